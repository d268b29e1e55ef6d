"""Reading STATE_DIR/jobs/J: whose job it is, and its files, as root may read them.

The SPANK plugin, as root, makes ``jobs/J`` at the job's start in a ``jobs/``
that is root's and writable by root alone, and gives it to the job's user
(group SlurmUser's, ``layout.JOB_DIR_MODE``). So the owner of ``jobs/J`` is the
owner of job J: the name of the directory says which job, its owner says
whose. Nothing written inside it (``coordinator.json`` says a ``job_id``
too) can claim another job.

Every read here walks from the configured STATE_DIR without following a
symlink, and takes only a regular file of the expected owner with one link,
capped in size, never blocking on a FIFO (``torchpass.checkpoint.safeio``):
root (tpassctl run by an admin) reads the files of a directory a user owns.
Errors are ``OSError`` with one line.

No torch, no zmq: tpassctl and the coordinator import it.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from typing import Any

from torchpass import layout
from torchpass.checkpoint import safeio

MAX_REGISTRATION_BYTES = 64 * 1024  # coordinator.json: a few hundred bytes


def open_jobs_dir(state_dir: layout.PathLike) -> int:
    """A directory fd for STATE_DIR/jobs if root owns it and no one else may write it
    (OSError otherwise, FileNotFoundError when there is none). Close it."""
    fd = safeio.open_dir(state_dir, (layout.JOBS,))
    st = os.fstat(fd)
    if st.st_uid != 0 or st.st_mode & 0o022:
        os.close(fd)
        where = layout.jobs_dir(state_dir)
        raise OSError(errno.EPERM, f"{where} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}: "
                                   f"it must be root's and writable by root alone (chown root: {where}; "
                                   f"chmod {layout.JOBS_DIR_MODE:o} {where}); refused")
    return fd


def is_job_name(name: str) -> bool:
    """``name`` is how the plugin spells a job id in jobs/ (decimal, no sign, no leading zero)."""
    return name.isascii() and name.isdigit() and str(int(name)) == name


def open_job_dir(state_dir: layout.PathLike, job: int | str) -> tuple[int, int]:
    """(directory fd, owner uid) of STATE_DIR/jobs/J. OSError when it is missing, not ours to
    read, a symlink, or jobs/ is not root's alone. Close the fd."""
    name = str(job)
    if not is_job_name(name):
        raise OSError(errno.EINVAL, f"{name!r} is not a job id")
    jfd = open_jobs_dir(state_dir)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=jfd)
    finally:
        os.close(jfd)
    return fd, os.fstat(fd).st_uid


def job_names(state_dir: layout.PathLike) -> list[int]:
    """The job ids that have a directory under STATE_DIR/jobs (sorted); [] without one."""
    try:
        jfd = open_jobs_dir(state_dir)
    except FileNotFoundError:
        return []
    try:
        return sorted(int(n) for n in os.listdir(jfd) if is_job_name(n))
    finally:
        os.close(jfd)


def read_file(dfd: int, name: str, owner: int, cap: int) -> bytes:
    """The regular file ``name`` of the job directory ``dfd``: ``owner``'s, with one link."""
    return safeio.read_regular(name, cap, dir_fd=dfd, owner=owner)


def read_json(dfd: int, name: str, owner: int, cap: int) -> Any:
    """The JSON in ``name`` (see read_file); None when it is missing, refused or not JSON."""
    try:
        return json.loads(read_file(dfd, name, owner, cap))
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def registration(dfd: int, job_id: int, owner: int) -> dict[str, Any] | None:
    """The coordinator registration in the job directory ``dfd`` of job ``job_id`` (owned by
    ``owner``): written by the job's coordinator, so a file of the owner that says the owner's
    uid. Its ``job_id`` is the directory's, whatever the file says."""
    info = read_json(dfd, layout.COORDINATOR_JSON, owner, MAX_REGISTRATION_BYTES)
    if not isinstance(info, dict) or info.get("uid") != owner or not isinstance(info.get("endpoint"), str):
        return None
    return {**info, "job_id": job_id, "uid": owner}


__all__ = ["MAX_REGISTRATION_BYTES", "open_jobs_dir", "is_job_name", "open_job_dir", "job_names", "read_file",
           "read_json", "registration"]
