"""machine.apply: outcomes recorded as facts, stale ones ignored, phase ends stamped."""

from __future__ import annotations

from dataclasses import replace

import pytest

from torchpass.coordinator import machine as mc
from torchpass.coordinator.decide import decide
from torchpass.coordinator.model import CoordState, Migration
from torchpass.coordinator.phases import Phase
from torchpass.coordinator.policy import CoordinatorPolicy
from torchpass.health import State

POLICY = CoordinatorPolicy()


def job(n_nodes=2, per_node=1, spares=("node9",)) -> CoordState:
    st = CoordState(job_id=3)
    r = 0
    for i in range(n_nodes):
        for _ in range(per_node):
            st = mc.apply(st, mc.RankRegistered(r, f"node{i + 1}", n_nodes * per_node), 0.0)
            r += 1
    for n in [f"node{i + 1}" for i in range(n_nodes)] + list(spares):
        st = mc.apply(st, mc.NodeHealthChanged(n, "healthy"), 0.0)
    for s in spares:
        st = mc.apply(st, mc.SpareAdded(s), 0.0)
    return st


def with_migration(st: CoordState, phase: Phase, **kw) -> CoordState:
    m = Migration(id="m1", node="node2", reason="r", trigger="health", ranks=(1,), detected=0.0, started=0.0,
                  phase=phase, phase_started=0.0, deadline=100.0, generation=1, target="node9", target_how="hot",
                  pause_at=50)
    return replace(st, migration=replace(m, **kw))


def test_registration_and_progress_track_when_a_rank_last_advanced():
    st = job()
    assert st.world_size == 2 and st.ranks[1].node == "node2" and st.ranks[1].last_advance == 0.0
    st = mc.apply(st, mc.RankProgress(1, 10, 2), 5.0)
    assert (st.ranks[1].collectives, st.ranks[1].step, st.ranks[1].last_advance) == (10, 2, 5.0)
    st = mc.apply(st, mc.RankProgress(1, 10, 2), 9.0)  # no advance: the time stays
    assert st.ranks[1].last_advance == 5.0
    assert mc.apply(st, mc.RankProgress(7, 1), 9.0) == st  # an unregistered rank: nothing to attach to


def test_health_since_moves_only_when_the_state_changes():
    st = job()
    st = mc.apply(st, mc.NodeHealthChanged("node2", State.DEGRADED, ("a",)), 10.0)
    st = mc.apply(st, mc.NodeHealthChanged("node2", "degraded", ("a", "b")), 20.0)
    h = st.health["node2"]
    assert h.state == State.DEGRADED and h.since == 10.0 and h.reasons == ("a", "b") and h.reachable
    with pytest.raises(ValueError):
        mc.apply(st, mc.NodeHealthChanged("node2", "poorly"), 1.0)


@pytest.mark.parametrize("outcome", [
    mc.MigrationDumpDone("m0", 1, "/i", "c"),  # another migration
    mc.MigrationDumpDone("m1", 0, "/i", "c"),  # a rank that is not moving
    mc.MigrationDumpFailed("m0", 1, "x"),
    mc.TransferDone("m1", 1, "node9", "/i", "c"),  # wrong phase
    mc.RestoreDone("m1", 1, "node9"),
    mc.Quiesced(1, 2, 50),  # wrong generation
    mc.Quiesced(1, 1, 49),  # wrong pause point
    mc.Armed(1, 49, 1, False, 60),  # refusal of an older pause point
    mc.SourceKilled("m1", "node2"),
    mc.SpareUnavailable("m1", "expand", "x"),
    mc.Drained("m1", "node2"),
])
def test_stale_or_misplaced_outcomes_are_ignored(outcome):
    st = with_migration(job(), Phase.DUMP if not isinstance(outcome, (mc.Quiesced, mc.Armed)) else Phase.PAUSE)
    assert mc.apply(st, outcome, 1.0) == st


def test_outcomes_from_a_replaced_target_are_ignored():
    st = with_migration(job(), Phase.RESTORE, target="node8")
    assert mc.apply(st, mc.RestoreDone("m1", 1, "node9"), 1.0) == st
    assert mc.apply(st, mc.RestoreFailed("m1", 1, "node9", "x", True), 1.0) == st
    st2 = mc.apply(st, mc.RestoreDone("m1", 1, "node8", {"criu_restore_s": 0.4}), 1.0)
    assert st2.migration.restored == {1} and st2.migration.tool_durations == {"restore.criu_restore_s": 0.4}


