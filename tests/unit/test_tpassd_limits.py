"""Limits that keep one user from starving tpassd or steering its health view, each driven
through the entry point a user reaches: a tpassd request, a socket, a directory users write."""

from __future__ import annotations

import os
from collections import namedtuple
from pathlib import Path

from structlog.testing import capture_logs

from tpassd.collectors.base import run_collector
from tpassd.collectors.host import HostCollector
from tpassd.daemon import Tpassd
from tpassd.testing import fake_node_config, wait_for

DU = namedtuple("DU", "total used free percent")


def test_disk_health_never_watches_a_directory_users_can_write(tmp_path, munge):
    """A shared state_dir is world-writable (users' jobs/J live there): a user filling it must not
    turn every node degraded. tpassd watches snapshot_dir (root's), not state_dir."""
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o1777)  # as a shared state_dir is
    d = Tpassd(fake_node_config(tmp_path, "node1", munge.socket, interval_s=0.2, collector_timeout_s=0.15,
                                state_dir=state),
               job_owner_uids=lambda: set(), admin_uids=lambda: frozenset({0}))
    with d:
        assert wait_for(lambda: d.last_sample is not None)
        host = d.last_sample["components"]["host"]["metrics"]
        watched = {v for k, v in host.items() if k.endswith(".path")}
    assert str(state) not in watched
    assert str(tmp_path / "snapshots") in watched


def test_a_configured_disk_path_users_can_write_is_ignored_with_one_log_line(tmp_path):
    from tpassd.collectors.host import user_writable

    mine = tmp_path / "root-only"
    mine.mkdir(mode=0o755)
    theirs = tmp_path / "users"
    theirs.mkdir()
    os.chmod(theirs, 0o777)
    owned = tmp_path / "owned"
    owned.mkdir()
    os.chown(owned, 65534, 65534)
    assert user_writable(mine) is None
    assert "writable by everyone" in user_writable(theirs)
    assert "uid 65534" in user_writable(owned)
    # every one would be degraded (0 bytes free) if it were watched
    c = HostCollector([mine, theirs, owned], disk_usage=lambda p: DU(100, 100, 0, 100.0))
    with capture_logs() as logs:
        for _ in range(3):
            r = run_collector(c, 0.0)
    paths = {v for k, v in r.components["host"].metrics.items() if k.endswith(".path")}
    assert paths == {str(mine)}
    ignored = [e for e in logs if e["event"].startswith("disk free space not watched")]
    assert sorted(e["path"] for e in ignored) == sorted([str(theirs), str(owned)])  # once each, not per sample


def test_a_criu_its_owner_stops_is_killed_within_seconds(tmp_path):
    """A user's dump runs criu as the user, who may SIGSTOP it: that must cost a tpassd worker
    seconds, not the dump's 600 s timeout. run_criu is called directly with a stand-in criu (a real
    process, run with the owner's ids through setpriv as for a dump): a real rank and CRIU add
    nothing to what is tested, how a stopped child of run_criu is noticed."""
    import subprocess
    import tempfile
    import threading
    import time

    import psutil

    from torchpass.checkpoint import criu as criu_mod
    from torchpass.errors import CheckpointError

    d = tempfile.mkdtemp(prefix="tpass-stopped-criu-", dir="/tmp")
    try:
        os.chmod(d, 0o755)
        stand_in = os.path.join(d, "criu")
        with open(stand_in, "w") as f:
            f.write("#!/bin/sh\nexec sleep 120\n")
        os.chmod(stand_in, 0o755)
        creds = criu_mod.Creds(uid=1001, gid=1001, groups=(), caps=("kill",))
        got: dict = {}

        def dump():
            t0 = time.monotonic()
            try:
                criu_mod.run_criu(criu_mod.Criu(stand_in, (4, 0)), ["dump"], 120.0, "criu dump of rank 0",
                                  "the rank keeps running", creds=creds)
            except BaseException as exc:  # noqa: BLE001 - examined below
                got["error"] = exc
            got["took"] = time.monotonic() - t0

        t = threading.Thread(target=dump, daemon=True)
        t.start()
        me = psutil.Process()

        def child():
            return next((c for c in me.children() if c.uids().real == 1001 and c.name() == "sleep"), None)

        assert wait_for(lambda: child() is not None, timeout=10)
        pid = child().pid
        # the owner stops their own criu, as any user may signal their own processes
        subprocess.run(["runuser", "-u", "tpuser1", "--", "kill", "-STOP", str(pid)], check=True, timeout=10)
        t.join(timeout=20)
        assert not t.is_alive(), "run_criu still waits for a stopped criu after 20 s"
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert isinstance(got["error"], CheckpointError) and got["took"] < 15
        msg = str(got["error"])
        assert "criu dump of rank 0 was stopped" in msg and "killed" in msg and "\n" not in msg
    finally:
        import shutil
        shutil.rmtree(d, ignore_errors=True)


