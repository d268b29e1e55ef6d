"""The coordinator's supervisor: the one process the SPANK plugin starts, in the coordinator's place.

It runs as the job user (the plugin drops root before it execs ``tpass-coordinator``, and nothing
here asks for any privilege back). It reads the job secret once, starts the coordinator as its
child (``tpass-coordinator --supervised``: a fresh pipe for the secret, another for the ready
line), passes the first ready line on to the plugin, and when the child dies asks
``restart.decide_restart`` what to do:

* RESTART: the orphans the dead coordinator left (restore steps' ``srun`` waiting at a gate; the
  supervisor is their subreaper) get SIGTERM, then SIGKILL 5 s later; a new coordinator starts on
  the same address and port (the ranks' TORCHPASS_COORDINATOR stays right; libzmq binds with
  SO_REUSEADDR), told ``--restart N``: it records ``coordinator.restarted``, rebuilds its view from
  the ranks' new registrations and the saved events, and settles the pause it may find in
  ``in_flight.json`` (recovery.py).
* GIVE_UP: one event ``coordinator.gave_up`` and one log line; the ranks go on unprotected.
* DONE: the supervisor exits with the child's status.

SIGTERM or SIGINT (the batch step ends: the plugin signals the process group) is passed to the
child, and the supervisor exits once it has.

Out of scope: the batch host's own crash takes the supervisor with it (Slurm ends or requeues the
job; docs/coordinator.md, "The coordinator comes back").
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from torchpass import layout, logs
from torchpass.coordinator.executor_ports import write_atomically
from torchpass.coordinator.job_record import JobState, encode_events
from torchpass.coordinator.restart import ChildExit, SupervisorAction, decide_restart

PR_SET_CHILD_SUBREAPER = 36
ORPHAN_GRACE_S = 5.0

log = logs.get_logger("torchpass.coordinator.supervisor")


def _subreaper() -> None:
    """Orphans of a dead coordinator become this process's children, so they can be stopped."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            log.warning("cannot become a subreaper: a dead coordinator's restore steps are left to Slurm",
                        errno=ctypes.get_errno())
    except OSError as exc:
        log.warning("cannot become a subreaper", error=str(exc))


def _children() -> set[int]:
    pids: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            pids.update(int(p) for p in (task / "children").read_text().split())
        except (OSError, ValueError):
            pass
    return pids


def _reap_orphans() -> list[int]:
    """SIGTERM every child left (a dead coordinator's), SIGKILL what outlives ORPHAN_GRACE_S."""
    orphans = _children()
    for pid in orphans:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    end = time.monotonic() + ORPHAN_GRACE_S
    left = set(orphans)
    while left and time.monotonic() < end:
        for pid in list(left):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                left.discard(pid)
        time.sleep(0.05)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    return sorted(orphans)


def _record(state_dir: Path, job_id: int, kind: str, message: str, **data) -> None:
    """Append one event to the job's saved log (its coordinator is dead: no other writer)."""
    import json

    path = layout.events_json(state_dir, job_id)
    job = JobState(job_id=job_id)
    try:
        job.carry_on(json.loads(path.read_text()))
    except (OSError, ValueError):
        pass
    job.record(time.time(), kind, message, **data)
    try:
        write_atomically(path, encode_events(job.events))
    except OSError as exc:
        log.error("cannot save the event", kind=kind, error=str(exc))


class Supervisor:
    def __init__(self, child_args: list[str], *, job_id: int, state_dir: Path, limit: int,
                 ready_fd: int | None, secret: bytes | None, program: list[str] | None = None):
        self.child_args = child_args
        # the coordinator's command line, before its arguments (a stand-in in tests)
        self.program = program or [sys.executable, "-m", "torchpass.coordinator.main"]
        self.job_id = job_id
        self.state_dir = Path(state_dir)
        self.limit = limit
        self.ready_fd = ready_fd
        self.secret = secret
        self.child: subprocess.Popen | None = None
        self.stopping = False

    def _stop(self, signum, _frame) -> None:
        self.stopping = True
        if self.child is not None and self.child.poll() is None:
            try:
                self.child.send_signal(signum)
            except ProcessLookupError:
                pass

    def _spawn(self, extra: list[str]) -> tuple[subprocess.Popen, str]:
        """Start one coordinator; (its process, its ready line or "" when it ended first)."""
        ready_r, ready_w = os.pipe()
        fds = [ready_w]
        args = [*self.program, "--supervised", *self.child_args, *extra,
                "--ready-fd", str(ready_w)]
        secret_r = -1
        if self.secret is not None:
            secret_r, secret_w = os.pipe()
            os.write(secret_w, self.secret)  # 64 bytes: far below a pipe's buffer
            os.close(secret_w)
            fds.append(secret_r)
            args += ["--secret-fd", str(secret_r)]
        try:
            child = subprocess.Popen(args, pass_fds=fds, stdin=subprocess.DEVNULL)
        finally:
            os.close(ready_w)
            if secret_r >= 0:
                os.close(secret_r)
        self.child = child
        line = b""
        with os.fdopen(ready_r, "rb", buffering=0) as f:
            while not line.endswith(b"\n"):
                b = f.read(1)
                if not b:
                    break
                line += b
        return child, line.decode(errors="replace").strip()

    def _tell_plugin(self, line: str) -> None:
        if self.ready_fd is None:
            return
        try:
            if line:
                os.write(self.ready_fd, (line + "\n").encode())
            os.close(self.ready_fd)
        except OSError as exc:
            log.warning("could not write the ready line", fd=self.ready_fd, error=str(exc))
        self.ready_fd = None

    def run(self) -> int:
        _subreaper()
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        restarts, extra, reason = 0, [], ""
        while True:
            child, line = self._spawn(extra + (["--restart", str(restarts), "--restart-reason", reason]
                                               if restarts else []))
            ready = line.startswith("tcp://")
            self._tell_plugin(line)  # the first start's line (or error, or nothing); later ones stay here
            status = child.wait()
            self.child = None
            ended = ChildExit(None, -status, ready) if status < 0 else ChildExit(status, None, ready)
            orphans = _reap_orphans()
            d = decide_restart(ended, restarts, self.limit, self.stopping)
            if ready:  # a start that failed: the child's own last line stays the log's (the plugin shows it)
                log.info("coordinator ended", job_id=self.job_id, pid=child.pid, how=ended.text(),
                         action=d.action.value, reason=d.reason, orphans_stopped=orphans)
            if d.action is SupervisorAction.DONE:
                return 0 if ended.code is None else ended.code
            if d.action is SupervisorAction.GIVE_UP:
                log.error("coordinator not restarted: the job is unprotected", job_id=self.job_id, reason=d.reason)
                _record(self.state_dir, self.job_id, "coordinator.gave_up", d.reason, pid=child.pid,
                        restarts=restarts, limit=self.limit)
                return 0
            if ready and not extra:  # every restart listens where the ranks already look
                addr, _, port = line[len("tcp://"):].rpartition(":")
                extra = ["--bind-address", addr, "--port", port]
            time.sleep(d.delay_s)
            if self.stopping:
                return 0
            restarts += 1
            reason = f"pid {child.pid} {ended.text()}"


__all__ = ["Supervisor"]
