"""The one writer: merges the spool and the jobs' event logs into the store, under a lock.

Job events reach the history this way: the writer (root) reads ``STATE_DIR/jobs/J/events.json``
of each job through ``torchpass.jobdir`` (safeio: no symlink followed, a regular file of the job
directory's owner with one link, at most jobdir.MAX_EVENTS_BYTES) and keeps, per job, the seq of the last
event it took, so a job still running is read again from there next time. No daemon and no socket
is added for it: the state directory is shared by every node and the login node, and root reads
the users' files there only through safeio (docs/security.md).

Which events become records (``job_records``, pure):

| events.json kind | record | node |
|---|---|---|
| migration.completed, .rolled_back, .aborted, .abandoned | job.migration (ranks_moved, target) | its source |
| snapshot.completed, snapshot.failed | job.snapshot (outcome) | the job's first node |
| link.rerouted, link.restored, link.reroute_failed | job.reroute (rails, outcome) | the node of the last link.down |
| job.relaunched, job.relaunch_failed | job.relaunch (outcome) | the last node an event named |
"""

from __future__ import annotations

import fcntl
import os
import pwd
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchpass import jobdir
from torchpass.fleet import records as R
from torchpass.fleet.store import FleetStore, Retention

MIGRATION_ENDS = {"migration.completed": "completed", "migration.rolled_back": "rolled_back",
                  "migration.aborted": "aborted", "migration.abandoned": "abandoned"}
SNAPSHOT_ENDS = {"snapshot.completed": "completed", "snapshot.failed": "failed"}
REROUTE_ENDS = {"link.rerouted": "rerouted", "link.restored": "restored", "link.reroute_failed": "failed"}
RELAUNCH_ENDS = {"job.relaunched": "relaunched", "job.relaunch_failed": "failed"}


def job_records(job: int, user: str, events: list[dict[str, Any]], after_seq: int = 0
                ) -> tuple[list[dict[str, Any]], int]:
    """(the fleet records of ``events`` with seq > after_seq, the last seq seen). Pure."""
    rank_node: dict[int, str] = {}
    last_node = ""
    first_node = ""
    link_node = ""
    out: list[dict[str, Any]] = []
    last_seq = after_seq
    for ev in events:
        if not isinstance(ev, dict):
            continue
        kind, data, seq = ev.get("kind"), ev.get("data") or {}, ev.get("seq", 0)
        ts = ev.get("time", 0.0)
        if not isinstance(data, dict) or not isinstance(seq, int):
            continue
        node = data.get("node") if isinstance(data.get("node"), str) else ""
        if kind == "rank.registered" and node and isinstance(data.get("rank"), int):
            rank_node[data["rank"]] = node
            first_node = first_node or node
        if kind == "link.down" and node:
            link_node = node
        new = seq > after_seq and isinstance(ts, (int, float))
        base = {"job": job, "user": user, "event": kind, "seq": seq}
        rec = None
        if new and kind in MIGRATION_ENDS and node:
            moved = sorted(r for r, n in rank_node.items() if n == node)
            rec = R.record("job.migration", node, ts, **base, outcome=MIGRATION_ENDS[kind],
                           target=data.get("target"), ranks_moved=len(moved) if kind == "migration.completed" else 0)
        elif new and kind in SNAPSHOT_ENDS and (node or first_node):
            rec = R.record("job.snapshot", node or first_node, ts, **base, outcome=SNAPSHOT_ENDS[kind])
        elif new and kind in REROUTE_ENDS and (link_node or node):
            rec = R.record("job.reroute", link_node or node, ts, **base, outcome=REROUTE_ENDS[kind],
                           rails=data.get("rails"))
        elif new and kind in RELAUNCH_ENDS and (node or last_node):
            rec = R.record("job.relaunch", node or last_node, ts, **base, outcome=RELAUNCH_ENDS[kind])
        if kind in MIGRATION_ENDS and kind == "migration.completed" and node:
            for r, n in list(rank_node.items()):
                if n == node and isinstance(data.get("target"), str):
                    rank_node[r] = data["target"]
        if rec is not None:
            out.append(rec)
        if node:
            last_node = node
        last_seq = max(last_seq, seq)
    return out, last_seq


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def read_job_events(state_dir: str | os.PathLike, job: int) -> tuple[list[dict[str, Any]], str] | None:
    """(events.json of job, its owner's name) read through safeio; None when it has none."""
    try:
        events, owner = jobdir.read_events(state_dir, job)
    except (OSError, ValueError):
        return None
    return events, _user_name(owner)


@dataclass(frozen=True)
class IngestResult:
    spooled: int
    refused_lines: int
    job_records: int
    pruned: int

    def as_dict(self) -> dict[str, int]:
        return {"spooled": self.spooled, "refused_lines": self.refused_lines, "job_records": self.job_records,
                "pruned": self.pruned}


class WriterLock:
    """The one writer: an exclusive flock on STORE.lock, held for one ingest."""

    def __init__(self, store_path: str | os.PathLike):
        self.path = Path(f"{store_path}.lock")

    def __enter__(self) -> WriterLock:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: Any) -> None:
        os.close(self.fd)


def ingest(store: FleetStore, state_dir: str | os.PathLike, now: float, retention: Retention = Retention(),
           read_events: Callable[[str | os.PathLike, int], Any] = read_job_events) -> IngestResult:
    """Merge the spool and every job's new events into ``store``, then apply the limits.
    The caller holds the WriterLock."""
    spooled, bad, _ = R.take_spool(R.spool_dir(state_dir))
    store.append(spooled)
    jobs = 0
    for job in jobdir.job_names(state_dir):
        got = read_events(state_dir, job)
        if got is None:
            continue
        events, user = got
        after = store.job_cursor(job)
        recs, last = job_records(job, user, events, after)
        store.append(recs)
        jobs += len(recs)
        if last > after:
            store.set_job_cursor(job, last)
    pruned = store.prune(now, retention)
    return IngestResult(len(spooled), bad, jobs, pruned)