def test_idle_metrics_connections_neither_grow_threads_nor_block_a_scrape(tmp_path, munge):
    """Connections that send nothing used to cost a thread each (200 gave 202). Now: no new
    thread at all, at most the cap open at once, each closed after its time limit; a normal
    scrape among them is answered."""
    import socket
    import threading
    import time
    import urllib.request

    d = Tpassd(fake_node_config(tmp_path, "node1", munge.socket, interval_s=0.2, collector_timeout_s=0.15),
               job_owner_uids=lambda: set(), admin_uids=lambda: frozenset({0}))
    with d:
        assert wait_for(lambda: d.last_sample is not None)
        port = d.ports()["metrics_port"]
        url = f"http://127.0.0.1:{port}/metrics"
        assert "tpassd_" in urllib.request.urlopen(url, timeout=5).read().decode()
        before = threading.active_count()
        idle = []
        try:
            for _ in range(200):
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                idle.append(s)
            time.sleep(0.5)
            assert threading.active_count() <= before, (before, threading.active_count())
            assert d.metrics.open_connections() <= d.metrics.max_connections
            t0 = time.monotonic()
            assert "tpassd_" in urllib.request.urlopen(url, timeout=5).read().decode()
            assert time.monotonic() - t0 < 2
            print(f"\nmetrics: 200 idle connections: threads {before} -> {threading.active_count()}, "
                  f"open {d.metrics.open_connections()} (cap {d.metrics.max_connections})")
        finally:
            for s in idle:
                s.close()
    # a connection idle past the time limit is closed by tpassd
    from tpassd.metrics import MetricsServer
    d2 = MetricsServer("127.0.0.1", 0, lambda: "x 1\n", timeout_s=0.5)
    d2.start()
    try:
        s = socket.create_connection(("127.0.0.1", d2.port), timeout=5)
        assert s.recv(1) == b""  # closed by the server after 0.5 s
        s.close()
    finally:
        d2.close()


def _rss_kb(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k in ("VmRSS", "VmHWM")}


