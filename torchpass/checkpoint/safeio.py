"""File access for root near directories a user can write.

tpassd runs as root and must read and write files in the job's rank
directory (``STATE_DIR/jobs/J/ranks/jobJ``), which the job user owns.
Everything here refuses to follow a symlink, in the last path component
or in an intermediate one, and never blocks on or swallows a special file:

* ``open_dir(base, parts)``: walk ``parts`` below a trusted ``base`` with
  ``O_DIRECTORY|O_NOFOLLOW`` at each step; returns a directory fd.
* ``open_root_owned_dir(path)``: walk an absolute path from ``/``, every
  directory owned by root and writable by nobody else (or sticky).
* ``read_regular(name, cap, dir_fd=...)``: a regular file of at most
  ``cap`` bytes (a FIFO, a device, a symlink or a larger file: OSError at
  once, with one clear line).
* ``open_dir_at(dir_fd, name)``: one directory below ``dir_fd``, O_NOFOLLOW.
* ``read_tail(path, cap)``: the last ``cap`` bytes of a regular file (a log).
* ``write_at(dir_fd, name, data)``: a fresh file made with
  ``O_CREAT|O_EXCL|O_NOFOLLOW`` and renamed over ``name`` (a planted symlink
  there is replaced, its target left unchanged).

Errors are ``OSError`` with a one-line message, so callers keep one
``except OSError``.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path

MAX_RECORD_BYTES = 1 << 20  # a rank record (holds the rank's argv)
MAX_MANIFEST_BYTES = 16 << 20  # a snapshot manifest (one line per image file)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _refused(what: str, exc: OSError) -> OSError:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return OSError(exc.errno, f"{what} is a symlink or not a directory; refused")
    return OSError(exc.errno, f"{what}: {exc.strerror}")


def _step(fd: int, part: str, where: Path) -> int:
    """Open the directory ``part`` below ``fd`` without following a symlink; close ``fd``
    (also on failure)."""
    try:
        if part in ("", ".", "..") or "/" in part:
            raise OSError(errno.EINVAL, f"{where}: bad path component {part!r}")
        try:
            return os.open(part, _DIR_FLAGS, dir_fd=fd)
        except OSError as exc:
            raise _refused(str(where), exc) from None
    finally:
        os.close(fd)


def open_dir(base: str | os.PathLike, parts: Iterable[str]) -> int:
    """A directory fd for ``base/parts...``; ``base`` is trusted (root's configuration),
    each of ``parts`` is opened with O_NOFOLLOW below the one before. Close it."""
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    where = Path(base)
    for part in parts:
        where = where / part
        fd = _step(fd, part, where)
    return fd


def open_dir_at(dir_fd: int, name: str) -> int:
    """A directory fd of ``name`` in ``dir_fd``, not followed if a symlink. Close it."""
    if name in ("", ".", "..") or "/" in name:
        raise OSError(errno.EINVAL, f"bad path component {name!r}")
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise _refused(name, exc) from None


def open_root_owned_dir(path: str | os.PathLike) -> int:
    """A directory fd for the absolute ``path`` if every directory on it, ``/`` included,
    is a real directory (no symlink) owned by root and writable by no one else, or
    sticky (like /tmp: others cannot replace root's entries there). Close it."""
    p = Path(path)
    if not p.is_absolute():
        raise OSError(errno.EINVAL, f"{p} is not an absolute path")
    fd, where = open_dir("/", ()), Path("/")
    for part in (*p.parts[1:], None):
        st = os.fstat(fd)
        if st.st_uid != 0 or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
            os.close(fd)
            raise OSError(errno.EPERM, f"{where} is owned by uid {st.st_uid} with mode "
                                       f"{stat.S_IMODE(st.st_mode):o}: not a root-owned directory; refused")
        if part is None:
            return fd
        where = where / part
        fd = _step(fd, part, where)  # closes the parent's fd, also when it fails
    raise AssertionError("unreachable")


def _open_nofollow(name: str | os.PathLike, dir_fd: int | None) -> int:
    """``name`` opened read-only without following a symlink (one line saying so) and without
    blocking on a FIFO or device."""
    try:
        return os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(exc.errno, f"{name} is a symlink; refused") from None
        raise


def read_regular(name: str | os.PathLike, cap: int, *, dir_fd: int | None = None, owner: int | None = None) -> bytes:
    """The content of the regular file ``name`` (not followed if a symlink), at most ``cap``
    bytes. A FIFO or device is refused without blocking; a larger file without reading it.
    ``owner``: the file must be that uid's, with one link (checked on the descriptor read, so a
    file swapped after a check by name, or a hard link to another's file, is refused)."""
    fd = _open_nofollow(name, dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if (
                stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)) else "not a regular file"
            raise OSError(errno.EINVAL, f"{name} is {kind}; refused")
        if owner is not None and (st.st_uid != owner or st.st_nlink != 1):
            raise OSError(errno.EPERM, f"{name} is not a file of uid {owner} with one link (uid {st.st_uid}, "
                                       f"{st.st_nlink} links); refused")
        if st.st_size > cap:
            raise OSError(errno.EFBIG, f"{name} has {st.st_size} bytes, more than the {cap} allowed; refused")
        chunks, left = [], cap + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > cap:
            raise OSError(errno.EFBIG, f"{name} grew past the {cap} bytes allowed; refused")
        return data
    finally:
        os.close(fd)


def read_tail(path: str | os.PathLike, cap: int) -> bytes:
    """The last ``cap`` bytes (or fewer) of the regular file ``path`` (not followed if a symlink;
    a FIFO or device refused without blocking): a log that may be long, read bounded."""
    fd = _open_nofollow(path, None)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file; refused")
        return os.pread(fd, cap, max(0, st.st_size - cap))
    finally:
        os.close(fd)


def write_at(dir_fd: int, name: str, data: bytes, mode: int = 0o644) -> None:
    """Replace ``name`` in the directory ``dir_fd`` with ``data``: written to a fresh
    O_EXCL|O_NOFOLLOW file, then renamed (a symlink at ``name`` is replaced, not followed)."""
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


__all__ = ["MAX_RECORD_BYTES", "MAX_MANIFEST_BYTES", "open_dir", "open_dir_at", "open_root_owned_dir", "read_regular",
           "read_tail", "write_at"]
