"""Run a program (criu) with a watchdog for a stopped process.

An ordinary user's dump runs criu under the user's uid, so the user may
SIGSTOP it (or ptrace-stop it). ``subprocess.run`` would then wait for the
whole timeout (600 s for a dump) with one of tpassd's workers held. ``run``
polls the child's state in /proc/PID/stat every ``POLL_S``; a child in a
stopped state (``T`` or ``t``) for ``STOPPED_GRACE_S`` is killed, and the
run fails with CheckpointError (one line). criu itself is never stopped in
normal operation: it stops the tasks it dumps, which are not its children
(and not this pid), so a stop of this pid is never CRIU's own doing.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence

from torchpass.errors import CheckpointError

POLL_S = 0.2
STOPPED_GRACE_S = 2.0  # a SIGSTOP then SIGCONT within this is let be (a debugger's brief stop)
STOPPED_STATES = ("T", "t")


def proc_state(pid: int, proc: str = "/proc") -> str | None:
    """The one-letter state of ``pid`` (/proc/PID/stat's third field), None when it is gone."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            raw = f.read(4096)
    except OSError:
        return None
    end = raw.rfind(b")")  # the comm field may hold spaces and parentheses
    return raw[end + 2:end + 3].decode() if end > 0 else None


def run(argv: Sequence[str], *, timeout_s: float, pass_fds: Sequence[int] = (), what: str = "criu",
        then: str = "", stopped_grace_s: float = STOPPED_GRACE_S, poll_s: float = POLL_S
        ) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output, text, stdin=DEVNULL, timeout, pass_fds)``, except that a
    child stopped for ``stopped_grace_s`` is killed: CheckpointError. Over ``timeout_s``: killed,
    subprocess.TimeoutExpired (as subprocess.run)."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                         text=True, pass_fds=tuple(pass_fds))
    deadline = time.monotonic() + timeout_s
    stopped_since: float | None = None
    with p:
        while True:
            try:
                out, err = p.communicate(timeout=poll_s)
                return subprocess.CompletedProcess(p.args, p.returncode, out, err)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if now >= deadline:
                p.kill()
                p.communicate()
                raise subprocess.TimeoutExpired(p.args, timeout_s)
            if proc_state(p.pid) in STOPPED_STATES:
                stopped_since = stopped_since if stopped_since is not None else now
                if now - stopped_since >= stopped_grace_s:
                    p.kill()  # SIGKILL ends a stopped process too
                    p.communicate()
                    raise CheckpointError(f"{what} was stopped (by a signal or a tracer) for "
                                          f"{now - stopped_since:.1f} s and was killed{'; ' + then if then else ''}")
            else:
                stopped_since = None


__all__ = ["proc_state", "run"]
