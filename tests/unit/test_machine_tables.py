"""The whole-job snapshot and relaunch machines: every phase change passes one checked table.

Each table's legal edges are all taken by the scenarios below (recorded through the checks
themselves), an edge left out of the table raises in strict mode, and in production mode it
takes the machine's safe end: a snapshot resumes every rank and ends as failed; a relaunch,
which cannot be undone, ends as failed with ``job.relaunch_failed``.
"""

from __future__ import annotations

import pytest

from test_snapshot_decide import P, Sim
from torchpass.coordinator import contract as ct
from torchpass.coordinator import machine as mc
from torchpass.coordinator import relaunch_phases, snapshot_phases
from torchpass.coordinator.decide import decide
from torchpass.coordinator.decide_relaunch import resumed_from_stop
from torchpass.coordinator.relaunch_phases import (
    RELAUNCH_RESULTS,
    RELAUNCH_TRANSITIONS,
    IllegalRelaunchTransition,
    RelaunchKind,
    RelaunchPhase,
    RelaunchResult,
)
from torchpass.coordinator.snapshot_phases import (
    SNAP_RESULTS,
    SNAP_TRANSITIONS,
    IllegalSnapshotTransition,
    SnapPhase,
    SnapResult,
)
from torchpass.health_state import State

NODES = ("node1", "node2", "node3")


def _lose(sim: Sim, node: str = "node2") -> list:
    return sim.tick(1.0, mc.NodeHealthChanged(node, State.FAILED, ("gone",), reachable=False))


def _snapshot_done(sim: Sim, sid: str = "s1", stop: bool = False) -> None:
    """A snapshot taken through to its manifest (not stopped: resumed too)."""
    sim.state = mc.accept_snapshot(sim.state, sid, sim.now, stop=stop)
    (pause,) = sim.of(ct.PauseAt, sim.tick())
    sim.quiesce(pause)
    sim.tick(1.0, *[ct.RankDumped(sid, sim.image(r, sid)) for r in range(3)])
    sim.tick(0.2, ct.SnapshotCommitted(sid, f"/m/{sid}.json", 6_000_000))
    if not stop:
        sim.tick(0.2, *[mc.Resumed(r, sim.state.generation + 1) for r in range(3)])


# --- scenarios: together they take every edge of both tables -------------------------------
def snap_completed_then_failed_pause():
    sim = Sim()
    _snapshot_done(sim)
    sim.state = mc.accept_snapshot(sim.state, "s2", sim.now)
    sim.tick()
    sim.tick(60.0)  # the pause times out: PAUSE -> RESUME (failed)
    sim.tick(0.5, *[mc.Resumed(r, sim.state.snapshot.generation) for r in range(3)])


def snap_failed_dump():
    sim = Sim()
    sim.state = mc.accept_snapshot(sim.state, "s1", sim.now)
    (pause,) = sim.of(ct.PauseAt, sim.tick())
    sim.quiesce(pause)
    sim.tick(0.5, ct.RankDumpFailed("s1", 1, "criu failed"))
    sim.tick(0.5, *[mc.Resumed(r, 1) for r in range(3)])


def snap_stop_failed():
    sim = Sim()
    _snapshot_done(sim, stop=True)
    sim.tick(0.5, ct.JobStopFailed("s1", "requeuehold refused"))  # STOP -> RESUME


def snap_not_taken():
    sim = Sim()
    sim.state = mc.accept_snapshot(sim.state, "s1", sim.now)
    sim.feed(mc.OperatorMigrate("node2", None))  # queued after it: the snapshot is refused when it starts
    sim.tick()


def _relaunchable(sim: Sim) -> None:
    sim.feed(ct.CheckpointCompleted(5, "/ckpt/5"))


def snap_ended_by_relaunch(phase=SnapPhase.DUMP):
    sim = Sim()
    _relaunchable(sim)
    stop = phase == SnapPhase.STOP
    sim.state = mc.accept_snapshot(sim.state, "s1", sim.now, stop=stop)
    if phase != SnapPhase.QUEUED:
        (pause,) = sim.of(ct.PauseAt, sim.tick())
        if phase != SnapPhase.PAUSE:
            sim.quiesce(pause)
            if phase != SnapPhase.DUMP:
                sim.tick(1.0, *[ct.RankDumped("s1", sim.image(r)) for r in range(3)])
    assert sim.state.snapshot.phase == phase
    _lose(sim)
    assert sim.state.snapshot is None and sim.state.relaunch is not None


