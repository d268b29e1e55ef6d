"""What the decision core's machines share: the action collector, rank and spare lookups, the
pause point T, and the pause's re-arm or give-up rule (used by migrations and whole-job snapshots).

Names with a leading underscore are the core's own, shared between the ``decide_*`` modules;
callers outside the core use ``decide``'s public names.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from torchpass.coordinator.contract import (
    Action,
    Event,
    PauseAt,
)
from torchpass.coordinator.model import (
    STALL_FLOOR_CACHE,
    CoordState,
    Migration,
    NodeHealth,
    RankView,
    SpareStatus,
    SpareView,
)
from torchpass.coordinator.policy import (
    CoordinatorPolicy,
)
from torchpass.health_state import (
    State,
)


@dataclass(frozen=True)
class Decision:
    actions: tuple[Action, ...]
    reason: str
    state: CoordState


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


def _set_spare(st: CoordState, node: str | None, status: SpareStatus) -> CoordState:
    if node is None or st.spare(node) is None:
        return st
    return replace(st, spares=tuple(replace(s, status=status) if s.node == node else s for s in st.spares))


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
    # decide asks on every tick (a pass over 8,192 ranks was ~7 % of the serve thread at steady
    # state). No rank can be quiet that long before the lowest last_advance of an earlier
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


def _everyone_in(st: CoordState, acks: frozenset[int]) -> bool:
    """Every rank is in ``acks``. machine asks after each rank's report: the sizes first, so that a
    fan-in of N reports costs O(N), not O(N) each."""
    return bool(st.ranks) and len(acks) >= len(st.ranks) and st.ranks.keys() <= acks


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
