"""Where every node's tpassd listens, read from tpassd's own configuration.

tpassd binds the ports of its config file (``/etc/torchpass/tpassd.toml``,
overridden by ``TPASSD_PUB_PORT``-style environment variables; defaults in
torchpass/ports.py). Whoever calls the tpassds (the job's coordinator,
``tpassctl``) reads the same file and the same variables, so a site that
moves a port changes it in one place, the file every node already has.
``$TORCHPASS_TPASSD_CONFIG`` names another file, for tpassd and its callers
alike (the devcluster, a test).

Only the port keys are read here; tpassd itself checks the whole file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from torchpass import config as tconfig
from torchpass import envnames
from torchpass.errors import ConfigError
from torchpass.ports import TPASSD_CONTROL_PORT, TPASSD_METRICS_PORT, TPASSD_PUB_PORT

DEFAULT_TPASSD_CONFIG = Path("/etc/torchpass/tpassd.toml")
CONFIG_ENV = envnames.TPASSD_CONFIG
ENV_PREFIX = "TPASSD"  # tpassd's own TPASSD_<KEY> overrides


@dataclass(frozen=True)
class TpassdPorts:
    pub_port: int = TPASSD_PUB_PORT
    control_port: int = TPASSD_CONTROL_PORT
    metrics_port: int = TPASSD_METRICS_PORT  # -1: tpassd serves no metrics

    def validate(self) -> None:
        for name in ("pub_port", "control_port"):
            v = getattr(self, name)
            if not 1 <= v <= 65535:
                raise ConfigError(f"tpassd's {name} must be 1..65535 for other nodes to reach it, got {v} "
                                  "(0, an ephemeral port, is for tests with a ports_file)")
        if not (self.metrics_port == -1 or 1 <= self.metrics_port <= 65535):
            raise ConfigError(f"tpassd's metrics_port must be -1 (off) or 1..65535, got {self.metrics_port}")


def tpassd_config_path(environ: dict[str, str] | None = None) -> Path:
    """tpassd's config file: ``$TORCHPASS_TPASSD_CONFIG``, else /etc/torchpass/tpassd.toml."""
    environ = os.environ if environ is None else environ
    return Path(environ.get(CONFIG_ENV) or DEFAULT_TPASSD_CONFIG)


def tpassd_ports(path: Path | None = None, environ: dict[str, str] | None = None) -> TpassdPorts:
    """The ports tpassd binds by this node's configuration: defaults -> file -> TPASSD_* environment.
    A missing file means the defaults (as for tpassd); an unreadable or invalid one is a ConfigError."""
    path = Path(path) if path is not None else tpassd_config_path(environ)
    keys = {f for f in TpassdPorts.__dataclass_fields__}
    ports = TpassdPorts()
    if path.exists():
        ports = tconfig.merge(ports, {k: v for k, v in tconfig.read_toml(path).items() if k in keys}, where=str(path))
    # merge() validates the result: a caller never gets port 0
    return tconfig.merge(ports, tconfig.env_overrides(TpassdPorts, ENV_PREFIX, environ), where="environment")


__all__ = ["CONFIG_ENV", "DEFAULT_TPASSD_CONFIG", "TpassdPorts", "tpassd_config_path", "tpassd_ports"]
