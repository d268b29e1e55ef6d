"""Restore tokens: root's word to the SPANK plugin that a restore was set up (slurm_spank/token.h).

The plugin forks the root restore agent for a step only when it takes a token that tpassd wrote on
that node for exactly that step's restore. tpassd writes one when the job's coordinator (munge: the
job's owner per Slurm) or root asks (``tpassd.restore`` op=prepare, torchpass.checkpoint.service),
after its own checks. So a user who sets ``TORCHPASS_RESTORE_RANK`` or ``TORCHPASS_RESTORE_SNAPSHOT``
on an srun of their own gets one line of refusal and no root process.

Where: ``layout.restore_token(TOKENS, NODE, J, KIND, ...)``, in TOKENS/NODE, both root's with mode
0700 on node-local storage (/run by default; NODE keeps apart the nodes of a devcluster, which
share one /run). What: ``key=value`` lines, parsed strictly by slurm_spank/token.c:

    kind=migration|snapshot|stopped  job=J  alloc=A (the job the step runs in)  uid=U
    rank=R generation=G (migration)  snapshot=ID (snapshot, stopped)  step=S (stopped)  created=T

Only root writes here; ``owner`` is a parameter so that tests can run as an ordinary user.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path
from typing import Any

from torchpass import layout
from torchpass.checkpoint import safeio

MAX_TOKEN_BYTES = 1024  # slurm_spank/token.h TPASS_TOKEN_MAX
FIELDS = ("kind", "job", "alloc", "uid", "rank", "generation", "snapshot", "step", "created")


def token_text(fields: dict[str, Any]) -> str:
    """The token's text: FIELDS in order, those that are not None."""
    unknown = set(fields) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown token fields {sorted(unknown)}")
    return "".join(f"{k}={fields[k]}\n" for k in FIELDS if fields.get(k) is not None)


def parse_token(text: str) -> dict[str, Any]:
    """The fields of a token's text (numbers as int); ValueError when it is not one."""
    out: dict[str, Any] = {}
    for line in text.splitlines():
        if not line:
            continue
        key, eq, val = line.partition("=")
        if not eq or key not in FIELDS or key in out:
            raise ValueError(f"token line {line[:60]!r} is not one of {', '.join(FIELDS)} (once each)")
        out[key] = val if key in ("kind", "snapshot") else int(val)
    return out


def _own_dir(dfd: int | None, path: Path, owner: int, *, create: bool) -> int:
    """A directory fd for ``path`` (``dfd``: its parent's, or None for an absolute walk of a root-owned
    tree to its parent), made 0700 when missing; refused unless it is ``owner``'s with no group or
    other access."""
    name = path.name
    parent = -1
    try:
        if dfd is None:
            if create and owner == 0:  # /run/torchpass on a node no rank has used yet; then checked
                os.makedirs(path.parent, mode=0o755, exist_ok=True)
            parent = safeio.open_root_owned_dir(path.parent) if owner == 0 else os.open(
                path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            dfd = parent
        if create:
            try:
                os.mkdir(name, 0o700, dir_fd=dfd)
            except FileExistsError:
                pass
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise OSError(exc.errno, f"{path} is a symlink or not a directory; refused") from None
        raise
    finally:
        if parent >= 0:
            os.close(parent)
    st = os.fstat(fd)
    if st.st_uid != owner or stat.S_IMODE(st.st_mode) & 0o077:
        os.close(fd)
        raise OSError(errno.EPERM, f"{path} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}, "
                                   "not root's with mode 0700; remove it")
    return fd


def open_node_dir(tokens: str | os.PathLike, node: str, *, owner: int = 0, create: bool = True) -> int:
    """TOKENS/NODE's directory fd (made root's 0700 where missing). Close it."""
    d = layout.restore_token_dir(tokens, node)
    tfd = _own_dir(None, Path(tokens), owner, create=create)
    try:
        return _own_dir(tfd, d, owner, create=create)
    finally:
        os.close(tfd)


def sweep(dfd: int, now: float, ttl_s: float = layout.RESTORE_TOKEN_TTL_S) -> int:
    """Remove the tokens in ``dfd`` older than ``ttl_s`` (taken or not): the plugin refuses them
    anyway. How many were removed."""
    gone = 0
    for name in os.listdir(dfd):
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if now - st.st_mtime > ttl_s:
                os.unlink(name, dir_fd=dfd)
                gone += 1
        except OSError:
            continue
    return gone


def write_token(tokens: str | os.PathLike, node: str, *, kind: str, job: int, alloc: int, uid: int,
                rank: int | None = None, generation: int | None = None, snapshot: str | None = None,
                step: int | None = None, now: float | None = None, owner: int = 0) -> Path:
    """Write the token of one restore on ``node`` (replacing an earlier one of the same name and any
    bound copy of it: a new prepare starts afresh); its path."""
    now = time.time() if now is None else now
    if kind == "migration":
        if rank is None or generation is None:
            raise ValueError("a migration token names its rank and generation")
        snapshot = None
    elif not layout.valid_snapshot_id(snapshot or ""):
        raise ValueError(f"a {kind} token names a snapshot id, not {snapshot!r}")
    text = token_text({"kind": kind, "job": job, "alloc": alloc, "uid": uid,
                       "rank": rank if kind == "migration" else None, "generation": generation if kind == "migration"
                       else None, "snapshot": snapshot, "step": step, "created": int(now)})
    path = layout.restore_token(tokens, node, job, kind, rank=rank)
    dfd = open_node_dir(tokens, node, owner=owner)
    try:
        sweep(dfd, now)
        if kind != "migration":  # a copy bound to a step of an earlier run serves no later one
            prefix = path.name[:-len(layout.TOKEN_SUFFIX)] + ".step"
            for name in os.listdir(dfd):
                if name.startswith(prefix) and name.endswith(layout.TOKEN_SUFFIX):
                    os.unlink(name, dir_fd=dfd)
        safeio.write_at(dfd, path.name, text.encode(), mode=0o600)
    finally:
        os.close(dfd)
    return path


__all__ = ["FIELDS", "MAX_TOKEN_BYTES", "open_node_dir", "parse_token", "sweep", "token_text", "write_token"]
