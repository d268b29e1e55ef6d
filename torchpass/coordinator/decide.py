"""The coordinator's decision logic: a pure function of (now, state, policy).

Model: torchft's lighthouse. ``decide(now, state, policy)`` reads no clock
and does no I/O; it returns a ``Decision`` with

* ``actions``: what the executor must do now (typed; torchpass.coordinator.contract),
* ``reason``: one human-readable line for the log (log it when it changes;
  it never embeds the time, so it changes only when the decision does),
* ``state``: the next state (torchpass.coordinator.model; phase transitions,
  deadlines and durations recorded). The driver keeps it and applies
  executor outcomes to it with ``machine.apply`` before the next call.

The core is five modules, none of which loads zmq or structlog:

* ``phases``: ``Phase``, how a migration ends (``Result``), and the one table
  of legal transitions, checked on every phase change;
* ``model``: the state types (``CoordState``, ``Migration``, ...) and their enums;
* ``contract``: actions (decide -> executor) and outcomes (-> machine.apply);
* ``decide`` (this module): one handler per phase;
* ``machine``: ``apply(state, outcome, now)``.

A migration moves every rank of one node to a spare through explicit
phases, one migration per job at a time:

    SPARE -> PAUSE -> DUMP -> TRANSFER -> RESTORE -> KILL_SOURCE -> REBUILD -> DRAIN -> SHRINK
                 \\________\\_______\\_________\\__________/
                                 ROLLBACK (resume in place on the source)

(phases.py draws every edge, the ends included.) Each phase has its handler
``_on_<phase>`` (``_HANDLERS``); for the paused phases ``_advance`` first
deals with a lost source or target, which can cut any of them short.

Training is paused from PAUSE to the end of REBUILD (or ROLLBACK). Each of
those phases has a deadline from the policy; an expired deadline or a
failure rolls back while the source copy is still alive (CRIU dumps with
--leave-running semantics, and the source is killed only after every
restore succeeded). Every path that paused the job ends with a Resume or a
ResumeInPlace command: the job is never left paused by torchpass, not even
by a bug in this module (an illegal transition: see ``decide``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from torchpass.coordinator.contract import (
    AbortRestore,
    Action,
    CommitSnapshot,
    DiscardSnapshot,
    Drain,
    DumpRank,
    Event,
    HandToSlurm,
    KillSource,
    PauseAt,
    Relaunch,
    RelaunchPossible,
    RequestSpare,
    Restore,
    Resume,
    ResumeInPlace,
    Shrink,
    MigrationDump,
    StopJob,
    ForgetStopped,
    Transfer,
)
from torchpass.coordinator.model import (
    SNAP_DUMP,
    SNAP_PAUSE,
    SNAP_QUEUED,
    SNAP_RESUME,
    SNAP_STOP,
    STALL_FLOOR_CACHE,
    CoordState,
    Failure,
    Image,
    Migration,
    MigrationRecord,
    NodeHealth,
    OperatorRequest,
    RankView,
    RelaunchRun,
    SnapshotPoint,
    SpareHow,
    SpareStatus,
    SnapshotRun,
    SpareView,
    Trigger,
)
from torchpass.coordinator.phases import (
    PAUSED_PHASES,
    IllegalTransition,
    Phase,
    Result,
    check_result,
    check_transition,
    strict_default,
)
from torchpass.coordinator.policy import CoordinatorPolicy
from torchpass.health_state import State


@dataclass(frozen=True)
class Decision:
    actions: tuple[Action, ...]
    reason: str
    state: CoordState


# ============================================================================
# Helpers
# ============================================================================
class _Out:
    def __init__(self) -> None:
        self.actions: list[Action] = []

    def add(self, *acts: Action) -> None:
        self.actions.extend(acts)

    def event(self, kind: str, message: str, **data: Any) -> None:
        self.actions.append(Event(kind, message, data))


def _r(x: float) -> float:
    return round(x, 3)


def _lost(h: NodeHealth) -> bool:
    return h.state == State.FAILED and not h.reachable


def _health_text(h: NodeHealth) -> str:
    return "; ".join(h.reasons) if h.reasons else h.state.value


def spare_usable(st: CoordState, sp: SpareView, policy: CoordinatorPolicy) -> bool:
    if sp.status != SpareStatus.FREE or sp.node in st.handed:
        return False
    h = st.node_health(sp.node)
    if policy.spare_requires_healthy:
        return h.state == State.HEALTHY
    return h.state in (State.HEALTHY, State.UNKNOWN)


def _pick_spare(st: CoordState, m: Migration, policy: CoordinatorPolicy) -> SpareView | None:
    allowed_hot = SpareHow.HOT in policy.spare_strategies
    order = {s: i for i, s in enumerate(policy.spare_strategies)}
    usable = [
        sp for sp in st.spares
        if spare_usable(st, sp, policy) and sp.node not in m.tried and sp.node != m.node
        and (sp.how != SpareHow.HOT or allowed_hot)
    ]
    usable.sort(key=lambda sp: (order.get(sp.how, 99), sp.node))
    return usable[0] if usable else None


def _set_spare(st: CoordState, node: str | None, status: SpareStatus) -> CoordState:
    if node is None or st.spare(node) is None:
        return st
    return replace(st, spares=tuple(replace(s, status=status) if s.node == node else s for s in st.spares))


def _target_lost(st: CoordState, m: Migration) -> bool:
    if m.target is None:
        return False
    sp = st.spare(m.target)
    return (sp is not None and sp.status == SpareStatus.LOST) or st.node_health(m.target).state == State.FAILED


def _source_lost(st: CoordState, m: Migration) -> bool:
    return _lost(st.node_health(m.node))


def in_place_master(st: CoordState) -> str:
    """The node whose rank serves the rendezvous of a resume in place (rank 0's)."""
    return _master(st, None)


def _master(st: CoordState, moved: Migration | None) -> str:
    if not st.ranks:
        return moved.target if moved and moved.target else ""
    first = min(st.ranks)
    if moved is not None and first in moved.ranks and moved.target:
        return moved.target
    return st.ranks[first].node


def stalled_ranks(now: float, st: CoordState, policy: CoordinatorPolicy) -> list[RankView]:
    """Ranks behind another rank's collective count that have not advanced for stall_s."""
    if policy.stall_s <= 0 or len(st.ranks) < 2:
        return []
    # decide asks on every tick (issue 13: a pass over 8,192 ranks was ~7 % of the serve thread at
    # steady state). No rank can be quiet that long before the lowest last_advance of an earlier
    # pass is (model.STALL_FLOOR_CACHE, carried between states): until then, no pass at all.
    stall_s = policy.stall_s
    floor = st.__dict__.get(STALL_FLOOR_CACHE)
    if floor is not None and now - floor < stall_s:
        return []
    floor = min(r.last_advance for r in st.ranks.values())
    st.__dict__[STALL_FLOOR_CACHE] = floor
    if now - floor < stall_s:
        return []
    quiet = [r for r in st.ranks.values() if now - r.last_advance >= stall_s]
    if not quiet:
        return []
    top = max(r.collectives for r in st.ranks.values())
    return sorted((r for r in quiet if r.collectives < top), key=lambda r: r.rank)


@dataclass(frozen=True)
class Candidate:
    node: str
    reason: str
    trigger: Trigger
    detected: float


def candidates(now: float, st: CoordState, policy: CoordinatorPolicy) -> list[Candidate]:
    """Nodes that need an automatic migration, oldest first (excludes the one in flight)."""
    busy = {st.migration.node} if st.migration else set()
    busy |= {r.node for r in st.operator_requests}
    skip = busy | set(st.handed) | set(st.released) | set(st.given_up)
    found: dict[str, Candidate] = {}
    # Only a node with a health report can trigger (unknown and healthy never do): the few in a
    # triggering state, found in one pass over the reports (decide runs every tick; issue 13).
    triggering = [n for n, h in st.health.items()
                  if h.state is not State.HEALTHY and h.state.value in policy.migrate_on]
    nodes = st.rank_nodes() if triggering else {}
    for node in sorted(triggering):
        if node not in nodes or node in skip or st.deferred.get(node, float("-inf")) > now:
            continue
        h = st.health[node]
        if _lost(h):
            continue  # lost is handed to Slurm
        found[node] = Candidate(node, _health_text(h), Trigger.HEALTH, h.since)
    for r in stalled_ranks(now, st, policy):
        if r.node in skip or r.node in found or st.deferred.get(r.node, float("-inf")) > now:
            continue
        if _lost(st.node_health(r.node)):
            continue
        found[r.node] = Candidate(r.node, f"rank {r.rank} stalled", Trigger.STALL,
                                  r.last_advance + policy.stall_s)
    return sorted(found.values(), key=lambda c: (c.detected, c.node))


def check_operator_request(st: CoordState, node: str, to: str | None) -> tuple[str, str] | None:
    """Why `tpassctl migrate` must be refused, as (wire error code, message); None if fine."""
    if st.job_unprotected is not None:
        return "conflict", f"job is unprotected: {st.job_unprotected}; torchpass cannot migrate it"
    nodes = st.rank_nodes()
    if node not in nodes:
        return "not_found", (
            f"node {node} runs no rank of job {st.job_id} (its nodes: {', '.join(sorted(nodes)) or 'none registered'})"
        )
    if node in st.handed:
        return "conflict", f"node {node} was lost and handed to Slurm; it cannot be migrated"
    pinned = st.pinned_nodes().get(node)
    if pinned:
        return "conflict", f"node {node} cannot move: {pinned}"
    if (st.migration is not None and st.migration.node == node) or any(r.node == node for r in st.operator_requests):
        return "conflict", f"a migration of {node} is already in flight or queued"
    if to is not None:
        if to == node:
            return "bad_request", f"--to {to} is the node being migrated"
        sp = st.spare(to)
        if sp is None:
            spares = ", ".join(s.node for s in st.spares) or "none"
            return "not_found", f"node {to} is not a spare of job {st.job_id} (spares: {spares})"
        if sp.status != SpareStatus.FREE:
            return "conflict", f"spare {to} is {sp.status}, not free"
    if not st.all_registered():
        return "conflict", (
            f"job {st.job_id} has {len(st.ranks)}/{st.world_size or '?'} ranks registered; "
            "a migration needs every rank to be reachable"
        )
    return None


def _everyone_in(st: CoordState, acks: frozenset[int]) -> bool:
    """Every rank is in ``acks``. machine asks after each rank's report: the sizes first, so that a
    fan-in of N reports costs O(N), not O(N) each (issue 13)."""
    return bool(st.ranks) and len(acks) >= len(st.ranks) and st.ranks.keys() <= acks


def phase_complete(st: CoordState, m: Migration) -> bool:
    """The completion condition of the current phase (used by machine for ready_at)."""
    if m.phase == Phase.PAUSE:
        return _everyone_in(st, m.quiesced)
    if m.phase == Phase.DUMP:
        return set(m.ranks) <= set(m.images)
    if m.phase == Phase.TRANSFER:
        return set(m.ranks) <= set(m.transferred)
    if m.phase == Phase.RESTORE:
        return set(m.ranks) <= m.restored
    if m.phase == Phase.KILL_SOURCE:
        return m.source_killed
    if m.phase in (Phase.REBUILD, Phase.ROLLBACK):
        return _everyone_in(st, m.resumed)
    if m.phase == Phase.DRAIN:
        return m.drain_done
    if m.phase == Phase.SHRINK:
        return m.shrink_done
    return False


def _stood_still(m: Migration) -> float | None:
    """When training stood still: every rank at T, else (rolled back before they all got
    there) the first rank that stopped; None if no rank ever stopped."""
    return m.stood_still_since if m.stood_still_since is not None else m.first_quiesced


def _close_phase(m: Migration, now: float) -> dict[str, float]:
    d = dict(m.phase_durations)
    end = m.ready_at if m.ready_at is not None else now
    d[m.phase.value] = _r(d.get(m.phase.value, 0.0) + max(0.0, end - m.phase_started))
    return d


def _enter(m: Migration, phase: Phase, now: float, deadline: float, **changes: Any) -> Migration:
    """``m`` in ``phase`` from ``now``: every phase change goes through here and the table."""
    check_transition(m.id, m.phase, phase)
    return replace(m, phase=phase, phase_started=now, deadline=deadline, ready_at=None,
                   phase_durations=_close_phase(m, now), **changes)


def _finish(out: _Out, st: CoordState, m: Migration, now: float, outcome: Result, policy: CoordinatorPolicy,
            message: str, kind: str, *, checked: bool = True) -> CoordState:
    """End ``m`` with ``outcome`` (every end goes through here and the table; ``checked=False``
    only for the recovery from an illegal transition)."""
    if checked:
        check_result(m.id, m.phase, outcome)
    durations = _close_phase(m, now)
    durations["total"] = _r(now - m.started)
    if "paused" not in durations and m.paused:
        since = _stood_still(m)
        durations["paused"] = _r(now - since) if since is not None else 0.0
    m = replace(m, phase_durations=durations)
    if m.target is not None:
        sp = st.spare(m.target)
        if sp is not None and sp.status == SpareStatus.RESERVED:
            st = _set_spare(st, m.target, SpareStatus.USED if outcome == Result.COMPLETED else SpareStatus.FREE)
    rec = MigrationRecord(m.id, m.node, m.target, outcome, m.reason, durations)
    st = replace(st, migration=None, history=(st.history + (rec,))[-50:])
    data: dict[str, Any] = {"migration": m.id, "node": m.node, "target": m.target, "outcome": outcome,
                            "phase_durations": durations}
    if m.tool_durations:
        data["tool_durations"] = dict(m.tool_durations)
    if m.pause_at is not None:
        data["pause_at"] = m.pause_at
        data["pause_estimate"] = m.pause_estimate
    out.event(kind, message, **data)
    if outcome in (Result.COMPLETED, Result.CANCELLED, Result.SOURCE_LOST, Result.REJECTED, Result.ABORTED):
        return st
    if outcome == Result.NO_SPARE:
        return replace(st, deferred={**st.deferred, m.node: now + policy.spare_retry_s},
                       unprotected=st.unprotected | {m.node})
    # rolled_back / stuck: count the failure; back off, then try again or give up.
    n = st.failures.get(m.node, 0) + 1
    st = replace(st, failures={**st.failures, m.node: n},
                 deferred={**st.deferred, m.node: now + policy.retry_backoff_s})
    if n >= policy.max_attempts_per_node and m.node not in st.given_up and m.trigger != Trigger.OPERATOR:
        st = replace(st, given_up=st.given_up | {m.node})
        out.event("migration.abandoned",
                  f"{m.node}: {n} migrations failed; torchpass stops trying (tpassctl migrate can still try)",
                  node=m.node, failures=n)
    return st


# ============================================================================
# Rollback and loss
# ============================================================================
def _rollback(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, why: str) -> CoordState:
    if _source_lost(st, m):
        return _job_lost(out, st, m, now, policy, f"{why}, and {m.node} is lost")
    if m.target is not None and (m.restored or m.phase in (Phase.RESTORE, Phase.KILL_SOURCE)):
        out.add(AbortRestore(m.id, m.target, tuple(m.ranks)))
    if m.target is not None:
        sp = st.spare(m.target)
        if sp is not None and sp.status == SpareStatus.RESERVED:
            st = _set_spare(st, m.target, SpareStatus.FREE)
    master = _master(st, None)
    out.add(ResumeInPlace(m.id, m.generation, master, why))
    out.event("migration.rollback", f"{m.id}: {why}; resuming on {m.node}", migration=m.id, node=m.node,
              phase=m.phase.value, why=why)
    m = _enter(m, Phase.ROLLBACK, now, now + policy.rebuild_timeout_s, resumed=frozenset(), resume_attempts=1,
               rollback_reason=why, failure=None)
    return replace(st, migration=m)


def _job_lost(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, why: str) -> CoordState:
    """The source died before its ranks could be saved: no clean move is possible."""
    if m.node not in st.handed:
        reason = f"torchpass: {m.node} lost during migration {m.id} ({why}); no clean dump possible"
        out.add(HandToSlurm(m.node, reason))
        st = replace(st, handed=st.handed | {m.node})
    if m.paused:
        # Never hold the survivors: release them; the job's fate is Slurm's now.
        if m.target is not None and m.restored:
            out.add(AbortRestore(m.id, m.target, tuple(m.ranks)))
        out.add(ResumeInPlace(m.id, m.generation, _master(st, None), f"{m.node} lost"))
        st = replace(st, generation=max(st.generation, m.generation))
    return _finish(out, st, m, now, Result.SOURCE_LOST, policy,
                   f"{m.id}: {m.node} was lost ({why}); no clean dump possible: handed to Slurm", "node.lost")


def _replace_target(out: _Out, st: CoordState, m: Migration, policy: CoordinatorPolicy, why: str
                    ) -> tuple[CoordState, Migration | None]:
    """The target died: mark it lost and take the next free spare, if allowed."""
    lost = m.target
    st = _set_spare(st, lost, SpareStatus.LOST)
    tried = m.tried + ((lost,) if lost else ())
    m = replace(m, tried=tried, target=None, target_how=None)
    if len(tried) >= policy.max_spare_attempts:
        return st, None
    sp = _pick_spare(st, m, policy)
    if sp is None:
        return st, None
    st = _set_spare(st, sp.node, SpareStatus.RESERVED)
    out.event("spare.replaced", f"{m.id}: spare {lost} lost ({why}); continuing with {sp.node} ({sp.how})",
              migration=m.id, lost=lost, target=sp.node, how=sp.how)
    return st, replace(m, target=sp.node, target_how=sp.how)


# ============================================================================
# The phases
# ============================================================================
def _listening(r: RankView, now: float) -> bool:
    """The rank's last report is a long poll still parked: a command reaches it at once."""
    return r.listening_until is not None and now < r.listening_until


def pause_point(now: float, ranks: dict[int, RankView], policy: CoordinatorPolicy,
                floor: int = 0) -> tuple[int, str]:
    """T: the smallest collective count every rank can still reach, and how it was chosen.

    A rank whose last report still waits at the coordinator as a long poll
    (``listening_until``) learns of the pause at once: it is ``now -
    reported_at`` past its reported count, plus ``pause_slack_listening_s``
    for the decision and the reply. Any other rank learns of it in the reply to its
    next progress report: ``report_gap`` after its last one (or at once if
    that is already overdue), plus ``pause_slack_s``. Until
    then it keeps issuing collectives at the job's rate (every rank issues
    the same collectives, so the fastest measured rate is the job's). T =
    max over ranks of that estimate + ``pause_margin_collectives``. When the
    ranks report optimizer-step boundaries a fixed number of collectives
    apart, T is rounded up to the next boundary: the ranks then stop between
    two steps, with no gradient all-reduce in flight. Without a rate (too few
    reports) T = max reported + ``pause_fallback_collectives``. ``floor``:
    T is at least this (a re-arm after refusals).
    """
    views = list(ranks.values())
    # One pass for what the estimate needs, one for the estimate: at 8,192 ranks this runs in the
    # pause's path (fault -> the moving node's ranks paused), where five passes cost 9-20 ms.
    top, rate = max(floor, 0), 0.0
    b = views[0] if views else None  # the first rank with the latest step boundary
    per0 = b.per_step if b is not None else 0
    one_per_step = True  # every rank reports the same collectives per step
    for r in views:
        if r.collectives > top:
            top = r.collectives
        if r.rate > rate:
            rate = r.rate
        if r.boundary > b.boundary:
            b = r
        if r.per_step != per0:
            one_per_step = False
    if rate <= 0:
        return top + policy.pause_fallback_collectives, (
            f"no rate measured yet: max reported {top} + {policy.pause_fallback_collectives}")
    reach = top
    # The pause reaches the long-polling ranks in one batch of replies, the last one this much later.
    fanout = len(views) / 1000.0 * policy.pause_fanout_s_per_1000_ranks
    if floor > 0:  # a count seen just now (a refusal): that rank learns of the new T one report later
        gap = max((r.report_gap for r in views if not _listening(r, now)), default=fanout)
        reach = floor + int(-(-rate * (gap + policy.pause_slack_s) // 1))
    slack_listening, slack = policy.pause_slack_listening_s, policy.pause_slack_s
    for r in views:
        since = now - r.reported_at if r.reported_at is not None else 0.0
        until = r.listening_until  # _listening(r, now), inline
        horizon = (since + fanout + slack_listening if until is not None and now < until
                   else max(since, r.report_gap) + slack)
        c = r.collectives + int(-(-rate * horizon // 1))  # ceil
        if c > reach:
            reach = c
    at = reach + policy.pause_margin_collectives
    how = f"max reported {top}, {rate:.1f} collectives/s, reachable {reach}, + {policy.pause_margin_collectives}"
    if one_per_step and b is not None and b.boundary >= 0 and b.per_step > 0:
        k = -(-(at - b.boundary) // b.per_step)
        aligned = b.boundary + max(0, k) * b.per_step
        if aligned >= at:
            how += f", rounded up to a step boundary ({b.per_step} collectives/step)"
            at = aligned
    return at, how


def _start_pause(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy) -> CoordState:
    at, how = pause_point(now, st.ranks, policy)
    out.add(PauseAt(m.id, at, m.generation, m.ranks))
    m = _enter(m, Phase.PAUSE, now, now + policy.pause_timeout_s, pause_at=at, pause_estimate=how,
               paused_since=now, first_quiesced=None, stood_still_since=None, quiesced=frozenset(), refused=())
    return replace(st, migration=m)


def _on_spare(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, done: bool = False
              ) -> CoordState:
    """Nothing is paused yet: reserve a usable spare and pause, ask slurmctld for one, or give up
    (the node runs on unprotected); a trigger that went away cancels the move."""
    if _source_lost(st, m):
        return _job_lost(out, st, m, now, policy, "failed and unreachable")
    if st.job_unprotected is not None:
        return _finish(out, st, m, now, Result.CANCELLED, policy,
                       f"{m.id}: the job is unprotected ({st.job_unprotected}); not moving {m.node}",
                       "migration.cancelled")
    if m.trigger == Trigger.HEALTH:
        h = st.node_health(m.node)
        if h.state.value not in policy.migrate_on and not _lost(h):
            return _finish(out, st, m, now, Result.CANCELLED, policy,
                           f"{m.id}: {m.node} is {h.state.value} again before anything was paused; not moving it",
                           "migration.cancelled")
    if m.trigger == Trigger.STALL and not any(r.node == m.node for r in stalled_ranks(now, st, policy)):
        return _finish(out, st, m, now, Result.CANCELLED, policy,
                       f"{m.id}: the ranks on {m.node} advance again before anything was paused; not moving it",
                       "migration.cancelled")
    if m.requested_to is not None:
        sp = st.spare(m.requested_to)
        if sp is None or not spare_usable(st, sp, policy):
            state = "unknown" if sp is None else (sp.status if sp.status != SpareStatus.FREE else st.node_health(sp.node).state.value)
            return _finish(out, st, m, now, Result.REJECTED, policy,
                           f"{m.id}: requested target {m.requested_to} is not usable ({state}); nothing was paused",
                           "migration.rejected")
        chosen: SpareView | None = sp
    else:
        chosen = _pick_spare(st, m, policy)
    if chosen is not None:
        st = _set_spare(st, chosen.node, SpareStatus.RESERVED)
        origin = {SpareHow.EXPAND: f", allocation {chosen.allocation} merged into job {st.job_id}",
                  SpareHow.COMPANION: f", companion allocation {chosen.allocation}"}.get(chosen.how, "")
        out.event("spare.chosen", f"{m.id}: moving {m.node} to {chosen.node} ({chosen.how} spare{origin})",
                  migration=m.id, node=m.node, target=chosen.node, how=chosen.how,
                  **({"allocation": chosen.allocation} if chosen.allocation is not None else {}))
        m = replace(m, target=chosen.node, target_how=chosen.how, spare_requested=None)
        return _start_pause(out, st, m, now, policy)
    if m.spare_requested is not None:
        if now < m.deadline:
            return st
        m = replace(m, spare_failures=m.spare_failures + ((m.spare_requested, "no answer in time"),),
                    spare_requested=None)
        st = replace(st, migration=m)
    # A granted spare whose tpassd has not reported yet: wait for it until the deadline.
    pending = [s for s in st.spares if s.status == SpareStatus.FREE and s.how != SpareHow.HOT and s.node not in m.tried
               and st.node_health(s.node).state == State.UNKNOWN]
    if pending and now < m.deadline:
        return st
    asked = {s for s, _ in m.spare_failures}
    for strategy in policy.spare_strategies:
        if strategy == SpareHow.HOT or strategy in asked:
            continue
        out.add(RequestSpare(m.id, SpareHow(strategy), m.node))
        out.event("spare.requested", f"{m.id}: no hot spare for {m.node}; asking slurmctld ({strategy})",
                  migration=m.id, node=m.node, strategy=strategy)
        m = replace(m, spare_requested=strategy, deadline=now + policy.spare_timeout_s)
        return replace(st, migration=m)
    tried = "; ".join(f"{s}: {w}" for s, w in m.spare_failures) or "no strategy allowed by the policy"
    hot = "no free hot spare" if SpareHow.HOT in policy.spare_strategies else "hot spares not allowed by the policy"
    return _finish(out, st, m, now, Result.NO_SPARE, policy,
                   f"{m.id}: no spare for {m.node} ({hot}; {tried}); training continues on {m.node} unprotected",
                   "spare.unavailable")


def _advance(out: _Out, st: CoordState, now: float, policy: CoordinatorPolicy) -> CoordState:
    m = st.migration
    assert m is not None
    ph = m.phase
    if ph == Phase.SPARE:  # nothing paused: a lost node only ends or re-plans the move
        return _on_spare(out, st, m, now, policy)

    # --- the source node died -------------------------------------------------------
    if _source_lost(st, m):
        saved = set(m.ranks) <= set(m.images)
        if ph in (Phase.PAUSE, Phase.ROLLBACK) or (ph == Phase.DUMP and not saved):
            return _job_lost(out, st, m, now, policy, "failed and unreachable before its ranks were saved")
        if ph == Phase.KILL_SOURCE and not m.source_killed:
            m = replace(m, source_killed=True, ready_at=now if m.ready_at is None else m.ready_at)  # its copies died with it
            st = replace(st, migration=m)
        # DUMP (all saved) / TRANSFER / RESTORE carry on from the images; later phases no longer need it.

    # --- the target died --------------------------------------------------------------
    if ph in (Phase.PAUSE, Phase.DUMP, Phase.TRANSFER, Phase.RESTORE) and (
        _target_lost(st, m) or (m.failure is not None and m.failure.target_lost)
    ):
        why = m.failure.why if m.failure is not None and m.failure.target_lost else f"{m.target} failed"
        restored_any = bool(m.restored) or ph == Phase.RESTORE
        if restored_any and m.target:
            out.add(AbortRestore(m.id, m.target, tuple(m.ranks)))
        st, m2 = _replace_target(out, st, m, policy, why)
        if m2 is None:
            m = replace(m, target=None, failure=None)
            return _rollback(out, st, m, now, policy, f"spare {m.tried[-1] if m.tried else '?'} lost ({why}) "
                             "and no other spare is free")
        m2 = replace(m2, failure=None, restored=frozenset(), transferred={})
        if ph in (Phase.TRANSFER, Phase.RESTORE):
            # Images are on the source side already: send them to the new target.
            st = replace(st, migration=m2)
            return _start_transfer(out, st, m2, now, policy)
        return replace(st, migration=m2)
    if ph in (Phase.REBUILD,) and _target_lost(st, m):
        # Source copies are gone, the moved ranks died with the target: nothing to resume.
        if m.target not in st.handed:
            out.add(HandToSlurm(m.target, f"torchpass: spare {m.target} failed while ranks {list(m.ranks)} "
                                          "were resuming there; no copy left"))
            st = replace(st, handed=st.handed | {m.target})
        return _finish(out, st, m, now, Result.STUCK, policy,
                       f"{m.id}: target {m.target} failed after the source copies were killed; handed to Slurm",
                       "job.stuck")

    # --- the job turned unprotected: its ranks refuse the pause; nothing is killed yet -------
    if st.job_unprotected is not None and ph in (Phase.PAUSE, Phase.DUMP, Phase.TRANSFER, Phase.RESTORE):
        return _rollback(out, st, m, now, policy, f"the job is unprotected ({st.job_unprotected})")

    done = phase_complete(st, m)
    return _HANDLERS[ph](out, st, m, now, policy, done)


def _on_pause(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, done: bool
              ) -> CoordState:
    """Every rank quiesced at T: dump the moved ones. Refusals re-arm a later T."""
    if done:
        for r in m.ranks:
            out.add(MigrationDump(m.id, r, m.node))
        # Training stands still from the moment the last rank reached T.
        m = replace(m, stood_still_since=m.ready_at if m.ready_at is not None else now)
        return replace(st, migration=_enter(m, Phase.DUMP, now, now + policy.dump_timeout_s))
    rearmed, why = _pause_overdue(out, st, m, now, policy, m.ranks, m.id, migration=m.id)
    if rearmed is not None:
        return replace(st, migration=rearmed)
    if why is not None:
        return _rollback(out, st, m, now, policy, why)
    return st


def _pause_overdue(out: _Out, st: CoordState, run: Any, now: float, policy: CoordinatorPolicy,
                   hold: tuple[int, ...], label: str, **ids: Any) -> tuple[Any, str | None]:
    """A PAUSE not complete yet, of a migration or a whole-job snapshot (``run``: either; ``label``
    names it in the event): (``run`` re-armed at a later T, None) when ranks were past T and re-arms
    are left; (None, why) when it must be rolled back (too many refusals, the deadline passed);
    (None, None) to wait."""
    if run.refused:
        if run.rearms < policy.max_pause_rearms:
            top = max([c for _, c in run.refused] + [run.pause_at or 0])
            at, how = pause_point(now, st.ranks, policy, floor=top)
            out.add(PauseAt(run.id, at, run.generation, hold))
            out.event("pause.rearmed", f"{label}: rank(s) {[r for r, _ in run.refused]} were past collective "
                      f"{run.pause_at}; pausing at {at} instead", at=at, **ids)
            return replace(run, pause_at=at, pause_estimate=how, refused=(), quiesced=frozenset(),
                           first_quiesced=None, rearms=run.rearms + 1, deadline=now + policy.pause_timeout_s), None
        return None, f"ranks {[r for r, _ in run.refused]} were past the pause point {run.rearms + 1} times"
    if now >= run.deadline:
        missing = sorted(set(st.ranks) - run.quiesced)
        return None, (f"pause timed out after {policy.pause_timeout_s:g}s: ranks {missing} did not quiesce "
                      f"at collective {run.pause_at}")
    return None, None


def _paused_step(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, done: bool, *,
                 failed: str, late: str, then: Callable[[], CoordState]) -> CoordState:
    """DUMP, TRANSFER, RESTORE, KILL_SOURCE: a failure or the deadline rolls back (``failed``:
    what failed, ``late``: what timed out); ``then`` once every outcome arrived."""
    if m.failure is not None:
        return _rollback(out, st, m, now, policy, f"{failed}: {m.failure.why}")
    if done:
        return then()
    if now >= m.deadline:
        return _rollback(out, st, m, now, policy, late)
    return st


def _on_dump(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, done: bool
             ) -> CoordState:
    """Every moved rank dumped (left running, paused): make the images readable on the target."""
    missing = sorted(set(m.ranks) - set(m.images))
    return _paused_step(out, st, m, now, policy, done, failed="dump failed",
                        late=f"dump timed out after {policy.dump_timeout_s:g}s (ranks {missing})",
                        then=lambda: _start_transfer(out, replace(st, migration=m), m, now, policy))


def _on_transfer(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, done: bool
                 ) -> CoordState:
    """Every image readable on the target: restore the ranks there (they stay paused, holding)."""
    def restore() -> CoordState:
        for r in m.ranks:
            img = m.transferred[r]
            out.add(Restore(m.id, r, m.target or "", img.path, img.checksum))
        return replace(st, migration=_enter(m, Phase.RESTORE, now, now + policy.restore_timeout_s))

    return _paused_step(out, st, m, now, policy, done, failed="transfer failed",
                        late=f"transfer timed out after {policy.transfer_timeout_s:g}s", then=restore)


def _on_restore(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, done: bool
                ) -> CoordState:
    """Every rank restored on the target: kill the source copies."""
    def kill() -> CoordState:
        out.add(KillSource(m.id, m.node, m.ranks))
        return replace(st, migration=_enter(m, Phase.KILL_SOURCE, now, now + policy.kill_timeout_s))

    missing = sorted(set(m.ranks) - m.restored)
    return _paused_step(out, st, m, now, policy, done, failed=f"restore on {m.target} failed",
                        late=f"restore on {m.target} timed out after {policy.restore_timeout_s:g}s (ranks {missing})",
                        then=kill)


def _on_kill_source(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, done: bool
                    ) -> CoordState:
    """The source copies are dead (``done``: ``m.source_killed``): the moved ranks live on the
    target; every rank rebuilds."""
    def rebuild() -> CoordState:
        ranks = {**st.ranks}
        for r in m.ranks:
            if r in ranks:
                ranks[r] = replace(ranks[r], node=m.target or ranks[r].node)
        moved = replace(st, ranks=ranks)
        out.add(Resume(m.id, m.generation, _master(moved, None)))
        m2 = _enter(m, Phase.REBUILD, now, now + policy.rebuild_timeout_s, resumed=frozenset(), resume_attempts=1)
        return replace(moved, migration=m2)

    return _paused_step(out, st, m, now, policy, done, failed="could not kill the source copies",
                        late=f"the source copies on {m.node} were not killed within {policy.kill_timeout_s:g}s",
                        then=rebuild)


def _resuming(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, done: bool
              ) -> CoordState:
    """REBUILD and ROLLBACK: wait for every rank to resume; ask again, then hand the laggards to Slurm."""
    ph = m.phase
    if done:
        end = m.ready_at if m.ready_at is not None else now
        since = _stood_still(m)
        durations = {**m.phase_durations, "paused": _r(max(0.0, end - since)) if since is not None else 0.0}
        m = replace(m, phase_durations=durations)
        st = replace(st, generation=max(st.generation, m.generation))
        if ph == Phase.ROLLBACK:
            return _finish(out, st, m, now, Result.ROLLED_BACK, policy,
                           f"{m.id}: rolled back ({m.rollback_reason}); training resumed on {m.node} after "
                           f"{durations['paused']:.2f}s paused", "migration.rolled_back")
        out.add(Drain(m.id, m.node, f"torchpass: {m.reason}"))
        out.event("migration.resumed", f"{m.id}: ranks {list(m.ranks)} resumed on {m.target}; training paused "
                  f"{durations['paused']:.2f}s", migration=m.id, node=m.node, target=m.target,
                  phase_durations=durations)
        return replace(st, migration=_enter(m, Phase.DRAIN, now, now + policy.finalize_timeout_s))
    if now >= m.deadline:
        missing = sorted(set(st.ranks) - m.resumed)
        if m.resume_attempts < policy.max_resume_attempts:
            if ph == Phase.REBUILD:
                out.add(Resume(m.id, m.generation, _master(st, None)))
            else:
                out.add(ResumeInPlace(m.id, m.generation, _master(st, None), m.rollback_reason or "rollback"))
            out.event("resume.retried", f"{m.id}: ranks {missing} did not resume; asking again",
                      migration=m.id, missing=missing)
            m = replace(m, resume_attempts=m.resume_attempts + 1, deadline=now + policy.rebuild_timeout_s)
            return replace(st, migration=m)
        culprits = sorted({st.ranks[r].node for r in missing if r in st.ranks})
        for node in culprits:
            if node not in st.handed:
                out.add(HandToSlurm(node, f"torchpass: ranks on {node} did not resume after migration {m.id}"))
                st = replace(st, handed=st.handed | {node})
        st = replace(st, generation=max(st.generation, m.generation))
        return _finish(out, st, m, now, Result.STUCK, policy,
                       f"{m.id}: ranks {missing} did not resume after {m.resume_attempts} resume commands; "
                       "handed to Slurm", "job.stuck")
    return st


def _settled(m: Migration, now: float, policy: CoordinatorPolicy, done: bool, what: str) -> Migration | None:
    """DRAIN and SHRINK (training runs): ``m`` once confirmed or, noting that ``what`` was not
    confirmed, once the deadline passed; None while waiting."""
    if done:
        return m
    if now < m.deadline:
        return None
    return replace(m, notes=m.notes + (f"{what} not confirmed in {policy.finalize_timeout_s:g}s",))


def _on_drain(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, done: bool
              ) -> CoordState:
    """Drain confirmed (or not in time): release the node from the job."""
    m2 = _settled(m, now, policy, done, f"drain of {m.node}")
    if m2 is None:
        return st
    out.add(Shrink(m2.id, (m2.node,)))
    return replace(st, migration=_enter(m2, Phase.SHRINK, now, now + policy.finalize_timeout_s))


def _on_shrink(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, done: bool
               ) -> CoordState:
    """Shrink confirmed (or not in time): the migration is complete."""
    m2 = _settled(m, now, policy, done, "shrink")
    if m2 is None:
        return st
    st = replace(st, released=st.released | {m2.node}, unprotected=st.unprotected - {m2.node})
    notes = f" ({'; '.join(m2.notes)})" if m2.notes else ""
    # Say what happened to the node: a shrink that failed leaves it in the job.
    kept = any(n.startswith(("shrink failed", "shrink not confirmed")) for n in m2.notes)
    # ... and whether its tpassd drained it (it refuses a healthy node for a user's job).
    drained = not any(n.startswith("drain of") for n in m2.notes)
    return _finish(out, st, m2, now, Result.COMPLETED, policy,
                   f"{m2.id}: moved ranks {list(m2.ranks)} from {m2.node} to {m2.target}; {m2.node} "
                   f"{'drained' if drained else 'not drained'} and {'kept in the job' if kept else 'released'}"
                   f"{notes}", "migration.completed")


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


def _on_rebuild(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, done: bool
                ) -> CoordState:
    """Every rank (the moved ones on the target) rebuilds the new generation: then drain the node."""
    return _resuming(out, st, m, now, policy, done)


def _on_rollback(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, done: bool
                 ) -> CoordState:
    """Every rank resumes where it was: the migration ends rolled back."""
    return _resuming(out, st, m, now, policy, done)


# One handler per phase, as in the module docstring (and phases.TRANSITIONS).
_HANDLERS = {
    Phase.SPARE: _on_spare,
    Phase.PAUSE: _on_pause,
    Phase.DUMP: _on_dump,
    Phase.TRANSFER: _on_transfer,
    Phase.RESTORE: _on_restore,
    Phase.KILL_SOURCE: _on_kill_source,
    Phase.REBUILD: _on_rebuild,
    Phase.ROLLBACK: _on_rollback,
    Phase.DRAIN: _on_drain,
    Phase.SHRINK: _on_shrink,
}


def _start_transfer(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy) -> CoordState:
    for r in m.ranks:
        img = m.images[r]
        out.add(Transfer(m.id, r, img.path, img.checksum, m.node, m.target or ""))
    m = _enter(m, Phase.TRANSFER, now, now + policy.transfer_timeout_s, transferred={}, restored=frozenset(),
               failure=None)
    return replace(st, migration=m)


# ============================================================================
# Starting migrations, lost nodes
# ============================================================================
# What Slurm does with a job whose node stopped answering (when torchpass has no checkpoint or
# snapshot to relaunch it from): measured on the devcluster (tests/integration/test_hard_failure.py).
SLURM_ON_LOST_NODE = ("slurmctld marks the node DOWN once it stops answering (SlurmdTimeout) and ends the job "
                      "as a node failure: a requeueable batch job is requeued, any other ends NODE_FAIL")
# What the coordinator itself does then (HandToSlurm end_job): the same, at once, also for a job
# submitted with --no-kill (which torchpass's relaunch needs), which slurmctld would leave running
# with ranks waiting in their collectives for a peer that is gone.
ENDED_LIKE_SLURM = ("torchpass does the same now, after the drain, also for a job run with --no-kill: "
                    "requeues it if it is a requeueable batch job, else ends its steps on the node")


def _handle_lost(out: _Out, st: CoordState, now: float, policy: CoordinatorPolicy) -> CoordState:
    m = st.migration
    # Spares that died are never chosen again.
    for sp in st.spares:
        if sp.status in (SpareStatus.FREE, SpareStatus.RESERVED) and st.node_health(sp.node).state == State.FAILED:
            st = _set_spare(st, sp.node, SpareStatus.LOST)
            out.event("spare.lost", f"spare {sp.node} failed ({_health_text(st.node_health(sp.node))})",
                      node=sp.node)
    involved = {m.node, m.target} if m else set()
    # Lost needs a report (state failed, unreachable): only those are looked at.
    lost = [n for n, h in st.health.items() if not h.reachable and _lost(h)]
    if lost:
        nodes = st.rank_nodes()
        lost = sorted(n for n in lost if n in nodes and n not in st.handed and n not in st.released
                      and n not in involved)
    if lost and (plan := _relaunch_plan(st, lost, policy)) is not None:
        return _relaunch(out, st, now, plan)
    for node in lost:
        h = st.node_health(node)
        reason = f"torchpass: {node} failed outright ({_health_text(h)}); no clean dump possible"
        out.add(HandToSlurm(node, reason, end_job=True))
        out.event("node.lost", f"{node} failed and is unreachable ({_health_text(h)}): no clean dump possible "
                  f"and {_no_relaunch_why(st, lost, policy)}; handed to Slurm's normal handling: "
                  f"{SLURM_ON_LOST_NODE}; {ENDED_LIKE_SLURM}",
                  node=node, snapshot=st.last_snapshot.id if st.last_snapshot else None,
                  checkpoint=st.restore_point[0] if st.restore_point else None, ranks=list(st.rank_nodes()[node]))
        st = replace(st, handed=st.handed | {node},
                     operator_requests=tuple(r for r in st.operator_requests if r.node != node))
        if st.migration is not None and st.migration.paused and st.migration.phase != Phase.ROLLBACK \
                and st.migration.phase != Phase.REBUILD:
            st = _rollback(out, st, st.migration, now, policy, f"{node} (not part of the move) was lost")
    return _relaunch_watch(out, st, now, policy)


# ============================================================================
# Relaunch after a lost node (issue 12): the job's training step starts again
# ============================================================================
# A node lost outright leaves nothing to dump. When the job has a restore point and a free spare
# for every lost node, the job's training step is started again inside the allocation: the
# executor rewrites the job's host file (each lost node's lines name its spare) and writes the
# verdict that the SPANK plugin's srun exit hook reads. The user's srun, ended by Slurm for the
# node failure, execs itself again with its own arguments and environment. The job is not
# requeued. Slurm ends the job anyway unless it runs with --no-kill (docs/coordinator.md, "A node
# lost outright"). The restore point is the newer of:
# - the newest application checkpoint torchpass.checkpoint reported complete: the script goes on
#   from it; every rank registers again, as generation 0 (fresh processes);
# - the newest whole-job snapshot that completed (a tie goes to the snapshot: nothing reloads):
#   the verdict names it, and every task of the relaunched srun restores its rank from it instead
#   of starting the program. Each restored copy registers again naming the snapshot, paused where
#   the snapshot paused it; once all are back, they resume as the snapshot's generation around a
#   new rendezvous (ResumeInPlace), and the relaunch ends when all resumed.


def _relaunch_spares(st: CoordState, policy: CoordinatorPolicy) -> list[SpareView]:
    """Free spares a relaunched srun can run on: the hot spares (--torchpass=spares=N). They are
    in the job's host file, which places every srun of the batch script; a spare slurmctld grants
    later is not (nor can the job's srun reach a companion allocation)."""
    return [sp for sp in st.spares if sp.how == SpareHow.HOT and spare_usable(st, sp, policy)]


def _snapshot_point(st: CoordState, s: SnapshotRun) -> SnapshotPoint:
    return SnapshotPoint(s.id, s.step, s.generation, st.step_offset, len(s.ranks))


def _committed(st: CoordState) -> CoordState:
    """``st`` with the snapshot in flight as its newest complete one if its manifest is written
    (the ranks were still resuming): retention may already have removed the one before it."""
    s = st.snapshot
    if s is None or s.committed is None or s.failure is not None or s.commit_failed is not None:
        return st
    return replace(st, last_snapshot=_snapshot_point(st, s))


def _end_snapshot_for_relaunch(out: _Out, st: CoordState, lost: set[str]) -> CoordState:
    """A node was lost while a whole-job snapshot ran and the job is relaunched: the snapshot ends
    here (its ranks are ended with their step; a complete one is kept, else what was written on
    the surviving nodes is removed)."""
    s = st.snapshot
    if s is None:
        return st
    st = _committed(st)
    if st.last_snapshot is not None and st.last_snapshot.id == s.id:
        out.event("snapshot.completed", f"snapshot {s.id} of job {st.job_id} at step {s.step}: complete (its manifest "
                  f"is written) when {', '.join(sorted(lost))} was lost; the job is relaunched from it",
                  snapshot=s.id, trigger=s.trigger, step=s.step, generation=s.generation, ranks=len(s.ranks),
                  bytes=s.committed.bytes if s.committed else 0, manifest=s.committed.manifest if s.committed else "",
                  removed=list(s.committed.removed) if s.committed else [], pause_s=s.paused_s)
    else:
        nodes = tuple(sorted({n for _, n in s.ranks} - lost))
        if nodes and s.failure is None:  # a failed one's images are being removed already (_snap_fail)
            out.add(DiscardSnapshot(s.id, nodes))
        out.event("snapshot.failed", f"snapshot {s.id} of job {st.job_id} failed: node(s) {', '.join(sorted(lost))} "
                  "lost while it ran; the job is relaunched from its newest complete restore point",
                  snapshot=s.id, trigger=s.trigger, why=f"node(s) {', '.join(sorted(lost))} lost", step=s.step)
    return replace(st, snapshot=None)


def _from_snapshot(st: CoordState) -> SnapshotPoint | None:
    """The whole-job snapshot a relaunch restores from, when it is the job's newest restore point."""
    snap = _committed(st).last_snapshot
    if snap is None or snap.world_size != st.world_size:
        return None
    return snap if st.restore_point is None or snap.step >= st.restore_point[0] else None


def _relaunch_plan(st: CoordState, lost: list[str], policy: CoordinatorPolicy) -> tuple[tuple[str, str], ...] | None:
    """(lost node, spare) for every lost node, or None when the job cannot be relaunched."""
    # A snapshot in flight does not stop it: it ends with the step (_end_snapshot_for_relaunch).
    if (st.restore_point is None and _from_snapshot(st) is None) or st.migration is not None \
            or (st.relaunch is not None and st.relaunch.snapshot):
        return None
    spares = _relaunch_spares(st, policy)
    if len(spares) < len(lost):
        return None
    return tuple(zip(lost, (sp.node for sp in spares)))


def _no_relaunch_why(st: CoordState, lost: list[str], policy: CoordinatorPolicy) -> str:
    if st.restore_point is None and _from_snapshot(st) is None:
        return ("no complete snapshot (snapshot_every) or application checkpoint (torchpass.checkpoint) of the "
                "job to relaunch it from")
    if st.relaunch is not None and st.relaunch.snapshot:
        return f"relaunch {st.relaunch.count} from snapshot {st.relaunch.snapshot} has not resumed yet"
    if st.migration is not None:
        return f"migration {st.migration.id} is in flight, so the job is not relaunched"
    free = len(_relaunch_spares(st, policy))
    snap = _from_snapshot(st)
    point = (f"snapshot {snap.id} of step {snap.step}" if snap is not None
             else f"checkpoint of step {st.restore_point[0]}" if st.restore_point is not None else "restore point")
    return f"no free hot spare for every lost node ({free} for {len(lost)}) to relaunch the job on from its {point}"


def _relaunch(out: _Out, st: CoordState, now: float, plan: tuple[tuple[str, str], ...]) -> CoordState:
    st = _end_snapshot_for_relaunch(out, st, {n for n, _ in plan})
    snap = _from_snapshot(st)
    count = st.relaunches + 1
    # The newest step a rank completed, in the job's numbering: the runtime reports how many
    # optimizer steps it completed (its own count, from 0 in a fresh process; step_offset shifts it).
    done = max((rv.step for rv in st.ranks.values()), default=0)
    last = done + st.step_offset - 1
    if snap is not None:
        step = snap.step
        drained = f"its snapshot {snap.id} of step {step}"
        lost_how = f"every rank restored from snapshot {snap.id} of step {step}"
        going = f"every rank is restored from snapshot {snap.id} of step {step}"
        point: dict[str, Any] = {"snapshot": snap.id, "checkpoint": None}
        going_data: dict[str, Any] = {**point, "snapshot_step": step}
    else:
        assert st.restore_point is not None
        step, path = st.restore_point
        drained = f"its checkpoint of step {step}"
        lost_how = f"from the application checkpoint of step {step}"
        going = f"the script goes on from its checkpoint of step {step} ({path})"
        point = {"snapshot": None, "checkpoint": step}
        going_data = {"checkpoint": step, "path": path}
    recompute = max(0, last - step + 1)
    nodes = st.rank_nodes()
    moved = ", ".join(f"{spare} for {node}" for node, spare in plan)
    for node, spare in plan:
        h = st.node_health(node)
        out.add(HandToSlurm(node, f"torchpass: {node} failed outright ({_health_text(h)}); the job was "
                                  f"relaunched from {drained}"))
        out.event("node.lost", f"{node} failed and is unreachable ({_health_text(h)}): no clean dump possible; "
                  f"relaunching the job's training step with spare {spare} in its place, {lost_how}", node=node,
                  spare=spare, ranks=list(nodes[node]), relaunch=count, **point)
    out.add(Relaunch(count, plan, step, snapshot=snap.id if snap is not None else ""))
    out.event("job.relaunching", f"relaunch {count}: the training step starts again on the surviving nodes with "
              f"{moved}; {going}: steps {step}..{last} ({recompute}) are computed again", relaunch=count,
              last_step=last, recompute_steps=recompute, replaced=dict(plan), **going_data)
    for _node, spare in plan:
        st = _set_spare(st, spare, SpareStatus.USED)
    if snap is not None:
        # The restored ranks keep their own step counts (in their images) and resume as the
        # snapshot's generation.
        resumes = {"generation": snap.generation, "step_offset": snap.step_offset,
                   "relaunch": RelaunchRun(count, plan[0][0], plan[0][1], now, step, last, snapshot=snap.id,
                                           generation=snap.generation)}
    else:  # fresh processes, generation 0; steps numbered from the checkpoint until rank 0 says what it loaded
        resumes = {"generation": 0, "step_offset": step,
                   "relaunch": RelaunchRun(count, plan[0][0], plan[0][1], now, step, last)}
    return replace(st, handed=st.handed | {n for n, _ in plan}, ranks={}, relaunches=count,
                   relaunch_pending="", snapshot_clock=None,
                   operator_requests=tuple(r for r in st.operator_requests if r.node not in dict(plan)), **resumes)


def _relaunch_id(r: RelaunchRun) -> str:
    """The name the restored ranks' resume goes under (the executor's commands for it)."""
    return f"relaunch{r.count}" if r.count else f"resume-{r.snapshot}"


def resumed_from_stop(job_id: int, now: float, snapshot: str, snapshot_step: int, generation: int,
                      world_size: int, step_offset: int) -> CoordState:
    """The first state of the coordinator of a job stopped with `tpassctl snapshot --stop` and
    resumed: every rank comes back restored from ``snapshot`` (the plugin restores the step the
    stop marker names) and is resumed once all are back, as after a relaunch from a snapshot."""
    point = SnapshotPoint(snapshot, snapshot_step, generation, step_offset, world_size)
    return CoordState(job_id=job_id, world_size=world_size, generation=generation, step_offset=step_offset,
                      last_snapshot=point,
                      relaunch=RelaunchRun(0, "", "", now, snapshot_step, snapshot_step - 1, snapshot=snapshot,
                                           generation=generation))


def _snapshot_relaunch_step(out: _Out, st: CoordState, now: float, policy: CoordinatorPolicy) -> CoordState:
    """A relaunch from a whole-job snapshot: resume the restored ranks once all are back, say
    when all resumed, ask again when some did not."""
    r = st.relaunch
    assert r is not None and r.snapshot
    world = st.world_size or 0
    # count 0: the resumed run of a job stopped with `tpassctl snapshot --stop` (no node was lost)
    what = f"relaunch {r.count}" if r.count else f"resume of job {st.job_id}"
    since = f"after {r.lost} was found lost" if r.count else "after this coordinator started"
    if r.resume_sent is None:
        if st.all_registered() and len(r.back) < world and set(st.ranks) - r.back:
            # Ranks registered that are not copies of the snapshot: the step was started afresh
            # (its id was not the one the stop marker named). They train on: nothing to resume.
            fresh = sorted(set(st.ranks) - r.back)
            out.event("job.restore_missed", f"{what}: ranks {fresh} registered as fresh processes, not restored "
                      f"from snapshot {r.snapshot}: the job's step started again from its beginning",
                      relaunch=r.count, snapshot=r.snapshot, fresh=fresh)
            if not r.count:
                out.add(ForgetStopped(r.snapshot))
            return replace(st, relaunch=None, snapshot_clock=now)
        if world and len(r.back) >= world and st.all_registered():
            master = in_place_master(st)
            out.add(ResumeInPlace(_relaunch_id(r), r.generation, master,
                                  f"{what}: every rank restored from snapshot {r.snapshot}"))
            out.event("job.restored", f"{what}: all {world} ranks were restored from snapshot "
                      f"{r.snapshot} and registered {now - r.decided:.1f} s {since}; "
                      f"resuming them as generation {r.generation} (rendezvous on {master})",
                      relaunch=r.count, snapshot=r.snapshot, decision_to_restored_s=_r(now - r.decided),
                      generation=r.generation)
            return replace(st, relaunch=replace(r, resume_sent=now, resume_attempts=1))
        return st
    if world and len(r.resumed) >= world:
        if r.count:
            out.event("job.relaunched", f"{what}: every rank restored from snapshot {r.snapshot} resumed "
                      f"{now - r.decided:.1f} s {since}; training goes on from step "
                      f"{r.checkpoint_step} (steps {r.checkpoint_step}..{r.last_step} are computed again)",
                      relaunch=r.count, snapshot=r.snapshot, decision_to_resumed_s=_r(now - r.decided),
                      snapshot_step=r.checkpoint_step, last_step=r.last_step,
                      recompute_steps=max(0, r.last_step - r.checkpoint_step + 1))
        else:
            out.add(ForgetStopped(r.snapshot))
            out.event("job.resumed", f"{what}: every rank restored from snapshot {r.snapshot} resumed "
                      f"{now - r.decided:.1f} s {since}; training goes on from step {r.checkpoint_step}, "
                      "where it stopped", snapshot=r.snapshot, decision_to_resumed_s=_r(now - r.decided),
                      snapshot_step=r.checkpoint_step)
        return replace(st, relaunch=None, snapshot_clock=now)
    if now - r.resume_sent >= policy.rebuild_timeout_s and r.resume_attempts < policy.max_resume_attempts:
        missing = sorted(set(range(world)) - r.resumed)
        out.add(ResumeInPlace(_relaunch_id(r), r.generation, in_place_master(st),
                              f"{what}: resume again"))
        out.event("resume.retried", f"{what}: ranks {missing} did not resume; asking again",
                  relaunch=r.count, missing=missing)
        return replace(st, relaunch=replace(r, resume_sent=now, resume_attempts=r.resume_attempts + 1))
    return st


def _relaunch_watch(out: _Out, st: CoordState, now: float, policy: CoordinatorPolicy) -> CoordState:
    """Say when a relaunch's ranks are all back, and keep srun's exit hook told whether a silent
    node of the job could lead to a relaunch (it then waits for the verdict)."""
    r = st.relaunch
    if r is not None and r.snapshot:
        st = _snapshot_relaunch_step(out, st, now, policy)
    elif r is not None and st.all_registered():
        out.event("job.relaunched", f"relaunch {r.count}: every rank of the relaunched training step registered "
                  f"{now - r.decided:.1f} s after {r.lost} was found lost; it goes on from its checkpoint of step "
                  f"{r.checkpoint_step}", relaunch=r.count, decision_to_registered_s=_r(now - r.decided),
                  checkpoint=r.checkpoint_step)
        st = replace(st, relaunch=None)
    pending = ""
    if st.restore_point is not None or st.last_snapshot is not None:  # none: no relaunch, nothing to tell srun
        nodes = st.rank_nodes()  # a pass over the health reports (few silent), no sort of every node
        silent = min((n for n, h in st.health.items() if not h.reachable and n in nodes and n not in st.handed),
                     default="")
        pending = silent if silent and _relaunch_plan(st, [silent], policy) is not None else ""
    if pending != st.relaunch_pending:
        out.add(RelaunchPossible(bool(pending), pending))
        st = replace(st, relaunch_pending=pending)
    return st


def _new_migration(st: CoordState, now: float, *, mid: str, node: str, reason: str, trigger: Trigger,
                   detected: float, to: str | None, policy: CoordinatorPolicy) -> Migration:
    check_transition(mid, None, Phase.SPARE)
    return Migration(
        id=mid, node=node, reason=reason, trigger=trigger, ranks=st.rank_nodes().get(node, ()),
        detected=detected, started=now, phase=Phase.SPARE, phase_started=now,
        deadline=now + policy.spare_timeout_s, generation=st.generation + 1, requested_to=to,
        phase_durations={"detect": _r(max(0.0, now - detected))},
    )


def _say_skipped(out: _Out, said: frozenset[str], cands, why: Callable[[str], tuple[str, dict]]) -> frozenset[str]:
    """One migration.skipped per node of ``cands`` not in ``said`` (``why(node)``: what keeps it,
    and the event's data for it); ``said`` with those nodes."""
    for c in cands:
        if c.node not in said:
            text, data = why(c.node)
            out.event("migration.skipped", f"{c.node} needs to move ({c.reason}), but {text}: not moving it",
                      node=c.node, reason=c.reason, **data)
            said = said | {c.node}
    return said


def _skip_unprotected(out: _Out, st: CoordState, now: float, policy: CoordinatorPolicy) -> CoordState:
    """The job is unprotected: drop queued operator requests, and say once per node that a
    node needing a move is not moved."""
    why = st.job_unprotected
    for req in st.operator_requests:
        out.event("migration.rejected", f"{req.id}: the job is unprotected ({why}); dropped",
                  migration=req.id, node=req.node)
    said = _say_skipped(out, st.unprotected_skipped, candidates(now, st, policy),
                        lambda _node: (f"the job is unprotected ({why})", {"unprotected": why}))
    if not st.operator_requests and said == st.unprotected_skipped:
        return st
    return replace(st, operator_requests=(), unprotected_skipped=said)


def _skip_pinned(out: _Out, st: CoordState, cands: list, pinned: dict[str, str]) -> CoordState:
    """Nodes that need to move but cannot (a rank there said why, e.g. torchrun's agent there
    serves a store every node uses): said once per node; the rest of the job stays protected."""
    said = _say_skipped(out, st.unprotected_skipped, cands,
                        lambda node: (f"it cannot move ({pinned[node]})", {"pinned": pinned[node]}))
    return st if said == st.unprotected_skipped else replace(st, unprotected_skipped=said)


def _start_next(out: _Out, st: CoordState, now: float, policy: CoordinatorPolicy) -> CoordState:
    if not st.all_registered() or st.slurm_down:
        return st  # a move needs slurmctld (spare, restore step, drain): wait for it
    if st.job_unprotected is not None:
        return _skip_unprotected(out, st, now, policy)
    while st.operator_requests:
        req, rest = st.operator_requests[0], st.operator_requests[1:]
        st = replace(st, operator_requests=rest)
        if req.node not in st.rank_nodes() or req.node in st.handed:
            out.event("migration.rejected", f"{req.id}: {req.node} no longer runs ranks of the job; dropped",
                      migration=req.id, node=req.node)
            continue
        pinned = st.pinned_nodes().get(req.node)
        if pinned:
            out.event("migration.rejected", f"{req.id}: {req.node} cannot move ({pinned}); dropped",
                      migration=req.id, node=req.node, pinned=pinned)
            continue
        m = _new_migration(st, now, mid=req.id, node=req.node, reason="operator request", trigger=Trigger.OPERATOR,
                           detected=req.at, to=req.to, policy=policy)
        out.event("migration.started", f"{m.id}: operator asked to move {req.node}"
                  + (f" to {req.to}" if req.to else ""), migration=m.id, node=req.node, to=req.to,
                  trigger=Trigger.OPERATOR)
        return replace(st, migration=m)
    cands = candidates(now, st, policy)
    if not cands:
        return st
    pinned = st.pinned_nodes()
    if pinned:
        st = _skip_pinned(out, st, [c for c in cands if c.node in pinned], pinned)
        cands = [c for c in cands if c.node not in pinned]
        if not cands:
            return st
    c = cands[0]
    mid = f"m{st.next_migration}"
    m = _new_migration(st, now, mid=mid, node=c.node, reason=c.reason, trigger=c.trigger,
                       detected=c.detected, to=None, policy=policy)
    out.event("migration.started", f"{mid}: {c.node} needs to move ({c.reason})", migration=mid, node=c.node,
              trigger=c.trigger, reason=c.reason)
    return replace(st, migration=m, next_migration=st.next_migration + 1,
                   unprotected=st.unprotected - {c.node})


# ============================================================================
# Whole-job snapshots (tpassctl snapshot; issue 12, engineer F)
# ============================================================================
# A snapshot saves every rank of the job and leaves it running:
#
#     QUEUED -> PAUSE -> DUMP -> RESUME -> None (snapshot.completed / snapshot.failed)
#                  \________\______/
#                   failure or timeout: ResumeInPlace, DiscardSnapshot, RESUME (failed)
#
# PAUSE: every rank pauses at the same collective T (PauseAt, every rank held: a held rank closes
# its coordinator link, so CRIU finds no socket). DUMP: every rank is dumped in parallel by its
# node's tpassd into the snapshot's own directory. RESUME: every rank resumes in place as the next
# generation (ResumeInPlace) while rank 0's tpassd verifies the images and writes the job manifest
# (CommitSnapshot), which then keeps the newest policy.snapshot_keep snapshots. At most one
# snapshot runs, never beside a migration: a snapshot is refused while a migration runs or is
# queued, and no migration starts while a snapshot runs.


def check_snapshot_request(st: CoordState) -> tuple[str, str] | None:
    """Why `tpassctl snapshot` must be refused, as (wire error code, message); None if fine."""
    if st.job_unprotected is not None:
        return "conflict", f"job is unprotected: {st.job_unprotected}; torchpass cannot snapshot it"
    if st.snapshot is not None:
        return "conflict", f"snapshot {st.snapshot.id} of job {st.job_id} is already in flight; try again after it"
    if st.migration is not None or st.operator_requests:
        what = st.migration.id if st.migration is not None else st.operator_requests[0].id
        return "conflict", f"migration {what} of job {st.job_id} is in flight or queued; snapshot after it ends"
    lost = st.handed.intersection(st.rank_nodes())  # a relaunch left its lost node behind: not these
    if lost:
        return "conflict", f"node(s) {', '.join(sorted(lost))} of job {st.job_id} were lost; no snapshot"
    if not st.all_registered():
        return "conflict", (f"job {st.job_id} has {len(st.ranks)}/{st.world_size or '?'} ranks registered; "
                            "a snapshot needs every rank")
    if st.relaunch is not None and st.relaunch.snapshot:
        return "conflict", (f"job {st.job_id} is being restored from snapshot {st.relaunch.snapshot}; snapshot "
                            "after it resumed")
    if st.slurm_down:
        return "unavailable", f"slurmctld is unreachable ({st.slurm_down}); tpassd needs it to check the ranks"
    pinned = st.pinned_nodes()
    if pinned or any(rv.task not in (-1, r) for r, rv in st.ranks.items()):
        return "conflict", (f"job {st.job_id} runs several ranks per task (torchrun): whole-job snapshots of "
                            "such jobs are not covered yet; live migration is")
    return None


def periodic_snapshot_due(now: float, st: CoordState, policy: CoordinatorPolicy) -> bool:
    """A periodic snapshot (policy.snapshot_every_s) is to be asked for now: that long since the job
    was fully registered or the last snapshot ended, and one would be accepted. One that cannot
    (a migration runs, a rank is missing) waits until it can: the interval bounds the steps a
    restore recomputes, so a late snapshot is taken as soon as possible, never skipped."""
    every = policy.snapshot_every_s
    return (every > 0 and st.snapshot is None and st.snapshot_clock is not None
            and now - st.snapshot_clock >= every and check_snapshot_request(st) is None)


def snapshot_phase_complete(st: CoordState, s: SnapshotRun) -> bool:
    """The completion condition of the snapshot's phase (machine stamps ready_at with it)."""
    if s.phase == SNAP_PAUSE:
        return _everyone_in(st, s.quiesced)
    if s.phase == SNAP_DUMP:
        return {r for r, _ in s.ranks} <= set(s.images)
    if s.phase == SNAP_RESUME:
        return _everyone_in(st, s.resumed)
    if s.phase == SNAP_STOP:
        return s.committed is not None
    return False


def _snap_enter(s: SnapshotRun, phase: str, now: float, deadline: float, **changes: Any) -> SnapshotRun:
    d = dict(s.phase_durations)
    if s.phase != SNAP_QUEUED:
        end = s.ready_at if s.ready_at is not None else now
        d[s.phase] = _r(d.get(s.phase, 0.0) + max(0.0, end - s.phase_started))
    return replace(s, phase=phase, phase_started=now, deadline=deadline, ready_at=None, phase_durations=d,
                   **changes)


def _snap_step_at(st: CoordState, at: int) -> int:
    """The optimizer steps done when every rank has issued ``at`` collectives (the ranks' step
    boundaries, when T is one of them; else the highest step a rank reported)."""
    views = list(st.ranks.values())
    b = max(views, key=lambda r: r.boundary) if views else None
    if b is not None and b.boundary >= 0 and b.per_step > 0 and at >= b.boundary \
            and (at - b.boundary) % b.per_step == 0:
        return b.boundary_step + (at - b.boundary) // b.per_step
    return max((r.step for r in views), default=-1)


def _snap_fail(out: _Out, st: CoordState, s: SnapshotRun, now: float, policy: CoordinatorPolicy,
               why: str) -> CoordState:
    """Every rank resumes in place; what was written is removed; the run ends once they resumed."""
    out.add(ResumeInPlace(s.id, s.generation, in_place_master(st), f"snapshot {s.id} failed: {why}"))
    nodes = tuple(sorted({n for _, n in s.ranks}))
    if nodes:
        out.add(DiscardSnapshot(s.id, nodes))
    s = _snap_enter(s, SNAP_RESUME, now, now + policy.rebuild_timeout_s, failure=why, resumed=frozenset(),
                    resume_attempts=1, commit_deadline=None)
    return replace(st, snapshot=s)


def _snap_end(out: _Out, st: CoordState, s: SnapshotRun, now: float, policy: CoordinatorPolicy) -> CoordState:
    """Every rank resumed and the manifest is settled: the event, and the snapshot is no longer in flight."""
    d = dict(s.phase_durations)
    d[SNAP_RESUME] = _r(d.get(SNAP_RESUME, 0.0) + max(0.0, (s.ready_at or now) - s.phase_started))
    d["total"] = _r(now - s.asked)
    paused = s.paused_s if s.paused_s is not None else 0.0
    d["paused"] = paused
    data: dict[str, Any] = {"snapshot": s.id, "trigger": s.trigger, "step": s.step, "pause_at": s.pause_at,
                            "generation": s.generation, "pause_s": paused, "phase_durations": d}
    if s.dump_durations:
        data["tool_durations"] = dict(s.dump_durations)
    why = s.failure or s.commit_failed
    last = st.last_snapshot
    if why is None and s.committed is not None:
        c = s.committed
        last = _snapshot_point(st, s)
        out.event("snapshot.completed", f"snapshot {s.id} of job {st.job_id} at step {s.step}: {len(s.images)} "
                  f"ranks, {c.bytes / 1e6:.1f} MB; training stood still {paused:.2f}s"
                  + (f"; removed older snapshot(s) {', '.join(c.removed)}" if c.removed else ""),
                  bytes=c.bytes, manifest=c.manifest, removed=list(c.removed), ranks=len(s.images), **data)
    else:
        if why is None:
            why = "no manifest was written"
        out.event("snapshot.failed", f"snapshot {s.id} of job {st.job_id} failed: {why}; every rank resumed "
                  f"after {paused:.2f}s", why=why, **data)
    return replace(st, snapshot=None, generation=max(st.generation, s.generation), snapshot_clock=now,
                   last_snapshot=last)


def _snapshot_step(out: _Out, st: CoordState, now: float, policy: CoordinatorPolicy) -> CoordState:
    """One transition of the snapshot in flight (``st.snapshot``), or none."""
    s = st.snapshot
    assert s is not None
    nodes = {n for _, n in s.ranks} or set(st.rank_nodes())
    lost = sorted(n for n in nodes if n in st.handed or _lost(st.node_health(n)))
    if s.phase == SNAP_QUEUED:
        why = check_snapshot_request(replace(st, snapshot=None))
        if why is not None:
            out.event("snapshot.failed", f"snapshot {s.id} of job {st.job_id} not taken: {why[1]}",
                      snapshot=s.id, why=why[1])
            return replace(st, snapshot=None)
        at, how = pause_point(now, st.ranks, policy)
        ranks = tuple((r, v.node) for r, v in sorted(st.ranks.items()))
        out.add(PauseAt(s.id, at, st.generation + 1, tuple(r for r, _ in ranks)))
        out.event("snapshot.started", f"snapshot {s.id}: pausing every rank at collective {at}",
                  snapshot=s.id, pause_at=at, pause_estimate=how)
        s = _snap_enter(s, SNAP_PAUSE, now, now + policy.pause_timeout_s, generation=st.generation + 1,
                        pause_at=at, pause_estimate=how, ranks=ranks)
        return replace(st, snapshot=s)
    if s.phase in (SNAP_PAUSE, SNAP_DUMP) or (s.phase == SNAP_STOP and s.stop_sent is None):
        if lost:
            return _snap_fail(out, st, s, now, policy, f"node(s) {', '.join(lost)} lost")
        if st.job_unprotected is not None:
            return _snap_fail(out, st, s, now, policy, f"the job is unprotected ({st.job_unprotected})")
    done = snapshot_phase_complete(st, s)
    if s.phase == SNAP_PAUSE:
        if done:
            stood = s.ready_at if s.ready_at is not None else now
            for r, node in s.ranks:
                out.add(DumpRank(s.id, r, node, s.generation, policy.snapshot_keep))
            s = _snap_enter(s, SNAP_DUMP, now, now + policy.dump_timeout_s, stood_still_since=stood,
                            step=_snap_step_at(st, s.pause_at or 0))
            return replace(st, snapshot=s)
        rearmed, why = _pause_overdue(out, st, s, now, policy, tuple(r for r, _ in s.ranks), f"snapshot {s.id}",
                                      snapshot=s.id)
        if rearmed is not None:
            return replace(st, snapshot=rearmed)
        return _snap_fail(out, st, s, now, policy, why) if why is not None else st
    if s.phase == SNAP_DUMP:
        if s.failure is not None:
            return _snap_fail(out, st, s, now, policy, s.failure)
        if done and s.stop:  # the ranks stay paused until the manifest is written and the job held
            master = in_place_master(st)
            images = tuple(s.images[r] for r, _ in s.ranks)
            out.add(CommitSnapshot(s.id, master, s.step, s.generation, s.pause_at or 0, images, policy.snapshot_keep))
            s = _snap_enter(s, SNAP_STOP, now, now + policy.dump_timeout_s, commit_deadline=now + policy.dump_timeout_s)
            return replace(st, snapshot=s)
        if done:
            out.add(ResumeInPlace(s.id, s.generation, in_place_master(st), f"snapshot {s.id} taken"))
            master = in_place_master(st)
            images = tuple(s.images[r] for r, _ in s.ranks)
            collectives = s.pause_at or 0
            out.add(CommitSnapshot(s.id, master, s.step, s.generation, collectives, images, policy.snapshot_keep))
            s = _snap_enter(s, SNAP_RESUME, now, now + policy.rebuild_timeout_s, resumed=frozenset(),
                            resume_attempts=1, commit_deadline=now + policy.dump_timeout_s)
            return replace(st, snapshot=s)
        if now >= s.deadline:
            missing = sorted({r for r, _ in s.ranks} - set(s.images))
            return _snap_fail(out, st, s, now, policy,
                              f"dump timed out after {policy.dump_timeout_s:g}s (ranks {missing})")
        return st
    if s.phase == SNAP_STOP:
        return _snapshot_stop(out, st, s, now, policy)
    # SNAP_RESUME: the ranks resume in place; the manifest is written meanwhile.
    if done and s.paused_s is None:
        since = s.stood_still_since if s.stood_still_since is not None else s.first_quiesced
        end = s.ready_at if s.ready_at is not None else now
        s = replace(s, paused_s=_r(max(0.0, end - since)) if since is not None else 0.0)
        st = replace(st, snapshot=s)
    if not done:
        if now < s.deadline:
            return st
        missing = sorted(set(st.ranks) - s.resumed)
        if s.resume_attempts < policy.max_resume_attempts:
            out.add(ResumeInPlace(s.id, s.generation, in_place_master(st), f"snapshot {s.id}: resume again"))
            out.event("resume.retried", f"snapshot {s.id}: ranks {missing} did not resume; asking again",
                      snapshot=s.id, missing=missing)
            return replace(st, snapshot=replace(s, resume_attempts=s.resume_attempts + 1,
                                                deadline=now + policy.rebuild_timeout_s))
        for node in sorted({st.ranks[r].node for r in missing if r in st.ranks}):
            if node not in st.handed:
                out.add(HandToSlurm(node, f"torchpass: ranks on {node} did not resume after snapshot {s.id}"))
                st = replace(st, handed=st.handed | {node})
        out.event("job.stuck", f"snapshot {s.id}: ranks {missing} did not resume after {s.resume_attempts} "
                  "resume commands; handed to Slurm", snapshot=s.id, missing=missing)
        s = replace(s, failure=s.failure or f"ranks {missing} did not resume")
        return _snap_end(out, st, s, now, policy)
    if s.failure is not None:
        return _snap_end(out, st, s, now, policy)
    if s.committed is None and s.commit_failed is None:
        if s.commit_deadline is not None and now >= s.commit_deadline:
            s = replace(s, commit_failed=f"the job manifest was not written within {policy.dump_timeout_s:g}s")
        else:
            return st
    if s.commit_failed is not None:
        out.add(DiscardSnapshot(s.id, tuple(sorted({n for _, n in s.ranks}))))
    return _snap_end(out, st, s, now, policy)


def _snapshot_stop(out: _Out, st: CoordState, s: SnapshotRun, now: float, policy: CoordinatorPolicy) -> CoordState:
    """`tpassctl snapshot --stop` after the dump: once the manifest is written, hold the job
    (StopJob); if the manifest or the hold fails, every rank resumes and the job goes on."""
    if s.stop_failed is not None:  # the job could not be held: the snapshot stays, training goes on
        out.event("job.stop_failed", f"job {st.job_id} could not be stopped after snapshot {s.id} ({s.stop_failed}); "
                  "every rank resumes and the job goes on", snapshot=s.id, why=s.stop_failed)
        out.add(ResumeInPlace(s.id, s.generation, in_place_master(st), f"snapshot {s.id}: the stop failed"))
        s = _snap_enter(s, SNAP_RESUME, now, now + policy.rebuild_timeout_s, resumed=frozenset(), resume_attempts=1,
                        commit_deadline=None)
        return replace(st, snapshot=s)
    if s.commit_failed is not None:
        return _snap_fail(out, st, s, now, policy, f"the job manifest was not written ({s.commit_failed})")
    if s.committed is None:
        if now >= (s.commit_deadline or s.deadline):
            return _snap_fail(out, st, s, now, policy, f"the job manifest was not written within "
                              f"{policy.dump_timeout_s:g}s")
        return st
    if s.stop_sent is not None:
        return st  # the job is being requeue-held: every process of it, this coordinator too, ends
    since = s.stood_still_since if s.stood_still_since is not None else s.first_quiesced
    c = s.committed
    d = dict(s.phase_durations)
    d["total"] = _r(now - s.asked)
    out.event("job.stopping", f"snapshot {s.id} of job {st.job_id} at step {s.step} is complete ({len(s.images)} "
              f"ranks, {c.bytes / 1e6:.1f} MB): the job is held now and its nodes freed; "
              f"'tpassctl resume {st.job_id}' brings it back, every rank restored from it",
              snapshot=s.id, trigger=s.trigger, step=s.step, generation=s.generation, bytes=c.bytes,
              manifest=c.manifest, removed=list(c.removed), ranks=len(s.images), stop=True,
              paused_s=_r(now - since) if since is not None else None, phase_durations=d)
    nodes = tuple(sorted({n for _, n in s.ranks}))
    out.add(StopJob(s.id, s.step, s.generation, len(s.ranks), st.step_offset, nodes))
    return replace(st, snapshot=replace(s, stop_sent=now), last_snapshot=_snapshot_point(st, s))


def snapshot_reason(st: CoordState) -> str | None:
    """The reason line's part for the snapshot in flight."""
    s = st.snapshot
    if s is None:
        return None
    text = {SNAP_QUEUED: "starting", SNAP_PAUSE: f"pausing every rank at collective {s.pause_at}",
            SNAP_DUMP: f"dumping ranks {sorted(r for r, _ in s.ranks)}",
            SNAP_RESUME: "resuming every rank" + (f" ({s.failure})" if s.failure else ", writing the manifest"),
            SNAP_STOP: "writing the manifest, then holding the job (--stop)" if s.stop_sent is None
            else "the job is being held (--stop)"}
    return f"snapshot {s.id}: {text.get(s.phase, s.phase)}"


# ============================================================================
# Reasons
# ============================================================================
_PHASE_TEXT = {
    Phase.PAUSE: "pausing every rank at collective {at} (generation {gen}; {how})",
    Phase.DUMP: "dumping ranks {ranks} on {node}",
    Phase.TRANSFER: "transferring images of ranks {ranks} to {target}",
    Phase.RESTORE: "restoring ranks {ranks} on {target}",
    Phase.KILL_SOURCE: "killing the source copies on {node}",
    Phase.REBUILD: "ranks rebuilding generation {gen} with {ranks} on {target}",
    Phase.DRAIN: "draining {node}",
    Phase.SHRINK: "releasing {node} from the job",
    Phase.ROLLBACK: "rolling back ({why}): resuming on {node}",
}


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
def _step(out: _Out, state: CoordState, now: float, policy: CoordinatorPolicy) -> CoordState:
    if state.snapshot_clock is None and state.all_registered():  # periodic snapshots count from here
        state = replace(state, snapshot_clock=now)
    st = state
    for _ in range(32):  # a few transitions can happen in one call (SPARE -> PAUSE)
        # Lost nodes first, and again once a move has ended: its nodes were not handed while involved.
        lost = _handle_lost(out, st, now, policy)
        if lost.snapshot is not None:  # a whole-job snapshot runs: no migration starts meanwhile
            nxt = _snapshot_step(out, lost, now, policy)
        elif lost.relaunch is not None and lost.relaunch.snapshot and lost.migration is None:
            nxt = lost  # restored ranks wait paused for their resume: no migration starts meanwhile
        elif st.migration is None:
            nxt = _start_next(out, lost, now, policy)
        else:
            nxt = _advance(out, lost, now, policy)
        if nxt is st:
            break
        st = nxt
    return st


def _recover(out: _Out, st: CoordState, now: float, policy: CoordinatorPolicy, exc: IllegalTransition
             ) -> CoordState:
    """Production answer to a bug in the core: drop what this call decided, end the migration
    in flight (rolled back to where the ranks can still resume), and resume every rank."""
    m = st.migration
    out.event("migration.illegal_transition", f"torchpass bug: {exc}; "
              + ("no migration in flight" if m is None else f"abandoning {m.id} and resuming every rank"),
              migration=exc.migration, src=None if exc.src is None else exc.src.value,
              dst=None if exc.dst is None else exc.dst.value)
    if m is None:
        return st
    if m.paused:
        if m.phase == Phase.REBUILD:  # the source copies are gone: the moved ranks resume on the target
            out.add(Resume(m.id, m.generation, _master(st, None)))
        else:
            if m.target is not None and (m.restored or m.phase in (Phase.RESTORE, Phase.KILL_SOURCE)):
                out.add(AbortRestore(m.id, m.target, tuple(m.ranks)))
            out.add(ResumeInPlace(m.id, m.generation, _master(st, None), f"illegal transition: {exc}"))
        st = replace(st, generation=max(st.generation, m.generation))
    return _finish(out, st, m, now, Result.ABORTED, policy, f"{m.id}: abandoned after a torchpass bug ({exc})",
                   "migration.aborted", checked=False)


def decide(now: float, state: CoordState, policy: CoordinatorPolicy, *, strict: bool | None = None) -> Decision:
    """What to do now. Pure: reads nothing but its arguments (and, with ``strict`` None,
    phases.strict_default()). An illegal phase transition raises ``IllegalTransition`` in
    strict mode; otherwise the migration in flight is abandoned with every rank resumed."""
    out = _Out()
    try:
        st = _step(out, state, now, policy)
    except IllegalTransition as exc:
        if strict_default() if strict is None else strict:
            raise
        out = _Out()
        st = _recover(out, state, now, policy, exc)
    return Decision(tuple(out.actions), _reason(now, st, policy), st)


# Re-exported for callers that know the core as one module (tests, tpassctl's helpers).
__all__ = [
    "Phase", "PAUSED_PHASES", "Result", "NodeHealth", "RankView", "SpareView", "OperatorRequest", "Image",
    "Failure", "Migration", "MigrationRecord", "CoordState", "SpareHow", "SpareStatus", "Trigger",
    "RequestSpare", "PauseAt", "MigrationDump", "Transfer", "Restore", "AbortRestore", "KillSource", "Resume",
    "ResumeInPlace", "Drain", "Shrink", "HandToSlurm", "Event", "Action", "Decision", "decide", "job_ended",
    "candidates", "stalled_ranks", "check_operator_request", "phase_complete", "spare_usable", "pause_point",
    "IllegalTransition", "SnapshotRun", "check_snapshot_request", "periodic_snapshot_due", "snapshot_phase_complete",
]
