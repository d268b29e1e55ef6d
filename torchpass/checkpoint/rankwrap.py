"""The task wrapper that makes a rank movable with CRIU.

Launch:   python -m torchpass.checkpoint.rankwrap [--state-dir D] -- python train.py ...
Restore:  python -m torchpass.checkpoint.rankwrap --restore IMAGES [--wake-file F] [--state-dir D]
Relaunch from a whole-job snapshot (the plugin's, see ``restore_snapshot``):
          python -m torchpass.checkpoint.rankwrap --restore-snapshot ID -- python train.py ...
          (``tpass-rankwrap``, the SPANK plugin's ``rank_wrapper``, is ``main``)

Launch mode (what Slurm tracks as the task): ``unshare(CLONE_NEWPID)``, fork;
the child does ``setsid`` (CRIU refuses a tree whose session leader lies
outside its PID namespace), takes a pipe to the wrapper as stdout and as
stderr, keeps stdin and every other fd it inherited from Slurm (srun's stdin
forwarding or ``--input``, PMI fds), gets SIGPIPE/SIGXFSZ back to default and
execs the program as PID 1 of its own PID namespace. The wrapper relays the
pipes to its own stdout/stderr, forwards SIGTERM/SIGINT/SIGHUP/SIGUSR1/SIGUSR2
(a namespace init ignores signals it has no handler for, so a SIGTERM the
program does not handle becomes the SIGKILL it would have meant, and is
reported as the SIGTERM), and ends as the rank ended: its exit code, or
killed by the same signal (core dumps off for that), so Slurm's ExitCode is
the one without torchpass. A rank that ends with another code than 0 or a
signal is first reported to the job's coordinator, and the wrapper's exit
held until it decided (torchpass.checkpoint.death_report). It writes a record
``D/job<J>/rank<R>.json`` (wrapper pid, rank pid, pipe inodes) that tpassd's
snapshot action reads. The layout of D is torchpass.layout's RANK_DIR. Default
D: $TORCHPASS_RANK_STATE_DIR, else the job's shared rank directory
(``layout.rank_records_dir($TORCHPASS_STATE_DIR, $TORCHPASS_JOB_ID)``, then
exported as $TORCHPASS_RANK_STATE_DIR), else /run/torchpass/ranks.

Hand-off markers, in ``D/job<J>/rank<R>.handoff`` (written by the snapshot
action): "moving" before the dump, "moved" after it succeeded, "abort" if it
failed. When the child dies while the marker says moving/moved, that is a
hand-off, not a failure: with ``--on-handoff wait`` (default) the wrapper
waits for ``rank<R>.exit`` (written by the restore wrapper wherever the rank
now runs; the state dir must then be shared: ``code``, and ``signal`` when a
signal ended the rank) and ends the same way; with
``--on-handoff exit0`` it exits 0 at once (the job's batch side must then
wait for the moved rank); with ``--on-handoff release`` (the SPANK plugin's)
it waits only until a restored copy holds the rank, writes
``rank<R>.released`` and exits 0, and srun's exit hook collects the rank's
exit code (torchpass.checkpoint.moved_exit): nothing of the step stays on the
node.

Restore mode (a step on the target node): becomes a child subreaper, verifies
the snapshot's manifest, runs ``criu restore -d`` with fresh stdout/stderr
pipes passed by ``--inherit-fd``, creates the wake file (the rank's runtime
then reopens its control link), relays output, waits for the restored rank
and writes its exit code to ``rank<R>.exit``, unless the rank record no
longer names this copy: the rank was moved on again (a newer restore wrapper
owns the exit code), or this move was called off after the restore (tpassd's
``tpassd.restore op=abort`` put the previous copy's record back, then killed
this one: its 137 is not the rank's exit). Then this one exits 0, which ends
its step (the node can then be released from the job). The launch-mode
wrapper likewise takes an exit code only from the copy the record names.

The PID namespace: when the SPANK plugin prepared it as root in
task_init_privileged (``/proc/self/ns/pid`` differs from
``pid_for_children``), the wrapper does not unshare; the plugin's
tpass-init is then PID 1 there (our child: ``namespace_init``) and the
wrapper double-forks the rank under it (the record's ``pid`` is tpass-init,
the root of the tree a dump takes, ``rank_pid`` the rank; tpass-init exits
with the rank's status, see ``Relay.wait``). Without tpass-init it forks
the rank as PID 1; without a prepared namespace it unshares itself (root).
In a restore step the plugin started its root restore agent for
(``TORCHPASS_RESTORE_RANK``), ``--restore`` asks that agent to restore
(``restore_via_agent``, torchpass.checkpoint.restore_agent); without one,
root restores in-process and anyone else is refused. When it may not (an ordinary user, no plugin help), it does no
harm: one line ``torchpass: rank R unprotected: WHY`` on stderr, then it
execs the task in its own place (same pid, stdin and fds; the task's exit
code or signal is the step's), without live migration.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import resource
import select
import signal
import socket
import sys
import time
from pathlib import Path

from torchpass import __version__, envnames, layout

CLONE_NEWPID = 0x20000000
CLONE_NEWTIME = 0x00000080
PR_SET_CHILD_SUBREAPER = 36
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)

_libc = ctypes.CDLL(None, use_errno=True)


# Restore mode: a file that also gets every message. The restore step's own
# stderr goes to the job's output (srun -o), so without it the coordinator's
# rollback event could only say "exited 1", not why.
_error_file: str | None = None


def say(msg: str) -> None:
    # The file first: when the step is being cancelled (a called-off move), its
    # stderr may already be gone.
    if _error_file:
        try:
            with open(_error_file, "a") as f:
                f.write(f"torchpass: {msg}\n")
        except OSError:
            pass
    try:
        sys.stderr.write(f"torchpass: {msg}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def set_child_subreaper() -> None:
    _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")


TASK_ENV = envnames.TASK


def identity(env=os.environ) -> tuple[str, str]:
    job = env.get(envnames.JOB_ID) or env.get("SLURM_JOB_ID") or "0"
    rank = env.get("RANK") or env.get("SLURM_PROCID") or "0"
    return job, rank


class Paths:
    def __init__(self, state_dir: str, job: str, rank: str):
        self.dir = layout.rank_job_dir(state_dir, job)
        self.record = layout.rank_record(state_dir, job, rank)
        self.handoff = layout.handoff(state_dir, job, rank)
        self.exit = layout.exit_file(state_dir, job, rank)

    def read_record(self) -> dict:
        try:
            return json.loads(self.record.read_text())
        except (OSError, ValueError):
            return {}

    def names(self, wrapper_pid: int, restored_from: str | None) -> bool:
        """Whether the rank record still names this copy: no later restore took the rank
        over, and no rollback gave it back to the copy the move started from (tpassd's
        ``tpassd.restore op=abort`` puts that copy's record back before it kills this one)."""
        rec = self.read_record()
        return (rec.get("wrapper_pid") == wrapper_pid and rec.get("node") == socket.gethostname()
                and rec.get("restored_from") == restored_from and not rec.get("aborted"))

    def write_exit(self, result: int, restored_from: str) -> None:
        """The moved rank's end (``Relay.wait``'s result), with the copy that reports it (see
        read_exit): ``code`` shell-style, and ``signal`` S when signal S ended it."""
        got = {"code": shell_code(result), "wrapper_pid": os.getpid(), "node": socket.gethostname(),
               "restored_from": restored_from}
        if result < 0:
            got["signal"] = -result
        write_json(self.exit, got)

    def read_exit(self) -> int | None:
        """The moved rank's exit code (-S: signal S ended it), or None while there is none from the copy the record
        names. A copy whose move was called off after its restore (rollback: the record
        names the copy that kept running) must never decide the rank's exit: the task
        wrapper Slurm tracks would report its 137 to srun while training goes on."""
        try:
            got = json.loads(self.exit.read_text())
        except (OSError, ValueError):
            return None
        if isinstance(got, int) and not isinstance(got, bool):  # "CODE\n": a wrapper without the writer
            return got
        if not isinstance(got, dict) or not isinstance(got.get("code"), int):
            return None
        rec = self.read_record()
        if (rec.get("aborted") or rec.get("wrapper_pid") != got.get("wrapper_pid")
                or rec.get("node") != got.get("node") or rec.get("restored_from") != got.get("restored_from")):
            return None
        sig = got.get("signal")
        return -sig if isinstance(sig, int) and not isinstance(sig, bool) and sig > 0 else got["code"]

    def marker(self) -> str:
        try:
            return self.handoff.read_text().strip()
        except OSError:
            return ""


def write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def handles_signal(pid: int, sig: int) -> bool:
    """Whether ``pid`` has a handler for ``sig`` (SigCgt in /proc/PID/status)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


class Relay:
    """Copies child pipes to our stdout/stderr and forwards signals, in one loop (no threads).

    Event-driven: the loop sleeps in select() until output, the waited process's exit (a
    pidfd) or a signal to forward (signal.set_wakeup_fd) wakes it. Polling instead (every
    50 ms, as it once did) woke every wrapper 20 times a second beside its rank; on a node
    whose ranks take every core, each wake-up can delay a rank inside a collective that all
    ranks wait for."""

    # A bound on one sleep, should a wake-up ever be missed (a pidfd is unavailable: < 5.3).
    IDLE_S = 5.0
    POLL_S = 0.05  # without a pidfd: how often the exit is checked

    def __init__(self, fds: dict[int, int]):
        self.fds = dict(fds)  # read fd -> our fd
        self.child: int | None = None
        self.pending: list[int] = []
        self.substituted: int | None = None  # the first signal we had to send as SIGKILL
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
            self.wake_w: int | None = wake_w
        except ValueError:  # not the main thread (tests): signals are checked every POLL_S
            os.close(wake_w)
            self.wake_w = None
        for s in FORWARDED:
            signal.signal(s, lambda sig, _f: self.pending.append(sig))

    def forward(self) -> None:
        while self.pending and self.child:
            sig = self.pending.pop(0)
            try:
                if handles_signal(self.child, sig):
                    os.kill(self.child, sig)
                else:  # a namespace init ignores it: do what the default action would
                    os.kill(self.child, signal.SIGKILL)
                    self.substituted = self.substituted or sig
            except ProcessLookupError:
                pass

    def pump(self, timeout: float, exited: int | None = None) -> None:
        """Forward pending signals, then relay what is ready within ``timeout``; ``exited``: a
        pidfd whose readiness (the process ended) also ends the wait."""
        self.forward()
        watch = [*self.fds, self.wake_r] + ([exited] if exited is not None else [])
        if self.wake_w is None:
            timeout = min(timeout, self.POLL_S)
        try:
            ready, _, _ = select.select(watch, [], [], timeout)
        except InterruptedError:
            return
        if self.wake_r in ready:
            try:
                while os.read(self.wake_r, 512):
                    pass
            except BlockingIOError:
                pass
        for fd in ready:
            if fd not in self.fds:
                continue
            try:
                data = os.read(fd, 65536)
            except OSError:
                data = b""
            if not data:
                os.close(fd)
                del self.fds[fd]
                continue
            out = self.fds[fd]
            while data:
                try:
                    n = os.write(out, data)
                except BlockingIOError:
                    continue
                except OSError:
                    break
                data = data[n:]

    def wait(self, pid: int, init: bool = False) -> int:
        """Relay until ``pid`` has exited; returns its exit code, or -S when signal S ended
        it (subprocess's convention). A SIGKILL we sent in place of a forwarded signal S
        the rank had no handler for counts as S: without the namespace, S would have
        ended it. ``init``: ``pid`` is the plugin's tpass-init, which exits with the
        rank's code and names a signal that ended the rank in its comm (``init_signal``),
        read before it is reaped."""
        try:
            exited = os.pidfd_open(pid)
        except OSError:  # gone already (waitid below says so), or no pidfd on this kernel
            exited = None
        try:
            return self._wait(pid, init, exited)
        finally:
            if exited is not None:
                os.close(exited)

    def _wait(self, pid: int, init: bool, exited: int | None) -> int:
        while True:
            try:
                if init:
                    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                    got, sig = (pid, init_signal(pid)) if info is not None else (0, None)
                    if got:
                        _, status = os.waitpid(pid, 0)
                else:
                    (got, status), sig = os.waitpid(pid, os.WNOHANG), None
            except ChildProcessError:
                return 255
            if got == pid:
                # drain what is left in the pipes
                end = time.monotonic() + 1.0
                while self.fds and time.monotonic() < end:
                    self.pump(0.05)
                code = -sig if sig else os.waitstatus_to_exitcode(status)
                if code == -signal.SIGKILL and self.substituted:
                    return -self.substituted
                return code
            self.pump(self.IDLE_S if exited is not None else self.POLL_S, exited)


INIT_SIGNAL_PREFIX = "tpass-sig:"  # tpass_init.c: the name it takes when a signal ended the rank


def init_signal(pid: int, proc: str = "/proc") -> int | None:
    """The signal that ended the rank under the exited tpass-init ``pid`` (still a zombie), if any."""
    try:
        name = Path(f"{proc}/{pid}/comm").read_text().strip()
    except OSError:
        return None
    tail = name[len(INIT_SIGNAL_PREFIX):] if name.startswith(INIT_SIGNAL_PREFIX) else ""
    return int(tail) if tail.isdigit() and 0 < int(tail) < 65 else None


def children(pid: int, proc: str = "/proc") -> list[int]:
    """``pid``'s children (of all its threads)."""
    out = []
    try:
        for tid in os.listdir(f"{proc}/{pid}/task"):
            with open(f"{proc}/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def wait_child_of(pid: int, timeout_s: float = 10.0, proc: str = "/proc") -> int:
    """The first child of ``pid`` (the rank under a restored tpass-init)."""
    end = time.monotonic() + timeout_s
    while True:
        got = children(pid, proc)
        if got:
            return got[0]
        if time.monotonic() > end:
            raise OSError(errno.ESRCH, f"no child of pid {pid} appeared within {timeout_s:g} s")
        time.sleep(0.002)


def namespace_init(proc: str = "/proc") -> int | None:
    """Our child that is PID 1 of another PID namespace: the plugin's tpass-init (forked by
    task_init_privileged before this program was executed); None without one."""
    for c in children(os.getpid(), proc):
        try:
            with open(f"{proc}/{c}/status") as f:
                ns = next((ln.split()[1:] for ln in f if ln.startswith("NSpid:")), [])
        except OSError:
            continue
        if len(ns) > 1 and ns[-1] == "1":
            return c
    return None


def shell_code(result: int) -> int:
    """A shell-style exit code (128+S for signal S) from ``Relay.wait``'s result."""
    return 128 - result if result < 0 else result


def exit_like(result: int) -> int:
    """End this process the way the rank ended (``Relay.wait``'s result): a signal S kills
    it by S (handler back to default, core dumps off for that self-kill: the rank made its
    own), so Slurm's ExitCode shows 0:S as without torchpass. Returns the exit code."""
    if result >= 0:
        return result
    sig = -result
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    except (OSError, ValueError):
        pass
    if sig not in (signal.SIGKILL, signal.SIGSTOP):  # these two have no handler to reset
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
    os.kill(os.getpid(), sig)
    return shell_code(result)  # a signal whose default action does not end a process


def pid_ns_prepared(ns: str = "/proc/self/ns") -> bool:
    """Whether our next child already gets a PID namespace of its own: the SPANK plugin
    unshared it as root in task_init_privileged (``unshare(CLONE_NEWPID)`` changes the
    namespace of the caller's children, not the caller's). Until its first process exists,
    the kernel gives the link ``pid_for_children`` but no target (ENOENT on readlink)."""
    try:
        own = os.readlink(f"{ns}/pid")
        os.lstat(f"{ns}/pid_for_children")  # absent on kernels before 4.12: not prepared
    except OSError:
        return False
    try:
        return os.readlink(f"{ns}/pid_for_children") != own
    except FileNotFoundError:
        return True
    except OSError:
        return False


def default_signals() -> None:
    """Signal dispositions back to what the task would get without us: Python ignores
    SIGPIPE and SIGXFSZ, and an ignored signal stays ignored across exec."""
    for s in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, *FORWARDED):
        signal.signal(s, signal.SIG_DFL)


def run_unprotected(argv: list[str], rank: str, why: str) -> None:
    """Do no harm: become the task itself, as if torchpass were not there (same pid as the
    task Slurm started, same stdin and file descriptors, its exit code or signal is the
    task's). Says so in one line first. Returns only if the program cannot be executed."""
    say(f"rank {rank} unprotected: {why}")
    default_signals()
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    os.execvp(argv[0], argv)


def make_pid_namespace(argv: list[str], rank: str, newtime: bool,
                       unshare_fn=unshare, prepared_fn=pid_ns_prepared) -> None:
    """Make sure the rank (our next child) is PID 1 of its own namespace: already so when the
    SPANK plugin prepared it; else unshare here (root). When that is not allowed (an ordinary
    user without the plugin's help), run the task unprotected instead (``run_unprotected``
    does not return; exit 127 if even the program cannot run)."""
    flags = CLONE_NEWTIME if newtime else 0
    prepared = prepared_fn()
    if not prepared:
        flags |= CLONE_NEWPID
    if not flags:
        return
    try:
        unshare_fn(flags)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EINVAL, errno.ENOSPC, errno.EUSERS, errno.ENOMEM):
            raise
        if prepared:  # only the optional time namespace failed: the rank is still movable
            say(f"rank {rank}: no time namespace of its own ({exc}); clocks will not carry across a move")
            return
        unprotected(argv, rank, f"cannot make its PID namespace ({exc}; needs root or torchpass's SPANK plugin)")


