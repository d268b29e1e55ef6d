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

from torchpass.auth import AuthFailure
from torchpass.errors import ConfigError

ENV_VAR = "TORCHPASS_JOB_SECRET"
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


class JobSigner:
    """Signs requests for zmqio.request(auth=signer): one sender, one counter (thread-safe)."""

    def __init__(self, secret: bytes, *, wall: Callable[[], float] = time.time, sender: str | None = None):
        self._key = secret
        self._wall = wall
        self.sender = sender or secrets.token_hex(8)
        self._seq = 0
        self._lock = threading.Lock()

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


__all__ = ["ENV_VAR", "JobSigner", "JobVerifier", "canonical", "parse_secret", "read_secret_fd",
           "signer_from_env"]
