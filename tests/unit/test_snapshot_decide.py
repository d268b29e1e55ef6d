"""Whole-job snapshots in the pure decision core: every rank pauses at one collective, every
rank is dumped, every rank resumes in place; a failed dump rolls everyone back; no snapshot beside a
migration. Driven with an injected clock, the executor played by hand (machine.apply)."""

from __future__ import annotations

import pytest

from torchpass.coordinator import contract as ct
from torchpass.coordinator import machine as mc
from torchpass.coordinator.decide import decide
from torchpass.coordinator.decide_snapshot import periodic_snapshot_due
from torchpass.coordinator.model import CoordState
from torchpass.coordinator.policy import CoordinatorPolicy
from torchpass.health_state import State

P = CoordinatorPolicy(pause_timeout_s=10.0, dump_timeout_s=20.0, rebuild_timeout_s=10.0, max_resume_attempts=2,
                      spare_timeout_s=30.0)
NODES = ("node1", "node2", "node3")


class Sim:
    def __init__(self, nodes=NODES, spares=("node4",)):
        self.now = 1000.0
        self.state = CoordState(job_id=7)
        self.actions: list = []
        for r, n in enumerate(nodes):
            self.feed(mc.RankRegistered(r, n, len(nodes)))
        for n in (*nodes, *spares):
            self.feed(mc.NodeHealthChanged(n, State.HEALTHY))
        for s in spares:
            self.feed(mc.SpareAdded(s))
        self.feed(*[mc.RankProgress(r, 100, 10) for r in range(len(nodes))])

    def feed(self, *events):
        for ev in events:
            self.state = mc.apply(self.state, ev, self.now)
        return self

    def tick(self, dt: float = 0.0, *events) -> list:
        self.now += dt
        self.feed(*events)
        d = decide(self.now, self.state, P, strict=True)
        self.state = d.state
        self.actions.extend(d.actions)
        self.reason = d.reason
        return list(d.actions)

    def of(self, cls, acts=None) -> list:
        return [a for a in (self.actions if acts is None else acts) if isinstance(a, cls)]

    def events(self, kind: str) -> list:
        return [a for a in self.of(ct.Event) if a.kind == kind]

    def snapshot(self, sid: str = "s1") -> ct.PauseAt:
        self.state = mc.accept_snapshot(self.state, sid, self.now)
        acts = self.tick()
        (pause,) = self.of(ct.PauseAt, acts)
        return pause

    def quiesce(self, pause: ct.PauseAt) -> list:
        return self.tick(0.5, *[mc.Quiesced(r, pause.generation, pause.at) for r in range(len(NODES))])

    def image(self, r: int, sid: str = "s1") -> ct.SnapImage:
        return ct.SnapImage(r, NODES[r], f"/snap/snapshots/job7/{sid}/rank{r}", f"sum{r}", 1_000_000 * (r + 1))


def test_success_pauses_dumps_every_rank_and_resumes_in_place():
    sim = Sim()
    pause = sim.snapshot()
    assert pause.hold_ranks == (0, 1, 2) and pause.generation == 1  # every rank held: no socket for CRIU
    dumps = sim.of(ct.DumpRank, sim.quiesce(pause))
    assert sorted((d.rank, d.node, d.snapshot) for d in dumps) == [(0, "node1", "s1"), (1, "node2", "s1"),
                                                                     (2, "node3", "s1")]
    assert {d.keep for d in dumps} == {2}  # the policy's retention: tpassd's quota check before the dump
    assert "snapshot s1: dumping" in sim.reason
    acts = sim.tick(1.0, *[ct.RankDumped("s1", sim.image(r), {"criu_dump_s": 0.2}) for r in range(3)])
    (resume,) = sim.of(ct.ResumeInPlace, acts)
    (commit,) = sim.of(ct.CommitSnapshot, acts)
    assert resume.migration == "s1" and resume.generation == 1 and resume.master == "node1"
    assert commit.node == "node1" and [i.rank for i in commit.ranks] == [0, 1, 2] and commit.keep == 2
    assert sim.tick(0.1, *[mc.Resumed(r, 1) for r in range(3)]) == []  # the manifest is still being written
    sim.tick(0.1, ct.SnapshotCommitted("s1", "/state/jobs/7/snapshots/s1.json", 6_000_000, ("s0",)))
    (done,) = sim.events("snapshot.completed")
    assert done.data["snapshot"] == "s1" and done.data["bytes"] == 6_000_000 and done.data["removed"] == ["s0"]
    assert done.data["pause_s"] == pytest.approx(1.1) and done.data["step"] == 10
    assert sim.state.snapshot is None and sim.state.generation == 1
    assert not sim.events("snapshot.failed") and not sim.of(ct.DiscardSnapshot)