def unprotected(argv: list[str], rank: str, why: str) -> None:
    """``run_unprotected``; exit 127 if even the program cannot run (never returns)."""
    try:
        run_unprotected(argv, rank, f"{why}; it runs without live migration")
    except OSError as err:
        say(f"cannot start {argv[0]}: {err}")
    os._exit(127)


def launch(argv: list[str], state_dir: str, on_handoff: str, newtime: bool) -> int:
    job, rank = identity()
    # The key of this task's rank record, for every rank in the task: under torchrun the ranks
    # are its workers, whose own RANK is torchrun's (control.task_fields sends it).
    os.environ[TASK_ENV] = rank
    make_pid_namespace(argv, rank, newtime)
    paths = Paths(state_dir, job, rank)
    # a released record is of an earlier step (a job requeued numbers its steps from 0 again)
    for p in (paths.handoff, paths.exit, layout.released_file(state_dir, job, rank)):
        try:
            p.unlink()
        except FileNotFoundError:
            pass
    # The plugin's tpass-init, PID 1 of the prepared namespace (an ordinary user's rank must
    # not be that PID 1: CRIU needs CAP_SYS_ADMIN in the root of the dumped tree).
    init = namespace_init()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    info_r, info_w = os.pipe()  # under tpass-init: the rank's pid, as the node sees it
    try:
        pid = os.fork()
    except OSError as exc:
        if exc.errno != errno.ENOMEM:
            raise
        # The prepared namespace's first process already exited (e.g. a TaskProlog ran
        # in it, or tpass-init could not start): no process can enter it any more.
        unprotected(argv, rank, f"its PID namespace is gone (fork: {exc.strerror})")
    if pid == 0:  # PID 1 of the new namespace, or (under tpass-init) the middle of a double fork
        try:
            if init is not None and os.fork() != 0:
                os._exit(0)  # the rank is orphaned into the namespace: tpass-init reaps it
            # CRIU refuses a tree whose session leader is outside its PID namespace
            os.setsid()
            if init is not None:
                os.write(info_w, os.readlink("/proc/self").encode())  # /proc is the node's
            # stdin and every inherited fd stay as Slurm gave them; the wrapper's own fds
            # (os.pipe, Python's) are close-on-exec
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            default_signals()
            os.execvp(argv[0], argv)
        except BaseException as exc:  # noqa: BLE001
            os.write(2, f"torchpass: cannot start {argv[0]}: {exc}\n".encode())
        os._exit(127)
    os.close(out_w)
    os.close(err_w)
    os.close(info_w)
    root = pid
    if init is not None:
        os.waitpid(pid, 0)
        got = os.read(info_r, 32)
        root, pid = init, int(got) if got.strip().isdigit() else 0
    os.close(info_r)
    relay = Relay({out_r: 1, err_r: 2})
    relay.child = pid or None
    # "pid": the root of the tree a dump takes; "rank_pid": the rank (the same without tpass-init)
    write_json(paths.record, {
        "job": job, "rank": rank, "wrapper_pid": os.getpid(), "pid": root, "rank_pid": pid or root,
        "node": socket.gethostname(),
        "stdout": f"pipe:[{os.fstat(out_r).st_ino}]", "stderr": f"pipe:[{os.fstat(err_r).st_ino}]",
        "argv": argv, "started": time.time(),
    })
    code = relay.wait(root, init=init is not None)
    marker = paths.marker()
    if marker in ("moving", "moved"):
        # the dump killed it: the rank lives on elsewhere
        if on_handoff == "exit0":
            return 0
        while True:
            got = paths.read_exit()
            if got is not None:
                return got
            if on_handoff == "release" and release_source(paths, job, rank, code):
                return 0
            # dump failed after all, and the rank died; an abort of a later move
            # (the rank then runs on elsewhere, its record names that copy) is not ours
            if paths.marker() == "abort" and paths.names(os.getpid(), None):
                return code
            relay.pump(0.2)
    if code != 0:
        # The rank died here (no hand-off): tell the coordinator and hold this task's exit until it
        # decided, so that srun and KillOnBadExit decide nothing first (death_report).
        from torchpass.checkpoint.death_report import hold_exit

        hold_exit(rank, code, say=say)
    return code