def test_1000_unauthenticated_peers_sending_maximum_frames_keep_tpassd_under_its_memory_max(tmp_path, munge):
    """A real tpassd process on 127.0.0.1; 1,000 peers that never authenticate each send 1 MiB
    frames (the frame-size limit) for a bounded time. tpassd's peak RSS must stay under the unit's
    MemoryMax (contrib/systemd/tpassd.service: 256M), and it still answers afterwards. Before:
    ZeroMQ queued 1,000 frames per peer, and the peak was 1.8 GB."""
    import json
    import subprocess
    import sys
    import threading
    import time

    from tpassd.testing import call, flood

    unit = (Path(__file__).resolve().parents[2] / "contrib" / "systemd" / "tpassd.service").read_text()
    memory_max_kb = int(next(line for line in unit.splitlines() if line.startswith("MemoryMax=")
                             ).split("=")[1].rstrip("M")) * 1024
    for d in ("state", "snap"):
        (tmp_path / d).mkdir()
    ports = tmp_path / "ports.json"
    (tmp_path / "tpassd.toml").write_text(
        f'node_name = "memnode"\nbind_address = "127.0.0.1"\npub_port = 0\ncontrol_port = 0\nmetrics_port = -1\n'
        f'nvml_provider = "fake"\nstate_dir = "{tmp_path}/state"\nsnapshot_dir = "{tmp_path}/snap"\n'
        f'sweep_interval_s = 0\nports_file = "{ports}"\nmunge_socket = "{munge.socket}"\n')
    p = subprocess.Popen([sys.executable, "-m", "tpassd.main", "--config", str(tmp_path / "tpassd.toml")],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: ports.exists(), timeout=30)
        ctl = f"tcp://127.0.0.1:{json.loads(ports.read_text())['control_port']}"
        assert call(ctl, "memnode", "tpassd.health", munge_socket=munge.socket, timeout_s=5)["node"] == "memnode"
        before = _rss_kb(p.pid)["VmRSS"]
        peak = [before]
        done = threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], _rss_kb(p.pid)["VmRSS"])
                time.sleep(0.05)

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        sent = flood(ctl, 1000, 8.0)
        done.set()
        t.join(2)
        hwm = _rss_kb(p.pid)["VmHWM"]
        print(f"\nflood: 1000 peers, {sent} frames of 1 MiB sent in 8 s; tpassd RSS {before} kB before, "
              f"peak {max(peak[0], hwm)} kB (VmHWM {hwm} kB), MemoryMax {memory_max_kb} kB")
        assert max(peak[0], hwm) < memory_max_kb
        assert call(ctl, "memnode", "tpassd.health", munge_socket=munge.socket, timeout_s=5, retries=3)
        assert p.poll() is None
    finally:
        p.terminate()
        p.wait(10)


def _owners(owners: dict[int, int]):
    """slurmctld's word on job owners (job -> uid), each question counted; the drain itself is
    never reached here."""
    from support.fake_slurm import FakeSlurm

    slurm = FakeSlurm()
    for job_id, uid in owners.items():
        slurm.run_job(job_id, user=f"u{uid}", uid=uid, nodes=("node1",))
    return slurm


def _node(tmp_path, munge, slurm, **over):
    return Tpassd(fake_node_config(tmp_path, "node1", munge.socket, interval_s=0.2, collector_timeout_s=0.15, **over),
                  job_owner_uids=lambda: set(), slurm_client=slurm, admin_uids=lambda: frozenset({0}))


def _as(uid, type_, body, munge):
    from torchpass import auth
    from tpassd.testing import credential_as

    return credential_as(uid, uid, auth.request_digest(type_, body, "node1"), munge.socket)


def test_refused_and_unauthenticated_requests_cost_no_slurm_work_and_leave_one_audit_line(tmp_path, munge):
    """A request with no valid credential is refused before any Slurm call; one for another user's
    job costs one owner lookup, cached per job (a flood of them asks slurmctld once), and never a
    scontrol listpids; each refusal leaves one tpassd.audit line naming uid, job and action."""
    import pytest

    from torchpass import zmqio
    from torchpass.errors import RemoteError

    slurm = _owners({7: 1001})
    d = _node(tmp_path, munge, slurm)
    listed: list[int] = []
    with d:
        d.checkpoint.job_pids = lambda j: listed.append(j) or set()
        # the handlers' own owner question goes to the same counted Slurm
        d.checkpoint.job_owner = lambda j: (lambda info: None if info is None else info.user_id)(slurm.job(j))
        ctl = f"tcp://127.0.0.1:{d.ports()['control_port']}"
        body = {"job_id": 7, "rank": 0, "op": "kill", "pid": 1}
        with capture_logs() as logs:
            for cred in (None, "MUNGE:forged:"):
                with pytest.raises(RemoteError) as ei:
                    zmqio.request(ctl, "tpassd.snapshot", body, auth=cred, timeout_s=5, retries=0)
                assert ei.value.code == "unauthenticated"
            for _ in range(20):
                with pytest.raises(RemoteError) as ei:
                    zmqio.request(ctl, "tpassd.snapshot", body, auth=_as(1002, "tpassd.snapshot", body, munge),
                                  timeout_s=5, retries=0)
                assert ei.value.code == "forbidden" and "uid 1002 does not own job 7" in ei.value.remote_message
    assert slurm.calls_of("job") == [(7,)], slurm.calls  # asked once for 20 requests: cached per job
    assert listed == []
    audit = [e for e in logs if e["event"] == "privileged action"]
    assert [(a["requester_uid"], a["job_id"], a["action"], a["outcome"]) for a in audit] == (
        [(None, 7, "snapshot.kill", "unauthenticated")] * 2 + [(1002, 7, "snapshot.kill", "forbidden")] * 20)


