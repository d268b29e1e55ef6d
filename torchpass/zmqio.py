"""ZeroMQ request/reply helpers shared by tpassd, the coordinator and tpassctl.

Client side: Lazy Pirate (the ZeroMQ guide, ch. 4). ``request()``: a REQ
socket with LINGER 0 sends, polls for the reply, and on a time-out closes the
socket and retries on a fresh one; after the last try it raises
UnreachableError. ``Client``: the same, over one DEALER socket kept across
requests (closed and reopened only after a time-out), for a peer that asks
often (a rank's reports to its coordinator).

Server side: a ROUTER socket whose frames are handed to ``serve_one``, which
decodes, authenticates through an optional hook, dispatches by message type
and always answers: a bad frame gets an error reply with a stable code, a
handler's TorchpassError its message, a bug the code ``internal`` (the
traceback goes to the server's log, never to the client).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import structlog
import zmq

from torchpass import wire
from torchpass.errors import (
    AuthError,
    ConfigError,
    DependencyError,
    ProtocolError,
    RemoteError,
    TorchpassError,
    UnreachableError,
)

log = structlog.get_logger("torchpass.zmqio")

Handler = Callable[[wire.Message], dict[str, Any] | None]


@runtime_checkable
class Signer(Protocol):
    """Signs every try of a request: the envelope fields (auth, seq, sender) for it."""

    def envelope(self, type_: str, id_: str, body: dict[str, Any]) -> dict[str, Any]: ...


@runtime_checkable
class ReplyOpener(Protocol):
    """Checks the MAC of the reply to a try it signed (torchpass.jobauth.JobSigner): the reply's
    bytes as sealed, or None (a reply with no or a wrong MAC: dropped, the try waits on)."""

    def open_reply(self, envelope: dict[str, Any], frame: bytes) -> bytes | None: ...


def _frame(type_: str, body: dict[str, Any] | None, auth) -> tuple[str, bytes, Callable[[bytes], bytes | None] | None]:
    """One try's request id, frame (a fresh id, and a fresh credential or signature, per try) and
    what opens its reply (None: a reply is taken as it comes)."""
    id_ = wire.new_id()
    opener = None
    if isinstance(auth, Signer):
        envelope = auth.envelope(type_, id_, body or {})
        if isinstance(auth, ReplyOpener):
            def opener(frame: bytes, _env=envelope) -> bytes | None:
                return auth.open_reply(_env, frame)
    else:
        envelope = {"auth": auth() if callable(auth) else auth}
    return id_, wire.encode(type_, body or {}, id=id_, **envelope), opener


def _reply_to(frame: bytes, id_: str, opener: Callable[[bytes], bytes | None] | None) -> wire.Reply | None:
    """The reply to request ``id_`` in ``frame``; None for anything else: not a reply, a late reply
    to an earlier try (dropped silently), or one whose MAC ``opener`` refuses (it says why)."""
    try:
        reply = wire.decode_reply(frame)
        if reply.id != id_:
            return None
        if opener is None:
            return reply
        sealed = opener(frame)
        return None if sealed is None else wire.decode_reply(sealed)
    except ProtocolError:
        return None


def request(
    endpoint: str,
    type_: str,
    body: dict[str, Any] | None = None,
    *,
    timeout_s: float = 2.0,
    retries: int = 2,
    auth: str | Callable[[], str | None] | Signer | None = None,
    context: zmq.Context | None = None,
) -> dict[str, Any]:
    """Send one request and return the reply's result (Lazy Pirate).

    ``auth`` may be a callable so that each retry carries a fresh credential
    (munge credentials are single-use), or a Signer (torchpass.jobauth) that
    signs each try. Raises UnreachableError when no reply comes after
    ``retries`` + 1 tries, RemoteError on an error reply.
    """
    ctx = context or zmq.Context.instance()
    last_exc: Exception | None = None
    for _attempt in range(retries + 1):
        id_, frame, opener = _frame(type_, body, auth)
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            sock.send(frame)
            if sock.poll(int(timeout_s * 1000), zmq.POLLIN):
                raw = sock.recv()
                if opener is None:
                    return wire.decode_reply(raw).unwrap()
                reply = _reply_to(raw, id_, opener)
                if reply is not None:  # else a reply that is not this job's: as no reply
                    return reply.unwrap()
        except zmq.ZMQError as exc:
            last_exc = exc
        finally:
            sock.close(linger=0)
    why = f": {last_exc}" if last_exc else ""
    raise UnreachableError(
        f"no reply from {endpoint} to {type_} after {retries + 1} tries of {timeout_s:g} s{why}"
    )


# --- persistent client ----------------------------------------------------------------------
# A REQ socket per request costs a TCP connect and a ZMTP handshake on both sides; at thousands of
# ranks that was most of the coordinator's cost per request (docs/benchmarks.md, "Coordinator at
# scale"). Client keeps one DEALER socket per peer across requests and frames each request as a
# REQ socket would ([b"", frame]), so a ROUTER server (serve_one, the coordinator's batch) sees no
# difference. The reply is matched by request id: a late reply to an earlier try is dropped.


def dealer_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """A DEALER socket connected to ``endpoint``, as Client uses it (LINGER 0: a close drops
    whatever is still queued, so nothing of a timed-out try is sent later)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def send_request(sock: zmq.Socket, frame: bytes) -> None:
    """Send one request frame on a DEALER socket, in a REQ envelope; zmq.Again if it cannot queue."""
    sock.send_multipart([b"", frame], zmq.NOBLOCK)


