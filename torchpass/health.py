"""The subscriber that follows tpassd publishers (the ZeroMQ guide's Clone pattern).

The health states themselves (``State``, ``worst``, ``severity``) live in
torchpass.health_state, which loads neither zmq nor structlog; they are
re-exported here.

``HealthSubscriber`` connects one SUB socket to any number of tpassd PUB
endpoints, asks each for a health snapshot over its (authenticated) request
socket, applies only events newer than the snapshot's sequence number,
detects gaps (then re-asks for a snapshot), and marks a publisher UNKNOWN
after ``missed_heartbeats`` heartbeat intervals without a word.

Publications are bound to their publisher: each followed tpassd has a SUB
socket of its own, and a publication that arrives on it must name that node
(envelope sender and body ``node``); one that names another is dropped and
counted (``wrong_sender``). Every numeric field is range-checked
(``check_publication``): an interval outside (0, 3600] s, a negative or
non-increasing seq, NaN or infinity anywhere is dropped and counted
(``out_of_range``). A dropped publication changes nothing: it never makes
a node healthy, and it never proves its publisher alive.
"""

from __future__ import annotations

import math
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq

from torchpass import wire
from torchpass.errors import ProtocolError, TorchpassError
from torchpass.health_state import DEGRADED, FAILED, HEALTHY, UNKNOWN, State, severity, worst  # noqa: F401

log = structlog.get_logger("torchpass.health")

# Topics are the first frame of every publication; subscribers filter on them.
TOPIC_SAMPLE = b"tpassd.sample"
TOPIC_EVENT = b"tpassd.event"
TOPIC_HEARTBEAT = b"tpassd.heartbeat"

# Ranges of a publication's numeric fields (check_publication).
MAX_INTERVAL_S = 3600.0  # a heartbeat interval above an hour is no heartbeat
# The subscriber follows one SUB socket per tpassd and waits on their ZMQ_FDs with epoll, which
# returns only the sockets that have something. A zmq.Poller walks every socket on every call:
# one call per publication made the subscriber of a 1,024-node job (~1,000 heartbeats a second)
# spend a third of a core in it (measured with bench/bench_coordinator.py).
DRAIN_MAX = 64  # publications read from one socket per pass (a flooding publisher starves no other)
MAX_SEQ = 2**63 - 1
_STATES = frozenset(s.value for s in State)


class OutOfRange(ProtocolError):
    """A publication's field is outside its range: the publication is dropped."""


def _finite(x: Any, name: str) -> None:
    """Every number in ``x`` (nested lists and dicts included) is finite."""
    todo, n = [x], 0
    while todo:
        v = todo.pop()
        n += 1
        if n > 100_000:
            raise OutOfRange(f"{name}: too deeply nested")
        if isinstance(v, float) and not math.isfinite(v):
            raise OutOfRange(f"{name}: {v} is not a finite number")
        if isinstance(v, dict):
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)


def _number(body: dict[str, Any], key: str, lo: float, hi: float, *, low_open: bool = False) -> None:
    v = body.get(key)
    if v is None:
        return  # wire.decode made sure that required fields are there
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or v < lo or v > hi or (low_open and v == lo):
        raise OutOfRange(f"{key} {v!r} outside {'(' if low_open else '['}{lo:g}, {hi:g}]")


def check_publication(type_: str, body: dict[str, Any], seq: int | None = None) -> None:
    """Raise OutOfRange unless every numeric field (and state) of a publication (or of a health
    snapshot) is in range; ``seq``: the publication's envelope seq."""
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= MAX_SEQ):
        raise OutOfRange(f"seq {seq!r} outside [0, {MAX_SEQ}]")
    _finite(body, type_)
    _number(body, "interval_s", 0.0, MAX_INTERVAL_S, low_open=True)
    _number(body, "t", 0.0, 1e11)
    _number(body, "uptime_s", 0.0, 1e11)
    for key in ("last_event_seq", "prev_event_seq"):
        _number(body, key, -1, MAX_SEQ)
        if key in body and not isinstance(body[key], int):
            raise OutOfRange(f"{key} {body[key]!r} is not an integer")
    for key in ("state", "previous", "node_state"):
        if key in body and body[key] not in _STATES:
            raise OutOfRange(f"{key} {body[key]!r} is not one of {sorted(_STATES)}")
    if not all(isinstance(r, str) for r in body.get("reasons") or []):
        raise OutOfRange("reasons must be strings")


