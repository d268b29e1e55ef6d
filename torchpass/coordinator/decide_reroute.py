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
from dataclasses import dataclass, field

USABLE_STATES = frozenset({"healthy", "unknown"})


@dataclass(frozen=True)
class RailPlan:
    """The rails in use and, per rail left out, since when it has been usable (None: not usable now)."""

    using: tuple[str, ...]
    usable_since: tuple[tuple[str, float | None], ...] = ()
    reroutes: int = 0


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
