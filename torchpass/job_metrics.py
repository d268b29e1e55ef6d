"""A job's summary for Prometheus: what the coordinator (the job's user) sends its batch host's
tpassd (root) in a ``tpassd.job_metrics`` request, and tpassd serves on its /metrics port.

One definition for both sides: the coordinator builds a ``JobReport`` and sends ``to_body()``;
tpassd keeps only what ``parse()`` accepts. tpassd acts on nothing in it but its own memory: the
report is a handful of numbers per job, no path, no command, no name (the job id is the key).

Caps (docs/tpassd.md, "Job metrics"): the body's JSON at most MAX_BODY_BYTES; only the keys
below, each outcome and pause kind from the tables here, numbers bounded (MAX_COUNT, MAX_RANKS,
EVERY_S_RANGE); no per-rank field, so a report's size does not grow with the job. tpassd keeps at
most MAX_JOBS jobs and drops a job it has not heard from for STALE_AFTER_PUSHES of the
coordinator's own ``every_s`` intervals.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from torchpass.coordinator.phases import Result
from torchpass.coordinator.snapshot_phases import SnapResult

# Pause lengths (s): the bucket bounds of the histogram. Measured standstills: a migration of one
# small rank 0.6 s (docs/benchmarks.md), snapshots and reroutes of devcluster jobs 0.3-3 s; the
# coordinator's timeouts end a pause after minutes at most.
PAUSE_BUCKETS_S = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# What stood still: a migration's ranks, a whole-job snapshot's, a reroute onto other data rails.
PAUSE_KINDS = ("migration", "snapshot", "reroute")
MIGRATION_OUTCOMES = tuple(r.value for r in Result)
# How a whole-job snapshot ended, as its end event says (``snapshot.completed``; ``snapshot.failed``
# with its ``outcome``, else failed). A snapshot ended by a relaunch is counted as completed or
# failed by its event, so SnapResult.RELAUNCHED is not among them.
SNAPSHOT_OUTCOMES = tuple(r.value for r in (SnapResult.COMPLETED, SnapResult.FAILED, SnapResult.NOT_TAKEN,
                                            SnapResult.ABORTED))

PUSH_EVERY_S = 15.0  # the coordinator's interval: a quarter of a 60 s scrape's staleness at most
EVERY_S_RANGE = (1.0, 300.0)
STALE_AFTER_PUSHES = 4  # tpassd forgets a job after this many of its intervals without a report
MAX_BODY_BYTES = 4096  # a full report (every outcome, three histograms) is about 1 KB of JSON
MAX_JOBS = 256  # jobs one tpassd serves metrics of: a batch host runs few coordinators
MAX_COUNT = 2 ** 53  # JSON's exact integers
MAX_RANKS = 1 << 20


class ReportError(ValueError):
    """A report tpassd refuses (the message says which field and why)."""


@dataclass(frozen=True)
class Pauses:
    """A histogram of pause lengths: ``buckets[i]`` pauses of at most PAUSE_BUCKETS_S[i] seconds
    (cumulative, as Prometheus counts them), ``count`` in all, ``sum_s`` their total length."""

    buckets: tuple[int, ...] = (0,) * len(PAUSE_BUCKETS_S)
    count: int = 0
    sum_s: float = 0.0

    def add(self, seconds: float) -> Pauses:
        b = tuple(n + (1 if seconds <= le else 0) for n, le in zip(self.buckets, PAUSE_BUCKETS_S, strict=True))
        return Pauses(b, self.count + 1, round(self.sum_s + seconds, 6))

    def merged(self, other: Pauses) -> Pauses:
        return Pauses(tuple(a + b for a, b in zip(self.buckets, other.buckets, strict=True)),
                      self.count + other.count, round(self.sum_s + other.sum_s, 6))


@dataclass(frozen=True)
class JobReport:
    job_id: int
    every_s: float
    ranks_registered: int
    ranks_expected: int  # 0: the world size is not known yet
    oldest_report_age_s: float  # the longest any registered rank has been silent (0: no rank)
    unprotected: bool  # the job cannot be protected (a rank said why): no migration starts
    migrations: dict[str, int] = field(default_factory=dict)  # outcome -> migrations ended so
    snapshots: dict[str, int] = field(default_factory=dict)  # outcome -> whole-job snapshots ended so
    pauses: dict[str, Pauses] = field(default_factory=dict)  # kind -> its pauses

    def to_body(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "every_s": self.every_s, "ranks_registered": self.ranks_registered,
                "ranks_expected": self.ranks_expected, "oldest_report_age_s": self.oldest_report_age_s,
                "unprotected": self.unprotected, "migrations": dict(self.migrations),
                "snapshots": dict(self.snapshots),
                "pauses": {k: {"buckets": list(p.buckets), "count": p.count, "sum_s": p.sum_s}
                           for k, p in self.pauses.items()}}


def _int(name: str, v: Any, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
        raise ReportError(f"{name} must be an integer 0..{hi}, got {v!r}")
    return v


def _num(name: str, v: Any, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise ReportError(f"{name} must be a number {lo:g}..{hi:g}, got {v!r}")
    return float(v)


def _counts(name: str, v: Any, known: tuple[str, ...]) -> dict[str, int]:
    if not isinstance(v, dict):
        raise ReportError(f"{name} must be an object")
    unknown = sorted(set(v) - set(known))
    if unknown:
        raise ReportError(f"{name}: unknown outcome(s) {', '.join(map(repr, unknown[:4]))}")
    return {k: _int(f"{name}.{k}", n, MAX_COUNT) for k, n in v.items()}


def _pauses(v: Any) -> dict[str, Pauses]:
    if not isinstance(v, dict):
        raise ReportError("pauses must be an object")
    unknown = sorted(set(v) - set(PAUSE_KINDS))
    if unknown:
        raise ReportError(f"pauses: unknown kind(s) {', '.join(map(repr, unknown[:4]))}")
    out = {}
    for kind, h in v.items():
        if not isinstance(h, dict) or set(h) != {"buckets", "count", "sum_s"}:
            raise ReportError(f"pauses.{kind} must be an object of buckets, count and sum_s")
        b = h["buckets"]
        if not isinstance(b, list) or len(b) != len(PAUSE_BUCKETS_S):
            raise ReportError(f"pauses.{kind}.buckets must list {len(PAUSE_BUCKETS_S)} counts")
        buckets = tuple(_int(f"pauses.{kind}.buckets", n, MAX_COUNT) for n in b)
        count = _int(f"pauses.{kind}.count", h["count"], MAX_COUNT)
        if any(a > c for a, c in zip(buckets, (*buckets[1:], count), strict=True)):
            raise ReportError(f"pauses.{kind}: bucket counts must not decrease, nor pass count")
        out[kind] = Pauses(buckets, count, _num(f"pauses.{kind}.sum_s", h["sum_s"], 0.0, 1e15))
    return out


KEYS = frozenset({"job_id", "every_s", "ranks_registered", "ranks_expected", "oldest_report_age_s", "unprotected",
                  "migrations", "snapshots", "pauses"})


def parse(body: Any) -> JobReport:
    """The report in a request's body, or ReportError: an unknown key, a value out of range, a
    body over MAX_BODY_BYTES."""
    if not isinstance(body, dict):
        raise ReportError("the report must be an object")
    size = len(json.dumps(body, separators=(",", ":")))
    if size > MAX_BODY_BYTES:
        raise ReportError(f"the report is {size} bytes; at most {MAX_BODY_BYTES}")
    if set(body) != KEYS:
        extra, missing = sorted(set(body) - KEYS), sorted(KEYS - set(body))
        raise ReportError(f"the report's keys: unknown {extra}, missing {missing}")
    if not isinstance(body["unprotected"], bool):
        raise ReportError("unprotected must be true or false")
    return JobReport(
        job_id=_int("job_id", body["job_id"], MAX_COUNT), every_s=_num("every_s", body["every_s"], *EVERY_S_RANGE),
        ranks_registered=_int("ranks_registered", body["ranks_registered"], MAX_RANKS),
        ranks_expected=_int("ranks_expected", body["ranks_expected"], MAX_RANKS),
        oldest_report_age_s=_num("oldest_report_age_s", body["oldest_report_age_s"], 0.0, 1e9),
        unprotected=body["unprotected"],
        migrations=_counts("migrations", body["migrations"], MIGRATION_OUTCOMES),
        snapshots=_counts("snapshots", body["snapshots"], SNAPSHOT_OUTCOMES),
        pauses=_pauses(body["pauses"]))
