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

Admission (no user can starve tpassd or the others). The front thread
decodes the munge credential of every request first; an unauthenticated
request gets its error reply there and costs no worker, no Slurm call and
no queue place. Then it authorizes: a job's request (snapshot, restore,
drain) needs the job's owner, the one Slurm call allowed before
authorization, asked by a small pool of lookup threads and cached per job
(``OwnerCache``: bounded, a short TTL); a drill needs the set of users with
a job on this node (asked the same way, not cached: it changes as jobs start). Only an authorized request is
queued for a worker, and only then does its handler ask slurmd for the
job's pids. A uid other than root may have requests of at most
``max_jobs_per_uid`` jobs in flight (waiting for its owner lookup, queued or
running); all requests of one job count as one, so a node's ranks still
dump in parallel. Every refusal leaves one ``tpassd.audit`` line (uid, job,
what was refused).

Memory (tpassd runs under MemoryMax=256M). Each peer may queue RCVHWM
frames (of up to wire.MAX_FRAME_BYTES) and have one more in ZeroMQ's
decoder; ``PeerGuard`` keeps at most ``max_peers`` TCP connections open,
closing the oldest one that never sent an authenticated request (else the
one idle longest) for each new one beyond that. A closed client's ZeroMQ
socket reconnects by itself, and its request is retried (Lazy Pirate).
"""

from __future__ import annotations

import itertools
import os
import queue
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
import zmq

from torchpass import auth, wire, zmqio
from torchpass.checkpoint.criu import DUMP_TIMEOUT_S
from torchpass.errors import AuthError, ProtocolError, TorchpassError

log = structlog.get_logger("tpassd.control")
audit_log = structlog.get_logger("tpassd.audit")

USER, OWNER, ROOT = "user", "owner", "root"

ControlHandler = Callable[[wire.Message, auth.Identity], dict[str, Any] | None]

DEFAULT_DEADLINE_S = 30.0  # a pooled request without its own deadline (drain, drill: two Slurm calls of 15 s)
DEFAULT_WORKERS = 8
DEFAULT_MAX_IN_FLIGHT = 64
DEFAULT_MAX_JOBS_PER_UID = 2
# TCP connections to the control socket (tpassd.toml control_max_peers). Each may hold RCVHWM frames
# plus one in ZeroMQ's decoder, 1 MiB each, and a closed one's queued frame until it is read. Under
# 1,000 peers that never authenticate, sending 1 MiB frames for 8 s (tests/unit/test_tpassd_limits.py,
# 2 shared cores): peak RSS 139-305 MB with 16 when each new connection closed the oldest at once;
# 93-106 MB with 16 and MIN_AGE_S (PeerGuard._close_one); MemoryMax=256M.
# Honest peers: a coordinator per job with ranks here and tpassctl: fewer; a closed one reconnects.
DEFAULT_MAX_PEERS = 16
# Owner lookups: a job's owner never changes while Slurm knows the job, but a job id may be reused
# after Slurm forgets it; "no such job" is cached for less, as the job may be just starting.
OWNER_TTL_S = 10.0
UNKNOWN_TTL_S = 2.0
OWNER_CACHE_ENTRIES = 4096
LOOKUP_THREADS = 2
MIN_AGE_S = 1.0  # a connection is not closed for a newer one before it had this long to authenticate
RECEIVE_BATCH = 32
# The requests that name a job whose owner (or root, or for a drain SlurmUser) may ask.
JOB_OWNED = frozenset({"tpassd.snapshot", "tpassd.restore", "tpassd.drain", "tpassd.account",
                       "tpassd.job_metrics"})
NODE_OWNERS = ("node",)  # the lookup key of the set of uids with a job running on this node

# Frames queued per peer before ZeroMQ stops reading it (TCP then holds the rest). ZeroMQ's default,
# 1,000 frames of up to 1 MiB per peer, let 1,000 peers that never authenticate grow tpassd past
# its MemoryMax (256M): 1.8 GB measured. A client waits for each reply, so 1 costs it nothing.
RCVHWM = 1

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


class OwnerCache:
    """Answers of the lookups made before authorization, per key (("job", J) -> owner uid or None
    when Slurm does not know the job; NODE_OWNERS -> the set of uids with a job on this node):
    bounded (the least recently used go first), each kept OWNER_TTL_S (a "not known" UNKNOWN_TTL_S).
    Thread-safe: the front thread reads it, the lookup threads and the handlers fill it."""

    def __init__(self, entries: int = OWNER_CACHE_ENTRIES, ttl_s: float = OWNER_TTL_S,
                 unknown_ttl_s: float = UNKNOWN_TTL_S, clock: Callable[[], float] = time.monotonic):
        self._d: OrderedDict[tuple, tuple[float, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.entries, self.ttl_s, self.unknown_ttl_s, self._clock = entries, ttl_s, unknown_ttl_s, clock

    def get(self, key: tuple) -> tuple[bool, Any]:
        with self._lock:
            hit = self._d.get(key)
            if hit is None or self._clock() >= hit[0]:
                self._d.pop(key, None)
                return False, None
            self._d.move_to_end(key)
            return True, hit[1]

    def put(self, key: tuple, value: Any) -> None:
        ttl = self.unknown_ttl_s if value is None else self.ttl_s
        with self._lock:
            self._d[key] = (self._clock() + ttl, value)
            self._d.move_to_end(key)
            while len(self._d) > self.entries:
                self._d.popitem(last=False)

    def __len__(self) -> int:
        return len(self._d)


class PeerGuard:
    """At most ``max_peers`` TCP connections on a ROUTER socket, seen through its monitor socket.
    Beyond that, each new connection closes the oldest one that never sent an authenticated
    request, else the one whose last authenticated request is the oldest (a client that reconnects
    by itself), each open MIN_AGE_S at least; none such: the new one is closed. Its own thread reads
    the monitor: a connection is closed within microseconds of its accept, not when the front thread
    is done with a 1 MiB frame (ZeroMQ's I/O thread reads every accepted peer meanwhile: 300 MB under
    1,000 peers when the front thread closed them)."""

    def __init__(self, sock: zmq.Socket, max_peers: int, clock: Callable[[], float] = time.monotonic):
        self.max_peers = max_peers
        self._clock = clock
        self._monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
        self._lock = threading.Lock()
        # fd -> [accepted at, last authenticated request at or None, peer address]
        self.peers: dict[int, list] = {}
        # fds whose connection this guard closed, until ZeroMQ accepts another on that fd: what they
        # had sent stays queued in the socket after the close, and is dropped unread (``evicted``)
        self._evicted: set[int] = set()
        self.closed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tpassd-peers", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from zmq.utils.monitor import parse_monitor_message

        while not self._stop.is_set():
            try:
                if not self._monitor.poll(100):
                    continue
                ev = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except (zmq.ZMQError, RuntimeError):
                continue
            fd = int(ev["value"])
            with self._lock:
                if ev["event"] == zmq.EVENT_ACCEPTED:
                    self._evicted.discard(fd)
                    self.peers[fd] = [self._clock(), None, _peer_name(fd)]
                    if len(self.peers) > self.max_peers:
                        self._close_one(keep=fd)
                else:
                    self.peers.pop(fd, None)

    def evicted(self, fd: int | None) -> bool:
        """A message from a connection this guard closed (dropped unread: no copy, no parse)."""
        if fd is None:
            return False
        with self._lock:
            return fd in self._evicted

    def authenticated(self, fd: int | None) -> None:
        if fd is None:
            return
        with self._lock:
            p = self.peers.get(fd)
            if p is not None:
                p[1] = self._clock()

    def _close_one(self, keep: int) -> None:
        """Close the oldest connection that never authenticated and had MIN_AGE_S to do so, else the
        one idle longest that has been open MIN_AGE_S, else the new one (``keep``) itself: a flood
        of connections then churns each place at most once per MIN_AGE_S, and the new ones closed
        at once have sent nothing (what a closed peer had sent stays queued until it is read)."""
        now = self._clock()
        others = [(fd, p) for fd, p in self.peers.items() if fd != keep and now - p[0] >= MIN_AGE_S]
        never = [(p[0], fd) for fd, p in others if p[1] is None]
        if never:
            fd = min(never)[1]
        elif others:
            fd = min((p[1], fd) for fd, p in others)[1]
        else:
            fd = keep
        addr = self.peers.pop(fd)[2]
        # Only the connection accepted on this fd: ZeroMQ may have closed it and the fd number be
        # another socket's by now; then its peer differs (an ephemeral port is not reused at once).
        if addr is not None and _peer_name(fd) == addr:
            try:
                with socket.socket(fileno=os.dup(fd)) as dup:
                    dup.shutdown(socket.SHUT_RDWR)  # ZeroMQ sees the end and drops the peer
                self.closed += 1
                self._evicted.add(fd)
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._monitor.close(linger=0)


def _peer_name(fd: int) -> Any:
    try:
        with socket.socket(fileno=os.dup(fd)) as dup:
            return dup.getpeername()
    except OSError:
        return None


def audit_refusal(ident: auth.Identity | None, msg: wire.Message, code: str, error: str,
                   node: str | None = None) -> None:
    """The one audit line of a request refused before a handler saw it (the fields of the handlers'
    own lines: torchpass.checkpoint.admission.Audit, the drain's)."""
    b = msg.body
    action = msg.type.removeprefix("tpassd.") + (f".{b['op']}" if isinstance(b.get("op"), str) else "")
    where = {"node": node}
    if isinstance(b.get("node"), str) and b["node"] != node:  # a lost node's drain, asked of a witness
        where = {"node": b["node"], "witness": node}
    audit_log.info("privileged action", outcome=code, requester_uid=None if ident is None else ident.uid,
                   job_id=b.get("job_id"), rank=b.get("rank"), pid=None, action=action, error=error, **where)


def request_job(body: dict[str, Any]) -> int | None:
    j = body.get("job_id")
    return j if isinstance(j, int) and not isinstance(j, bool) and j >= 0 else None


@dataclass(frozen=True)
class _Route:
    inline: bool
    deadline_s: float
    exclusive: bool
    access: str = USER
    job_owned: bool = False  # root or the owner of the body's job_id (admins too: admin_ok)
    admin_ok: bool = False  # SlurmUser may too (drains, as with scontrol)


@dataclass
class _Pending:
    envelope: list[bytes]
    id: str
    type: str
    deadline: float
    started: float
    key: tuple[int, int] | None
    answered: bool = False
    uid: int = 0
    slot: Any = None


@dataclass
class _Parked:
    """A request waiting for its authorization lookup (front thread only)."""
    envelope: list[bytes]
    frame: bytes
    msg: wire.Message
    route: _Route
    ident: auth.Identity
    arrived: float
    slot: Any


class ControlServer:
    def __init__(self, ctx: zmq.Context, address: str, port: int, authenticator: Authenticator,
                 job_owner_uids: Callable[[], set[int]] | None = None, *, workers: int = DEFAULT_WORKERS,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, clock: Callable[[], float] = time.monotonic,
                 job_owner: Callable[[int], int | None] | None = None,
                 max_jobs_per_uid: int = DEFAULT_MAX_JOBS_PER_UID, max_peers: int = DEFAULT_MAX_PEERS,
                 is_admin: Callable[[int], bool] = lambda uid: uid == 0):
        if not 1 <= workers <= max_in_flight:
            raise ValueError(f"need 1 <= workers ({workers}) <= max_in_flight ({max_in_flight})")
        if max_jobs_per_uid < 1:
            raise ValueError(f"max_jobs_per_uid must be >= 1, got {max_jobs_per_uid}")
        self.sock, self.port = zmqio.bind_router(ctx, address, port, rcvhwm=RCVHWM)
        self._auth = authenticator
        self.node = getattr(authenticator, "node", None)  # for the audit lines
        self._job_owner_uids = job_owner_uids or (lambda: set())
        self._job_owner = job_owner or _slurm_job_owner
        self._is_admin = is_admin
        self.owners = OwnerCache(clock=clock)
        self._max_jobs_per_uid = max_jobs_per_uid
        self._handlers: dict[str, Callable[[wire.Message], dict[str, Any] | None]] = {}
        self._fns: dict[str, ControlHandler] = {}
        self._routes: dict[str, _Route] = {}
        self.counters: dict[str, int] = {"requests": 0, "malformed": 0, "auth_failed": 0, "dropped": 0,
                                         "timed_out": 0, "busy": 0, "queued_behind_rank_op": 0,
                                         "forbidden": 0, "uid_limited": 0, "peers_closed": 0}
        self._clock = clock
        self._max_in_flight = max_in_flight
        self._tokens = itertools.count(1)
        # Owned by the front thread alone: the socket, _pending, _parked, _slots, counters.
        self._pending: dict[int, _Pending] = {}
        # (job, rank) -> (type, since) of the op running on it; read by other threads (busy_jobs).
        self._busy: dict[tuple[int, int], tuple[str, float]] = {}
        # requests for a busy rank, in arrival order (front thread only)
        self._waiting: dict[tuple[int, int], list[tuple]] = {}
        # requests waiting for the lookup of their key (OwnerCache keys)
        self._parked: dict[tuple, list[_Parked]] = {}
        # uid -> {slot (a job id, or a request type): requests in flight}
        self._slots: dict[int, dict[Any, int]] = {}
        self._busy_lock = threading.Lock()
        self._jobs: queue.Queue[tuple[int, wire.Message, auth.Identity, float] | None] = queue.Queue()
        self._done: queue.SimpleQueue[tuple[int, bytes, dict[str, int]]] = queue.SimpleQueue()
        self._lookups: queue.Queue[tuple | None] = queue.Queue()
        self._looked_up: queue.SimpleQueue[tuple[tuple, Any, BaseException | None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wake_lock = threading.Lock()  # no write to the pipe's fd once close() closed it
        self._closed = False
        self._guard = PeerGuard(self.sock, max_peers, clock)
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._workers = [threading.Thread(target=self._work, name=f"tpassd-op-{i}", daemon=True)
                         for i in range(workers)]
        self._workers += [threading.Thread(target=self._look_up, name=f"tpassd-owner-{i}", daemon=True)
                          for i in range(LOOKUP_THREADS)]
        for w in self._workers:
            w.start()

    def register(self, type_: str, fn: ControlHandler, access: str, *, inline: bool = False,
                 deadline_s: float | None = None, exclusive: bool | None = None,
                 job_owned: bool | None = None, admin_ok: bool = False) -> None:
        """Serve ``type_`` with ``fn``. ``inline``: answered by the front thread (only for handlers
        that never block); otherwise by a worker within ``deadline_s``. ``exclusive``: one op per
        (job_id, rank) of the body at a time. Both default from RANK_OPS (else 30 s, not exclusive).
        ``job_owned`` (default: the types of JOB_OWNED): queued only for root or the owner of the
        body's job_id (``admin_ok``: SlurmUser too); the handler may check more."""
        if deadline_s is None:
            deadline_s = RANK_OPS.get(type_, DEFAULT_DEADLINE_S)
        if exclusive is None:
            exclusive = type_ in RANK_OPS
        if job_owned is None:
            job_owned = type_ in JOB_OWNED
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
                audit_refusal(None, msg, getattr(exc, "code", "unauthenticated"), str(exc), self.node)
                raise
            if threading.current_thread() is self._thread:
                self._guard.authenticated(self._guard_src)
            self._authorize(msg, ident, access)
            return fn(msg, ident)

        self._handlers[type_] = handler
        self._fns[type_] = fn
        self._routes[type_] = _Route(inline, deadline_s, exclusive, access, job_owned, admin_ok)

    def _authorize(self, msg: wire.Message, ident: auth.Identity, access: str) -> None:
        if access == USER or ident.uid == 0:
            return
        if access == OWNER:
            try:
                if ident.uid in self._job_owner_uids():
                    return
            except TorchpassError as exc:
                log.warning("cannot ask Slurm for job owners; only root may do this", error=str(exc))
        who = "root" if access == ROOT else "root or the owner of a job on this node"
        log.warning("forbidden request refused", type=msg.type, uid=ident.uid, gid=ident.gid)
        audit_refusal(ident, msg, "forbidden", f"{msg.type} needs {who}", self.node)
        raise auth.AuthFailure("forbidden", f"{msg.type} needs {who}; uid {ident.uid} is neither")

    def job_owner(self, job_id: int) -> int | None:
        """The job's owner as Slurm records it (None: Slurm does not know the job), from the cache
        the admission filled when it can; the handlers' owner lookup (no second Slurm call)."""
        hit, owner = self.owners.get(("job", job_id))
        if hit:
            return owner
        owner = self._job_owner(job_id)
        self.owners.put(("job", job_id), owner)
        return owner

    def handle(self, frame: bytes, counters: dict[str, int] | None = None) -> bytes:
        """One request frame -> one reply frame, in the caller's thread (also the fuzz tests' entry point)."""
        return zmqio.handle_frame(frame, self._handlers, counters=self.counters if counters is None else counters)

    def busy_jobs(self) -> set[int]:
        """Jobs with an op running on this node now (the sweep leaves their files alone)."""
        with self._busy_lock:
            return {j for j, _ in self._busy}

    def peers(self) -> int:
        """TCP connections open on the control socket (as its monitor last said)."""
        return len(self._guard.peers)

    # -- the front thread ------------------------------------------------------------
    def serve_once(self, timeout_ms: int = 100) -> bool:
        """Wait up to ``timeout_ms`` (less when a deadline comes first) for requests and results."""
        now = self._clock()
        due = [p.deadline for p in self._pending.values() if not p.answered]
        if due:
            timeout_ms = max(0, min(timeout_ms, int((min(due) - now) * 1000) + 1))
        events = dict(self._poller.poll(timeout_ms))
        self.counters["peers_closed"] = self._guard.closed
        if self._wake_r in events:
            self._collect()
        got = False
        if events.get(self.sock, 0) & zmq.POLLIN:
            for _ in range(RECEIVE_BATCH):  # a few per wake-up: what waits in ZeroMQ holds memory
                if not self._receive():
                    break
                got = True
        self._expire()
        return got or bool(events)

    def _receive(self) -> bool:
        try:
            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            return False
        try:
            srcfd = frames[-1].get(zmq.SRCFD)
        except zmq.ZMQError:
            srcfd = None
        if self._guard.evicted(srcfd):
            self.counters["dropped"] += 1
            return True
        parts = [f.bytes for f in frames]
        del frames
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
            self._guard_src = srcfd  # marked authenticated by the handler, on this thread
            try:
                self._send(parts[:-1], self.handle(frame))
            finally:
                self._guard_src = None
            return True
        self._admit(parts[:-1], frame, msg, route, srcfd)
        return True

    _guard_src = None

    # -- admission: authenticate, limit, authorize; then queue -------------------------
    def _refuse(self, envelope: list[bytes], msg: wire.Message, ident: auth.Identity | None, code: str,
                message: str) -> None:
        audit_refusal(ident, msg, code, message, self.node)
        self._send(envelope, wire.encode_error(msg.id, code, message))

    def _admit(self, envelope: list[bytes], frame: bytes, msg: wire.Message, route: _Route, srcfd) -> None:
        try:
            ident = self._auth.identify(msg)  # munge first: nothing else for a stranger
        except AuthError as exc:
            self.counters["auth_failed"] += 1
            log.warning("unauthenticated request refused", type=msg.type, id=msg.id, error=str(exc))
            self._refuse(envelope, msg, None, getattr(exc, "code", "unauthenticated"), str(exc))
            return
        except TorchpassError as exc:  # munged cannot be asked
            self._refuse(envelope, msg, None, zmqio.error_code(exc), str(exc))
            return
        self._guard.authenticated(srcfd)
        job = request_job(msg.body)
        slot: Any = job if job is not None else msg.type
        in_flight = (len(self._pending) + sum(len(w) for w in self._waiting.values())
                     + sum(len(p) for p in self._parked.values()))
        if in_flight >= self._max_in_flight:
            self.counters["busy"] += 1
            self._refuse(envelope, msg, ident, "unavailable",
                         f"tpassd is busy: {in_flight} requests in flight; retry {msg.type} later")
            return
        if ident.uid != 0:
            held = self._slots.get(ident.uid, {})
            if slot not in held and len(held) >= self._max_jobs_per_uid:
                self.counters["uid_limited"] += 1
                log.warning("request over its uid's limit refused", type=msg.type, uid=ident.uid, job_id=job)
                self._refuse(envelope, msg, ident, "unavailable", (
                    f"uid {ident.uid} has requests of {len(held)} jobs in flight on this tpassd, its limit "
                    f"(max_jobs_per_uid); retry {msg.type} when one of them has been answered"))
                return
            if route.access == ROOT:
                self._forbid(envelope, msg, ident, f"{msg.type} needs root; uid {ident.uid} is not")
                return
            key = None
            if route.job_owned:
                if job is None:
                    self._refuse(envelope, msg, ident, "bad_request",
                                 f"{msg.type}: job_id must be a non-negative integer")
                    return
                key = ("job", job)
            elif route.access == OWNER:
                key = NODE_OWNERS
            if key is not None:
                self._take(ident.uid, slot)
                # the node's job owners change as jobs start: asked each time, never cached
                hit, value = self.owners.get(key) if key != NODE_OWNERS else (False, None)
                if not hit:
                    parked = self._parked.setdefault(key, [])
                    parked.append(_Parked(envelope, frame, msg, route, ident, self._clock(), slot))
                    if len(parked) == 1:
                        self._lookups.put(key)
                    return
                self._decided(_Parked(envelope, frame, msg, route, ident, self._clock(), slot), value, None)
                return
        self._take(ident.uid, slot)
        self._dispatch(envelope, frame, msg, route, self._clock(), ident, slot)

    def _forbid(self, envelope: list[bytes], msg: wire.Message, ident: auth.Identity, why: str) -> None:
        self.counters["forbidden"] += 1
        log.warning("forbidden request refused", type=msg.type, uid=ident.uid, gid=ident.gid)
        self._refuse(envelope, msg, ident, "forbidden", why)

    def _why_not(self, p: _Parked, value: Any) -> tuple[str, str] | None:
        """(code, message) refusing the parked request given its lookup's answer; None: allowed."""
        uid, msg, route = p.ident.uid, p.msg, p.route
        if route.job_owned:
            job = msg.body["job_id"]
            if route.admin_ok and self._is_admin(uid):
                return None
            if msg.type == "tpassd.snapshot" and msg.body.get("op") == "delete":
                return None  # the manifests' recorded owner may delete after Slurm forgot the job
            if value is None and msg.type != "tpassd.drain":
                return "not_found", f"job {job} is not known to Slurm"
            if value != uid:
                return "forbidden", f"uid {uid} does not own job {job}"
            return None
        if uid in (value or set()):
            return None
        return "forbidden", f"{msg.type} needs root or the owner of a job on this node; uid {uid} is neither"

    def _decided(self, p: _Parked, value: Any, error: BaseException | None) -> None:
        if error is not None:
            self._release(p.ident.uid, p.slot)
            what = f"who owns job {p.msg.body.get('job_id')}" if p.route.job_owned else "which jobs run here"
            self._refuse(p.envelope, p.msg, p.ident, "unavailable", f"cannot ask Slurm {what} ({error})")
            return
        why = self._why_not(p, value)
        if why is not None:
            self._release(p.ident.uid, p.slot)
            if why[0] == "forbidden":
                self._forbid(p.envelope, p.msg, p.ident, why[1])
            else:
                self._refuse(p.envelope, p.msg, p.ident, *why)
            return
        if self._clock() >= p.arrived + p.route.deadline_s:
            self._release(p.ident.uid, p.slot)
            self._timed_out(p.envelope, p.msg.id, p.msg.type, p.route.deadline_s)
            return
        self._dispatch(p.envelope, p.frame, p.msg, p.route, p.arrived, p.ident, p.slot)

    def _take(self, uid: int, slot: Any) -> None:
        held = self._slots.setdefault(uid, {})
        held[slot] = held.get(slot, 0) + 1

    def _release(self, uid: int, slot: Any) -> None:
        held = self._slots.get(uid)
        if held is None or slot not in held:
            return
        held[slot] -= 1
        if held[slot] <= 0:
            del held[slot]
        if not held:
            del self._slots[uid]

    def _look_up(self) -> None:
        while True:
            key = self._lookups.get()
            if key is None:
                return
            value, error = None, None
            try:
                value = self._job_owner(key[1]) if key[0] == "job" else set(self._job_owner_uids())
            except Exception as exc:  # noqa: BLE001 - handed to the front thread, which refuses
                error = exc
            self._looked_up.put((key, value, error))
            self._wake()

    def _dispatch(self, envelope: list[bytes], frame: bytes, msg: wire.Message, route: _Route, now: float,
                  ident: auth.Identity, slot: Any) -> None:
        key = job_rank_key(msg.body) if route.exclusive else None
        if key is not None:
            with self._busy_lock:
                running = self._busy.get(key)
                if running is None:
                    self._busy[key] = (msg.type, now)
            if running is not None:
                self.counters["queued_behind_rank_op"] += 1
                self._waiting.setdefault(key, []).append((envelope, frame, msg, route, now, ident, slot))
                return
        self._start(envelope, frame, msg, route, now, key, ident, slot)

    def _start(self, envelope: list[bytes], frame: bytes, msg: wire.Message, route: _Route, arrived: float,
               key: tuple[int, int] | None, ident: auth.Identity, slot: Any) -> None:
        token = next(self._tokens)
        self._pending[token] = _Pending(envelope, msg.id, msg.type, arrived + route.deadline_s, arrived, key,
                                        uid=ident.uid, slot=slot)
        self._jobs.put((token, msg, ident, arrived + route.deadline_s))

    def _next_for(self, key: tuple[int, int]) -> None:
        """The rank's op ended: start the next one that waited for it (the rank stays busy), if any."""
        waiting = self._waiting.get(key)
        if not waiting:
            self._waiting.pop(key, None)
            with self._busy_lock:
                self._busy.pop(key, None)
            return
        envelope, frame, msg, route, arrived, ident, slot = waiting.pop(0)
        if self._clock() >= arrived + route.deadline_s:  # expired while it waited: never start it
            self._release(ident.uid, slot)
            self._timed_out(envelope, msg.id, msg.type, route.deadline_s)
            self._next_for(key)
            return
        with self._busy_lock:
            self._busy[key] = (msg.type, self._clock())
        self._start(envelope, frame, msg, route, arrived, key, ident, slot)

    def _collect(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                key, value, error = self._looked_up.get_nowait()
            except queue.Empty:
                break
            if error is None and key != NODE_OWNERS:
                self.owners.put(key, value)
            for p in self._parked.pop(key, []):
                self._decided(p, value, error)
        while True:
            try:
                token, reply, counters = self._done.get_nowait()
            except queue.Empty:
                return
            p = self._pending.pop(token, None)
            if p is None:
                continue
            self._release(p.uid, p.slot)
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
                self._release(item[5].uid, item[6])
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
    def _wake(self) -> None:
        with self._wake_lock:
            if self._closed:
                return
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass  # the pipe is full: a wake-up is pending anyway

    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            token, msg, ident, deadline = item
            counters: dict[str, int] = {}  # merged by the front thread, which owns self.counters
            if self._clock() >= deadline:
                # It waited for a worker past its deadline and its requester was told "timeout":
                # never start it now (a dump nobody waits for any more).
                reply = b""
            else:
                fn = self._fns[msg.type]
                reply = zmqio.reply_for(msg, lambda: fn(msg, ident), counters=counters)
            self._done.put((token, reply, counters))
            self._wake()
            if self._closed:
                return

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tpassd-control", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.serve_once(100)
            except Exception:
                log.exception("control loop error")

    def close(self) -> None:
        if self._closed:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        for _ in range(DEFAULT_WORKERS + len(self._workers)):
            self._jobs.put(None)
            self._lookups.put(None)
        for w in self._workers:
            w.join(timeout=0.5)  # a worker still in a long op is a daemon thread: it dies with tpassd
        self._guard.close()
        self.sock.close(linger=0)
        with self._wake_lock:
            self._closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)


def _slurm_job_owner(job_id: int) -> int | None:
    """The job's owner as slurmctld records it; None when it does not know the job."""
    from torchpass import slurm

    info = slurm.client().job(job_id)
    return None if info is None else info.user_id
