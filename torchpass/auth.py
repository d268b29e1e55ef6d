"""Request authentication with munge, shared by tpassd and the coordinator.

A client makes a munge credential whose payload is a digest of the request
it authorises (``request_digest``: type, body and the target), and puts it
in the envelope's ``auth`` field. The server decodes it with munged, which
proves the uid/gid, rejects forged, expired (TTL) and replayed (single-use)
credentials, and then checks that the payload matches the request it came
with, so a captured credential cannot authorise any other request.

libmunge.so.2 is called through ctypes; the socket path is settable (the
devcluster runs munged on a non-default socket, exported as MUNGE_SOCKET).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import os
import threading
from dataclasses import dataclass
from typing import Any

from torchpass.errors import AuthError, DependencyError

# munge.h
MUNGE_OPT_TTL = 4
MUNGE_OPT_SOCKET = 8
EMUNGE_SOCKET = 6
EMUNGE_TIMEOUT = 7
EMUNGE_CRED_EXPIRED = 15
EMUNGE_CRED_REWOUND = 16
EMUNGE_CRED_REPLAYED = 17
_SERVICE_ERRORS = {EMUNGE_SOCKET, EMUNGE_TIMEOUT, 1, 5}  # socket, timeout, snafu, no memory


class AuthFailure(AuthError):
    """An AuthError with the stable wire code: "unauthenticated" or "forbidden"."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Identity:
    uid: int
    gid: int


_lib = None
_libc = None
_lib_lock = threading.Lock()


def _load():
    global _lib, _libc
    with _lib_lock:
        if _lib is not None:
            return _lib, _libc
        name = ctypes.util.find_library("munge") or "libmunge.so.2"
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            try:
                lib = ctypes.CDLL("libmunge.so.2")
            except OSError:
                raise DependencyError(
                    "libmunge.so.2 was not found; install munge (apt-get install munge libmunge2)"
                ) from None
        lib.munge_ctx_create.restype = ctypes.c_void_p
        lib.munge_ctx_destroy.argtypes = [ctypes.c_void_p]
        lib.munge_ctx_strerror.restype = ctypes.c_char_p
        lib.munge_ctx_strerror.argtypes = [ctypes.c_void_p]
        lib.munge_strerror.restype = ctypes.c_char_p
        lib.munge_strerror.argtypes = [ctypes.c_int]
        lib.munge_encode.restype = ctypes.c_int
        lib.munge_encode.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        lib.munge_decode.restype = ctypes.c_int
        lib.munge_decode.argtypes = [
            ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int),
            ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
        ]
        libc = ctypes.CDLL(None)
        libc.free.argtypes = [ctypes.c_void_p]
        _lib, _libc = lib, libc
        return lib, libc


def default_socket() -> str | None:
    """TORCHPASS_MUNGE_SOCKET, then MUNGE_SOCKET, else libmunge's default socket."""
    return os.environ.get("TORCHPASS_MUNGE_SOCKET") or os.environ.get("MUNGE_SOCKET") or None


def _ctx(lib, socket: str | None, ttl: int | None):
    ctx = lib.munge_ctx_create()
    if not ctx:
        raise DependencyError("munge_ctx_create failed (out of memory?)")
    if socket:
        rc = lib.munge_ctx_set(ctypes.c_void_p(ctx), ctypes.c_int(MUNGE_OPT_SOCKET),
                               ctypes.c_char_p(os.fsencode(socket)))
        if rc != 0:
            lib.munge_ctx_destroy(ctx)
            raise DependencyError(f"cannot set munge socket {socket}: error {rc}")
    if ttl is not None:
        rc = lib.munge_ctx_set(ctypes.c_void_p(ctx), ctypes.c_int(MUNGE_OPT_TTL), ctypes.c_int(ttl))
        if rc != 0:
            lib.munge_ctx_destroy(ctx)
            raise DependencyError(f"cannot set munge TTL {ttl}: error {rc}")
    return ctx


