"""Which data rails a job's collectives use: a pure, clock-injected rule over the rails' health.

Input: the rails the job's nodes were given (TORCHPASS_DATA_RAILS, in that order) and, per
(node, rail) of the job's nodes, the rail's state as tpassd publishes it (component
``rail:NAME``: healthy, degraded, failed, unknown). A rail is *usable* when it is healthy or
unknown on every node of the job: a rail down (failed) or flapping / counting errors
(degraded) on one node is unusable for every rank, since both ends of every pair must agree
on the interface. Not knowing (unknown: a tpassd silent for a tick) is not a fault.

::

    USING(rails) ──a used rail unusable, another usable──────────────► USING(rails - it)  Reroute
    USING(rails) ──every rail unusable──► USING(rails) unchanged (the node is failed: tpassd marks it
                                          and the migration or relaunch machine moves its ranks)
    USING(rails) ──a rail left out, usable on every node for restore_after_s──► USING(rails + it)  Reroute

Hysteresis is one-sided on purpose: a rail leaves at once (every collective on it stalls) and
comes back only after ``restore_after_s`` of continuous health, so a rail that flaps five
times in a minute causes one reroute, not five. The reroute itself is carried out at the next
collective boundary (runtime/pg.py: every rank rebuilds its inner group on the new rails).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # model imports this module (RailPlan) for its annotations
    from torchpass.coordinator.decide_common import _Out
    from torchpass.coordinator.model import CoordState, SnapshotRun
    from torchpass.coordinator.policy import CoordinatorPolicy

USABLE_STATES = frozenset({"healthy", "unknown"})
# After a failed reroute (its pause timed out: a collective stuck on the dead rail never reaches T),
# the next waits this long: each try stands the job still for up to pause_timeout_s.
RETRY_AFTER_FAILED_S = 60.0


@dataclass(frozen=True)
class RailPlan:
    """The rails in use and, per rail left out, since when it has been usable (None: not usable now)."""

    using: tuple[str, ...]
    usable_since: tuple[tuple[str, float | None], ...] = ()
    reroutes: int = 0
    retry_at: float = 0.0  # a reroute failed: no other starts before this (track)


@dataclass(frozen=True)
class Reroute:
    """Every rank rebuilds its inner group on ``rails`` at the next collective boundary."""

    rails: tuple[str, ...]
    dropped: tuple[str, ...] = ()
    restored: tuple[str, ...] = ()
    reason: str = ""


@dataclass(frozen=True)
class RerouteDecision:
    plan: RailPlan
    action: Reroute | None
    reason: str
    unusable: dict[str, list[str]] = field(default_factory=dict)  # rail -> the nodes where it is not usable


def initial_plan(rails: tuple[str, ...]) -> RailPlan:
    return RailPlan(using=tuple(rails))


def unusable_nodes(rails: tuple[str, ...], health: Mapping[tuple[str, str], str],
                   nodes: tuple[str, ...]) -> dict[str, list[str]]:
    """rail -> the job's nodes where it is not usable (empty list: usable everywhere)."""
    return {r: [n for n in nodes if health.get((n, r), "unknown") not in USABLE_STATES] for r in rails}


def decide_rails(now: float, plan: RailPlan, rails: tuple[str, ...], nodes: tuple[str, ...],
                 health: Mapping[tuple[str, str], str], restore_after_s: float) -> RerouteDecision:
    """The next plan, the reroute to carry out (or None), and one line saying why."""
    bad = unusable_nodes(rails, health, nodes)
    usable = tuple(r for r in rails if not bad[r])
    since = dict(plan.usable_since)
    if not usable:
        return RerouteDecision(plan, None, "no data rail is usable on every node of the job: keeping "
                                           f"{', '.join(plan.using)} (a node with no rail left is failed)", bad)
    dropped = tuple(r for r in plan.using if bad[r])
    # A rail left out: usable since when (reset by any sample that finds it unusable).
    for r in rails:
        if r in plan.using and r not in dropped:
            since.pop(r, None)
        elif bad[r]:
            since[r] = None
        elif since.get(r) is None:
            since[r] = now
    restored = tuple(r for r in rails if r not in plan.using and since.get(r) is not None
                     and now - since[r] >= restore_after_s)
    if not dropped and not restored:
        waiting = [r for r in rails if r not in plan.using and since.get(r) is not None]
        reason = f"using {', '.join(plan.using)}"
        if waiting:
            reason += f"; {', '.join(waiting)} back after {restore_after_s:g} s of health"
        return RerouteDecision(RailPlan(plan.using, tuple(sorted(since.items())), plan.reroutes), None, reason, bad)
    new = tuple(r for r in rails if (r in plan.using and r not in dropped) or r in restored)
    for r in restored:
        since.pop(r, None)
    parts = [f"{r} unusable on {', '.join(bad[r])}" for r in dropped]
    parts += [f"{r} healthy on every node for {restore_after_s:g} s" for r in restored]
    reason = f"reroute onto {', '.join(new)}: {'; '.join(parts)}"
    return RerouteDecision(RailPlan(new, tuple(sorted(since.items())), plan.reroutes + 1),
                           Reroute(new, dropped, restored, reason), reason, bad)


