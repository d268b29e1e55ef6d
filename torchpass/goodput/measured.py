"""torchpass's own measured detection and migration times, for `--measured`.

The benchmarks write a machine-readable results file (bench/results/*.json);
docs/benchmarks.md may carry the same figures in a fenced block tagged
``json torchpass-measured``. Both use one JSON shape (docs/goodput.md,
"Measured inputs"):

    {
      "detection_latency_s": {"mean": 2.1, "p50": 1.9, "p95": 3.4, "n": 20},
      "migration_pause_s":   {"mean": 6.6, "p50": 6.5, "p95": 7.1, "n": 20},
      "steady_state_overhead": {"mean": 0.004}
    }

Each figure is an object of statistics or a bare number. The model needs
expected values, so ``mean`` is used, else ``p50``. bench_hard_failure adds
``hard_failure_relaunch_s`` (a node lost outright to training resumed from the
newest checkpoint: ``lm_relaunch_s``), bench_app_checkpoint
``checkpoint_blocking_s`` (how long one torchpass.checkpoint save blocks
training: ``lm_checkpoint_save_s``). Any of the keys may be missing; a file
with none of them is not a results file for this purpose.

``gpu_killed`` (bench_hard_failure's GPU killed under a rank on a live node to
every rank training again: ``lm_gpu_killed_s``) is a figure, or an object
whose ``resumed_s`` is one; it may also sit in the file's ``summary``.

Four of the figures grow with the model, whose state is copied, moved or
loaded: the migration pause, the save's blocking time, the relaunch and the
GPU-killed recovery (both load a restore point). Benchmarks run on a CPU
devcluster with small models, so these are applied only to a model size
inside the sizes they were measured at (``by_model``'s keys, else the figure's
or the file's ``model`` or ``params``); otherwise, or with no model size, they
are not applied and ``not_applied`` says why. Inside the range, a figure with
``by_model`` (``"by_model": {"10M": 1.2, "100M": 7.6}``) is the one measured
for that size, else for the nearest measured size (by ratio); a note says
which. Detection latency and steady-state overhead do not grow with the model
and always apply.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchpass.errors import ConfigError

# results key -> goodput input it sets
MEASURED_KEYS = {
    "detection_latency_s": "lm_detect_s",
    "migration_pause_s": "lm_migrate_s",
    "steady_state_overhead": "lm_overhead",
    "hard_failure_relaunch_s": "lm_relaunch_s",
    "checkpoint_blocking_s": "lm_checkpoint_save_s",
    "gpu_killed": "lm_gpu_killed_s",
}
# The figures that grow with the model's state (copied, moved or loaded).
SIZE_DEPENDENT_KEYS = ("migration_pause_s", "checkpoint_blocking_s", "hard_failure_relaunch_s", "gpu_killed")
STATISTICS = ("mean", "p50")
PAUSE_KEY = "migration_pause_s"
# The figures that grow with the model, measured per size ("by_model"), and what each is called in notes.
BY_MODEL_KEYS = {
    PAUSE_KEY: ("migration pause", "the pause grows with the model's memory"),
    "checkpoint_blocking_s": ("torchpass.checkpoint save blocking", "the copy to host memory grows with the state"),
}
RESULTS_GLOB = "bench/results/*.json"
BENCHMARKS_DOC = "docs/benchmarks.md"
_FENCE = re.compile(r"^```json[ \t]+torchpass-measured[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([kmbt]?)", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


@dataclass(frozen=True)
class Measured:
    source: str
    values: dict[str, float]  # goodput input name -> value
    statistics: dict[str, str]  # goodput input name -> "mean" | "p50" | "value"
    # goodput input name -> the file it came from, where figures were merged
    # from several results files (empty: all from ``source``)
    sources: dict[str, str] = field(default_factory=dict)
    # what the user should know about the figures chosen (the model size a pause is from)
    notes: tuple[str, ...] = ()
    # goodput input name -> the model sizes its figure was measured at, where it was not applied
    # because the model asked about is outside them (or not given)
    not_applied: dict[str, str] = field(default_factory=dict)

    def source_of(self, name: str) -> str:
        return self.sources.get(name, self.source)


def _figure(where: str, key: str, raw: Any) -> tuple[float, str]:
    if isinstance(raw, dict):
        for stat in STATISTICS:
            if stat in raw:
                value, used = raw[stat], stat
                break
        else:
            raise ConfigError(f"{where}: {key} has neither 'mean' nor 'p50'")
    else:
        value, used = raw, "value"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{where}: {key} must be a finite number >= 0, got {value!r}")
    if key == "steady_state_overhead" and value >= 1:
        raise ConfigError(f"{where}: {key} is a fraction of step time and must be < 1, got {value!r}")
    return float(value), used


def model_params(size: str) -> float:
    """Parameters in a model size such as ``10M``, ``1.3B``, ``70b`` or ``125000000``."""
    m = _SIZE.fullmatch(str(size).strip())
    value = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()] if m else 0.0
    if value <= 0:
        raise ConfigError(f"model size {size!r} is not a parameter count such as 10M, 1.3B or 70B")
    return value


def nearest_size(wanted: str, measured: list[str]) -> str:
    """The measured size nearest ``wanted`` by ratio (ties: the larger, whose pause is longer)."""
    w = math.log(model_params(wanted))
    return min(measured, key=lambda s: (abs(math.log(model_params(s)) - w), -model_params(s)))


def _for_size(where: str, key: str, raw: Any, model_size: str) -> tuple[float, str, str]:
    """(figure, statistic, note) from ``key``'s ``by_model`` for ``model_size`` (a BY_MODEL_KEYS key
    whose figure has a non-empty ``by_model``; ``model_size`` inside its sizes)."""
    what, why = BY_MODEL_KEYS[key]
    by_model = raw["by_model"]
    for size in by_model:
        model_params(size)  # a bad key is named, not skipped
    chosen = nearest_size(model_size, list(by_model))
    value, used = _figure(where, f"{key}.by_model.{chosen}", by_model[chosen])
    sizes = ", ".join(sorted(by_model, key=model_params))
    if model_params(chosen) == model_params(model_size):
        return value, used, f"{what} {value:g} s measured with the {chosen} model (measured: {sizes})"
    return value, used, (f"{what} {value:g} s from the {chosen} model, the measured size nearest "
                         f"{model_size} (measured: {sizes}); {why}")


def _raw_figure(data: dict[str, Any], key: str) -> Any:
    """The figure under ``key``; ``gpu_killed`` may sit in ``summary`` and carry ``resumed_s``."""
    raw = data.get(key)
    if raw is None and key == "gpu_killed" and isinstance(data.get("summary"), dict):
        raw = data["summary"].get(key)
    if key == "gpu_killed" and isinstance(raw, dict) and "resumed_s" in raw:
        raw = raw["resumed_s"]
    return raw


def measured_sizes(data: dict[str, Any], key: str) -> list[str]:
    """The model sizes ``key``'s figure was measured at: its by_model, else its or the file's model."""
    raw = data.get(key)
    if isinstance(raw, dict) and isinstance(raw.get("by_model"), dict) and raw["by_model"]:
        sizes = list(raw["by_model"])
    else:
        of = (raw.get("model") if isinstance(raw, dict) else None) or data.get("model") or data.get("params")
        sizes = [str(of)] if of is not None else []
    for size in sizes:
        model_params(size)  # a bad size is named, not skipped
    return sorted(sizes, key=model_params)


def _check(where: str, key: str, raw: Any) -> None:
    """Refuse a bad figure even where it is not applied: a typo is an error, not "out of range"."""
    by_model = raw.get("by_model") if isinstance(raw, dict) else None
    if isinstance(by_model, dict):
        for size, figure in by_model.items():
            _figure(where, f"{key}.by_model.{size}", figure)
    if not isinstance(by_model, dict) or any(stat in raw for stat in STATISTICS):
        _figure(where, key, raw)


def _size_range(sizes: list[str]) -> str:
    if not sizes:
        return "an unstated model size"
    return sizes[0] if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"


def parse(data: Any, where: str, model_size: str | None = None) -> Measured | None:
    """The figures in one results object; None if it has none of the keys.

    ``model_size``: the model the question is about. A figure that grows with the model is applied
    only inside the sizes it was measured at; with ``by_model``, the one for that size or the nearest.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
    present = [k for k in MEASURED_KEYS if _raw_figure(data, k) is not None]
    if not present:
        return None
    values: dict[str, float] = {}
    stats: dict[str, str] = {}
    notes: list[str] = []
    not_applied: dict[str, str] = {}
    for key in present:
        raw = _raw_figure(data, key)
        name = MEASURED_KEYS[key]
        if key in SIZE_DEPENDENT_KEYS:
            sizes = measured_sizes(data, key)
            _check(where, key, raw)
            inside = (model_size is not None and sizes
                      and model_params(sizes[0]) <= model_params(model_size) <= model_params(sizes[-1]))
            if not inside:
                not_applied[name] = _size_range(sizes)
                continue
            if key in BY_MODEL_KEYS and isinstance(raw, dict) and isinstance(raw.get("by_model"), dict) \
                    and raw["by_model"]:
                value, used, note = _for_size(where, key, raw, model_size)
                notes.append(note)
            else:
                value, used = _figure(where, key, raw)
        else:
            value, used = _figure(where, key, raw)
        values[name] = value
        stats[name] = used
    return Measured(source=where, values=values, statistics=stats, notes=tuple(notes), not_applied=not_applied)


