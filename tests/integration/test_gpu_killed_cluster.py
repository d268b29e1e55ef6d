"""A rank that dies on a live node: the GPU under it killed, a bug in the script, no restore point.

Every job is examples/train_ddp.py (3 gloo DDP ranks at 0.1 s a step on node1..node3, one per node,
SLURM_LOCALID 0) as the ordinary job user; node4 is the hot spare. Its reference, per-step losses,
is training_jobs.reference_run's fault-free run, shared with the other train_ddp.py modules of the
test process (the sleep between steps changes no loss).

* ``sbatch --torchpass=spares=1,snapshot_every=2``; once a snapshot completed, at a random step,
  ``tpassctl devcluster kill-gpu NODE --gpu 0`` on a random training node other than the batch host
  (node and step from one seed, printed; ``TORCHPASS_TEST_SEED=N`` replays): tpassd reports Xid 79
  and GPU-is-lost, and the node's rank is SIGKILLed. The rank's task wrapper reports the death and
  holds its exit; the coordinator matches it to the Xid, drains the node with a ``torchpass:``
  reason naming the fault, and relaunches the step from the snapshot with the spare in the node's
  place. Checked: same job id, COMPLETED 0:0, Restarts=0, every loss line (so the last one of every
  step) the reference's bit for bit, the drain's reason. With Slurm's default.
* the same with a mesh job: examples/train_parallel.py ``hsdp`` (FSDP2 on a (replicate, shard) =
  (3, 2) DeviceMesh, 6 ranks, 2 per node), the GPU (0 or 1) chosen by the seed too, and
  KillOnBadExit (``SLURM_KILL_BAD_EXIT=1`` in the batch script's environment, which srun takes as
  ``--kill-on-bad-exit``: per job, the same setting slurm.conf's KillOnBadExit=1 gives every step);
  its reference run is drill.reference's (plain sbatch), shared with test_mesh_shapes.py when both
  run in one pytest process.
* the same with ``srun torchrun --max-restarts=0`` (3 agents, 2 workers each, the rendezvous store
  on node1), whose workers save a ``torchpass.checkpoint`` every 10 steps: whole-job snapshots of
  torchrun jobs are not covered (decide_snapshot), so the restore point is the checkpoint. The
  GPU's worker (``LOCAL_RANK``) dies; its agent, as torchrun does with no restart left, stops its
  other worker and exits 1. The agent's task wrapper reports its task and holds; the coordinator
  matches the task to its ranks on the node, relaunches the step from the checkpoint (every agent
  and worker starts again, the workers load it) with the spare in the node's place. Checked as
  above, and every worker's ``TORCHELASTIC_RESTART_COUNT`` is 0 at its end (torchrun restarted
  nothing: torchpass did).
* a script whose rank 1 raises at step BUG_AT (after a snapshot): the death has no hardware event,
  so the coordinator waits ``death_event_window_s`` and relaunches once from the snapshot; the
  restored rank hits the bug again and the job ends FAILED, as without torchpass, with the events
  ``rank.died`` (unexplained), ``job.relaunching`` and ``job.not_relaunched``.
* ``--torchpass=spares=1`` with no snapshot and no checkpoint, GPU killed: the job ends FAILED as
  without torchpass, and ``job.not_relaunched`` says there is no restore point.
"""

from __future__ import annotations

import dataclasses
import os
import random
import textwrap
import time
from pathlib import Path

import pytest

import drill
import training_jobs as tj
from drill import Drill
from slurm_helpers import job_id_of, job_python, sbatch, submit_env
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
# A mesh job: test_mesh_shapes.py's hsdp drill (same script and arguments: the same reference),
# run with KillOnBadExit (one job covers both: a fault-free run of either gives the same losses).
MESH_PLAIN = Drill("hsdp", (Path(__file__).resolve().parents[2] / "examples" / "train_parallel.py").read_text(),
                   ("hsdp", "--steps", "100", "--sleep", "0.05"), 100, nodes=3, per_node=2, fault_steps=(25, 45))
