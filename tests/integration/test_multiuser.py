"""Two ordinary users on one devcluster (PrivateData=jobs): tpuser2 can neither
see nor steer tpuser1's --torchpass job, while it runs and after it ended. The
unit tests cover each check alone (test_job_auth.py, test_tpassd_daemon.py,
test_checkpoint_service.py, test_migrate_admin_drain.py, test_job_privacy.py);
here the real programs answer requests made with the real users' munge
credentials, the real plugin makes the job's state directory, and the owner's
own requests are the control.
"""

from __future__ import annotations

import json
import pwd
import re
import stat
import subprocess
import time

import pytest

from slurm_helpers import job_id_of, job_python, sbatch, scancel, squeue, submit_env, tpassctl, wait_job, wait_running
from torchpass import layout
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


def _tpassd_request(cluster, user: str, node: str, type_: str, body: dict, endpoint: str | None = None) -> dict:
    args = json.dumps([type_, body, node, endpoint or f"tcp://{cluster.node_address(node)}:{TPASSD_CONTROL_PORT}",
                       str(cluster.munge_socket)])
    out = subprocess.run(["runuser", "-u", user, "--", job_python(), "-c", _TPASSD_REQUEST, args],
                         capture_output=True, text=True, timeout=60, cwd="/", env=submit_env(user))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


# Run by the job Python as a user: open() each path; prints the errno names (or "ok").
_OPEN_EACH = """
import errno, json, sys
out = []
for p in json.loads(sys.argv[1]):
    try:
        open(p, "rb").close()
        out.append("ok")
    except OSError as e:
        out.append(errno.errorcode[e.errno])
print(json.dumps(out))
"""


def _open_each(user: str, paths: list[str]) -> list[str]:
    out = subprocess.run(["runuser", "-u", user, "--", job_python(), "-c", _OPEN_EACH, json.dumps(paths)],
                         capture_output=True, text=True, timeout=60, cwd="/", env=submit_env(user))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _refusal(cluster, job_id: int) -> str:
    """tpassctl's one line for a job the caller may not see (tpassctl/status_cmd.py, not_visible; exit 4)."""
    return (f"Error: job {job_id}: no torchpass job of yours with this id in {cluster.state_dir} (only its owner "
            "or an admin can see a job; check the id and --state-dir)\n")


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
        while ((mine := tpassctl("status", str(job_id), "--json", user=owner)).returncode != 0
               or json.loads(mine.stdout)["jobs"][0]["state"] != "running") and time.monotonic() < deadline:
            time.sleep(0.3)
        assert mine.returncode == 0, mine.stderr
        assert json.loads(mine.stdout)["jobs"][0]["job_id"] == job_id
        assert tpassctl("events", str(job_id), "--json", user=owner).returncode == 0
        node = client().job(job_id).batch_host  # runs the coordinator and a task of the job

        # Another user sees nothing of it: the line a job id with no job gets (a script sees exit 4:
        # not found; under --json the same line as the error's message)...
        for what in ("status", "events"):
            theirs = tpassctl(what, str(job_id), "--json", user=intruder)
            error = {"code": "not_found", "message": _refusal(cluster, job_id).removeprefix("Error: ").rstrip("\n")}
            assert (theirs.returncode, json.loads(theirs.stdout), theirs.stderr) == (4, {"error": error}, ""), theirs
        # ...and steers nothing: no migration (tpassctl cannot find the coordinator; asked
        # directly, the coordinator refuses), no dump of its ranks, no drain, no drill on its nodes.
        moved = tpassctl("migrate", str(job_id), "--node", node, user=intruder)
        assert (moved.returncode, moved.stderr) == (4, _refusal(cluster, job_id)), moved
        endpoint = json.loads(layout.coordinator_json(cluster.state_dir, job_id).read_text())["endpoint"]
        asked = _tpassd_request(cluster, intruder, f"job:{job_id}", "job.migrate", {"node": node}, endpoint=endpoint)
        assert not asked["ok"] and asked["code"] == "forbidden" and f"does not own job {job_id}" in asked["message"], \
            asked
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
    _an_ended_job_stays_private(cluster, job_id, owner, intruder)
    # Leave the nodes free for the next test: the job's nodes are released after COMPLETING.
    deadline = time.monotonic() + 60
    while squeue("-h", "-j", str(job_id), "-o", "%T").stdout.strip() and time.monotonic() < deadline:
        time.sleep(0.3)


def _an_ended_job_stays_private(cluster, job_id: int, owner: str, intruder: str) -> None:
    """After the job ended: its directory is the owner's, group SlurmUser's, 2750 (the plugin made
    it so), and tpuser2 reads none of its events, log or rank records, neither with tpassctl nor
    with open(); tpuser1 reads them all (the control)."""
    jdir = layout.job_dir(cluster.state_dir, job_id)
    # A clean stop on the plugin's SIGTERM, not its SIGKILL stop_timeout (5 s) later: the last line
    # the coordinator logs comes after its events are saved, its metrics pushed and its health
    # link closed (up to 1.5 s after "coordinator stopping"), and never after a SIGKILL.
    log_path = layout.coordinator_log(cluster.state_dir, job_id)
    deadline = time.monotonic() + 30
    while '"coordinator stopped"' not in (log := log_path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert '"coordinator stopped"' in log, log
    assert layout.events_json(cluster.state_dir, job_id).exists()
    slurm_user = re.search(r"^SlurmUser=(\S+)", cluster.slurm_conf.read_text(), re.M).group(1)
    st = jdir.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (
        pwd.getpwnam(owner).pw_uid, pwd.getpwnam(slurm_user).pw_gid, layout.JOB_DIR_MODE), (st, oct(st.st_mode))
    ranks = sorted(str(p) for p in layout.rank_records_dir(cluster.state_dir, job_id).rglob("*") if p.is_file())
    paths = [str(layout.events_json(cluster.state_dir, job_id)), str(layout.coordinator_log(cluster.state_dir, job_id)),
             *ranks]
    assert ranks, f"no rank records under {jdir}"
    assert _open_each(intruder, paths) == ["EACCES"] * len(paths)
    assert _open_each(owner, paths) == ["ok"] * len(paths)
    for what in ("status", "events"):
        for job in (job_id, job_id + 100000):  # the job, and one that never was: the same line
            theirs = tpassctl(what, str(job), "--json", user=intruder)
            error = {"code": "not_found", "message": _refusal(cluster, job).removeprefix("Error: ").rstrip("\n")}
            assert (theirs.returncode, json.loads(theirs.stdout), theirs.stderr) == (4, {"error": error}, ""), theirs
    mine = tpassctl("events", str(job_id), "--json", user=owner)
    assert mine.returncode == 0 and json.loads(mine.stdout)["jobs"][0]["events"], mine.stderr
