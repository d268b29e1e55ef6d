"""An admin's `tpassctl migrate` of an ordinary user's job drains the healthy node (drains by root):
root runs tpassctl, the job's coordinator (the job user) accepts and carries out the
move, and tpassctl asks the node's own tpassd to drain it; tpassd grants it because munge proves
the requester is root. The owner's own request leaves a healthy node in service
(test_migration.py). Without the drain nobody drains the node after an admin's request of a user's job.
"""

from __future__ import annotations

import json

import pytest

import training_jobs as tj
from torchpass import layout
from tpassd.testing import wait_for
from training_jobs import TPASSCTL, drain_audit

pytestmark = pytest.mark.integration

STEPS = 150
NODE, SPARE = "node2", "node4"  # node1 is the batch host; node4 the job's hot spare
REASON = "torchpass: operator request (admin uid 0)"


def admin_comment(job_id: int) -> str:
    """``scontrol show job``'s AdminComment (slurmctld keeps an ended job's record for a while)."""
    return json.loads(tj.run(["scontrol", "show", "job", str(job_id), "--json"]).stdout)["jobs"][0]["admin_comment"]


def test_root_migrating_a_users_job_drains_the_healthy_node(cluster, plugin_built, job_dir, job_user):
    job_id = tj.submit(job_dir, "adm", STEPS, nodes=4, user=job_user.name)
    try:
        out_path = job_dir / f"adm.{job_id}.out"
        wait_for(lambda: out_path.exists() and "step=5 " in out_path.read_text(), 120,
                 f"{out_path.name} at step 5", poll_s=0.1)
        # Another tool's part of AdminComment, set by root before the move: it must survive.
        r = tj.run(["scontrol", "update", f"JobId={job_id}", "AdminComment=site: foo"])
        assert r.returncode == 0 and admin_comment(job_id) == "site: foo", (r.stdout, r.stderr)
        r = tj.run([*TPASSCTL, "migrate", str(job_id), "--node", NODE, "--to", SPARE, "--json"])  # as root
        assert r.returncode == 0, (r.stdout, r.stderr)
        res = json.loads(r.stdout)
        assert res["drain"] == {"node": NODE, "reason": REASON, "health": "healthy"}, res
        n = tj.node(NODE)
        assert "DRAIN" in n["state"] and n["reason"] == REASON, n
        # tpassd's audit: root asked, the node was healthy, granted.
        assert (0, "healthy", "ok") in [(a["requester_uid"], a["health"], a["outcome"])
                                        for a in drain_audit(cluster, NODE, job_id)]

        end = tj.wait_end(job_id, 240)
        text = out_path.read_text()
        assert end["job_state"] == ["COMPLETED"], text[-3000:]
        assert len(tj.steps(text)) == 3 * STEPS, text[-3000:]
        events = json.loads(layout.events_json(cluster.state_dir, job_id).read_text())
        done = [e for e in events if e["kind"] == "migration.completed"]
        assert len(done) == 1 and done[0]["data"]["node"] == NODE, events
        # The job user's coordinator had root (its tpassd) write the move into AdminComment.
        paused = done[0]["data"]["phase_durations"]["paused"]
        assert admin_comment(job_id) == f"site: foo | torchpass: mig 1 ({NODE}->{SPARE} ok {paused:.1f}s)"
        assert tj.node(NODE)["reason"] == REASON  # still drained, with the admin's reason
    finally:
        tj.run(["scancel", str(job_id)])
        if (tj.node(NODE).get("reason") or "").startswith("torchpass"):
            tj.run(["scontrol", "update", f"NodeName={NODE}", "State=RESUME"])
