"""The job manifest of a whole-job snapshot: one format, written by root, read by every side.

tpassd (root) writes ``STATE_DIR/jobs/J/snapshots/ID.json`` when it commits
snapshot ID (``job_snapshots.JobSnapshots.commit``): which ranks, on which nodes, in
which image directories, with which checksums, of which owner. A relaunched
step's rank wrapper (the job's user) reads it to find its rank's images, and
tpassctl lists and resumes from it. The user owns ``jobs/J``, so a reader
takes only a regular file owned by root with one link, of this job, named by
its own snapshot id (``read_all``): a user cannot forge one there. The root
restore agent checks the images a manifest names on its own
(``restore_agent.check_images``), so this module is the format, not a trust
decision. It imports nothing that runs as root, so the user-side programs
may use it (the import contract in pyproject.toml).
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from torchpass import layout
from torchpass.checkpoint import safeio

VERSION = 1
# A manifest lists every rank's part: ~200 bytes each, so 4 MiB holds ~20,000 ranks.
MAX_BYTES = 4 << 20


def build(*, job_id: int, snapshot: str, uid: int, created: float, step: int | None, generation: int | None,
          collectives: int | None, parts: list[dict[str, Any]], written_by: str) -> dict[str, Any]:
    """The manifest of snapshot ``snapshot`` of job ``job_id``: ``parts`` are the checked ranks
    ({rank, node, images, checksum, bytes}), sorted by rank."""
    return {
        "version": VERSION, "job_id": job_id, "snapshot": snapshot, "uid": uid, "created": round(created, 3),
        "step": step, "generation": generation, "collectives": collectives,
        "world_size": len(parts), "nodes": sorted({p["node"] for p in parts}), "ranks": parts,
        "bytes": sum(p["bytes"] for p in parts), "written_by": written_by,
    }


def encode(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, indent=1).encode()


def parse(data: bytes) -> dict[str, Any]:
    """A manifest from its bytes; ValueError (why) when it is not one."""
    m = json.loads(data)
    if not isinstance(m, dict):
        raise ValueError("not a JSON object")
    return m


def rank_images(manifest: dict[str, Any], rank: int | str) -> str | None:
    """Rank ``rank``'s image directory in ``manifest``; None when it has no such rank."""
    for part in manifest.get("ranks") or []:
        if isinstance(part, dict) and str(part.get("rank")) == str(rank) and isinstance(part.get("images"), str):
            return part["images"]
    return None


def read_all(dfd: int, job_id: int) -> list[dict[str, Any]]:
    """The job manifests in the directory ``dfd`` (STATE_DIR/jobs/J/snapshots), oldest first: only
    regular files owned by root with one link (root wrote them; a user cannot forge one there), of
    this job, whose name is their snapshot id. Unreadable or foreign entries are skipped."""
    out = []
    suffix = layout.SNAPSHOT_MANIFEST_SUFFIX
    for name in os.listdir(dfd):
        if not name.endswith(suffix) or name.startswith("."):
            continue
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_nlink != 1:
                continue
            m = parse(safeio.read_regular(name, MAX_BYTES, dir_fd=dfd))
        except (OSError, ValueError):
            continue
        if m.get("job_id") == job_id and f"{m.get('snapshot')}{suffix}" == name:
            out.append(m)
    out.sort(key=lambda m: (float(m.get("created") or 0), str(m["snapshot"])))
    return out


__all__ = ["MAX_BYTES", "VERSION", "build", "encode", "parse", "rank_images", "read_all"]