def relaunch_from_checkpoint():
    sim = Sim()
    _relaunchable(sim)
    _lose(sim)
    assert sim.state.relaunch.phase == RelaunchPhase.REGISTERING
    assert sim.state.relaunch.kind == RelaunchKind.LOST_NODE
    sim.tick(1.0, *[mc.RankRegistered(r, n, 3) for r, n in enumerate(("node1", "node4", "node3"))])
    assert sim.state.relaunch is None and sim.events("job.relaunched")


def relaunch_from_snapshot(fresh: bool = False):
    sim = Sim()
    _snapshot_done(sim)
    _lose(sim)
    r = sim.state.relaunch
    assert r.phase == RelaunchPhase.RESTORING and r.snapshot == "s1"
    sim.tick(1.0, *[mc.RankRegistered(i, n, 3, restored="" if fresh else "s1")
                    for i, n in enumerate(("node1", "node4", "node3"))])
    if fresh:
        assert sim.state.relaunch is None and sim.events("job.restore_missed")
        return
    assert sim.state.relaunch.phase == RelaunchPhase.RESUMING
    sim.tick(0.5, *[mc.Resumed(i, r.generation) for i in range(3)])
    assert sim.state.relaunch is None and sim.events("job.relaunched")


def relaunch_restore_missed():
    relaunch_from_snapshot(fresh=True)


def resumed_stop():
    sim = Sim(nodes=())
    sim.state = resumed_from_stop(7, sim.now, "s1", 10, 1, 3, 0)
    assert sim.state.relaunch.kind == RelaunchKind.RESUMED_STOP
    sim.tick(0.1, *[mc.RankRegistered(r, f"node{r + 5}", 3, restored="s1") for r in range(3)])
    sim.tick(0.5, *[mc.Resumed(r, 1) for r in range(3)])
    assert sim.events("job.resumed") and sim.state.relaunch is None


def _scenarios():
    yield snap_completed_then_failed_pause
    yield snap_failed_dump
    yield snap_stop_failed
    yield snap_not_taken
    for ph in (SnapPhase.QUEUED, SnapPhase.PAUSE, SnapPhase.DUMP, SnapPhase.STOP, SnapPhase.RESUME):
        yield lambda ph=ph: snap_ended_by_relaunch(ph)
    yield relaunch_from_checkpoint
    yield relaunch_from_snapshot
    yield relaunch_restore_missed
    yield resumed_stop


def _record(monkeypatch, module):
    seen: set = set()
    ends: set = set()
    check, result = module.check_transition, module.check_result

    def transition(name, src, dst):
        seen.add((src, dst))
        check(name, src, dst)

    def end(name, phase, res):
        seen.add((phase, None))
        ends.add((phase, res))
        result(name, phase, res)

    monkeypatch.setattr(module, "check_transition", transition)
    monkeypatch.setattr(module, "check_result", end)
    return seen, ends


@pytest.mark.parametrize("module,table,results", [
    (snapshot_phases, SNAP_TRANSITIONS, SNAP_RESULTS),
    (relaunch_phases, RELAUNCH_TRANSITIONS, RELAUNCH_RESULTS),
], ids=["snapshot", "relaunch"])
def test_every_legal_edge_is_taken_and_accepted(monkeypatch, module, table, results):
    seen, ends = _record(monkeypatch, module)
    for run in _scenarios():
        run()
    legal = {(src, dst) for src, dsts in table.items() for dst in dsts}
    assert legal - seen == set(), "legal edges no scenario took"
    assert seen - legal == set()
    assert {(ph, r) for ph, rs in results.items() for r in rs} - ends == set(), "legal ends no scenario took"
    want_ends = {(ph, r) for ph, rs in results.items() for r in rs}
    assert ends <= want_ends


