"""The fleet store: its versioned SQLite schema, limits, and the records it keeps."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from torchpass.fleet import records as R
from torchpass.fleet.store import SCHEMA_VERSION, Retention, SqliteStore

V1_SQL = Path(__file__).parent / "fleet_sql" / "fleet_v1.sql"


def test_a_version_1_file_opens_after_the_upgrade_with_its_rows_intact(tmp_path):
    path = tmp_path / "fleet.sqlite"
    db = sqlite3.connect(path)
    db.executescript(V1_SQL.read_text())
    db.close()
    store = SqliteStore(path)
    assert store.version == SCHEMA_VERSION == 2
    rows = store.records()
    assert [(r["kind"], r["node"]) for r in rows] == [("health.change", "node2"), ("job.migration", "node2")]
    assert rows[1]["ranks_moved"] == 2 and store.job_cursor(42) == 17
    # the columns version 2 added are filled from the old rows' data
    assert store.db.execute("SELECT job, user FROM records WHERE kind = 'job.migration'").fetchone() == (42, "tpuser1")
    assert store.db.execute("SELECT version FROM schema_version").fetchall() == [(2,)]
    store.close()
    assert SqliteStore(path).records() == rows  # a second open migrates nothing


def test_a_newer_file_is_refused_rather_than_damaged(tmp_path):
    path = tmp_path / "fleet.sqlite"
    SqliteStore(path).close()
    db = sqlite3.connect(path)
    db.execute("UPDATE schema_version SET version = 99")
    db.commit()
    db.close()
    with pytest.raises(R.FleetError, match="newer"):
        SqliteStore(path)


def test_retention_drops_old_rows_then_the_oldest_beyond_the_row_limit(tmp_path):
    store = SqliteStore(tmp_path / "f.sqlite")
    day = 86400.0
    store.append([R.record("health.change", "n1", t, state="failed", previous="healthy")
                  for t in (0.0, 50 * day, 60 * day, 61 * day, 62 * day)])
    assert store.prune(100 * day, Retention(days=45, max_rows=3)) == 2
    assert [r["ts"] for r in store.records()] == [60 * day, 61 * day, 62 * day]
    assert store.prune(100 * day, Retention(days=45, max_rows=2)) == 1
    assert [r["ts"] for r in store.records(since=61 * day)] == [61 * day, 62 * day]


def test_a_fresh_store_is_private_to_root(tmp_path):
    SqliteStore(tmp_path / "f.sqlite").close()
    assert (tmp_path / "f.sqlite").stat().st_mode & 0o077 == 0


@pytest.mark.parametrize("bad", [
    {"schema": 2, "ts": 1.0, "kind": "health.change", "node": "n"},
    {"schema": 1, "ts": 1.0, "kind": "health.whatever", "node": "n"},
    {"schema": 1, "ts": float("nan"), "kind": "health.change", "node": "n"},
    {"schema": 1, "ts": 1.0, "kind": "health.change", "node": ""},
    ["not", "an", "object"],
])
def test_a_record_this_version_cannot_read_is_refused(bad):
    with pytest.raises(R.FleetError):
        R.validate(bad)


def test_spool_lines_parse_and_count_what_they_refuse():
    good = R.encode(R.record("audit.node", "n1", 5.0, outlier=True))
    recs, bad = R.parse_lines(good + b'{"schema":1}\n' + b"half a li")
    assert [r["node"] for r in recs] == ["n1"] and bad == 2


def test_a_reader_opens_read_only_and_an_old_file_sends_it_to_the_writer(tmp_path):
    path = tmp_path / "fleet.sqlite"
    store = SqliteStore(path)
    store.append([R.record("audit.node", "n1", 5.0, outlier=True)])
    store.close()
    reader = SqliteStore(path, readonly=True)
    assert [r["node"] for r in reader.records()] == ["n1"]
    with pytest.raises(sqlite3.OperationalError):
        reader.append([R.record("audit.node", "n2", 6.0, outlier=True)])
    old = tmp_path / "old.sqlite"
    db = sqlite3.connect(old)
    db.executescript(V1_SQL.read_text())
    db.close()
    with pytest.raises(R.FleetError, match="fleet ingest"):
        SqliteStore(old, readonly=True)
