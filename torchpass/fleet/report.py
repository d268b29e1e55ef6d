"""Suspect nodes ranked from the history, and who may see which records. Pure: no clock, no I/O.

The score of a node (docs/fleet.md, "The score") adds, over the records since ``--since``:

| record | points |
|---|---|
| audit.node with outlier true (compute, or every rail) | 10 each |
| audit.rail with outlier true (one rail of the node) | 5 each |
| health.change into failed | 4 each |
| health.change into degraded | 2 each |
| job.migration out of the node | 3 each, + 1 per rank moved off it |
| job.reroute or job.relaunch on the node | 2 each |
| each distinct job affected (a migration, reroute or relaunch of it on the node) | 2 |

Snapshots score nothing (they are not a fault) but are counted. Ties rank by the most recent
record first, then by name. Nodes with a score of 0 are listed last.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

POINTS = {"audit.node": 10, "audit.rail": 5, "failed": 4, "degraded": 2, "migration": 3, "rank_moved": 1,
          "reroute": 2, "relaunch": 2, "job_affected": 2}


@dataclass
class NodeScore:
    node: str
    score: int = 0
    audit_outliers: int = 0
    rail_outliers: int = 0
    failed: int = 0
    degraded: int = 0
    migrations_out: int = 0
    ranks_moved: int = 0
    reroutes: int = 0
    relaunches: int = 0
    snapshots: int = 0
    jobs: set[int] = field(default_factory=set)
    last_ts: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"node": self.node, "score": self.score, "audit_outliers": self.audit_outliers,
                "rail_outliers": self.rail_outliers, "failed": self.failed, "degraded": self.degraded,
                "migrations_out": self.migrations_out, "ranks_moved": self.ranks_moved,
                "reroutes": self.reroutes, "relaunches": self.relaunches, "snapshots": self.snapshots,
                "jobs_affected": sorted(self.jobs), "last_ts": self.last_ts}


def rank(records: Iterable[dict[str, Any]]) -> list[NodeScore]:
    """Every node the records name, the most suspect first."""
    nodes: dict[str, NodeScore] = {}
    for r in records:
        s = nodes.setdefault(r["node"], NodeScore(r["node"]))
        s.last_ts = max(s.last_ts, float(r["ts"]))
        kind = r["kind"]
        if kind == "audit.node" and r.get("outlier"):
            s.audit_outliers += 1
            s.score += POINTS["audit.node"]
        elif kind == "audit.rail" and r.get("outlier"):
            s.rail_outliers += 1
            s.score += POINTS["audit.rail"]
        elif kind == "health.change" and r.get("state") in ("failed", "degraded") and r.get("state") != r.get(
                "previous"):
            setattr(s, r["state"], getattr(s, r["state"]) + 1)
            s.score += POINTS[r["state"]]
        elif kind == "job.migration" and r.get("outcome") == "completed":
            s.migrations_out += 1
            moved = int(r.get("ranks_moved") or 0)
            s.ranks_moved += moved
            s.score += POINTS["migration"] + POINTS["rank_moved"] * moved
            _affected(s, r)
        elif kind in ("job.reroute", "job.relaunch"):
            if kind == "job.reroute":
                s.reroutes += 1
            else:
                s.relaunches += 1
            s.score += POINTS[kind.split(".")[1]]
            _affected(s, r)
        elif kind == "job.snapshot":
            s.snapshots += 1
    return sorted(nodes.values(), key=lambda s: (-s.score, -s.last_ts, s.node))


def _affected(s: NodeScore, r: dict[str, Any]) -> None:
    job = r.get("job")
    if isinstance(job, int) and job not in s.jobs:
        s.jobs.add(job)
        s.score += POINTS["job_affected"]


@dataclass(frozen=True)
class Viewer:
    """Who runs ``fleet report``: their name, and whether they see everything."""

    user: str
    sees_all: bool


def viewer_for(uid: int, user: str, private: bool, admins: frozenset[int]) -> Viewer:
    """PrivateData=jobs (or all) in slurm.conf: root and SlurmUser see every record, others
    their own; without it everyone sees every record (as squeue shows every job)."""
    return Viewer(user, sees_all=not private or uid in admins)


def visible(records: Iterable[dict[str, Any]], viewer: Viewer) -> list[dict[str, Any]]:
    """The records ``viewer`` may see: all, or the records of their own jobs and the health and
    audit records of the nodes those jobs ran on (another user's job.* records never)."""
    records = list(records)
    if viewer.sees_all:
        return records
    own = [r for r in records if r["kind"].startswith("job.") and r.get("user") == viewer.user]
    nodes = {r["node"] for r in own} | {r["target"] for r in own if isinstance(r.get("target"), str)}
    return [r for r in records if (r["kind"].startswith("job.") and r.get("user") == viewer.user)
            or (not r["kind"].startswith("job.") and r["node"] in nodes)]