def test_a_failed_dump_resumes_every_rank_and_removes_the_partial_snapshot():
    sim = Sim()
    sim.quiesce(sim.snapshot())
    acts = sim.tick(1.0, ct.RankDumped("s1", sim.image(0)), ct.RankDumpFailed("s1", 1, "criu dump failed"))
    (resume,) = sim.of(ct.ResumeInPlace, acts)
    (discard,) = sim.of(ct.DiscardSnapshot, acts)
    assert resume.generation == 1 and "criu dump failed" in resume.why
    assert discard.nodes == NODES
    assert not sim.of(ct.CommitSnapshot)
    sim.tick(0.5, ct.RankDumped("s1", sim.image(2)))  # late: changes nothing
    assert not sim.of(ct.CommitSnapshot)
    sim.tick(0.5, *[mc.Resumed(r, 1) for r in range(3)])
    (failed,) = sim.events("snapshot.failed")
    assert "dump of rank 1 failed: criu dump failed" in failed.data["why"]
    assert not sim.events("snapshot.completed") and sim.state.snapshot is None and sim.state.generation == 1


def test_a_pause_that_times_out_resumes_every_rank():
    sim = Sim()
    pause = sim.snapshot()
    sim.tick(1.0, mc.Quiesced(0, pause.generation, pause.at))
    acts = sim.tick(P.pause_timeout_s)
    (resume,) = sim.of(ct.ResumeInPlace, acts)
    assert "did not quiesce" in resume.why and not sim.of(ct.DumpRank)


def test_a_failed_manifest_removes_the_images_and_fails():
    sim = Sim()
    sim.quiesce(sim.snapshot())
    sim.tick(1.0, *[ct.RankDumped("s1", sim.image(r)) for r in range(3)])
    acts = sim.tick(0.1, *[mc.Resumed(r, 1) for r in range(3)], ct.SnapshotCommitFailed("s1", "checksum mismatch"))
    assert sim.of(ct.DiscardSnapshot, acts)
    (failed,) = sim.events("snapshot.failed")
    assert failed.data["why"] == "checksum mismatch"


def test_refused_while_a_migration_runs_and_a_migration_waits_for_a_snapshot():
    sim = Sim()
    sim.state, mid = mc.accept_operator(sim.state, "node2", None, sim.now)
    with pytest.raises(mc.OperatorRejected) as exc:
        mc.accept_snapshot(sim.state, "s1", sim.now)
    assert exc.value.code == "conflict" and mid in str(exc.value)
    sim.tick()  # the migration starts (spare chosen, pause sent)
    assert sim.state.migration is not None
    with pytest.raises(mc.OperatorRejected):
        mc.accept_snapshot(sim.state, "s1", sim.now)

    sim2 = Sim()
    pause = sim2.snapshot()
    sim2.tick(0.1, mc.NodeHealthChanged("node2", State.DEGRADED, ("ecc",)))
    assert sim2.state.migration is None  # a migration waits while the snapshot runs
    sim2.quiesce(pause)
    sim2.tick(1.0, *[ct.RankDumped("s1", sim2.image(r)) for r in range(3)])
    sim2.tick(0.1, *[mc.Resumed(r, 1) for r in range(3)], ct.SnapshotCommitted("s1", "/m", 1, ()))
    assert sim2.events("snapshot.completed")
    assert sim2.state.migration is not None and sim2.state.migration.node == "node2"
    assert sim2.state.migration.generation == 2  # after the snapshot's generation


