"""A rank that dies on a live node: the GPU under it killed, a bug in the script, no restore point.

Every job is examples/train_ddp.py (3 gloo DDP ranks at 0.1 s a step on node1..node3, one per node,
SLURM_LOCALID 0) as the ordinary job user; node4 is the hot spare. One plain run (no
``--torchpass``: the runtime is not loaded) is the module's reference: per-step losses.

* ``sbatch --torchpass=spares=1,snapshot_every=2``; once a snapshot completed, at a random step,
  ``tpassctl devcluster kill-gpu NODE --gpu 0`` on a random training node other than the batch host
  (node and step from one seed, printed; ``TORCHPASS_TEST_SEED=N`` replays): tpassd reports Xid 79
  and GPU-is-lost, and the node's rank is SIGKILLed. The rank's task wrapper reports the death and
  holds its exit; the coordinator matches it to the Xid, drains the node with a ``torchpass:``
  reason naming the fault, and relaunches the step from the snapshot with the spare in the node's
  place. Checked: same job id, COMPLETED 0:0, Restarts=0, every loss line (so the last one of every
  step) the reference's bit for bit, the drain's reason. Run twice: with Slurm's default, and with
  KillOnBadExit (``SLURM_KILL_BAD_EXIT=1`` in the batch script's environment, which srun takes as
  ``--kill-on-bad-exit``: per job, the same setting slurm.conf's KillOnBadExit=1 gives every step).
* a script whose rank 1 raises at step BUG_AT (after a snapshot): the death has no hardware event,
  so the coordinator waits ``death_event_window_s`` and relaunches once from the snapshot; the
  restored rank hits the bug again and the job ends FAILED, as without torchpass, with the events
  ``rank.died`` (unexplained), ``job.relaunching`` and ``job.not_relaunched``.
* ``--torchpass=spares=1`` with no snapshot and no checkpoint, GPU killed: the job ends FAILED as
  without torchpass, and ``job.not_relaunched`` says there is no restore point.
"""

from __future__ import annotations

import os
import random
import time

import pytest

import drill
import training_jobs as tj
from drill import Drill
from support.wait import until
from torchpass.coordinator.policy import CoordinatorPolicy

pytestmark = pytest.mark.integration

SEED = int(os.environ.get("TORCHPASS_TEST_SEED") or time.time_ns() % 1_000_000)
NODES = ("node1", "node2", "node3", "node4")
STEPS = 70
ARGS = ("--steps", str(STEPS), "--params", "1M", "--sleep", "0.1")
KILLABLE = ("node2", "node3")  # node1 is the batch host: the coordinator runs there
BUG_AT = 35
TRAIN = Drill("gpukill", "", ARGS, STEPS, nodes=3, fault_steps=(25, 45))
TRAIN_KOBE = Drill("gpukill", "", ARGS, STEPS, nodes=3, fault_steps=(25, 45),
                   sbatch_extra=("--export=ALL,SLURM_KILL_BAD_EXIT=1",))
BUGGY = Drill("buggy", f'''import sys, time
from train_ddp import add_args, start
import argparse
ap = argparse.ArgumentParser()
add_args(ap)
args = ap.parse_args()
job = start(args)
for step in range(args.steps):
    if step == {BUG_AT} and job.rank == 1:
        raise RuntimeError("a bug in the script at step {BUG_AT}")
    print(f"step={{step}} loss={{job.step().hex()}}", flush=True)
    time.sleep(args.sleep)
''', ARGS, STEPS, nodes=3)
POLICY = CoordinatorPolicy()


@pytest.fixture(scope="module")
def reference(cluster, plugin_built, jobs_base, job_user) -> dict:
    print(f"\ntest_gpu_killed seed={SEED} (replay: TORCHPASS_TEST_SEED={SEED})")
    d = jobs_base / f"gpukill-ref-{os.getpid()}"
    d.mkdir(exist_ok=True)
    d.chmod(0o755)
    os.chown(d, job_user.uid, job_user.gid)
    jobs: list[int] = []
    t0 = time.monotonic()
    ref = drill.reference(TRAIN, d, job_user.name, jobs)
    print(f"reference: {STEPS} steps in {time.monotonic() - t0:.1f} s")
    return ref


def _kill_gpu(cluster, node: str) -> dict:
    import json
    r = tj.run([*tj.TPASSCTL, "devcluster", "kill-gpu", node, "--gpu", "0", "--name", cluster.spec.name, "--json"])
    assert r.returncode == 0, (SEED, r.stdout, r.stderr)
    return json.loads(r.stdout)


def _snapshot_done(cluster, job_id: int) -> None:
    until(lambda: [e for e in drill.events(cluster, job_id) if e["kind"] == "snapshot.completed"],
          "a complete snapshot", 90, every=0.1)


def _leave_clean(d: Drill, jobs: list[int]) -> None:
    drill.leave_clean(d, jobs)
    for j in jobs:
        tj.wait_end(j, 60)
    until(lambda: all(tj.node(n)["state"] == ["IDLE"] for n in NODES), "every node idle", 60, every=0.5)


