"""Which processes tpassd may act on: found from Slurm and the kernel, never from a user's file.

A rank record (written by the job user's rank wrapper) may *name* a pid;
tpassd acts on it only if

* Slurm lists it as one of the job's processes on this node
  (``scontrol listpids JOB``: slurmstepd's task list with proctrack's
  descendants; the step cgroup's ``cgroup.procs`` under proctrack/cgroup);
* its real, effective, saved and filesystem uids (``/proc/PID/status``)
  are the job's owner as slurmctld records it;
* for a rank: its parent (``/proc/PID/stat``) is the wrapper the record
  names, which passes the same checks;
* for a dump: it and its wrapper share tpassd's own mount and user
  namespaces (a rank in namespaces of its own, e.g. made with
  ``unshare -Urm``, is refused: criu would have to run in them, where the
  user decides what ``criu`` and its libraries are). Network and UTS
  namespaces a user cannot make without a user namespace; criu enters the
  wrapper's (``nsenter --net --uts``, never ``--mount``: the devcluster's
  nodes have their own);

and it is pinned by a pidfd opened *before* those checks: ``alive()`` after
them proves the pid still names the process that was checked (a pid is not
reused while its process, zombie included, exists), and ``kill`` signals
through the pidfd.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

from torchpass.errors import RemoteError

SCONTROL_TIMEOUT_S = 10.0
SHARED_NAMESPACES = ("mnt", "user")  # a rank criu dumps must share these with tpassd
ENTERED_NAMESPACES = ("net", "uts")  # criu enters the wrapper's when they are not tpassd's


def slurm_job_pids(job_id: int, *, run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
                   timeout_s: float = SCONTROL_TIMEOUT_S) -> set[int]:
    """The pids Slurm tracks for ``job_id`` on this node (``scontrol listpids``); empty when none."""
    argv = ["scontrol", "listpids", str(int(job_id))]
    try:
        proc = run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RemoteError("unavailable", f"'{' '.join(argv)}' did not answer in {timeout_s:g} s; "
                                         "is this node's slurmd up?") from None
    except OSError as exc:
        raise RemoteError("unavailable", f"cannot run scontrol ({exc}); install the Slurm client") from None
    if proc.returncode != 0:
        return set()  # "Job J does not exist on this node" and the like: nothing of the job is here
    pids = set()
    for line in proc.stdout.splitlines():
        first = line.split(maxsplit=1)[0] if line.strip() else ""
        if first.isdigit():
            pids.add(int(first))
    return pids


@dataclass(frozen=True)
class Stat:
    ppid: int
    state: str
    start: int  # clock ticks after boot: with the pid, names one process for good
    flags: int  # the task's PF_* flags (PF_EXITING: in do_exit)


def read_stat(pid: int, proc: str = "/proc") -> Stat:
    return _read_stat_file(f"{proc}/{pid}/stat")


def _read_stat_file(path: str) -> Stat:
    """A process's or a thread's (/proc/P/task/T/stat) stat file."""
    with open(path, "rb") as f:
        raw = f.read(4096).decode(errors="replace")
    fields = raw.rsplit(")", 1)[1].split()  # after "(comm)", which may hold spaces and parentheses
    return Stat(ppid=int(fields[1]), state=fields[0], start=int(fields[19]), flags=int(fields[6]))


PF_EXITING = 0x4  # a task's flag (stat field 9) from the moment it is in do_exit (include/linux/sched.h)
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def _thread_dying(task: str) -> bool:
    """The thread at ``task`` (/proc/P/task/T) runs no more user code: gone, exiting, or SIGKILL pending."""
    try:
        st = _read_stat_file(f"{task}/stat")
        if st.state in ("Z", "X", "x") or st.flags & PF_EXITING:
            return True
        with open(f"{task}/status", "rb") as f:
            for line in f.read(1 << 16).decode(errors="replace").splitlines():
                if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & _SIGKILL_BIT:
                    return True
    except (FileNotFoundError, ProcessLookupError):
        return True
    except (OSError, ValueError, IndexError):  # unreadable or malformed: not taken for dying
        return False
    return False


def dying(pid: int, start: int | None = None, proc: str = "/proc") -> bool:
    """True once process ``pid`` (the one that started at ``start``, when given) can run no more of its
    own code: gone, replaced by a later process of the same pid, or every thread of it exiting or with
    SIGKILL pending. A SIGKILL reaches every thread of a process at once, and a thread that has it
    never returns to user space; the freeing of its memory that follows can take a while (0.1 s for a
    2.2 GB rank here, seconds for a GPU node's), and nothing waits for it. An unreadable /proc entry
    (other than a vanished one) is not taken for dying."""
    try:
        if start is not None and read_stat(pid, proc).start != start:
            return True
        tids = os.listdir(f"{proc}/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return True
    except (OSError, ValueError, IndexError):
        return False
    return all(_thread_dying(f"{proc}/{pid}/task/{tid}") for tid in tids)


def read_uids(pid: int, proc: str = "/proc") -> tuple[int, ...]:
    """Real, effective, saved and filesystem uid of ``pid``."""
    with open(f"{proc}/{pid}/status", "rb") as f:
        for line in f.read(1 << 16).decode(errors="replace").splitlines():
            if line.startswith("Uid:"):
                return tuple(int(x) for x in line.split()[1:])
    raise OSError(f"{proc}/{pid}/status has no Uid line")


def ns_pid(pid: int, proc: str = "/proc") -> int:
    """``pid`` as its innermost PID namespace numbers it: the number a CRIU restore gives it back."""
    with open(f"{proc}/{pid}/status", "rb") as f:
        for line in f.read(1 << 16).decode(errors="replace").splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    return pid  # a kernel before 4.1 has no NSpid line: one namespace


def foreign_namespaces(pid: int, proc: str = "/proc", kinds: tuple[str, ...] = SHARED_NAMESPACES) -> list[str]:
    """The namespaces of ``pid`` (among ``kinds``) that are not this process's own."""
    out = []
    for kind in kinds:
        try:
            if os.readlink(f"{proc}/{pid}/ns/{kind}") != os.readlink(f"/proc/self/ns/{kind}"):
                out.append(kind)
        except OSError:
            out.append(kind)
    return out


CAP_SYS_ADMIN = 21
CAP_KINDS = ("CapInh", "CapPrm", "CapEff", "CapAmb")


def creds_of(pid: int, proc: str = "/proc") -> dict:
    """The credentials of ``pid`` as /proc shows them: its pid in its innermost namespace, real,
    effective, saved and fs uids and gids, supplementary groups (sorted) and capability sets."""
    with open(f"{proc}/{pid}/status", "rb") as f:
        st = {k: v.split() for k, _, v in (ln.partition(":") for ln in f.read(1 << 16).decode(errors="replace")
                                           .splitlines())}
    return {"ns_pid": int(st["NSpid"][-1]) if st.get("NSpid") else pid,
            "uid": [int(x) for x in st["Uid"]], "gid": [int(x) for x in st["Gid"]],
            "groups": sorted(int(g) for g in st.get("Groups", [])),
            "caps": {k: int(st[k][0], 16) for k in CAP_KINDS}}


def check_tree_creds(root: int, owner: int, *, init: bool, proc: str = "/proc") -> list[dict]:
    """The credentials of every process of ``root``'s tree (``creds_of``), when each is the job
    owner's; RemoteError ``forbidden`` (one line naming the process) otherwise.

    The owner's ids: real, effective, saved and fs uid ``owner``, and all four gids the root's
    gid; supplementary groups a subset of the root's (Slurm gave them; no process of the user can
    add one), group root (0) for tpass-init alone (``init``: the root is the plugin's tpass-init),
    never an empty list (CRIU restores an empty one as criu's own, group root included). No
    capability in any set, except tpass-init's CAP_SYS_ADMIN (permitted and effective, its only one). So a
    setuid or setgid program run in the tree, or one that kept another saved id, is never dumped
    (its restore would run it with ids the dump's criu had no right to)."""
    out = []
    try:
        top = creds_of(root, proc)
    except (OSError, ValueError, KeyError, IndexError):
        raise RemoteError("not_found", f"pid {root} exited before its dump") from None
    gid = top["gid"][0]
    allowed = set(top["groups"]) - {0}
    from torchpass.checkpoint.criu import tree_pids  # criu imports this module

    for p in tree_pids(root, proc):
        try:
            c = creds_of(p, proc)
        except (OSError, ValueError, KeyError, IndexError):
            continue  # gone: nothing of it is dumped
        is_init = init and p == root
        why = None
        if c["uid"] != [owner] * 4:
            why = f"runs as uid {'/'.join(map(str, c['uid']))}"
        elif c["gid"] != [gid] * 4:
            why = f"runs as gid {'/'.join(map(str, c['gid']))}, not {gid}"
        elif not c["groups"] or not set(c["groups"]) - {0} <= allowed or (0 in c["groups"] and not is_init):
            why = f"holds groups {c['groups'] or 'none'}"
        else:
            allow = {"CapInh": 0, "CapPrm": 1 << CAP_SYS_ADMIN, "CapEff": 1 << CAP_SYS_ADMIN, "CapAmb": 0} \
                if is_init else dict.fromkeys(CAP_KINDS, 0)
            if any(v & ~allow[k] for k, v in c["caps"].items()):
                why = "holds capabilities " + " ".join(f"{k}={v:x}" for k, v in c["caps"].items() if v)
        if why:
            raise RemoteError("forbidden", f"process {p} of the tree of pid {root} {why}, not only job owner uid "
                                           f"{owner}'s ids (a setuid or setgid program?); not dumping")
        out.append(c)
    return out


class Pinned:
    """A process checked and held by a pidfd. Close it (or use ``with``)."""

    def __init__(self, pid: int, pidfd: int, start: int):
        self.pid, self.pidfd, self.start = pid, pidfd, start

    def alive(self) -> bool:
        try:
            signal.pidfd_send_signal(self.pidfd, 0)
            return True
        except ProcessLookupError:
            return False

    def kill(self, sig: int = signal.SIGKILL) -> bool:
        """Signal the pinned process (never a later one with the same pid); False if it is gone."""
        try:
            signal.pidfd_send_signal(self.pidfd, sig)
            return True
        except ProcessLookupError:
            return False

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1

    def __enter__(self) -> "Pinned":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pin(pid: int, *, job_id: int, job_pids: set[int], owner: int, parent: int | None = None,
        same_namespaces: bool = False, proc: str = "/proc") -> Pinned:
    """Pin ``pid`` and check it is the job's (see the module doc); RemoteError ``forbidden``
    (one line) when not, ``not_found`` when it is gone."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        raise RemoteError("bad_request", f"pid {pid!r} is not a process id")
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        raise RemoteError("not_found", f"pid {pid} does not exist on this node") from None
    try:
        if pid not in job_pids:
            raise RemoteError("forbidden", f"pid {pid} is not a process of job {job_id} on this node "
                                           "(scontrol listpids); refused")
        try:
            uids, st = read_uids(pid, proc), read_stat(pid, proc)
        except (OSError, ValueError, IndexError):
            raise RemoteError("not_found", f"pid {pid} does not exist on this node") from None
        if any(u != owner for u in uids):
            raise RemoteError("forbidden", f"pid {pid} runs as uid {'/'.join(map(str, uids))}, not as job "
                                           f"{job_id}'s owner (uid {owner}); refused")
        if parent is not None and st.ppid != parent:
            raise RemoteError("forbidden", f"pid {pid}'s parent is {st.ppid}, not the wrapper {parent} "
                                           "its rank record names; refused")
        if same_namespaces and (kinds := foreign_namespaces(pid, proc)):
            raise RemoteError("forbidden", f"pid {pid} runs in {'/'.join(kinds)} namespace(s) of its own; "
                                           "tpassd runs criu only for ranks in its own mount and user namespaces; "
                                           "refused")
        pinned = Pinned(pid, pidfd, st.start)
        if not pinned.alive():
            raise RemoteError("not_found", f"pid {pid} exited while it was checked")
        return pinned
    except BaseException:
        os.close(pidfd)
        raise


__all__ = ["creds_of", "check_tree_creds", "SCONTROL_TIMEOUT_S", "SHARED_NAMESPACES", "ENTERED_NAMESPACES",
           "slurm_job_pids", "Stat", "read_stat", "read_uids", "foreign_namespaces", "Pinned", "pin"]