def test_a_second_snapshot_is_refused_while_one_runs():
    sim = Sim()
    sim.snapshot()
    with pytest.raises(mc.OperatorRejected) as exc:
        mc.accept_snapshot(sim.state, "s2", sim.now)
    assert exc.value.code == "conflict"


def test_a_node_lost_during_the_pause_resumes_the_survivors():
    sim = Sim()
    pause = sim.snapshot()
    acts = sim.tick(0.5, mc.NodeHealthChanged("node3", State.FAILED, ("gone",), reachable=False),
                    mc.Quiesced(0, pause.generation, pause.at))
    assert sim.of(ct.ResumeInPlace, acts) and sim.of(ct.HandToSlurm, acts)
    assert not sim.of(ct.DumpRank)


def test_a_rank_past_the_pause_point_rearms_a_later_one():
    sim = Sim()
    pause = sim.snapshot()
    acts = sim.tick(0.2, mc.Armed(1, pause.at, pause.generation, False, pause.at + 5))
    (again,) = sim.of(ct.PauseAt, acts)
    assert again.at > pause.at + 5 and again.hold_ranks == (0, 1, 2) and again.generation == pause.generation
    (ev,) = sim.events("pause.rearmed")
    assert ev.data["snapshot"] == "s1"
    dumps = sim.of(ct.DumpRank, sim.tick(0.5, *[mc.Quiesced(r, again.generation, again.at) for r in range(3)]))
    assert len(dumps) == 3


@pytest.mark.parametrize("seed", range(40))
def test_never_left_paused_whatever_comes_back(seed):
    """Outcomes lost, late, failed, in any order: the snapshot ends within the policy's bound, and a
    resume in place follows the last pause."""
    import random

    rng = random.Random(seed)
    sim = Sim()
    pause = sim.snapshot()
    start = sim.now
    while sim.state.snapshot is not None:
        assert sim.now - start <= P.max_pause_s(), sim.reason
        s = sim.state.snapshot
        evs: list = []
        for r in range(3):
            if rng.random() < 0.7:
                if s.phase == "pause":
                    evs.append(mc.Quiesced(r, s.generation, s.pause_at) if rng.random() < 0.9
                               else mc.Armed(r, s.pause_at, s.generation, False, s.pause_at + 1))
                elif s.phase == "dump":
                    evs.append(ct.RankDumped("s1", sim.image(r)) if rng.random() < 0.9
                               else ct.RankDumpFailed("s1", r, "boom"))
                elif s.phase == "resume":
                    evs.append(mc.Resumed(r, s.generation, cancelled=rng.random() < 0.2))
        if s.phase == "resume" and rng.random() < 0.5:
            evs.append(ct.SnapshotCommitted("s1", "/m", 1) if rng.random() < 0.8
                       else ct.SnapshotCommitFailed("s1", "x"))
        rng.shuffle(evs)
        sim.tick(rng.choice((0.1, 1.0, 5.0)), *evs)
    pauses = [i for i, a in enumerate(sim.actions) if isinstance(a, ct.PauseAt)]
    resumes = [i for i, a in enumerate(sim.actions) if isinstance(a, (ct.ResumeInPlace, ct.HandToSlurm))]
    assert pauses and resumes and resumes[-1] > pauses[-1]
    assert len(sim.events("snapshot.completed")) + len(sim.events("snapshot.failed")) == 1
    assert pause.generation == 1