def release_source(paths: Paths, job: str, rank: str, result: int) -> bool:
    """``--on-handoff release``: once a restored copy holds the rank, leave this node (nothing of
    the step stays on it, so it can leave the job) and let srun collect the rank's exit code
    (torchpass.checkpoint.moved_exit). Returns whether this wrapper may now exit 0."""
    from torchpass.checkpoint import moved_exit

    rec = paths.read_record()
    if not moved_exit.leave_source(rec, os.getpid(), socket.gethostname()):
        return False
    moved_exit.write_released(layout.released_file(paths.dir.parent, job, rank), rank,
                              os.environ.get("SLURM_STEP_ID", ""), shell_code(result))
    say(f"rank {rank} runs on {rec.get('node', '?')}; its task leaves {socket.gethostname()} "
        "(srun collects its exit code)")
    return True


def restore(images: str, state_dir: str, wake_file: str | None, criu_bin: str | None, gpu: bool = False) -> int:
    from torchpass.checkpoint import criu as criu_mod
    from torchpass.checkpoint.manifest import read_manifest
    from torchpass.errors import TorchpassError

    # The plugin's root restore agent is this task's child in a restore step it knows
    # (TORCHPASS_RESTORE_RANK); without it (no plugin: unit tests, tools) root restores in-process.
    agents = children(os.getpid()) if os.environ.get(RESTORE_RANK_ENV) else []
    if agents:
        return restore_via_agent(images, state_dir, wake_file, agents)
    if os.geteuid() != 0:
        say(f"restore of {images}: an ordinary user's rank is restored by torchpass's SPANK plugin (its root "
            f"restore agent, started for steps with {RESTORE_RANK_ENV}=R), not by this wrapper; not restoring")
        return 1
    set_child_subreaper()
    try:
        c = criu_mod.find_criu(criu_bin)
        # files and sizes now; their SHA-256 while CRIU restores (criu.restore(checked=...)
        # kills the restored tree before the wake file exists if a check fails)
        manifest = read_manifest(images)
    except TorchpassError as exc:
        say(str(exc))
        return 1
    meta = manifest.get("meta", {})
    job, rank = str(meta.get("job", identity()[0])), str(meta.get("rank", identity()[1]))
    paths = Paths(state_dir, job, rank)
    relays, inherit = {}, {}
    for fd in (1, 2):
        key = criu_mod.pipe_key(meta.get(f"fd{fd}"))
        if key:
            r, w = os.pipe()
            relays[r] = fd
            inherit[w] = key
    relay = Relay(relays)
    try:
        pid, seconds = criu_mod.restore(c, images, inherit=inherit, checked=manifest)
    except TorchpassError as exc:
        say(str(exc))
        return 1
    finally:
        for w in inherit:
            os.close(w)
    init = bool(meta.get("init"))
    rank_pid = wait_child_of(pid) if init else pid
    relay.child = rank_pid
    if gpu or meta.get("gpu"):
        # GPU state back from host memory before the rank may run on (it is
        # still locked by the driver until then)
        try:
            resume_cuda_of(pid, rank_pid, meta)
        except TorchpassError as exc:
            say(f"restored rank {rank} but its CUDA state did not come back ({exc}); killing it")
            os.kill(pid, signal.SIGKILL)
            relay.wait(pid, init=init)
            return 1
    take_over(paths, job, rank, pid, str(images), meta, seconds, rank_pid=rank_pid)
    wake(wake_file)
    code = relay.wait(pid, init=init)
    return finish_restored(paths, str(images), code)