MESH = dataclasses.replace(MESH_PLAIN, sbatch_extra=("--export=ALL,SLURM_KILL_BAD_EXIT=1",))
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
    """train_ddp.py's losses per step with 3 ranks: training_jobs.reference_run, shared with the
    other modules of this process (the sleep between steps changes no loss)."""
    print(f"\ntest_gpu_killed seed={SEED} (replay: TORCHPASS_TEST_SEED={SEED})")
    return tj.reference_run(jobs_base, job_user, "gpukill", STEPS, context=f"seed={SEED}: ")["per_step"]


def _ended(cluster, job_id: int, out: Path, timeout_s: float, what: str) -> dict:
    """The job's record once it has ended; on a timeout the error carries the job's output, events
    and coordinator log."""
    return tj.wait_end(job_id, timeout_s, context=f"{what}: ", diag=lambda: drill.diagnosis(cluster, job_id, out, ""))


def _completed_after_the_kill(cluster, job_id: int, out: Path, t0: float, what: str) -> tuple[str, list[dict]]:
    """The job ended COMPLETED, exit 0, under its id and with no restart, within 180 s of the kill
    (at ``t0``); its diagnosis and events."""
    final = _ended(cluster, job_id, out, 180, what)
    print(f"job {job_id} ended {time.monotonic() - t0:.1f} s after the kill")
    diag = drill.diagnosis(cluster, job_id, out, what)
    assert final["job_id"] == job_id and final["job_state"][0] == "COMPLETED", diag
    assert final["exit_code"]["return_code"]["number"] == 0 and int(final.get("restart_cnt", 0)) == 0, diag
    return diag, drill.events(cluster, job_id)


def _kill_gpu(cluster, node: str, gpu: int = 0) -> dict:
    import json
    r = tj.run([*tj.TPASSCTL, "devcluster", "kill-gpu", node, "--gpu", str(gpu), "--name", cluster.spec.name,
                "--json"])
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


@pytest.mark.parametrize("d", [TRAIN, MESH], ids=["default", "mesh-kill-on-bad-exit"])
def test_a_gpu_killed_under_a_rank_relaunches_the_job_from_its_snapshot_on_the_spare(cluster, reference, job_dir,
                                                                                    job_user, d):
    rng = random.Random(f"{SEED}:{d.name}:{d.sbatch_extra}")
    node, at = rng.choice(KILLABLE), rng.randint(*d.fault_steps)
    gpu = rng.randrange(d.per_node) if d.per_node > 1 else 0
    what = (f"seed={SEED} (replay with TORCHPASS_TEST_SEED={SEED}): GPU {gpu} of {node} killed at step {at}, "
            f"{d.name} ({d.ranks} ranks){', KillOnBadExit' if d.sbatch_extra else ''}")
    print(f"\n{what}")
    jobs: list[int] = []
    try:
        if d is MESH:  # its own reference: another script (run once per process, drill.reference)
            t_ref = time.monotonic()
            reference = drill.reference(MESH_PLAIN, job_dir, job_user.name, jobs)
            print(f"{d.name} reference: {time.monotonic() - t_ref:.1f} s")
        job_id = drill.submit(d, job_dir, "gpukill", "spares=1,snapshot_every=2", job_user.name)
        jobs.append(job_id)
        out = job_dir / f"gpukill.{job_id}.out"
        drill.wait_step(cluster, job_id, out, at, what)
        _snapshot_done(cluster, job_id)
        t0 = time.monotonic()
        killed = _kill_gpu(cluster, node, gpu)
        # srun's block distribution: node i's local rank g is rank i * per_node + g
        assert [k["rank"] for k in killed["killed"]] == [d.training_nodes.index(node) * d.per_node + gpu], \
            (killed, what)
        diag, evs = _completed_after_the_kill(cluster, job_id, out, t0, what)
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
        assert sorted(tj.per_step(lines)) == list(range(d.steps)), diag
        # srun's exit hook says what happened: a rank died on a node that is up, not a node lost
        said = [ln for ln in out.read_text().splitlines() if ln.startswith(f"srun: tpass: job {job_id}")
                and "starts its step again" in ln]
        assert said and said[0].startswith(f"srun: tpass: job {job_id}: a rank died on {node} (the node is up); "
                                           f"srun starts its step again with {d.spare} in its place, every rank "
                                           f"restored from snapshot {going['data']['snapshot']}"), (said, diag)
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
        final = _ended(cluster, job_id, out, 240, what)
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
        final = _ended(cluster, job_id, out, 120, what)
        diag = drill.diagnosis(cluster, job_id, out, what)
        assert final["job_state"][0] == "FAILED" and int(final.get("restart_cnt", 0)) == 0, diag
        evs = drill.events(cluster, job_id)
        (ended,) = [e for e in evs if e["kind"] == "job.not_relaunched"]
        assert "no complete snapshot (snapshot_every) or application checkpoint" in ended["message"], diag
        assert "Xid 79" in ended["data"]["faults"][node] and not [e for e in evs if e["kind"] == "job.relaunching"]
        print(ended["message"])
    finally:
        _leave_clean(TRAIN, jobs)


