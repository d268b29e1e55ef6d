"""One Slurm client interface, two backends.

* ``cli`` (default): the Slurm commands with ``--json`` (scontrol, squeue,
  sinfo). Works with every recent release.
* ``pyslurm``: only where the installed pyslurm matches the cluster's Slurm
  version (PyPI builds it for Slurm 25.11 only); otherwise refused.

``client()`` picks the backend once, from ``TORCHPASS_SLURM_BACKEND``
(``cli``/``pyslurm``/``auto``), and logs the choice.
"""

from __future__ import annotations

import os

import structlog

from torchpass import envnames
from torchpass.errors import ConfigError
from torchpass.slurm.base import JobInfo, NodeInfo, SlurmClient, SpareRequest, StepInfo, overlap_step_argv
from torchpass.slurm.cli import CliSlurmClient

log = structlog.get_logger("torchpass.slurm")

__all__ = ["JobInfo", "NodeInfo", "SpareRequest", "StepInfo", "SlurmClient", "CliSlurmClient", "client",
           "overlap_step_argv"]


def client(backend: str | None = None, environ: dict[str, str] | None = None) -> SlurmClient:
    environ = os.environ if environ is None else environ
    backend = backend or environ.get(envnames.SLURM_BACKEND, "cli")
    if backend == "cli":
        chosen: SlurmClient = CliSlurmClient(environ=environ)
    elif backend in ("pyslurm", "auto"):
        from torchpass.slurm.pyslurm_backend import PyslurmClient, pyslurm_matches

        ok, why = pyslurm_matches()
        if ok:
            chosen = PyslurmClient(environ=environ)
        elif backend == "auto":
            log.info("pyslurm backend not usable, using the CLI backend", reason=why)
            chosen = CliSlurmClient(environ=environ)
        else:
            raise ConfigError(f"{envnames.SLURM_BACKEND}=pyslurm: {why}; use 'cli'")
    else:
        raise ConfigError(
            f"{envnames.SLURM_BACKEND}={backend!r} is not one of cli, pyslurm, auto"
        )
    log.debug("slurm backend chosen", backend=chosen.name)
    return chosen