def test_the_last_outcome_of_a_phase_stamps_ready_at_once():
    st = with_migration(job(), Phase.PAUSE)
    st = mc.apply(st, mc.Quiesced(0, 1, 50), 1.0)
    assert st.migration.ready_at is None
    st = mc.apply(st, mc.Quiesced(1, 1, 50), 2.0)
    assert st.migration.ready_at == 2.0
    st = mc.apply(st, mc.Quiesced(1, 1, 50), 3.0)  # a repeat does not move it
    assert st.migration.ready_at == 2.0
    st = mc.apply(st, mc.RankProgress(0, 50), 4.0)
    assert st.migration.ready_at == 2.0


def test_first_failure_is_kept():
    st = with_migration(job(), Phase.RESTORE)
    st = mc.apply(st, mc.RestoreFailed("m1", 1, "node9", "first", False), 1.0)
    st = mc.apply(st, mc.RestoreFailed("m1", 1, "node9", "second", True), 1.0)
    f = st.migration.failure
    assert (f.step, f.why, f.target_lost) == ("restore", "rank 1: first", False)


def test_resumed_counts_cancelled_ranks_only_in_a_rollback():
    st = with_migration(job(), Phase.REBUILD)
    st2 = mc.apply(st, mc.Resumed(0, 0, cancelled=True), 1.0)
    assert st2.migration.resumed == frozenset()
    assert st2.ranks[0].last_advance == 1.0  # a resumed rank starts a fresh stall clock
    st = with_migration(job(), Phase.ROLLBACK)
    st = mc.apply(st, mc.Resumed(0, 0, cancelled=True), 1.0)
    st = mc.apply(st, mc.Resumed(1, 1, node="node2"), 1.5)
    assert st.migration.resumed == {0, 1} and st.migration.ready_at == 1.5


def test_spare_granted_and_unavailable():
    st = with_migration(job(spares=()), Phase.SPARE, target=None, spare_requested="expand")
    st2 = mc.apply(st, mc.SpareUnavailable("m1", "companion", "x"), 1.0)
    assert st2 == st  # not the strategy asked for
    st2 = mc.apply(st, mc.SpareUnavailable("m1", "expand", "no permit_job_expansion"), 1.0)
    assert st2.migration.spare_requested is None
    assert st2.migration.spare_failures == (("expand", "no permit_job_expansion"),)
    st3 = mc.apply(st, mc.SpareGranted("m1", "node7", "expand"), 1.0)
    assert st3.spare("node7").how == "expand" and st3.spare("node7").status == "free"
    assert st3.migration.spare_requested is None
    # A grant that arrives after its migration ended still adds the node as a spare.
    st4 = mc.apply(replace(st, migration=None), mc.SpareGranted("m1", "node7", "expand"), 1.0)
    assert st4.spare("node7") is not None
    assert st3.spare("node7").allocation is None
    st6 = mc.apply(st, mc.SpareGranted("m1", "node7", "companion", allocation=12), 1.0)
    assert st6.spare("node7").allocation == 12 and st6.spare("node7").how == "companion"
    st5 = mc.apply(st3, mc.SpareLost("node7", "gone"), 2.0)
    assert st5.spare("node7").status == "lost"


def test_accept_operator_assigns_ids_and_refuses_by_name():
    st = job(n_nodes=3, spares=("node9", "node8"))
    st, mid = mc.accept_operator(st, "node2", None, 1.0)
    st, mid2 = mc.accept_operator(st, "node3", "node8", 1.0)
    assert (mid, mid2) == ("m1", "m2") and [r.node for r in st.operator_requests] == ["node2", "node3"]
    cases = [
        (("node7", None), "not_found", "node node7 runs no rank of job 3 (its nodes: node1, node2, node3)"),
        (("node2", None), "conflict", "already in flight or queued"),
        (("node1", "node1"), "bad_request", "is the node being migrated"),
        (("node1", "node5"), "not_found", "node node5 is not a spare of job 3 (spares: node9, node8)"),
    ]
    for (node, to), code, text in cases:
        with pytest.raises(mc.OperatorRejected) as exc:
            mc.accept_operator(st, node, to, 2.0)
        assert exc.value.code == code and text in str(exc.value)
    st_used = replace(st, spares=tuple(replace(s, status="used") for s in st.spares))
    with pytest.raises(mc.OperatorRejected) as exc:
        mc.accept_operator(st_used, "node1", "node9", 2.0)
    assert exc.value.code == "conflict" and "spare node9 is used" in str(exc.value)
    partial = replace(job(), world_size=4)
    with pytest.raises(mc.OperatorRejected) as exc:
        mc.accept_operator(partial, "node1", None, 2.0)
    assert exc.value.code == "conflict" and "2/4 ranks registered" in str(exc.value)


