"""tests/release checks the release as an admin installs it, never the checkout: `make release-check`
runs them with the Python of a fresh venv holding the wheel of `make dist`, and the plugin and
tpass-init of `make -C slurm_spank install DESTDIR=...` (docs/admin.md, sections 1 and 2).

TORCHPASS_TEST_DIST_DIR names the directory of the sdist and wheel; TORCHPASS_TEST_INSTALL_ROOT
the DESTDIR the plugin went to (its files are in usr/lib/slurm below it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import torchpass

REPO = Path(__file__).resolve().parents[2]
# The devcluster job's helpers (sbatch as a user, the DDP example) are the integration tests'.
sys.path.insert(0, str(REPO / "tests" / "integration"))


def pytest_configure(config):
    where = Path(torchpass.__file__).resolve()
    if where.is_relative_to(REPO):
        raise pytest.UsageError(f"tests/release checks an installed wheel, but this Python imports torchpass from "
                                f"the checkout ({where}); run `make release-check`")


def _env_dir(name: str) -> Path:
    value = os.environ.get(name)
    if not value or not Path(value).is_dir():
        pytest.fail(f"{name} must name a directory (make release-check sets it), got {value!r}", pytrace=False)
    return Path(value)


@pytest.fixture(scope="session")
def dist_dir() -> Path:
    return _env_dir("TORCHPASS_TEST_DIST_DIR")


@pytest.fixture(scope="session")
def plugin_dir() -> Path:
    """Where `make -C slurm_spank install PREFIX=/usr DESTDIR=ROOT` put torchpass.so and tpass-init."""
    return _env_dir("TORCHPASS_TEST_INSTALL_ROOT") / "usr" / "lib" / "slurm"
