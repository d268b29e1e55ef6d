"""The stop marker of a job stopped with `tpassctl snapshot --stop` (layout.stopped_file).

Written by the stopping coordinator just before it requeue-holds the job, read by `tpassctl
resume` and by the coordinator of the resumed run (both as the job user or an admin: root reads
it only as a plain file of the job's owner, torchpass.jobdir); the SPANK plugin reads its
``snapshot`` and ``step`` (slurm_spank/stop.c, with the same checks). ``key=value`` lines:

    snapshot=ID  step=S (the Slurm step of the ranks)  snapshot_step=K  generation=G
    world_size=W  step_offset=O
"""

from __future__ import annotations

import os
from typing import Any

from torchpass import jobdir, layout
from torchpass.errors import TorchpassError

STOPPED_MAX_BYTES = 4096  # slurm_spank/stop.h's TPASS_STOPPED_MAX
STOPPED_KEYS = ("snapshot", "step", "snapshot_step", "generation", "world_size", "step_offset")


def stopped_text(fields: dict[str, Any]) -> str:
    """The marker's text for ``fields`` (every one of STOPPED_KEYS)."""
    return "".join(f"{k}={fields[k]}\n" for k in STOPPED_KEYS)


def read_stopped(state_dir: str | os.PathLike, job_id: int) -> dict | None:
    """The marker's fields, or None without one. TorchpassError when it is malformed (the job then
    starts as Slurm reran it, with a line why)."""
    path = layout.stopped_file(state_dir, job_id)
    try:
        dfd, owner = jobdir.open_job_dir(state_dir, job_id)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TorchpassError(f"cannot read the stop marker {path}: {exc}") from None
    try:
        text = jobdir.read_file(dfd, layout.STOPPED, owner, STOPPED_MAX_BYTES).decode("utf-8", "replace")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TorchpassError(f"cannot read the stop marker {path}: {exc}") from None
    finally:
        os.close(dfd)
    fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    try:
        got = {k: (fields[k] if k == "snapshot" else int(fields[k])) for k in STOPPED_KEYS}
    except (KeyError, ValueError):
        raise TorchpassError(f"the stop marker {path} is malformed (needs {', '.join(STOPPED_KEYS)}): "
                             f"{text[:200]!r}") from None
    if not layout.valid_snapshot_id(got["snapshot"]) or got["world_size"] < 1:
        raise TorchpassError(f"the stop marker {path} names no valid snapshot: {text[:200]!r}")
    return got


__all__ = ["STOPPED_MAX_BYTES", "STOPPED_KEYS", "read_stopped", "stopped_text"]
