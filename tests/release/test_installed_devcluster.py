"""One devcluster job on the installed release: the plugin and tpass-init from `make install`, every
program (tpassd, tpass-coordinator, tpass-rankwrap, tpass-restore-agent, tpassctl) and the runtime
from the wheel's venv. An ordinary user's 2-rank job trains, is moved by a planned `tpassctl migrate`
(the check docs/admin.md asks of a real cluster), and ends COMPLETED. Without tpass-init beside the
plugin no rank of an ordinary user gets its PID namespace: each says "unprotected" and none moves.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import torchpass
import training_jobs as tj
from slurm_helpers import submit_env
from torchpass import layout
from torchpass.devcluster import Devcluster, DevclusterSpec

pytestmark = pytest.mark.cluster

BIN = Path(sys.executable).parent
USER = "tpuser1"


def cluster_name_and_subnet() -> tuple[str, str]:
    """Beside the cluster tier's clusters (NAME0, NAME1 on the subnet's third octet +0, +1): NAME's
    release cluster on +5."""
    name = os.environ.get("TORCHPASS_TEST_CLUSTER", "t")
    a, b, c = os.environ.get("TORCHPASS_TEST_SUBNET", "10.78.0").split(".")
    return f"{name[:7]}r", f"{a}.{b}.{int(c) + 5}"


@pytest.fixture(scope="module")
def cluster(plugin_dir):
    name, subnet = cluster_name_and_subnet()
    spec = DevclusterSpec(name=name, subnet=subnet, nodes=3, plugin=plugin_dir / "torchpass.so",
                          job_python=BIN / "python")
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


def _events(cluster, job_id: int) -> list[dict]:
    try:
        return json.loads(layout.events_json(cluster.state_dir, job_id).read_text())
    except (OSError, ValueError):
        return []


def _wait(pred, timeout_s: float, what: str, diag):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if got := pred():
            return got
        time.sleep(0.2)
    raise AssertionError(f"{what} not within {timeout_s:g} s\n{diag()}")


def test_an_ordinary_users_job_trains_moves_and_completes_on_the_installed_release(cluster, tmp_path_factory):
    plugstack = (cluster.run_dir / "etc" / "plugstack.conf").read_text()
    assert f"coordinator={BIN / 'tpass-coordinator'}" in plugstack and f"rank_wrapper={BIN / 'tpass-rankwrap'}" \
        in plugstack, plugstack
    assert f"runtime_path={Path(torchpass.__file__).parent / 'runtime' / 'boot'}" in plugstack, plugstack

    pw = pwd.getpwnam(USER)
    job_dir = Path("/tmp") / f"torchpass-release-{cluster.spec.name}"
    shutil.rmtree(job_dir, ignore_errors=True)
    job_dir.mkdir(mode=0o755)
    os.chown(job_dir, pw.pw_uid, pw.pw_gid)
    job_id = tj.submit(job_dir, "release", 120, nodes=3, user=USER)
    out = job_dir / f"release.{job_id}.out"

    def diag() -> str:
        log = layout.coordinator_log(cluster.state_dir, job_id)
        return ((out.read_text()[-2000:] if out.exists() else "no output") + "\n--- events ---\n"
                + "\n".join(f"{e['kind']}: {e['message']}" for e in _events(cluster, job_id))
                + "\n--- coordinator.log ---\n" + (log.read_text()[-2000:] if log.exists() else ""))

    try:
        _wait(lambda: out.exists() and "step=3 " in out.read_text(), 120, "step 3", diag)
        # each rank got its PID namespace from the installed tpass-init, or says it runs unprotected
        assert "unprotected" not in out.read_text(), diag()
        record = layout.rank_record(layout.rank_records_dir(cluster.state_dir, job_id), job_id, 1)
        source = _wait(lambda: record.exists() and json.loads(record.read_text())["node"], 30, "rank 1's record",
                       diag)
        # the job's owner asks for the move with the installed tpassctl, as a user on a login node would
        env = {**submit_env(USER), **{k: v for k, v in os.environ.items() if k.startswith("TORCHPASS_")}}
        asked = subprocess.run(["runuser", "-u", USER, "--", str(BIN / "tpassctl"), "migrate", str(job_id),
                                "--node", source], capture_output=True, text=True, timeout=60, env=env, cwd="/")
        assert asked.returncode == 0, asked.stdout + asked.stderr + diag()
        ends = ("migration.completed", "migration.rolled_back", "migration.aborted", "migration.abandoned",
                "migration.cancelled", "migration.rejected", "migration.skipped")
        done = _wait(lambda: [e for e in _events(cluster, job_id) if e["kind"] in ends], 150,
                     "the migration's end", diag)
        assert done[0]["kind"] == "migration.completed", diag()
        final = tj.wait_end(job_id, 180)
        assert final["job_state"][0] == "COMPLETED", diag()
        text = out.read_text()
        assert "unprotected" not in text, diag()
        assert len(tj.steps(text)) == 2 * 120, diag()
        # slurmd said, once at its start, which release of the plugin it loaded and for which Slurm
        slurmd_log = (cluster.run_dir / "log" / "slurmd.node1.log").read_text(errors="replace")
        assert slurmd_log.count(f"tpass: torchpass {torchpass.__version__}, built for Slurm ") == 1, slurmd_log[-3000:]
    finally:
        subprocess.run(["scancel", str(job_id)], capture_output=True, timeout=30)
