"""Per-job message authentication: rank.* requests signed with the job's secret.

munge proves a uid, not a job: two jobs of one user look the same to it. So
the SPANK plugin makes a random secret for each job (32 bytes from
getrandom, as 64 hex digits) when it starts the job's coordinator in the
batch step. It hands the secret to the coordinator on a pipe
(``--secret-fd``: never on a command line, never in the coordinator's
environment) and exports it to the job as TORCHPASS_JOB_SECRET, so every
step's tasks carry it (a restored rank keeps its environment through CRIU).

A signed request uses the one wire envelope (torchpass.wire):

* ``sender``: a random id the signing process picks once (16 hex digits);
* ``seq``: that sender's request counter, 1, 2, ... (every try of a request
  is signed anew, with the next number);
* ``auth``: ``"job1:<t_ms>:<hmac>"``: the sender's wall clock in
  milliseconds and HMAC-SHA256 under the secret over ``canonical()``:
  the type, id, sender, seq, t_ms and the body (JSON, sorted keys).

``JobVerifier`` refuses (AuthFailure "unauthenticated") a request with no or
a malformed ``auth``, a MAC that does not match (another job's secret, a
changed body or envelope), a timestamp more than ``window_s`` away from its
clock, or a seq not above the last one accepted from that sender (a replay).
A sender's counter is forgotten once its last request is older than the
window: anything it sent before is refused by the timestamp check then.

A process restored by CRIU continues its source's sender and counter; the
source copy sends nothing after its dump (it waits for its hold file and is
killed, or resumed instead of the restored copy), so exactly one copy ever
continues the counter. A copy restored from a whole-job snapshot is the
exception: its source went on after the snapshot, past the counter in the
image, so the copy takes a new sender (``JobSigner.renew``) when it wakes.

Replies are signed too. Whoever answers a rank's socket (a server squatting the
coordinator's port once it is gone, or one a forged pause names through its
hold file) could otherwise command the rank: pause it, hold it, point it at
another coordinator. So the coordinator ends each reply to a verified rank.*
request with ``,"auth":"job1:<hmac>"}``: HMAC-SHA256 under the secret over
``reply_canonical()``: the request's sender and seq, then the reply's bytes
as they were before the field was added (``ReplySealer.seal``). The rank
(``JobSigner.open_reply``) checks it against the sender and seq of the try it
waits on, so a reply cannot be moved to another request or another rank, and
reads only the bytes the MAC covers. A reply with no MAC or a wrong one is
dropped with one line (``on_refused``); the rank keeps waiting for the real
one. The coordinator seals no reply to a request it refused as
unauthenticated: its sender and seq are unproven, and a sealed refusal for a
chosen (sender, seq) would be a reply anyone could ask for in advance. So the
rank takes that one reply unsealed: an error with code ``unauthenticated``
(a rank of another job, a replay, a clock out of the window), which carries
no result and no command and fails the try as no answer would.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from torchpass import envnames
from torchpass.auth import AuthFailure
from torchpass.errors import ConfigError

ENV_VAR = envnames.JOB_SECRET
SCHEME = "job1"
WINDOW_S = 300.0  # as munge's default credential TTL: Slurm already needs clocks this close
MAX_SENDERS = 1 << 16

_SECRET_RE = re.compile(r"[0-9a-f]{64}")
_SENDER_RE = re.compile(r"[0-9a-f]{16}")
_AUTH_RE = re.compile(r"job1:([0-9]{1,15}):([0-9a-f]{64})")


def parse_secret(text: str | bytes, source: str = ENV_VAR) -> bytes:
    """The secret as the HMAC key; ConfigError unless it is 64 lowercase hex digits."""
    if isinstance(text, bytes):
        text = text.decode("ascii", errors="replace")
    text = text.strip()
    if not _SECRET_RE.fullmatch(text):
        raise ConfigError(f"{source} is not a torchpass job secret (64 hex digits)")
    return text.encode()


def read_secret_fd(fd: int) -> bytes:
    """Read the secret the plugin wrote to ``fd`` (a pipe), then close it."""
    chunks = []
    try:
        while sum(map(len, chunks)) < 256:
            chunk = os.read(fd, 256)
            if not chunk:
                break
            chunks.append(chunk)
    except OSError as exc:
        raise ConfigError(f"cannot read the job secret from fd {fd}: {exc.strerror}") from None
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    return parse_secret(b"".join(chunks), f"the job secret on fd {fd}")


def canonical(type_: str, id_: str, sender: str, seq: int, t_ms: int, body: Mapping[str, Any]) -> bytes:
    """The bytes a job MAC covers: everything the request says."""
    canon = json.dumps(dict(body), sort_keys=True, separators=(",", ":"), allow_nan=False)
    return b"\0".join(p.encode() for p in ("torchpass-job-v1", type_, id_, sender, str(seq), str(t_ms), canon))


def _mac(key: bytes, data: bytes) -> str:
    return hmac.new(key, data, hashlib.sha256).hexdigest()


REPLY_DOMAIN = b"torchpass-job-reply-v1"
_REPLY_HEAD = b',"auth":"job1:'
_REPLY_TAIL = len(_REPLY_HEAD) + 64 + 2  # the field, its 64 hex digits, '"}'
_HEX = frozenset(b"0123456789abcdef")


def reply_canonical(sender: str, seq: int, reply: bytes) -> bytes:
    """The bytes a reply's MAC covers: the request's sender and seq, then the unsealed reply."""
    return b"%s\0%s\0%d\0%s" % (REPLY_DOMAIN, sender.encode(), seq, reply)


class ReplySealer:
    """The coordinator's side: ``seal(sender, seq, reply)``, the reply with its MAC.

    HMAC-SHA256 (RFC 2104) with the key's inner and outer pads hashed once: a pause or a resume
    seals one reply per rank, and ``hmac.new`` per reply spends most of its time on the key.
    Measured on the 2-core dev VM (a 324-byte pause reply): 5.9 us a reply against 10.4 us with
    a copied ``hmac.HMAC`` and 2.6 us for encoding the reply itself (wire.encode_ok_raw);
    tests/unit/test_job_auth.py checks that it equals ``hmac``'s."""

    __slots__ = ("_inner", "_outer")

    def __init__(self, secret: bytes):
        key = hashlib.sha256(secret).digest() if len(secret) > 64 else secret
        key = key.ljust(64, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in key))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))

    def mac(self, data: bytes) -> str:
        inner = self._inner.copy()
        inner.update(data)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.hexdigest()

    def seal(self, sender: str, seq: int, reply: bytes) -> bytes:
        """``reply`` (one JSON object, as wire encodes it) with ``"auth"`` added as its last field."""
        return b'%s%s%s"}' % (reply[:-1], _REPLY_HEAD, self.mac(reply_canonical(sender, seq, reply)).encode())


