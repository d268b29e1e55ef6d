"""The files tpassd's checkpoint service reads and writes, each at the one path the layout gives.

The rank directory is ``layout.rank_records_dir(STATE_DIR, J)`` (the job user's: walked from
STATE_DIR without following a symlink, read capped, written with O_NOFOLLOW|O_EXCL then renamed,
torchpass.checkpoint.safeio); a request that names another is refused. Snapshot images are
``layout.images_dir(ROOT, J, R, G)`` (or a whole-job snapshot's rank directory) under this tpassd's
snapshot_dir or another directory tree owned by root alone; anything else is ``forbidden``.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from torchpass import layout
from torchpass.checkpoint import safeio
from torchpass.checkpoint.manifest import checksum_of, read_manifest_bytes
from torchpass.checkpoint.node_settings import NodeSettings
from torchpass.errors import RemoteError


class JobFiles:
    def __init__(self, settings: NodeSettings):
        self.settings = settings

    # -- the rank directory (the job user's) --------------------------------------------------
    def rank_dir(self, job_id: int) -> Path:
        s = self.settings
        if s.state_dir is None:
            raise RemoteError("unavailable", f"tpassd on {s.node} has no state_dir: it cannot find rank records")
        return layout.rank_records_dir(s.state_dir, job_id)

    def check_rank_dir(self, b: dict[str, Any], job_id: int) -> None:
        """A request may name the rank directory only as tpassd derives it itself."""
        asked = b.get("rank_dir")
        if asked and os.path.normpath(asked) != str(self.rank_dir(job_id)):
            raise RemoteError("forbidden", f"rank_dir {asked} is not job {job_id}'s rank directory "
                                           f"({self.rank_dir(job_id)}); refused")

    def open_rank_dir(self, job_id: int) -> int | None:
        """RANK_DIR/jobJ (the user's), walked from STATE_DIR without following a symlink; None if absent."""
        state_dir = self.settings.state_dir
        parts = layout.rank_job_dir(self.rank_dir(job_id), job_id).relative_to(state_dir).parts
        try:
            return safeio.open_dir(state_dir, parts)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise RemoteError("forbidden", f"job {job_id}'s rank directory: {exc}") from None

    @staticmethod
    def read_record(dfd: int, job_id: int, rank: int) -> dict[str, Any]:
        """The rank record in the rank directory ``dfd`` (RemoteError not_found when unreadable)."""
        name = layout.rank_record(".", job_id, rank).name
        try:
            rec = json.loads(safeio.read_regular(name, safeio.MAX_RECORD_BYTES, dir_fd=dfd))
        except (OSError, ValueError) as exc:
            raise RemoteError("not_found", f"rank {rank} of job {job_id} does not run under rankwrap here "
                                           f"(its rank record: {exc}); it cannot be snapshotted") from None
        if not isinstance(rec, dict):
            raise RemoteError("not_found", f"rank {rank} of job {job_id}: its rank record is not an object")
        return rec

    @staticmethod
    def write(dfd: int, path: Path, text: str) -> None:
        """Write ``path``'s name in the directory ``dfd`` (O_NOFOLLOW|O_EXCL, then renamed)."""
        safeio.write_at(dfd, path.name, text.encode())

    def write_handoff(self, job_id: int, rank: int, text: str) -> None:
        """The rank's hand-off marker says ``text``; nothing when the rank directory is gone."""
        dfd = self.open_rank_dir(job_id)
        if dfd is None:
            return
        try:
            self.write(dfd, layout.handoff(self.rank_dir(job_id), job_id, rank), text)
        finally:
            os.close(dfd)

    # -- snapshot images (root's) -------------------------------------------------------------
    def open_images(self, job_id: int, rank: int, images: str) -> tuple[Path, int]:
        """(IMAGES, its directory fd) when ``images`` is layout.images_dir(ROOT, J, R, G) under this
        tpassd's snapshot_dir or a directory tree owned by root alone; RemoteError forbidden otherwise."""
        parsed = layout.parse_images_dir(images, job_id, rank) if os.path.isabs(images) else None
        if parsed is None:
            raise RemoteError("forbidden", f"{images} is not a snapshot directory of rank {rank} of job {job_id} "
                                           "(SNAPSHOT_DIR/jobJ/rankR.genG); refused")
        return self.open_dir_of(parsed[0], layout.images_dir(parsed[0], job_id, rank, parsed[1]))

    def open_dir_of(self, root: Path, path: Path) -> tuple[Path, int]:
        """A directory fd for ``path`` under this tpassd's snapshot_dir (walked without following a
        symlink) or under a directory tree owned by root alone (another node's snapshot_dir)."""
        snapshot_dir = self.settings.snapshot_dir
        try:
            if root == snapshot_dir:
                return path, safeio.open_dir(snapshot_dir, path.relative_to(snapshot_dir).parts)
            return path, safeio.open_root_owned_dir(path)
        except FileNotFoundError:
            raise RemoteError("failed", f"{self.settings.node} cannot read snapshot {path} (it does not exist)"
                              ) from None
        except OSError as exc:
            raise RemoteError("forbidden", f"snapshot {path}: {exc}") from None

    def check_images(self, job_id: int, images: Path, dfd: int, want: str | None
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(manifest, its files) of the images in ``dfd``: readable, matching ``want``, every file there
        at its recorded size, the job's; RemoteError otherwise."""
        node = self.settings.node
        try:
            raw = read_manifest_bytes(images, dir_fd=dfd)
            manifest = json.loads(raw)
            files = manifest["files"]
            if not isinstance(files, dict):
                raise ValueError("its files are not a mapping")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise RemoteError("failed", f"{node} cannot read snapshot {images} ({exc})") from None
        if want and checksum_of(raw) != want:
            raise RemoteError("failed", f"snapshot {images} on {node} does not match its checksum")
        for n, f in files.items():
            try:
                st = os.stat(n, dir_fd=dfd, follow_symlinks=False) if "/" not in n else None
            except OSError:
                st = None
            if st is None or not stat.S_ISREG(st.st_mode) or st.st_size != (f or {}).get("size"):
                raise RemoteError("failed", f"snapshot {images} on {node}: {n} missing or incomplete")
        if (manifest.get("meta") or {}).get("job") != job_id:
            raise RemoteError("forbidden", f"snapshot {images} is not one of job {job_id}")
        return manifest, files


__all__ = ["JobFiles"]