TR_STEPS = 60
TR_CKPT_EVERY = 10
TR_SCRIPT = textwrap.dedent(
    r"""
    import os, sys, time, torch, torch.distributed as dist, torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    import torchpass.checkpoint as tpc
    def say(line):  # one write(2) per line: the node's 2 workers share torchrun's stdout
        sys.stdout.write(line + "\n"); sys.stdout.flush()

    class Gen:  # each worker's data generator, under its own key
        def __init__(self, g, rank): self.g, self.key = g, f"rank{rank}"
        def state_dict(self): return {self.key: self.g.get_state()}
        def load_state_dict(self, s): self.g.set_state(s[self.key])

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # env:// as torchrun sets it up
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    steps, ckpt_every = int(sys.argv[1]), int(sys.argv[2])
    ckpt = tpc.Checkpointer(sys.argv[3], keep=2)
    state = {"train": tpc.ModelState(model, opt), "data": Gen(g, rank)}
    first = ckpt.load(state) or 0
    if first:  # DDP's buckets as the job had them (examples/train_checkpointed.py's ddp_warm_up)
        model(torch.zeros(1, 16)).sum().mul(0).backward()
        for p in model.parameters():
            p.grad = None
    for step in range(first, steps):
        x = torch.randn(8, 16, generator=g)
        loss = nn.functional.mse_loss(model(x), torch.tanh(x.sum(1, keepdim=True)))
        opt.zero_grad(); loss.backward(); opt.step()
        t = loss.detach().clone(); dist.all_reduce(t)
        say(f"step={step} loss={(t.item() / world).hex()}")
        if (step + 1) % ckpt_every == 0 and step + 1 < steps:
            ckpt.save(step + 1, state)
        time.sleep(0.1)
    ckpt.close()
    dist.barrier()
    say(f"restarts={os.environ.get('TORCHELASTIC_RESTART_COUNT')}")
    dist.destroy_process_group()
    os._exit(0)  # plain torch 2.13 may abort at a normal exit (docs/runtime.md, "Unprotected jobs")
    """
)
TR_WORKERS = 6
_TR_REFERENCE: dict = {}


def _torchrun_submit(d: Path, tag: str, torchpass: str | None, user) -> tuple[int, Path]:
    """sbatch the torchrun job as ``user`` on 3 nodes (4 with ``torchpass``: the spare)."""
    script = d / "tr_ckpt.py"
    if not script.exists():
        script.write_text(TR_SCRIPT)
        os.chown(script, user.uid, user.gid)
    args = ["-N", str(3 + bool(torchpass)), "-o", str(d / f"{tag}.%j.out")]
    if torchpass:
        args.insert(0, f"--torchpass={torchpass}")
    body = tj.torchrun_batch(d, Path(job_python()).parent / "torchrun", 3,
                             f"tr_ckpt.py {TR_STEPS} {TR_CKPT_EVERY} {d / f'{tag}.ckpt'}", conf="--max-restarts=0")
    job_id = job_id_of(sbatch(args, body, cwd=d, user=user.name, env=submit_env(user.name)))
    return job_id, d / f"{tag}.{job_id}.out"


