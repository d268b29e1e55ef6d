"""A training node lost outright: with no restore point Slurm's normal behaviour
applies, with a clear event; with an application checkpoint the job's step is relaunched.

The first test:

``sbatch -N4 --torchpass=spares=1`` of examples/train_ddp.py as the job user (3 gloo DDP ranks
on node1..node3, hot spare node4). At a random step a random training node other than the batch
host (node2 or node3; node and step from one seed, printed; ``TORCHPASS_TEST_SEED=N`` replays)
is crashed with ``tpassctl devcluster crash``: its link goes down, then every process of it is
killed at once, as in a power cut. Checked:

* the coordinator records one ``node.lost`` event for that node, saying that there is no snapshot
  to restore the job from and what Slurm will do, once slurmctld confirms that it does not hear the
  node either; it pauses nobody and starts no migration;
* the node is drained with a ``torchpass:`` reason through another node of the job (its own
  tpassd died with it; the witness's tpassd checks with slurmctld that the job runs on both and
  that slurmctld no longer hears the node): one ``node.drained`` event naming the witness;
  slurmctld then marks it DOWN and keeps the reason (docs/coordinator.md, "A node lost outright");
* no process of the crashed node is left, nor its UTS and mount namespaces;
* the job, a requeueable batch job (Slurm's default), is requeued: Restarts=1, pending behind its
  requeue hold. The test cancels it. Run twice: plainly, where slurmctld requeues it when it marks
  the node DOWN ("DUE TO NODE FAILURE") unless the coordinator's own requeue (after the drain)
  came first; and with ``sbatch --no-kill`` (what a relaunch needs), where slurmctld would leave the
  job running with its other ranks waiting for the lost one, and the coordinator requeues it
  (``job.requeuing``, then ``job.requeued``);
* the coordinator ended.

The node is revived at the end: its slurmd registers, and it stays drained (it does not return to
service by itself) until the test resumes it (the session's later tests need all four nodes idle).
The batch host's crash (node1) is out of scope: the coordinator dies with it and no event can be
recorded; Slurm requeues the job the same way.

The second: examples/train_checkpointed.py (a torchpass.checkpoint save every 5 steps) under
``sbatch --no-kill --torchpass=spares=1`` as the job user, and a plain run of it (the reference).
node2 or node3 is crashed at a random step (seed printed). The coordinator ends the step that lost
the node, puts the hot spare in its place in the job's host file, and the user's srun starts the
step again (the SPANK plugin's exit hook); the script loads its newest complete checkpoint.
Checked: the same job id, Restarts=0, COMPLETED 0:0; every step's loss line, the recomputed ones
included, equals the reference bit for bit; the relaunched step loads the checkpoint the
``job.relaunching`` event names, which is the newest one the coordinator heard of before the loss,
and only the steps from it on are computed again (each once per rank after the relaunch); the dead
node is drained with a ``torchpass:`` reason.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest

import drill
import training_jobs as tj
from drill import Drill
from support.wait import until
from torchpass import layout
from torchpass.coordinator.decide_relaunch import ENDED_LIKE_SLURM, SLURM_ON_LOST_NODE
from torchpass.devcluster.cluster import pid_alive

pytestmark = pytest.mark.integration

SEED = int(os.environ.get("TORCHPASS_TEST_SEED") or time.time_ns() % 1_000_000)
NODES = ("node1", "node2", "node3", "node4")
REPO = Path(__file__).resolve().parents[2]
CKPT_STEPS = 120
CKPT_EVERY = 5
CHECKPOINTED = Drill("train_checkpointed", (REPO / "examples" / "train_checkpointed.py").read_text(),
                     ("--steps", str(CKPT_STEPS), "--params", "1M", "--sleep", "0.05", "--ckpt-every",
                      str(CKPT_EVERY), "--ckpt-dir", "ckpt.$SLURM_JOB_ID"),
                     CKPT_STEPS, nodes=3, fault_steps=(12, 60), sbatch_extra=("--no-kill",))


def _ns_holders(kind: str, inode: str) -> list[int]:
    """Live processes in the namespace ``kind`` (uts, mnt) whose link reads ``inode``."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.readlink(f"/proc/{d}/ns/{kind}") == inode and pid_alive(int(d)):
                    found.append(int(d))
            except OSError:
                continue
    return found