def test_edges_outside_the_tables_raise():
    for module, table, phases in ((snapshot_phases, SNAP_TRANSITIONS, list(SnapPhase)),
                                  (relaunch_phases, RELAUNCH_TRANSITIONS, list(RelaunchPhase))):
        for src in [None, *phases]:
            for dst in [None, *phases]:
                if dst in table.get(src, frozenset()):
                    module.check_transition("x", src, dst)
                else:
                    with pytest.raises(module.IllegalSnapshotTransition if module is snapshot_phases
                                       else module.IllegalRelaunchTransition):
                        module.check_transition("x", src, dst)
    with pytest.raises(IllegalSnapshotTransition):
        snapshot_phases.check_result("s1", SnapPhase.PAUSE, SnapResult.COMPLETED)
    with pytest.raises(IllegalRelaunchTransition):
        relaunch_phases.check_result("relaunch1", RelaunchPhase.RESTORING, RelaunchResult.RELAUNCHED)


# --- strict mode raises; production takes the safe end ---------------------------------------
def _snapshot_at_dump(sim: Sim) -> None:
    sim.state = mc.accept_snapshot(sim.state, "s1", sim.now)
    (pause,) = sim.of(ct.PauseAt, sim.tick())
    sim.quiesce(pause)
    assert sim.state.snapshot.phase == SnapPhase.DUMP


def test_an_illegal_snapshot_edge_raises_in_strict_mode(monkeypatch):
    sim = Sim()
    _snapshot_at_dump(sim)
    monkeypatch.setitem(SNAP_TRANSITIONS, SnapPhase.DUMP, frozenset({SnapPhase.STOP, None}))  # DUMP -> RESUME
    with pytest.raises(IllegalSnapshotTransition, match="snapshot s1: illegal phase transition dump -> resume"):
        sim.tick(1.0, *[ct.RankDumped("s1", sim.image(r)) for r in range(3)])


def test_an_illegal_snapshot_edge_in_production_resumes_every_rank_and_fails_the_snapshot(monkeypatch):
    monkeypatch.setenv("TORCHPASS_STRICT_TRANSITIONS", "0")
    sim = Sim()
    _snapshot_at_dump(sim)
    monkeypatch.setitem(SNAP_TRANSITIONS, SnapPhase.DUMP, frozenset({SnapPhase.STOP, None}))
    sim.feed(*[ct.RankDumped("s1", sim.image(r)) for r in range(3)])
    sim.now += 1.0
    d = decide(sim.now, sim.state, P, strict=False)
    (rip,) = [a for a in d.actions if isinstance(a, ct.ResumeInPlace)]
    assert rip.migration == "s1" and rip.generation == 1 and "aborted" in rip.why
    (discard,) = [a for a in d.actions if isinstance(a, ct.DiscardSnapshot)]
    assert discard.nodes == NODES and not [a for a in d.actions if isinstance(a, ct.CommitSnapshot)]
    (ev,) = [a for a in d.actions if isinstance(a, ct.Event)]
    assert ev.kind == "snapshot.failed" and ev.data["outcome"] == SnapResult.ABORTED and "bug" in ev.data["why"]
    assert d.state.snapshot is None and d.state.generation == 1


def _relaunch_restoring(sim: Sim) -> None:
    _snapshot_done(sim)
    _lose(sim)
    assert sim.state.relaunch.phase == RelaunchPhase.RESTORING


def test_an_illegal_relaunch_edge_raises_in_strict_mode(monkeypatch):
    sim = Sim()
    _relaunch_restoring(sim)
    monkeypatch.setitem(RELAUNCH_TRANSITIONS, RelaunchPhase.RESTORING, frozenset({None}))
    with pytest.raises(IllegalRelaunchTransition, match="relaunch1: illegal phase transition restoring -> resuming"):
        sim.tick(1.0, *[mc.RankRegistered(i, n, 3, restored="s1") for i, n in enumerate(("node1", "node4", "node3"))])