def _torchrun_reference(job_dir: Path, user, jobs: list[int]) -> dict:
    if "steps" not in _TR_REFERENCE:
        t0 = time.monotonic()
        ref_id, out = _torchrun_submit(job_dir, "trref", None, user)
        jobs.append(ref_id)
        final = tj.wait_end(ref_id, 300, context="torchrun reference: ")
        text = out.read_text()
        assert final["job_state"][0] == "COMPLETED", tj.excerpt(text)
        assert text.splitlines().count("restarts=0") == TR_WORKERS, tj.excerpt(text)
        ref = tj.per_step(tj.steps(text))
        assert sorted(ref) == list(range(TR_STEPS)) and all(sum(c.values()) == TR_WORKERS for c in ref.values()), \
            tj.excerpt(text)
        assert all(len(c) == 1 for c in ref.values()), "the workers disagree on a step's loss"
        _TR_REFERENCE["steps"] = ref
        print(f"torchrun reference: {TR_STEPS} steps in {time.monotonic() - t0:.1f} s")
    return _TR_REFERENCE["steps"]


def test_a_gpu_killed_under_a_torchrun_worker_relaunches_the_job_from_its_checkpoint(cluster, reference, job_dir,
                                                                                   job_user):
    rng = random.Random(f"{SEED}:torchrun")
    node, at, gpu = rng.choice(KILLABLE), rng.randint(22, 35), rng.randrange(2)
    what = (f"seed={SEED} (replay with TORCHPASS_TEST_SEED={SEED}): GPU {gpu} of {node} killed at step {at}, "
            "srun torchrun --max-restarts=0, 3 x 2 workers, checkpoints every 10 steps")
    print(f"\n{what}")
    jobs: list[int] = []
    try:
        ref = _torchrun_reference(job_dir, job_user, jobs)
        job_id, out = _torchrun_submit(job_dir, "trkill", "spares=1", job_user)
        jobs.append(job_id)
        drill.wait_step(cluster, job_id, out, at, what)
        until(lambda: [e for e in drill.events(cluster, job_id) if e["kind"] == "checkpoint.completed"],
              "a complete checkpoint", 60, every=0.1)
        t0 = time.monotonic()
        killed = _kill_gpu(cluster, node, gpu)
        task = TRAIN.training_nodes.index(node)  # one agent per node: its task is the node's index
        assert [k["rank"] for k in killed["killed"]] == [2 * task + gpu], (killed, what)  # the worker, not the agent
        diag, evs = _completed_after_the_kill(cluster, job_id, out, t0, what)
        died = [e for e in evs if e["kind"] == "rank.died"]
        (going,) = [e for e in evs if e["kind"] == "job.relaunching"]
        assert [e["data"]["cause"] for e in died] == ["hardware"] and "Xid 79" in died[0]["data"]["faults"][node], diag
        assert going["data"]["replaced"] == {node: "node4"} and not going["data"].get("snapshot"), diag
        print(died[0]["message"])
        print(going["message"])
        text = out.read_text()
        assert f"srun: tpass: job {job_id}: a rank died on {node} (the node is up); srun starts its step again " \
               "with node4 in its place (relaunch 1;" in text, diag
        lines = tj.steps(text)
        assert lines and all(ln in ref[int(ln.split()[0][5:])] for ln in lines), diag
        assert sorted(tj.per_step(lines)) == list(range(TR_STEPS)), diag
        # torchrun restarted nothing (its agents are new ones, started by the relaunched srun)
        assert text.splitlines().count("restarts=0") == TR_WORKERS, diag
        dn = tj.node(node)
        assert "DRAIN" in dn["state"] and dn.get("reason", "").startswith(f"torchpass: {node} GPU failed under") \
            and "Xid 79" in dn["reason"], (dn.get("reason"), diag)
        print(f"{node} drained: {dn['reason']}")
    finally:
        _leave_clean(TRAIN, jobs)
