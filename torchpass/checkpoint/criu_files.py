"""The files a CRIU image reopens by path, read from the image, and their check before a restore.

CRIU's restore reopens every regular file (and directory: cwd, root) of the
dumped tree by the path recorded in ``files.img``, following symlinks, and
checks only its size and mode. Its criu runs as the job's owner
(``criu.restore_creds``), so it opens nothing its owner could not, except
through the group root that tpass-init keeps (its working directory is
root's, mode 0770). Before criu runs, each path is walked here as the owner,
one component at a time with O_NOFOLLOW: a symlink anywhere on it, a file
that is not of the dumped kind, or an owner (recorded in the manifest at
dump time), size or mode other than the dumped ones refuses the restore with
one line naming the file. The build-id of executables is CRIU's own check
(``--file-validation=buildid``). Inode numbers are not compared: they differ
on every other node.

The image is root's (written by tpassd, its digests in the manifest), so its
contents are trusted here; the decoder is still bounded and refuses what it
cannot parse.

What the walk does not close: it checks before criu opens. A user who swaps a
path for a symlink in between reaches only what the owner's ids plus group
root can open (criu's credentials: no DAC capability), and only a file of the
dumped size and mode (CRIU's own check), e.g. a root-group file of mode 0660.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Iterator
from pathlib import Path

from torchpass.errors import CheckpointError

IMG_COMMON_MAGIC = 0x54564319
FILES_MAGIC = 0x56303138
REMAP_FPATH_MAGIC = 0x59133954
PSTREE_MAGIC = 0x50273030
FD_TYPE_REG = 1
MAX_IMAGE_BYTES = 64 << 20
# Where tpass-init's working directory lies (criu.TPASS_INIT_BASE): root's, made by recreate_cwd.
ROOT_DIRS = ("/run/torchpass-init",)


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[i]
        i += 1
        out |= (b & 0x7F) << shift
        if not b & 0x80:
            return out, i
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of a protobuf message: varints as int, length-delimited as bytes."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _varint(buf, i)
            yield num, v
        elif wire == 2:
            n, i = _varint(buf, i)
            if i + n > len(buf):
                raise ValueError("truncated field")
            yield num, buf[i:i + n]
            i += n
        elif wire == 1:
            yield num, buf[i:i + 8]
            i += 8
        elif wire == 5:
            yield num, buf[i:i + 4]
            i += 4
        else:
            raise ValueError(f"wire type {wire}")


def _entries(path: Path, magic: int) -> Iterator[bytes]:
    with open(path, "rb") as f:
        data = f.read(MAX_IMAGE_BYTES + 1)
    if len(data) > MAX_IMAGE_BYTES or len(data) < 8:
        raise ValueError("size")
    m0, m1 = struct.unpack_from("<II", data)
    if m0 != IMG_COMMON_MAGIC or m1 != magic:
        raise ValueError("magic")
    i = 8
    while i < len(data):
        (n,) = struct.unpack_from("<I", data, i)
        if i + 4 + n > len(data):
            raise ValueError("truncated entry")
        yield data[i + 4:i + 4 + n]
        i += 4 + n


def reg_files(images: str | os.PathLike) -> list[dict]:
    """Every regular-file entry of ``images``/files.img: {"id", "path", "size", "mode", "remapped"}
    (``remapped``: a ghost or link-remap of an unlinked file, which CRIU recreates)."""
    d = Path(images)
    remapped: set[int] = set()
    try:
        if (d / "remap-fpath.img").exists():
            for e in _entries(d / "remap-fpath.img", REMAP_FPATH_MAGIC):
                remapped.update(v for n, v in _fields(e) if n == 1 and isinstance(v, int))
        out = []
        for e in _entries(d / "files.img", FILES_MAGIC):
            f = dict(_fields(e))
            if f.get(1) != FD_TYPE_REG or not isinstance(f.get(3), bytes):
                continue
            r = dict(_fields(f[3]))
            name = r.get(6)
            if not isinstance(name, bytes):
                raise ValueError("a file without a name")
            out.append({"id": r.get(1), "path": name.decode(errors="surrogateescape"),
                        "size": r.get(8), "mode": r.get(10), "remapped": r.get(1) in remapped})
        return out
    except (OSError, ValueError, struct.error) as exc:
        raise CheckpointError(f"snapshot {d}: cannot read the files CRIU reopens from files.img ({exc}); "
                              "take a new snapshot") from None


def image_pids(images: str | os.PathLike) -> list[int]:
    """The pid of every process in ``images``/pstree.img, as its PID namespace numbers it."""
    d = Path(images)
    try:
        return [v for e in _entries(d / "pstree.img", PSTREE_MAGIC) for n, v in _fields(e) if n == 1
                and isinstance(v, int)]
    except (OSError, ValueError, struct.error) as exc:
        raise CheckpointError(f"snapshot {d}: cannot read pstree.img ({exc}); take a new snapshot") from None


def _walk(path: str) -> os.stat_result:
    """lstat of ``path``, reached from / one component at a time without following a symlink
    (O_NOFOLLOW on each directory, and on the last component); OSError naming why otherwise."""
    if not path.startswith("/"):
        raise OSError(f"{path!r} is not absolute")
    parts = [p for p in path.split("/") if p]
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            st = os.stat(part, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise OSError(f"{'/' + '/'.join(parts[:i + 1])} is a symlink")
            if i == len(parts) - 1:
                return st
            nfd = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
        return os.fstat(fd)
    finally:
        os.close(fd)


def _under_root_dir(path: str) -> bool:
    return any(path == d or path.startswith(d + "/") for d in ROOT_DIRS)


def owners(files: list[dict]) -> dict[str, list[int]]:
    """{path: [uid, gid]} of each file as it is now (at the dump: the manifest records them); a
    path that cannot be walked (gone, a symlink on it) is left out and refused at the restore."""
    out = {}
    for f in files:
        if f["remapped"]:
            continue
        try:
            st = _walk(f["path"])
        except OSError:
            continue
        out[f["path"]] = [st.st_uid, st.st_gid]
    return out


def check(files: list[dict], owned: dict, uid: int, gid: int, groups: list[int]) -> str | None:
    """The first file that is not as dumped, walked as ``uid``/``gid``/``groups`` (in a child
    process: the ids are the whole process's), as one line; None when all are. A path under a
    root-only directory of tpass-init's (made by ``recreate_cwd``) is walked as root."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        code = 0
        try:
            os.close(r)
            mine = [f for f in files if not _under_root_dir(f["path"])]
            os.setgroups([g for g in groups if g != 0])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            msg = _first_bad(mine, owned) or ""
            os.write(w, msg.encode(errors="replace")[:4096])
        except BaseException as exc:  # noqa: BLE001
            os.write(w, f"cannot check the files as uid {uid} ({exc})".encode()[:4096])
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    try:
        chunks = []
        while chunk := os.read(r, 4096):
            chunks.append(chunk)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    msg = b"".join(chunks).decode(errors="replace")
    if msg:
        return msg
    return _first_bad([f for f in files if _under_root_dir(f["path"])], owned, root=True)


def _first_bad(files: list[dict], owned: dict, root: bool = False) -> str | None:
    for f in files:
        path = f["path"]
        if f["remapped"]:  # CRIU recreates it (a ghost): only its directory must be the same
            path = os.path.dirname(path) or "/"
        try:
            st = _walk(path)
        except OSError as exc:
            why = exc.strerror if exc.strerror else str(exc)
            return f"{path}: {why}"
        if f["remapped"]:
            if not stat.S_ISDIR(st.st_mode):
                return f"{path}: not a directory"
            continue
        mode = f.get("mode")
        if isinstance(mode, int):
            if stat.S_IFMT(mode) != stat.S_IFMT(st.st_mode):
                return f"{path}: not a {'directory' if stat.S_ISDIR(mode) else 'regular file'} as when dumped"
            if mode != st.st_mode:
                return f"{path}: mode {st.st_mode:o}, dumped as {mode:o}"
        elif not stat.S_ISREG(st.st_mode):
            return f"{path}: not a regular file"
        if stat.S_ISREG(st.st_mode) and isinstance(f.get("size"), int) and f["size"] != st.st_size:
            return f"{path}: size {st.st_size}, dumped as {f['size']}"
        own = owned.get(path)
        if own is not None and [st.st_uid, st.st_gid] != list(own):
            return f"{path}: owner {st.st_uid}:{st.st_gid}, dumped as {own[0]}:{own[1]}"
        if root and (st.st_uid != 0 or st.st_mode & 0o002):
            return f"{path}: not root's"
    return None


__all__ = ["reg_files", "image_pids", "owners", "check"]