# --- periodic snapshots (policy.snapshot_every_s; --torchpass=snapshot_every=S) -------------------
def test_periodic_snapshots_are_due_every_interval_of_training_after_registration():
    every = CoordinatorPolicy(snapshot_every_s=60.0)
    sim = Sim()
    sim.tick()
    start = sim.state.snapshot_clock
    assert start == sim.now  # every rank registered: the interval starts
    assert not periodic_snapshot_due(sim.now + 59.9, sim.state, every)
    assert periodic_snapshot_due(sim.now + 60.0, sim.state, every)
    assert not periodic_snapshot_due(sim.now + 600.0, sim.state, P)  # snapshot_every_s 0: never

    sim.now += 60.0
    sim.state = mc.accept_snapshot(sim.state, "p1", sim.now, "periodic")
    (pause,) = sim.of(ct.PauseAt, sim.tick())
    assert not periodic_snapshot_due(sim.now + 120.0, sim.state, every)  # one in flight
    sim.quiesce(pause)
    sim.tick(1.0, *[ct.RankDumped("p1", sim.image(r, "p1")) for r in range(3)])
    sim.tick(0.5, *[mc.Resumed(r, 1) for r in range(3)], ct.SnapshotCommitted("p1", "/m/p1.json", 6, ()))
    (done,) = sim.events("snapshot.completed")
    assert done.data["trigger"] == "periodic"
    ended = sim.now
    assert sim.state.snapshot is None and sim.state.snapshot_clock == ended  # counts from its end
    assert not periodic_snapshot_due(ended + 59.0, sim.state, every)
    assert periodic_snapshot_due(ended + 60.0, sim.state, every)


def test_a_periodic_snapshot_waits_while_one_cannot_be_taken():
    every = CoordinatorPolicy(snapshot_every_s=10.0)
    sim = Sim(nodes=("node1", "node2", "node3"))
    half = CoordState(job_id=7)  # before every rank registered, no interval runs
    half = mc.apply(half, mc.RankRegistered(0, "node1", 3), 0.0)
    assert decide(100.0, half, every).state.snapshot_clock is None
    sim.tick()
    sim.state = mc.accept_operator(sim.state, "node2", None, sim.now)[0]  # a migration queued
    assert not periodic_snapshot_due(sim.now + 10.0, sim.state, every)
    unprotected = mc.apply(sim.state, ct.RankUnprotected(1, "a store passed by the script"), sim.now)
    assert not periodic_snapshot_due(sim.now + 10.0, unprotected, every)


# -- tpassctl snapshot --stop ------------------------------------------------------------------------
def _stopped_dump(sim) -> list:
    sim.state = mc.accept_snapshot(sim.state, "s1", sim.now, stop=True)
    (pause,) = sim.of(ct.PauseAt, sim.tick())
    sim.quiesce(pause)
    return sim.tick(1.0, *[ct.RankDumped("s1", sim.image(r)) for r in range(3)])


def test_stop_keeps_every_rank_paused_until_the_manifest_is_written_then_holds_the_job():
    sim = Sim()
    acts = _stopped_dump(sim)
    assert sim.of(ct.CommitSnapshot, acts) and not sim.of(ct.ResumeInPlace, acts), "no resume with --stop"
    assert "holding the job (--stop)" in sim.reason
    acts = sim.tick(0.2, ct.SnapshotCommitted("s1", "/state/jobs/7/snapshots/s1.json", 6_000_000))
    (stop,) = sim.of(ct.StopJob, acts)
    assert (stop.snapshot, stop.snapshot_step, stop.generation, stop.world_size, stop.nodes) == \
        ("s1", 10, 1, 3, NODES)
    (going,) = sim.events("job.stopping")
    assert going.data["snapshot"] == "s1" and going.data["bytes"] == 6_000_000 and going.data["stop"] is True
    assert "tpassctl resume 7" in going.message
    assert sim.state.last_snapshot.id == "s1" and not sim.of(ct.ResumeInPlace)
    assert sim.tick(30.0) == [], "the job is being held: nothing more (the coordinator ends with it)"
    assert not sim.events("snapshot.completed") and not sim.events("snapshot.failed")