def not_applied_line(found: Measured, model_size: str | None, size_from: str | None) -> str | None:
    """One line naming the measured inputs kept at their earlier value, and why; None if none."""
    if not found.not_applied:
        return None
    which = ", ".join(f"{name} (measured at {sizes})" for name, sizes in found.not_applied.items())
    model = (f"the model is {model_size} ({size_from})" if model_size
             else "no model size given (--model-size)")
    return (f"not applied: {which}; {model}, and these grow with the model's size, so each keeps its "
            "preset/config/default value (give --model-size inside a measured range, or measure at your size)")


def load_file(path: Path, model_size: str | None = None) -> Measured:
    """A results file the user named: missing keys are an error here."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read measured results {path}: {exc.strerror or exc}") from None
    if path.suffix == ".md":
        found = _from_markdown(text, str(path), model_size)
        if found is None:
            raise ConfigError(f"{path}: no ```json torchpass-measured block with measured figures")
        return found
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    found = parse(data, str(path), model_size)
    if found is None:
        raise ConfigError(f"{path} has none of the keys {', '.join(MEASURED_KEYS)}")
    return found


def _from_markdown(text: str, where: str, model_size: str | None = None) -> Measured | None:
    for block in _FENCE.findall(text):
        try:
            data = json.loads(block)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: the torchpass-measured block is not valid JSON: {exc}") from None
        found = parse(data, where, model_size)
        if found is not None:
            return found
    return None


def discover(root: Path, model_size: str | None = None) -> tuple[Measured | None, list[str]]:
    """The newest figure of each key under ``root``'s results, else docs/benchmarks.md; and where it looked.

    Each benchmark writes its own results file (bench_tpassd the detection
    latency, bench_migration the pause and the end-to-end detection), so each
    key is taken from the newest results file that has it: re-running one
    benchmark does not hide another's figures. Results files without the keys
    (other benchmarks) are skipped, not errors.
    """
    looked = [str(root / RESULTS_GLOB), str(root / BENCHMARKS_DOC)]
    files = sorted(root.glob(RESULTS_GLOB), key=lambda p: (p.stat().st_mtime, p.name), reverse=True)
    values: dict[str, float] = {}
    stats: dict[str, str] = {}
    sources: dict[str, str] = {}
    notes: dict[str, tuple[str, ...]] = {}  # source -> its notes
    refused: dict[str, str] = {}
    for path in files:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict):
            found = parse(data, str(path), model_size)
            if found is None:
                continue
            taken = False
            for name, value in found.values.items():
                if name not in values and name not in refused:
                    values[name], stats[name], sources[name] = value, found.statistics[name], found.source
                    taken = True
            for name, sizes in found.not_applied.items():
                if name not in values and name not in refused:
                    refused[name] = sizes
            if found.notes and taken:
                notes[found.source] = found.notes
    if values or refused:
        used = list(dict.fromkeys(sources.values())) or [str(root / RESULTS_GLOB)]  # newest first
        return Measured(source=", ".join(used), values=values, statistics=stats,
                        sources=sources if len(used) > 1 else {},
                        notes=tuple(n for s in used for n in notes.get(s, ())), not_applied=refused), looked
    doc = root / BENCHMARKS_DOC
    if doc.is_file():
        found = _from_markdown(doc.read_text(), str(doc), model_size)
        if found is not None:
            return found, looked
    return None, looked