def test_operator_migrate_outcome_queues_like_accept():
    st = mc.apply(job(), mc.OperatorMigrate("node1"), 1.0)
    assert st.operator_requests[0].id == "m1" and st.next_migration == 2


def test_apply_then_decide_is_the_driver_loop():
    st = job()
    st = mc.apply(st, mc.NodeHealthChanged("node2", "degraded", ("ib0: symbol errors rising",)), 5.0)
    d = decide(6.0, st, POLICY)
    assert d.state.migration.phase == Phase.PAUSE and d.state.migration.phase_durations["detect"] == 1.0


def test_reason_log_reports_only_changes():
    log = mc.ReasonLog()
    assert [log.changed(r) for r in ["a", "a", "b", "b", "a"]] == [True, False, True, False, True]


def test_not_an_outcome_is_a_type_error():
    with pytest.raises(TypeError):
        mc.apply(job(), object(), 0.0)


def test_what_a_rank_says_of_itself_is_kept_for_status_without_touching_the_decision():
    st = mc.apply(CoordState(job_id=7), mc.RankRegistered(1, "node2", 2, pid=41, generation=3), 1.0)
    rv = st.ranks[1]
    assert (rv.pid, rv.generation, rv.last_report, rv.last_count) == (41, 3, 1.0, 0)
    st = mc.apply(st, mc.RankProgress(1, 12, 2), 2.0)
    assert (st.ranks[1].last_report, st.ranks[1].last_count) == (2.0, 12)
    st2 = mc.apply(st, mc.Quiesced(1, 4, 20), 3.0)  # no migration in flight: decide sees nothing new
    assert (st2.ranks[1].last_report, st2.ranks[1].last_count, st2.ranks[1].collectives) == (3.0, 20, 12)
    st3 = mc.apply(st2, mc.Resumed(1, 4, "node5", collectives=21), 4.0)
    assert (st3.ranks[1].node, st3.ranks[1].generation, st3.ranks[1].last_count) == ("node5", 4, 21)
    assert mc.apply(st, mc.Armed(1, 30, 4, True, 25), 5.0).ranks[1].last_report == 5.0


def test_the_first_rank_that_says_unprotected_makes_the_job_unprotected_for_good():
    st = job()
    assert st.job_unprotected is None
    assert mc.apply(st, mc.RankUnprotected(0, ""), 1.0) == st  # nothing said: nothing changes
    st = mc.apply(st, mc.RankUnprotected(1, "process group 'tp' (new_group) cannot be moved yet"), 1.0)
    assert st.job_unprotected == "rank 1 unprotected: process group 'tp' (new_group) cannot be moved yet"
    assert mc.apply(st, mc.RankUnprotected(0, "another reason"), 2.0).job_unprotected == st.job_unprotected


def test_an_armed_refusal_that_says_unprotected_makes_the_job_unprotected():
    st = with_migration(job(), Phase.PAUSE)
    plain = mc.apply(st, mc.Armed(0, 50, 1, False, 60), 1.0)
    assert plain.job_unprotected is None and plain.migration.refused == ((0, 60),)
    st = mc.apply(st, mc.Armed(0, 50, 1, False, 60, "DeviceMesh"), 1.0)
    assert st.job_unprotected == "rank 0 unprotected: DeviceMesh"
    err = pytest.raises(mc.OperatorRejected, mc.accept_operator, replace(st, migration=None), "node1", None, 2.0)
    assert err.value.code == "conflict" and "job is unprotected: rank 0 unprotected: DeviceMesh" in str(err.value)