@pytest.mark.parametrize("no_kill", [False, True], ids=["slurm-kills", "no-kill"])
def test_a_node_lost_outright_with_no_snapshot_is_left_to_slurm_with_a_clear_event(cluster, plugin_built, job_dir,
                                                                                  job_user, no_kill):
    rng = random.Random(SEED)
    node, at = rng.choice(("node2", "node3")), rng.randint(3, 15)
    what = (f"seed={SEED} (replay with TORCHPASS_TEST_SEED={SEED}): crash of {node} at step {at}"
            + (", sbatch --no-kill" if no_kill else ""))
    print(f"\n{what}")
    job_id = tj.submit(job_dir, "crash", steps=3000, nodes=4, user=job_user.name,
                       sbatch_extra=("--no-kill",) if no_kill else ())
    out = job_dir / f"crash.{job_id}.out"

    def diag() -> str:
        return drill.diagnosis(cluster, job_id, out, what)

    def wait(cond, timeout_s: float, waited_for: str, every: float = 0.2):
        try:
            return until(cond, waited_for, timeout_s, every=every)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{diag()}") from None

    def lost_events() -> list[dict]:
        return [e for e in drill.events(cluster, job_id) if e["kind"] == "node.lost"]

    crashed = False
    try:
        wait(lambda: out.exists() and f"step={at} " in out.read_text(), 240, f"step {at}", every=0.1)
        coord = json.loads(layout.coordinator_json(cluster.state_dir, job_id).read_text())["pid"]
        slurmd = cluster.slurmd_pid(node)
        tpassd = json.loads((cluster.run_dir / "cluster.json").read_text())["pids"][f"tpassd.{node}"]
        spaces = {k: os.readlink(f"/proc/{slurmd}/ns/{k}") for k in ("uts", "mnt")}
        netns = cluster.spec.netns(cluster.node_names.index(node) + 1)
        before = cluster._netns_pids(netns)
        assert slurmd in before and tpassd in before and len(before) >= 5, before  # + stepd, wrapper, rank
        t0 = time.monotonic()
        killed = cluster.crash(node)
        crashed = True
        print(f"{node} crashed: {len(killed)} processes killed")
        assert set(before) <= set(killed), (before, killed)

        # Nothing of the node is left: no process in its network namespace, none in its UTS and
        # mount namespaces (gone with their last process), its daemons dead.
        assert cluster._netns_pids(netns) == []
        assert not pid_alive(slurmd) and not pid_alive(tpassd)
        for kind, inode in spaces.items():
            assert _ns_holders(kind, inode) == [], (kind, inode)

        # The event, once slurmctld confirms the node is gone: no snapshot, what Slurm does.
        wait(lost_events, 90, "the node.lost event")
        (lost,) = lost_events()
        print(f"node.lost after {time.monotonic() - t0:.1f} s: {lost['message']}")
        assert lost["data"]["node"] == node and lost["data"]["snapshot"] is None, diag()
        assert ("no complete snapshot (snapshot_every) or application checkpoint (torchpass.checkpoint)"
                " of the job to relaunch it from" in lost["message"]), diag()
        assert SLURM_ON_LOST_NODE in lost["message"] and ENDED_LIKE_SLURM in lost["message"], diag()
        assert "tpassd silent; slurmctld reports" in lost["message"], diag()

        # Drained with torchpass's reason, through a node of the job that is still there.
        wait(lambda: [e for e in drill.events(cluster, job_id) if e["kind"] in ("node.drained", "node.drain_failed")],
             30, "the drain of the lost node")
        (drained,) = [e for e in drill.events(cluster, job_id) if e["kind"] in ("node.drained", "node.drain_failed")]
        print(f"{drained['kind']} after {time.monotonic() - t0:.1f} s: {drained['message']}")
        assert drained["kind"] == "node.drained", diag()
        assert drained["data"]["node"] == node and drained["data"]["witness"] in ("node1", "node2", "node3", "node4")
        assert drained["data"]["witness"] != node, diag()
        reason = drained["data"]["reason"]
        assert reason.startswith(f"torchpass: {node} failed outright"), reason

        # The job requeued: by the coordinator after the drain, or by slurmctld when it marks the node
        # DOWN, whichever comes first; with --no-kill slurmctld would not, and only the coordinator's
        # requeue keeps the job's other ranks from waiting in their collectives for the lost one.
        def requeued():  # pending again (a requeue leaves it COMPLETING until the lost node is DOWN)
            j = tj.job(job_id)
            again = int(j.get("restart_cnt", 0)) >= 1 and "PENDING" in j["job_state"]
            return j if again or not set(j["job_state"]) & tj.ACTIVE else None

        final = wait(requeued, 90, "the job's requeue", every=0.5)
        print(f"job {job_id}: {final['job_state']}, Restarts={final.get('restart_cnt')}, "
              f"{final.get('state_reason')} ({time.monotonic() - t0:.1f} s after the crash)")
        assert int(final["restart_cnt"]) == 1 and "PENDING" in final["job_state"], (final["job_state"], diag())
        ours = [e for e in drill.events(cluster, job_id) if e["kind"].startswith("job.")]
        print(f"the coordinator's word on the job: {[e['kind'] for e in ours]}")
        # job.requeuing is saved before the requeue; job.requeued after it, if the requeue (which ends
        # the batch step) left the coordinator the time to save it.
        requeued_by_us = (["job.requeuing", "job.requeued"], ["job.requeuing"])
        if no_kill:
            assert [e["kind"] for e in ours] in requeued_by_us, (ours, diag())
            assert all(e["data"]["node"] == node for e in ours)
        else:  # slurmctld's own requeue, or the coordinator's if it came first (then slurmctld finds it pending)
            assert [e["kind"] for e in ours] in (*requeued_by_us, ["job.not_ended"], []), (ours, diag())
            if not ours or ours[0]["kind"] != "job.requeuing":
                assert "DUE TO NODE FAILURE" in out.read_text(), diag()
        wait(lambda: "DOWN" in tj.node(node)["state"], 60, f"slurmctld marking {node} DOWN", every=0.5)
        down = tj.node(node)
        # slurmctld keeps the drain's reason when it marks the node DOWN, and appends its own
        assert {"DOWN", "DRAIN"} <= set(down["state"]) and down.get("reason", "").startswith(reason), \
            (down["state"], down.get("reason"))
        wait(lambda: not pid_alive(coord), 60, "the coordinator's end")
        kinds = [e["kind"] for e in drill.events(cluster, job_id)]
        assert "migration.started" not in kinds, kinds  # nobody paused, nothing moved
    finally:
        tj.run(["scancel", str(job_id)])
        back = _revive(cluster, node) if crashed else None
    assert back is not None and "DRAIN" in back["state"] and back.get("reason", "").startswith("torchpass: "), back
    tj.wait_end(job_id, 60)
    assert all(tj.node(n)["state"] == ["IDLE"] for n in NODES), [(n, tj.node(n)["state"]) for n in NODES]


