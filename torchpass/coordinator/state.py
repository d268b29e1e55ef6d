"""The coordinator's view of its job: ranks, progress and an event log."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RankState:
    rank: int
    node: str
    pid: int
    world_size: int
    generation: int = 0
    step: int = -1
    collectives: int = 0
    registered_at: float = 0.0  # coordinator clock (monotonic seconds)
    last_report: float = 0.0

    def as_dict(self, now: float) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "node": self.node,
            "pid": self.pid,
            "generation": self.generation,
            "step": self.step,
            "collectives": self.collectives,
            "last_report_age_s": round(max(0.0, now - self.last_report), 3),
        }


@dataclass
class Event:
    seq: int
    wall_time: float
    kind: str
    message: str
    data: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "time": self.wall_time, "kind": self.kind,
                "message": self.message, "data": self.data}


@dataclass
class JobState:
    job_id: int
    spares: int = 0
    policy: str = "default"
    started_wall: float = 0.0
    world_size: int | None = None
    ranks: dict[int, RankState] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    _next_seq: int = 1

    def record(self, wall_time: float, kind: str, message: str, **data: Any) -> Event:
        ev = Event(self._next_seq, wall_time, kind, message, data)
        self._next_seq += 1
        self.events.append(ev)
        # Bound memory: a job that runs for weeks keeps its last 10k events.
        if len(self.events) > 10_000:
            del self.events[: len(self.events) - 10_000]
        return ev

    def status(self, now: float) -> dict[str, Any]:
        steps = [r.step for r in self.ranks.values()]
        return {
            "job_id": self.job_id,
            "spares": self.spares,
            "policy": self.policy,
            "started": self.started_wall,
            "world_size": self.world_size,
            "registered_ranks": len(self.ranks),
            "min_step": min(steps) if steps else None,
            "max_step": max(steps) if steps else None,
            "ranks": [self.ranks[r].as_dict(now) for r in sorted(self.ranks)],
            "last_event_seq": self.events[-1].seq if self.events else 0,
        }
