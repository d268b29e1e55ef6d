"""tpassd under systemd, played by this test: a stand-in NOTIFY_SOCKET (a unix datagram socket
bound here, as systemd binds its own), SIGHUP, and a JOURNAL_STREAM naming tpassd's stdout.

The tpassd program runs as the devcluster starts it (torchpass/devcluster/tpassd_node.py):
under setpriv with the unit's capability bounding set."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from torchpass.devcluster.tpassd_node import start_args
from tpassd.daemon import Tpassd
from tpassd.main import Signals, serve
from tpassd.sd_notify import Notifier
from tpassd.testing import call, fake_node_config, wait_for


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture
def notify(tmp_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(tmp_path / "notify"))
    yield s
    s.close()


class Program:
    """A tpassd program on 127.0.0.1, its stdout in a file (journald's stream when ``journal``)."""

    def __init__(self, tmp: Path, munge_socket: str, env: dict[str, str], journal: bool = False):
        self.ports = free_ports(3)
        self.dir = tmp / "node"
        self.argv = start_args("node1", "127.0.0.1", self.dir, Path(munge_socket), interval_s=1.0,
                               ports=tuple(self.ports))
        self.policy = self.dir / "policy.toml"
        self.log = tmp / "tpassd.log"
        self.munge_socket = munge_socket
        with open(self.log, "wb") as out:
            if journal:
                st = os.fstat(out.fileno())
                env = {**env, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, **env})

    def health(self) -> dict:
        return call(f"tcp://127.0.0.1:{self.ports[1]}", "node1", "tpassd.health", {},
                    munge_socket=self.munge_socket, timeout_s=5)

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def first_message(prog: Program, sock: socket.socket, timeout_s: float = 60) -> dict[str, str]:
    """The first sd_notify message; AssertionError with tpassd's output when it exits first."""
    end = time.monotonic() + timeout_s
    sock.settimeout(0.2)
    while time.monotonic() < end:
        try:
            return dict(line.split("=", 1) for line in sock.recv(4096).decode().splitlines())
        except TimeoutError:
            assert prog.proc.poll() is None, f"tpassd exited {prog.proc.returncode}: {prog.log.read_text()}"
    raise AssertionError(f"no sd_notify message in {timeout_s} s: {prog.log.read_text()}")