def resume_cuda_of(root: int, rank_pid: int, meta: dict, proc: str = "/proc", cuda=None,
                   pairs: list[tuple[str, str]] | tuple[tuple[str, str], ...] = ()) -> None:
    """After a restore, give the GPU state back to every process of the tree that the dump
    suspended (tpassd recorded them in the image's meta as ``gpu_pids``: their numbers in the
    tree's PID namespace, which CRIU restores unchanged), parents first. Under torchrun those
    are the agent's workers, not ``rank_pid`` (the agent). ``pairs`` remaps the source's GPUs
    onto the restore step's (restore_agent.gpu_pairs_for); none restores onto the same UUIDs."""
    from torchpass.checkpoint import procs
    from torchpass.checkpoint.criu import tree_pids
    from torchpass.checkpoint.cuda import CudaCheckpoint
    from torchpass.errors import CheckpointError

    wanted = meta.get("gpu_pids")
    if wanted is None:  # an image of a tpassd that suspended the task's main process alone
        targets = [rank_pid]
    else:
        by_ns = {}
        for q in tree_pids(root, proc):
            try:
                by_ns[procs.ns_pid(q, proc)] = q
            except (OSError, ValueError):
                continue  # gone since: reported below if it was one of them
        missing = [n for n in wanted if n not in by_ns]
        if missing:
            raise CheckpointError(f"the restored tree has no process {', '.join(map(str, missing))} of those whose "
                                  "GPU state the dump suspended")
        targets = [by_ns[n] for n in wanted]
    cuda = cuda or CudaCheckpoint.load()
    for q in targets:
        cuda.resume(q, pairs)


