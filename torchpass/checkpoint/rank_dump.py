"""op=dump (a migration) and op=snap (a rank's part of a whole-job snapshot): CRIU-dump a quiesced
rank, leaving it running, paused, so that a later failure can resume it in place; op=abort of a
move, and the images a finished or called-off move leaves (``discard``).

The tree is dumped only after the wrapper, the tree's root and the rank were pinned as the job's
(Slurm's and the kernel's word, not the rank record's), all in tpassd's own namespaces. criu runs
in tpassd's mount namespace (entering only the wrapper's network and UTS namespaces), executed
from a file descriptor, with a timeout; for an ordinary user's job as the tree root's ids with
``criu.dump_caps()`` only (criu.owner_creds).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from torchpass import layout
from torchpass.checkpoint import criu as criu_mod
from torchpass.checkpoint import gpu_map, procs
from torchpass.checkpoint.admission import Admission, Audit
from torchpass.checkpoint.cuda import CudaCheckpoint
from torchpass.checkpoint.job_files import JobFiles
from torchpass.checkpoint.manifest import checksum_of, read_manifest_bytes
from torchpass.checkpoint.node_settings import NodeSettings
from torchpass.errors import CheckpointError, RemoteError, TorchpassError

log = structlog.get_logger("tpassd.checkpoint")

# check_quota(owner, job_id, snapshot, estimated_bytes, keep, part=rank): RemoteError when a
# snapshot's rank alone would take its owner past the quota (job_snapshots.JobSnapshots.check_quota)
QuotaCheck = Callable[..., None]


class RankDumps:
    def __init__(self, settings: NodeSettings, admission: Admission, files: JobFiles,
                 check_quota: QuotaCheck):
        self.settings = settings
        self.admission = admission
        self.files = files
        self.check_quota = check_quota
        self._discarding: list[threading.Thread] = []  # image removals running after their reply (discard)

    def dump(self, job_id: int, rank: int, generation: int, act: Audit, snapshot: str | None = None,
             keep: int = 1) -> dict[str, Any]:
        """Dump the rank: for a migration (``snapshot`` None: the hand-off marker says moving / moved /
        abort), or into whole-job snapshot ``snapshot`` (no marker: nothing moves)."""
        marker = layout.handoff(self.files.rank_dir(job_id), job_id, rank)  # named in errors either way
        dfd = self.files.open_rank_dir(job_id)
        if dfd is None:
            raise RemoteError("not_found", f"rank {rank} of job {job_id} does not run under rankwrap here "
                                           f"(no {marker.parent}); it cannot be snapshotted")
        try:
            rec = self.files.read_record(dfd, job_id, rank)
            # "pid": the root of the tree to dump (the PID namespace's init that the plugin
            # made, or the rank itself when it is PID 1); "rank_pid": the rank, the init's child.
            pid, wrapper = rec.get("pid"), rec.get("wrapper_pid")
            rank_pid = rec.get("rank_pid", pid)
            act.fields["pid"] = pid
            if rec.get("node") not in (None, self.settings.node):
                raise RemoteError("not_found", f"rank {rank} of job {job_id} (pid {pid}) does not run on "
                                               f"{self.settings.node}")
            # Slurm's and the kernel's word, not the record's: the wrapper is the job's,
            # the tree's root its child, the rank the root's child (or the root itself);
            # all in tpassd's own namespaces.
            view = self.admission.job_view(job_id, act)
            pin = self.admission.pin
            moving = marker if snapshot is None else None
            with pin(job_id, wrapper, dump=True, view=view) as w, \
                    pin(job_id, pid, parent=wrapper, dump=True, view=view) as p:
                if rank_pid == pid:
                    return self._dump_pinned(job_id, rank, generation, moving, dfd, p, w, p, view[1], snapshot, keep)
                with pin(job_id, rank_pid, parent=pid, dump=True, view=view) as r:
                    return self._dump_pinned(job_id, rank, generation, moving, dfd, p, w, r, view[1], snapshot, keep)
        finally:
            os.close(dfd)

    def _dump_pinned(self, job_id: int, rank: int, generation: int, marker: Path | None, dfd: int,
                     p: procs.Pinned, w: procs.Pinned, r: procs.Pinned, owner: int,
                     snapshot: str | None = None, keep: int = 1) -> dict[str, Any]:
        s = self.settings
        pid = r.pid  # the rank: its GPU state, its stdout/stderr
        try:
            c = criu_mod.find_criu(s.criu_binary)
        except TorchpassError as exc:
            raise RemoteError("unavailable", str(exc)) from None
        estimate = s.image_estimate
        if snapshot is None:
            images = layout.images_dir(s.snapshot_dir, job_id, rank, generation)
            criu_mod.make_private_dir(layout.snapshot_job_dir(s.snapshot_dir, job_id))
        else:
            images = layout.snapshot_images_dir(s.snapshot_dir, job_id, snapshot, rank)
            criu_mod.make_private_dir(images.parent)
            # A snapshot must not take the disk below tpassd's own free-space rule (the node would
            # turn degraded and its ranks would be moved away): it needs the image plus that reserve.
            estimate = lambda pid_: s.image_estimate(pid_) + s.keep_free_bytes  # noqa: E731
        who = f"rank {rank}"
        # Handles CRIU cannot dump (the verbs devices NCCL's IB transport keeps open): refused
        # here, before the marker, the CUDA suspend or CRIU touch anything.
        if held := criu_mod.undumpable_handles(p.pid, s.proc):
            raise RemoteError("unavailable", f"rank {rank} of job {job_id} holds handles CRIU cannot checkpoint "
                                             f"({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}): it "
                                             "cannot be moved or snapshotted; see docs/runtime.md, NCCL over "
                                             "InfiniBand")
        if snapshot is not None:
            # The quota is checked again, exactly, at the commit; here, before anything is written, a
            # rank that alone would take its owner past it (its tree's resident memory, the image's
            # usual size) is refused, so that an owner over quota does not fill the shared directory.
            self.check_quota(owner, job_id, snapshot, s.image_estimate(p.pid), keep, part=rank)
        # A full image disk refuses the move before the rank is touched (no marker, no CUDA).
        criu_mod.check_space(who, s.snapshot_dir, estimate(p.pid))
        # Every process of the tree that holds GPU state: the rank itself, or under torchrun the
        # agent's workers (the agent is the task's main process and holds none).
        holders = [q for q in criu_mod.tree_pids(p.pid, s.proc) if s.holds_gpu_state(q)]
        gpu = bool(holders)
        cuda = None
        if gpu:
            try:
                cuda = (s.cuda_loader or CudaCheckpoint.load)()
            except TorchpassError as exc:
                raise RemoteError("unavailable", f"rank {rank} of job {job_id} holds GPU state but this node "
                                                 f"cannot checkpoint CUDA: {exc}") from None
        # The GPUs the image will name, in local order, so that the restore can remap each onto the
        # restore step's (gpu_map); read before anything is touched, so a failure moves nothing.
        try:
            gpu_uuids = self._gpu_uuids(holders) if gpu else self._allocated_gpu_uuids(p.pid)
        except TorchpassError as exc:
            raise RemoteError("unavailable", f"rank {rank} of job {job_id}: {exc}; it cannot be moved") from None
        t0 = time.monotonic()
        if marker is not None:
            self.files.write(dfd, marker, "moving\n")
        suspended: list[int] = []
        try:
            if not (p.alive() and w.alive() and r.alive()):
                raise CheckpointError(f"rank {rank} of job {job_id} (pid {pid}) exited before its dump")
            if cuda is not None:
                # The runtime destroyed its NCCL communicators at the pause; the driver
                # now moves the GPU state into host memory so CRIU dumps it with the rest.
                for q in holders:
                    suspended.append(q)  # before the call: a suspend that failed half way is resumed too
                    cuda.suspend(q)
            entered = procs.foreign_namespaces(w.pid, s.proc, procs.ENTERED_NAMESPACES)
            # An ordinary user's tree is dumped with the user's ids (criu_mod.owner_creds says why).
            creds = criu_mod.owner_creds(p.pid, s.proc) if owner != 0 else None
            res = criu_mod.dump(c, p.pid, images, timeout_s=s.dump_timeout_s, net_of=w.pid if entered else None,
                                fds_of=pid, creds=creds, who=who, space_root=s.snapshot_dir,
                                estimate=estimate,
                                meta={"job": job_id, "rank": rank, "generation": generation, "node": s.node,
                                      "gpu": gpu, "init": p.pid != pid, "uid": owner,
                                      # their pids as the restore gives them back (the task's PID namespace)
                                      **({"gpu_pids": [procs.ns_pid(q, s.proc) for q in holders]} if gpu else {}),
                                      **({"gpu_uuids": gpu_uuids} if gpu_uuids or gpu else {}),
                                      **({"snapshot": snapshot} if snapshot else {})})
        except BaseException as exc:
            # Aborted (criu failed, timed out, the disk filled, the suspend failed half way):
            # the GPU state goes back first, and only then does the marker call the move
            # off, so nothing resumes the rank while CUDA still holds it locked.
            stuck = self._resume_cuda(cuda, job_id, rank, suspended)
            if marker is not None:
                self.files.write(dfd, marker, "abort\n")
            if stuck and isinstance(exc, TorchpassError):
                raise CheckpointError(f"{exc}; and rank {rank}'s CUDA state was not given back ({stuck}): it "
                                      "cannot resume, cancel the job") from None
            raise
        # The source copy stays alive (held) until the move commits: give it its GPU
        # state back, so that a later rollback can resume it in place.
        cuda_error = self._resume_cuda(cuda, job_id, rank, suspended)
        if marker is not None:
            self.files.write(dfd, marker, "moved\n")
        out = {"images": str(res.images), "checksum": checksum_of(read_manifest_bytes(res.images)),
               "bytes": res.bytes, "criu_dump_s": round(res.seconds, 4), "total_s": round(time.monotonic() - t0, 4),
               "pid": p.pid, "wrapper_pid": w.pid, "node": s.node}
        if cuda_error:
            out["cuda_resume_error"] = cuda_error
        log.info("rank dumped (left running)", job_id=job_id, rank=rank, images=out["images"],
                 mb=round(res.bytes / 1e6, 1), dump_s=out["criu_dump_s"])
        return out

    def _gpu_uuids(self, holders: list[int]) -> list[str]:
        """The UUIDs of the GPUs the holders map, in local order (gpu_map); none when they map no
        NVIDIA device file (a stand-in for GPU state: NVML is then not asked)."""
        minors = gpu_map.mapped_gpu_minors(holders, self.settings.proc)
        return gpu_map.uuids_of(minors, self.settings.gpu_uuids_by_minor()) if minors else []

    def _allocated_gpu_uuids(self, pid: int) -> list[str]:
        """The UUIDs of the GPUs the devices cgroup of a rank that holds no GPU state (gloo on a GPU
        allocation) lets it open, in local order, so that its move still pairs them, refuses a
        restore step with fewer, and shows the table. None where the node's GPUs are not known or
        its cgroup cannot be asked (no ConstrainDevices, cgroup v2): the rank moves as a CPU rank."""
        if self.settings.gpu_inventory is None:
            return []
        try:
            inv = self.settings.gpu_inventory()
            if not inv.uuids:
                return []
            return gpu_map.uuids_of(gpu_map.allowed_in_cgroup_of(pid, inv, self.settings.proc), inv.uuids)
        except TorchpassError as exc:
            log.info("a rank without GPU state: its allocated GPUs are not recorded", pid=pid, why=str(exc))
            return []

    @staticmethod
    def _resume_cuda(cuda: Any, job_id: int, rank: int, pids: list[int]) -> str | None:
        """Restore and unlock each process's CUDA state, whatever state a suspend left it in; the
        errors, if any (every process is tried: one that failed does not keep the others locked)."""
        errors = []
        for pid in pids:
            try:
                cuda.resume(pid)
            except CheckpointError as exc:
                log.error("CUDA state of the source copy not resumed", job_id=job_id, rank=rank, pid=pid,
                          error=str(exc))
                errors.append(str(exc))
        return "; ".join(errors) or None

    def abort_move(self, job_id: int, rank: int) -> dict[str, Any]:
        """op=abort: the move is off and the rank resumes here (its marker says so); a later move
        dumps anew, so this node's images of the rank go."""
        self.files.write_handoff(job_id, rank, "abort\n")
        return {"node": self.settings.node, "rank": rank, "marker": "abort", "discarded_mb": self.discard(job_id, rank)}

    def discard(self, job_id: int, rank: int) -> float:
        """Remove this node's snapshots of the rank (MB freed). Without this every
        move left its images (hundreds of MB to GB per rank) in snapshot_dir for good.

        Each images directory is renamed out of the rank's names at once (``.discard-...`` in
        the same job directory: nothing finds it as an image any more, and a later dump of the
        rank makes a directory of its own) and removed by a thread after the reply: the kill
        that asks for it is the last step before every rank resumes, and removing a 2.2 GB image
        took 0.19 s of that standstill. What a tpassd that stops meanwhile leaves is
        inside SNAPSHOT_DIR/jobJ, which the job's sweep removes."""
        snapshot_dir = self.settings.snapshot_dir
        freed = 0
        job_dir = layout.snapshot_job_dir(snapshot_dir, job_id)
        doomed = []
        for d in layout.images_dirs(snapshot_dir, job_id, rank):
            if d.is_dir() and not d.is_symlink():
                freed += sum(f.stat().st_size for f in d.iterdir() if f.is_file() and not f.is_symlink())
                trash = d.with_name(f".discard-{d.name}-{os.urandom(4).hex()}")
                try:
                    os.rename(d, trash)
                    doomed.append(trash)
                except OSError:  # removed here and now, as before
                    shutil.rmtree(d, ignore_errors=True)

        def remove() -> None:
            for trash in doomed:
                shutil.rmtree(trash, ignore_errors=True)
            try:
                job_dir.rmdir()  # only when empty: other ranks of the job may still have images here
            except OSError:
                pass

        if doomed:
            t = threading.Thread(target=remove, name=f"discard-job{job_id}-rank{rank}", daemon=True)
            self._discarding = [x for x in self._discarding if x.is_alive()] + [t]
            t.start()
        else:
            remove()
        if freed:
            log.info("snapshot images discarded", job_id=job_id, rank=rank, mb=round(freed / 1e6, 1))
        return round(freed / 1e6, 1)

    def wait_discarded(self, timeout_s: float = 30.0) -> bool:
        """True once every image removal started by discard has finished."""
        deadline = time.monotonic() + timeout_s
        for t in list(self._discarding):
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._discarding)


__all__ = ["RankDumps"]