def test_a_uid_may_have_requests_of_two_jobs_in_flight_and_a_jobs_ranks_count_as_one(tmp_path, munge):
    """User 1001 holds requests of two jobs (ranks 0..3 of job 7, all running side by side: one
    job) and job 8; a request for a third job is refused at once with one line, while another
    user's request still runs. Every refusal is audited."""
    import threading

    import pytest

    from torchpass import zmqio
    from torchpass.errors import RemoteError
    from tpassd.control import USER

    slurm = _owners({7: 1001, 8: 1001, 9: 1001, 10: 1002})
    d = _node(tmp_path, munge, slurm)
    release = threading.Event()
    running: list[tuple[int, int]] = []
    lock = threading.Lock()

    def slow(msg, ident):
        with lock:
            running.append((msg.body["job_id"], msg.body["rank"]))
        release.wait(20)
        return {"job": msg.body["job_id"]}

    with d:
        d.control.register("tpassd.snapshot", slow, USER)
        ctl = f"tcp://127.0.0.1:{d.ports()['control_port']}"

        def ask(uid, job, rank, box):
            body = {"job_id": job, "rank": rank, "op": "dump"}
            try:
                box.append(zmqio.request(ctl, "tpassd.snapshot", body, timeout_s=25, retries=0,
                                         auth=_as(uid, "tpassd.snapshot", body, munge)))
            except RemoteError as exc:
                box.append(exc)

        boxes, threads = [], []
        for job, rank in [(7, 0), (7, 1), (7, 2), (7, 3), (8, 0)]:
            box: list = []
            t = threading.Thread(target=ask, args=(1001, job, rank, box), daemon=True)
            t.start()
            boxes.append(box)
            threads.append(t)
        assert wait_for(lambda: len(running) == 5, timeout=10), running  # a node's ranks dump in parallel
        with capture_logs() as logs:
            body = {"job_id": 9, "rank": 0, "op": "dump"}
            with pytest.raises(RemoteError) as ei:
                zmqio.request(ctl, "tpassd.snapshot", body, auth=_as(1001, "tpassd.snapshot", body, munge),
                              timeout_s=5, retries=0)
        assert ei.value.code == "unavailable" and "max_jobs_per_uid" in ei.value.remote_message
        assert "\n" not in ei.value.remote_message
        audit = [e for e in logs if e["event"] == "privileged action"]
        assert [(a["requester_uid"], a["job_id"], a["outcome"]) for a in audit] == [(1001, 9, "unavailable")]
        other: list = []
        t = threading.Thread(target=ask, args=(1002, 10, 0, other), daemon=True)
        t.start()
        assert wait_for(lambda: (10, 0) in running, timeout=10)  # the other user is not starved
        release.set()
        for t in [*threads, t]:
            t.join(10)
        assert all(b and isinstance(b[0], dict) for b in [*boxes, other]), boxes
        # the limit is of jobs in flight: once answered, a third job is served
        body = {"job_id": 9, "rank": 0, "op": "dump"}
        assert zmqio.request(ctl, "tpassd.snapshot", body, auth=_as(1001, "tpassd.snapshot", body, munge),
                             timeout_s=5, retries=0) == {"job": 9}