def _revive(cluster, node: str) -> dict:
    """Its slurmd registers again (ReturnToService=2 would return a node that was only DOWN to
    service); drained, it stays out until an admin resumes it (here the test, also when it failed:
    the session's later tests need the node). The node's record once it registered."""
    cluster.revive(node)
    back = until(lambda: (lambda n: n if "DOWN" not in n["state"] else None)(tj.node(node)),
                 f"{node}'s slurmd registered again", 60, every=0.2)
    if "DRAIN" in back["state"]:
        tj.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"])
    until(lambda: tj.node(node)["state"] == ["IDLE"], f"{node} idle again", 60, every=0.2)
    return back


def _completes_never_requeued(cluster, job_id: int, out, what: str, crashed_at: float) -> tuple[str, list[dict]]:
    """After the crash: the job ends COMPLETED 0:0 under its id, Restarts=0. (diagnosis, events)."""
    final = tj.wait_end(job_id, 240, context=f"{what}: ")
    print(f"job {job_id} ended {time.monotonic() - crashed_at:.1f} s after the crash")
    diag = drill.diagnosis(cluster, job_id, out, what)
    assert final["job_id"] == job_id and final["job_state"][0] == "COMPLETED", diag
    assert final["exit_code"]["return_code"]["number"] == 0 and int(final.get("restart_cnt", 0)) == 0, diag
    return diag, drill.events(cluster, job_id)


