"""The coordinator comes back: ``kill -9`` of it between a move's dump and its restore.

``sbatch -N4 --torchpass=spares=1,policy=tpcoordloss-c`` of examples/train_ddp.py (3 gloo DDP
ranks on node1..node3, hot spare node4), submitted as the job user. The policy sets the paused
ranks' own deadline (``hold_deadline_s``) to D = 120 s: a rank that resumed only by falling back
on its own would do so far later than the restart, and would say so.

At a random step (the seed is printed: TORCHPASS_TEST_SEED replays it) ``tpassctl migrate`` moves
a random node's rank (node2 or node3; not rank 0's batch host) to node4. The coordinator is stopped
(SIGSTOP) the moment tpassd begins the dump (its directory appears), the dump completes without it
(its manifest appears), and the coordinator is killed with ``kill -9`` (the pid in the job's
registration): the move is between its dump and its restore. Then:

* its supervisor starts a new coordinator within seconds (a new pid in the registration, the event
  ``coordinator.restarted``), which rolls the move back (``migration.rolled_back``, recovered);
  every rank trains again well before D, none fell back on its own, no copy claimed the rank, and
  no rank noted ``coordinator.lost``;
* an ECC drill on the same node: the restarted coordinator moves it to node4
  (``migration.completed`` after ``coordinator.restarted``);
* the job ends COMPLETED 0:0 with the same id, Restarts=0, and the fault-free run's losses, bit for
  bit, every step once.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest

import drill
import training_jobs as tj
from conftest import site_policy
from slurm_helpers import job_id_of, job_python, sbatch, submit_env, tpassctl
from support.wait import until
from torchpass import coordinator_lost, layout
from training_jobs import TPASSCTL

pytestmark = pytest.mark.integration

POLICY = "tpcoordloss-c"  # a file name no other test uses (/etc/torchpass/policies is global)
D = 120  # hold_deadline_s
STEPS = 250
NODES = ("node1", "node2", "node3", "node4")
SPARE = "node4"
FELL_BACK = "no resume from the coordinator in"


@pytest.fixture(scope="module")
def policy():
    with site_policy(POLICY, f"hold_deadline_s = {D}.0\ncoordinator_restarts = 2\n") as name:
        yield name


def _submit(job_dir: Path, tag: str, user: str) -> int:
    strict = {k: v for k, v in os.environ.items() if k == "TORCHPASS_STRICT_TRANSITIONS"}
    proc = sbatch(["-N4", "--ntasks-per-node=1", f"--torchpass=spares=1,policy={POLICY}",
                   "-o", str(job_dir / f"{tag}.%j.out")],
                  "#!/bin/bash\n"
                  f"srun {job_python()} {tj.train_script(job_dir)} --steps {STEPS} --params 1M --sleep 0.05\n",
                  cwd=job_dir, user=user, env={**submit_env(user), **strict})
    return job_id_of(proc)


def _last_step(out: Path) -> int:
    lines = tj.steps(out.read_text()) if out.exists() else []
    return int(lines[-1].split()[0].split("=")[1]) if lines else -1


def _registration(cluster, job_id: int) -> dict:
    try:
        return json.loads(layout.coordinator_json(cluster.state_dir, job_id).read_text())
    except (OSError, ValueError):
        return {}


def _kinds(cluster, job_id: int, kind: str) -> list[dict]:
    return [e for e in drill.events(cluster, job_id) if e["kind"] == kind]


def _diag(cluster, job_id: int, out: Path) -> str:
    return drill.diagnosis(cluster, job_id, out, f"job {job_id}")


@pytest.fixture(scope="module")
def reference(cluster, plugin_built, jobs_base, job_user) -> dict:
    """The fault-free run (the policy changes nothing in a run without a fault), once per process:
    training_jobs.reference_run, shared with the other modules of train_ddp.py on 4 nodes."""
    return tj.reference_run(jobs_base, job_user, "coordloss", STEPS)


@pytest.fixture
def clean(cluster):
    """No job of ours left, no drill armed, no torchpass drain, every node idle again."""
    jobs: list[int] = []
    yield jobs
    tj.leave_idle(jobs, NODES)


def test_kill_9_of_the_coordinator_between_dump_and_restore_it_comes_back_and_moves_later(
        cluster, policy, reference, job_dir, job_user, clean):
    seed = int(os.environ.get("TORCHPASS_TEST_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    moved, at = rng.choice(("node2", "node3")), rng.randint(5, 40)
    rank = int(moved[-1]) - 1  # one task per node, in node order
    print(f"\nseed={seed} (replay with TORCHPASS_TEST_SEED={seed}): move {moved} (rank {rank}) at step {at}, "
          "kill -9 of the coordinator between its dump and its restore")
    job_id = _submit(job_dir, "kill", job_user.name)
    clean.append(job_id)
    out = job_dir / f"kill.{job_id}.out"
    until(lambda: _registration(cluster, job_id).get("pid"), "the coordinator's registration", 60, every=0.1)
    pid = int(_registration(cluster, job_id)["pid"])
    until(lambda: _last_step(out) >= at, f"step {at}", 120, every=0.1)  # every rank registered
    r = tpassctl("migrate", str(job_id), "--node", moved, "--to", SPARE, user=job_user.name)
    assert r.returncode == 0, (r.stdout, r.stderr)

    snapshots = layout.snapshot_job_dir(cluster.snapshot_dir, job_id)
    until(snapshots.exists, "the dump", 60, every=0.002)  # tpassd began it: the coordinator waits for its answer
    os.kill(pid, signal.SIGSTOP)
    until(lambda: list(snapshots.glob(f"rank{rank}.gen*/manifest.json")), "the dump's manifest", 60, every=0.05)
    os.kill(pid, signal.SIGKILL)
    killed_at, step_at_kill = time.monotonic(), _last_step(out)
    until(lambda: not tj.alive(pid), "the coordinator's end", 10, every=0.05)
    print(f"kill -9 of the coordinator (pid {pid}) after the dump: step {step_at_kill}")

    try:
        until(lambda: _registration(cluster, job_id).get("pid") not in (None, pid), "a restarted coordinator", 30,
               every=0.1)
        back_s = time.monotonic() - killed_at
        until(lambda: _kinds(cluster, job_id, "migration.rolled_back"), "the move's rollback", 30, every=0.2)
        until(lambda: _last_step(out) > step_at_kill + 1, "training after the kill", 60, every=0.1)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_diag(cluster, job_id, out)}") from None
    went_on = time.monotonic() - killed_at
    diag = _diag(cluster, job_id, out)
    new_pid = int(_registration(cluster, job_id)["pid"])
    assert tj.alive(new_pid), diag
    restarted = _kinds(cluster, job_id, "coordinator.restarted")
    assert len(restarted) == 1 and restarted[0]["data"]["recovery"] == "roll_back", diag
    assert "SIGKILL" in restarted[0]["message"], diag
    back = _kinds(cluster, job_id, "migration.rolled_back")
    assert len(back) == 1 and back[0]["data"].get("recovered") and back[0]["data"]["node"] == moved, diag
    assert went_on < D / 2, (went_on, diag)  # the restarted coordinator resumed them, not their own deadline
    text = out.read_text()
    assert FELL_BACK not in text, diag
    assert not list(layout.job_dir(cluster.state_dir, job_id).glob("hold/*.claim")), diag
    assert not coordinator_lost.path(cluster.state_dir, job_id).exists(), diag
    print(f"restarted coordinator pid {new_pid} listening {back_s:.1f} s after the kill; "
          f"every rank trained again {went_on:.1f} s after it")

    # A later fault: the restarted coordinator protects the job.
    inj = tj.run([*TPASSCTL, "inject", "--node", moved, "--fault", "ecc-sbe-storm"])
    assert inj.returncode == 0, inj.stderr
    try:
        until(lambda: _kinds(cluster, job_id, "migration.completed"), "the move after the drill", 120, every=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_diag(cluster, job_id, out)}") from None
    done = _kinds(cluster, job_id, "migration.completed")
    assert done[0]["seq"] > restarted[0]["seq"], _diag(cluster, job_id, out)
    assert done[0]["data"]["node"] == moved and done[0]["data"]["target"] == SPARE, done

    final = tj.wait_end(job_id, 300)
    text = out.read_text()
    diag = _diag(cluster, job_id, out)
    assert final["job_id"] == job_id, diag
    assert final["job_state"][0] == "COMPLETED" and final["exit_code"]["return_code"]["number"] == 0, diag
    assert int(final.get("restart_cnt", 0)) == 0, diag
    assert tj.per_step(tj.steps(text)) == reference["per_step"], diag  # bit-identical, every step once
    assert FELL_BACK not in text and "did not join" not in text, diag
    ev = tpassctl("events", str(job_id), user=job_user.name)
    assert "coordinator.restarted" in ev.stdout, (ev.stdout, ev.stderr)
    print(f"{moved} -> {SPARE} by the restarted coordinator: phases {done[0]['data'].get('phase_durations')}")
