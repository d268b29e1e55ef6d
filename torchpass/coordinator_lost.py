"""STATE_DIR/jobs/J/coordinator.lost: a rank's note that the job's coordinator stopped answering.

The first rank whose link to the coordinator has had no answer for a while
(``torchpass.runtime.control``, 30 s by default) creates this file, once,
with ``O_CREAT|O_EXCL|O_NOFOLLOW`` in the job's own directory (owned by the
job's user), holding ``{"time", "rank", "node", "error"}``. A coordinator
that died cannot say so itself: ``tpassctl status`` shows the job's
coordinator LOST from this file and ``tpassctl events`` lists it as the event
``coordinator.lost`` (docs/coordinator.md, "Never left paused").

No torch, no zmq: the runtime and tpassctl both import it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torchpass import layout

NAME = "coordinator.lost"
EVENT = "coordinator.lost"
MAX_BYTES = 64 * 1024  # what we read of a file the job's user writes
FIELDS = ("time", "rank", "node", "error")


def path(state_dir: layout.PathLike, job: int | str) -> Path:
    """STATE_DIR/jobs/J/coordinator.lost."""
    return layout.job_dir(state_dir, job) / NAME


def create(state_dir: layout.PathLike, job: int | str, record: dict[str, Any]) -> bool:
    """Write the note unless it exists; True if this call created it.

    ``O_EXCL``: of all the ranks that notice, exactly one writes it;
    ``O_NOFOLLOW``: a link planted in its place is never followed.
    """
    p = path(state_dir, job)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({k: record.get(k) for k in FIELDS}))
    return True


def read_job_file(state_dir: layout.PathLike, job: int | str, p: Path, max_bytes: int = MAX_BYTES) -> Any:
    """The JSON in ``p``, a file of STATE_DIR/jobs/J; None unless it is trustworthy.

    Trusted only if it is a regular file with one link (not a link, FIFO or
    device: read without following and capped in size) owned by the owner of
    jobs/J (made by the root plugin for the job's user): the state directory
    is shared.
    """
    from torchpass.checkpoint import safeio  # stdlib only: no torch, no zmq

    try:
        owner = os.stat(layout.job_dir(state_dir, job), follow_symlinks=False).st_uid
        data = safeio.read_regular(p, max_bytes, owner=owner)  # one link, too: root (an admin's tpassctl) reads it
    except OSError:
        return None
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None


def read(state_dir: layout.PathLike, job: int | str) -> dict[str, Any] | None:
    """The note of job ``job``, or None (none, or not one to trust)."""
    rec = read_job_file(state_dir, job, path(state_dir, job))
    return {k: rec.get(k) for k in FIELDS} if isinstance(rec, dict) else None


def message(rec: dict[str, Any]) -> str:
    """One line for status and events."""
    return (f"rank {rec.get('rank')} on {rec.get('node')}: the coordinator does not answer "
            f"({rec.get('error')}); the job is unprotected")


def as_event(rec: dict[str, Any], seq: int) -> dict[str, Any]:
    """The note as an event of the job's log (the shape of job.events' entries)."""
    return {"seq": seq, "time": rec.get("time"), "kind": EVENT, "message": message(rec), "data": dict(rec)}


__all__ = ["NAME", "EVENT", "path", "create", "read", "read_job_file", "message", "as_event"]