def test_a_node_lost_outright_relaunches_a_checkpointed_job_on_the_spare(cluster, plugin_built, job_dir, job_user):
    d = CHECKPOINTED
    rng = random.Random(f"{SEED}:relaunch")
    node, at = rng.choice(("node2", "node3")), rng.randint(*d.fault_steps)
    what = f"seed={SEED} (replay with TORCHPASS_TEST_SEED={SEED}): crash of {node} at step {at}, {d.name}"
    print(f"\n{what}")
    jobs: list[int] = []
    crashed = False
    try:
        ref = drill.reference(d, job_dir, job_user.name, jobs)
        job_id = drill.submit(d, job_dir, "relaunch", "spares=1", job_user.name)
        jobs.append(job_id)
        out = job_dir / f"relaunch.{job_id}.out"
        drill.wait_step(cluster, job_id, out, at, what)
        t0 = time.monotonic()
        cluster.crash(node)
        crashed = True
        diag, evs = _completes_never_requeued(cluster, job_id, out, what, t0)
        kinds = [e["kind"] for e in evs]
        (lost,) = [e for e in evs if e["kind"] == "node.lost"]
        (going,) = [e for e in evs if e["kind"] == "job.relaunching"]
        (back,) = [e for e in evs if e["kind"] == "job.relaunched"]
        print(going["message"])
        print(back["message"])
        assert lost["data"]["node"] == node and lost["data"]["spare"] == d.spare, diag
        # the newest checkpoint the coordinator heard of before the loss is the one used
        told = [e["data"]["step"] for e in evs[:kinds.index("node.lost")] if e["kind"] == "checkpoint.completed"]
        used = going["data"]["checkpoint"]
        assert told and used == told[-1], (told, used, diag)
        assert going["data"]["replaced"] == {node: d.spare}, diag

        text = out.read_text()
        marker = f"srun: tpass: job {job_id} lost {node}; srun starts its step again"
        assert text.count(marker) == 1, diag
        before, after = text.split(marker)
        assert after.count(f"ckpt loaded step={used}") == 1 and "ckpt loaded" not in before, diag
        # every loss line, the recomputed ones included, is the reference's, bit for bit
        lines = tj.steps(text)
        assert all(ln in ref[int(ln.split()[0][5:])] for ln in lines), diag
        # after the relaunch: exactly the steps from the checkpoint on, once per rank
        redo = tj.per_step(tj.steps(after))
        assert sorted(redo) == list(range(used, d.steps)) and all(sum(c.values()) == d.ranks
                                                                   for c in redo.values()), diag
        # before it: every step up to the crash, none past the ones recomputed
        first = tj.per_step(tj.steps(before))
        assert sorted(first) == list(range(max(first) + 1)) and used <= max(first) + 1, diag
        recomputed = max(first) + 1 - used
        # the event's count: the steps the ranks completed (a survivor may have finished the step
        # whose loss line it never printed: the loss all-reduce waited for the dead rank)
        assert 0 <= going["data"]["recompute_steps"] - recomputed <= 1, (going["data"], recomputed, diag)
        assert [e["data"]["step"] for e in evs if e["kind"] == "checkpoint.loaded"] == [used], diag
        print(f"checkpoint of step {used}; steps {used}..{max(first)} ({recomputed}) computed again; "
              f"{back['data']['decision_to_registered_s']} s from the loss found to every rank back")

        dn = tj.node(node)
        assert "DRAIN" in dn["state"] and dn.get("reason", "").startswith(f"torchpass: {node} failed outright"), dn
    finally:
        for j in jobs:
            tj.run(["scancel", str(j)])
        back = _revive(cluster, node) if crashed else None
        drill.leave_clean(d, jobs)
    assert back is not None and "DRAIN" in back["state"], back  # it stayed out until resumed
    assert all(tj.node(n)["state"] == ["IDLE"] for n in NODES), [(n, tj.node(n)["state"]) for n in NODES]


# The 3-rank DDP example with periodic snapshots 2 s apart (at 0.1 s a step: one every ~20 steps).
SNAPSHOTTED = Drill("snapshotted", "", ("--steps", "110", "--params", "1M", "--sleep", "0.1"), 110, nodes=3,
                    fault_steps=(30, 70), sbatch_extra=("--no-kill",))


