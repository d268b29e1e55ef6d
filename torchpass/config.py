"""Typed configuration loading shared by every torchpass program.

Each program has one frozen dataclass of settings. ``load`` builds it in a
fixed order of precedence, later sources winning:

    dataclass defaults -> TOML file -> environment (PREFIX_FIELD) -> flags

Unknown keys in the file are an error naming the key (a typo must not
silently fall back to a default); so are values of the wrong type, in the
file and in the environment alike. Nested tables map to nested dataclasses.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from pathlib import Path
from typing import Any, TypeVar

from torchpass.errors import ConfigError

T = TypeVar("T")


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(where: str, tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(where, arg, value)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: invalid value {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, got {type(value).__name__}")
        return _build(tp, value, where)
    if origin in (list, tuple):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        item = args[0] if args else Any
        items = [_coerce(f"{where}[{i}]", item, v) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, got {type(value).__name__}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip(), 10)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    if tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
        raise ConfigError(f"{where}: expected a path, got {value!r}")
    raise ConfigError(f"{where}: unsupported setting type {tp!r}")


def _build(cls: type[T], values: dict[str, Any], where: str) -> T:
    types = _field_types(cls)
    unknown = sorted(set(values) - set(types))
    if unknown:
        prefix = f"{where}: " if where else ""
        raise ConfigError(
            f"{prefix}unknown key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(types))}"
        )
    kwargs = {}
    for name, value in values.items():
        kwargs[name] = _coerce(f"{where}.{name}" if where else name, types[name], value)
    try:
        obj = cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where or cls.__name__}: {exc}") from None
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj


def merge(base: Any, overrides: dict[str, Any], where: str = "") -> Any:
    """A copy of dataclass ``base`` with ``overrides`` (nested dicts for tables) applied."""
    types = _field_types(type(base))
    unknown = sorted(set(overrides) - set(types))
    if unknown:
        raise ConfigError(
            f"{where + ': ' if where else ''}unknown key(s) {', '.join(unknown)}; "
            f"known keys: {', '.join(sorted(types))}"
        )
    changes = {}
    for name, value in overrides.items():
        path = f"{where}.{name}" if where else name
        current = getattr(base, name)
        if dataclasses.is_dataclass(current) and isinstance(value, dict):
            changes[name] = merge(current, value, path)
        else:
            changes[name] = _coerce(path, types[name], value)
    obj = dataclasses.replace(base, **changes)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except PermissionError:
        raise ConfigError(f"config file {path} is not readable by this user") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def env_overrides(cls: type, prefix: str, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Top-level scalar settings from ``PREFIX_NAME`` environment variables."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}_{f.name.upper()}"
        if key in environ:
            out[f.name] = environ[key]
    return out


def load(
    cls: type[T],
    *,
    path: Path | None = None,
    env_prefix: str | None = None,
    flags: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
    required_file: bool = False,
) -> T:
    """defaults -> file -> environment -> flags; see the module docstring."""
    obj = cls()
    if path is not None and (required_file or Path(path).exists()):
        obj = merge(obj, read_toml(Path(path)), where=str(path))
    if env_prefix:
        obj = merge(obj, env_overrides(cls, env_prefix, environ), where="environment")
    if flags:
        obj = merge(obj, {k: v for k, v in flags.items() if v is not None}, where="flags")
    return obj