def messages(sock: socket.socket, timeout_s: float) -> list[dict[str, str]]:
    """The sd_notify messages that arrive within ``timeout_s``."""
    out = []
    end = time.monotonic() + timeout_s
    while (left := end - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data = sock.recv(4096).decode()
        except TimeoutError:
            break
        out.append(dict(line.split("=", 1) for line in data.splitlines()))
    return out


def test_ready_comes_only_once_every_socket_accepts(tmp_path, munge, notify):
    prog = Program(tmp_path, munge.socket, {"NOTIFY_SOCKET": notify.getsockname()})
    try:
        first = first_message(prog, notify)
        # At the instant READY=1 arrives, each port accepts a connection (refused before its bind).
        for port in prog.ports:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        assert first["READY"] == "1", first
        assert first["STATUS"] == f"serving node1: pub {prog.ports[0]}, control {prog.ports[1]}, " \
                                  f"metrics {prog.ports[2]}"
        assert prog.health()["node"] == "node1"  # the control thread answers
        # no other message while it runs (no watchdog asked for: no WATCHDOG_USEC)
        assert messages(notify, 0.5) == []
        assert prog.stop() == 0
        assert messages(notify, 1) == [{"STOPPING": "1"}]
    finally:
        if prog.proc.poll() is None:
            prog.stop()


def test_a_bad_config_exits_2_before_ready(tmp_path, munge, notify):
    """RestartPreventExitStatus=2: a config error is not restarted; no READY=1 came."""
    argv = start_args("node1", "127.0.0.1", tmp_path / "node", Path(munge.socket), ports=tuple(free_ports(3)))
    (tmp_path / "node" / "policy.toml").write_text("[host]\nno_such_key = 1\n")
    env = {**os.environ, "NOTIFY_SOCKET": notify.getsockname()}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and "no_such_key" in out.stderr
    assert messages(notify, 0.3) == []


def test_sighup_keeps_the_policy_in_force_when_the_file_is_invalid_and_applies_a_valid_one(tmp_path, munge,
                                                                                           notify):
    prog = Program(tmp_path, munge.socket, {"NOTIFY_SOCKET": notify.getsockname()}, journal=True)
    try:
        assert first_message(prog, notify)["READY"] == "1"
        wait_for(lambda: prog.health()["state"] == "healthy", 10, "healthy under the start's policy")
        prog.policy.write_text("[host]\ndisk_free_gb_degraded = 1e9\nno_such_key = 1\n")
        prog.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: any("policy not reloaded" in ln for ln in prog.lines()), 10, "the reload's error")
        time.sleep(2.5)  # two samples under whatever policy is in force now
        assert prog.health()["state"] == "healthy"
        errors = [ln for ln in prog.lines() if ln.startswith("<3>")]
        assert len(errors) == 1, errors
        err = json.loads(errors[0][3:])
        assert err["event"].startswith("policy not reloaded") and "no_such_key" in err["error"]
        assert [m.get("RELOADING") for m in messages(notify, 0.5)][:1] == ["1"]
        # Valid now: 1e9 GB free wanted, which no disk has: the node is degraded at the next sample.
        prog.policy.write_text("[host]\ndisk_free_gb_degraded = 1e9\n")
        prog.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: prog.health()["state"] == "degraded", 10, "degraded under the reloaded policy")
        assert any("GB free" in r and "threshold 1e+09 GB" in r for r in prog.health()["reasons"])
        reloaded = [json.loads(ln[3:]) for ln in prog.lines() if '"policy reloaded"' in ln]
        assert reloaded and reloaded[0]["changed"] == ["host.disk_free_gb_degraded"]
        assert all(ln[:3] in ("<3>", "<4>", "<6>") for ln in prog.lines()), prog.lines()
        assert prog.proc.poll() is None
    finally:
        assert prog.stop() == 0


def test_no_watchdog_ping_once_sampling_is_blocked(tmp_path, munge, notify):
    """A sampler stuck inside a tick (here: the tick's own callback waits) stops the pings; the
    control thread still answers, which alone would not keep systemd's watchdog fed."""
    held = threading.Event()
    release = threading.Event()

    def on_tick(sample):
        if held.is_set():
            release.wait(30)

    cfg = fake_node_config(tmp_path, "node1", munge.socket, interval_s=0.1, collector_timeout_s=0.05,
                           metrics_port=-1)
    daemon = Tpassd(cfg, on_tick=on_tick)
    signals = Signals()
    t = threading.Thread(target=serve, args=(daemon, signals, Notifier(notify.getsockname()), 0.4))
    t.start()
    try:
        assert messages(notify, 1.0)[0]["READY"] == "1"
        assert len([m for m in messages(notify, 1.0) if m == {"WATCHDOG": "1"}]) >= 4  # every 0.2 s
        held.set()
        time.sleep(0.6)  # the next tick blocks; stale after 2 * 0.1 + 0.05 s, seen within a ping period
        messages(notify, 0.01)  # the pings queued before: sent while samples still flowed
        assert [m for m in messages(notify, 1.5) if "WATCHDOG" in m] == []
        control = f"tcp://127.0.0.1:{daemon.ports()['control_port']}"
        assert call(control, "node1", "tpassd.health", {}, munge_socket=munge.socket)["node"] == "node1"
        release.set()
        held.clear()
        assert len([m for m in messages(notify, 1.0) if m == {"WATCHDOG": "1"}]) >= 3  # samples flow again
    finally:
        release.set()
        signals.stop = True
        t.join(15)
    assert not t.is_alive()
