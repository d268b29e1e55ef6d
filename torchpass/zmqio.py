"""ZeroMQ request/reply helpers shared by tpassd, the coordinator and tpassctl.

Client side: Lazy Pirate (the ZeroMQ guide, ch. 4). A REQ socket with
LINGER 0 sends, polls for the reply, and on a time-out closes the socket and
retries on a fresh one; after the last try it raises UnreachableError.

Server side: a ROUTER socket whose frames are handed to ``serve_one``, which
decodes, authenticates through an optional hook, dispatches by message type
and always answers: a bad frame gets an error reply with a stable code, a
handler's TorchpassError its message, a bug the code ``internal`` (the
traceback goes to the server's log, never to the client).
"""

from __future__ import annotations

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
        id_ = wire.new_id()
        if isinstance(auth, Signer):
            envelope = auth.envelope(type_, id_, body or {})
        else:
            envelope = {"auth": auth() if callable(auth) else auth}
        frame = wire.encode(type_, body or {}, id=id_, **envelope)
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            sock.send(frame)
            if sock.poll(int(timeout_s * 1000), zmq.POLLIN):
                return wire.decode_reply(sock.recv()).unwrap()
        except zmq.ZMQError as exc:
            last_exc = exc
        finally:
            sock.close(linger=0)
    why = f": {last_exc}" if last_exc else ""
    raise UnreachableError(
        f"no reply from {endpoint} to {type_} after {retries + 1} tries of {timeout_s:g} s{why}"
    )


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
    try:
        if authenticate is not None:
            authenticate(msg)
        result = handler(msg) or {}
        return wire.encode_ok(msg.id, result)
    except TorchpassError as exc:
        if counters is not None and isinstance(exc, AuthError):
            counters["auth_failed"] = counters.get("auth_failed", 0) + 1
        log.warning("request refused", type=msg.type, error=str(exc))
        return wire.encode_error(msg.id, _error_code(exc), str(exc))
    except Exception:  # noqa: BLE001 - a handler bug must not kill the server
        log.exception("request handler failed", type=msg.type)
        return wire.encode_error(msg.id, "internal", f"{msg.type} failed inside the server; see its log")


def serve_one(sock: zmq.Socket, handlers: dict[str, Handler], **kw) -> None:
    """Read one multipart message from a ROUTER socket and reply to it.

    Frames that do not look like a REQ envelope (identity, empty, payload)
    are dropped: there is nobody to reply to.
    """
    parts = sock.recv_multipart(copy=True)
    if len(parts) < 3 or parts[-2] != b"":
        counters = kw.get("counters")
        if counters is not None:
            counters["dropped"] = counters.get("dropped", 0) + 1
        return
    reply = handle_frame(parts[-1], handlers, **kw)
    sock.send_multipart(parts[:-1] + [reply])


def bind_router(ctx: zmq.Context, address: str, port: int = 0) -> tuple[zmq.Socket, int]:
    """Bind a ROUTER socket to ``tcp://address:port`` (0 = ephemeral); return it and its port."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES + 4096)
    if port:
        sock.bind(f"tcp://{address}:{port}")
        return sock, port
    bound = sock.bind_to_random_port(f"tcp://{address}", min_port=20000, max_port=60000)
    return sock, bound