def test_a_node_lost_outright_relaunches_the_job_from_its_newest_snapshot(cluster, plugin_built, job_dir, job_user):
    """``sbatch --no-kill --torchpass=spares=1,snapshot_every=2`` of examples/train_ddp.py as the job
    user; node2 or node3 crashed at a random step once a snapshot completed (seed printed). The
    coordinator relaunches the step with the hot spare in the lost node's place, and every task of
    the relaunched srun restores its rank from the newest complete snapshot instead of starting the
    script: the job goes on from the snapshot's step, with nothing reloaded by the script.

    Checked: the same job id, Restarts=0, COMPLETED 0:0; every loss line, the recomputed ones
    included, equals the plain run's bit for bit (so the last one of every step does); the snapshot
    used is the newest one completed before the loss; after the relaunch exactly the steps from the
    snapshot's on are computed, once per rank; the dead node is drained with a ``torchpass:`` reason."""
    d = SNAPSHOTTED
    rng = random.Random(f"{SEED}:snapshot-relaunch")
    node, at = rng.choice(("node2", "node3")), rng.randint(*d.fault_steps)
    what = f"seed={SEED} (replay with TORCHPASS_TEST_SEED={SEED}): crash of {node} at step {at}, from a snapshot"
    print(f"\n{what}")
    jobs: list[int] = []
    crashed = False
    try:
        ref = drill.reference(d, job_dir, job_user.name, jobs)
        job_id = drill.submit(d, job_dir, "snaprelaunch", "spares=1,snapshot_every=2", job_user.name)
        jobs.append(job_id)
        out = job_dir / f"snaprelaunch.{job_id}.out"
        drill.wait_step(cluster, job_id, out, at, what)
        until(lambda: [e for e in drill.events(cluster, job_id) if e["kind"] == "snapshot.completed"],
              "a complete snapshot", 60, every=0.1)
        t0 = time.monotonic()
        cluster.crash(node)
        crashed = True
        diag, evs = _completes_never_requeued(cluster, job_id, out, what, t0)
        kinds = [e["kind"] for e in evs]
        (lost,) = [e for e in evs if e["kind"] == "node.lost"]
        (going,) = [e for e in evs if e["kind"] == "job.relaunching"]
        (restored,) = [e for e in evs if e["kind"] == "job.restored"]
        (back,) = [e for e in evs if e["kind"] == "job.relaunched"]
        print(going["message"])
        print(restored["message"])
        print(back["message"])
        # the newest snapshot completed before the loss is the one every rank is restored from
        told = [e["data"]["snapshot"] for e in evs[:kinds.index("node.lost")] if e["kind"] == "snapshot.completed"]
        used = going["data"]["snapshot"]
        assert told and used == told[-1] and lost["data"]["snapshot"] == used, (told, used, diag)
        assert going["data"]["replaced"] == {node: d.spare} and lost["data"]["spare"] == d.spare, diag
        step = going["data"]["snapshot_step"]
        assert step == [e["data"]["step"] for e in evs if e["kind"] == "snapshot.completed"
                        and e["data"]["snapshot"] == used][0], diag
        registered = [e for e in evs[kinds.index("job.relaunching"):] if e["kind"] == "rank.registered"]
        assert sorted(e["data"]["rank"] for e in registered) == list(range(d.ranks)), diag
        assert all(e["data"].get("restored") == used for e in registered), diag
        assert {e["data"]["node"] for e in registered} == {*d.training_nodes, d.spare} - {node}, diag

        text = out.read_text()
        marker = f"srun: tpass: job {job_id} lost {node}; srun starts its step again"
        assert text.count(marker) == 1 and f"every rank restored from snapshot {used}" in text, diag
        before, after = text.split(marker)
        # every loss line, the recomputed ones included, is the reference's, bit for bit
        lines = tj.steps(text)
        assert lines and all(ln in ref[int(ln.split()[0][5:])] for ln in lines), diag
        # after the relaunch: the steps from the snapshot's on, exactly once per rank (the line of the
        # step the pause point closed may come after it: the ranks paused before printing it)
        redo = tj.per_step(tj.steps(after))
        first_after = min(redo)
        assert first_after in (step - 1, step), (first_after, step, diag)
        assert sorted(redo) == list(range(first_after, d.steps)) and all(sum(c.values()) == d.ranks
                                                                         for c in redo.values()), diag
        first = tj.per_step(tj.steps(before))
        assert sorted(first) == list(range(max(first) + 1)) and first_after <= max(first) + 1, diag
        recomputed = max(first) + 1 - first_after
        assert abs(going["data"]["recompute_steps"] - recomputed) <= 1, (going["data"], recomputed, diag)
        assert "ckpt loaded" not in text and "Traceback" not in text, diag
        print(f"snapshot {used} of step {step}; steps {first_after}..{max(first)} ({recomputed}) computed again; "
              f"{back['data']['decision_to_resumed_s']} s from the loss found to every rank resumed")

        dn = tj.node(node)
        assert "DRAIN" in dn["state"] and dn.get("reason", "").startswith(f"torchpass: {node} failed outright"), dn
    finally:
        for j in jobs:
            tj.run(["scancel", str(j)])
        back_node = _revive(cluster, node) if crashed else None
        drill.leave_clean(d, jobs)
    assert back_node is not None and "DRAIN" in back_node["state"], back_node
    assert all(tj.node(n)["state"] == ["IDLE"] for n in NODES), [(n, tj.node(n)["state"]) for n in NODES]
