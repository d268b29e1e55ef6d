"""Limits that keep one user from starving tpassd or steering its health view, each driven
through the entry point a user reaches: a tpassd request, a socket, a directory users write."""

from __future__ import annotations

import os
from collections import namedtuple

from structlog.testing import capture_logs

from tpassd.collectors.base import run_collector
from tpassd.collectors.host import HostCollector, user_writable
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
    import pytest

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