def wake(wake_file: str | None, text: str = "") -> None:
    """The restored rank's runtime reopens its control link when this file exists; ``text`` (written
    whole before the file appears) tells it more (a copy restored from a whole-job snapshot)."""
    if not wake_file:
        return
    path = Path(wake_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not text:
        path.touch()
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)  # a secret
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


RESTORE_RANK_ENV = envnames.RESTORE_RANK  # set on the restore srun: the plugin starts its restore agent
# ... and the rank's job, which is not the step's when it runs in a companion allocation
RESTORE_JOB_ENV = envnames.RESTORE_JOB


def wait_agent(agent: int, timeout_s: float) -> int | None:
    """The wait status of our child ``agent`` once it exits; None after ``timeout_s``. Woken by its
    exit (a pidfd), not a poll: every rank of the job stands still until the restored rank runs."""
    deadline = time.monotonic() + timeout_s
    try:
        pidfd = os.pidfd_open(agent)
    except OSError:  # already reaped elsewhere, or no pidfd: fall back to polling
        pidfd = -1
    try:
        while (got := os.waitpid(agent, os.WNOHANG))[0] == 0:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if pidfd >= 0:
                select.select([pidfd], [], [], left)
            else:
                time.sleep(min(0.01, left))
        return got[1]
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def restore_via_agent(images: str, state_dir: str, wake_file: str | None, agents: list[int],
                      wake_text: str = "", env=os.environ) -> int:
    """User side of a root restore (torchpass.checkpoint.restore_agent). The plugin made this task
    a child subreaper and forked the root agent as its child. We hand it two pipes (by fd
    number: it takes them with pidfd_getfd) and the image path, in a request file
    named after the agent's pid (a request of an earlier move's step is never taken); it runs
    criu restore -d as root and the restored tree (tpass-init and the rank) is reparented to us."""
    from torchpass.checkpoint import criu as criu_mod

    job = env.get(RESTORE_JOB_ENV) or env.get("SLURM_JOB_ID") or identity(env)[0]
    rank = env[RESTORE_RANK_ENV]
    paths = Paths(state_dir, job, rank)
    if len(agents) != 1:
        say(f"restore: expected the plugin's root restore agent as this task's only child, found {agents}; "
            "is torchpass's SPANK plugin loaded on this node?")
        return 1
    agent = agents[0]
    # From the layout, as the agent names them: this side imports no root code (pyproject.toml's
    # root-only import contract).
    req, res = layout.restore_request_file(paths.dir, rank, agent), layout.restore_result_file(paths.dir, rank, agent)
    relays, fds = {}, {}
    for fd in (1, 2):
        r, w = os.pipe()
        relays[r], fds[str(fd)] = fd, w
    write_json(req, {"images": str(images), "fds": fds})
    # criu (and its hashing) has its own timeout in the agent; this is for an agent that never answers
    status = wait_agent(agent, criu_mod.RESTORE_TIMEOUT_S + 60.0)
    if status is None:
        say(f"restore: the root restore agent (pid {agent}) did not answer in "
            f"{criu_mod.RESTORE_TIMEOUT_S + 60.0:g} s; not restoring")
        return 1
    for w in fds.values():
        os.close(w)
    try:
        out = json.loads(res.read_text())
    except (OSError, ValueError):
        out = {"error": f"the root restore agent exited {os.waitstatus_to_exitcode(status)} without a result"}
    for p in (req, res):
        try:
            p.unlink()
        except OSError:
            pass
    if not isinstance(out, dict) or "error" in out or not isinstance(out.get("pid"), int):
        say(str(out.get("error") if isinstance(out, dict) else out))
        return 1
    pid, rank_pid = out["pid"], out.get("rank_pid", out["pid"])
    if pid not in children(os.getpid()):
        say(f"restore: the restored tree (pid {pid}) was not reparented to this task; not taking it over")
        return 1
    relay = Relay(relays)
    relay.child = rank_pid
    meta = out.get("meta") or {}
    take_over(paths, job, rank, pid, str(images), meta, float(out.get("restore_s", 0.0)), rank_pid=rank_pid,
              gpu_pairs=out.get("gpu_pairs"))
    wake(wake_file, wake_text)
    code = relay.wait(pid, init=pid != rank_pid)
    if code != 0 and paths.names(os.getpid(), str(images)):
        # The restored rank died here (this copy is still the rank's): as in launch mode.
        from torchpass.checkpoint.death_report import hold_exit

        hold_exit(rank, code, env, say=say)
    return finish_restored(paths, str(images), code)


