"""Two ordinary users on one devcluster (PrivateData=jobs, issue 9): tpuser2 can
neither see nor steer tpuser1's --torchpass job. The unit tests cover each
check alone (test_job_auth.py, test_tpassd_daemon.py, test_checkpoint_service.py,
test_migrate_admin_drain.py); here the real programs answer requests made with
the real users' munge credentials, and the owner's own requests are the control.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from slurm_helpers import (job_id_of, job_python, sbatch, scancel, squeue, submit_env, tpassctl, wait_job,
                           wait_running)

from torchpass.ports import TPASSD_CONTROL_PORT
from torchpass.slurm import client

pytestmark = pytest.mark.integration

# Run by the job Python as a user: one tpassd request signed with that user's munge
# credential; prints the result or the error's code.
_TPASSD_REQUEST = """
import json, sys
from torchpass import auth, zmqio
from torchpass.errors import RemoteError
t, body, node, endpoint, sock = json.loads(sys.argv[1])
try:
    r = zmqio.request(endpoint, t, body, timeout_s=10, retries=0, auth=auth.credential_for(t, body, node, sock))
    print(json.dumps({"ok": True, "result": r}))
except RemoteError as e:
    print(json.dumps({"ok": False, "code": e.code, "message": e.remote_message}))
"""


def _tpassd_request(cluster, user: str, node: str, type_: str, body: dict) -> dict:
    args = json.dumps([type_, body, node, f"tcp://{cluster.node_address(node)}:{TPASSD_CONTROL_PORT}",
                       str(cluster.munge_socket)])
    out = subprocess.run(["runuser", "-u", user, "--", job_python(), "-c", _TPASSD_REQUEST, args],
                         capture_output=True, text=True, timeout=60, cwd="/", env=submit_env(user))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _node(name: str):
    return next(n for n in client().nodes() if n.name == name)


def test_another_user_can_neither_see_nor_steer_a_job(cluster, plugin_built, job_dir, job_user, other_user):
    owner, intruder = job_user.name, other_user.name
    job_id = job_id_of(sbatch(["-N2", "--torchpass", "-o", str(job_dir / "out.%j")],
                              "#!/bin/sh\nsrun sleep 300\n", cwd=job_dir, user=owner))
    try:
        wait_running(job_id)
        # The owner sees the job (the control: the refusals below are about who asks),
        # once its coordinator has registered.
        deadline = time.monotonic() + 30
        while (mine := tpassctl("status", str(job_id), "--json", user=owner)).returncode != 0 \
                and time.monotonic() < deadline:
            time.sleep(0.3)
        assert mine.returncode == 0, mine.stderr
        assert json.loads(mine.stdout)["jobs"][0]["job_id"] == job_id
        assert tpassctl("events", str(job_id), "--json", user=owner).returncode == 0
        node = client().job(job_id).batch_host  # runs the coordinator and a task of the job

        # Another user sees nothing of it...
        for what in ("status", "events"):
            theirs = tpassctl(what, str(job_id), "--json", user=intruder)
            # The refusal is in the job's entry, and the exit status says so (a script must not take it for an answer)
            assert theirs.returncode == 1 and "only the job's owner or an admin" in theirs.stderr, theirs.stderr
            entry = json.loads(theirs.stdout)["jobs"][0]
            assert entry["job_id"] == job_id and "(forbidden)" in entry["error"], entry
            assert not entry.get("ranks") and not entry.get("events") and not entry.get("user"), entry
        # ...and steers nothing: no migration, no dump of its ranks, no drain, no drill on its nodes.
        moved = tpassctl("migrate", str(job_id), "--node", node, user=intruder)
        assert moved.returncode != 0 and f"does not own job {job_id}" in moved.stderr, moved.stderr
        dump = _tpassd_request(cluster, intruder, node, "tpassd.snapshot", {"job_id": job_id, "rank": 0, "op": "dump"})
        assert not dump["ok"] and dump["code"] == "forbidden", dump
        drain = _tpassd_request(cluster, intruder, node, "tpassd.drain",
                                {"job_id": job_id, "reason": "torchpass: not yours"})
        assert not drain["ok"] and drain["code"] == "forbidden", drain
        drill = tpassctl("inject", "--node", node, "--fault", "ecc-sbe-storm", user=intruder)
        assert drill.returncode != 0 and "(forbidden)" in drill.stderr, drill.stderr
        assert "permission denied" in scancel(job_id, user=intruder).stderr

        assert client().job(job_id).state == "RUNNING"
        assert not _node(node).drained and not _node(node).reason, _node(node)
        events = json.loads(tpassctl("events", str(job_id), "--json", user=owner).stdout)
        assert not [e for e in json.dumps(events).split('"') if e.startswith("migration.")], events
        health = tpassctl("nodes", "--json", user=owner)
        assert {n["node"]: n["state"] for n in json.loads(health.stdout)["nodes"]}[node] == "healthy"
    finally:
        scancel(job_id, user=owner)
    assert wait_job(job_id, timeout_s=60).state == "CANCELLED"
    # Leave the nodes free for the next test: the job's nodes are released after COMPLETING.
    deadline = time.monotonic() + 60
    while squeue("-h", "-j", str(job_id), "-o", "%T").stdout.strip() and time.monotonic() < deadline:
        time.sleep(0.3)
