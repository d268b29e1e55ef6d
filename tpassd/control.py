"""tpassd's control endpoint: a ROUTER socket served by one thread.

Every request must carry a munge credential bound to the request
(torchpass.auth.request_digest(type, body, node)); a forged, expired,
replayed or missing credential gets an ``unauthenticated`` error reply and a
log line. Each handler declares who may call it:

  USER   any authenticated uid (read-only: health, status)
  OWNER  root, or the owner of a Slurm job running on this node (drills;
         later snapshot/restore)
  ROOT   root only

Adding a request type is one line: ``server.register(type, fn, access)``
with ``fn(msg, identity) -> dict``. Malformed frames get an error reply (or
are dropped when there is no one to reply to) and are counted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import structlog
import zmq

from torchpass import auth, wire, zmqio
from torchpass.errors import AuthError

log = structlog.get_logger("tpassd.control")

USER, OWNER, ROOT = "user", "owner", "root"

ControlHandler = Callable[[wire.Message, auth.Identity], dict[str, Any] | None]


class Authenticator:
    """munge by default; tests may pass another object with the same ``identify``."""

    def __init__(self, node: str, munge_socket: str | None):
        self.node = node
        self.socket = munge_socket or None

    def identify(self, msg: wire.Message) -> auth.Identity:
        return auth.verify(msg.auth, auth.request_digest(msg.type, msg.body, self.node), self.socket)


class ControlServer:
    def __init__(self, ctx: zmq.Context, address: str, port: int, authenticator: Authenticator,
                 job_owner_uids: Callable[[], set[int]] | None = None):
        self.sock, self.port = zmqio.bind_router(ctx, address, port)
        self._auth = authenticator
        self._job_owner_uids = job_owner_uids or (lambda: set())
        self._handlers: dict[str, Callable[[wire.Message], dict[str, Any] | None]] = {}
        self.counters: dict[str, int] = {"requests": 0, "malformed": 0, "auth_failed": 0, "dropped": 0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def register(self, type_: str, fn: ControlHandler, access: str) -> None:
        if type_ not in wire.BODIES:
            raise ValueError(f"{type_} is not in torchpass.wire.BODIES")
        if access not in (USER, OWNER, ROOT):
            raise ValueError(f"unknown access level {access!r}")

        def handler(msg: wire.Message) -> dict[str, Any] | None:
            try:
                ident = self._auth.identify(msg)
            except AuthError as exc:
                log.warning("unauthenticated request refused", type=msg.type, id=msg.id, error=str(exc))
                raise
            self._authorize(msg, ident, access)
            return fn(msg, ident)

        self._handlers[type_] = handler

    def _authorize(self, msg: wire.Message, ident: auth.Identity, access: str) -> None:
        if access == USER or ident.uid == 0:
            return
        if access == OWNER and ident.uid in self._job_owner_uids():
            return
        who = "root" if access == ROOT else "root or the owner of a job on this node"
        log.warning("forbidden request refused", type=msg.type, uid=ident.uid, gid=ident.gid)
        raise auth.AuthFailure("forbidden", f"{msg.type} needs {who}; uid {ident.uid} is neither")

    def handle(self, frame: bytes) -> bytes:
        """One request frame -> one reply frame (also the fuzz tests' entry point)."""
        self.counters["requests"] += 1
        return zmqio.handle_frame(frame, self._handlers, counters=self.counters)

    def serve_once(self, timeout_ms: int = 100) -> bool:
        if not self.sock.poll(timeout_ms, zmq.POLLIN):
            return False
        try:
            parts = self.sock.recv_multipart()
        except zmq.ZMQError:
            return False
        if len(parts) < 3 or parts[-2] != b"":
            self.counters["dropped"] += 1
            return True
        reply = self.handle(parts[-1])
        try:
            self.sock.send_multipart(parts[:-1] + [reply], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            self.counters["dropped"] += 1
        return True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tpassd-control", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.serve_once(100)
            except Exception:  # noqa: BLE001 - never let the control thread die
                log.exception("control loop error")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.sock.close(linger=0)