def _err(lib, ctx, rc: int) -> str:
    msg = lib.munge_ctx_strerror(ctx) if ctx else None
    if not msg:
        msg = lib.munge_strerror(rc)
    return (msg or b"munge error").decode(errors="replace")


def make_credential(payload: bytes, socket: str | None = None, ttl: int | None = None) -> str:
    """A munge credential carrying ``payload`` for the calling uid/gid."""
    lib, libc = _load()
    socket = socket or default_socket()
    ctx = _ctx(lib, socket, ttl)
    out = ctypes.c_char_p()
    try:
        rc = lib.munge_encode(ctypes.byref(out), ctx, payload, len(payload))
        if rc != 0:
            raise DependencyError(
                f"munge could not encode a credential via {socket or 'the default socket'}: "
                f"{_err(lib, ctx, rc)}; is munged running?"
            )
        return out.value.decode()
    finally:
        if out:
            libc.free(ctypes.cast(out, ctypes.c_void_p))
        lib.munge_ctx_destroy(ctx)


def verify(cred: str | None, payload: bytes, socket: str | None = None) -> Identity:
    """Decode ``cred`` with munged; it must carry exactly ``payload``.

    AuthFailure("unauthenticated") for a missing, forged, expired, replayed or
    mismatched credential; DependencyError when munged cannot be asked.
    """
    if not cred:
        raise AuthFailure("unauthenticated", "request carries no munge credential")
    if not isinstance(cred, str) or len(cred) > 8192 or not cred.isascii():
        raise AuthFailure("unauthenticated", "credential is not a munge credential")
    lib, libc = _load()
    socket = socket or default_socket()
    ctx = _ctx(lib, socket, None)
    buf = ctypes.c_void_p()
    length = ctypes.c_int(0)
    uid = ctypes.c_uint32(0)
    gid = ctypes.c_uint32(0)
    try:
        rc = lib.munge_decode(cred.encode(), ctx, ctypes.byref(buf), ctypes.byref(length),
                              ctypes.byref(uid), ctypes.byref(gid))
        data = ctypes.string_at(buf, length.value) if buf and length.value > 0 else b""
        if rc in _SERVICE_ERRORS:
            raise DependencyError(
                f"munged could not be asked via {socket or 'the default socket'}: {_err(lib, ctx, rc)}")
        if rc == EMUNGE_CRED_EXPIRED:
            raise AuthFailure("unauthenticated", "munge credential expired")
        if rc == EMUNGE_CRED_REPLAYED:
            raise AuthFailure("unauthenticated", "munge credential replayed")
        if rc == EMUNGE_CRED_REWOUND:
            raise AuthFailure("unauthenticated", "munge credential is from the future (clock skew)")
        if rc != 0:
            raise AuthFailure("unauthenticated", f"invalid munge credential: {_err(lib, ctx, rc)}")
        if data != payload:
            raise AuthFailure("unauthenticated", "munge credential was made for a different request")
        return Identity(int(uid.value), int(gid.value))
    finally:
        if buf:
            libc.free(buf)
        lib.munge_ctx_destroy(ctx)


def request_digest(type_: str, body: dict[str, Any], target: str) -> bytes:
    """What a credential authorises: this request type with this body, to this target."""
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    h = hashlib.sha256()
    for part in ("torchpass-auth-v1", type_, target, canon):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest().encode()


def credential_for(type_: str, body: dict[str, Any] | None, target: str, socket: str | None = None):
    """A zero-argument callable for zmqio.request(auth=...): a fresh credential per try."""
    b = dict(body or {})
    return lambda: make_credential(request_digest(type_, b, target), socket)


def job_target(job_id: int) -> str:
    """The target a credential for a job's coordinator names (request_digest)."""
    return f"job:{job_id}"


def optional_credential_for(type_: str, body: dict[str, Any] | None, target: str, socket: str | None = None):
    """As credential_for, but None where munge cannot make one: for requests a server may take
    without one (job.status / job.events when Slurm's PrivateData does not hide jobs)."""
    make = credential_for(type_, body, target, socket)

    def cred() -> str | None:
        try:
            return make()
        except DependencyError:
            return None

    return cred
