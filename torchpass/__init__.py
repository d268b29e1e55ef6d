"""torchpass: workload fault tolerance for distributed PyTorch training on Slurm.

The base package holds what every component shares: the exception hierarchy,
logging set-up, the one wire schema, the ZeroMQ helpers and typed configs.
It must never import torch (tpassd and tpassctl run without it).
"""

import re as _re
from importlib import metadata as _metadata
from pathlib import Path as _Path


def _version() -> str:
    """pyproject.toml's version, the one every program and the SPANK plugin report: the checkout's
    own when this package is imported from one (an installed older torchpass on sys.path must not
    answer for it), else the installed distribution's."""
    pyproject = _Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        found = _re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), _re.MULTILINE)
    except OSError:
        found = None
    if found:
        return found.group(1)
    try:
        return _metadata.version("torchpass")
    except _metadata.PackageNotFoundError:
        return "0+unknown"


__version__ = _version()
