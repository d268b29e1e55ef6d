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
import grp
import json
import os
import pwd
import stat
import struct
from typing import Any

from torchpass import layout
from torchpass.checkpoint import safeio

MAX_REGISTRATION_BYTES = 64 * 1024  # coordinator.json: a few hundred bytes
# events.json keeps the last 10,000 events (coordinator/job_record.py EVENTS_KEPT): about 3 MB at
# 8,192 ranks. Larger is not a log a coordinator wrote.
MAX_EVENTS_BYTES = 64 << 20


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


def read_events(state_dir: layout.PathLike, job: int | str, *, owner: int | None = None,
                cap: int = MAX_EVENTS_BYTES) -> tuple[list[Any], int]:
    """(the event log STATE_DIR/jobs/J/events.json, its owner's uid). ``owner``: the uid the job
    directory and the file must belong to (what Slurm says, for root acting on a request); None:
    the directory's owner, who is the job's (the plugin made it so). OSError when it is missing or
    refused, ValueError when it is not a JSON list."""
    dfd, dir_owner = open_job_dir(state_dir, job)
    try:
        if owner is not None and dir_owner != owner:
            raise OSError(errno.EPERM, f"{layout.job_dir(state_dir, int(job))} belongs to uid {dir_owner}, "
                                       f"not to the job's owner (uid {owner})")
        data = read_file(dfd, layout.EVENTS_JSON, dir_owner, cap)
    finally:
        os.close(dfd)
    events = json.loads(data)
    if not isinstance(events, list):
        raise ValueError("not a list of events")
    return events, dir_owner


def registration(dfd: int, job_id: int, owner: int) -> dict[str, Any] | None:
    """The coordinator registration in the job directory ``dfd`` of job ``job_id`` (owned by
    ``owner``): written by the job's coordinator, so a file of the owner that says the owner's
    uid. Its ``job_id`` is the directory's, whatever the file says."""
    info = read_json(dfd, layout.COORDINATOR_JSON, owner, MAX_REGISTRATION_BYTES)
    if not isinstance(info, dict) or info.get("uid") != owner or not isinstance(info.get("endpoint"), str):
        return None
    return {**info, "job_id": job_id, "uid": owner}


# --- what root writes there for the owner alone (snapshot manifests) ------------------------------

def private_group(uid: int) -> int | None:
    """``uid``'s primary group if it is a user-private group (named as the user, no other member
    listed), else None: a shared primary group ("users") must not read what is the owner's alone."""
    try:
        pw = pwd.getpwuid(uid)
        gr = grp.getgrgid(pw.pw_gid)
    except KeyError:
        return None
    if gr.gr_name != pw.pw_name or set(gr.gr_mem) - {pw.pw_name}:
        return None
    return pw.pw_gid


# A POSIX access ACL as the kernel takes it in system.posix_acl_access (linux/posix_acl_xattr.h):
# version 2, then (tag, perm, id) entries sorted by tag.
_ACL_VERSION = 2
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_ACL_UNDEFINED_ID = 0xFFFFFFFF


def _owner_acl(uid: int, perm: int) -> bytes:
    entries = [(_ACL_USER_OBJ, 7 if perm & 1 else 6, _ACL_UNDEFINED_ID), (_ACL_USER, perm, uid),
               (_ACL_GROUP_OBJ, 0, _ACL_UNDEFINED_ID), (_ACL_MASK, perm, _ACL_UNDEFINED_ID),
               (_ACL_OTHER, 0, _ACL_UNDEFINED_ID)]
    return struct.pack("<I", _ACL_VERSION) + b"".join(struct.pack("<HHI", *e) for e in entries)


def share_with_owner(fd: int, uid: int, gid: int | None, *, directory: bool) -> str | None:
    """Make root's file (or directory) ``fd`` readable by ``uid`` and root alone: through ``gid``
    when it is given (``uid``'s private group, see private_group), else through a POSIX ACL entry
    for ``uid`` (owner root, group root, no group or other bits). Why the owner cannot read it
    (the filesystem has no ACLs), or None."""
    mode = 0o750 if directory else 0o640
    if gid is not None:
        os.fchown(fd, 0, gid)
        os.fchmod(fd, mode)
        return None
    os.fchown(fd, 0, 0)
    os.fchmod(fd, mode & 0o700)
    try:
        os.setxattr(fd, "system.posix_acl_access", _owner_acl(uid, 5 if directory else 4))
    except OSError as exc:
        return (f"uid {uid} has no private group and this filesystem takes no ACL ({exc.strerror}): "
                "only root reads it")
    return None


__all__ = ["MAX_REGISTRATION_BYTES", "private_group", "share_with_owner", "open_jobs_dir", "is_job_name",
           "open_job_dir", "job_names", "read_file", "read_json", "registration"]