def test_a_stop_that_cannot_hold_the_job_resumes_every_rank_and_keeps_the_snapshot():
    sim = Sim()
    _stopped_dump(sim)
    sim.tick(0.2, ct.SnapshotCommitted("s1", "/state/jobs/7/snapshots/s1.json", 6_000_000))
    acts = sim.tick(0.5, ct.JobStopFailed("s1", "scontrol requeuehold failed: Access denied"))
    (resume,) = sim.of(ct.ResumeInPlace, acts)
    assert resume.generation == 1 and "the stop failed" in resume.why
    (failed,) = sim.events("job.stop_failed")
    assert "Access denied" in failed.message
    sim.tick(0.5, *[mc.Resumed(r, 1) for r in range(3)])
    (done,) = sim.events("snapshot.completed")  # the snapshot itself is complete and kept
    assert done.data["snapshot"] == "s1" and sim.state.snapshot is None and not sim.of(ct.DiscardSnapshot)


def test_a_stop_whose_manifest_fails_resumes_every_rank_and_removes_the_images():
    sim = Sim()
    _stopped_dump(sim)
    acts = sim.tick(0.2, ct.SnapshotCommitFailed("s1", "checksum mismatch"))
    assert sim.of(ct.ResumeInPlace, acts) and sim.of(ct.DiscardSnapshot, acts) and not sim.of(ct.StopJob)
    sim.tick(0.5, *[mc.Resumed(r, 1) for r in range(3)])
    (failed,) = sim.events("snapshot.failed")
    assert "checksum mismatch" in failed.data["why"]


def test_the_resumed_run_resumes_the_restored_ranks_once_all_are_back_and_forgets_the_stop():
    from torchpass.coordinator.decide_relaunch import resumed_from_stop

    sim = Sim(nodes=())
    sim.state = resumed_from_stop(7, sim.now, "s1", 10, 1, 3, 0)
    sim.feed(*[mc.NodeHealthChanged(n, State.HEALTHY) for n in ("node5", "node6", "node7")])
    sim.tick(0.1, mc.RankRegistered(0, "node5", 3, generation=0, restored="s1"),
             mc.RankRegistered(1, "node6", 3, generation=0, restored="s1"))
    assert not sim.of(ct.ResumeInPlace) and check_snapshot_refused(sim.state)
    acts = sim.tick(0.1, mc.RankRegistered(2, "node7", 3, generation=0, restored="s1"))
    (resume,) = sim.of(ct.ResumeInPlace, acts)
    assert resume.generation == 1 and resume.master == "node5"
    (back,) = sim.events("job.restored")
    assert "resume of job 7" in back.message
    acts = sim.tick(0.5, *[mc.Resumed(r, 1) for r in range(3)])
    (forget,) = sim.of(ct.ForgetStopped, acts)
    (done,) = sim.events("job.resumed")
    assert forget.snapshot == "s1" and done.data["snapshot_step"] == 10
    assert sim.state.relaunch is None and not check_snapshot_refused(sim.state)


def check_snapshot_refused(st) -> bool:
    from torchpass.coordinator.decide_snapshot import check_snapshot_request

    return check_snapshot_request(st) is not None


def test_a_resumed_run_whose_step_started_afresh_says_so_and_forgets_the_stop():
    from torchpass.coordinator.decide_relaunch import resumed_from_stop

    sim = Sim(nodes=())
    sim.state = resumed_from_stop(7, sim.now, "s1", 10, 1, 3, 0)
    acts = sim.tick(0.1, *[mc.RankRegistered(r, f"node{r + 1}", 3) for r in range(3)])
    (missed,) = sim.events("job.restore_missed")
    assert missed.data["fresh"] == [0, 1, 2] and sim.of(ct.ForgetStopped, acts) and not sim.of(ct.ResumeInPlace)
    assert sim.state.relaunch is None


def test_stop_is_refused_after_a_relaunch():
    from dataclasses import replace

    sim = Sim()
    sim.state = replace(sim.state, relaunches=1)
    with pytest.raises(mc.OperatorRejected, match="relaunched after a lost node"):
        mc.accept_snapshot(sim.state, "s1", sim.now, stop=True)
    mc.accept_snapshot(sim.state, "s1", sim.now)  # leave-running is fine