def open_reply(key: bytes, sender: str, seq: int, frame: bytes) -> bytes:
    """The reply ``frame`` as the coordinator sealed it for request (sender, seq), without its MAC:
    the bytes to decode. AuthFailure("unauthenticated") when it carries no MAC or a wrong one."""
    frame = bytes(frame)
    tail = frame[-_REPLY_TAIL:]
    if (len(frame) <= _REPLY_TAIL or not tail.startswith(_REPLY_HEAD) or not tail.endswith(b'"}')
            or not set(tail[len(_REPLY_HEAD):-2]) <= _HEX):
        raise AuthFailure("unauthenticated", "the reply is not signed with the job secret")
    reply = frame[:-_REPLY_TAIL] + b"}"
    good = _mac(key, reply_canonical(sender, seq, reply))
    if not hmac.compare_digest(good.encode(), tail[len(_REPLY_HEAD):-2]):
        raise AuthFailure("unauthenticated", "the reply is not signed with this job's secret")
    return reply


def _unsealed_refusal(frame: bytes) -> bool:
    """``frame`` is an error reply ``unauthenticated`` with no MAC: the coordinator's refusal of a
    request whose own MAC it could not verify (it cannot seal that one; see above)."""
    from torchpass import wire
    from torchpass.errors import ProtocolError

    if bytes(frame).endswith(b'"}') and _REPLY_HEAD in bytes(frame)[-_REPLY_TAIL:]:
        return False  # sealed, wrongly
    try:
        reply = wire.decode_reply(frame)
    except ProtocolError:
        return False
    return not reply.ok and reply.code == "unauthenticated"


