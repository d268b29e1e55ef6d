"""The coordinator's record of its job: identity, the event log, and the status it reports.

The ranks themselves (node, pid, progress) live in the decision state
(``model.CoordState.ranks``), their one home; ``status`` reads them there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from torchpass.coordinator.model import CoordState, RankView

# A job that runs for weeks keeps its last EVENTS_KEPT events (memory, and events.json is rewritten
# after every event).
EVENTS_KEPT = 10_000
# The kinds a job writes once per rank: a registration of 1,024 nodes x 8 ranks alone writes 8,192,
# and a relaunch from a snapshot as many again. Over the limit these go first, oldest first, so
# that the job's own history (migrations, a lost node, snapshots) is not pushed out by them.
PER_RANK_KINDS = frozenset({"rank.registered"})


def activity_status(state: CoordState, now: float) -> dict[str, Any]:
    """What the coordinator is doing to the job now (job.status; ``now``: coordinator clock): the
    migration and the whole-job snapshot in flight (None: none), and how the last migration ended."""
    m, s = state.migration, state.snapshot
    last = state.history[-1] if state.history else None
    return {
        "migration": None if m is None else {
            "id": m.id, "node": m.node, "target": m.target, "phase": str(m.phase),
            "phase_age_s": round(max(0.0, now - m.phase_started), 3), "age_s": round(max(0.0, now - m.started), 3)},
        "snapshot": None if s is None else {
            "id": s.id, "trigger": s.trigger, "phase": str(s.phase),
            "phase_age_s": round(max(0.0, now - s.phase_started), 3)},
        "last_migration": None if last is None else {
            "id": last.id, "node": last.node, "target": last.target, "outcome": str(last.outcome)},
    }


STATUS_COMPUTE_STEPS = 10  # the newest steps job.status's compute figures cover


def rank_status(rv: RankView, now: float) -> dict[str, Any]:
    """One rank in job.status (``now``: coordinator clock)."""
    return {
        "rank": rv.rank,
        "node": rv.node,
        "pid": rv.pid,
        # the Slurm task whose rank record (RANK_DIR/jobJ/rankT.json) holds it: -1, the rank's own
        "task": rv.task,
        "generation": rv.generation,
        "step": rv.step,
        "collectives": rv.last_count,
        "last_report_age_s": round(max(0.0, now - rv.last_report), 3),
    }


def compute_status(state: CoordState, now: float) -> dict[str, Any]:
    """What the fail-slow rule sees, for job.status: per node, its slowest rank's median compute
    time per step (s) over its newest STATUS_COMPUTE_STEPS measured steps (nodes whose ranks
    reported none are left out), and the nodes the rule finds slow now. Per node, not per rank:
    job.status at 8,192 ranks is ~0.93 MB of its 1 MiB frame already."""
    per_node: dict[str, float] = {}
    for rv in state.ranks.values():
        measured = [f for f in rv.compute[-STATUS_COMPUTE_STEPS:] if f >= 0]
        if measured:
            per_node[rv.node] = max(per_node.get(rv.node, 0.0), round(median(measured), 4))
    slow = {n: {"ratio": w.ratio, "node_compute_s": w.node_s, "peers_median_s": w.peers_s,
                "slow_for_s": round(max(0.0, now - w.since), 1)} for n, w in state.slow.items()}
    return {"compute_per_node_s": per_node, "slow_nodes": slow}


def rails_status(state: CoordState) -> dict[str, Any]:
    """The job's data rails (decide_reroute) for job.status: the rails given, those its ranks use
    now, and those unusable on a node of the job at the last look; nothing for a job without rails."""
    if not state.job_rails or state.rail_plan is None:
        return {}
    return {"rails": {"all": list(state.job_rails), "using": list(state.rail_plan.using),
                      "down": sorted(state.rails_down)}}


@dataclass
class Event:
    seq: int
    wall_time: float
    kind: str
    message: str
    data: dict[str, Any] = field(default_factory=dict)

    # as_dict() as JSON, once: an event is not changed once recorded, and the whole log is saved
    # after every new one (at 8,192 ranks, encoding their rank.registered events again each time
    # cost the serve thread 40-80 ms per event, twice before every pause).
    _encoded: str | None = field(default=None, init=False, repr=False, compare=False)

    def as_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "time": self.wall_time, "kind": self.kind,
                "message": self.message, "data": self.data}

    def encoded(self) -> str:
        if self._encoded is None:
            self._encoded = json.dumps(self.as_dict())
        return self._encoded


def encode_events(events: list[Event]) -> str:
    """The event log as a JSON array: the same text as json.dumps of every as_dict()."""
    return "[" + ", ".join(e.encoded() for e in events) + "]"


@dataclass
class JobState:
    job_id: int
    spares: int = 0
    policy: str = "default"
    started_wall: float = 0.0
    # A torch outside the runtime's tested range that the site allowed ($TORCHPASS_ALLOW_TORCH):
    # the first rank's line saying so ("" for a tested torch). Shown in job.status.
    torch_override: str = ""
    events: list[Event] = field(default_factory=list)
    _next_seq: int = 1

    def carry_on(self, earlier: list[dict[str, Any]]) -> None:
        """Start from the event log of an earlier run of the job (a job stopped with `tpassctl
        snapshot --stop` and resumed): its events stay first, and the numbering goes on after them."""
        for e in earlier[-EVENTS_KEPT:]:
            if isinstance(e, dict) and isinstance(e.get("seq"), int) and isinstance(e.get("kind"), str):
                self.events.append(Event(e["seq"], float(e.get("time") or 0.0), e["kind"], str(e.get("message", "")),
                                         e.get("data") if isinstance(e.get("data"), dict) else {}))
        if self.events:
            self._next_seq = self.events[-1].seq + 1

    def record(self, wall_time: float, kind: str, message: str, **data: Any) -> Event:
        ev = Event(self._next_seq, wall_time, kind, message, data)
        self._next_seq += 1
        self.events.append(ev)
        if len(self.events) > EVENTS_KEPT:
            self._drop_oldest()
        return ev

    def _drop_oldest(self) -> None:
        """One event out: the oldest per-rank one, else the oldest. The scan stops at the first
        per-rank event, which follows the few job events kept before it."""
        for i, e in enumerate(self.events):
            if e.kind in PER_RANK_KINDS:
                del self.events[i]
                return
        del self.events[0]

    def status(self, now: float, state: CoordState) -> dict[str, Any]:
        ranks = state.ranks
        steps = [r.step for r in ranks.values()]
        return {
            "job_id": self.job_id,
            "spares": self.spares,
            "policy": self.policy,
            "started": self.started_wall,
            "world_size": state.world_size,
            "registered_ranks": len(ranks),
            "min_step": min(steps) if steps else None,
            "max_step": max(steps) if steps else None,
            "ranks": [rank_status(ranks[r], now) for r in sorted(ranks)],
            **compute_status(state, now),
            # why the job cannot be protected ("rank R unprotected: ..."); None while it can
            "unprotected": state.job_unprotected,
            # the site's override of the runtime's tested torch range ("": none; torch_range)
            "torch_override": self.torch_override,
            **rails_status(state),
            **activity_status(state, now),
            "last_event_seq": self.events[-1].seq if self.events else 0,
        }
