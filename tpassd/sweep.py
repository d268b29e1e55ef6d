"""Remove what a migration leaves of a job that has ended, whatever way it ended.

A move that commits or is called off cleans up after itself
(torchpass.checkpoint.service). A job that ends during a move (scancel, its
time limit, a coordinator lost) does not: its CRIU images in
``SNAPSHOT_DIR/jobJ`` (hundreds of MB to GB per rank) and the hold files in
``STATE_DIR/jobs/J/hold`` stay. Every tpassd therefore sweeps, at start and
every ``sweep_interval_s``:

1. It lists the candidates: ``SNAPSHOT_DIR/jobJ`` (its own node's images)
   and ``STATE_DIR/jobs/J/hold`` (the shared state directory: every tpassd
   sweeps it, the first one wins).
2. Then it asks Slurm (``squeue --json`` through torchpass.slurm) which jobs
   still exist. Listing first means a job too new to be listed has no files
   yet. No answer from Slurm: nothing is removed.
3. For each job Slurm no longer lists as active, a dump still running on
   this tpassd is aborted (its criu killed); the job's files go once no op
   of this tpassd works on the job any more.

Removal never follows a link a user planted. ``STATE_DIR/jobs/J`` and its
``hold`` belong to the job user: each directory is opened below root's
trusted STATE_DIR with ``O_NOFOLLOW`` (torchpass.checkpoint.safeio), and the
tree is removed with ``shutil.rmtree(name, dir_fd=...)``, which works with
``openat``/``unlinkat`` on directory fds, so a symlink anywhere in it is
unlinked, never followed. A directory that is a symlink is unlinked, its
target left alone.

``tpassd --sweep-job J`` (a node ``Epilog=`` helper, contrib/epilog.d) does
the same for one job Slurm reports ended, right when it ends.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import structlog

from torchpass import layout
from torchpass.checkpoint import safeio
from torchpass.errors import TorchpassError
from torchpass.slurm import SlurmClient

log = structlog.get_logger("tpassd.sweep")

_SNAPSHOT_JOB = re.compile(r"job([0-9]{1,12})")  # layout.snapshot_job_dir's name
_JOB = re.compile(r"[0-9]{1,12}")  # layout.job_dir's name


@dataclass
class SweepResult:
    removed: list[str] = field(default_factory=list)  # paths removed
    aborted: list[int] = field(default_factory=list)  # pids of criu dumps killed
    kept_busy: list[int] = field(default_factory=list)  # ended jobs whose op still runs here
    skipped: str = ""  # why nothing was swept ("" = it ran)

    def as_dict(self) -> dict:
        return {"removed": self.removed, "aborted": self.aborted, "kept_busy": self.kept_busy,
                "skipped": self.skipped}


def _rmtree_at(dfd: int, name: str, where: Path) -> bool:
    """Remove ``name`` below the directory fd ``dfd`` without following any link in it; True if
    something was removed. A symlink (or a file) at ``name`` is unlinked, never followed."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        try:
            os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            return False
        log.warning("not a directory: unlinked, not followed", path=str(where))
        return True

    def gone_already(_fn, _path, exc_info) -> None:  # another tpassd swept the shared dir first
        if not (isinstance(exc_info[1], OSError) and exc_info[1].errno == errno.ENOENT):
            raise exc_info[1]

    shutil.rmtree(name, dir_fd=dfd, onerror=gone_already)  # the fd-based, symlink-safe walk
    return True


def _job_ids(dfd: int, pattern: re.Pattern[str]) -> set[int]:
    with os.scandir(dfd) as it:
        return {int(m.group(1) if m.groups() else m.group(0)) for e in it if (m := pattern.fullmatch(e.name))}


def _open(base: Path, parts: Iterable[str]) -> int | None:
    try:
        return safeio.open_dir(base, parts)
    except FileNotFoundError:
        return None
    except OSError as exc:  # a symlink or a non-directory where a directory should be
        log.warning("refused to sweep below a link or non-directory", path=str(Path(base, *parts)), error=str(exc))
        return None


