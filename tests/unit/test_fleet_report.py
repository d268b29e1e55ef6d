"""fleet report: the documented score ranks suspects; PrivateData decides who sees which records."""

from __future__ import annotations

import json
from pathlib import Path

from torchpass.fleet import report as F
from torchpass.fleet.ingest import job_records
from torchpass.fleet.records import record

GOLDEN = Path(__file__).parent / "golden" / "migration_events.json"


def test_a_node_with_faults_and_a_migration_out_ranks_ahead_of_a_milder_distractor():
    recs = [
        record("health.change", "node3", 10.0, state="failed", previous="healthy", reasons=["gpu0: xid 79"]),
        record("audit.node", "node3", 20.0, outlier=True, measures={"compute_s": 4.1}),
        record("job.migration", "node3", 30.0, job=7, user="u", outcome="completed", target="node4", ranks_moved=2),
        record("health.change", "node2", 11.0, state="degraded", previous="healthy", reasons=["rail0 flapping"]),
        record("job.reroute", "node2", 31.0, job=8, user="u", outcome="rerouted"),
        record("audit.node", "node1", 20.0, outlier=False),
    ]
    ranked = F.rank(recs)
    assert [s.node for s in ranked] == ["node3", "node2", "node1"]
    assert ranked[0].score == 10 + 4 + 3 + 2 + 2 and ranked[0].jobs == {7}
    assert ranked[1].score == 2 + 2 + 2 and ranked[2].score == 0


def test_recovery_and_failed_migrations_score_nothing():
    recs = [record("health.change", "n1", 1.0, state="healthy", previous="failed"),
            record("job.migration", "n1", 2.0, job=1, user="u", outcome="rolled_back", ranks_moved=0),
            record("job.snapshot", "n1", 3.0, job=1, user="u", outcome="completed")]
    (s,) = F.rank(recs)
    assert s.score == 0 and s.snapshots == 1


def test_the_coordinators_event_log_becomes_migration_records_with_the_ranks_moved():
    events = json.loads(GOLDEN.read_text())
    recs, last = job_records(42, "tpuser1", events)
    kinds = [(r["kind"], r["node"], r["outcome"], r.get("ranks_moved")) for r in recs]
    assert kinds == [("job.migration", "node2", "rolled_back", 0), ("job.migration", "node3", "completed", 1)]
    assert last == max(e["seq"] for e in events)
    # taken again from the cursor: nothing new
    assert job_records(42, "tpuser1", events, last) == ([], last)


def _mixed():
    return [record("job.migration", "n1", 1.0, job=1, user="alice", outcome="completed", target="n2", ranks_moved=1),
            record("job.migration", "n3", 1.0, job=2, user="bob", outcome="completed", target="n4", ranks_moved=1),
            record("health.change", "n1", 2.0, state="failed", previous="healthy"),
            record("health.change", "n2", 2.0, state="degraded", previous="healthy"),
            record("health.change", "n3", 2.0, state="failed", previous="healthy"),
            record("audit.node", "n4", 3.0, outlier=True)]


def test_with_private_data_a_user_sees_their_jobs_and_the_nodes_they_ran_on_only():
    v = F.viewer_for(1001, "alice", private=True, admins=frozenset({0, 64030}))
    seen = F.visible(_mixed(), v)
    assert {(r["kind"], r["node"]) for r in seen} == {("job.migration", "n1"), ("health.change", "n1"),
                                                      ("health.change", "n2")}
    assert all(r.get("user") in (None, "alice") for r in seen)


def test_admins_and_everyone_without_private_data_see_every_record():
    assert F.visible(_mixed(), F.viewer_for(0, "root", True, frozenset({0}))) == _mixed()
    assert F.visible(_mixed(), F.viewer_for(64030, "slurm", True, frozenset({0, 64030}))) == _mixed()
    assert F.visible(_mixed(), F.viewer_for(1001, "alice", False, frozenset({0}))) == _mixed()
