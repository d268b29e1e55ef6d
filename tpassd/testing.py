"""Helpers for tests and benchmarks: a private munged, an in-process tpassd
with the fake provider and a fixture IB tree, a munge-authenticated client."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from torchpass import auth, zmqio
from torchpass.errors import DependencyError
from tpassd.config import TpassdConfig
from tpassd.drills import write_fixture_tree


class MungeDaemon:
    """munged on a private socket with a throwaway key (stopped by PID)."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.socket = str(self.dir / "munge.socket.2")
        self.proc: subprocess.Popen | None = None

    def start(self) -> MungeDaemon:
        munged = shutil.which("munged") or "/usr/sbin/munged"
        if not os.path.exists(munged):
            raise DependencyError("munged is not installed; apt-get install munge")
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o755)
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        self.proc = subprocess.Popen(
            [munged, "-F", "--force", f"--socket={self.socket}", f"--key-file={key}",
             f"--pid-file={self.dir / 'munged.pid'}", f"--seed-file={self.dir / 'munged.seed'}",
             f"--log-file={self.dir / 'munged.log'}"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                auth.verify(auth.make_credential(b"ping", self.socket), b"ping", self.socket)
                return self
            except DependencyError:
                time.sleep(0.02)
        self.stop()
        raise DependencyError(f"munged did not come up on {self.socket}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def __enter__(self) -> MungeDaemon:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def fake_node_config(tmp: Path, node: str = "node1", munge_socket: str = "", **over: Any) -> TpassdConfig:
    """A config for a tpassd on 127.0.0.1 with ephemeral ports, 8 fake GPUs, 4 fixture IB ports,
    and no sweep (it would ask this machine's Slurm about the test's job ids; pass sweep_interval_s)."""
    sysfs = tmp / "sys"
    write_fixture_tree(sysfs)
    for d in ("state", "snapshots"):
        (tmp / d).mkdir(parents=True, exist_ok=True)
    cfg = TpassdConfig(node_name=node, bind_address="127.0.0.1", pub_port=0, control_port=0, metrics_port=0,
                       nvml_provider="fake", sysfs_root=sysfs, state_dir=tmp / "state",
                       snapshot_dir=tmp / "snapshots", munge_socket=munge_socket, drills=True, sweep_interval_s=0)
    return replace(cfg, **over) if over else cfg


def call(endpoint: str, node: str, type_: str, body: dict | None = None, munge_socket: str | None = None,
         timeout_s: float = 2.0, retries: int = 1) -> dict:
    """A munge-authenticated request to a tpassd control endpoint."""
    return zmqio.request(endpoint, type_, body or {}, timeout_s=timeout_s, retries=retries,
                         auth=auth.credential_for(type_, body or {}, node, munge_socket))


@contextlib.contextmanager
def private_munged():
    """A MungeDaemon under /tmp in a 0755 directory (other uids can reach it); removed after."""
    d = tempfile.mkdtemp(prefix="tpass-munge-", dir="/tmp")
    os.chmod(d, 0o755)
    try:
        with MungeDaemon(Path(d) / "m") as m:
            yield m
    finally:
        shutil.rmtree(d, ignore_errors=True)


def wait_for(pred, timeout: float = 5.0, what: str = "", poll_s: float = 0.01) -> bool:
    """Poll ``pred`` until it is true (True) or ``timeout`` seconds pass: False, or, when ``what``
    says what was awaited, AssertionError naming it."""
    end = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() >= end:
            if what:
                raise AssertionError(f"{what}: not within {timeout:g} s")
            return False
        time.sleep(poll_s)


def credential_as(uid: int, gid: int, payload: bytes, socket: str) -> str:
    """A munge credential made by another user (via setpriv), for authorisation tests."""
    out = subprocess.run([shutil.which("setpriv") or "setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                          shutil.which("munge") or "munge", "--socket", socket, "-s", payload.decode()],
                         capture_output=True, text=True, check=True, timeout=10)
    return out.stdout.strip()


def flood_frames() -> list[bytes]:
    """Two maximum-size frames (wire.MAX_FRAME_BYTES): a well-formed request with a forged
    credential, and garbage."""
    from torchpass import wire

    pad = "x" * (wire.MAX_FRAME_BYTES - 4096)
    forged = wire.encode("tpassd.snapshot", {"op": "dump", "job_id": 1, "rank": 0, "rank_dir": pad},
                         auth="MUNGE:forged:")
    return [forged[:wire.MAX_FRAME_BYTES], b"{" + b"9" * (wire.MAX_FRAME_BYTES - 1)]


def flood(endpoint: str, peers: int, seconds: float) -> int:
    """A bounded flood of a control socket: ``peers`` DEALER sockets on their own context, each
    sending flood_frames() without reading a reply, for ``seconds``; none authenticates. The
    number of frames sent."""
    import zmq

    ctx = zmq.Context(io_threads=2)
    ctx.setsockopt(zmq.MAX_SOCKETS, peers + 16)
    socks = []
    try:
        for _ in range(peers):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 4)
            s.connect(endpoint)
            socks.append(s)
        frames = flood_frames()
        sent = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            progress = False
            for i, s in enumerate(socks):
                try:
                    s.send_multipart([b"", frames[i % 2]], zmq.NOBLOCK, copy=False)
                    sent += 1
                    progress = True
                except zmq.Again:
                    pass
                try:
                    while s.poll(0):
                        s.recv_multipart(zmq.NOBLOCK)  # replies dropped unread
                except zmq.ZMQError:
                    pass
            if not progress:
                time.sleep(0.01)
        return sent
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()
