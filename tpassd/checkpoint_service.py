"""tpassd's checkpoint requests: ``tpassd.snapshot`` and ``tpassd.restore``.

The job's coordinator asks the source node's tpassd to CRIU-dump a quiesced
rank (leaving it running, paused, so that a later failure can resume it in
place), to kill that source copy once every restore succeeded, or to mark
the hand-off aborted; and the target node's tpassd to check a snapshot
before the restore step runs, or to kill what a failed move restored.

Who may ask: root, or the uid Slurm records as the job's owner. Every pid
acted on must carry the job's id in its environment (SLURM_JOB_ID or
TORCHPASS_JOB_ID), so a job owner cannot make tpassd dump or kill anything
else.

``rankwrap_main`` is the ``tpass-rankwrap`` console script (the SPANK
plugin's ``rank_wrapper``): rankwrap with the job's shared rank state
directory ($TORCHPASS_STATE_DIR/jobs/$TORCHPASS_JOB_ID/ranks) as default.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from torchpass import auth, wire
from torchpass.errors import CheckpointError, RemoteError, TorchpassError

log = structlog.get_logger("tpassd.checkpoint")


def _job_owner(job_id: int) -> int | None:
    from torchpass import slurm

    info = slurm.client().job(job_id)
    return None if info is None else info.user_id


def environ_of(pid: int, proc: str = "/proc") -> dict[str, str]:
    try:
        raw = Path(f"{proc}/{pid}/environ").read_bytes()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


def pid_in_job(pid: int, job_id: int, rank: int | None = None, proc: str = "/proc") -> bool:
    env = environ_of(pid, proc)
    if str(job_id) not in (env.get("SLURM_JOB_ID"), env.get("TORCHPASS_JOB_ID")):
        return False
    if rank is not None and str(rank) not in (env.get("RANK"), env.get("SLURM_PROCID")):
        return False
    return True


def maps_nvidia_device(pid: int, proc: str = "/proc") -> bool:
    """True if ``pid`` maps an NVIDIA device file (a CUDA context): its GPU state must be checkpointed."""
    try:
        with open(f"{proc}/{pid}/maps") as f:
            return any("/dev/nvidia" in line for line in f)
    except OSError:
        return False


def manifest_checksum(images: str | os.PathLike) -> str:
    return hashlib.sha256((Path(images) / "manifest.json").read_bytes()).hexdigest()


class CheckpointService:
    def __init__(self, snapshot_dir: str | os.PathLike, node: str, *, criu_binary: str | None = None,
                 job_owner: Callable[[int], int | None] = _job_owner, proc: str = "/proc",
                 restore_fault: Callable[[], bool] | None = None, kill_fault: Callable[[], bool] | None = None,
                 gpu_in_use: Callable[[int], bool] | None = None, cuda_loader: Callable[[], Any] | None = None):
        self.snapshot_dir = Path(snapshot_dir)
        # Does the rank hold GPU state (then the driver must move it to host
        # memory before CRIU can dump)? Injectable for tests on GPU-less machines.
        self.gpu_in_use = gpu_in_use or (lambda pid: maps_nvidia_device(pid, self.proc))
        self.cuda_loader = cuda_loader
        self.node = node
        self.criu_binary = criu_binary
        self.job_owner = job_owner
        self.proc = proc
        # The restore-fail fault drill (tpassd/drills.py): True once when armed.
        self.restore_fault = restore_fault or (lambda: False)
        # The kill-fail drill: True once when armed; the next op=kill is refused.
        self.kill_fault = kill_fault or (lambda: False)

    # -- authorization ---------------------------------------------------------
    def authorize(self, ident: auth.Identity, job_id: int) -> None:
        if ident.uid == 0:
            return
        try:
            owner = self.job_owner(job_id)
        except TorchpassError as exc:
            raise RemoteError("unavailable", f"cannot ask Slurm who owns job {job_id} ({exc})") from None
        if owner is None:
            raise RemoteError("not_found", f"job {job_id} is not known to Slurm")
        if owner != ident.uid:
            raise auth.AuthFailure("forbidden", f"uid {ident.uid} does not own job {job_id}")

    @staticmethod
    def _paths(rank_dir: str, job_id: int, rank: int) -> tuple[Path, Path]:
        if not os.path.isabs(rank_dir):
            raise RemoteError("bad_request", f"rank_dir {rank_dir!r} must be an absolute path")
        d = Path(rank_dir) / f"job{job_id}"
        return d / f"rank{rank}.json", d / f"rank{rank}.handoff"

    @staticmethod
    def _put_record(path: Path, rec: dict[str, Any]) -> None:
        tmp = path.with_suffix(f".json.{os.getpid()}.tmp")  # not rankwrap's tmp name
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, path)

    @staticmethod
    def _mark(path: Path, text: str) -> None:
        tmp = path.with_suffix(".handoff.tmp")
        tmp.write_text(text + "\n")
        os.replace(tmp, path)

    # -- tpassd.snapshot -------------------------------------------------------
    def snapshot(self, msg: wire.Message, ident: auth.Identity) -> dict[str, Any]:
        b = msg.body
        job_id, rank, op = b["job_id"], b["rank"], b["op"]
        self.authorize(ident, job_id)
        record, marker = self._paths(b["rank_dir"], job_id, rank)
        if op == "dump":
            return self._dump(job_id, rank, int(b.get("generation") or 0), record, marker)
        if op == "kill":
            pid = b.get("pid")
            if not isinstance(pid, int) or pid <= 1:
                raise RemoteError("bad_request", "op kill needs the source copy's pid")
            if self.kill_fault():
                log.warning("fault drill kill-fail: refusing to kill the source copy", job_id=job_id, rank=rank,
                            pid=pid)
                raise RemoteError("failed", f"fault drill kill-fail on {self.node}: the source copy of rank {rank} "
                                            f"(pid {pid}) was not killed")
            out = self._kill(job_id, rank, pid)
            # Every restore succeeded before the coordinator asks for this kill:
            # the images are not needed any more.
            out["discarded_mb"] = self._discard(job_id, rank)
            return out
        if op == "abort":
            if marker.parent.is_dir():
                self._mark(marker, "abort")
            # The move is off and the rank resumes here: a later move dumps anew.
            return {"node": self.node, "rank": rank, "marker": "abort", "discarded_mb": self._discard(job_id, rank)}
        raise RemoteError("bad_request", f"unknown op {op!r} for tpassd.snapshot; allowed: dump, kill, abort")

    def _discard(self, job_id: int, rank: int) -> float:
        """Remove this node's snapshots of the rank (MB freed). Without this every
        move left its images (hundreds of MB to GB per rank) in snapshot_dir for good."""
        import shutil

        freed = 0
        job_dir = self.snapshot_dir / f"job{job_id}"
        for d in sorted(job_dir.glob(f"rank{rank}.gen*")):
            if d.is_dir() and not d.is_symlink():
                freed += sum(f.stat().st_size for f in d.iterdir() if f.is_file() and not f.is_symlink())
                shutil.rmtree(d, ignore_errors=True)
        try:
            job_dir.rmdir()  # only when empty: other ranks of the job may still have images here
        except OSError:
            pass
        if freed:
            log.info("snapshot images discarded", job_id=job_id, rank=rank, mb=round(freed / 1e6, 1))
        return round(freed / 1e6, 1)

    def _dump(self, job_id: int, rank: int, generation: int, record: Path, marker: Path) -> dict[str, Any]:
        from tpassd.checkpoint import criu as criu_mod

        try:
            rec = json.loads(record.read_text())
        except (OSError, ValueError):
            raise RemoteError("not_found", f"rank {rank} of job {job_id} does not run under rankwrap here "
                                           f"(no {record}); it cannot be snapshotted") from None
        pid, wrapper = int(rec["pid"]), int(rec["wrapper_pid"])
        if rec.get("node") not in (None, self.node) or not pid_in_job(pid, job_id, rank, self.proc):
            raise RemoteError("not_found", f"rank {rank} of job {job_id} (pid {pid}) does not run on {self.node}")
        try:
            c = criu_mod.find_criu(self.criu_binary)
        except TorchpassError as exc:
            raise RemoteError("unavailable", str(exc)) from None
        images = self.snapshot_dir / f"job{job_id}" / f"rank{rank}.gen{generation}"
        criu_mod.make_private_dir(self.snapshot_dir / f"job{job_id}")
        gpu = self.gpu_in_use(pid)
        cuda = None
        if gpu:
            from tpassd.checkpoint.cuda import CudaCheckpoint

            try:
                cuda = (self.cuda_loader or CudaCheckpoint.load)()
            except TorchpassError as exc:
                raise RemoteError("unavailable", f"rank {rank} of job {job_id} holds GPU state but this node "
                                                 f"cannot checkpoint CUDA: {exc}") from None
        t0 = time.monotonic()
        self._mark(marker, "moving")
        suspended = False
        try:
            if cuda is not None:
                # The runtime destroyed its NCCL communicators at the pause; the driver
                # now moves the GPU state into host memory so CRIU dumps it with the rest.
                cuda.suspend(pid)
                suspended = True
            res = criu_mod.dump(c, pid, images, ns_pid=wrapper, extra_args=["--leave-running"],
                                meta={"job": job_id, "rank": rank, "generation": generation, "node": self.node,
                                      "gpu": gpu})
        except CheckpointError:
            self._mark(marker, "abort")
            raise
        finally:
            if suspended:
                # The source copy stays alive (held) until the move commits: give it
                # its GPU state back so a rollback can resume it in place.
                cuda.resume(pid)
        self._mark(marker, "moved")
        out = {"images": str(res.images), "checksum": manifest_checksum(res.images), "bytes": res.bytes,
               "criu_dump_s": round(res.seconds, 4), "total_s": round(time.monotonic() - t0, 4), "pid": pid,
               "wrapper_pid": wrapper, "node": self.node}
        log.info("rank dumped (left running)", job_id=job_id, rank=rank, images=out["images"],
                 mb=round(res.bytes / 1e6, 1), dump_s=out["criu_dump_s"])
        return out

    def _kill(self, job_id: int, rank: int, pid: int) -> dict[str, Any]:
        if not Path(f"{self.proc}/{pid}").exists():
            return {"node": self.node, "rank": rank, "pid": pid, "killed": False}
        if not pid_in_job(pid, job_id, rank, self.proc):
            raise RemoteError("forbidden", f"pid {pid} is not rank {rank} of job {job_id}")
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # it died since the check: what the kill wanted
            return {"node": self.node, "rank": rank, "pid": pid, "killed": False}
        deadline = time.monotonic() + 5.0
        while Path(f"{self.proc}/{pid}").exists() and time.monotonic() < deadline:
            try:  # a zombie awaiting its wrapper counts as gone
                if Path(f"{self.proc}/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                    break
            except OSError:
                break
            time.sleep(0.005)
        log.info("source copy killed", job_id=job_id, rank=rank, pid=pid)
        return {"node": self.node, "rank": rank, "pid": pid, "killed": True}

    def _corrupt_for_drill(self, images: Path, manifest: dict[str, Any]) -> None:
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
        fd = os.open(images / name, os.O_RDWR)
        try:
            off = files[name] // 2
            b = os.pread(fd, 1, off)
            os.pwrite(fd, bytes([b[0] ^ 0xFF]), off)
        finally:
            os.close(fd)
        log.warning("fault drill restore-fail: corrupted a verified snapshot; its restore will fail",
                    images=str(images), file=name, offset=off)

    # -- tpassd.restore ----------------------------------------------------------
    def restore(self, msg: wire.Message, ident: auth.Identity) -> dict[str, Any]:
        b = msg.body
        job_id, rank, op, images = b["job_id"], b["rank"], b["op"], Path(b["images"])
        self.authorize(ident, job_id)
        if op == "verify":
            try:
                manifest = json.loads((images / "manifest.json").read_text())
            except (OSError, ValueError) as exc:
                raise RemoteError("failed", f"{self.node} cannot read snapshot {images} ({exc})") from None
            if b.get("checksum") and manifest_checksum(images) != b["checksum"]:
                raise RemoteError("failed", f"snapshot {images} on {self.node} does not match its checksum")
            missing = [n for n, f in manifest.get("files", {}).items()
                       if not (images / n).is_file() or (images / n).stat().st_size != f.get("size")]
            if missing:
                raise RemoteError("failed", f"snapshot {images} on {self.node}: {missing[0]} missing or incomplete")
            if manifest.get("meta", {}).get("job") != job_id:
                raise RemoteError("forbidden", f"snapshot {images} is not one of job {job_id}")
            if self.restore_fault():
                self._corrupt_for_drill(images, manifest)
            return {"node": self.node, "rank": rank, "files": len(manifest.get("files", {}))}
        if op == "abort":
            record, _ = self._paths(b.get("rank_dir") or "/", job_id, rank)
            try:
                rec = json.loads(record.read_text())
            except (OSError, ValueError):
                return {"node": self.node, "rank": rank, "killed": False}
            if rec.get("restored_from") != str(images) or rec.get("node") != self.node:
                return {"node": self.node, "rank": rank, "killed": False}
            # The rank is the copy this move started from again: put its record back
            # *before* the kill, so that the aborted copy's wrapper, when its rank dies,
            # sees it is no longer the rank and writes no exit code (the rank's first
            # task wrapper would report that 137 to srun), and a later move finds the
            # rank where it runs. No saved record (a wrapper older than "previous"):
            # the record says the copy was aborted, which the wrapper also honours.
            prev = rec.get("previous")
            self._put_record(record, prev if isinstance(prev, dict) and prev.get("wrapper_pid")
                             else {**rec, "aborted": True})
            out = self._kill(job_id, rank, int(rec["pid"]))
            out["record"] = "previous" if isinstance(prev, dict) and prev.get("wrapper_pid") else "aborted"
            log.info("restored copy aborted; rank record back to the copy the move started from",
                     job_id=job_id, rank=rank, images=str(images), record_now=out["record"],
                     node_now=(prev or {}).get("node"))
            return out
        raise RemoteError("bad_request", f"unknown op {op!r} for tpassd.restore; allowed: verify, abort")


def register(control, cfg, node: str, restore_fault: Callable[[], bool] | None = None,
             kill_fault: Callable[[], bool] | None = None) -> CheckpointService:
    """Add tpassd.snapshot / tpassd.restore to tpassd's control server (authorization is per job)."""
    from tpassd.control import USER

    svc = CheckpointService(cfg.snapshot_dir, node, criu_binary=cfg.criu_binary or None,
                            restore_fault=restore_fault, kill_fault=kill_fault)
    control.register("tpassd.snapshot", svc.snapshot, USER)
    control.register("tpassd.restore", svc.restore, USER)
    return svc


def rankwrap_main() -> None:
    """``tpass-rankwrap``: rankwrap with the job's shared rank state directory as default."""
    import sys

    from tpassd.checkpoint import rankwrap

    sd, job = os.environ.get("TORCHPASS_STATE_DIR"), os.environ.get("TORCHPASS_JOB_ID")
    if sd and job and not os.environ.get("TORCHPASS_RANK_STATE_DIR"):
        os.environ["TORCHPASS_RANK_STATE_DIR"] = str(Path(sd) / "jobs" / job / "ranks")
    sys.exit(rankwrap.main())


__all__ = ["CheckpointService", "register", "rankwrap_main", "pid_in_job", "manifest_checksum"]
