"""tpassd.restore: ``prepare`` (the one-time token without which the SPANK plugin starts no root
restore agent on this node), ``verify`` (a snapshot's images are whole and the job's before the
restore step runs) and ``abort`` (kill what a failed move restored, and give the rank record back
to the copy the move started from).

A token names the job, the kind (layout.TOKEN_KINDS), the images' generation or the snapshot, the
step where known and the rank; it is written root's 0700 under tpassd.toml's restore_token_dir
(torchpass.checkpoint.restore_token) and consumed by the plugin.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import structlog

from torchpass import layout
from torchpass.checkpoint import job_manifest, restore_token
from torchpass.checkpoint.admission import Admission, Audit
from torchpass.checkpoint.job_files import JobFiles
from torchpass.checkpoint.node_settings import NodeSettings
from torchpass.checkpoint.rank_kill import RankKills
from torchpass.checkpoint.snapshot_records import SnapshotRecords
from torchpass.errors import RemoteError

log = structlog.get_logger("tpassd.checkpoint")

def _count(b: dict[str, Any], key: str, required: bool) -> int | None:
    v = b.get(key)
    if v is None and not required:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2 ** 32 - 1:
        raise RemoteError("bad_request", f"op prepare: {key} must be a non-negative integer, got {v!r}")
    return v


class RestoreRequests:
    def __init__(self, settings: NodeSettings, admission: Admission, files: JobFiles, records: SnapshotRecords,
                 kills: RankKills):
        self.settings = settings
        self.admission = admission
        self.files = files
        self.records = records
        self.kills = kills

    def handle(self, b: dict[str, Any], act: Audit) -> dict[str, Any]:
        """tpassd.restore's op ``prepare``, ``verify`` or ``abort``, authorized and audited (``act``)."""
        job_id, rank, op = b["job_id"], b["rank"], b["op"]
        if op == "prepare":
            return self.prepare(b, act)
        if op in ("verify", "abort") and not isinstance(b.get("images"), str):
            raise RemoteError("bad_request", f"op {op} of tpassd.restore needs images (a path)")
        if op == "verify":
            images, dfd = self.files.open_images(job_id, rank, b["images"])
            try:
                return self.verify(job_id, rank, images, dfd, b.get("checksum"))
            finally:
                os.close(dfd)
        if op == "abort":
            self.files.check_rank_dir(b, job_id)
            if layout.parse_images_dir(b["images"], job_id, rank) is None:
                raise RemoteError("forbidden", f"{b['images']} is not a snapshot directory of rank {rank} of job "
                                               f"{job_id}; refused")
            return self.abort_restored(job_id, rank, b["images"], act)
        raise RemoteError("bad_request", f"unknown op {op!r} for tpassd.restore; allowed: verify, abort, prepare")

    def prepare(self, b: dict[str, Any], act: Audit) -> dict[str, Any]:
        """op=prepare: write the token that lets the SPANK plugin on this node start the root restore
        agent for one restore (torchpass.checkpoint.restore_token). The requester owns the job (or is
        root: the admission asked Slurm); a companion allocation the step runs in has the same owner; a
        snapshot restore names a committed snapshot of the job (its manifest root's, of that owner)."""
        job_id, rank, kind = b["job_id"], b["rank"], b.get("kind")
        if kind not in layout.TOKEN_KINDS:
            raise RemoteError("bad_request", f"op prepare: kind {kind!r} is not one of {', '.join(layout.TOKEN_KINDS)}")
        act.fields["kind"] = kind
        owner = act.owner if act.owner is not None else self.admission.owner_of(job_id)
        alloc = _count(b, "alloc", False)
        alloc = job_id if alloc is None else alloc
        if alloc != job_id and self.admission.owner_of(alloc) != owner:
            raise RemoteError("forbidden", f"job {alloc} is not of job {job_id}'s owner (uid {owner}); no restore "
                                           f"of job {job_id} runs in it")
        step = _count(b, "step", False)
        generation, snap = None, None
        if kind == "migration":
            generation = _count(b, "generation", True)
            act.fields["generation"] = generation
        else:
            snap = b.get("snapshot")
            if not isinstance(snap, str) or not layout.valid_snapshot_id(snap):
                raise RemoteError("bad_request", f"op prepare: a {kind} restore needs a snapshot id, got {snap!r}")
            act.fields["snapshot"] = snap
            dfd = self.records.open_manifests_dir(job_id)
            if dfd is None:
                raise RemoteError("not_found", f"job {job_id} has no snapshots; nothing to restore")
            try:
                found = {m["snapshot"]: m for m in job_manifest.read_all(dfd, job_id)}
            finally:
                os.close(dfd)
            if snap not in found:
                raise RemoteError("not_found", f"job {job_id} has no committed snapshot {snap}; nothing to restore")
            if found[snap].get("uid") != owner:
                raise RemoteError("forbidden", f"snapshot {snap} of job {job_id} is of uid {found[snap].get('uid')}, "
                                               f"not of the job's owner (uid {owner}); refused")
        try:
            s = self.settings
            path = restore_token.write_token(s.restore_tokens, s.node, kind=kind, job=job_id, alloc=alloc,
                                             uid=owner, rank=rank, generation=generation, snapshot=snap,
                                             step=step if kind == "stopped" else None, now=s.wall(),
                                             owner=s.token_owner)
        except (OSError, ValueError) as exc:
            raise RemoteError("failed", f"{self.settings.node} cannot write the restore token: {exc}") from None
        return {"node": self.settings.node, "kind": kind, "token": path.name, "ttl_s": layout.RESTORE_TOKEN_TTL_S}

    def verify(self, job_id: int, rank: int, images: Path, dfd: int, want: str | None) -> dict[str, Any]:
        manifest, files = self.files.check_images(job_id, images, dfd, want)
        if self.settings.restore_fault():
            self._corrupt_for_drill(images, dfd, manifest)
        return {"node": self.settings.node, "rank": rank, "files": len(files)}

    def abort_restored(self, job_id: int, rank: int, images: str, act: Audit) -> dict[str, Any]:
        nothing = {"node": self.settings.node, "rank": rank, "killed": False}
        dfd = self.files.open_rank_dir(job_id)
        if dfd is None:
            return nothing
        try:
            try:
                rec = self.files.read_record(dfd, job_id, rank)
            except RemoteError:
                return nothing
            if rec.get("restored_from") != images or rec.get("node") != self.settings.node:
                return nothing
            pid, wrapper = rec.get("pid"), rec.get("wrapper_pid")
            act.fields["pid"] = pid
            if not isinstance(pid, int) or not isinstance(wrapper, int):
                raise RemoteError("forbidden", f"rank {rank} of job {job_id}: its rank record names no pids")
            # The rank is the copy this move started from again: put its record back
            # *before* the kill, so that the aborted copy's wrapper, when its rank dies,
            # sees it is no longer the rank and writes no exit code (the rank's first
            # task wrapper would report that 137 to srun), and a later move finds the
            # rank where it runs. No saved record (a wrapper older than "previous"):
            # the record says the copy was aborted, which the wrapper also honours.
            # The pid is checked first (the job's, the wrapper's child); a copy already
            # gone is no reason to leave the record naming it.
            pinned = self.admission.pin_unless_gone(job_id, pid, parent=wrapper, act=act)
            prev = rec.get("previous")
            restored_prev = isinstance(prev, dict) and prev.get("wrapper_pid")
            record = layout.rank_record(self.files.rank_dir(job_id), job_id, rank)
            try:
                self.files.write(dfd, record, json.dumps(prev if restored_prev else {**rec, "aborted": True}))
            except BaseException:
                if pinned is not None:
                    pinned.close()
                raise
            out = self.kills.kill_pinned(job_id, rank, pid, pinned)
            out["record"] = "previous" if restored_prev else "aborted"
            log.info("restored copy aborted; rank record back to the copy the move started from",
                     job_id=job_id, rank=rank, images=images, record_now=out["record"],
                     node_now=(prev or {}).get("node") if isinstance(prev, dict) else None)
            return out
        finally:
            os.close(dfd)

    def _corrupt_for_drill(self, images: Path, dfd: int, manifest: dict[str, Any]) -> None:
        """The restore-fail drill: flip one byte in the middle of the largest image file.

        Done after the verify passed (it checks sizes and the manifest, not every
        file's SHA-256), so the coordinator goes on to the restore, whose full
        check (run while CRIU restores) refuses the image and kills the restored copy
        before it may run: the real failed-restore path.
        """
        files = {n: f.get("size", 0) for n, f in manifest.get("files", {}).items() if f.get("size", 0) > 0}
        if not files:
            log.warning("restore-fail drill: snapshot has no image data to corrupt", images=str(images))
            return
        name = max(files, key=lambda n: (files[n], n))
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:
            off = files[name] // 2
            b = os.pread(fd, 1, off)
            os.pwrite(fd, bytes([b[0] ^ 0xFF]), off)
        finally:
            os.close(fd)
        log.warning("fault drill restore-fail: corrupted a verified snapshot; its restore will fail",
                    images=str(images), file=name, offset=off)


__all__ = ["RestoreRequests"]