class JobSigner:
    """Signs requests for zmqio.request(auth=signer): one sender, one counter (thread-safe)."""

    def __init__(self, secret: bytes, *, wall: Callable[[], float] = time.time, sender: str | None = None,
                 on_refused: Callable[[str], None] | None = None):
        self._key = secret
        self._wall = wall
        self.sender = sender or secrets.token_hex(8)
        self._seq = 0
        self._lock = threading.Lock()
        # Told why, once per reply dropped by open_reply (the rank runtime says it in one line).
        self.on_refused = on_refused
        self.replies_refused = 0

    def renew(self) -> None:
        """A new sender with its own counter: for a copy restored from a whole-job snapshot, whose
        image's counter its source copy has used beyond since (the coordinator would refuse it as
        a replay until it caught up)."""
        with self._lock:
            self.sender = secrets.token_hex(8)
            self._seq = 0

    def envelope(self, type_: str, id_: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """The envelope fields (auth, seq, sender) of one signed try of a request."""
        with self._lock:
            self._seq += 1
            seq = self._seq
        t_ms = int(self._wall() * 1000)
        mac = _mac(self._key, canonical(type_, id_, self.sender, seq, t_ms, body))
        return {"auth": f"{SCHEME}:{t_ms}:{mac}", "seq": seq, "sender": self.sender}

    def open_reply(self, envelope: Mapping[str, Any], frame: bytes) -> bytes | None:
        """The reply to the try signed with ``envelope`` (what envelope() gave it), as the
        coordinator sealed it, or an unsealed refusal ``unauthenticated`` (which it cannot seal);
        None, after telling on_refused why, for any other reply with no or a wrong MAC."""
        try:
            return open_reply(self._key, envelope["sender"], envelope["seq"], frame)
        except AuthFailure as exc:
            if _unsealed_refusal(frame):
                return bytes(frame)
            self.replies_refused += 1
            if self.on_refused is not None:
                self.on_refused(str(exc))
            return None


def signer_from_env(env: Mapping[str, str] = os.environ) -> JobSigner | None:
    """The rank's signer. None without TORCHPASS_JOB_SECRET (a job started by an older plugin, whose
    coordinator takes unsigned requests; a coordinator that wants them signed refuses the rank with
    ``unauthenticated`` and the rank trains on unprotected). ConfigError for a malformed secret."""
    text = env.get(ENV_VAR)
    return JobSigner(parse_secret(text)) if text else None


class JobVerifier:
    """The coordinator's side: verify(msg) or AuthFailure("unauthenticated")."""

    def __init__(self, secret: bytes, *, wall: Callable[[], float] = time.time, window_s: float = WINDOW_S,
                 max_senders: int = MAX_SENDERS):
        self._key = secret
        self._wall = wall
        self.window_s = window_s
        self.max_senders = max_senders
        self._last: dict[str, tuple[int, int]] = {}  # sender -> (last seq, newest t_ms)

    def verify(self, msg: Any) -> int:
        """``msg``: a torchpass.wire.Message. Accepting it advances its sender's counter; returns
        the wall-clock time it was signed at (ms), which the MAC covers."""
        m = _AUTH_RE.fullmatch(msg.auth) if isinstance(msg.auth, str) else None
        if m is None:
            raise AuthFailure("unauthenticated", f"{msg.type} is not signed with the job secret "
                              f"({ENV_VAR} missing from the rank's environment?): the rank is unprotected")
        sender, seq = msg.sender, msg.seq
        if not isinstance(sender, str) or not _SENDER_RE.fullmatch(sender) or not isinstance(seq, int) or seq < 1:
            raise AuthFailure("unauthenticated", f"{msg.type} lacks a valid sender and sequence number")
        t_ms = int(m.group(1))
        good = _mac(self._key, canonical(msg.type, msg.id, sender, seq, t_ms, msg.body))
        if not hmac.compare_digest(good, m.group(2)):
            raise AuthFailure("unauthenticated", f"{msg.type} is not signed with this job's secret")
        now_ms = int(self._wall() * 1000)
        if abs(now_ms - t_ms) > self.window_s * 1000:
            raise AuthFailure("unauthenticated", f"{msg.type} was signed {abs(now_ms - t_ms) / 1000:.0f} s "
                              f"away from this clock (window {self.window_s:g} s); are the clocks in sync?")
        last = self._last.get(sender)
        if last is not None and seq <= last[0]:
            raise AuthFailure("unauthenticated", f"{msg.type} replayed (sequence {seq}, last {last[0]})")
        self._last[sender] = (seq, max(t_ms, last[1]) if last else t_ms)
        if len(self._last) > self.max_senders:
            self._forget(now_ms)
        return t_ms

    def _forget(self, now_ms: int) -> None:
        horizon = now_ms - self.window_s * 1000
        self._last = {s: v for s, v in self._last.items() if v[1] >= horizon}
        if len(self._last) > self.max_senders:  # a flood of live senders: keep the newest max_senders
            newest = sorted(self._last.items(), key=lambda kv: kv[1][1])[-self.max_senders:]
            self._last = dict(newest)


__all__ = ["ENV_VAR", "JobSigner", "JobVerifier", "ReplySealer", "canonical", "open_reply", "parse_secret",
           "read_secret_fd", "reply_canonical", "signer_from_env"]