def recv_reply(sock: zmq.Socket, id_: str, opener: Callable[[bytes], bytes | None] | None = None) -> wire.Reply | None:
    """Read one message from a DEALER socket: the reply to request ``id_``, or None for anything
    else (a late reply to an earlier try, a frame that is not a reply, one whose MAC ``opener``
    refuses)."""
    parts = sock.recv_multipart(zmq.NOBLOCK)
    if len(parts) != 2 or parts[0] != b"":
        return None
    return _reply_to(parts[1], id_, opener)


# How often a request with ``abandon`` and no ``wake_fd`` asks whether to give up waiting.
ABANDON_CHECK_S = 0.01


def drain_fd(fd: int) -> None:
    """Empty a non-blocking wake-up pipe (its bytes only say "look again")."""
    try:
        while os.read(fd, 4096):
            pass
    except (BlockingIOError, InterruptedError):
        pass


class Client:
    """``request()`` over one kept connection to ``endpoint``.

    Same contract as ``request()``: ``retries`` + 1 tries of ``timeout_s`` each, ``auth`` signed
    per try, UnreachableError when no try got a reply, RemoteError on an error reply. A try that
    times out closes the socket and the next try reconnects on a fresh one (Lazy Pirate: a peer
    that restarted, or a request stuck in a dead connection, is not waited for twice).

    ``context`` is a zmq.Context or a callable returning the one to use now (the rank runtime
    destroys its context at a hold and opens a fresh one after): a socket whose context was
    closed, or that was made in another process (fork; a CRIU restore of a holding rank has none),
    is dropped and made again, lazily, at the next request. Requests from several threads are
    serialised by a lock (a zmq socket is not thread-safe); ``close()`` may be called from any
    thread.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float = 2.0,
        retries: int = 2,
        auth: str | Callable[[], str | None] | Signer | None = None,
        context: zmq.Context | Callable[[], zmq.Context] | None = None,
    ):
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.retries = retries
        self.auth = auth
        self._context = context
        self._lock = threading.Lock()
        self._sock: zmq.Socket | None = None
        self._pid = 0  # of the process that made _sock
        self.connects = 0  # sockets made so far (tests, and a reconnect count for logs)

    def _ctx(self) -> zmq.Context:
        c = self._context
        if c is None:
            return zmq.Context.instance()  # pyzmq makes a new instance in a forked child
        return c if isinstance(c, zmq.Context) else c()

    def _socket(self) -> zmq.Socket:
        ctx = self._ctx()
        sock = self._sock
        if sock is not None and (self._pid != os.getpid() or sock.closed or sock.context is not ctx):
            if self._pid == os.getpid() and not sock.closed:
                sock.close(linger=0)
            # else: another process's socket (fork) or one closed with its context: never touch it
            sock = self._sock = None
        if sock is None:
            sock = self._sock = dealer_socket(ctx, self.endpoint)
            self._pid = os.getpid()
            self.connects += 1
        return sock

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None and self._pid == os.getpid() and not sock.closed:
            sock.close(linger=0)

    def close(self) -> None:
        """Close the connection (the next request opens a new one)."""
        with self._lock:
            self._drop()

    def request(self, type_: str, body: dict[str, Any] | None = None, *, timeout_s: float | None = None,
                retries: int | None = None, abandon: Callable[[], bool] | None = None,
                wake_fd: int | None = None) -> dict[str, Any] | None:
        """The reply's result; with ``abandon``, None as soon as ``abandon()`` is true while waiting
        (a long poll given up for a request that cannot wait). The connection is kept then: the
        server's late answer is dropped by its id. ``abandon()`` is asked when ``wake_fd`` (the
        read end of a non-blocking pipe that the caller writes to when abandon() may have become
        true) is readable; without one, every ABANDON_CHECK_S. A rank long-polls all the time it
        trains: a wake-up every 10 ms in every rank would take the GIL from training."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        retries = self.retries if retries is None else retries
        auth = self.auth
        last_exc: Exception | None = None
        with self._lock:
            for _attempt in range(retries + 1):
                id_, frame, opener = _frame(type_, body, auth)
                try:
                    sock = self._socket()
                    send_request(sock, frame)
                    deadline = time.monotonic() + timeout_s
                    poller = None
                    if abandon is not None and wake_fd is not None:
                        poller = zmq.Poller()
                        poller.register(sock, zmq.POLLIN)
                        poller.register(wake_fd, zmq.POLLIN)
                    while (left := deadline - time.monotonic()) > 0:
                        if abandon is not None:
                            if abandon():
                                return None
                            if poller is None:
                                left = min(left, ABANDON_CHECK_S)
                        if poller is not None:
                            ready = dict(poller.poll(int(left * 1000) + 1))
                            if wake_fd in ready:
                                drain_fd(wake_fd)
                            if sock not in ready:
                                continue
                        elif not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                            continue
                        reply = recv_reply(sock, id_, opener)
                        if reply is not None:
                            return reply.unwrap()
                except zmq.ZMQError as exc:  # zmq.Again too: the queue to the peer is full
                    last_exc = exc
                self._drop()  # no reply in time: the next try on a fresh connection
        why = f": {last_exc}" if last_exc else ""
        raise UnreachableError(
            f"no reply from {self.endpoint} to {type_} after {retries + 1} tries of {timeout_s:g} s{why}"
        )


