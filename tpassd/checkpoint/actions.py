"""What tpassd's snapshot / restore actions call (the daemon's request
handlers stay in tpassd; this module holds the mechanism).

Layout (both roots are parameters, so tests use tmp_path):

* ``state_dir`` (default /run/torchpass/ranks, shared by the node's
  rankwraps and tpassd): ``job<J>/rank<R>.json`` (rankwrap's record: wrapper
  pid, rank pid, pipe inodes), ``rank<R>.handoff`` (moving/moved/abort),
  ``rank<R>.exit`` (exit code of a moved rank). With ``--on-handoff wait``
  it must be on a filesystem the source and target nodes share.
* ``images_root`` (default /var/lib/torchpass/images, 0700, root): one
  directory per snapshot, ``job<J>/rank<R>.gen<G>``, with manifest.json.
  Must be shared with the target node (or copied there) before restore.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from torchpass.errors import CheckpointError, TorchpassError
from tpassd.checkpoint import criu as criu_mod

DEFAULT_IMAGES_ROOT = "/var/lib/torchpass/images"
DEFAULT_STATE_DIR = "/run/torchpass/ranks"


@dataclass
class Checkpointer:
    images_root: str = DEFAULT_IMAGES_ROOT
    state_dir: str = DEFAULT_STATE_DIR
    criu_binary: str | None = None
    cuda_loader: object = None  # () -> CudaCheckpoint; None = the real libcuda

    def check(self) -> criu_mod.Criu:
        """Call at tpassd start (and for `tpassctl nodes`): DependencyError when criu is missing/old."""
        return criu_mod.find_criu(self.criu_binary)

    def _cuda(self):
        from tpassd.checkpoint.cuda import CudaCheckpoint

        return CudaCheckpoint.load(self.cuda_loader) if self.cuda_loader else CudaCheckpoint.load()

    def rank_dir(self, job_id: int) -> Path:
        return Path(self.state_dir) / f"job{job_id}"

    def record(self, job_id: int, rank: int) -> dict:
        p = self.rank_dir(job_id) / f"rank{rank}.json"
        try:
            return json.loads(p.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"rank {rank} of job {job_id} does not run under rankwrap on this node "
                                  f"(no {p}); it cannot be snapshotted") from None
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"rank record {p} is unreadable ({exc})") from None

    def images_dir(self, job_id: int, rank: int, generation: int) -> Path:
        return Path(self.images_root) / f"job{job_id}" / f"rank{rank}.gen{generation}"

    def _mark(self, job_id: int, rank: int, text: str) -> None:
        p = self.rank_dir(job_id) / f"rank{rank}.handoff"
        tmp = p.with_suffix(".handoff.tmp")
        tmp.write_text(text + "\n")
        os.replace(tmp, p)

    def snapshot(self, job_id: int, rank: int, generation: int, *, gpu: bool = False,
                 wait_no_sockets_s: float = 5.0, leave_running: bool = False) -> dict:
        """Dump a quiesced rank; on failure it keeps running and the marker says abort.

        Precondition: the coordinator has seen rank.quiesced with hold=true from this rank.
        By default CRIU kills the rank after the dump (marker "moved"). With
        ``leave_running`` the rank stays alive, held (marker stays "moving"),
        so a later failure can still resume it in place; call ``kill_source``
        before the restored copy may run (or ``abort`` to keep this one).
        """
        c = self.check()
        rec = self.record(job_id, rank)
        pid, wrapper = int(rec["pid"]), int(rec["wrapper_pid"])
        images = self.images_dir(job_id, rank, generation)
        criu_mod.make_private_dir(Path(self.images_root))
        self._mark(job_id, rank, "moving")
        cuda = None
        t0 = time.monotonic()
        try:
            if gpu:
                cuda = self._cuda()
                cuda.suspend(pid)
            res = criu_mod.dump(c, pid, images, ns_pid=wrapper, wait_no_sockets_s=wait_no_sockets_s,
                                leave_running=leave_running,
                                meta={"job": job_id, "rank": rank, "generation": generation, "gpu": gpu,
                                      "node": rec.get("node")})
        except TorchpassError:
            self._mark(job_id, rank, "abort")
            if cuda is not None:
                try:
                    cuda.resume(pid)
                except TorchpassError:
                    pass
            raise
        if not leave_running:
            self._mark(job_id, rank, "moved")
        elif cuda is not None:
            cuda.resume(pid)  # the source copy stays usable for an in-place resume
        return {"images": str(res.images), "bytes": res.bytes, "dump_s": round(res.seconds, 4),
                "total_s": round(time.monotonic() - t0, 4), "pid": pid, "wrapper_pid": wrapper}

    def kill_source(self, job_id: int, rank: int, timeout_s: float = 10.0) -> None:
        """Kill a rank dumped with leave_running (marker "moved" first: its wrapper sees a hand-off)."""
        import signal

        rec = self.record(job_id, rank)
        pid = int(rec["pid"])
        self._mark(job_id, rank, "moved")
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        end = time.monotonic() + timeout_s
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < end:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        return  # dead; its wrapper reaps it
            except OSError:
                return
            time.sleep(0.01)
        if os.path.exists(f"/proc/{pid}"):
            raise CheckpointError(f"rank {rank} of job {job_id} (pid {pid}) did not die within {timeout_s:g} s")

    def abort(self, job_id: int, rank: int, wake_file: str | None = None) -> None:
        """The move is off: mark abort and wake the held rank in place (it resumes on this node)."""
        self._mark(job_id, rank, "abort")
        if wake_file:
            Path(wake_file).parent.mkdir(parents=True, exist_ok=True)
            Path(wake_file).touch()

    def restore_argv(self, job_id: int, rank: int, generation: int, *, wake_file: str,
                     gpu: bool = False, python: str = sys.executable) -> list[str]:
        """The command the restore step runs on the target (e.g. srun --jobid=J --overlap -w SPARE ...)."""
        argv = [python, "-m", "tpassd.checkpoint.rankwrap", "--restore",
                str(self.images_dir(job_id, rank, generation)), "--wake-file", wake_file,
                "--state-dir", self.state_dir]
        if self.criu_binary:
            argv += ["--criu", self.criu_binary]
        if gpu:
            argv.append("--gpu")
        return argv
