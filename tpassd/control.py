"""tpassd's control endpoint: a ROUTER socket whose front loop never waits on a request.

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

Concurrency (the ZeroMQ guide's ROUTER front end with worker threads). One
front thread owns the socket. It answers the ``inline`` requests itself
(health and status: no disk, no Slurm, no subprocess), and hands every other
request to a bounded pool of worker threads, each request with its own
deadline counted from its arrival. A worker's reply comes back to the front
thread through a queue and a wake-up pipe (ZeroMQ sockets are not
thread-safe), so a dump of up to 600 s, a Slurm call that hangs or a manifest
that is a FIFO never delays a health request. What a request gets instead
of waiting:

* over its deadline: a ``timeout`` error reply; the work may still finish
  (criu and scontrol have their own timeouts) and its late result is logged
  and dropped;
* a second op on a (job, rank) whose op still runs (``exclusive`` types,
  even one whose first request already timed out) waits for it and then
  runs, in arrival order, within its own deadline: an ``abort`` that the
  coordinator sends while the rank's dump still runs must land after it,
  as it did when tpassd served one request at a time (refusing it left the
  source's hand-off unmarked, and its wrapper waiting at the job's end);
* more than ``max_in_flight`` requests waiting or running: ``unavailable``.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
import zmq

from torchpass import auth, wire, zmqio
from torchpass.checkpoint.criu import DUMP_TIMEOUT_S
from torchpass.errors import AuthError, ProtocolError

log = structlog.get_logger("tpassd.control")

USER, OWNER, ROOT = "user", "owner", "root"

ControlHandler = Callable[[wire.Message, auth.Identity], dict[str, Any] | None]

DEFAULT_DEADLINE_S = 30.0  # a pooled request without its own deadline (drain, drill: two Slurm calls of 15 s)
DEFAULT_WORKERS = 8
DEFAULT_MAX_IN_FLIGHT = 64

# The requests that act on one rank: their deadline, and one op per (job, rank) at a time.
# A dump waits for criu (killed after DUMP_TIMEOUT_S) and a CUDA suspend/resume; a
# verify reads one capped manifest and stats the image files (a slow shared disk).
RANK_OPS = {
    "tpassd.snapshot": DUMP_TIMEOUT_S + 30.0,
    "tpassd.restore": 120.0,
}


class Authenticator:
    """munge by default; tests may pass another object with the same ``identify``."""

    def __init__(self, node: str, munge_socket: str | None):
        self.node = node
        self.socket = munge_socket or None

    def identify(self, msg: wire.Message) -> auth.Identity:
        return auth.verify(msg.auth, auth.request_digest(msg.type, msg.body, self.node), self.socket)


def job_rank_key(body: dict[str, Any]) -> tuple[int, int] | None:
    """The (job, rank) an op acts on; None when the body names none (the handler refuses it)."""
    j, r = body.get("job_id"), body.get("rank")
    if isinstance(j, int) and isinstance(r, int) and not isinstance(j, bool) and not isinstance(r, bool):
        return j, r
    return None


@dataclass(frozen=True)
class _Route:
    inline: bool
    deadline_s: float
    exclusive: bool


@dataclass
class _Pending:
    envelope: list[bytes]
    id: str
    type: str
    deadline: float
    started: float
    key: tuple[int, int] | None
    answered: bool = False


class ControlServer:
    def __init__(self, ctx: zmq.Context, address: str, port: int, authenticator: Authenticator,
                 job_owner_uids: Callable[[], set[int]] | None = None, *, workers: int = DEFAULT_WORKERS,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, clock: Callable[[], float] = time.monotonic):
        if not 1 <= workers <= max_in_flight:
            raise ValueError(f"need 1 <= workers ({workers}) <= max_in_flight ({max_in_flight})")
        self.sock, self.port = zmqio.bind_router(ctx, address, port)
        self._auth = authenticator
        self._job_owner_uids = job_owner_uids or (lambda: set())
        self._handlers: dict[str, Callable[[wire.Message], dict[str, Any] | None]] = {}
        self._routes: dict[str, _Route] = {}
        self.counters: dict[str, int] = {"requests": 0, "malformed": 0, "auth_failed": 0, "dropped": 0,
                                         "timed_out": 0, "busy": 0, "queued_behind_rank_op": 0}
        self._clock = clock
        self._max_in_flight = max_in_flight
        self._tokens = itertools.count(1)
        # Owned by the front thread alone: the socket, _pending, counters.
        self._pending: dict[int, _Pending] = {}
        # (job, rank) -> (type, since) of the op running on it; read by other threads (busy_jobs).
        self._busy: dict[tuple[int, int], tuple[str, float]] = {}
        # requests for a busy rank, in arrival order (front thread only)
        self._waiting: dict[tuple[int, int], list[tuple[list[bytes], bytes, wire.Message, _Route, float]]] = {}
        self._busy_lock = threading.Lock()
        self._jobs: queue.Queue[tuple[int, bytes, float] | None] = queue.Queue()
        self._done: queue.SimpleQueue[tuple[int, bytes, dict[str, int]]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wake_lock = threading.Lock()  # no write to the pipe's fd once close() closed it
        self._closed = False
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._workers = [threading.Thread(target=self._work, name=f"tpassd-op-{i}", daemon=True)
                         for i in range(workers)]
        for w in self._workers:
            w.start()

    def register(self, type_: str, fn: ControlHandler, access: str, *, inline: bool = False,
                 deadline_s: float | None = None, exclusive: bool | None = None) -> None:
        """Serve ``type_`` with ``fn``. ``inline``: answered by the front thread (only for handlers
        that never block); otherwise by a worker within ``deadline_s``. ``exclusive``: one op per
        (job_id, rank) of the body at a time. Both default from RANK_OPS (else 30 s, not exclusive)."""
        if deadline_s is None:
            deadline_s = RANK_OPS.get(type_, DEFAULT_DEADLINE_S)
        if exclusive is None:
            exclusive = type_ in RANK_OPS
        if type_ not in wire.BODIES:
            raise ValueError(f"{type_} is not in torchpass.wire.BODIES")
        if access not in (USER, OWNER, ROOT):
            raise ValueError(f"unknown access level {access!r}")
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")

        def handler(msg: wire.Message) -> dict[str, Any] | None:
            try:
                ident = self._auth.identify(msg)
            except AuthError as exc:
                log.warning("unauthenticated request refused", type=msg.type, id=msg.id, error=str(exc))
                raise
            self._authorize(msg, ident, access)
            return fn(msg, ident)

        self._handlers[type_] = handler
        self._routes[type_] = _Route(inline, deadline_s, exclusive)

    def _authorize(self, msg: wire.Message, ident: auth.Identity, access: str) -> None:
        if access == USER or ident.uid == 0:
            return
        if access == OWNER and ident.uid in self._job_owner_uids():
            return
        who = "root" if access == ROOT else "root or the owner of a job on this node"
        log.warning("forbidden request refused", type=msg.type, uid=ident.uid, gid=ident.gid)
        raise auth.AuthFailure("forbidden", f"{msg.type} needs {who}; uid {ident.uid} is neither")

    def handle(self, frame: bytes, counters: dict[str, int] | None = None) -> bytes:
        """One request frame -> one reply frame, in the caller's thread (also the fuzz tests' entry point)."""
        return zmqio.handle_frame(frame, self._handlers, counters=self.counters if counters is None else counters)

    def busy_jobs(self) -> set[int]:
        """Jobs with an op running on this node now (the sweep leaves their files alone)."""
        with self._busy_lock:
            return {j for j, _ in self._busy}

    # -- the front thread ------------------------------------------------------------
    def serve_once(self, timeout_ms: int = 100) -> bool:
        """Wait up to ``timeout_ms`` (less when a deadline comes first) for requests and results."""
        now = self._clock()
        due = [p.deadline for p in self._pending.values() if not p.answered]
        if due:
            timeout_ms = max(0, min(timeout_ms, int((min(due) - now) * 1000) + 1))
        events = dict(self._poller.poll(timeout_ms))
        if self._wake_r in events:
            self._collect()
        got = False
        if events.get(self.sock, 0) & zmq.POLLIN:
            got = self._receive()
        self._expire()
        return got or bool(events)

    def _receive(self) -> bool:
        try:
            parts = self.sock.recv_multipart(zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        if len(parts) < 3 or parts[-2] != b"":
            self.counters["dropped"] += 1
            return True
        self.counters["requests"] += 1
        frame = parts[-1]
        try:
            msg = wire.decode(frame)
        except ProtocolError:
            msg = None  # handle() answers it with the right error code
        route = self._routes.get(msg.type) if msg is not None else None
        if route is None or route.inline:
            self._send(parts[:-1], self.handle(frame))
            return True
        self._dispatch(parts[:-1], frame, msg, route)
        return True

    def _dispatch(self, envelope: list[bytes], frame: bytes, msg: wire.Message, route: _Route) -> None:
        now = self._clock()
        in_flight = len(self._pending) + sum(len(w) for w in self._waiting.values())
        if in_flight >= self._max_in_flight:
            self.counters["busy"] += 1
            self._send(envelope, wire.encode_error(msg.id, "unavailable", (
                f"tpassd is busy: {in_flight} requests in flight; retry {msg.type} later")))
            return
        key = job_rank_key(msg.body) if route.exclusive else None
        if key is not None:
            with self._busy_lock:
                running = self._busy.get(key)
                if running is None:
                    self._busy[key] = (msg.type, now)
            if running is not None:
                self.counters["queued_behind_rank_op"] += 1
                self._waiting.setdefault(key, []).append((envelope, frame, msg, route, now))
                return
        self._start(envelope, frame, msg, route, now, key)

    def _start(self, envelope: list[bytes], frame: bytes, msg: wire.Message, route: _Route, arrived: float,
               key: tuple[int, int] | None) -> None:
        token = next(self._tokens)
        self._pending[token] = _Pending(envelope, msg.id, msg.type, arrived + route.deadline_s, arrived, key)
        self._jobs.put((token, frame, arrived + route.deadline_s))

    def _next_for(self, key: tuple[int, int]) -> None:
        """The rank's op ended: start the next one that waited for it (the rank stays busy), if any."""
        waiting = self._waiting.get(key)
        if not waiting:
            self._waiting.pop(key, None)
            with self._busy_lock:
                self._busy.pop(key, None)
            return
        envelope, frame, msg, route, arrived = waiting.pop(0)
        if self._clock() >= arrived + route.deadline_s:  # expired while it waited: never start it
            self._timed_out(envelope, msg.id, msg.type, route.deadline_s)
            self._next_for(key)
            return
        with self._busy_lock:
            self._busy[key] = (msg.type, self._clock())
        self._start(envelope, frame, msg, route, arrived, key)

    def _collect(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                token, reply, counters = self._done.get_nowait()
            except queue.Empty:
                return
            p = self._pending.pop(token, None)
            if p is None:
                continue
            if p.key is not None:
                self._next_for(p.key)
            for k, v in counters.items():
                self.counters[k] = self.counters.get(k, 0) + v
            if p.answered:
                log.warning("late result dropped: its request had timed out", type=p.type,
                            took_s=round(self._clock() - p.started, 3))
            else:
                self._send(p.envelope, reply)

    def _expire(self) -> None:
        now = self._clock()
        for p in self._pending.values():
            if not p.answered and now >= p.deadline:
                p.answered = True
                self._timed_out(p.envelope, p.id, p.type, p.deadline - p.started)
        for key, waiting in self._waiting.items():  # waited behind its rank's op past its deadline
            for item in [w for w in waiting if now >= w[4] + w[3].deadline_s]:
                waiting.remove(item)
                self._timed_out(item[0], item[2].id, item[2].type, item[3].deadline_s)

    def _timed_out(self, envelope: list[bytes], msg_id, type_: str, deadline_s: float) -> None:
        self.counters["timed_out"] += 1
        log.warning("request over its deadline answered with timeout", type=type_, deadline_s=round(deadline_s, 3))
        self._send(envelope, wire.encode_error(msg_id, "timeout", (
            f"{type_} did not finish within its {deadline_s:g} s deadline on this tpassd; "
            "it may still complete: check before retrying")))

    def _send(self, envelope: list[bytes], reply: bytes) -> None:
        try:
            self.sock.send_multipart(envelope + [reply], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            self.counters["dropped"] += 1

    # -- the workers -------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            token, frame, deadline = item
            counters: dict[str, int] = {}  # merged by the front thread, which owns self.counters
            if self._clock() >= deadline:
                # It waited for a worker past its deadline and its requester was told "timeout":
                # never start it now (a dump nobody waits for any more).
                reply = b""
            else:
                reply = self.handle(frame, counters)
            self._done.put((token, reply, counters))
            with self._wake_lock:
                if self._closed:
                    return
                try:
                    os.write(self._wake_w, b"x")
                except BlockingIOError:
                    pass  # the pipe is full: a wake-up is pending anyway

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
        if self._closed:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        for _ in self._workers:
            self._jobs.put(None)
        for w in self._workers:
            w.join(timeout=0.5)  # a worker still in a long op is a daemon thread: it dies with tpassd
        self.sock.close(linger=0)
        with self._wake_lock:
            self._closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)