def snapshot_images(jobs_state_dir: str, job: str, snap: str, rank: str) -> str:
    """Rank ``rank``'s images in whole-job snapshot ``snap``, from the job manifest tpassd wrote
    (root's, readable by the job's owner). The root agent checks the path itself."""
    from torchpass.checkpoint import job_manifest, safeio

    path = layout.snapshot_manifest(jobs_state_dir, job, snap)
    try:
        manifest = job_manifest.parse(safeio.read_regular(str(path), job_manifest.MAX_BYTES))
    except FileNotFoundError:
        raise LookupError(f"snapshot {snap} of job {job} has no manifest ({path}): it was never completed or was "
                          "removed") from None
    except (OSError, ValueError) as exc:
        raise LookupError(f"cannot read the manifest of snapshot {snap} of job {job} ({path}: {exc})") from None
    images = job_manifest.rank_images(manifest, rank)
    if images is None:
        raise LookupError(f"snapshot {snap} of job {job} has no rank {rank} ({path})")
    return images


def restore_snapshot(snap: str, state_dir: str, env=os.environ) -> int:
    """A task of a step relaunched from whole-job snapshot ``snap`` (the SPANK plugin runs
    ``rank_wrapper --restore-snapshot ID -- PROGRAM...`` for every task of an srun that its exit
    hook started again with TORCHPASS_RESTORE_SNAPSHOT): instead of starting PROGRAM, restore
    rank $SLURM_PROCID from the snapshot through the plugin's root restore agent, wake it with
    a hold file that says ``restored ID`` (its runtime then registers again and waits for the
    coordinator's resume), relay its output, and end with its exit code: this task is the rank."""
    job = env.get(envnames.JOB_ID) or env.get("SLURM_JOB_ID") or ""
    rank = env.get("SLURM_PROCID") or ""
    jobs_state = env.get(envnames.STATE_DIR) or ""
    if not layout.valid_snapshot_id(snap) or not job.isdigit() or not rank.isdigit() or not jobs_state:
        say(f"cannot restore from snapshot {snap!r}: needs a snapshot id, TORCHPASS_JOB_ID, SLURM_PROCID and "
            "TORCHPASS_STATE_DIR (a --torchpass step relaunched by the SPANK plugin)")
        return 1
    try:
        images = snapshot_images(jobs_state, job, snap, rank)
    except LookupError as exc:
        say(f"rank {rank}: {exc}; the relaunched step cannot restore it")
        return 1
    env[RESTORE_RANK_ENV] = rank
    hold = layout.hold_file(jobs_state, job, snap, rank)
    try:  # the snapshot's own resume released it: the restored copy must wait until it runs
        hold.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        say(f"rank {rank}: cannot reset its hold file {hold} ({exc}); not restoring")
        return 1
    # This run's coordinator and job secret: a job stopped and resumed has a new coordinator
    # (elsewhere) and a new secret; the copy's image knows the old ones (runtime.control).
    said = "".join(f"{key}={env[var]}\n" for key, var in (("coordinator", envnames.COORDINATOR),
                                                          ("secret", envnames.JOB_SECRET)) if env.get(var))
    return restore_via_agent(images, state_dir, str(hold), children(os.getpid()),
                             wake_text=f"{layout.RESTORED_WAKE} {snap}\n{said}", env=env)


