"""What every tpassctl command shares: the state directory (and where it came from) and --verbose.

The state directory is where coordinators register (STATE_DIR/jobs/J), shared
by every node. It is, in this order: ``--state-dir`` (before or after the
subcommand), ``$TORCHPASS_STATE_DIR``, ``state_dir`` in tpassd's config file
(``$TORCHPASS_TPASSD_CONFIG``, else /etc/torchpass/tpassd.toml: a login node
that carries the compute nodes' file needs no flag), and /var/lib/torchpass.
It is resolved on first use, so a command that needs none (goodput,
devcluster) never reads tpassd's file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import click

from torchpass import config as tconfig
from torchpass import envnames
from torchpass.errors import ConfigError
from torchpass.tpassd_ports import tpassd_config_path
from tpassctl.exit_codes import CliError

DEFAULT_STATE_DIR = Path("/var/lib/torchpass")
STATE_DIR_KEY = "state_dir"  # the key in tpassd.toml (tpassd.config.TpassdConfig.state_dir)


def resolve_state_dir(flag: Path | None, environ: dict[str, str] | None = None) -> tuple[Path, str]:
    """(state directory, where it came from): flag > environment > tpassd.toml > default."""
    environ = os.environ if environ is None else environ
    if flag is not None:
        return Path(flag), "--state-dir"
    if environ.get(envnames.STATE_DIR):
        return Path(environ[envnames.STATE_DIR]), envnames.STATE_DIR
    path = tpassd_config_path(environ)
    if path.exists():
        try:
            value = tconfig.read_toml(path).get(STATE_DIR_KEY)
        except ConfigError as exc:
            raise CliError(f"{exc}; pass --state-dir or set {envnames.STATE_DIR}", "usage") from None
        if value is not None:
            if not isinstance(value, str) or not os.path.isabs(value):
                raise CliError(f"{path}: {STATE_DIR_KEY} must be an absolute path, got {value!r}; "
                               f"pass --state-dir or set {envnames.STATE_DIR}", "usage")
            return Path(value), str(path)
    return DEFAULT_STATE_DIR, "default"


@dataclass
class CliContext:
    verbose: bool = False
    state_dir_flag: Path | None = None
    environ: dict[str, str] | None = None
    _resolved: tuple[Path, str] | None = field(default=None, repr=False)

    @property
    def state_dir(self) -> Path:
        return self._state()[0]

    @property
    def state_dir_source(self) -> str:
        return self._state()[1]

    def _state(self) -> tuple[Path, str]:
        if self._resolved is None:
            self._resolved = resolve_state_dir(self.state_dir_flag, self.environ)
        return self._resolved

    def set_state_dir(self, flag: Path) -> None:
        self.state_dir_flag, self._resolved = Path(flag), None


STATE_DIR_HELP = ("Shared torchpass state directory (where coordinators register) [default: $TORCHPASS_STATE_DIR, "
                  "else state_dir of /etc/torchpass/tpassd.toml, else /var/lib/torchpass].")


def _take_state_dir(ctx: click.Context, _param: click.Parameter, value: Path | None) -> None:
    if value is not None:
        ctx.ensure_object(CliContext).set_state_dir(value)


def state_dir_option(fn):
    """``--state-dir`` after the subcommand, as well as before it (the group's): the later one wins."""
    return click.option("--state-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
                        expose_value=False, is_eager=True, callback=_take_state_dir, help=STATE_DIR_HELP)(fn)


__all__ = ["DEFAULT_STATE_DIR", "CliContext", "resolve_state_dir", "state_dir_option"]
