"""CRIU dump and restore of one rank's process tree.

What a rank must look like for this to work (see docs/migration-internals.md
and /work/shared/notes/criu-migration.md): PID 1 of its own PID namespace
(rankwrap.py makes that), no socket open (the runtime has torn its process
group down and closed its control link), stdin /dev/null, stdout/stderr
pipes to its wrapper, no private mount namespace.

Images live in a root-only directory (0700, files 0600) with a
``manifest.json`` holding the SHA-256 and size of every image file
(torchpass.checkpoint.manifest); restore verifies it first, so a corrupt or incomplete snapshot gives one clear
CheckpointError and never a half-restored process.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from torchpass.checkpoint.manifest import TailHasher, check_hashes, verify_manifest, write_manifest
from torchpass.errors import CheckpointError, DependencyError

MIN_VERSION = (4, 0)
# criu is killed after these (a rank of a few GB dumps and restores in seconds here):
# no request, and no restore step, waits on a hung criu for ever.
DUMP_TIMEOUT_S = 600.0
RESTORE_TIMEOUT_S = 600.0


# -- finding criu ------------------------------------------------------------------
@dataclass(frozen=True)
class Criu:
    path: str
    version: tuple[int, ...]

    @property
    def version_text(self) -> str:
        return ".".join(map(str, self.version))


def parse_version(text: str) -> tuple[int, ...] | None:
    m = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


def find_criu(
    binary: str | None = None,
    *,
    which: Callable[[str], str | None] = shutil.which,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
    fallbacks: Sequence[str] = ("/usr/sbin/criu", "/usr/local/sbin/criu"),
) -> Criu:
    """Locate criu and check it is >= 4.0; DependencyError (one line) otherwise."""
    path = binary or which("criu") or next((p for p in fallbacks if os.access(p, os.X_OK)), None)
    if not path or not os.access(path, os.X_OK):
        where = f"at {binary}" if binary else "on PATH or in /usr/sbin"
        raise DependencyError(
            f"criu not found {where}: live migration needs CRIU >= {MIN_VERSION[0]}.{MIN_VERSION[1]} "
            "(Debian 13: apt install criu; Debian 12: from the trixie suite)"
        )
    try:
        out = run([path, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        raise DependencyError(f"criu at {path} does not run ({exc}): reinstall CRIU >= 4.0") from None
    version = parse_version((out.stdout or "") + (out.stderr or ""))
    if version is None:
        raise DependencyError(f"criu at {path} printed no version (exit {out.returncode}): reinstall CRIU >= 4.0")
    if version[:2] < MIN_VERSION:
        raise DependencyError(
            f"criu {'.'.join(map(str, version))} at {path} is too old: live migration needs CRIU >= "
            f"{MIN_VERSION[0]}.{MIN_VERSION[1]} (older releases cannot dump on kernels >= 6.x); upgrade criu"
        )
    return Criu(path, version)


# -- image directories and manifests ---------------------------------------------------
def make_private_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` (and parents) as a root-only 0700 directory; refuse a looser existing one."""
    p = Path(path)
    p.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(p, 0o700)
    st = p.stat()
    if st.st_uid != os.geteuid():
        raise CheckpointError(f"image directory {p} belongs to uid {st.st_uid}, not to this daemon; remove it")
    return p


