"""The coordinator's pure decision core, driven scenario by scenario with an injected clock.

A ``Sim`` holds the state, a clock moved by hand, and every action decided
so far; it plays the executor by feeding outcomes through machine.apply.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from torchpass.coordinator import machine as mc
from torchpass.coordinator.contract import (
    AbortRestore,
    Drain,
    Event,
    HandToSlurm,
    KillSource,
    MigrationDump,
    PauseAt,
    RequestSpare,
    Restore,
    Resume,
    ResumeInPlace,
    Shrink,
    Transfer,
)
from torchpass.coordinator.decide import decide, job_ended
from torchpass.coordinator.model import CoordState
from torchpass.coordinator.phases import Phase
from torchpass.coordinator.policy import CoordinatorPolicy
from torchpass.health import State

P = CoordinatorPolicy(
    stall_s=30.0, pause_margin_collectives=8, pause_fallback_collectives=8, spare_timeout_s=30.0, pause_timeout_s=10.0,
    dump_timeout_s=20.0,
    transfer_timeout_s=10.0, restore_timeout_s=20.0, kill_timeout_s=5.0, rebuild_timeout_s=10.0,
    finalize_timeout_s=10.0, max_spare_attempts=2, max_resume_attempts=2, retry_backoff_s=100.0,
    spare_retry_s=200.0, max_attempts_per_node=3,
)


class Sim:
    def __init__(self, nodes=("node1", "node2", "node3"), spares=("node4",), per_node=2, policy=P):
        self.now = 1000.0
        self.policy = policy
        self.state = CoordState(job_id=7)
        self.actions: list = []
        self.decisions: list = []
        rank = 0
        for n in nodes:
            for _ in range(per_node):
                self.feed(mc.RankRegistered(rank, n, len(nodes) * per_node))
                rank += 1
        for n in (*nodes, *spares):
            self.feed(mc.NodeHealthChanged(n, State.HEALTHY))
        for s in spares:
            self.feed(mc.SpareAdded(s))
        self.feed(*[mc.RankProgress(r, 100, 10) for r in range(rank)])

    # -- plumbing ------------------------------------------------------------------
    @property
    def m(self):
        return self.state.migration

    def feed(self, *events):
        for ev in events:
            self.state = mc.apply(self.state, ev, self.now)
        return self

    def tick(self, dt: float = 0.0, *events):
        self.now += dt
        self.feed(*events)
        d = decide(self.now, self.state, self.policy)
        self.state = d.state
        self.actions.extend(d.actions)
        self.decisions.append(d)
        return d

    def events(self, kind=None):
        return [a for a in self.actions if isinstance(a, Event) and (kind is None or a.kind == kind)]

    @staticmethod
    def of(d, cls):
        return [a for a in d.actions if isinstance(a, cls)]

    # -- executor shortcuts --------------------------------------------------------
    def degrade(self, node, why="gpu0: Xid 63 (row remap pending)", dt=1.0):
        return self.tick(dt, mc.NodeHealthChanged(node, State.DEGRADED, (why,)))

    def quiesce_all(self, dt=0.5):
        m = self.m
        return self.tick(dt, *[mc.Quiesced(r, m.generation, m.pause_at) for r in self.state.ranks])

    def dump_all(self, dt=0.3):
        m = self.m
        return self.tick(dt, *[mc.MigrationDumpDone(m.id, r, f"/shared/img/{m.id}/r{r}", f"sha-{r}",
                                               {"criu_dump_s": 0.2, "cuda_checkpoint_s": 0.05}) for r in m.ranks])

    def transfer_all(self, dt=0.1):
        m = self.m
        return self.tick(dt, *[mc.TransferDone(m.id, r, m.target, m.images[r].path, m.images[r].checksum)
                               for r in m.ranks])

    def restore_all(self, dt=0.2):
        m = self.m
        return self.tick(dt, *[mc.RestoreDone(m.id, r, m.target, {"criu_restore_s": 0.15}) for r in m.ranks])

    def kill_source(self, dt=0.05):
        return self.tick(dt, mc.SourceKilled(self.m.id, self.m.node))

    def resume_all(self, dt=0.06, cancelled=False):
        m = self.m
        return self.tick(dt, *[mc.Resumed(r, m.generation, self.state.ranks[r].node, cancelled)
                               for r in self.state.ranks])

    def finish(self, dt=0.5):
        mid, node = self.m.id, self.m.node
        self.tick(dt, mc.Drained(mid, node))
        return self.tick(dt, mc.Shrunk(mid, (node,)))

    def end_job(self, dt=0.1):
        """The coordinator stops with the job (Driver.close)."""
        self.now += dt
        d = job_ended(self.now, self.state, self.policy)
        self.state = d.state
        self.actions.extend(d.actions)
        self.decisions.append(d)
        return d

    def to_restore(self):
        self.degrade("node2")
        self.quiesce_all()
        self.dump_all()
        self.transfer_all()
        assert self.m.phase == Phase.RESTORE


# ============================================================================
def _to_drain(sim):
    sim.to_restore()
    sim.restore_all()
    sim.kill_source()
    sim.resume_all()
    assert sim.m.phase == Phase.DRAIN


def test_a_job_that_ends_while_its_source_node_is_released_completes_its_migration():
    # CI, mesh3d: training ended 5 s after the resume while slurmctld did not answer the shrink's
    # query; the coordinator stopped and the move, done, was never recorded.
    sim = Sim()
    _to_drain(sim)
    d = sim.end_job()
    (done,) = sim.of(d, Event)
    assert done.kind == "migration.completed" and done.data["outcome"] == "completed"
    assert done.message == ("m1: moved ranks [2, 3] from node2 to node4; the job ended before node2 was released "
                            "(drain of node2 not confirmed: the job ended first and node2 leaves with it)")
    assert sim.m is None and sim.state.history[-1].outcome == Result.COMPLETED
    assert sim.state.spare("node4").status == "used"
    assert d.reason == "the job has ended" and not sim.of(d, Shrink)

    sim = Sim()
    _to_drain(sim)
    sim.tick(0.5, mc.Drained("m1", "node2"))
    assert sim.m.phase == Phase.SHRINK
    (done,) = sim.of(sim.end_job(), Event)
    assert done.kind == "migration.completed"
    assert done.message.endswith("(shrink not confirmed: the job ended first and node2 leaves with it)")
    assert done.data["phase_durations"]["drain"] == pytest.approx(0.5)


def test_a_job_that_ends_records_nothing_for_a_migration_still_moving_or_none():
    sim = Sim()
    assert sim.end_job().actions == ()
    sim.to_restore()
    d = sim.end_job()  # paused: the job was cancelled under it; nothing is claimed
    assert d.actions == () and sim.m.phase == Phase.RESTORE


def test_idle_job_does_nothing():
    sim = Sim()
    d = sim.tick()
    assert d.actions == () and d.reason == "no migration needed"


def test_no_migration_starts_while_slurmctld_is_unreachable_and_it_starts_when_it_answers():
    sim = Sim()
    sim.tick(1.0, mc.SlurmReachability(False, "no answer for 15 s: connection refused"))
    d = sim.degrade("node2")
    assert sim.m is None and not sim.of(d, PauseAt)
    assert d.reason == "no migration starts while slurmctld is unreachable (no answer for 15 s: connection refused)"
    d = sim.tick(5.0, mc.SlurmReachability(True))
    assert sim.m is not None and sim.m.node == "node2" and sim.of(d, PauseAt)


def test_happy_path_through_every_phase_with_durations():
    sim = Sim()
    d = sim.degrade("node2")
    assert [e.kind for e in sim.of(d, Event)] == ["migration.started", "spare.chosen"]
    (pause,) = sim.of(d, PauseAt)
    assert pause == PauseAt("m1", 108, 1, (2, 3))
    assert sim.m.phase == Phase.PAUSE and sim.m.target == "node4" and sim.m.target_how == "hot"
    assert sim.state.spare("node4").status == "reserved"

    d = sim.quiesce_all()
    assert sim.of(d, MigrationDump) == [MigrationDump("m1", 2, "node2"), MigrationDump("m1", 3, "node2")]
    d = sim.dump_all()
    assert sim.of(d, Transfer) == [Transfer("m1", r, f"/shared/img/m1/r{r}", f"sha-{r}", "node2", "node4")
                                   for r in (2, 3)]
    d = sim.transfer_all()
    assert sim.of(d, Restore) == [Restore("m1", r, "node4", f"/shared/img/m1/r{r}", f"sha-{r}") for r in (2, 3)]
    d = sim.restore_all()
    assert sim.of(d, KillSource) == [KillSource("m1", "node2", (2, 3))]
    assert sim.of(d, Resume) == []  # never resume before the source copies are gone
    d = sim.kill_source()
    assert sim.of(d, Resume) == [Resume("m1", 1, "node1")]
    assert sim.state.ranks[2].node == "node4" and sim.state.ranks[3].node == "node4"
    d = sim.resume_all()
    assert sim.of(d, Drain) == [Drain("m1", "node2", "torchpass: gpu0: Xid 63 (row remap pending)")]
    assert sim.events("migration.resumed")
    d = sim.tick(0.5, mc.Drained("m1", "node2"))
    assert sim.of(d, Shrink) == [Shrink("m1", ("node2",))]
    d = sim.tick(0.5, mc.Shrunk("m1", ("node2",)))
    (done,) = sim.of(d, Event)
    assert done.kind == "migration.completed"
    assert done.data["outcome"] == "completed" and done.data["target"] == "node4"
    pd = done.data["phase_durations"]
    expected = {"detect": 0.0, "spare": 0.0, "pause": 0.5, "dump": 0.3, "transfer": 0.1, "restore": 0.2,
                "kill_source": 0.05, "rebuild": 0.06, "drain": 0.5, "shrink": 0.5}
    for k, v in expected.items():
        assert pd[k] == pytest.approx(v, abs=1e-6), k
    # paused = training standing still: from the last rank reaching T (the ranks trained
    # on during the 0.5 s "pause" phase) to the end of the rebuild.
    assert pd["paused"] == pytest.approx(0.3 + 0.1 + 0.2 + 0.05 + 0.06)
    assert pd["total"] == pytest.approx(sum(expected.values()))
    assert done.data["tool_durations"] == {"dump.criu_dump_s": 0.2, "dump.cuda_checkpoint_s": 0.05,
                                           "restore.criu_restore_s": 0.15}
    st = sim.state
    assert st.migration is None and st.generation == 1 and st.released == {"node2"}
    assert st.spare("node4").status == "used"
    assert st.history[-1].outcome == "completed"
    # node2 is still degraded but no longer in the job: nothing more happens.
    d = sim.tick(1000)
    assert d.actions == () and d.reason == "no migration needed"


def test_durations_end_when_the_last_outcome_arrives_not_at_the_next_tick():
    sim = Sim()
    sim.degrade("node2")
    m = sim.m
    sim.now += 0.25
    sim.feed(*[mc.Quiesced(r, m.generation, m.pause_at) for r in sim.state.ranks])
    sim.tick(3.0)  # decide runs late
    assert sim.m.phase == Phase.DUMP and sim.m.phase_durations["pause"] == pytest.approx(0.25)


def test_restore_failure_rolls_back_to_the_source_and_says_why():
    sim = Sim()
    sim.to_restore()
    sim.tick(0.1, mc.RestoreDone("m1", 2, "node4"))
    d = sim.tick(0.1, mc.RestoreFailed("m1", 3, "node4", "criu restore exited 1: can't restore pid 1"))
    assert sim.of(d, AbortRestore) == [AbortRestore("m1", "node4", (2, 3))]
    (rip,) = sim.of(d, ResumeInPlace)
    assert rip.generation == 1 and rip.master == "node1" and "criu restore exited 1" in rip.why
    assert sim.of(d, KillSource) == []  # the source was never killed
    (ev,) = sim.events("migration.rollback")
    assert "restore on node4 failed: rank 3: criu restore exited 1" in ev.message
    assert sim.m.phase == Phase.ROLLBACK and sim.state.spare("node4").status == "free"
    assert all(sim.state.ranks[r].node == "node2" for r in (2, 3))
    d = sim.resume_all(dt=0.1)
    (rb,) = sim.events("migration.rolled_back")
    assert rb.data["outcome"] == "rolled_back" and "rollback" in rb.data["phase_durations"]
    st = sim.state
    assert st.migration is None and st.generation == 1 and st.failures == {"node2": 1}
    # node2 is still degraded: tried again only after the back-off, with a fresh generation.
    assert sim.tick(50).actions == ()
    d = sim.tick(51)
    (pause,) = sim.of(d, PauseAt)
    assert pause.migration == "m2" and pause.generation == 2


def test_spare_dies_during_restore_next_spare_is_used():
    sim = Sim(spares=("node4", "node5"))
    sim.to_restore()
    d = sim.tick(0.1, mc.RestoreFailed("m1", 2, "node4", "node4 stopped answering", target_lost=True))
    assert sim.of(d, AbortRestore) == [AbortRestore("m1", "node4", (2, 3))]
    assert [a.target for a in sim.of(d, Transfer)] == ["node5", "node5"]
    assert sim.of(d, ResumeInPlace) == [] and sim.m.target == "node5" and sim.m.phase == Phase.TRANSFER
    assert sim.state.spare("node4").status == "lost" and sim.state.spare("node5").status == "reserved"
    (ev,) = sim.events("spare.replaced")
    assert "node4 lost" in ev.message and "node5" in ev.message
    # A late answer from the dead spare changes nothing.
    before = sim.state
    sim.feed(mc.RestoreDone("m1", 3, "node4"))
    assert sim.state == before
    sim.transfer_all()
    sim.restore_all()
    sim.kill_source()
    sim.resume_all()
    sim.finish()
    assert sim.state.history[-1].outcome == "completed" and sim.state.history[-1].target == "node5"
    assert sim.state.ranks[2].node == "node5"


def test_spare_health_failing_mid_transfer_is_detected_without_an_outcome():
    sim = Sim(spares=("node4", "node5"))
    sim.degrade("node2")
    sim.quiesce_all()
    sim.dump_all()
    d = sim.tick(0.1, mc.NodeHealthChanged("node4", State.FAILED, ("host: kernel panic",), reachable=False))
    assert [a.target for a in sim.of(d, Transfer)] == ["node5", "node5"]
    assert sim.of(d, HandToSlurm) == []  # a spare runs no ranks: nothing to hand over


def test_spare_dies_and_no_other_spare_rolls_back():
    sim = Sim(spares=("node4",))
    sim.to_restore()
    d = sim.tick(0.1, mc.RestoreFailed("m1", 2, "node4", "node4 gone", target_lost=True))
    assert len(sim.of(d, ResumeInPlace)) == 1
    assert "no other spare is free" in sim.events("migration.rollback")[0].message


def test_spare_attempts_are_bounded():
    sim = Sim(spares=("node4", "node5", "node6"), policy=replace(P, max_spare_attempts=2))
    sim.to_restore()
    sim.tick(0.1, mc.RestoreFailed("m1", 2, "node4", "gone", target_lost=True))
    assert sim.m.target == "node5"
    sim.transfer_all()
    d = sim.tick(0.1, mc.RestoreFailed("m1", 2, "node5", "gone too", target_lost=True))
    assert len(sim.of(d, ResumeInPlace)) == 1 and sim.m.phase == Phase.ROLLBACK


def test_no_hot_spare_asks_slurmctld_then_runs_unprotected_without_pausing():
    sim = Sim(spares=())
    d = sim.degrade("node2")
    assert sim.of(d, RequestSpare) == [RequestSpare("m1", "expand", "node2")]
    assert sim.of(d, PauseAt) == []
    d = sim.tick(2, mc.SpareUnavailable("m1", "expand", "permit_job_expansion is not set"))
    assert sim.of(d, RequestSpare) == [RequestSpare("m1", "companion", "node2")]
    d = sim.tick(2, mc.SpareUnavailable("m1", "companion", "partition gpu has no idle node"))
    (ev,) = sim.of(d, Event)
    assert ev.kind == "spare.unavailable"
    assert "permit_job_expansion is not set" in ev.message and "no idle node" in ev.message
    assert "continues on node2 unprotected" in ev.message
    assert not any(isinstance(a, (PauseAt, Resume, ResumeInPlace)) for a in sim.actions)
    assert sim.m is None and "no spare, running unprotected: node2" in d.reason
    assert sim.tick(100).actions == ()
    d = sim.tick(101)  # spare_retry_s later it asks again
    assert sim.of(d, RequestSpare) == [RequestSpare("m2", "expand", "node2")]


def test_spare_granted_by_slurmctld_is_used_and_the_strategy_logged():
    sim = Sim(spares=())
    sim.degrade("node2")
    d = sim.tick(3, mc.SpareGranted("m1", "node9", "expand"), mc.NodeHealthChanged("node9", State.HEALTHY))
    (pause,) = sim.of(d, PauseAt)
    assert sim.m.target == "node9" and sim.m.target_how == "expand"
    assert "expand spare" in sim.events("spare.chosen")[0].message
    assert sim.m.phase_durations["spare"] == pytest.approx(3.0)
    assert [e.data["strategy"] for e in sim.events("spare.requested")] == ["expand"]


def test_second_fault_moves_the_hot_spare_rank_on_to_a_slurmctld_spare():
    """Two faults one after the other: node2 -> node4 (hot), then node4 -> node9 (expand, from slurmctld)."""
    sim = Sim()
    sim.degrade("node2")
    sim.quiesce_all()
    sim.dump_all()
    sim.transfer_all()
    sim.restore_all()
    sim.kill_source()
    sim.resume_all()
    sim.finish()
    assert sim.m is None and sim.state.spare("node4").status == "used"
    assert sim.state.rank_nodes()["node4"] == (2, 3)
    # The former hot spare now runs ranks 2 and 3 and degrades in its turn.
    d = sim.degrade("node4")
    assert sim.of(d, RequestSpare) == [RequestSpare("m2", "expand", "node4")]
    assert sim.of(d, PauseAt) == []  # nothing paused while slurmctld is asked
    d = sim.tick(0.4, mc.SpareGranted("m2", "node9", "expand", allocation=31))
    assert d.actions == ()  # its tpassd has not reported yet
    d = sim.tick(0.3, mc.NodeHealthChanged("node9", State.HEALTHY))
    (pause,) = sim.of(d, PauseAt)
    assert pause.hold_ranks == (2, 3) and pause.generation == 2
    (chosen,) = [e for e in sim.events("spare.chosen") if e.data["migration"] == "m2"]
    assert chosen.data == {"migration": "m2", "node": "node4", "target": "node9", "how": "expand",
                           "allocation": 31}
    assert "allocation 31 merged into job 7" in chosen.message
    sim.quiesce_all()
    assert sim.of(sim.decisions[-1], MigrationDump) == [MigrationDump("m2", 2, "node4"),
                                                         MigrationDump("m2", 3, "node4")]
    sim.dump_all()
    sim.transfer_all()
    d = sim.restore_all()
    assert sim.of(d, KillSource) == [KillSource("m2", "node4", (2, 3))]
    sim.kill_source()
    sim.resume_all()
    d = sim.tick(0.5, mc.Drained("m2", "node4"))
    assert sim.of(d, Shrink) == [Shrink("m2", ("node4",))]
    d = sim.tick(0.5, mc.Shrunk("m2", ("node4",)))
    (done,) = [e for e in sim.events("migration.completed") if e.data["migration"] == "m2"]
    assert done.data["target"] == "node9" and sim.state.rank_nodes()["node9"] == (2, 3)
    assert sim.state.released >= {"node2", "node4"} and sim.state.spare("node9").status == "used"
    assert done.message.endswith("node4 drained and released")
    assert done.data["source"] == "released" and "source_kept_why" not in done.data
    assert [e.data["strategy"] for e in sim.events("spare.requested")] == ["expand"]


def test_failed_shrink_says_the_node_stays_in_the_job():
    sim = Sim()
    sim.degrade("node2")
    sim.quiesce_all()
    sim.dump_all()
    sim.transfer_all()
    sim.restore_all()
    sim.kill_source()
    sim.resume_all()
    sim.tick(0.5, mc.Drained("m1", "node2"))
    sim.tick(0.5, mc.ShrinkFailed("m1", "step 7.0 still has a task on node2"))
    (done,) = sim.events("migration.completed")
    assert "node2 drained and kept in the job (shrink failed: step 7.0 still has a task on node2)" in done.message
    assert done.data["source"] == "kept"
    assert done.data["source_kept_why"] == "shrink failed: step 7.0 still has a task on node2"
    assert sim.m is None and "node2" in sim.state.released  # no rank left there: never a candidate again


def test_companion_spare_event_names_its_allocation():
    sim = Sim(spares=(), policy=replace(P, spare_strategies=("hot", "companion")))
    d = sim.degrade("node2")
    assert sim.of(d, RequestSpare) == [RequestSpare("m1", "companion", "node2")]
    sim.tick(1, mc.SpareGranted("m1", "node9", "companion", allocation=55),
             mc.NodeHealthChanged("node9", State.HEALTHY))
    assert sim.state.spare("node9").allocation == 55 and sim.m.target_how == "companion"
    (chosen,) = sim.events("spare.chosen")
    assert chosen.data["allocation"] == 55 and "companion allocation 55" in chosen.message


def test_hot_spare_event_carries_no_allocation():
    sim = Sim()
    sim.degrade("node2")
    (chosen,) = sim.events("spare.chosen")
    assert "allocation" not in chosen.data and chosen.message.endswith("(hot spare)")


def test_spare_request_without_answer_times_out_to_the_next_strategy():
    sim = Sim(spares=())
    sim.degrade("node2")
    assert sim.tick(29).actions == ()
    d = sim.tick(1)
    assert sim.of(d, RequestSpare) == [RequestSpare("m1", "companion", "node2")]


def test_granted_spare_waits_for_its_first_health_report_until_the_deadline():
    sim = Sim(spares=())
    sim.degrade("node2")
    d = sim.tick(1, mc.SpareGranted("m1", "node9", "companion"))
    assert d.actions == () and "report healthy" in d.reason
    d = sim.tick(1, mc.NodeHealthChanged("node9", State.HEALTHY))
    assert sim.of(d, PauseAt) and sim.m.target == "node9"


def test_policy_spare_strategy_order_is_followed():
    sim = Sim(spares=("node4",), policy=replace(P, spare_strategies=("companion",)))
    d = sim.degrade("node2")
    assert sim.of(d, RequestSpare) == [RequestSpare("m1", "companion", "node2")]  # the hot spare is not allowed


def test_pause_timeout_resumes_in_place():
    sim = Sim()
    sim.degrade("node2")
    m = sim.m
    sim.tick(1, *[mc.Quiesced(r, m.generation, m.pause_at) for r in range(5)])
    assert sim.tick(8.9).actions == ()
    d = sim.tick(0.2)
    (rip,) = sim.of(d, ResumeInPlace)
    assert "pause timed out after 10s: ranks [5] did not quiesce at collective 108" in rip.why
    assert sim.of(d, MigrationDump) == []
    sim.tick(0.1, *[mc.Resumed(r, 1, cancelled=(r == 5)) for r in range(6)])
    assert sim.m is None and sim.state.history[-1].outcome == "rolled_back"


def test_refused_pause_is_rearmed_later_then_rolled_back():
    sim = Sim()
    sim.degrade("node2")
    d = sim.tick(0.1, mc.Armed(4, 108, 1, False, 130))
    (pause,) = sim.of(d, PauseAt)
    assert pause.at == 138 and pause.generation == 1
    sim.tick(0.1, mc.Armed(4, 138, 1, False, 150))
    d = sim.tick(0.1, mc.Armed(4, 158, 1, False, 170))
    assert sim.of(d, PauseAt) == [] and len(sim.of(d, ResumeInPlace)) == 1


def test_dump_failure_and_dump_timeout_roll_back():
    sim = Sim()
    sim.degrade("node2")
    sim.quiesce_all()
    d = sim.tick(0.2, mc.MigrationDumpFailed("m1", 3, "criu dump: tcp socket in the tree"))
    assert "dump failed: rank 3: criu dump: tcp socket" in sim.of(d, ResumeInPlace)[0].why
    assert sim.of(d, AbortRestore) == []
    sim2 = Sim()
    sim2.degrade("node2")
    sim2.quiesce_all()
    sim2.tick(0.1, mc.MigrationDumpDone("m1", 2, "/i/2", "c"))
    d = sim2.tick(20)
    assert "dump timed out after 20s (ranks [3])" in sim2.of(d, ResumeInPlace)[0].why


def test_kill_failure_rolls_back_and_aborts_the_restored_copies():
    sim = Sim()
    sim.to_restore()
    sim.restore_all()
    d = sim.tick(0.1, mc.KillFailed("m1", "node2", "tpassd: permission denied"))
    assert sim.of(d, AbortRestore) == [AbortRestore("m1", "node4", (2, 3))]
    assert len(sim.of(d, ResumeInPlace)) == 1


def test_rebuild_timeout_resends_resume_then_hands_stuck_ranks_to_slurm():
    sim = Sim()
    sim.to_restore()
    sim.restore_all()
    sim.kill_source()
    sim.tick(1, *[mc.Resumed(r, 1) for r in (0, 1, 2, 3, 4)])
    d = sim.tick(9)
    assert sim.of(d, Resume) == [Resume("m1", 1, "node1")] and sim.events("resume.retried")
    d = sim.tick(10)
    assert sim.of(d, HandToSlurm) == [
        HandToSlurm("node3", "torchpass: ranks on node3 did not resume after migration m1")]
    assert sim.m is None and sim.state.history[-1].outcome == "stuck"


def test_node_failed_outright_is_handed_to_slurm_once():
    sim = Sim()
    d = sim.tick(1, mc.NodeHealthChanged("node3", State.FAILED, ("tpassd unreachable", "gpu1: Xid 79"),
                                         reachable=False))
    (h,) = sim.of(d, HandToSlurm)
    assert h.node == "node3" and h.reason.startswith("torchpass: node3 failed outright")
    (ev,) = sim.of(d, Event)
    assert ev.kind == "node.lost" and "no clean dump possible" in ev.message
    assert sim.of(d, PauseAt) == [] and sim.m is None
    assert sim.tick(5).actions == ()
    assert "handed to Slurm: node3" in sim.decisions[-1].reason


def test_failed_but_reachable_node_is_migrated_unless_the_policy_says_otherwise():
    sim = Sim()
    d = sim.tick(1, mc.NodeHealthChanged("node2", State.FAILED, ("gpu0: Xid 48",), reachable=True))
    assert sim.of(d, PauseAt) and sim.of(d, HandToSlurm) == []
    sim = Sim(policy=replace(P, migrate_on=("degraded",)))
    d = sim.tick(1, mc.NodeHealthChanged("node2", State.FAILED, ("gpu0: Xid 48",), reachable=True))
    assert d.actions == ()


def test_source_lost_before_its_ranks_are_saved_is_handed_to_slurm_and_survivors_released():
    sim = Sim()
    sim.degrade("node2")
    sim.quiesce_all()
    d = sim.tick(0.1, mc.NodeHealthChanged("node2", State.FAILED, ("tpassd unreachable",), reachable=False))
    assert [h.node for h in sim.of(d, HandToSlurm)] == ["node2"]
    assert len(sim.of(d, ResumeInPlace)) == 1  # nobody is left paused by torchpass
    assert sim.m is None and sim.state.history[-1].outcome == "source_lost"
    assert sim.events("node.lost") and sim.state.spare("node4").status == "free"


def test_source_lost_after_the_dump_does_not_stop_the_move():
    sim = Sim()
    sim.degrade("node2")
    sim.quiesce_all()
    sim.dump_all()
    d = sim.tick(0.1, mc.NodeHealthChanged("node2", State.FAILED, ("host: unreachable",), reachable=False))
    assert sim.of(d, HandToSlurm) == [] and sim.m.phase == Phase.TRANSFER
    sim.transfer_all()
    d = sim.restore_all()
    # The source copies died with their node: no kill needed to resume.
    assert sim.of(d, Resume) == [Resume("m1", 1, "node1")]
    sim.resume_all()
    sim.finish()
    assert sim.state.history[-1].outcome == "completed"


def test_unknown_health_never_triggers_a_migration():
    sim = Sim()
    d = sim.tick(1, mc.NodeHealthChanged("node2", State.UNKNOWN, ("no heartbeat for 3 intervals",), reachable=False))
    assert d.actions == ()
    d = sim.tick(10_000)
    assert d.actions == () and "health unknown (not a reason to move): node2" in d.reason


def test_a_stalled_rank_makes_its_node_migrate():
    sim = Sim()  # every rank reported collective 100 at t=1000
    for i in range(4):  # the others advance; rank 4 stays behind them
        d = sim.tick(7, *[mc.RankProgress(r, 110 + i, 11 + i) for r in (0, 1, 2, 3, 5)])
        assert sim.of(d, PauseAt) == []
    d = sim.tick(1.9)  # 29.9 s without progress: not yet (stall_s=30)
    assert d.actions == ()
    d = sim.tick(0.1)
    (pause,) = sim.of(d, PauseAt)
    assert pause.hold_ranks == (4, 5) and sim.m.reason == "rank 4 stalled" and sim.m.trigger == "stall"
    # T: the top count 113 + what the ranks can issue before their next report (7 s apart
    # here, + pause_slack_s) at the measured rate, + pause_margin_collectives.
    rate = max(r.rate for r in sim.state.ranks.values())
    assert 0 < rate < 1.5
    assert pause.at == 113 + math.ceil(rate * (7 + P.pause_slack_s)) + 8
    assert sim.m.phase_durations["detect"] == 0.0


def test_a_stall_that_clears_before_the_pause_cancels_the_move():
    sim = Sim(spares=())
    sim.tick(30, *[mc.RankProgress(r, 110) for r in (0, 1, 2, 3, 5)])
    assert sim.m is not None and sim.m.phase == Phase.SPARE  # asking slurmctld for a spare
    sim.tick(1, mc.RankProgress(4, 110))
    assert sim.events("migration.cancelled") and sim.m is None


def test_ranks_that_all_wait_together_are_not_stalled():
    sim = Sim()
    assert sim.tick(10_000).actions == ()  # a global hang (data loader, checkpoint on all ranks): not a node fault


def test_two_degraded_nodes_are_moved_one_after_the_other():
    sim = Sim(spares=("node4", "node5"))
    sim.degrade("node2")
    d = sim.degrade("node3", why="ib0: link down")
    assert sim.of(d, PauseAt) == [] and "queued: node3" in d.reason
    sim.quiesce_all()
    sim.dump_all()
    sim.transfer_all()
    sim.restore_all()
    sim.kill_source()
    sim.resume_all()
    sim.tick(0.1, mc.Drained("m1", "node2"))
    d = sim.tick(0.1, mc.Shrunk("m1", ("node2",)))
    # m1 finished and m2 started in the same decision, never two at once.
    (pause,) = sim.of(d, PauseAt)
    assert pause == PauseAt("m2", 108, 2, (4, 5)) and sim.m.target == "node5"
    assert [e.kind for e in sim.of(d, Event)] == ["migration.completed", "migration.started", "spare.chosen"]


def test_operator_migrate_without_and_with_to():
    sim = Sim(spares=("node4", "node5"))
    sim.state, mid = mc.accept_operator(sim.state, "node1", None, sim.now)
    assert mid == "m1"
    d = sim.tick(1)
    (pause,) = sim.of(d, PauseAt)
    assert pause.hold_ranks == (0, 1) and sim.m.target == "node4" and sim.m.trigger == "operator"
    assert sim.m.phase_durations["detect"] == pytest.approx(1.0)
    sim2 = Sim(spares=("node4", "node5"))
    sim2.feed(mc.OperatorMigrate("node3", "node5"))
    d = sim2.tick(0)
    assert sim2.m.target == "node5" and sim2.of(d, PauseAt)[0].hold_ranks == (4, 5)
    # A rank-0 move makes the target the rendezvous master.
    sim.quiesce_all()
    sim.dump_all()
    sim.transfer_all()
    sim.restore_all()
    d = sim.kill_source()
    assert sim.of(d, Resume) == [Resume("m1", 1, "node4")]


def test_operator_request_queues_behind_the_migration_in_flight():
    sim = Sim(spares=("node4", "node5"))
    sim.degrade("node2")
    sim.state, mid = mc.accept_operator(sim.state, "node3", "node5", sim.now)
    assert mid == "m2" and "queued: node3" in sim.tick(0).reason
    sim.quiesce_all()
    sim.dump_all()
    sim.transfer_all()
    sim.restore_all()
    sim.kill_source()
    sim.resume_all()
    d = sim.finish()
    assert sim.m.id == "m2" and sim.m.target == "node5" and sim.of(d, PauseAt)


def test_operator_target_gone_by_the_time_it_runs_is_rejected_without_pausing():
    sim = Sim(spares=("node4",))
    sim.state, _ = mc.accept_operator(sim.state, "node3", "node4", sim.now)
    sim.feed(mc.NodeHealthChanged("node4", State.DEGRADED, ("ib0 flapping",)))
    d = sim.tick(1)
    assert sim.of(d, PauseAt) == [] and sim.events("migration.rejected") and sim.m is None


def test_recovery_before_anything_is_paused_cancels_the_move():
    sim = Sim(spares=())
    sim.degrade("node2")
    sim.tick(1, mc.NodeHealthChanged("node2", State.HEALTHY))
    assert sim.events("migration.cancelled") and sim.m is None
    assert not any(isinstance(a, PauseAt) for a in sim.actions)


def test_repeated_failures_give_up_on_a_node():
    sim = Sim(policy=replace(P, max_attempts_per_node=2))
    sim.degrade("node2")
    for attempt in range(2):
        sim.tick(10)  # pause timeout
        sim.resume_all(cancelled=True)
        assert sim.m is None
        sim.tick(100)  # back-off passes; the second time there is no third try
    assert sim.events("migration.abandoned") and sim.state.given_up == {"node2"}
    assert sim.tick(1000).actions == ()
    assert "given up on: node2" in sim.decisions[-1].reason


def test_no_migration_before_every_rank_registered():
    sim = Sim()
    sim.state = replace(sim.state, world_size=8)
    d = sim.degrade("node2")
    assert d.actions == () and "waiting for ranks to register (6/8)" in d.reason


def test_reasons_change_only_when_the_decision_changes():
    sim = Sim()
    log = mc.ReasonLog()
    logged = []

    def tick(dt=0.0, *evs):
        d = sim.tick(dt, *evs)
        if log.changed(d.reason):
            logged.append(d.reason)
        return d

    tick()
    tick(1)
    tick(1)  # nothing happened: the same reason
    assert logged == ["no migration needed"]
    tick(1, mc.NodeHealthChanged("node2", State.DEGRADED, ("gpu0: Xid 63",)))
    for _ in range(5):
        d = tick(1)  # waiting in the pause: time passes, the reason stays
        assert d.actions == ()
    assert len(logged) == 2 and "pausing every rank at collective 108" in logged[-1]
    m = sim.m
    tick(0.1, *[mc.Quiesced(r, m.generation, m.pause_at) for r in sim.state.ranks])
    assert "dumping ranks [2, 3] on node2" in logged[-1] and len(logged) == 3


@pytest.mark.parametrize("phase_to", ["pause", "dump", "transfer", "restore", "kill"])
def test_every_phase_timeout_ends_resumed(phase_to):
    sim = Sim()
    sim.degrade("node2")
    steps = {"pause": [], "dump": [sim.quiesce_all], "transfer": [sim.quiesce_all, sim.dump_all],
             "restore": [sim.quiesce_all, sim.dump_all, sim.transfer_all],
             "kill": [sim.quiesce_all, sim.dump_all, sim.transfer_all, sim.restore_all]}[phase_to]
    for s in steps:
        s()
    t0 = sim.now
    while sim.m is not None and sim.m.phase != Phase.ROLLBACK:
        sim.tick(1)
    assert sim.now - t0 <= max(P.pause_timeout_s, P.dump_timeout_s, P.restore_timeout_s) + 1
    assert isinstance([a for a in sim.actions if isinstance(a, (ResumeInPlace, Resume))][-1], ResumeInPlace)


# ============================================================================
# Invariant: whatever happens, the job is never left paused beyond the
# timeouts, at most one migration is in flight, and decide is idempotent.
# ============================================================================
HP = replace(P, stall_s=20.0)
NODES = ("node1", "node2", "node3", "node4", "node5")


def _completing(sim, m):
    ranks = sim.state.ranks
    return {
        Phase.SPARE: [mc.SpareGranted(m.id, "node6", "companion"), mc.NodeHealthChanged("node6", State.HEALTHY)],
        Phase.PAUSE: [mc.Quiesced(r, m.generation, m.pause_at or 0) for r in ranks],
        Phase.DUMP: [mc.MigrationDumpDone(m.id, r, f"/i/{r}", "c") for r in m.ranks],
        Phase.TRANSFER: [mc.TransferDone(m.id, r, m.target or "", f"/i/{r}", "c") for r in m.ranks],
        Phase.RESTORE: [mc.RestoreDone(m.id, r, m.target or "") for r in m.ranks],
        Phase.KILL_SOURCE: [mc.SourceKilled(m.id, m.node)],
        Phase.REBUILD: [mc.Resumed(r, m.generation) for r in ranks],
        Phase.ROLLBACK: [mc.Resumed(r, m.generation) for r in ranks],
        Phase.DRAIN: [mc.Drained(m.id, m.node)],
        Phase.SHRINK: [mc.Shrunk(m.id, (m.node,))],
    }[m.phase]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hs.data())
def test_never_left_paused_and_one_migration_at_a_time(data):
    sim = Sim(spares=("node4", "node5"), policy=HP)
    paused_by: str | None = None  # the migration whose PauseAt has not been answered by a resume command
    last_paused: str | None = None  # resume commands may be resent
    paused_since = 0.0
    max_dt = 3.0
    bound = HP.max_pause_s() + max_dt
    for _ in range(data.draw(hs.integers(5, 60), label="steps")):
        m = sim.m
        mid = m.id if m else "m1"
        if data.draw(hs.integers(0, 9)) == 0:
            mid = "m0"  # a stale outcome
        gen = m.generation if m else sim.state.generation + 1
        rank = data.draw(hs.integers(0, 5))
        mr = data.draw(hs.sampled_from(m.ranks)) if m and m.ranks else rank
        tgt = m.target if m and m.target else "node4"
        why = "x"
        choices = [
            lambda: None,
            lambda: mc.NodeHealthChanged(data.draw(hs.sampled_from(NODES)),
                                         data.draw(hs.sampled_from(list(State))), (why,), data.draw(hs.booleans())),
            lambda: mc.Quiesced(rank, gen, m.pause_at if m and m.pause_at else 0),
            lambda: mc.Armed(rank, m.pause_at if m and m.pause_at else 0, gen, False, 500),
            lambda: mc.MigrationDumpDone(mid, mr, f"/i/{mr}", "c"),
            lambda: mc.MigrationDumpFailed(mid, mr, why),
            lambda: mc.TransferDone(mid, mr, tgt, f"/i/{mr}", "c"),
            lambda: mc.TransferFailed(mid, mr, tgt, why, data.draw(hs.booleans())),
            lambda: mc.RestoreDone(mid, mr, tgt),
            lambda: mc.RestoreFailed(mid, mr, tgt, why, data.draw(hs.booleans())),
            lambda: mc.SourceKilled(mid, m.node if m else "node2"),
            lambda: mc.KillFailed(mid, m.node if m else "node2", why),
            lambda: mc.Resumed(rank, gen, None, data.draw(hs.booleans())),
            lambda: mc.Drained(mid, m.node if m else "node2"),
            lambda: mc.Shrunk(mid, (m.node if m else "node2",)),
            lambda: mc.SpareGranted(mid, data.draw(hs.sampled_from(("node6", "node7"))), "expand"),
            lambda: mc.SpareUnavailable(mid, m.spare_requested if m and m.spare_requested else "expand", why),
            lambda: mc.RankProgress(rank, data.draw(hs.integers(0, 400))),
            lambda: mc.RankUnprotected(rank, why),  # the job turns unprotected (for good)
            lambda: "operator",
            *[lambda: "advance"] * 6,  # weighted: the outcomes that complete the current phase
        ]
        ev = data.draw(hs.sampled_from(range(len(choices))))
        out = choices[ev]()
        events = []
        if out == "operator":
            try:
                sim.state, _ = mc.accept_operator(sim.state, data.draw(hs.sampled_from(NODES)),
                                                  data.draw(hs.sampled_from((None, *NODES))), sim.now)
            except mc.OperatorRejected:
                pass
        elif out == "advance" and m:
            events = _completing(sim, m)
        elif out is not None and not isinstance(out, str):
            events = [out]
        before = sim.state
        d = sim.tick(data.draw(hs.floats(0, max_dt)), *events)
        st = sim.state

        for a in d.actions:
            if isinstance(a, PauseAt):
                assert paused_by in (None, a.migration), "a second migration paused the job"
                assert a.generation > before.generation or paused_by == a.migration
                if paused_by is None:
                    paused_by, paused_since, last_paused = a.migration, sim.now, a.migration
            elif isinstance(a, (Resume, ResumeInPlace)):
                assert a.migration in (paused_by, last_paused)
                paused_by = None
        if paused_by is not None:
            assert st.migration is not None and st.migration.id == paused_by and st.migration.paused
            assert sim.now - paused_since <= bound
        if st.migration is not None:
            assert sim.now < st.migration.deadline, "an expired deadline was not acted on"
            if st.migration.paused:
                assert sim.now - st.migration.paused_since <= bound
        reserved = [s for s in st.spares if s.status == "reserved"]
        assert len(reserved) <= 1 and (not reserved or (st.migration and st.migration.target == reserved[0].node))
        # decide is idempotent: asked again at once, it does nothing new and says the same.
        again = decide(sim.now, st, HP)
        assert again.actions == () and again.reason == d.reason and again.state == st


# ============================================================================
# The pause point T and the standstill ("paused")
# ============================================================================
from torchpass.coordinator.decide_common import pause_point  # noqa: E402
from torchpass.coordinator.model import RankView  # noqa: E402

TP = replace(P, pause_margin_collectives=2, pause_slack_s=0.5, pause_slack_listening_s=0.1,
             pause_fallback_collectives=64)


def _train(sim, seconds, per_report=3, per_step=2, interval=0.5):
    """Every rank reports every ``interval``: ``per_report`` more collectives, a step boundary
    every ``per_step`` collectives (the last one before the report)."""
    for _ in range(int(seconds / interval)):
        top = max(r.collectives for r in sim.state.ranks.values()) + per_report
        b = top - (top - 100) % per_step  # boundaries at 100, 102, 104, ...
        sim.tick(interval, *[mc.RankProgress(r, top, 10 + (b - 100) // per_step, None, b, 10 + (b - 100) // per_step)
                             for r in sim.state.ranks])


def test_pause_point_comes_from_the_measured_rate_and_lands_on_a_step_boundary():
    sim = Sim(policy=TP)
    _train(sim, 3.0)  # 6 collectives/s, reports 0.5 s apart, 2 collectives per step
    views = sim.state.ranks
    assert all(v.rate == pytest.approx(6.0) and v.report_gap == pytest.approx(0.5) and v.per_step == 2
               for v in views.values())
    top = max(v.collectives for v in views.values())
    d = sim.degrade("node2", dt=0.1)
    (pause,) = sim.of(d, PauseAt)
    # reachable: top + 6/s x (0.5 s to the next report + 0.5 s slack) = top + 6; + margin 2;
    # top + 8 is a step boundary (collectives 100 + 2k).
    assert pause.at == top + 8 and (pause.at - 100) % 2 == 0
    assert "collectives/s" in sim.m.pause_estimate and "step boundary" in sim.m.pause_estimate
    # The old fixed margin would have asked for top + 64: ~10 s more of training before the move.


def test_pause_point_rounds_up_to_the_next_step_boundary():
    base = dict(collectives=100, reported_at=10.0, report_gap=0.5, rate=4.0, boundary=97, boundary_step=32)
    ranks = {r: RankView(r, "n", per_step=5, **base) for r in range(3)}
    at, how = pause_point(10.0, ranks, TP)
    # reach 100 + ceil(4 x 1.0) = 104, + 2 = 106 -> next boundary 97 + 5k >= 106 is 107
    assert at == 107 and "5 collectives/step" in how
    # Ranks that disagree on the collectives per step: no rounding.
    ranks[1] = replace(ranks[1], per_step=0)
    assert pause_point(10.0, ranks, TP)[0] == 106
    # A report that is overdue counts from the time since it, not the usual gap.
    assert pause_point(12.0, {0: RankView(0, "n", **base)}, TP)[0] == 100 + 10 + 2
    # No rate yet: the fallback margin.
    at, how = pause_point(10.0, {0: RankView(0, "n", collectives=100)}, TP)
    assert at == 164 and "no rate" in how
    # A re-arm after a refusal at 130 seen just now: 130 + what that rank issues before it hears.
    assert pause_point(10.0, {0: RankView(0, "n", **base)}, TP, floor=130)[0] == 130 + 4 + 2


def test_a_rank_whose_report_waits_at_the_coordinator_hears_the_pause_at_once():
    # A long-polling rank (its last report parked until listening_until) is paused at once: T counts
    # only the time since its report, not its report interval (less training to T).
    base = dict(collectives=100, reported_at=10.0, report_gap=2.0, rate=4.0)
    waiting = {0: RankView(0, "n", listening_until=12.0, **base)}
    tp = replace(TP, pause_fanout_s_per_1000_ranks=0.0)
    # 0.25 s since its report + 0.1 s slack (the reply leaves at once): ceil(4 x 0.35) = 2; + margin 2.
    assert pause_point(10.25, waiting, tp)[0] == 100 + 2 + 2
    # The slack of a rank that hears at its next report does not apply to it.
    assert pause_point(10.25, waiting, replace(tp, pause_slack_s=5.0))[0] == 100 + 2 + 2
    assert pause_point(10.25, waiting, replace(tp, pause_slack_listening_s=0.5))[0] == 100 + 3 + 2
    # The same rank reporting without a long poll hears it one report interval later.
    assert pause_point(10.25, {0: RankView(0, "n", **base)}, tp)[0] == 100 + 10 + 2
    # Its poll answered (listening_until passed): at its next report, here overdue (2.5 s + slack).
    assert pause_point(12.5, waiting, tp)[0] == 100 + 12 + 2
    # A re-arm after a refusal, every rank listening: only the slack.
    assert pause_point(10.0, waiting, tp, floor=130)[0] == 130 + 2 + 2
    # 2,000 listening ranks: the last one hears the pause 2 x pause_fanout_s_per_1000_ranks
    # (0.25 s) after the first: ceil(4 x (0.25 + 0.5 + 0.1)) = 4.
    many = {r: RankView(r, "n", listening_until=12.0, **base) for r in range(2000)}
    assert pause_point(10.25, many, TP)[0] == 100 + 4 + 2


def test_a_long_poll_marks_the_rank_listening_until_another_message_answers_it():
    st = CoordState(job_id=1)
    st = mc.apply(st, mc.RankRegistered(0, "n1", 1), 0.0)
    st = mc.apply(st, mc.RankProgress(0, 10, 1, wait_s=2.0), 1.0)
    assert st.ranks[0].listening_until == 3.0
    st = mc.apply(st, mc.RankProgress(0, 12, 1), 1.5)  # a plain report
    assert st.ranks[0].listening_until is None
    st = mc.apply(st, mc.RankProgress(0, 14, 1, wait_s=2.0), 2.0)
    st = mc.apply(st, mc.Armed(0, 20, 1, True, 15), 2.1)  # its client answered the parked poll
    assert st.ranks[0].listening_until is None


def test_rank_pace_from_progress_reports():
    st = CoordState(job_id=1)
    st = mc.apply(st, mc.RankRegistered(0, "n1", 1), 0.0)
    st = mc.apply(st, mc.RankProgress(0, 10, 1, None, 9, 1), 1.0)
    assert st.ranks[0].rate == 0.0 and st.ranks[0].rate_base == (1.0, 10)
    st = mc.apply(st, mc.RankProgress(0, 12, 1), 1.05)  # too close to measure a rate (a paused rank's poll)
    assert st.ranks[0].rate == 0.0 and st.ranks[0].report_gap == pytest.approx(0.05)
    st = mc.apply(st, mc.RankProgress(0, 20, 4, None, 18, 4), 2.0)
    v = st.ranks[0]
    assert v.rate == pytest.approx(10.0) and v.per_step == 3 and (v.boundary, v.boundary_step) == (18, 4)
    st = mc.apply(st, mc.RankProgress(0, 22, 5, None, 22, 5), 3.0)  # 4 collectives in that step, not 3
    assert st.ranks[0].rate == pytest.approx(6.0) and st.ranks[0].per_step == 0
    st = mc.apply(st, mc.RankProgress(0, 27, 6, None, 26, 6), 3.5)  # 4 again
    assert st.ranks[0].per_step == 4 and st.ranks[0].report_gap == pytest.approx(0.625)
    st = mc.apply(st, mc.RankProgress(0, 5, 1), 4.0)  # went backwards: measure afresh
    assert st.ranks[0].rate == 0.0 and st.ranks[0].rate_base == (4.0, 5)


def test_a_pause_does_not_lower_the_measured_rate():
    # Issue 13: a rank paused at T reports the same count for seconds; were those samples, the rate
    # (and with it the next T) would fall, and the ranks would pass T before they heard of it.
    st = CoordState(job_id=1)
    st = mc.apply(st, mc.RankRegistered(0, "n1", 1), 0.0)
    for t in range(1, 5):
        st = mc.apply(st, mc.RankProgress(0, 40 * t, t), float(t))
    assert st.ranks[0].rate == pytest.approx(40.0)
    for t in (5.0, 7.0, 9.0):  # paused at 160, long polls 2 s apart
        st = mc.apply(st, mc.RankProgress(0, 160, 4), t)
    assert st.ranks[0].rate == pytest.approx(40.0)
    # Reaching T (160 + 40) mid-interval and standing there is not a sample either.
    from torchpass.coordinator.model import Migration

    st = replace(st, migration=Migration(id="m1", node="n2", reason="r", trigger="health", ranks=(1,), detected=4.0,
                                         started=4.0, phase=Phase.PAUSE, phase_started=4.0, deadline=60.0,
                                         generation=2, pause_at=200))
    st = mc.apply(st, mc.Resumed(0, 2, "n1", False, 160), 9.0)
    st = mc.apply(st, mc.RankProgress(0, 180, 4), 9.2)
    st = mc.apply(st, mc.RankProgress(0, 200, 4), 10.5)  # at T since ~9.7
    assert st.ranks[0].rate == pytest.approx(40.0)
    st = replace(st, migration=None)
    st = mc.apply(st, mc.Resumed(0, 2, "n1", False, 160), 9.5)  # a new measurement from the next report
    assert st.ranks[0].rate_base is None
    st = mc.apply(st, mc.RankProgress(0, 180, 5), 11.0)
    st = mc.apply(st, mc.RankProgress(0, 220, 6), 12.0)
    assert st.ranks[0].rate == pytest.approx(40.0)


def test_paused_is_the_standstill_from_the_last_rank_at_T():
    sim = Sim()
    sim.degrade("node2")
    m = sim.m
    sim.tick(0.4, *[mc.Quiesced(r, m.generation, m.pause_at) for r in range(5)])
    sim.tick(1.0, mc.Quiesced(5, m.generation, m.pause_at, 0.25, 12.5))  # the last rank gets there 1 s later
    assert sim.m.phase == Phase.DUMP and sim.m.stood_still_since == sim.now
    assert sim.m.tool_durations["quiesce.drain_s"] == 0.25
    assert sim.m.tool_durations["quiesce.released_mb"] == 12.5  # the held rank's freed caches
    sim.dump_all()
    sim.transfer_all()
    sim.restore_all()
    sim.kill_source()
    sim.resume_all()
    pd = sim.events("migration.resumed")[-1].data["phase_durations"]
    assert pd["pause"] == pytest.approx(1.4)
    assert pd["paused"] == pytest.approx(0.3 + 0.1 + 0.2 + 0.05 + 0.06)


def test_a_rollback_before_every_rank_stopped_counts_from_the_first_one():
    sim = Sim()
    sim.degrade("node2")
    m = sim.m
    sim.tick(1.0, mc.Quiesced(0, m.generation, m.pause_at))
    d = sim.tick(P.pause_timeout_s)  # the others never get there
    assert sim.of(d, ResumeInPlace)
    sim.resume_all(dt=0.2, cancelled=True)
    rec = sim.state.history[-1]
    assert rec.outcome == "rolled_back"
    assert rec.phase_durations["paused"] == pytest.approx(P.pause_timeout_s + 0.2)
    # Nobody stopped at all: nothing stood still.
    sim2 = Sim()
    sim2.degrade("node2")
    sim2.tick(P.pause_timeout_s)
    sim2.resume_all(dt=0.2, cancelled=True)
    assert sim2.state.history[-1].phase_durations["paused"] == 0.0


# ============================================================================
# The transition table (torchpass.coordinator.phases)
# ============================================================================
from torchpass.coordinator import decide_migration as decide_mod  # noqa: E402 - the migration machine checks its edges there
from torchpass.coordinator import phases  # noqa: E402
from torchpass.coordinator.phases import RESULTS, TRANSITIONS, IllegalTransition, Result  # noqa: E402


def _lose(node):
    return mc.NodeHealthChanged(node, State.FAILED, ("host: unreachable",), reachable=False)


def _scenarios():
    """One short run per way through the diagram (each a fresh Sim)."""
    def happy():
        sim = Sim()
        sim.to_restore()
        sim.restore_all()
        sim.kill_source()
        sim.resume_all()
        sim.finish()

    def spare_cancelled():
        sim = Sim(spares=())
        sim.degrade("node2")
        sim.tick(1, mc.NodeHealthChanged("node2", State.HEALTHY))

    def spare_none():
        sim = Sim(spares=())
        sim.degrade("node2")
        sim.tick(1, mc.SpareUnavailable("m1", "expand", "no"))
        sim.tick(1, mc.SpareUnavailable("m1", "companion", "no"))

    def spare_rejected():
        sim = Sim()
        sim.feed(mc.OperatorMigrate("node2", "node4"))
        sim.tick(1, _lose("node4"))

    def spare_source_lost():
        sim = Sim(spares=())
        sim.degrade("node2")
        sim.tick(1, _lose("node2"))

    def pause_timeout_then_stuck():
        sim = Sim()
        sim.degrade("node2")
        sim.tick(P.pause_timeout_s + 1)  # PAUSE -> ROLLBACK
        sim.tick(P.rebuild_timeout_s + 1)
        sim.tick(P.rebuild_timeout_s + 1)  # ROLLBACK -> None (stuck)

    def pause_source_lost():
        sim = Sim()
        sim.degrade("node2")
        sim.tick(1, _lose("node2"))

    def dump_failed_rolled_back():
        sim = Sim()
        sim.degrade("node2")
        sim.quiesce_all()
        sim.tick(1, mc.MigrationDumpFailed("m1", 2, "boom"))
        sim.resume_all()

    def dump_source_lost():
        sim = Sim()
        sim.degrade("node2")
        sim.quiesce_all()
        sim.tick(1, _lose("node2"))

    def rollback_source_lost():
        sim = Sim()
        sim.degrade("node2")
        sim.tick(P.pause_timeout_s + 1)
        sim.tick(1, _lose("node2"))

    def transfer_failed():
        sim = Sim()
        sim.degrade("node2")
        sim.quiesce_all()
        sim.dump_all()
        sim.tick(1, mc.TransferFailed("m1", 2, "node4", "checksum mismatch"))

    def transfer_target_lost():
        sim = Sim(spares=("node4", "node5"))
        sim.degrade("node2")
        sim.quiesce_all()
        sim.dump_all()
        sim.tick(1, _lose("node4"))  # TRANSFER -> TRANSFER (to node5)

    def transfer_source_lost():
        sim = Sim()
        sim.degrade("node2")
        sim.quiesce_all()
        sim.dump_all()
        sim.tick(1, _lose("node2"), mc.TransferFailed("m1", 2, "node4", "no"))

    def restore_failed():
        sim = Sim()
        sim.to_restore()
        sim.tick(1, mc.RestoreFailed("m1", 2, "node4", "criu restore failed"))

    def restore_target_lost():
        sim = Sim(spares=("node4", "node5"))
        sim.to_restore()
        sim.tick(1, _lose("node4"))  # RESTORE -> TRANSFER (to node5)

    def restore_source_lost():
        sim = Sim()
        sim.to_restore()
        sim.tick(1, _lose("node2"), mc.RestoreFailed("m1", 2, "node4", "no"))

    def kill_failed():
        sim = Sim()
        sim.to_restore()
        sim.restore_all()
        sim.tick(1, mc.KillFailed("m1", "node2", "tpassd refused"))

    def kill_source_lost():
        sim = Sim()
        sim.to_restore()
        sim.restore_all()
        sim.tick(1, _lose("node2"), mc.KillFailed("m1", "node2", "no answer"))

    def rebuild_stuck():
        sim = Sim()
        sim.to_restore()
        sim.restore_all()
        sim.kill_source()
        sim.tick(P.rebuild_timeout_s + 1)
        sim.tick(P.rebuild_timeout_s + 1)

    def job_ended_in_drain():
        sim = Sim()
        _to_drain(sim)
        sim.end_job()

    def job_ended_in_shrink():
        sim = Sim()
        _to_drain(sim)
        sim.tick(0.5, mc.Drained("m1", "node2"))
        sim.end_job()

    return [happy, job_ended_in_drain, job_ended_in_shrink, spare_cancelled, spare_none, spare_rejected,
            spare_source_lost, pause_timeout_then_stuck, pause_source_lost, dump_failed_rolled_back,
            dump_source_lost, rollback_source_lost, transfer_failed,
            transfer_target_lost, transfer_source_lost, restore_failed, restore_target_lost, restore_source_lost,
            kill_failed, kill_source_lost, rebuild_stuck]


def test_every_edge_of_the_transition_table_is_reachable(monkeypatch):
    seen: set = set()
    ends: set = set()
    check_t, check_r = decide_mod.check_transition, decide_mod.check_result

    def transition(mid, src, dst):
        check_t(mid, src, dst)
        seen.add((src, dst))

    def result(mid, phase, res):
        check_r(mid, phase, res)
        seen.add((phase, None))
        ends.add((phase, res))

    monkeypatch.setattr(decide_mod, "check_transition", transition)
    monkeypatch.setattr(decide_mod, "check_result", result)
    for run in _scenarios():
        run()
    table = {(src, dst) for src, dsts in TRANSITIONS.items() for dst in dsts}
    assert table - seen == set(), "legal edges no scenario reached"
    assert seen - table == set()
    assert {(ph, r) for ph, rs in RESULTS.items() for r in rs} - ends == set(), "legal ends no scenario reached"


def test_an_illegal_transition_raises_in_strict_mode(monkeypatch):
    monkeypatch.setitem(TRANSITIONS, Phase.PAUSE, frozenset({Phase.ROLLBACK, None}))  # PAUSE -> DUMP now illegal
    sim = Sim()
    sim.degrade("node2")
    assert phases.strict_default()  # under pytest
    with pytest.raises(IllegalTransition, match="m1: illegal phase transition pause -> dump"):
        sim.quiesce_all()
    with pytest.raises(IllegalTransition):
        phases.check_result("m1", Phase.DRAIN, Result.ROLLED_BACK)


@pytest.mark.parametrize("phase", [Phase.PAUSE, Phase.RESTORE, Phase.KILL_SOURCE])
def test_an_illegal_transition_in_production_rolls_back_and_resumes_every_rank(monkeypatch, phase):
    monkeypatch.setenv("TORCHPASS_STRICT_TRANSITIONS", "0")
    assert not phases.strict_default()
    sim = Sim()
    if phase == Phase.PAUSE:
        sim.degrade("node2")
    else:
        sim.to_restore()
    if phase == Phase.KILL_SOURCE:
        sim.restore_all()
    assert sim.m.phase == phase
    nxt = {Phase.PAUSE: Phase.DUMP, Phase.RESTORE: Phase.KILL_SOURCE, Phase.KILL_SOURCE: Phase.REBUILD}[phase]
    monkeypatch.setitem(TRANSITIONS, phase, TRANSITIONS[phase] - {nxt})
    if phase == Phase.PAUSE:
        d = sim.quiesce_all()
    elif phase == Phase.RESTORE:
        d = sim.restore_all()
    else:
        d = sim.kill_source()
    (ev,) = sim.of(d, Event)[:1]
    assert ev.kind == "migration.illegal_transition" and ev.data["dst"] == nxt.value
    (rip,) = sim.of(d, ResumeInPlace)
    assert rip.generation == 1 and not sim.of(d, MigrationDump) and not sim.of(d, KillSource) and not sim.of(d, Resume)
    assert bool(sim.of(d, AbortRestore)) == (phase != Phase.PAUSE)  # a restored copy is called off
    assert sim.m is None and sim.state.history[-1].outcome == "aborted" and sim.state.generation == 1
    assert [e.kind for e in sim.of(d, Event)][-1] == "migration.aborted"


def test_strict_mode_follows_the_environment(monkeypatch):
    monkeypatch.setenv("TORCHPASS_STRICT_TRANSITIONS", "1")
    assert phases.strict_default()
    monkeypatch.setenv("TORCHPASS_STRICT_TRANSITIONS", "")
    assert not phases.strict_default()
    monkeypatch.setenv("TORCHPASS_STRICT_TRANSITIONS", "0")
    assert not phases.strict_default()


def test_importing_the_core_loads_neither_zmq_nor_structlog():
    import subprocess
    import sys

    core = ("torchpass.coordinator.decide", "torchpass.coordinator.machine", "torchpass.coordinator.model",
            "torchpass.coordinator.contract", "torchpass.coordinator.phases", "torchpass.health_state")
    code = ("import sys\n" + "".join(f"import {m}\n" for m in core)
            + "print(sorted(m for m in ('zmq', 'structlog') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
    # The test can fail: the subscriber module does load both.
    out = subprocess.run([sys.executable, "-c", "import sys, torchpass.health; print('zmq' in sys.modules)"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "True"


# ============================================================================
# An unprotected job (a rank refuses every pause: "do no harm")
# ============================================================================
WHY = "process group 'tp' (DeviceMesh) cannot be moved yet"


def test_an_unprotected_job_starts_no_migration_and_says_so_once_per_node():
    sim = Sim()
    sim.tick(1.0, mc.RankUnprotected(3, WHY))
    assert sim.state.job_unprotected == f"rank 3 unprotected: {WHY}"
    d = sim.degrade("node2")
    assert sim.m is None and not sim.of(d, PauseAt) and not sim.of(d, RequestSpare)
    assert d.reason == f"no migration starts: the job is unprotected (rank 3 unprotected: {WHY})"
    (ev,) = sim.events("migration.skipped")
    assert "node2 needs to move (gpu0: Xid 63 (row remap pending)), but the job is unprotected" in ev.message
    for _ in range(5):  # later ticks: nothing more to say
        assert sim.tick(1.0).actions == ()
    sim.degrade("node3")
    assert [e.data["node"] for e in sim.events("migration.skipped")] == ["node2", "node3"]
    with pytest.raises(mc.OperatorRejected, match="job is unprotected: rank 3"):
        mc.accept_operator(sim.state, "node1", None, sim.now)
    assert sim.m is None


def test_an_operator_request_queued_before_the_job_turned_unprotected_is_dropped():
    sim = Sim()
    sim.state, mid = mc.accept_operator(sim.state, "node1", None, sim.now)  # queued, not started yet
    sim.feed(mc.RankUnprotected(0, WHY))
    d = sim.tick(1.0)
    assert sim.m is None and not sim.of(d, PauseAt) and sim.state.operator_requests == ()
    (ev,) = sim.events("migration.rejected")
    assert ev.data["migration"] == mid and "the job is unprotected" in ev.message


def test_an_armed_refusal_saying_unprotected_rolls_back_at_once_without_a_rearm():
    sim = Sim()
    sim.degrade("node2")
    m = sim.m
    d = sim.tick(0.1, mc.Armed(4, m.pause_at, m.generation, False, 99, WHY))
    assert sim.of(d, PauseAt) == []
    (rip,) = sim.of(d, ResumeInPlace)
    assert rip.why == f"the job is unprotected (rank 4 unprotected: {WHY})"
    assert sim.m.phase == Phase.ROLLBACK
    # Unprotected ranks acknowledge the cancel; the protected ones were armed and cancel too.
    sim.resume_all(cancelled=True)
    assert sim.m is None and sim.state.history[-1].outcome == "rolled_back"
    d = sim.tick(P.retry_backoff_s + 1)  # the node is still degraded, and stays where it is
    assert sim.m is None and not sim.of(d, PauseAt) and len(sim.events("migration.skipped")) == 1


@pytest.mark.parametrize("phase", [Phase.DUMP, Phase.TRANSFER, Phase.RESTORE])
def test_a_job_that_turns_unprotected_while_paused_rolls_back(phase):
    sim = Sim()
    sim.degrade("node2")
    sim.quiesce_all()
    if phase != Phase.DUMP:
        sim.dump_all()
    if phase == Phase.RESTORE:
        sim.transfer_all()
    assert sim.m.phase == phase
    d = sim.tick(0.1, mc.RankUnprotected(0, WHY))
    (rip,) = sim.of(d, ResumeInPlace)
    assert "the job is unprotected" in rip.why and sim.m.phase == Phase.ROLLBACK
    assert (sim.of(d, AbortRestore) != []) == (phase == Phase.RESTORE)


def test_a_job_that_turns_unprotected_while_waiting_for_a_spare_cancels_the_move():
    sim = Sim(spares=())
    d = sim.degrade("node2")
    assert sim.m.phase == Phase.SPARE and sim.of(d, RequestSpare)
    d = sim.tick(0.5, mc.RankUnprotected(2, WHY))
    assert sim.m is None and not sim.of(d, PauseAt) and not sim.of(d, ResumeInPlace)
    assert sim.state.history[-1].outcome == "cancelled"
    (ev,) = sim.events("migration.cancelled")
    assert "the job is unprotected (rank 2 unprotected" in ev.message


def test_a_pinned_node_is_skipped_once_and_the_rest_of_the_job_still_moves():
    """torchrun: the node whose agent serves a store cannot move (its workers register it pinned).
    A degradation there is said once (migration.skipped, naming why) and moves nothing; an
    operator request for it is rejected; another node still moves, and a snapshot is refused
    (several ranks per task)."""
    sim = Sim()
    why = "torchrun's agent on this node serves a TCP store"
    for r in (0, 1):  # node1's two workers, of task 0
        sim.feed(mc.RankRegistered(r, "node1", 6, task=0, pinned=why))
    sim.degrade("node1")
    sim.tick(1.0)
    (ev,) = sim.events("migration.skipped")
    assert ev.data["node"] == "node1" and ev.data["pinned"] == why and why in ev.message
    assert sim.m is None and not [a for a in sim.actions if isinstance(a, PauseAt)]
    sim.degrade("node2")
    assert sim.m is not None and sim.m.node == "node2"
    assert len(sim.events("migration.skipped")) == 1  # said once
    from torchpass.coordinator.decide_snapshot import check_snapshot_request

    code, msg = check_snapshot_request(replace(sim.state, migration=None))
    assert code == "conflict" and "torchrun" in msg


def test_an_operator_request_for_a_pinned_node_is_rejected():
    from torchpass.coordinator.machine import OperatorRejected, accept_operator

    sim = Sim()
    sim.feed(mc.RankRegistered(0, "node1", 6, task=0, pinned="serves a store"))
    with pytest.raises(OperatorRejected) as err:
        accept_operator(sim.state, "node1", None, sim.now)
    assert "node1 cannot move: serves a store" in str(err.value)
    accept_operator(sim.state, "node2", None, sim.now)  # the others can


def test_a_fan_in_in_a_batch_gives_the_same_state_as_one_report_at_a_time():
    """machine.thaw_acks/freeze_acks: a batch adds each quiesced and resumed report to
    one set in place; the states that come out equal those of applying them one by one."""
    from dataclasses import replace

    from torchpass.coordinator import machine as mc
    from torchpass.coordinator.model import CoordState, Migration, RankView
    from torchpass.coordinator.phases import Phase

    ranks = {r: RankView(r, f"n{r // 4}", collectives=50, task=r) for r in range(16)}
    m = Migration(id="m1", node="n0", reason="x", trigger="health", ranks=(0, 1, 2, 3), detected=1.0,
                  started=1.0, phase=Phase.PAUSE, phase_started=1.0, deadline=60.0, generation=1, pause_at=60)
    start = CoordState(job_id=1, world_size=16, ranks=ranks, migration=m)

    one_by_one = start
    for r in range(16):
        one_by_one = mc.apply(one_by_one, mc.Quiesced(r, 1, 60), 2.0 + r)
    batched = start
    for lo in (0, 5, 11):  # three batches, the last one completes the pause
        batched = mc.thaw_acks(replace(batched, ranks=dict(batched.ranks)))
        owned = batched.ranks
        for r in range(lo, {0: 5, 5: 11, 11: 16}[lo]):
            batched = mc.apply(batched, mc.Quiesced(r, 1, 60), 2.0 + r, owned=owned)
        assert type(batched.migration.quiesced) is set  # added to in place
        batched = mc.freeze_acks(batched)
        assert type(batched.migration.quiesced) is frozenset
    assert batched == one_by_one
    assert batched.migration.ready_at == 17.0  # stamped by the sixteenth report
    assert start.migration.quiesced == frozenset()  # the state before the batches: untouched


def test_the_rank_views_carry_over_and_are_rebuilt_when_a_rank_changes_node():
    """CoordState.carry_views: a state made from another with the same ranks keeps its
    rank_nodes(); a report in a batch that moves a rank to another node drops them."""
    from dataclasses import replace

    from torchpass.coordinator import machine as mc
    from torchpass.coordinator.model import RANK_NODES_CACHE, CoordState, RankView

    st = CoordState(job_id=1, world_size=4, ranks={r: RankView(r, f"n{r // 2}") for r in range(4)})
    assert st.rank_nodes() == {"n0": (0, 1), "n1": (2, 3)}
    same = st.carry_views(replace(st, slurm_down="x"))
    assert RANK_NODES_CACHE in same.__dict__
    copied = st.carry_views(replace(st, ranks=dict(st.ranks)), copied_ranks=True)
    owned = copied.ranks
    after = mc.apply(copied, mc.RankProgress(0, 5, 1, "n7"), 1.0, owned=owned)  # rank 0 moved
    assert after.rank_nodes() == {"n7": (0,), "n0": (1,), "n1": (2, 3)}
    kept = mc.apply(after, mc.RankProgress(1, 5, 1), 2.0, owned=owned)  # a report alone
    assert kept.rank_nodes() is after.rank_nodes()
    assert st.rank_nodes() == {"n0": (0, 1), "n1": (2, 3)}  # the state before the batch: its own views


def test_the_stall_pass_is_skipped_until_a_rank_could_be_quiet_and_then_finds_it():
    """decide.stalled_ranks keeps the lowest last_advance of its last pass (carried from state to
    state, a batch's in-place ranks included): no pass over the ranks before a rank could have been
    quiet for stall_s, and the stalled rank is found once it has."""
    from torchpass.coordinator.decide_common import stalled_ranks
    from torchpass.coordinator.model import STALL_FLOOR_CACHE

    pol = replace(P, stall_s=30.0)
    st = CoordState(job_id=1, world_size=8)
    for r in range(8):
        st = mc.apply(st, mc.RankRegistered(r, f"node{r // 2 + 1}", 8), 0.0)
    assert stalled_ranks(0.0, st, pol) == [] and st.__dict__[STALL_FLOOR_CACHE] == 0.0
    for t in range(5, 60, 5):  # every rank but 3 advances every 5 s, as one batch each
        owned = dict(st.ranks)
        batch = st.carry_views(replace(st, ranks=owned), copied_ranks=True)
        for r in range(8):
            if r != 3:
                batch = mc.apply(batch, mc.RankProgress(r, 10 * t, t // 5), float(t), owned=owned)
        st = batch
        found = stalled_ranks(float(t), st, pol)
        if t < 30:
            assert found == [] and st.__dict__[STALL_FLOOR_CACHE] == 0.0  # carried: no pass yet
        else:
            assert [r.rank for r in found] == [3], t  # quiet 30 s, behind the others
    # a rank that advances again is no longer stalled, and the floor moves up with it
    st = mc.apply(st, mc.RankProgress(3, 600, 55), 60.0)
    assert stalled_ranks(60.0, st, pol) == [] and st.__dict__[STALL_FLOOR_CACHE] >= 55.0
