"""The coordinator's decision logic: a pure function of (now, state, policy).

Model: torchft's lighthouse. ``decide(now, state, policy)`` reads no clock
and does no I/O; it returns a ``Decision`` with

* ``actions``: what the executor must do now (typed; torchpass.coordinator.contract),
* ``reason``: one human-readable line for the log (log it when it changes;
  it never embeds the time, so it changes only when the decision does),
* ``state``: the next state (torchpass.coordinator.model; phase transitions,
  deadlines and durations recorded). The driver keeps it and applies
  executor outcomes to it with ``machine.apply`` before the next call.

The core loads neither zmq nor structlog. It holds three state machines,
each with one table of legal transitions checked on every phase change:

=====================  ======================  =========================
machine                table                   handlers
=====================  ======================  =========================
migration              ``phases``              ``decide_migration``
whole-job snapshot     ``snapshot_phases``     ``decide_snapshot``
relaunch (lost node)   ``relaunch_phases``     ``decide_relaunch``
=====================  ======================  =========================

plus ``decide_rank_death``: a rank that died on a live node leads to a
relaunch (that machine) or is released to end as without torchpass.

plus ``decide_common`` (what they share), ``model`` (the state types),
``contract`` (actions and outcomes) and ``machine`` (``apply``). This module
runs them: each pass deals with dead ranks and lost nodes first (the relaunch machine),
then lets one machine act, chosen by ``next_turn``. docs/coordinator.md
draws each machine's diagram from its table (``python -m
torchpass.coordinator.diagrams``).

Every path that paused the job ends with a Resume or a ResumeInPlace
command: the job is never left paused by torchpass, not even by a bug in
the core (an illegal transition: see ``decide``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import replace

from torchpass.coordinator import decide_failslow as failslow
from torchpass.coordinator import decide_reroute as reroute
from torchpass.coordinator.decide_common import Decision, _Out
from torchpass.coordinator.decide_migration import (
    _PHASE_TEXT,
    _advance,
    _finish,
    _recover_migration,
    _start_next,
    candidates,
)
from torchpass.coordinator.decide_rank_death import handle_deaths
from torchpass.coordinator.decide_relaunch import _handle_lost, _recover_relaunch
from torchpass.coordinator.decide_snapshot import _recover_snapshot, _snapshot_step, snapshot_reason
from torchpass.coordinator.model import CoordState
from torchpass.coordinator.phases import IllegalTransition, Phase, Result, strict_default
from torchpass.coordinator.policy import CoordinatorPolicy
from torchpass.coordinator.relaunch_phases import IllegalRelaunchTransition
from torchpass.coordinator.snapshot_phases import IllegalSnapshotTransition
from torchpass.health_state import State


# ============================================================================
# Which machine acts
# ============================================================================
class Turn(enum.StrEnum):
    """The machine that acts on one pass of ``decide`` (after lost nodes were dealt with)."""

    SNAPSHOT = "snapshot"  # the whole-job snapshot in flight advances
    RESTORE_WAIT = "restore_wait"  # restored copies wait paused for their resume: nothing else starts
    MIGRATION_START = "migration_start"  # no migration in flight: start the next one, if any is due
    MIGRATION = "migration"  # the migration in flight advances


def next_turn(st: CoordState) -> Turn:
    """The priority between the machines, in one place. Lost nodes come first, on every pass
    (``decide_relaunch._handle_lost``: a relaunch or a hand-over to Slurm cannot wait for
    anything else); then, in this order:

    1. a whole-job snapshot asked for or in flight acts alone: no migration starts meanwhile
       (and a snapshot is refused while a migration runs or is queued, so none runs beside it);
    2. a relaunch from a whole-job snapshot with no migration in flight: the restored ranks wait
       paused for their resume (``_handle_lost`` sends it), so no migration starts meanwhile;
    3. no migration in flight: start the next one (operator requests first, then the oldest
       candidate);
    4. the migration in flight advances.
    """
    if st.snapshot is not None:
        return Turn.SNAPSHOT
    if st.relaunch is not None and st.relaunch.snapshot and st.migration is None:
        return Turn.RESTORE_WAIT
    if st.migration is None:
        return Turn.MIGRATION_START
    return Turn.MIGRATION


def _wait(out: _Out, st: CoordState, now: float, policy: CoordinatorPolicy) -> CoordState:
    return st


_TURNS: dict[Turn, Callable[[_Out, CoordState, float, CoordinatorPolicy], CoordState]] = {
    Turn.SNAPSHOT: _snapshot_step,
    Turn.RESTORE_WAIT: _wait,
    Turn.MIGRATION_START: _start_next,
    Turn.MIGRATION: _advance,
}


def _step(out: _Out, state: CoordState, now: float, policy: CoordinatorPolicy) -> CoordState:
    if state.snapshot_clock is None and state.all_registered():  # periodic snapshots count from here
        state = replace(state, snapshot_clock=now)
    state = failslow.track(state, now, policy)  # which nodes compute slower than their peers, since when
    state = reroute.track(out, state, now, policy)  # the job's data rails: link.down, a reroute to start
    st = state
    for _ in range(32):  # a few transitions can happen in one call (SPARE -> PAUSE)
        # Ranks that died on live nodes first (their wrappers hold srun's exit until this decides),
        # then lost nodes, and again once a move has ended: its nodes were not handed while involved.
        lost = _handle_lost(out, handle_deaths(out, st, now, policy), now, policy)
        nxt = _TURNS[next_turn(lost)](out, lost, now, policy)
        if nxt is st:
            break
        st = nxt
    return st


# ============================================================================
# Reasons
# ============================================================================
def _reason(now: float, st: CoordState, policy: CoordinatorPolicy) -> str:
    parts: list[str] = []
    m = st.migration
    if m is not None:
        if m.phase == Phase.SPARE:
            text = (f"waiting for a {m.spare_requested} spare from slurmctld" if m.spare_requested
                    else "waiting for a granted spare to report healthy")
        else:
            text = _PHASE_TEXT[m.phase].format(at=m.pause_at, gen=m.generation, ranks=list(m.ranks), node=m.node,
                                               target=m.target, why=m.rollback_reason, how=m.pause_estimate)
        parts.append(f"{m.id} {m.node} -> {m.target or '?'} ({m.reason}): {text}")
        queued = [r.node for r in st.operator_requests] + [c.node for c in candidates(now, st, policy)]
        if queued:
            parts.append(f"queued: {', '.join(queued)}")
    elif st.snapshot is not None:
        parts.append(snapshot_reason(st) or "")
    else:
        if not st.all_registered():
            parts.append(f"waiting for ranks to register ({len(st.ranks)}/{st.world_size or '?'})")
        elif st.job_unprotected is not None:
            parts.append(f"no migration starts: the job is unprotected ({st.job_unprotected})")
        elif st.slurm_down:
            parts.append(f"no migration starts while slurmctld is unreachable ({st.slurm_down})")
        else:
            parts.append("no migration needed")
    nodes = st.rank_nodes()
    health = st.health
    unknown = sorted(n for n in nodes if ((h := health.get(n)) is None or h.state == State.UNKNOWN)
                     and n not in st.handed)
    if unknown:
        parts.append(f"health unknown (not a reason to move): {', '.join(unknown)}")
    unprot = sorted(n for n in st.unprotected if n in nodes and n not in st.handed)
    if unprot:
        parts.append(f"no spare, running unprotected: {', '.join(unprot)}")
    if st.given_up:
        parts.append(f"given up on: {', '.join(sorted(st.given_up))}")
    if st.handed:
        parts.append(f"handed to Slurm: {', '.join(sorted(st.handed))}")
    return "; ".join(parts)


# ============================================================================
# decide
# ============================================================================
def _recover(out: _Out, st: CoordState, now: float, policy: CoordinatorPolicy, exc: IllegalTransition
             ) -> CoordState:
    """Production answer to a bug in the core: drop what this call decided and end the machine
    whose table refused the edge, the way that machine can end safely."""
    if isinstance(exc, IllegalSnapshotTransition):
        return _recover_snapshot(out, st, now, exc)
    if isinstance(exc, IllegalRelaunchTransition):
        return _recover_relaunch(out, st, exc)
    return _recover_migration(out, st, now, policy, exc)


def decide(now: float, state: CoordState, policy: CoordinatorPolicy, *, strict: bool | None = None) -> Decision:
    """What to do now. Pure: reads nothing but its arguments (and, with ``strict`` None,
    phases.strict_default()). An illegal phase transition of any machine raises
    ``IllegalTransition`` (or its snapshot or relaunch subclass) in strict mode; otherwise the
    machine that tried it ends the way it safely can (``_recover``)."""
    out = _Out()
    try:
        st = _step(out, state, now, policy)
    except IllegalTransition as exc:
        if strict_default() if strict is None else strict:
            raise
        out = _Out()
        st = _recover(out, state, now, policy, exc)
    return Decision(tuple(out.actions), _reason(now, st, policy), st)


def job_ended(now: float, state: CoordState, policy: CoordinatorPolicy) -> Decision:
    """The job ended (the coordinator stops with it). A migration whose ranks already run on the
    target (DRAIN, SHRINK) is complete: Slurm releases the source node with the job, so the
    release need not be waited for. Any other migration ends with the job, unrecorded; nothing
    new starts. Pure, like ``decide``."""
    out = _Out()
    st = state
    m = state.migration
    if m is not None and m.phase in (Phase.DRAIN, Phase.SHRINK):
        what = f"drain of {m.node}" if m.phase == Phase.DRAIN else "shrink"
        m = replace(m, notes=m.notes + (f"{what} not confirmed: the job ended first and {m.node} leaves with it",))
        st = _finish(out, st, m, now, Result.COMPLETED, policy,
                     f"{m.id}: moved ranks {list(m.ranks)} from {m.node} to {m.target}; the job ended before "
                     f"{m.node} was released ({'; '.join(m.notes)})", "migration.completed")
    return Decision(tuple(out.actions), "the job has ended", st)

