"""slurmctld away for 3 minutes: the job trains on and moves its node after.

``sbatch -N4 --torchpass=spares=1,policy=tpoutage-c`` of examples/train_ddp.py
(3 gloo DDP ranks on node1..node3, hot spare node4), submitted as the job user.
slurmctld is stopped for 3 minutes (its pid, from the devcluster's pid file),
with a degraded node meanwhile: the job trains on, the coordinator stays
alive, records ``slurm.unavailable``, moves nothing while slurmctld is away,
records ``slurm.available`` when it is back, and then moves the node.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

import drill
import training_jobs as tj
from conftest import site_policy
from slurm_helpers import job_id_of, job_python, sbatch, submit_env
from support.wait import until
from torchpass import layout
from torchpass.errors import SlurmError
from torchpass.ports import TPASSD_CONTROL_PORT
from torchpass.slurm.cli import CliSlurmClient
from training_jobs import TPASSCTL

pytestmark = pytest.mark.integration

POLICY = "tpoutage-c"  # a file name no other test uses (/etc/torchpass/policies is global)
D = 20  # hold_deadline_s
LOST_S = 10  # TORCHPASS_COORDINATOR_LOST_S
STEPS = 150
NODES = ("node1", "node2", "node3", "node4")
MOVED, RANK, SPARE = "node2", 1, "node4"
OUTAGE_S = int(os.environ.get("TORCHPASS_TEST_OUTAGE_S", "180"))  # the 3 minutes; shorter to debug


@pytest.fixture(scope="module")
def policy():
    with site_policy(POLICY, f"hold_deadline_s = {D}.0\nrebuild_timeout_s = 60.0\n") as name:
        yield name


def _submit(job_dir: Path, tag: str, user: str, steps: int = STEPS, sleep: float = 0.05) -> int:
    strict = {k: v for k, v in os.environ.items() if k == "TORCHPASS_STRICT_TRANSITIONS"}
    proc = sbatch(["-N4", "--ntasks-per-node=1", f"--torchpass=spares=1,policy={POLICY}",
                   "-o", str(job_dir / f"{tag}.%j.out")],
                  "#!/bin/bash\n"
                  f"export TORCHPASS_COORDINATOR_LOST_S={LOST_S}\n"
                  f"srun {job_python()} {tj.train_script(job_dir)} --steps {steps} --params 1M --sleep {sleep}\n",
                  cwd=job_dir, user=user, env={**submit_env(user), **strict})
    return job_id_of(proc)


def _last_step(out: Path) -> int:
    lines = tj.steps(out.read_text()) if out.exists() else []
    return int(lines[-1].split()[0].split("=")[1]) if lines else -1


def _coordinator_pid(cluster, job_id: int) -> int:
    path = layout.coordinator_json(cluster.state_dir, job_id)
    until(path.exists, f"job {job_id}'s coordinator registration", 60, every=0.1)
    return int(json.loads(path.read_text())["pid"])


def _diag(cluster, job_id: int, out: Path) -> str:
    return drill.diagnosis(cluster, job_id, out, f"job {job_id}")


@pytest.fixture
def clean(cluster):
    """No job of ours left, no drill armed, no torchpass drain, every node idle again."""
    jobs: list[int] = []
    yield jobs
    tj.leave_idle(jobs, NODES)


def test_slurmctld_away_for_3_minutes_the_job_trains_and_moves_after(cluster, plugin_built, policy, job_dir,
                                                                     job_user, clean):
    # Long enough to train through the outage and the move after it; cancelled once seen.
    job_id = _submit(job_dir, "outage", job_user.name, steps=5000, sleep=0.1)
    clean.append(job_id)
    out = job_dir / f"outage.{job_id}.out"
    coord = _coordinator_pid(cluster, job_id)
    until(lambda: _last_step(out) >= 5, "step 5", 120, every=0.1)
    ctld_pidfile = cluster.run_dir / "ctld" / "slurmctld.pid"
    ctld = int(ctld_pidfile.read_text().split()[0])
    os.kill(ctld, signal.SIGTERM)
    until(lambda: not tj.alive(ctld), "slurmctld's exit", 60, every=0.1)
    t0, step0 = time.monotonic(), _last_step(out)
    try:
        try:
            until(lambda: [e for e in drill.events(cluster, job_id) if e["kind"] == "slurm.unavailable"],
                  "event slurm.unavailable", 60, every=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_diag(cluster, job_id, out)}") from None
        # A node degrades meanwhile (a pending row remap: it stays so until cleared, unlike an ECC
        # storm, which ends with its window): nothing moves while slurmctld is away.
        # (tpassctl finds tpassd's address from slurmctld: named here instead)
        tpassd = f"{MOVED}=tcp://{cluster.node_address(MOVED)}:{TPASSD_CONTROL_PORT}"
        inj = tj.run([*TPASSCTL, "inject", "--node", MOVED, "--fault", "row-remap-pending",
                      "--endpoint", tpassd])
        assert inj.returncode == 0, inj.stderr
        # The coordinator's own question, asked here too: slurmctld away is an error, never "no such
        # job" (scontrol --json answers both alike; most likely why a coordinator exited in CI).
        slurm = CliSlurmClient(environ={**os.environ, **cluster.env()})
        with pytest.raises(SlurmError):
            slurm.job(job_id)
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - t0)))
        step1 = _last_step(out)
        kinds = [e["kind"] for e in drill.events(cluster, job_id)]
        assert tj.alive(coord), _diag(cluster, job_id, out)
        assert "migration.started" not in kinds, _diag(cluster, job_id, out)
    finally:
        cluster._start_slurmctld()  # the devcluster's own start: same flags, pid recorded for down()
    assert step1 > step0 + 100, (step0, step1, _diag(cluster, job_id, out))  # trained on throughout
    try:
        until(lambda: [e for e in drill.events(cluster, job_id) if e["kind"] == "slurm.available"],
              "event slurm.available", 60, every=0.5)
        until(lambda: [e for e in drill.events(cluster, job_id) if e["kind"] == "migration.completed"],
              "the move after slurmctld came back", 120, every=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_diag(cluster, job_id, out)}") from None
    events = drill.events(cluster, job_id)
    kinds = [e["kind"] for e in events]
    assert kinds.index("slurm.unavailable") < kinds.index("slurm.available") < kinds.index("migration.started"), kinds
    assert slurm.job(job_id) is not None and slurm.job(job_id + 100_000) is None  # slurmctld back: it knows
    unavailable = next(e for e in events if e["kind"] == "slurm.unavailable")
    assert "no migration starts until it answers" in unavailable["message"], unavailable
    done = next(e for e in events if e["kind"] == "migration.completed")
    assert done["data"]["node"] == MOVED and done["data"]["target"] == SPARE, done
    assert tj.alive(coord)
    step2 = _last_step(out)
    until(lambda: _last_step(out) > step2 + 5, "training after the move", 60, every=0.2)
    print(f"\nslurmctld away {OUTAGE_S} s: steps {step0} -> {step1}; moved {MOVED} -> {SPARE} after it came back")