def take_over(paths: Paths, job: str, rank: str, pid: int, images: str, meta: dict, seconds: float,
              rank_pid: int | None = None, gpu_pairs: list | None = None) -> None:
    """The rank record now names this restored copy. The record it replaces is kept as
    ``previous``: if this move is called off after the restore, tpassd puts it back.
    ``gpu_pairs``: the root agent's remap of the source's GPUs (the coordinator's event shows it)."""
    previous = paths.read_record()
    if previous.get("restored_from") == images and isinstance(previous.get("previous"), dict):
        # An earlier restore of this same snapshot on a target that was lost (so its
        # abort could not put the record back): the move started from *its* previous.
        previous = previous["previous"]
    previous.pop("previous", None)
    write_json(paths.record, {
        "job": job, "rank": rank, "wrapper_pid": os.getpid(), "pid": pid, "rank_pid": rank_pid or pid,
        "node": socket.gethostname(), "stdout": meta.get("fd1"), "stderr": meta.get("fd2"), "restored_from": images,
        "restore_s": round(seconds, 4), "started": time.time(), "previous": previous,
        **({"gpu_pairs": gpu_pairs} if gpu_pairs else {}),
    })


def finish_restored(paths: Paths, images: str, result: int) -> int:
    """After the restored rank ended with ``result`` (``Relay.wait``'s): report it as the rank's exit,
    unless the rank record no longer names this copy. Then either the rank moved on
    (a later restore wrapper holds it and reports its exit), or this copy's move was
    rolled back after the restore (tpassd put the previous copy's record back and
    killed this one; training goes on there). Either way this step ends with 0, so
    the node can be released, and writes nothing: the 137 of an aborted copy is not
    the rank's exit. Returns this step's exit code (shell-style)."""
    code = shell_code(result)
    rank = paths.record.stem.removeprefix("rank")
    if not paths.names(os.getpid(), images):
        rec = paths.read_record()
        prev = rec.get("previous") or {}
        if prev.get("wrapper_pid") == os.getpid() and prev.get("restored_from") == images:
            say(f"rank {rank} moved on from {socket.gethostname()} to {rec.get('node', '?')}; this restore step ends")
        else:
            where = "" if rec.get("aborted") else f"; it runs on {rec.get('node', '?')}"
            say(f"rank {rank}: its move to {socket.gethostname()} was called off{where}; "
                f"this copy ends (its exit {code} is not the rank's)")
        return 0
    paths.write_exit(result, images)
    return code


