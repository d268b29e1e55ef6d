"""Whole-job snapshots (tpassctl snapshot): tpassd.snapshot's ops ``snap``, ``commit``, ``discard``
and ``delete``, the retention of a job's newest ``keep``, and the expiry of old ones.

op "snap":    dump the held rank into SNAPSHOT_DIR/snapshots/jobJ/ID/rankR (no hand-off marker)
op "commit":  (rank 0's tpassd) verify every rank's images, write the job manifest
              STATE_DIR/jobs/J/snapshots/ID.json (root's, readable by the owner), keep the newest `keep`
op "discard": remove this snapshot_dir's part of a snapshot that failed (no manifest was written)
op "delete":  remove a committed snapshot (its images on every node's snapshot_dir, then its manifest)
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import structlog

from torchpass import auth, layout
from torchpass.checkpoint import job_manifest, safeio
from torchpass.checkpoint.admission import Admission, Audit
from torchpass.checkpoint.job_files import JobFiles
from torchpass.checkpoint.node_settings import NodeSettings
from torchpass.checkpoint.rank_dump import RankDumps
from torchpass.checkpoint.snapshot_records import SnapshotRecords
from torchpass.errors import RemoteError

log = structlog.get_logger("tpassd.checkpoint")

# tpassd.snapshot ops of whole-job snapshots (JobSnapshots.handle).
JOB_SNAPSHOT_OPS = ("snap", "commit", "discard", "delete")


def keep_of(body: dict[str, Any]) -> int:
    """A request's ``keep`` (the job's retention: the snapshots kept), 1 when absent or not a count."""
    keep = body.get("keep")
    return keep if isinstance(keep, int) and not isinstance(keep, bool) and keep >= 1 else 1


class JobSnapshots:
    def __init__(self, settings: NodeSettings, admission: Admission, files: JobFiles, records: SnapshotRecords,
                 dumps: RankDumps):
        self.settings = settings
        self.admission = admission
        self.files = files
        self.records = records
        self.dumps = dumps

    def handle(self, b: dict[str, Any], op: str, act: Audit) -> dict[str, Any]:
        """One of JOB_SNAPSHOT_OPS, authorized (``authorize``) and audited (``act``)."""
        job_id, snap = b["job_id"], b.get("snapshot")
        if not isinstance(snap, str) or not layout.valid_snapshot_id(snap):
            raise RemoteError("bad_request", f"op {op} needs a snapshot id (letters, digits, '-', '_'); got {snap!r}")
        act.fields["snapshot"] = snap
        if op == "snap":
            out = self.dumps.dump(job_id, b["rank"], int(b.get("generation") or 0), act, snapshot=snap,
                                  keep=keep_of(b))
            return {**out, "snapshot": snap}
        if op == "commit":
            return self.commit(job_id, snap, b, act.owner)
        if op == "discard":
            state_dir = self.settings.state_dir
            if state_dir is not None and layout.snapshot_manifest(state_dir, job_id, snap).exists():
                raise RemoteError("conflict", f"snapshot {snap} of job {job_id} is complete (it has a manifest); "
                                              "delete it instead (tpassctl snapshots JOBID --delete ID)")
            return {"node": self.settings.node, "snapshot": snap,
                    "discarded_mb": round(self.remove_images(self.settings.snapshot_dir, job_id, snap) / 1e6, 1)}
        return self.delete(job_id, snap)

    def _snapshot_part(self, job_id: int, snap: str, part: Any) -> dict[str, Any]:
        """One rank's part, checked: its images are that rank's of this snapshot under root-owned
        directories, its root-written manifest matches the checksum; the sizes are the manifest's."""
        if not isinstance(part, dict) or not isinstance(part.get("rank"), int) or isinstance(part["rank"], bool) \
                or not isinstance(part.get("images"), str):
            raise RemoteError("bad_request", f"snapshot {snap}: a part is not {{rank, node, images, checksum}}")
        rank, images = part["rank"], part["images"]
        parsed = layout.parse_snapshot_images_dir(images, job_id, rank) if os.path.isabs(images) else None
        if parsed is None or parsed[1] != snap:
            raise RemoteError("forbidden", f"{images} is not rank {rank}'s directory of snapshot {snap} of job "
                                           f"{job_id}; refused")
        path, dfd = self.files.open_dir_of(parsed[0], layout.snapshot_images_dir(parsed[0], job_id, snap, rank))
        try:
            manifest, _ = self.files.check_images(job_id, path, dfd, part.get("checksum"))
        finally:
            os.close(dfd)
        meta = manifest.get("meta") or {}
        if meta.get("rank") != rank or meta.get("snapshot") != snap:
            raise RemoteError("forbidden", f"snapshot {path} is not rank {rank}'s of snapshot {snap}")
        size = sum(int((f or {}).get("size") or 0) for f in manifest["files"].values())
        return {"rank": rank, "node": str(meta.get("node") or part.get("node") or ""), "images": str(path),
                "checksum": part.get("checksum"), "bytes": size}

    def commit(self, job_id: int, snap: str, b: dict[str, Any], owner: int | None = None) -> dict[str, Any]:
        owner = self.admission.owner_of(job_id) if owner is None else owner
        parts = b.get("parts")
        if not isinstance(parts, list) or not parts:
            raise RemoteError("bad_request", f"commit of snapshot {snap}: no parts")
        checked = sorted((self._snapshot_part(job_id, snap, p) for p in parts), key=lambda p: p["rank"])
        if len({p["rank"] for p in checked}) != len(checked):
            raise RemoteError("bad_request", f"commit of snapshot {snap}: a rank is named twice")
        keep = keep_of(b)
        self.records.check_quota(owner, job_id, snap, sum(p["bytes"] for p in checked), keep)
        manifest = job_manifest.build(job_id=job_id, snapshot=snap, uid=owner, created=self.settings.wall(),
                                      step=b.get("step"), generation=b.get("generation"),
                                      collectives=b.get("collectives"), parts=checked, written_by=self.settings.node)
        dfd = self.records.open_manifests_dir(job_id, create_for=owner)
        assert dfd is not None
        try:
            name = layout.snapshot_manifest(".", job_id, snap).name
            safeio.write_at(dfd, name, job_manifest.encode(manifest), mode=0o600)
            mfd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            try:
                self.records.share_with_owner(mfd, owner, directory=False)
            finally:
                os.close(mfd)
            self.records.write_record(job_id, snap, manifest)
            removed = self.retain(job_id, dfd, keep, snap)
        finally:
            os.close(dfd)
        path = layout.snapshot_manifest(self.settings.state_dir, job_id, snap)
        log.info("job snapshot committed", job_id=job_id, snapshot=snap, mb=round(manifest["bytes"] / 1e6, 1),
                 manifest=str(path), removed=removed)
        return {"node": self.settings.node, "snapshot": snap, "manifest": str(path), "bytes": manifest["bytes"],
                "removed": removed}

    def expire(self) -> list[str]:
        """Remove the complete snapshots this tpassd committed that are older than snapshot_max_age_s
        (tpassd's sweep calls it); "JOB/ID" of each removed. One tpassd per snapshot: its writer."""
        if self.settings.snapshot_max_age_s <= 0:
            return []
        cutoff = self.settings.wall() - self.settings.snapshot_max_age_s
        gone = []
        for job_id, found in self.records.each_jobs_manifests():
            old = [m for m in found
                   if m.get("written_by") == self.settings.node and float(m.get("created") or 0) < cutoff]
            if not old:
                continue
            try:  # one job's trouble must not stop the others' expiry
                try:
                    dfd = self.records.open_manifests_dir(job_id)
                except RemoteError:
                    dfd = None  # not root's any more: the record and the images still go
                try:
                    for m in old:
                        self._remove_snapshot(job_id, m, dfd)
                        gone.append(f"{job_id}/{m['snapshot']}")
                finally:
                    if dfd is not None:
                        os.close(dfd)
            except Exception as exc:
                log.exception("expiry of one job's snapshots failed; the others go on", job_id=job_id,
                              error=str(exc))
        if gone:
            log.info("expired snapshots removed", snapshots=gone,
                     max_age_h=round(self.settings.snapshot_max_age_s / 3600, 2))
        return gone

    def retain(self, job_id: int, dfd: int, keep: int, newest: str) -> list[str]:
        """Remove all but the newest ``keep`` complete snapshots of the job (oldest first); their ids."""
        found = job_manifest.read_all(dfd, job_id)
        old = [m for m in found if m["snapshot"] != newest][:max(0, len(found) - keep)]
        for m in old:
            self._remove_snapshot(job_id, m, dfd)
        return [m["snapshot"] for m in old]

    def _remove_snapshot(self, job_id: int, manifest: dict[str, Any], dfd: int | None) -> int:
        """Remove one committed snapshot: every rank's images (each where the manifest says, checked
        against the layout), then the manifest itself. Bytes freed."""
        snap = manifest["snapshot"]
        freed = 0
        roots = set()
        for part in manifest.get("ranks") or []:
            parsed = layout.parse_snapshot_images_dir(str(part.get("images", "")), job_id, part.get("rank"))
            if parsed is not None and parsed[1] == snap:
                roots.add(parsed[0])
        for root in sorted(roots):
            freed += self.remove_images(root, job_id, snap)
        self.records.remove_record(job_id, snap)
        if dfd is not None:
            try:
                os.unlink(layout.snapshot_manifest(".", job_id, snap).name, dir_fd=dfd)
            except FileNotFoundError:
                pass
        log.info("job snapshot removed", job_id=job_id, snapshot=snap, mb=round(freed / 1e6, 1))
        return freed

    def remove_images(self, root: Path, job_id: int, snap: str) -> int:
        """Remove ROOT/snapshots/jobJ/ID (root-owned trees only: never through a user's directory)."""
        d = layout.snapshot_tree(root, job_id) / snap
        try:
            fd = safeio.open_dir(self.settings.snapshot_dir, d.relative_to(self.settings.snapshot_dir).parts) \
                if root == self.settings.snapshot_dir else safeio.open_root_owned_dir(d)
        except (OSError, ValueError):
            return 0  # not there (or not root's): nothing of ours to remove
        os.close(fd)
        freed = sum(f.stat().st_size for f in d.rglob("*") if f.is_file() and not f.is_symlink())
        shutil.rmtree(d, ignore_errors=True)
        for parent in (d.parent, d.parent.parent):
            try:
                parent.rmdir()  # only when empty
            except OSError:
                break
        return freed

    def delete(self, job_id: int, snap: str) -> dict[str, Any]:
        dfd = self.records.open_manifests_dir(job_id)
        if dfd is None:
            raise RemoteError("not_found", f"job {job_id} has no snapshots")
        try:
            found = {m["snapshot"]: m for m in job_manifest.read_all(dfd, job_id)}
            if snap not in found:
                have = ", ".join(found) or "none"
                raise RemoteError("not_found", f"job {job_id} has no snapshot {snap} (its snapshots: {have})")
            freed = self._remove_snapshot(job_id, found[snap], dfd)
        finally:
            os.close(dfd)
        return {"node": self.settings.node, "snapshot": snap, "deleted": True, "freed_mb": round(freed / 1e6, 1)}

    def authorize(self, ident: auth.Identity, job_id: int, op: str) -> int | None:
        """Root or the job's owner; for op delete also the owner a job manifest records (root wrote
        it), so that a snapshot can be deleted after Slurm forgot the job. Returns the owner when
        Slurm was asked, as ``authorize``."""
        if ident.uid == 0:
            return None
        if op == "delete" and self.settings.state_dir is not None:
            dfd = self.records.open_manifests_dir(job_id)
            if dfd is not None:
                try:
                    uids = {m.get("uid") for m in job_manifest.read_all(dfd, job_id)}
                finally:
                    os.close(dfd)
                if uids and uids <= {ident.uid}:
                    return None  # the manifests' word, not Slurm's: nothing is pinned on it
                if uids:
                    raise auth.AuthFailure("forbidden", f"uid {ident.uid} does not own job {job_id}'s snapshots")
        return self.admission.authorize(ident, job_id)



__all__ = ["JOB_SNAPSHOT_OPS", "JobSnapshots", "keep_of"]
