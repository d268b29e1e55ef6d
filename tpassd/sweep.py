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

Each job is swept on its own: one whose removal fails is logged and the
others go on. ``STATE_DIR/jobs/J`` of a job Slurm no longer lists is removed
``job_dir_retention_h`` after its last change (unless it holds the job's
snapshot manifests).

Removal never follows a link a user planted. ``STATE_DIR/jobs/J`` and its
``hold`` belong to the job user: each directory is opened below root's
trusted STATE_DIR with ``O_NOFOLLOW`` (torchpass.checkpoint.safeio), and the
tree is removed with ``openat``/``unlinkat`` on directory fds (O_NOFOLLOW),
iteratively with a bounded stack of fds (``_rmtree_at``, MAX_DEPTH), so a
symlink anywhere in it is unlinked, never followed, and no depth makes it
recurse. A directory that is a symlink is unlinked, its target left alone.

``tpassd --sweep-job J`` (a node ``Epilog=`` helper, contrib/epilog.d) does
the same for one job Slurm reports ended, right when it ends.
"""

from __future__ import annotations

import errno
import os
import re
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
    failed: list[int] = field(default_factory=list)  # jobs whose sweep raised (logged; the rest went on)

    def as_dict(self) -> dict:
        return {"removed": self.removed, "aborted": self.aborted, "kept_busy": self.kept_busy,
                "skipped": self.skipped, "failed": self.failed}


# How deep the removal walks with open directory fds; a directory below that is moved up to the
# tree's parent and removed from there, so any depth (a user's 1,500-deep hold made shutil.rmtree,
# which recurses, raise RecursionError) costs at most this many fds and no recursion.
MAX_DEPTH = 32
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _rmtree_at(dfd: int, name: str, where: Path, max_depth: int = MAX_DEPTH) -> bool:
    """Remove ``name`` below the directory fd ``dfd`` without following any link in it; True if
    something was removed. A symlink (or a file) at ``name`` is unlinked, never followed.
    Iterative: no recursion, at most ``max_depth`` fds open (see MAX_DEPTH)."""
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
    todo = [name]
    moved = 0
    while todo:
        top = todo.pop()
        moved += _rm_dir(dfd, top, todo, max_depth)
    if moved:
        log.warning("tree deeper than the sweep walks at once: removed in parts", path=str(where),
                    max_depth=max_depth, parts=moved + 1)
    return True


def _unlink_entry(fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=fd)
    except FileNotFoundError:
        pass
    except IsADirectoryError:  # became a directory since: the next scan finds it
        pass


def _rm_dir(dfd: int, name: str, todo: list[str], max_depth: int) -> int:
    """Remove the directory ``name`` in ``dfd`` depth-first with a stack of fds; a directory at
    ``max_depth`` is renamed into ``dfd`` and appended to ``todo``. The number so moved."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dfd)
    except FileNotFoundError:
        return 0
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # swapped for a link or a file: unlinked
            _unlink_entry(dfd, name)
            return 0
        raise
    stack = [(dfd, name, fd)]
    moved = 0
    try:
        while stack:
            pfd, nm, fd = stack[-1]
            child = None
            with os.scandir(fd) as it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        child = e.name
                        break
                    _unlink_entry(fd, e.name)
            if child is None:
                try:
                    os.rmdir(nm, dir_fd=pfd)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    if exc.errno != errno.ENOTEMPTY:
                        raise
                    continue  # something appeared since the scan: scan again
                stack.pop()
                os.close(fd)
                continue
            if len(stack) >= max_depth:
                up = f".tpassd-sweep-{os.getpid()}-{time.monotonic_ns()}"
                os.rename(child, up, src_dir_fd=fd, dst_dir_fd=dfd)
                todo.append(up)
                moved += 1
                continue
            try:
                cfd = os.open(child, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                continue
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    _unlink_entry(fd, child)
                    continue
                raise
            stack.append((fd, child, cfd))
    finally:
        for _pfd, _nm, fd in stack:
            os.close(fd)
    return moved


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
                 busy_jobs: Callable[[], set[int]] = set, busy_wait_s: float = 10.0,
                 job_dir_retention_s: float = 0.0, wall: Callable[[], float] = time.time):
        self.snapshot_dir = Path(snapshot_dir)
        # STATE_DIR/jobs/J of a job Slurm no longer lists goes this long after its last change
        # (tpassd.toml job_dir_retention_h); 0: kept. One with snapshot manifests is kept.
        self.job_dir_retention_s = job_dir_retention_s
        self._wall = wall
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
        if not cands and self.job_dir_retention_s <= 0:
            return res
        try:
            alive = self.active_jobs()
        except TorchpassError as exc:
            res.skipped = f"cannot ask Slurm which jobs still exist ({exc}); nothing removed"
            log.warning("sweep skipped", reason=res.skipped)
            return res
        for job in sorted(cands - alive):
            try:
                self.sweep_job(job, res)
            except Exception as exc:
                res.failed.append(job)
                log.exception("sweep of one ended job failed; the others go on", job_id=job, error=str(exc))
        self.expire_job_dirs(alive, res)
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

    def expire_job_dirs(self, alive: set[int], res: SweepResult) -> None:
        """Remove STATE_DIR/jobs/J of the jobs Slurm no longer lists (``alive`` is its list) whose
        directory has not changed for job_dir_retention_s, except one that holds the job's snapshot
        manifests (a relaunch needs them; tpassctl snapshots --delete removes them). Per job: one
        that fails is logged and the others go on."""
        if self.job_dir_retention_s <= 0:
            return
        dfd = _open(self.state_dir, (layout.JOBS,))
        if dfd is None:
            return
        try:
            jobs = _job_ids(dfd, _JOB)
            cutoff = self._wall() - self.job_dir_retention_s
            for job in sorted(jobs - alive - set(self._busy_jobs())):
                name = str(job)
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    if st.st_mtime > cutoff:
                        continue
                    if os.path.lexists(layout.snapshot_manifests_dir(self.state_dir, job)):
                        continue
                    if _rmtree_at(dfd, name, layout.job_dir(self.state_dir, job)):
                        res.removed.append(str(layout.job_dir(self.state_dir, job)))
                        log.info("ended job's state directory removed after its retention",
                                 job_id=job, retention_h=round(self.job_dir_retention_s / 3600, 2))
                except Exception as exc:  # noqa: BLE001 - one job's tree must not stop the others'
                    res.failed.append(job)
                    log.warning("could not remove an ended job's state directory", job_id=job, error=str(exc))
        finally:
            os.close(dfd)

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