def error_code(exc: TorchpassError) -> str:
    """The stable wire error code of a TorchpassError."""
    return _error_code(exc)


def _error_code(exc: TorchpassError) -> str:
    if isinstance(exc, RemoteError):
        return exc.code if exc.code in wire.ERROR_CODES else "failed"
    if isinstance(exc, ProtocolError):
        return "bad_request"
    if isinstance(exc, AuthError):
        return getattr(exc, "code", "unauthenticated")
    if isinstance(exc, DependencyError):
        return "unavailable"
    if isinstance(exc, ConfigError):
        return "bad_request"
    return getattr(exc, "code", "failed")


def handle_frame(
    frame: bytes,
    handlers: dict[str, Handler],
    *,
    authenticate: Callable[[wire.Message], None] | None = None,
    counters: dict[str, int] | None = None,
) -> bytes:
    """Turn one request frame into one reply frame; never raises."""
    try:
        msg = wire.decode(frame)
    except ProtocolError as exc:
        if counters is not None:
            counters["malformed"] = counters.get("malformed", 0) + 1
        text = str(exc)
        code = "unsupported_version" if "schema version" in text else (
            "unknown_type" if "unknown message type" in text else "bad_request")
        return wire.encode_error(wire.peek_id(frame), code, text)
    handler = handlers.get(msg.type)
    if handler is None:
        return wire.encode_error(msg.id, "unknown_type", f"this server does not serve {msg.type!r}")

    def run() -> dict[str, Any] | None:
        if authenticate is not None:
            authenticate(msg)
        return handler(msg)

    return reply_for(msg, run, counters=counters)