# ============================================================================
# The job's rails: what decide does on each pass (decide._step)
# ============================================================================
def job_rail_health(st: CoordState) -> tuple[tuple[str, ...], dict[tuple[str, str], str]]:
    """The job's rank nodes and (node, rail) -> state from their tpassds' rail:NAME items."""
    nodes = tuple(sorted(st.rank_nodes()))
    return nodes, {(n, r): state for n in nodes for r, state in st.node_health(n).rails}


def reroute_busy(st: CoordState) -> bool:
    """A reroute pauses every rank: not while another pause (snapshot, migration, relaunch) runs,
    before every rank registered, or in a job that refuses pauses."""
    return (st.snapshot is not None or st.migration is not None or st.relaunch is not None
            or bool(st.operator_requests) or not st.all_registered() or st.job_unprotected is not None)


def track(out: _Out, st: CoordState, now: float, policy: CoordinatorPolicy) -> CoordState:
    """Follow the job's data rails: ``link.down`` when a rail becomes unusable, and a reroute (a
    pause at the next collective boundary, then a resume in place on the new rails: a SnapshotRun
    with ``rails`` set, nothing dumped) when the rule says so. Jobs without rails: unchanged."""
    from torchpass.coordinator.model import SnapshotRun  # model imports this module
    from torchpass.coordinator.snapshot_phases import SnapPhase, check_transition

    plan = st.rail_plan
    if plan is None or not st.job_rails:
        return st
    nodes, health = job_rail_health(st)
    bad = unusable_nodes(st.job_rails, health, nodes)
    down = frozenset(r for r, where in bad.items() if where)
    if down != st.rails_down:
        for r in sorted(down - st.rails_down):
            states = ", ".join(f"{n}: {health.get((n, r), 'unknown')}" for n in bad[r])
            out.event("link.down", f"data rail {r} is unusable on {', '.join(bad[r])} ({states})",
                      rail=r, nodes=bad[r])
        st = replace(st, rails_down=down)
    if reroute_busy(st) or now < plan.retry_at:
        return st
    d = decide_rails(now, plan, st.job_rails, nodes, health, policy.rail_restore_after_s)
    st = replace(st, rail_plan=d.plan)
    if d.action is None:
        return st
    rid = f"reroute-{d.plan.reroutes}"
    check_transition(rid, None, SnapPhase.QUEUED)
    run = SnapshotRun(rid, now, trigger="reroute", rails=d.action.rails, rails_before=plan.using)
    return replace(st, snapshot=run)


def reroute_ended(out: _Out, st: CoordState, s: SnapshotRun, now: float, why: str | None, paused: float,
                  data: dict[str, Any]) -> CoordState:
    """The reroute's ranks all resumed: ``link.rerouted`` (or ``link.restored`` when every rail of
    the job is in use again), or ``link.reroute_failed`` (the ranks resumed on the rails they had,
    and the plan says so: the rule decides again on its next pass)."""
    rails, before = s.rails or (), s.rails_before
    fields = {**data, "rails": list(rails), "rails_before": list(before)}
    plan = st.rail_plan
    if why is not None:
        out.event("link.reroute_failed", f"{s.id} onto {', '.join(rails)} failed: {why}; every rank resumed on "
                  f"{', '.join(before)} after {paused:.2f}s", why=why, **fields)
        if plan is not None:
            plan = replace(plan, using=before, retry_at=now + RETRY_AFTER_FAILED_S)
    else:
        kind = "link.restored" if set(rails) == set(st.job_rails) else "link.rerouted"
        out.event(kind, f"{s.id}: every rank now uses data rails {', '.join(rails)} (was {', '.join(before)}); "
                  f"training stood still {paused:.2f}s", **fields)
    return replace(st, snapshot=None, generation=max(st.generation, s.generation), rail_plan=plan)
