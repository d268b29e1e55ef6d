"""The fleet history's store: one small interface (``FleetStore``), one backend (SQLite).

A site whose own database should hold the history implements ``FleetStore`` (six methods)
and passes it where ``SqliteStore`` is made (``open_store``); SQLite is the only backend tested.

The SQLite schema is versioned: ``schema_version`` holds one row, and ``MIGRATIONS`` lists one
function per version, in order; opening a file runs those above its version in one transaction.

* version 1: ``records(id, ts, kind, node, data)`` (data: the whole record as JSON) and
  ``job_cursor(job, seq)`` (the last event of each job's events.json already taken);
* version 2: ``records`` gains ``job`` and ``user`` (filled from ``data`` for old rows: the
  PrivateData filter selects on them) and an index on ``ts``.

Limits (``Retention``): rows older than ``days`` are deleted at each ingest, then the oldest
beyond ``max_rows`` (a row is ~400 B with its index: 1,000,000 rows ~ 400 MB).
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from torchpass.fleet.records import FleetError

DEFAULT_STORE = Path("/var/lib/torchpass/fleet/fleet.sqlite")


@dataclass(frozen=True)
class Retention:
    days: float = 90.0
    max_rows: int = 1_000_000


class FleetStore(Protocol):
    """What the writer and ``fleet report`` need of a store."""

    def append(self, records: Iterable[dict[str, Any]]) -> int:
        """Add records (checked by records.validate); returns how many."""

    def records(self, since: float | None = None) -> list[dict[str, Any]]:
        """Every record with ts >= since (all when None), oldest first."""

    def job_cursor(self, job: int) -> int:
        """The seq of job's last event already taken (0: none)."""

    def set_job_cursor(self, job: int, seq: int) -> None: ...

    def prune(self, now: float, retention: Retention) -> int:
        """Apply the limits; returns the rows deleted."""

    def close(self) -> None: ...


def _v1(db: sqlite3.Connection) -> None:
    db.execute("CREATE TABLE records (id INTEGER PRIMARY KEY, ts REAL NOT NULL, kind TEXT NOT NULL, "
               "node TEXT NOT NULL, data TEXT NOT NULL)")
    db.execute("CREATE TABLE job_cursor (job INTEGER PRIMARY KEY, seq INTEGER NOT NULL)")


def _v2(db: sqlite3.Connection) -> None:
    db.execute("ALTER TABLE records ADD COLUMN job INTEGER")
    db.execute("ALTER TABLE records ADD COLUMN user TEXT")
    db.execute("UPDATE records SET job = json_extract(data, '$.job'), user = json_extract(data, '$.user')")
    db.execute("CREATE INDEX records_ts ON records (ts)")


# Version N is reached by MIGRATIONS[N - 1]; never edit a released one, append the next.
MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_v1, _v2)
SCHEMA_VERSION = len(MIGRATIONS)


class SqliteStore:
    """The history in one SQLite file, written by one process at a time (the caller holds
    ``writer_lock``). Made 0600: the records name jobs and users (docs/fleet.md, "Who sees what")."""

    def __init__(self, path: str | os.PathLike, mode: int = 0o600, readonly: bool = False):
        self.path = Path(path)
        if readonly:  # a reader that is not the writer: no migration, no lock taken
            self.db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, isolation_level=None)
            row = self.db.execute("SELECT version FROM schema_version").fetchone()
            self.version = row[0] if row else 0
            if self.version != SCHEMA_VERSION:
                raise FleetError(f"{self.path} has fleet schema {self.version}, this torchpass reads "
                                 f"{SCHEMA_VERSION}; root's next 'tpassctl fleet ingest' upgrades it")
            return
        fresh = not self.path.exists()
        if fresh:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW, mode))
        self.db = sqlite3.connect(self.path, isolation_level=None)
        self.version = self._upgrade()

    def _upgrade(self) -> int:
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = db.execute("SELECT version FROM schema_version").fetchone()
            have = row[0] if row else 0
            if have > SCHEMA_VERSION:
                raise FleetError(f"{self.path} has fleet schema {have}, newer than this torchpass's "
                                 f"{SCHEMA_VERSION}; upgrade torchpass")
            for step in MIGRATIONS[have:]:
                step(db)
            db.execute("DELETE FROM schema_version")
            db.execute("INSERT INTO schema_version VALUES (?)", (SCHEMA_VERSION,))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return SCHEMA_VERSION

    def append(self, records: Iterable[dict[str, Any]]) -> int:
        rows = [(r["ts"], r["kind"], r["node"], r.get("job"), r.get("user"),
                 json.dumps(r, separators=(",", ":"), allow_nan=False)) for r in records]
        with self.db:
            self.db.executemany("INSERT INTO records (ts, kind, node, job, user, data) VALUES (?, ?, ?, ?, ?, ?)",
                                rows)
        return len(rows)

    def records(self, since: float | None = None) -> list[dict[str, Any]]:
        cur = self.db.execute("SELECT data FROM records WHERE ts >= ? ORDER BY ts, id",
                              (since if since is not None else float("-inf"),))
        return [json.loads(d) for (d,) in cur]

    def job_cursor(self, job: int) -> int:
        row = self.db.execute("SELECT seq FROM job_cursor WHERE job = ?", (job,)).fetchone()
        return row[0] if row else 0

    def set_job_cursor(self, job: int, seq: int) -> None:
        with self.db:
            self.db.execute("INSERT INTO job_cursor VALUES (?, ?) ON CONFLICT(job) DO UPDATE SET seq = excluded.seq",
                            (job, seq))

    def prune(self, now: float, retention: Retention) -> int:
        with self.db:
            n = self.db.execute("DELETE FROM records WHERE ts < ?", (now - retention.days * 86400.0,)).rowcount
            n += self.db.execute("DELETE FROM records WHERE id NOT IN "
                                 "(SELECT id FROM records ORDER BY ts DESC, id DESC LIMIT ?)",
                                 (retention.max_rows,)).rowcount
        return n

    def close(self) -> None:
        self.db.close()
