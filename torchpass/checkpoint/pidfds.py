"""Process file descriptors for root: acting on a process, never on a pid number alone.

A pid number names whichever process holds it now: the one root checked may
have exited and its number gone to another by the time root acts. A pidfd
names one process for as long as it is held. So root

* takes another process's fds with ``pidfd_getfd(2)`` (``getfd``): the open
  file the process holds at that instant, which root then checks with fstat
  and F_GETFL on its own copy. Reopening ``/proc/PID/fd/N`` instead opens
  whatever N names at the second look, by path, with root's rights;
* reads ``/proc/PID/...`` only while it holds a pidfd of PID, and checks the
  pidfd is still live after the read (``alive``): a process that still exists
  (a zombie included) keeps its number, so what was read was that process's;
* signals only through a pidfd (``signal.pidfd_send_signal``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import select
import signal
import time

# pidfd_getfd(2) (Linux 5.6): 438 in the generic syscall table that these architectures share.
# Python 3.11 has no os.pidfd_getfd.
_SYS_PIDFD_GETFD = {"x86_64": 438, "aarch64": 438, "arm64": 438, "riscv64": 438, "ppc64le": 438, "s390x": 438}
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def getfd(pidfd: int, fd: int) -> int:
    """Our own (close-on-exec) duplicate of the open file that fd ``fd`` of the process ``pidfd``
    names now. Needs ptrace rights over it (root's CAP_SYS_PTRACE). OSError otherwise."""
    nr = _SYS_PIDFD_GETFD.get(platform.machine())
    if nr is None:
        raise OSError(errno.ENOSYS, f"pidfd_getfd: no syscall number known for {platform.machine()}")
    got = _libc.syscall(ctypes.c_long(nr), ctypes.c_int(pidfd), ctypes.c_int(fd), ctypes.c_uint(0))
    if got < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return int(got)


def alive(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` still exists (a zombie does: its number is still its own)."""
    try:
        signal.pidfd_send_signal(pidfd, 0)
        return True
    except ProcessLookupError:
        return False


def ppid_of(pid: int, proc: str = "/proc") -> int | None:
    """The parent of ``pid`` from ``/proc/PID/stat`` (after the last ')': a command name may hold
    one); None when it cannot be read. Only meaningful while a pidfd of ``pid`` is held and live."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            return int(f.read(4096).rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def child_pidfd(pid: int, parent: int, parent_pidfd: int, proc: str = "/proc") -> int:
    """A pidfd of ``pid`` if it is a child of ``parent`` (``parent_pidfd`` held by the caller);
    OSError (one line) otherwise. The parent is checked before and after the pidfd is opened: the
    first check may read a process that exits before pidfd_open, and its number may go to another;
    the second reads the process the pidfd holds, and both pidfds are then checked live, so neither
    number changed hands in between. Never our own pid (the restore agent is the task's child too)."""
    if not isinstance(pid, int) or pid <= 1 or pid == os.getpid():
        raise OSError(errno.EPERM, f"pid {pid} is not a process root may act on")
    if ppid_of(pid, proc) != parent:
        raise OSError(errno.EPERM, f"pid {pid} is not a child of pid {parent}; refused")
    fd = os.pidfd_open(pid)
    try:
        if ppid_of(pid, proc) != parent or not alive(fd) or not alive(parent_pidfd):
            raise OSError(errno.EPERM, f"pid {pid} is not a child of pid {parent}; refused")
    except BaseException:
        os.close(fd)
        raise
    return fd


def kill_and_wait(pidfd: int, timeout_s: float = 5.0) -> None:
    """SIGKILL the process of ``pidfd``; reap it if it is our child, else wait until it has exited
    (its reaper collects it) or ``timeout_s`` passed."""
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        return
    try:
        os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
        return
    except ChildProcessError:
        pass  # not ours: the restore task (the subreaper) reaps it
    deadline = time.monotonic() + timeout_s
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)  # readable once the process has exited
    while (left := deadline - time.monotonic()) > 0:
        if poller.poll(max(1, int(left * 1000))):
            return