def test_an_illegal_relaunch_edge_in_production_ends_it_as_failed_and_resumes_the_restored_ranks(monkeypatch):
    sim = Sim()
    _relaunch_restoring(sim)
    monkeypatch.setitem(RELAUNCH_TRANSITIONS, RelaunchPhase.RESTORING, frozenset({None}))
    sim.feed(*[mc.RankRegistered(i, n, 3, restored="s1") for i, n in enumerate(("node1", "node4", "node3"))])
    d = decide(sim.now + 1.0, sim.state, P, strict=False)
    (ev,) = [a for a in d.actions if isinstance(a, ct.Event)]
    assert ev.kind == "job.relaunch_failed" and ev.data["outcome"] == RelaunchResult.FAILED
    assert ev.data["src"] == "restoring" and ev.data["dst"] == "resuming" and "without torchpass" in ev.message
    (rip,) = [a for a in d.actions if isinstance(a, ct.ResumeInPlace)]
    assert rip.migration == "relaunch1", "the restored copies are not left paused"
    assert d.state.relaunch is None
    # The job goes on: the next decision does not raise and starts nothing for the ended relaunch.
    d2 = decide(sim.now + 2.0, d.state, P, strict=False)
    assert not [a for a in d2.actions if isinstance(a, (ct.ResumeInPlace, ct.Relaunch))]


def test_the_priority_between_the_machines_is_next_turn():
    """A snapshot acts alone; restored copies waiting for their resume keep migrations from
    starting; otherwise a migration starts or advances."""
    from dataclasses import replace

    from torchpass.coordinator.decide import Turn, next_turn
    from torchpass.coordinator.model import RelaunchRun, SnapshotRun

    sim = Sim()
    st = sim.state
    assert next_turn(st) == Turn.MIGRATION_START
    snap = SnapshotRun("s1", 0.0)
    from_snapshot = RelaunchRun(1, "node2", "node4", 0.0, 5, 6, snapshot="s0", phase=RelaunchPhase.RESTORING)
    from_checkpoint = RelaunchRun(1, "node2", "node4", 0.0, 5, 6)
    assert next_turn(replace(st, snapshot=snap, relaunch=from_snapshot)) == Turn.SNAPSHOT
    assert next_turn(replace(st, relaunch=from_snapshot)) == Turn.RESTORE_WAIT
    assert next_turn(replace(st, relaunch=from_checkpoint)) == Turn.MIGRATION_START
    sim.tick(0.0, mc.NodeHealthChanged("node2", State.DEGRADED, ("ecc",)))
    assert sim.state.migration is not None
    assert next_turn(sim.state) == Turn.MIGRATION
    assert next_turn(replace(sim.state, relaunch=from_snapshot)) == Turn.MIGRATION


# --- machine.apply: one handler per outcome type ----------------------------------------------
def test_every_outcome_type_has_an_apply_handler_and_nothing_else_does():
    import dataclasses
    import typing

    outcomes = set(typing.get_args(ct.Outcome))
    missing = sorted(t.__name__ for t in outcomes - set(mc.APPLY))
    assert missing == [], f"outcomes machine.apply has no handler for: {missing}"
    assert sorted(t.__name__ for t in set(mc.APPLY) - outcomes) == []
    # A dataclass added to the contract is an action, an outcome, or a value inside one: an outcome
    # left out of the Outcome union would escape the check above.
    values = {ct.SnapImage}
    kinds = set(typing.get_args(ct.Action)) | outcomes | values
    classes = {v for v in vars(ct).values() if isinstance(v, type) and dataclasses.is_dataclass(v)
               and v.__module__ == ct.__name__}
    assert sorted(c.__name__ for c in classes - kinds) == []


def test_apply_refuses_what_is_not_an_outcome():
    with pytest.raises(TypeError, match="not an outcome"):
        mc.apply(Sim().state, ct.PauseAt("m1", 10, 1, ()), 0.0)


# --- docs/coordinator.md draws each machine from its table ----------------------------------
def test_the_state_diagrams_in_the_doc_are_the_ones_the_tables_generate():
    from pathlib import Path

    from torchpass.coordinator import diagrams

    doc = (Path(__file__).resolve().parents[2] / "docs" / "coordinator.md").read_text()
    assert diagrams.section(doc) == diagrams.generated(), (
        "docs/coordinator.md's state diagrams differ from the tables: "
        "run `python -m torchpass.coordinator.diagrams --update docs/coordinator.md`")


def test_a_changed_table_changes_its_diagram(monkeypatch):
    from torchpass.coordinator import diagrams

    before = diagrams.generated()
    monkeypatch.setitem(RELAUNCH_TRANSITIONS, RelaunchPhase.RESTORING, frozenset({None}))
    after = diagrams.generated()
    assert "restoring --> resuming" in before and "restoring --> resuming" not in after
