"""Where tpassd keeps the manifests of complete whole-job snapshots, and the per-user quota they
count against.

Two copies of each job manifest. ``STATE_DIR/jobs/J/snapshots/ID.json`` (root's, readable by the
job's owner only: group only when it is the owner's private group) is what tpassctl and the
rank wrapper read. ``STATE_DIR/jobs/J`` belongs to the job's owner, who may rename
``jobs/J/snapshots`` and so hide their snapshots from the quota and the expiry; so the committing
tpassd also keeps a record of each manifest in ``SNAPSHOT_DIR/snapshots/jobJ/ID.json`` (root's
alone, beside the images). The quota and the expiry count the records, and the manifests in
STATE_DIR only where no record exists (commits older than the records).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import structlog

from torchpass import jobdir, layout
from torchpass.checkpoint import job_manifest, safeio
from torchpass.checkpoint.node_settings import NodeSettings
from torchpass.errors import RemoteError

log = structlog.get_logger("tpassd.checkpoint")

_JOB_ID = re.compile(r"[0-9]{1,12}")  # layout.job_dir's name


class SnapshotRecords:
    def __init__(self, settings: NodeSettings):
        self.settings = settings

    def open_manifests_dir(self, job_id: int, create_for: int | None = None) -> int | None:
        """STATE_DIR/jobs/J/snapshots, root's and readable by the owner alone (made for uid ``create_for``
        when missing); None when absent. A directory there that root does not own is refused."""
        state_dir, node = self.settings.state_dir, self.settings.node
        if state_dir is None:
            raise RemoteError("unavailable", f"tpassd on {node} has no state_dir: it cannot keep job manifests")
        parts = layout.snapshot_manifests_dir(state_dir, job_id).relative_to(state_dir).parts
        try:
            jfd = safeio.open_dir(state_dir, parts[:-1])
        except FileNotFoundError:
            if create_for is None:
                return None
            raise RemoteError("failed", f"job {job_id} has no state directory on {node}") from None
        except OSError as exc:
            raise RemoteError("forbidden", f"job {job_id}'s state directory: {exc}") from None
        try:
            if create_for is not None:
                try:
                    os.mkdir(parts[-1], 0o750, dir_fd=jfd)
                except FileExistsError:
                    pass
            try:
                fd = os.open(parts[-1], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=jfd)
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise RemoteError("forbidden", f"job {job_id}'s snapshot manifests: {exc}") from None
            st = os.fstat(fd)
            if st.st_uid != 0:
                os.close(fd)
                raise RemoteError("forbidden", f"{layout.snapshot_manifests_dir(state_dir, job_id)} is not "
                                               "root's (someone else made it); remove it")
            if create_for is not None:
                self.share_with_owner(fd, create_for, directory=True)
            return fd
        finally:
            os.close(jfd)

    def share_with_owner(self, fd: int, uid: int, *, directory: bool) -> None:
        """The manifests (and their directory) are readable by the job's owner only: a group reads
        them only when it is the owner's private group."""
        why = jobdir.share_with_owner(fd, uid, self.settings.owner_gid(uid), directory=directory)
        if why:
            log.warning("a job manifest its owner cannot read", uid=uid, why=why)


    def _records_dir(self, job_id: int, create: bool = False) -> int | None:
        parts = layout.snapshot_tree(self.settings.snapshot_dir, job_id).relative_to(self.settings.snapshot_dir).parts
        try:
            if create:
                base = safeio.open_dir(self.settings.snapshot_dir, ())
                try:
                    for i, part in enumerate(parts):
                        try:
                            os.mkdir(part, 0o700, dir_fd=base)
                        except FileExistsError:
                            pass
                        nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=base)
                        os.close(base)
                        base = nxt
                    return base
                except BaseException:
                    os.close(base)
                    raise
            return safeio.open_dir(self.settings.snapshot_dir, parts)
        except FileNotFoundError:
            return None

    def write_record(self, job_id: int, snap: str, manifest: dict[str, Any]) -> None:
        dfd = self._records_dir(job_id, create=True)
        try:
            safeio.write_at(dfd, layout.snapshot_manifest(".", job_id, snap).name, job_manifest.encode(manifest),
                            mode=0o600)
        finally:
            os.close(dfd)

    def remove_record(self, job_id: int, snap: str) -> None:
        try:
            dfd = self._records_dir(job_id)
        except OSError:
            return
        if dfd is None:
            return
        try:
            os.unlink(layout.snapshot_manifest(".", job_id, snap).name, dir_fd=dfd)
        except FileNotFoundError:
            pass
        finally:
            os.close(dfd)
        try:  # the job's tree, once nothing of it is left
            os.rmdir(layout.snapshot_tree(self.settings.snapshot_dir, job_id))
        except OSError:
            pass

    def _each_jobs_records(self) -> dict[int, list[dict[str, Any]]]:
        """The root-only records under this tpassd's SNAPSHOT_DIR/snapshots, job by job."""
        top = Path(self.settings.snapshot_dir) / layout.SNAPSHOTS
        try:
            names = os.listdir(top)
        except OSError:
            return {}
        out: dict[int, list[dict[str, Any]]] = {}
        for name in names:
            m = re.fullmatch(r"job([0-9]{1,12})", name)
            if m is None:
                continue
            job_id = int(m.group(1))
            try:
                dfd = self._records_dir(job_id)
            except OSError:
                continue
            if dfd is None:
                continue
            try:
                found = job_manifest.read_all(dfd, job_id)
            except OSError:
                continue
            finally:
                os.close(dfd)
            if found:
                out[job_id] = found
        return out

    def each_jobs_manifests(self) -> list[tuple[int, list[dict[str, Any]]]]:
        """Every job's complete snapshots, job by job: the root-only records in SNAPSHOT_DIR, and the
        root-written manifests under STATE_DIR that have no record (committed before the records)."""
        records = self._each_jobs_records()
        merged = {j: list(found) for j, found in records.items()}
        for job_id, found in self._each_state_dir_manifests():
            have = {m["snapshot"] for m in merged.get(job_id, [])}
            extra = [m for m in found if m["snapshot"] not in have]
            if extra:
                merged[job_id] = sorted(merged.get(job_id, []) + extra,
                                        key=lambda m: (float(m.get("created") or 0), str(m["snapshot"])))
        return sorted(merged.items())

    def _each_state_dir_manifests(self) -> list[tuple[int, list[dict[str, Any]]]]:
        """Every job's complete snapshots under STATE_DIR (root-written manifests only), job by job."""
        if self.settings.state_dir is None:
            return []
        try:
            names = os.listdir(layout.jobs_dir(self.settings.state_dir))
        except OSError:
            return []
        out = []
        for name in names:
            if not _JOB_ID.fullmatch(name):
                continue
            job_id = int(name)
            try:
                dfd = self.open_manifests_dir(job_id)
            except RemoteError:
                continue  # not root's: nothing of a complete snapshot there
            if dfd is None:
                continue
            try:
                out.append((job_id, job_manifest.read_all(dfd, job_id)))
            finally:
                os.close(dfd)
        return out

    def check_quota(self, owner: int, job_id: int, snap: str, new_bytes: int, keep: int,
                     part: int | None = None) -> None:
        """Refuse the commit (RemoteError conflict: the coordinator then discards the images) when the
        owner's complete snapshots, with this one in and the job's oldest gone by retention, would
        exceed snapshot_quota_bytes. ``part``: a rank's dump, before it is written (``new_bytes``: its
        estimate, the rank alone)."""
        quota = self.settings.snapshot_quota_bytes
        if quota <= 0:
            return
        used = 0
        for jid, found in self.each_jobs_manifests():
            mine = [m for m in found if m.get("uid") == owner and m.get("snapshot") != snap]
            if jid == job_id:  # JobSnapshots.retain keeps the newest `keep`, this one among them
                mine = mine[max(0, len(mine) + 1 - keep):]
            used += sum(int(m.get("bytes") or 0) for m in mine)
        if used + new_bytes > quota:
            what = (f"snapshot {snap} of job {job_id}" if part is None
                    else f"rank {part} alone of snapshot {snap} of job {job_id} (estimated)")
            raise RemoteError("conflict", f"{what} ({new_bytes / 1e9:.2f} GB) would bring "
                                          f"uid {owner}'s snapshots to {(used + new_bytes) / 1e9:.2f} GB, over this "
                                          f"cluster's quota of {quota / 1e9:g} GB per user "
                                          "(tpassd snapshot_quota_gb); delete older ones (tpassctl snapshots "
                                          "JOBID --delete ID) or ask your administrator")


__all__ = ["SnapshotRecords"]