@dataclass
class NodeView:
    """What a subscriber currently believes about one tpassd."""

    node: str
    endpoint: str
    state: State = State.UNKNOWN
    reasons: list[str] = field(default_factory=lambda: ["no heartbeat seen yet"])
    components: dict[str, dict[str, Any]] = field(default_factory=dict)
    incarnation: str | None = None
    seq: int = -1  # envelope seq of the last publication applied
    last_event_seq: int = -1
    last_heartbeat: float | None = None  # subscriber's clock
    interval_s: float = 1.0
    reported_state: State = State.UNKNOWN  # what the publisher says
    reported_reasons: list[str] = field(default_factory=list)
    need_snapshot: bool = True
    gaps: int = 0
    received_seq: int = -1  # highest envelope seq received from this incarnation (seq must increase)

    def heartbeat_age(self, now: float) -> float | None:
        return None if self.last_heartbeat is None else max(0.0, now - self.last_heartbeat)

    def as_dict(self, now: float) -> dict[str, Any]:
        age = self.heartbeat_age(now)
        return {
            "node": self.node,
            "state": self.state.value,
            "reasons": list(self.reasons),
            "last_heartbeat_age_s": None if age is None else round(age, 3),
            "incarnation": self.incarnation,
            "seq": self.seq,
            "components": {k: dict(v) for k, v in self.components.items()},
        }


SnapshotFn = Callable[[str, str], dict[str, Any]]  # (node, endpoint) -> tpassd.health result