@pytest.mark.parametrize("d", [TRAIN, TRAIN_KOBE], ids=["default", "kill-on-bad-exit"])
def test_a_gpu_killed_under_a_rank_relaunches_the_job_from_its_snapshot_on_the_spare(cluster, reference, job_dir,
                                                                                    job_user, d):
    rng = random.Random(f"{SEED}:{d.sbatch_extra}")
    node, at = rng.choice(KILLABLE), rng.randint(*d.fault_steps)
    what = (f"seed={SEED} (replay with TORCHPASS_TEST_SEED={SEED}): GPU 0 of {node} killed at step {at}"
            f"{', KillOnBadExit' if d.sbatch_extra else ''}")
    print(f"\n{what}")
    jobs: list[int] = []
    try:
        job_id = drill.submit(d, job_dir, "gpukill", "spares=1,snapshot_every=2", job_user.name)
        jobs.append(job_id)
        out = job_dir / f"gpukill.{job_id}.out"
        drill.wait_step(cluster, job_id, out, at, what)
        _snapshot_done(cluster, job_id)
        t0 = time.monotonic()
        killed = _kill_gpu(cluster, node)
        assert [k["rank"] for k in killed["killed"]] == [d.training_nodes.index(node)], (killed, what)
        final = tj.wait_end(job_id, 180, context=f"{what}: ")
        print(f"job {job_id} ended {time.monotonic() - t0:.1f} s after the kill")
        diag = drill.diagnosis(cluster, job_id, out, what)
        assert final["job_id"] == job_id and final["job_state"][0] == "COMPLETED", diag
        assert final["exit_code"]["return_code"]["number"] == 0 and int(final.get("restart_cnt", 0)) == 0, diag
        evs = drill.events(cluster, job_id)
        (died,) = [e for e in evs if e["kind"] == "rank.died"]
        (going,) = [e for e in evs if e["kind"] == "job.relaunching"]
        (back,) = [e for e in evs if e["kind"] == "job.relaunched"]
        print(died["message"])
        print(going["message"])
        print(back["message"])
        assert died["data"]["cause"] == "hardware" and "Xid 79" in died["data"]["faults"][node], diag
        assert going["data"]["replaced"] == {node: d.spare} and going["data"]["snapshot"], diag
        # every loss line, the recomputed ones included, is the reference's, bit for bit (so is
        # the last line of every step), and every step is there
        lines = tj.steps(out.read_text())
        assert lines and all(ln in reference[int(ln.split()[0][5:])] for ln in lines), diag
        assert sorted(tj.per_step(lines)) == list(range(STEPS)), diag
        drained = [e for e in evs if e["kind"] in ("node.drained", "node.drain_failed")]
        assert [(e["kind"], e["data"]["node"]) for e in drained] == [("node.drained", node)], (drained, diag)
        dn = tj.node(node)
        assert "DRAIN" in dn["state"], (dn["state"], drained)
        assert dn.get("reason", "").startswith(f"torchpass: {node} GPU failed under rank") \
            and "Xid 79" in dn["reason"], (dn.get("reason"), diag)
        print(f"{node} drained: {dn['reason']}; {back['data']['decision_to_resumed_s']} s from the decision "
              "to every rank resumed")
    finally:
        _leave_clean(d, jobs)


def test_a_script_bug_that_kills_a_rank_twice_is_relaunched_once_then_the_job_ends(cluster, reference, job_dir,
                                                                                   job_user):
    what = f"seed={SEED}: rank 1 raises at step {BUG_AT}, after a snapshot"
    print(f"\n{what}")
    jobs: list[int] = []
    try:
        job_id = drill.submit(BUGGY, job_dir, "buggy", "spares=1,snapshot_every=2", job_user.name)
        jobs.append(job_id)
        out = job_dir / f"buggy.{job_id}.out"
        final = tj.wait_end(job_id, 240, context=f"{what}: ")
        diag = drill.diagnosis(cluster, job_id, out, what)
        # as without torchpass: srun exits with the failed task's status, so does the batch script
        assert final["job_state"][0] == "FAILED" and int(final.get("restart_cnt", 0)) == 0, diag
        kinds = [e["kind"] for e in drill.events(cluster, job_id)]
        evs = drill.events(cluster, job_id)
        assert kinds.count("job.relaunching") == 1 and kinds.count("job.not_relaunched") == 1, diag
        died = [e for e in evs if e["kind"] == "rank.died"]
        assert [e["data"]["cause"] for e in died] == ["unexplained"], diag
        (ended,) = [e for e in evs if e["kind"] == "job.not_relaunched"]
        assert "max_unexplained_relaunches" in ended["message"] and "without torchpass" in ended["message"], diag
        assert kinds.index("snapshot.completed") < kinds.index("rank.died") < kinds.index("job.relaunching") \
            < kinds.index("job.not_relaunched"), diag
        assert out.read_text().count(f"RuntimeError: a bug in the script at step {BUG_AT}") == 2, diag
        print(ended["message"])
    finally:
        _leave_clean(BUGGY, jobs)


def test_a_gpu_killed_with_no_restore_point_ends_the_job_as_without_torchpass(cluster, reference, job_dir, job_user):
    rng = random.Random(f"{SEED}:norestore")
    node, at = rng.choice(KILLABLE), rng.randint(5, 30)
    what = f"seed={SEED}: GPU 0 of {node} killed at step {at}, no snapshot, no checkpoint"
    print(f"\n{what}")
    jobs: list[int] = []
    try:
        job_id = drill.submit(TRAIN, job_dir, "norestore", "spares=1", job_user.name)
        jobs.append(job_id)
        out = job_dir / f"norestore.{job_id}.out"
        drill.wait_step(cluster, job_id, out, at, what)
        _kill_gpu(cluster, node)
        final = tj.wait_end(job_id, 120, context=f"{what}: ")
        diag = drill.diagnosis(cluster, job_id, out, what)
        assert final["job_state"][0] == "FAILED" and int(final.get("restart_cnt", 0)) == 0, diag
        evs = drill.events(cluster, job_id)
        (ended,) = [e for e in evs if e["kind"] == "job.not_relaunched"]
        assert "no complete snapshot (snapshot_every) or application checkpoint" in ended["message"], diag
        assert "Xid 79" in ended["data"]["faults"][node] and not [e for e in evs if e["kind"] == "job.relaunching"]
        print(ended["message"])
    finally:
        _leave_clean(TRAIN, jobs)