def default_state_dir(env=os.environ) -> str:
    """$TORCHPASS_RANK_STATE_DIR; else the job's shared rank directory, exported as
    $TORCHPASS_RANK_STATE_DIR (the rank inherits it); else /run/torchpass/ranks."""
    sd, job = env.get(envnames.STATE_DIR), env.get(envnames.JOB_ID)
    if sd and job and not env.get(envnames.RANK_STATE_DIR):
        env[envnames.RANK_STATE_DIR] = str(layout.rank_records_dir(sd, job))
    return env.get(envnames.RANK_STATE_DIR, layout.DEFAULT_RANK_DIR)


def main(argv: list[str] | None = None) -> int:
    """``tpass-rankwrap`` and ``python -m torchpass.checkpoint.rankwrap``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m torchpass.checkpoint.rankwrap")
    ap.add_argument("--version", action="version", version=f"tpass-rankwrap {__version__}")
    ap.add_argument("--state-dir", default=default_state_dir())
    ap.add_argument("--on-handoff", choices=("wait", "exit0", "release"), default="wait")
    ap.add_argument("--collect-moved", metavar="STEP",
                    help="srun's exit hook: exit with --status and the exit codes of step STEP's moved ranks "
                         "whose launch wrappers left their nodes (--on-handoff release)")
    ap.add_argument("--status", type=int, default=0, help="with --collect-moved: srun's own exit code")
    ap.add_argument("--timens", action="store_true",
                    help="also give the rank its own time namespace (clocks continue across hosts)")
    ap.add_argument("--restore", metavar="IMAGES")
    ap.add_argument("--restore-snapshot", metavar="ID",
                    help="restore rank $SLURM_PROCID from whole-job snapshot ID (a relaunched step)")
    ap.add_argument("--wake-file")
    ap.add_argument("--criu")
    ap.add_argument("--gpu", action="store_true", help="restore: CUDA-restore the rank after CRIU")
    ap.add_argument("--error-file", help="restore: also append why a restore failed to this file")
    args = ap.parse_args(own)
    if args.collect_moved is not None:
        from torchpass.checkpoint import moved_exit

        return moved_exit.collect(args.collect_moved, args.status, args.state_dir,
                                  os.environ.get(envnames.STATE_DIR, ""), identity()[0])
    if args.restore_snapshot is not None:
        return restore_snapshot(args.restore_snapshot, args.state_dir)
    if args.restore:
        global _error_file
        _error_file = args.error_file
        return restore(args.restore, args.state_dir, args.wake_file, args.criu, args.gpu)
    if not prog:
        ap.error("give the program after --")
    try:
        return exit_like(launch(prog, args.state_dir, args.on_handoff, args.timens))
    except OSError as exc:
        say(f"cannot make the rank's PID namespace ({exc}); needs CAP_SYS_ADMIN (root or the SPANK plugin)")
        return 1


if __name__ == "__main__":
    sys.exit(main())