class HealthSubscriber:
    """Follow many tpassd publishers. Thread-safe reads; one background thread.

    ``snapshot(node, control_endpoint)`` must return a ``tpassd.health``
    result (the caller supplies it so that authentication stays outside this
    module; ``tpassctl`` and the coordinator pass a munge-authenticated
    request). ``clock`` is injectable; ``poll_once`` lets tests drive the
    loop by hand without the thread.
    """

    def __init__(
        self,
        publishers: dict[str, tuple[str, str]],
        *,
        snapshot: SnapshotFn | None,
        missed_heartbeats: int = 3,
        clock: Callable[[], float] = time.monotonic,
        context: zmq.Context | None = None,
        on_change: Callable[[NodeView, State], None] | None = None,
    ):
        """``publishers``: node -> (pub_endpoint, control_endpoint)."""
        self._ctx = context or zmq.Context.instance()
        self._snapshot = snapshot
        self.missed_heartbeats = missed_heartbeats
        self._clock = clock
        self._on_change = on_change
        self._lock = threading.Lock()
        self._views: dict[str, NodeView] = {}
        self._control: dict[str, str] = {}
        self.counters = {"malformed": 0, "gaps": 0, "snapshots": 0, "snapshot_failures": 0,
                         "wrong_sender": 0, "out_of_range": 0}
        self._warned: set[tuple[str, str]] = set()  # (kind, node): dropped publications are logged once
        # One SUB socket per followed tpassd: what arrives on it must come from that node.
        self._subs: dict[zmq.Socket, str] = {}
        # ZMQ_FD is edge-triggered: it signals that the socket's events changed, not that a message
        # waits. So a socket is read while ZMQ_EVENTS says POLLIN, and one left with messages (a
        # new socket, or DRAIN_MAX reached) stays in _unread until it has none.
        self._epoll = select.epoll()
        self._by_fd: dict[int, zmq.Socket] = {}
        self._unread: set[zmq.Socket] = set()
        for node, (pub, ctl) in publishers.items():
            self._views[node] = NodeView(node=node, endpoint=pub, need_snapshot=snapshot is not None)
            self._control[node] = ctl
            self._subscribe(node, pub)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_snapshot_try: dict[str, float] = {}
        self._to_connect: list[tuple[str, str]] = []  # (node, endpoint) added by follow(), for the loop's thread

    def _subscribe(self, node: str, pub: str) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100000)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES + 4096)
        for topic in (TOPIC_EVENT, TOPIC_HEARTBEAT):
            sock.setsockopt(zmq.SUBSCRIBE, topic)
        sock.connect(pub)
        self._subs[sock] = node
        fd = sock.getsockopt(zmq.FD)
        self._by_fd[fd] = sock
        self._epoll.register(fd, select.EPOLLIN)
        self._unread.add(sock)

    def follow(self, node: str, pub: str, ctl: str) -> None:
        """Also follow ``node`` from now on (a spare obtained while the job runs).

        Thread-safe: the view appears at once (state unknown until the first
        snapshot or publication); the socket is connected by the thread that
        polls it, as ZeroMQ sockets must not be shared between threads.
        """
        with self._lock:
            if node in self._views:
                return
            self._views[node] = NodeView(node=node, endpoint=pub, need_snapshot=self._snapshot is not None)
            self._control[node] = ctl
            self._to_connect.append((node, pub))

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> HealthSubscriber:
        self._thread = threading.Thread(target=self._run, name="health-subscriber", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        for sock in self._subs:
            sock.close(linger=0)
        self._subs.clear()
        self._by_fd.clear()
        self._unread.clear()
        self._epoll.close()

    def __enter__(self) -> HealthSubscriber:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once(100)
            except Exception:  # keep following; log the bug
                log.exception("health subscriber loop error")
                self._stop.wait(0.1)

    # -- reading -----------------------------------------------------------
    def view(self, node: str) -> NodeView:
        with self._lock:
            return self._views[node]

    def nodes(self) -> dict[str, dict[str, Any]]:
        now = self._clock()
        with self._lock:
            return {n: v.as_dict(now) for n, v in self._views.items()}

    def brief(self) -> dict[str, tuple[str, tuple[str, ...], float | None]]:
        """Per node (state, reasons, heartbeat age): what the coordinator's health poll needs,
        without ``nodes()``'s copy of every component (16 ms a poll at 1,025 nodes)."""
        now = self._clock()
        with self._lock:
            return {n: (v.state.value, tuple(v.reasons), v.heartbeat_age(now)) for n, v in self._views.items()}

    def rails_brief(self) -> dict[str, tuple[tuple[str, str], ...]]:
        """Per node, each data rail's state as tpassd publishes it (component ``rail:NAME``):
        ((NAME, state), ...), sorted. Read only for jobs with data rails."""
        with self._lock:
            return {n: tuple(sorted((c[len("rail:"):], str(v.get("state", "unknown")))
                                    for c, v in view.components.items() if c.startswith("rail:")))
                    for n, view in self._views.items()}

    def state(self, node: str) -> State:
        with self._lock:
            return self._views[node].state

    # -- the loop body -----------------------------------------------------
    def poll_once(self, timeout_ms: int = 100) -> None:
        with self._lock:
            connect, self._to_connect = self._to_connect, []
        for node, pub in connect:
            self._subscribe(node, pub)
        deadline = self._clock() + timeout_ms / 1000.0
        while True:
            left = 0.0 if self._unread else max(0.0, deadline - self._clock())
            ready = self._epoll.poll(left)
            for fd, _ in ready:
                sock = self._by_fd.get(fd)
                if sock is not None:
                    self._unread.add(sock)
            if not ready and not self._unread:
                break  # the wait timed out
            for sock in list(self._unread):
                self._read(sock)
            if self._clock() >= deadline:
                break
        self._fetch_snapshots()
        self.expire()

    def _read(self, sock: zmq.Socket) -> None:
        """Up to DRAIN_MAX publications from ``sock``; it leaves _unread once it has none left."""
        for _ in range(DRAIN_MAX):
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._unread.discard(sock)
                return
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue  # EVENTS is re-read: it also re-arms the edge of ZMQ_FD
            self.ingest(parts, self._subs[sock])

    def _drop(self, kind: str, node: str, why: str) -> None:
        """Count a dropped publication; log the first of each kind per node (lock held)."""
        self.counters[kind] += 1
        if (kind, node) not in self._warned:
            self._warned.add((kind, node))
            log.warning("dropped publication", kind=kind, node=node, why=why)
        else:
            log.debug("dropped publication", kind=kind, node=node, why=why)

    def ingest(self, parts: list[bytes], node: str | None = None) -> None:
        """Apply one publication (topic, frame); bad ones are dropped and counted.

        ``node``: the tpassd followed on the socket it arrived on; the
        publication must name it (None: taken from the publication, for
        callers that feed publications by hand)."""
        try:
            if len(parts) != 2:
                raise ProtocolError(f"publication of {len(parts)} frames, expected 2")
            msg = wire.decode(parts[1])
            if parts[0] != msg.type.encode() or msg.type not in ("tpassd.event", "tpassd.heartbeat", "tpassd.sample"):
                raise ProtocolError(f"topic {parts[0][:40]!r} does not match type {msg.type!r}")
            if msg.seq is None or msg.sender is None:
                raise ProtocolError("publication without seq or sender")
        except ProtocolError as exc:
            with self._lock:
                self.counters["malformed"] += 1
            log.debug("dropped malformed publication", error=str(exc))
            return
        with self._lock:
            view = self._views.get(msg.sender if node is None else node)
            if view is None:
                self.counters["malformed"] += 1
                return
            if msg.sender != view.node or msg.body.get("node") != view.node:
                self._drop("wrong_sender", view.node, f"the publisher followed as {view.node} sent a publication "
                           f"from {str(msg.sender)[:64]!r} about node {str(msg.body.get('node'))[:64]!r}")
                return
            body = msg.body
            try:
                check_publication(msg.type, body, msg.seq)
                if body.get("incarnation") == view.incarnation and msg.seq <= view.received_seq:
                    raise OutOfRange(f"seq {msg.seq} does not follow {view.received_seq}")
            except OutOfRange as exc:
                self._drop("out_of_range", view.node, str(exc))
                return
            before = view.state
            if body.get("incarnation") != view.incarnation:
                # A restarted (or first seen) publisher: its seq starts afresh.
                if view.incarnation is not None:
                    log.info("publisher restarted", node=view.node)
                view.incarnation = body.get("incarnation")
                view.seq = -1
                view.last_event_seq = -1
                view.need_snapshot = self._snapshot is not None
            view.received_seq = msg.seq
            if msg.type == "tpassd.heartbeat":
                view.last_heartbeat = self._clock()
                view.interval_s = float(body["interval_s"])
                if not view.need_snapshot and body["last_event_seq"] > view.last_event_seq:
                    self._gap(view, f"heartbeat says last event {body['last_event_seq']}, "
                                    f"applied {view.last_event_seq}")
                view.seq = max(view.seq, msg.seq)
            elif msg.type == "tpassd.event":
                view.last_heartbeat = self._clock()  # any word from it proves it alive
                if view.need_snapshot:
                    pass  # the snapshot will carry it (or a newer state)
                elif msg.seq <= view.last_event_seq:
                    pass  # older than what we have
                elif body["prev_event_seq"] != view.last_event_seq:
                    self._gap(view, f"event {msg.seq} follows {body['prev_event_seq']}, "
                                    f"applied {view.last_event_seq}")
                    if self._snapshot is None:
                        self._apply_event(view, msg.seq, body)  # best effort: no snapshot source
                else:
                    self._apply_event(view, msg.seq, body)
            self._refresh(view)
            after = view.state
        if after != before and self._on_change is not None:
            self._on_change(view, before)

    def _gap(self, view: NodeView, why: str) -> None:
        view.gaps += 1
        self.counters["gaps"] += 1
        view.need_snapshot = self._snapshot is not None
        log.info("gap in publisher sequence; re-reading snapshot", node=view.node, why=why)

    @staticmethod
    def _apply_event(view: NodeView, seq: int, body: dict[str, Any]) -> None:
        comp = body["component"]
        if comp == "node":
            view.reported_state = State(body["state"])
            view.reported_reasons = list(body["reasons"])
        else:
            view.components[comp] = {"state": body["state"], "reasons": list(body["reasons"])}
        view.seq = max(view.seq, seq)
        view.last_event_seq = seq

    def apply_snapshot(self, node: str, result: dict[str, Any]) -> None:
        with self._lock:
            view = self._views[node]
            before = view.state
            try:
                if result.get("node", node) != node:
                    raise ValueError(f"snapshot of node {result.get('node')!r}")
                _number(result, "seq", -1, MAX_SEQ)  # -1: nothing published yet
                check_publication("tpassd.health", result)
                if str(result["incarnation"]) != view.incarnation:
                    view.received_seq = -1  # a restarted publisher counts its seq afresh
                view.incarnation = str(result["incarnation"])
                view.seq = int(result["seq"])
                view.last_event_seq = int(result["last_event_seq"])
                view.reported_state = State(result["state"])
                view.reported_reasons = [str(r) for r in result["reasons"]]
                view.components = {
                    str(c): {"state": State(v["state"]).value, "reasons": [str(r) for r in v["reasons"]]}
                    for c, v in result["components"].items()
                }
                view.interval_s = float(result["interval_s"])
            except (KeyError, TypeError, ValueError, AttributeError, OutOfRange) as exc:
                self.counters["malformed"] += 1
                log.warning("malformed health snapshot", node=node, error=repr(exc))
                return
            view.need_snapshot = False
            if view.last_heartbeat is None:
                view.last_heartbeat = self._clock()
            self.counters["snapshots"] += 1
            self._refresh(view)
            after = view.state
        if after != before and self._on_change is not None:
            self._on_change(view, before)

    def _fetch_snapshots(self) -> None:
        if self._snapshot is None:
            return
        now = self._clock()
        with self._lock:
            wanted = [n for n, v in self._views.items() if v.need_snapshot]
        for node in wanted:
            # Do not hammer a dead node: one try per heartbeat interval.
            last = self._last_snapshot_try.get(node, -1e18)
            if now - last < self._views[node].interval_s:
                continue
            self._last_snapshot_try[node] = now
            try:
                result = self._snapshot(node, self._control[node])
            except TorchpassError as exc:
                with self._lock:
                    self.counters["snapshot_failures"] += 1
                log.debug("health snapshot failed", node=node, error=str(exc))
                continue
            self.apply_snapshot(node, result)

    def expire(self) -> None:
        now = self._clock()
        changed = []
        with self._lock:
            for view in self._views.values():
                before = view.state
                self._refresh(view, now)
                if view.state != before:
                    changed.append((view, before))
        if self._on_change is not None:
            for view, before in changed:
                self._on_change(view, before)

    def _refresh(self, view: NodeView, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        age = view.heartbeat_age(now)
        window = self.missed_heartbeats * view.interval_s
        if age is None:
            view.state, view.reasons = State.UNKNOWN, ["no heartbeat seen yet"]
        elif age > window:
            view.state = State.UNKNOWN
            view.reasons = [f"no heartbeat for {age:.1f} s ({self.missed_heartbeats} intervals of "
                            f"{view.interval_s:g} s missed)"]
        elif view.need_snapshot:
            view.state, view.reasons = State.UNKNOWN, ["waiting for a health snapshot"]
        else:
            view.state, view.reasons = view.reported_state, list(view.reported_reasons)