def dump_processes(snapshot_dir: Path, job_id: int, parent: int | None = None) -> list[psutil.Process]:
    """criu dumps writing into ``SNAPSHOT_DIR/jobJ``: descendants of ``parent`` (default: this
    process, which runs them) whose argv says ``-D SNAPSHOT_DIR/jobJ/...``."""
    prefix = f"{layout.snapshot_job_dir(snapshot_dir, job_id)}/"
    found = []
    try:
        kids = psutil.Process(parent or os.getpid()).children(recursive=True)
    except psutil.Error:
        return []
    for p in kids:
        try:
            argv = p.cmdline()
        except psutil.Error:
            continue
        if "dump" in argv and any(a == "-D" and b.startswith(prefix) for a, b in zip(argv, argv[1:])):
            found.append(p)
    return found


class Sweeper:
    def __init__(self, snapshot_dir: Path, state_dir: Path, slurm: Callable[[], SlurmClient], *,
                 busy_jobs: Callable[[], set[int]] = set, busy_wait_s: float = 10.0):
        self.snapshot_dir = Path(snapshot_dir)
        self.state_dir = Path(state_dir)
        self._slurm = slurm
        self._busy_jobs = busy_jobs
        self.busy_wait_s = busy_wait_s

    def candidates(self) -> set[int]:
        """Jobs with images on this node or hold files in the shared state directory."""
        found: set[int] = set()
        for base, parts, pattern in ((self.snapshot_dir, (), _SNAPSHOT_JOB),
                                     (self.state_dir, (layout.JOBS,), _JOB)):
            dfd = _open(base, parts)
            if dfd is None:
                continue
            try:
                jobs = _job_ids(dfd, pattern)
            finally:
                os.close(dfd)
            if pattern is _JOB:  # only the jobs that have a hold directory (or something there)
                jobs = {j for j in jobs if os.path.lexists(layout.job_dir(self.state_dir, j) / layout.HOLD)}
            found |= jobs
        return found

    def active_jobs(self) -> set[int]:
        """Every job Slurm still lists as active (SlurmError / DependencyError when it cannot say)."""
        return {j.job_id for j in self._slurm().jobs(states=()) if j.active}

    def sweep(self) -> SweepResult:
        """One sweep of every ended job's files (see the module docstring)."""
        res = SweepResult()
        cands = self.candidates()
        if not cands:
            return res
        try:
            alive = self.active_jobs()
        except TorchpassError as exc:
            res.skipped = f"cannot ask Slurm which jobs still exist ({exc}); nothing removed"
            log.warning("sweep skipped", reason=res.skipped)
            return res
        for job in sorted(cands - alive):
            self.sweep_job(job, res)
        return res

    def sweep_job(self, job: int, res: SweepResult | None = None) -> SweepResult:
        """Remove job ``job``'s images here and its hold files; the caller checked that it ended."""
        res = res or SweepResult()
        if job in self._busy_jobs():
            for p in dump_processes(self.snapshot_dir, job):
                try:
                    p.send_signal(signal.SIGKILL)
                    res.aborted.append(p.pid)
                except psutil.Error:
                    pass
            if res.aborted:
                log.warning("dump of an ended job aborted", job_id=job, pids=res.aborted)
            end = time.monotonic() + self.busy_wait_s
            while job in self._busy_jobs() and time.monotonic() < end:
                time.sleep(0.05)
            if job in self._busy_jobs():
                res.kept_busy.append(job)
                log.warning("ended job's files kept: an op of this tpassd still works on it", job_id=job)
                return res
        self._remove(self.snapshot_dir, (), layout.snapshot_job_dir(self.snapshot_dir, job).name, res)
        self._remove(self.state_dir, (layout.JOBS, str(job)), layout.HOLD, res)
        return res

    def _remove(self, base: Path, parts: tuple[str, ...], name: str, res: SweepResult) -> None:
        dfd = _open(base, parts)
        if dfd is None:
            return
        where = Path(base, *parts, name)
        try:
            if _rmtree_at(dfd, name, where):
                res.removed.append(str(where))
                log.info("ended job's migration files removed", path=str(where))
        except OSError as exc:
            log.warning("could not remove an ended job's files", path=str(where), error=str(exc))
        finally:
            os.close(dfd)


__all__ = ["Sweeper", "SweepResult", "dump_processes"]