def reply_for(msg: wire.Message, run: Callable[[], dict[str, Any] | None], *,
              counters: dict[str, int] | None = None) -> bytes:
    """The reply frame to ``msg``: ``run()``'s result, or its error with a stable code; never raises."""
    try:
        result = run() or {}
        return wire.encode_ok(msg.id, result)
    except TorchpassError as exc:
        if counters is not None and isinstance(exc, AuthError):
            counters["auth_failed"] = counters.get("auth_failed", 0) + 1
        log.warning("request refused", type=msg.type, error=str(exc))
        return wire.encode_error(msg.id, _error_code(exc), str(exc))
    except Exception:  # a handler bug must not kill the server
        log.exception("request handler failed", type=msg.type)
        return wire.encode_error(msg.id, "internal", f"{msg.type} failed inside the server; see its log")


def send_bundle(sock: zmq.Socket, items: list[tuple[bytes, bytes]], *, to: bytes | None = None) -> bool:
    """Send (identity, frame) items as node-relay bundles (wire.RELAY_BUNDLE), as few as fit under
    wire.MAX_FRAME_BYTES each (a peer's MAXMSGSIZE, bind_router, disconnects a larger frame); ``to``:
    the ROUTER peer they go to. False when the peer's queue was full (the items not sent: their ranks
    ask again)."""
    head = [wire.RELAY_BUNDLE] if to is None else [to, wire.RELAY_BUNDLE]
    chunk: list[tuple[bytes, bytes]] = []
    size = 0
    try:
        for ident, frame in items:
            n = wire.BUNDLE_ITEM_OVERHEAD + len(ident) + len(frame)
            if chunk and size + n > wire.MAX_FRAME_BYTES:
                sock.send_multipart([*head, wire.pack_bundle(chunk)], zmq.NOBLOCK)
                chunk, size = [], 0
            chunk.append((ident, frame))
            size += n
        if chunk:
            sock.send_multipart([*head, wire.pack_bundle(chunk)], zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False


def serve_one(sock: zmq.Socket, handlers: dict[str, Handler], *, bundles: bool = False, **kw) -> None:
    """Read one multipart message from a ROUTER socket and reply to it.

    Frames that do not look like a REQ envelope (identity, empty, payload)
    are dropped: there is nobody to reply to. With ``bundles``, a node relay's
    bundle (wire.RELAY_BUNDLE, torchpass/runtime/relay.py) is served item by
    item and answered with one bundle, as the coordinator does.
    """
    parts = sock.recv_multipart(copy=True)
    if bundles and len(parts) == 3 and parts[1] == wire.RELAY_BUNDLE:
        try:
            items = wire.unpack_bundle(parts[2])
        except ProtocolError:
            items = None
        if items is not None:
            send_bundle(sock, [(ident, handle_frame(frame, handlers, **kw)) for ident, frame in items], to=parts[0])
            return
    if len(parts) < 3 or parts[-2] != b"":
        counters = kw.get("counters")
        if counters is not None:
            counters["dropped"] = counters.get("dropped", 0) + 1
        return
    reply = handle_frame(parts[-1], handlers, **kw)
    sock.send_multipart(parts[:-1] + [reply])


def bind_router(ctx: zmq.Context, address: str, port: int = 0, *, rcvhwm: int | None = None
                ) -> tuple[zmq.Socket, int]:
    """Bind a ROUTER socket to ``tcp://address:port`` (0 = ephemeral); return it and its port.
    ``rcvhwm``: frames queued per peer before ZeroMQ stops reading that peer (ZeroMQ's default
    is 1,000; each may be MAX_FRAME_BYTES)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES + 4096)
    if rcvhwm is not None:
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
    if port:
        sock.bind(f"tcp://{address}:{port}")
        return sock, port
    bound = sock.bind_to_random_port(f"tcp://{address}", min_port=20000, max_port=60000)
    return sock, bound
