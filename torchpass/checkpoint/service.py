"""What tpassd's checkpoint requests do: ``tpassd.snapshot`` and ``tpassd.restore``.

The job's coordinator asks the source node's tpassd to CRIU-dump a quiesced
rank (leaving it running, paused, so that a later failure can resume it in
place), to kill that source copy once every restore succeeded, or to mark
the hand-off aborted; and the target node's tpassd to check a snapshot
before the restore step runs, or to kill what a failed move restored.

The privilege boundary (tpassd is root; the rank record and the rank
directory belong to the job user). tpassd acts only on what it verifies
itself (docs/migration-internals.md, "Privilege boundary"):

* Who may ask: root, or the uid Slurm records as the job's owner.
* Paths: the rank directory is ``layout.rank_records_dir(STATE_DIR, J)``
  (tpassd's own state directory); snapshot images are
  ``layout.images_dir(ROOT, J, R, G)`` under this tpassd's snapshot_dir or
  another directory tree owned by root alone. A request that names another
  rank directory, or images elsewhere, is refused (``forbidden``).
* Processes: a pid named by the rank record or the request is acted on only
  if Slurm lists it for the job on this node, it runs as the job's owner,
  the rank's parent is the wrapper, and (for a dump) both share tpassd's
  mount and user namespaces; pinned by a pidfd (torchpass.checkpoint.procs, through
  torchpass.checkpoint.admission).
* Files in the user's directory are read capped, never a FIFO or device,
  and written with O_NOFOLLOW|O_EXCL then renamed (torchpass.checkpoint.safeio).
* criu runs in tpassd's mount namespace (entering only the wrapper's
  network and UTS namespaces), executed from a file descriptor, with a
  timeout; scontrol too has a timeout.
* Every request leaves one audit line (logger ``tpassd.audit``): requester
  uid, job, rank, pid, action, outcome.

tpassd/checkpoint_handlers.py registers ``CheckpointService.snapshot`` and
``CheckpointService.restore`` on tpassd's control server. This module only routes each op to the
part that does it, one concern per module:

* admission:         who may ask, Slurm asked once per request, processes pinned, the audit line
* job_files:         the rank directory and the images directories, at the layout's paths only
* rank_dump:         op=dump of a rank, op=abort of a move, discarding a move's images
* rank_kill:         op=kill of a move's source copies (and the kill behind a restore's abort)
* job_snapshots:     whole-job snapshots: ops snap, commit, discard, delete; retention, expiry
* snapshot_records:  where their manifests are kept, root-only records, the per-user quota
* restore_requests:  tpassd.restore: ops prepare (the restore token), verify, abort
* node_settings:     the paths, limits and seams the parts share
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchpass import auth, layout, wire
from torchpass.checkpoint import criu as criu_mod
from torchpass.checkpoint import procs
from torchpass.checkpoint.admission import Admission, Audit
from torchpass.checkpoint.job_files import JobFiles
from torchpass.checkpoint.job_snapshots import JOB_SNAPSHOT_OPS, JobSnapshots
from torchpass.checkpoint.node_settings import NodeSettings, slurm_job_owner
from torchpass.checkpoint.rank_dump import RankDumps
from torchpass.checkpoint.rank_kill import RankKills
from torchpass.checkpoint.restore_requests import RestoreRequests
from torchpass.checkpoint.snapshot_records import SnapshotRecords
from torchpass.errors import RemoteError


class CheckpointService:
    """tpassd.snapshot and tpassd.restore, routed to the parts that do them (the module says which).

    ``settings`` (node_settings.NodeSettings) is shared by every part: tpassd sets its site limits
    there after building the service (snapshot_quota_bytes, snapshot_max_age_s, keep_free_bytes)."""

    def __init__(self, snapshot_dir: str | os.PathLike, node: str, *, state_dir: str | os.PathLike | None = None,
                 criu_binary: str | None = None, job_owner: Callable[[int], int | None] = slurm_job_owner,
                 job_pids: Callable[[int], set[int]] = procs.slurm_job_pids, proc: str = "/proc",
                 restore_fault: Callable[[], bool] | None = None, kill_fault: Callable[[], bool] | None = None,
                 gpu_in_use: Callable[[int], bool] | None = None, cuda_loader: Callable[[], Any] | None = None,
                 dump_timeout_s: float = criu_mod.DUMP_TIMEOUT_S,
                 image_estimate: Callable[[int], int] = criu_mod.image_estimate, keep_free_bytes: int = 0,
                 wall: Callable[[], float] | None = None, owner_gid: Callable[[int], int | None] | None = None,
                 restore_tokens: str | os.PathLike = layout.RESTORE_TOKENS, token_owner: int = 0):
        s = self.settings = NodeSettings(
            snapshot_dir=Path(snapshot_dir), node=node, state_dir=None if state_dir is None else Path(state_dir),
            criu_binary=criu_binary, job_owner=job_owner, job_pids=job_pids, proc=proc,
            gpu_in_use=gpu_in_use, cuda_loader=cuda_loader, dump_timeout_s=dump_timeout_s,
            image_estimate=image_estimate, keep_free_bytes=keep_free_bytes,
            restore_tokens=Path(restore_tokens), token_owner=token_owner)
        if restore_fault is not None:
            s.restore_fault = restore_fault
        if kill_fault is not None:
            s.kill_fault = kill_fault
        if wall is not None:
            s.wall = wall
        if owner_gid is not None:
            s.owner_gid = owner_gid
        self.admission = Admission(s)
        self.files = JobFiles(s)
        self.records = SnapshotRecords(s)
        self.kills = RankKills(s, self.admission)
        self.dumps = RankDumps(s, self.admission, self.files, self.records.check_quota)
        self.snapshots = JobSnapshots(s, self.admission, self.files, self.records, self.dumps)
        self.restores = RestoreRequests(s, self.admission, self.files, self.records, self.kills)

    # -- the two requests tpassd serves ---------------------------------------------------------
    def snapshot(self, msg: wire.Message, ident: auth.Identity) -> dict[str, Any]:
        """tpassd.snapshot: ops dump, kill, abort (a migration) and JOB_SNAPSHOT_OPS."""
        return self.admission.audited("snapshot", msg, ident, self._snapshot_op, authorize=self._authorize_snapshot)

    def restore(self, msg: wire.Message, ident: auth.Identity) -> dict[str, Any]:
        """tpassd.restore: ops prepare, verify, abort."""
        return self.admission.audited("restore", msg, ident, self.restores.handle)

    def _authorize_snapshot(self, ident: auth.Identity, job_id: int, op: str) -> int | None:
        if op in JOB_SNAPSHOT_OPS:  # a committed snapshot outlives its job: its manifests may say who owns it
            return self.snapshots.authorize(ident, job_id, op)
        return self.admission.authorize(ident, job_id)

    def _snapshot_op(self, b: dict[str, Any], act: Audit) -> dict[str, Any]:
        job_id, rank, op = b["job_id"], b["rank"], b["op"]
        self.files.check_rank_dir(b, job_id)
        if op == "dump":
            return self.dumps.dump(job_id, rank, int(b.get("generation") or 0), act)
        if op in JOB_SNAPSHOT_OPS:
            return self.snapshots.handle(b, op, act)
        if op == "kill":
            killed = self.kills.kill_sources(b, act)
            # Every restore succeeded before the coordinator asks for this kill:
            # the images are not needed any more.
            for out in killed:
                out["discarded_mb"] = self.dumps.discard(job_id, out["rank"])
            if len(killed) > 1:
                killed[0]["tasks"] = killed[1:]
            return killed[0]
        if op == "abort":
            return self.dumps.abort_move(job_id, rank)
        raise RemoteError("bad_request", f"unknown op {op!r} for tpassd.snapshot; allowed: dump, kill, abort, "
                                         f"{', '.join(JOB_SNAPSHOT_OPS)}")

    # -- what tpassd calls besides requests -------------------------------------------------------
    def authorize(self, ident: auth.Identity, job_id: int) -> int | None:
        """Root, or the job's owner (admission.Admission.authorize)."""
        return self.admission.authorize(ident, job_id)

    def expire_snapshots(self) -> list[str]:
        """Remove this tpassd's complete snapshots older than snapshot_max_age_s (tpassd's sweep)."""
        return self.snapshots.expire()

    def wait_discarded(self, timeout_s: float = 30.0) -> bool:
        """True once every image removal started by a kill or an abort has finished."""
        return self.dumps.wait_discarded(timeout_s)


def _setting(name: str) -> property:
    return property(lambda self: getattr(self.settings, name), lambda self, v: setattr(self.settings, name, v),
                    doc=f"NodeSettings.{name}, shared by every part")


# tpassd/daemon.py sets the site limits on the service it registered; tests move its clock and seams.
for _name in ("snapshot_dir", "state_dir", "node", "criu_binary", "job_owner", "proc", "restore_fault",
              "kill_fault", "keep_free_bytes", "snapshot_quota_bytes", "snapshot_max_age_s", "wall"):
    setattr(CheckpointService, _name, _setting(_name))
del _name


__all__ = ["CheckpointService", "JOB_SNAPSHOT_OPS"]
