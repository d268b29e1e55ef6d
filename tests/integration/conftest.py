"""Integration fixtures: a real local Slurm cluster for the whole session.

The cluster's name and subnet come from TORCHPASS_TEST_CLUSTER and
TORCHPASS_TEST_SUBNET (defaults "t" and 10.78.0, apart from the demo's
10.77.0) so that a developer's own devcluster keeps running beside the tests.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from torchpass.devcluster import Devcluster, DevclusterSpec
from torchpass.devcluster.cluster import REPO_ROOT

pytestmark = pytest.mark.integration


def _preflight() -> None:
    if os.geteuid() != 0:
        pytest.fail("integration tests need root (network namespaces, slurmd); run 'make test' as root",
                    pytrace=False)


@pytest.fixture(scope="session")
def plugin_built() -> Path:
    """Tests of --torchpass jobs need the SPANK plugin; 'make test' builds it first."""
    plugin = REPO_ROOT / "slurm_spank" / "torchpass.so"
    if not plugin.exists():
        pytest.fail(f"{plugin} is not built; 'make test' builds it (make -C slurm_spank)", pytrace=False)
    return plugin


@pytest.fixture(scope="session")
def cluster():
    """The session's devcluster. Bring-up writes plugstack.conf, so a
    plugin built after this point is not loaded: build it first."""
    _preflight()
    spec = DevclusterSpec(
        name=os.environ.get("TORCHPASS_TEST_CLUSTER", "t"),
        subnet=os.environ.get("TORCHPASS_TEST_SUBNET", "10.78.0"),
        nodes=4,
        tpassd=os.environ.get("TORCHPASS_TEST_NO_TPASSD") != "1",
    )
    c = Devcluster.up(spec)
    saved = {k: os.environ.get(k) for k in c.env()}
    os.environ.update(c.env())
    try:
        yield c
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        c.down()
        leftover = [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
                    if ns.startswith(f"tp-{spec.name}-")]
        assert not leftover, f"devcluster left namespaces behind: {leftover}"


@pytest.fixture
def job_dir(tmp_path_factory) -> Path:
    """A directory every node can read and write (one machine: a shared fs)."""
    d = tmp_path_factory.mktemp("job")
    d.chmod(0o777)
    return d
