"""The fleet history's one record format, and the spool that carries records to the writer.

A record is one JSON object per line::

    {"schema": 1, "ts": <unix seconds>, "kind": KIND, "node": NODE, ...fields of the kind}

KIND is one of KINDS. Who writes what:

* ``health.change``: tpassd, when its node's state changes (``state``, ``previous``, ``reasons``);
* ``audit.node`` / ``audit.rail``: ``tpassctl fleet audit`` run as root (``outlier``, measures);
* ``job.*``: the writer itself, from each job's ``events.json`` (``job``, ``user``, ...).

SQLite over NFS is unsafe with many writers, so every producer appends to a file of its own in
the spool, ``STATE_DIR/fleet/spool/<producer>.jsonl`` (root's, 0700; STATE_DIR is shared by every
node, /var/lib/torchpass by default), and one writer (``tpassctl fleet ingest``, docs/fleet.md)
merges them into the store. An append holds an flock on the file while it writes, so the writer,
which renames a file before it reads it, never reads half a line.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from torchpass.checkpoint import safeio
from torchpass.errors import TorchpassError

SCHEMA = 1
KINDS = ("health.change", "audit.node", "audit.rail", "job.migration", "job.snapshot", "job.reroute",
         "job.relaunch")
FLEET_DIR = "fleet"
SPOOL_DIR = "spool"
SPOOL_SUFFIX = ".jsonl"
# A producer's spool file stops growing at this size until the writer takes it (a line is ~300 B:
# about 200,000 records); what is dropped meanwhile is counted, never blocks tpassd.
MAX_SPOOL_BYTES = 64 << 20
MAX_RECORD_BYTES = 64 << 10


class FleetError(TorchpassError):
    """A fleet record, spool or store that cannot be used as it is."""


def spool_dir(state_dir: str | os.PathLike) -> Path:
    return Path(state_dir) / FLEET_DIR / SPOOL_DIR


def record(kind: str, node: str, ts: float, **fields: Any) -> dict[str, Any]:
    """A checked record of ``kind`` about ``node`` at ``ts``."""
    rec = {"schema": SCHEMA, "ts": ts, "kind": kind, "node": node, **fields}
    validate(rec)
    return rec


def validate(rec: Any) -> dict[str, Any]:
    """``rec`` if it is a record this version reads; FleetError saying what is wrong otherwise."""
    if not isinstance(rec, dict):
        raise FleetError(f"a fleet record is a JSON object, got {type(rec).__name__}")
    if rec.get("schema") != SCHEMA:
        raise FleetError(f"fleet record schema {rec.get('schema')!r} is not {SCHEMA}")
    if rec.get("kind") not in KINDS:
        raise FleetError(f"fleet record kind {rec.get('kind')!r} is not one of {', '.join(KINDS)}")
    ts = rec.get("ts")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise FleetError(f"fleet record ts {ts!r} is not a time in unix seconds")
    node = rec.get("node")
    if not isinstance(node, str) or not node or len(node) > 100:
        raise FleetError(f"fleet record node {node!r} is not a node name")
    return rec


def encode(rec: dict[str, Any]) -> bytes:
    line = json.dumps(validate(rec), separators=(",", ":"), allow_nan=False).encode() + b"\n"
    if len(line) > MAX_RECORD_BYTES:
        raise FleetError(f"a fleet record of {len(line)} bytes is over the {MAX_RECORD_BYTES} allowed")
    return line


def parse_lines(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """(the records of complete, valid lines, how many lines were refused)."""
    out, bad = [], 0
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            out.append(validate(json.loads(line)))
        except (ValueError, FleetError):
            bad += 1
    return out, bad


class SpoolAppender:
    """Appends records to ``SPOOL/<producer>.jsonl``. Root's: the spool's parents must be
    root-owned (safeio.open_root_owned_dir), the spool is made 0700 and the file 0600."""

    def __init__(self, spool: str | os.PathLike, producer: str, max_bytes: int = MAX_SPOOL_BYTES):
        if not producer or "/" in producer or producer.startswith("."):
            raise FleetError(f"{producer!r} is not a spool producer name")
        self.spool = Path(spool)
        self.name = producer + SPOOL_SUFFIX
        self.max_bytes = max_bytes
        self.dropped = 0

    def _open_spool(self) -> int:
        try:
            return safeio.open_root_owned_dir(self.spool)
        except FileNotFoundError:
            parent = safeio.open_root_owned_dir(self.spool.parent.parent)
            try:
                for part in (self.spool.parent.name, self.spool.name):
                    try:
                        os.mkdir(part, 0o700, dir_fd=parent)
                    except FileExistsError:
                        pass
                    nxt = safeio.open_dir_at(parent, part)
                    os.close(parent)
                    parent = nxt
            except BaseException:
                os.close(parent)
                raise
            os.close(parent)
            return safeio.open_root_owned_dir(self.spool)

    def append(self, rec: dict[str, Any]) -> bool:
        """Append one record; False (and counted in ``dropped``) when the file is full."""
        line = encode(rec)
        dfd = self._open_spool()
        try:
            fd = os.open(self.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dfd)
        finally:
            os.close(dfd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_size + len(line) > self.max_bytes:
                self.dropped += 1
                return False
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view):]
            return True
        finally:
            os.close(fd)


def take_spool(spool: str | os.PathLike) -> tuple[list[dict[str, Any]], int, list[str]]:
    """The writer's side: every producer file is renamed aside (producers start a fresh one at
    their next append), read under its flock (an append in flight finishes first), and removed.
    Returns (records, lines refused, the files taken)."""
    try:
        dfd = safeio.open_root_owned_dir(spool)
    except FileNotFoundError:
        return [], 0, []
    records: list[dict[str, Any]] = []
    bad, taken = 0, []
    try:
        for name in sorted(os.listdir(dfd)):
            if not name.endswith(SPOOL_SUFFIX) or name.startswith("."):
                continue
            aside = f".{name}.taking"
            try:
                os.rename(name, aside, src_dir_fd=dfd, dst_dir_fd=dfd)
            except FileNotFoundError:
                continue
            records_, bad_ = _read_taken(dfd, aside)
            records += records_
            bad += bad_
            taken.append(name)
        # a file left aside by a writer that died mid-way: read it now
        for name in sorted(os.listdir(dfd)):
            if name.startswith(".") and name.endswith(".taking") and name[1:-len(".taking")] not in taken:
                records_, bad_ = _read_taken(dfd, name)
                records += records_
                bad += bad_
    finally:
        os.close(dfd)
    return records, bad, taken


def _read_taken(dfd: int, name: str) -> tuple[list[dict[str, Any]], int]:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        data = _read_fd(fd)
    finally:
        os.close(fd)
    os.unlink(name, dir_fd=dfd)
    return parse_lines(data)


def _read_fd(fd: int) -> bytes:
    """The whole regular file ``fd``, bounded (a producer's cap and one record past it)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EINVAL, "a spool entry is not a regular file; refused")
    chunks, left = [], MAX_SPOOL_BYTES + MAX_RECORD_BYTES
    while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