# -- process-tree inspection ------------------------------------------------------------
def tree_pids(pid: int, proc: str = "/proc") -> list[int]:
    """``pid`` and all its descendants (threads' children included)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"{proc}/{p}/task"):
                with open(f"{proc}/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def open_sockets(pid: int, proc: str = "/proc") -> list[str]:
    """'PID:FD' for every socket held by the tree rooted at ``pid``."""
    found = []
    for p in tree_pids(pid, proc):
        try:
            fds = os.listdir(f"{proc}/{p}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"{proc}/{p}/fd/{fd}").startswith("socket:"):
                    found.append(f"{p}:{fd}")
            except OSError:
                pass
    return found


def fd_target(pid: int, fd: int, proc: str = "/proc") -> str | None:
    try:
        return os.readlink(f"{proc}/{pid}/fd/{fd}")
    except OSError:
        return None


def _log_tail(path: Path, n: int = 6) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    errs = [ln.strip() for ln in lines if "Error" in ln or "error" in ln]
    pick = (errs or lines)[-n:]
    return " | ".join(pick) or "(empty log)"


# -- running criu -------------------------------------------------------------------------------
# tpassd's dumps run in this slice, outside tpassd's own CPU and memory caps (docs/admin.md,
# "criu outside tpassd's caps"; contrib/systemd/torchpass-criu.slice). Restores do not: the
# restored rank must stay in its restore step's cgroup.
CRIU_SLICE = "torchpass-criu.slice"


def systemd_booted(marker: str = "/run/systemd/system") -> bool:
    """Whether systemd is PID 1 (sd_booted(3): it creates ``marker`` at boot)."""
    return os.path.isdir(marker)


def scoped(argv: Sequence[str], slice_: str | None, booted: Callable[[], bool] = systemd_booted) -> list[str]:
    """``argv`` run in a transient scope of ``slice_`` (``systemd-run --scope``, which execs it in
    place: same pid, fds and namespaces, only its cgroup differs) when systemd is PID 1; else as is."""
    if slice_ is None or not booted():
        return list(argv)
    return ["systemd-run", "--scope", "--quiet", "--collect", f"--slice={slice_}", "--", *argv]


def run_criu(criu: Criu, args: Sequence[str], timeout_s: float, what: str, then: str, *,
             pass_fds: Sequence[int] = (), net_of: int | None = None,
             slice_: str | None = None) -> subprocess.CompletedProcess:
    """Run ``criu ARGS`` from a file descriptor opened here, in this process's mount namespace.

    The binary is opened before anything else (``/proc/self/fd/N`` is what is
    executed), so no later change to the path, and no mount namespace, decides
    which program runs as root. ``net_of``: in the network and UTS namespaces
    of that process (``nsenter --net --uts``, never ``--mount``). Killed after
    ``timeout_s``: CheckpointError. ``slice_``: in a scope of that slice (``scoped``).
    """
    fd = os.open(criu.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        argv = [f"/proc/self/fd/{fd}", *args]
        if net_of is not None:
            argv = ["nsenter", "-t", str(net_of), "--net", "--uts", "--", *argv]
        argv = scoped(argv, slice_)
        try:
            return subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                  timeout=timeout_s, pass_fds=(fd, *pass_fds))
        except subprocess.TimeoutExpired:
            raise CheckpointError(f"{what} did not finish in {timeout_s:g} s and was killed; {then}") from None
    finally:
        os.close(fd)


# -- dump -------------------------------------------------------------------------------------
@dataclass
class DumpResult:
    images: Path
    seconds: float
    bytes: int
    manifest: dict = field(repr=False)
    hash_s: float = 0.0  # what checksumming added after CRIU exited (TailHasher hashes during the dump)


def dump(
    criu: Criu,
    pid: int,
    images: str | os.PathLike,
    *,
    wait_no_sockets_s: float = 5.0,
    meta: dict | None = None,
    timeout_s: float = DUMP_TIMEOUT_S,
    net_of: int | None = None,
) -> DumpResult:
    """Dump the process tree rooted at ``pid`` into ``images``, leaving it running.

    criu runs in this process's mount namespace (the caller checks that the
    rank shares them: torchpass.checkpoint.procs; ``net_of``: criu enters
    that process's network and UTS namespaces), from a file descriptor
    opened here (``run_criu``), and is killed after ``timeout_s`` (the
    rank then goes on: CRIU's ptrace hold ends with it). Waits up to
    ``wait_no_sockets_s`` for the
    tree to hold no socket (the runtime closes its control link right after
    reporting quiesced); a socket still open after that is a CheckpointError
    before CRIU runs. CRIU leaves the task running (``--leave-running``),
    on success too: it stays paused, so a later failure can resume it in
    place; kill it before the restored copy elsewhere may run.
    """
    d = make_private_dir(images)
    if any(d.iterdir()):
        raise CheckpointError(f"image directory {d} is not empty; use a fresh directory per snapshot")
    deadline = time.monotonic() + wait_no_sockets_s
    while socks := open_sockets(pid):
        if time.monotonic() >= deadline:
            raise CheckpointError(
                f"process {pid} still holds {len(socks)} socket(s) ({', '.join(socks[:4])}): it is not quiesced "
                "(the rank runtime closes all sockets at a pause); not dumping"
            )
        time.sleep(0.01)
    info = dict(meta or {})
    for fd in (0, 1, 2):
        info[f"fd{fd}"] = fd_target(pid, fd)
    t0 = time.monotonic()
    with TailHasher(d) as hasher:
        proc = run_criu(criu, ["dump", "-t", str(pid), "-D", str(d), "-o", "dump.log", "-v2", "--leave-running"],
                        timeout_s, f"criu dump of pid {pid}", "the rank was left running", net_of=net_of,
                        slice_=CRIU_SLICE)
        t1 = time.monotonic()
        seconds = t1 - t0
        if proc.returncode != 0:
            raise CheckpointError(f"criu dump of pid {pid} failed (exit {proc.returncode}): "
                                  f"{_log_tail(d / 'dump.log')}; the rank was left running")
        hashed = hasher.finish()
    info["dump_s"] = round(seconds, 4)
    manifest = write_manifest(d, info, hashed)
    size = sum(f["size"] for f in manifest["files"].values())
    return DumpResult(d, seconds, size, manifest, hash_s=time.monotonic() - t1)


# -- restore ------------------------------------------------------------------------------------
def pipe_key(target: str | None) -> str | None:
    """'pipe:[123]' from a /proc fd link, else None."""
    return target if target and re.fullmatch(r"pipe:\[\d+\]", target) else None


def restore(
    criu: Criu,
    images: str | os.PathLike,
    *,
    pidfile: str | os.PathLike,
    inherit: dict[int, str] | None = None,
    verified: dict | None = None,
    checked: dict | None = None,
    timeout_s: float = RESTORE_TIMEOUT_S,
) -> tuple[int, float]:
    """Verify the manifest, then ``criu restore -d`` the tree; returns (host pid, seconds).

    ``verified``: the manifest the caller has just checked with
    ``verify_manifest``: it is not hashed a second time. Measured: each
    pass over a 10M-parameter rank's 440 MB image costs ~0.34 s here, while
    every rank stands still.

    ``checked``: the manifest from ``read_manifest`` (files present, sizes
    right, contents not hashed yet): the images are hashed *while* CRIU
    restores, and a snapshot that fails the check is still refused: the
    restored tree is killed before this returns, so it never gets past its
    hold (the rank waits for a wake file its restore wrapper creates only
    after this returned), and the error is the same "is corrupt" one. The
    restore then costs max(CRIU, hashing) instead of their sum. A CRIU
    failure on a corrupt snapshot is reported as the corruption (the cause).

    ``inherit`` maps a file descriptor of this process to the resource the
    dumped task had (``'pipe:[INODE]'``, from the manifest's fd1/fd2): the
    restored task gets that descriptor in its place. The caller should be a
    child subreaper (PR_SET_CHILD_SUBREAPER) to become the restored tree's
    parent and ``waitpid`` it: without ``-d`` criu's exit status says nothing
    about the restored tree.
    """
    d = Path(images)
    if verified is None and checked is None:
        verify_manifest(d)
    args = ["restore", "-D", str(d), "-d", "--pidfile", str(pidfile), "-o", "restore.log", "-v2"]
    for fd, key in sorted((inherit or {}).items()):
        args += ["--inherit-fd", f"fd[{fd}]:{key}"]
    hashing: list[BaseException | None] = []
    hasher = None
    if verified is None and checked is not None:
        def _hash() -> None:
            try:
                check_hashes(d, checked)
                hashing.append(None)
            except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller's thread
                hashing.append(exc)

        hasher = threading.Thread(target=_hash, name="restore-verify", daemon=True)
        hasher.start()
    t0 = time.monotonic()
    proc = run_criu(criu, args, timeout_s, f"criu restore from {d}", "take a new snapshot",
                    pass_fds=tuple((inherit or {}).keys()))
    seconds = time.monotonic() - t0
    if hasher is not None:
        hasher.join()
    corrupt = hashing[0] if hashing and hashing[0] is not None else None
    if hasher is not None and not hashing:
        corrupt = CheckpointError(f"snapshot {d}: the SHA-256 check did not finish; take a new snapshot")
    if proc.returncode != 0:
        if corrupt is not None:
            raise corrupt
        raise CheckpointError(f"criu restore from {d} failed (exit {proc.returncode}): "
                              f"{_log_tail(d / 'restore.log')}")
    try:
        pid = int(Path(pidfile).read_text().strip())
    except (OSError, ValueError) as exc:
        pid = None
        if corrupt is None:
            raise CheckpointError(f"criu restore from {d} wrote no usable pidfile ({exc})") from None
    if corrupt is not None:
        if pid is not None:
            _kill_restored(pid)
        raise corrupt
    return pid, seconds


def _kill_restored(pid: int) -> None:
    """Kill a restored tree that must not run (its snapshot failed the check) and reap it
    (the caller is its subreaper); the root is PID 1 of its namespace: the rest dies with it."""
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        return
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
            time.sleep(0.01)
