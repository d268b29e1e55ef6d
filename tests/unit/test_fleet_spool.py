"""The fleet spool and its one writer: root-owned files, appends under flock, one ingest."""

from __future__ import annotations

import json
import os

import pytest

from torchpass import layout
from torchpass.fleet import records as R
from torchpass.fleet.ingest import WriterLock, ingest
from torchpass.fleet.store import SqliteStore


@pytest.fixture
def state_dir(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the spool is root's")
    tmp_path.chmod(0o755)
    return tmp_path


def test_producers_append_and_the_writer_merges_spool_and_job_events_once(state_dir):
    spool = R.spool_dir(state_dir)
    a, b = R.SpoolAppender(spool, "node1"), R.SpoolAppender(spool, "node2")
    assert a.append(R.record("health.change", "node1", 5.0, state="failed", previous="healthy"))
    assert b.append(R.record("audit.node", "node2", 6.0, outlier=True))
    assert oct(spool.stat().st_mode & 0o777) == "0o700" and (spool / "node1.jsonl").stat().st_mode & 0o077 == 0
    jd = layout.job_dir(state_dir, 9)
    jd.parent.mkdir(mode=0o755)
    jd.mkdir(mode=0o750)
    events = [{"seq": 1, "time": 1.0, "kind": "rank.registered", "message": "", "data": {"rank": 0, "node": "node1"}},
              {"seq": 2, "time": 7.0, "kind": "migration.completed", "message": "",
               "data": {"node": "node1", "target": "node3", "outcome": "completed"}}]
    (jd / layout.EVENTS_JSON).write_text(json.dumps(events))
    store = SqliteStore(state_dir / "fleet.sqlite")
    with WriterLock(store.path):
        res = ingest(store, state_dir, now=100.0)
    assert (res.spooled, res.job_records, res.refused_lines) == (2, 1, 0)
    assert sorted(os.listdir(spool)) == []  # taken and removed
    with WriterLock(store.path):
        assert ingest(store, state_dir, now=100.0).job_records == 0  # the cursor: taken once
    kinds = [(r["kind"], r["node"]) for r in store.records()]
    assert kinds == [("health.change", "node1"), ("audit.node", "node2"), ("job.migration", "node1")]
    assert store.records()[2]["user"] == "root" and store.records()[2]["ranks_moved"] == 1


def test_a_full_spool_file_drops_and_counts_instead_of_growing(state_dir):
    ap = R.SpoolAppender(R.spool_dir(state_dir), "node1", max_bytes=300)
    results = [ap.append(R.record("health.change", "node1", float(t), state="failed", previous="healthy"))
               for t in range(10)]
    assert results[0] and not results[-1] and ap.dropped == results.count(False) > 0


def test_a_spool_under_a_directory_a_user_can_write_is_refused(state_dir):
    (state_dir / "open").mkdir(mode=0o777)
    (state_dir / "open").chmod(0o777)
    with pytest.raises(OSError, match="not a root-owned directory"):
        R.SpoolAppender(R.spool_dir(state_dir / "open"), "node1").append(
            R.record("health.change", "node1", 1.0, state="failed", previous="healthy"))
