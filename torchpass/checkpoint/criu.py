"""CRIU dump and restore of one rank's process tree.

What a rank must look like for this to work (see docs/migration-internals.md
and /work/shared/notes/criu-migration.md): PID 1 of its own PID namespace
(rankwrap.py makes that), no socket open (the runtime has torn its process
group down and closed its control link), stdin /dev/null, stdout/stderr
pipes to its wrapper, no private mount namespace, a working directory of its
own at the tree's root (``CRIU_PROC_DIR`` says why).

Images live in a root-only directory (0700, files 0600) with a
``manifest.json`` holding the BLAKE3 digest and size of every image file
(torchpass.checkpoint.manifest); restore verifies it first, so a corrupt or incomplete snapshot gives one clear
CheckpointError and never a half-restored process.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from torchpass.checkpoint import watchdog
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


# Capability names (linux/capability.h) for setpriv, which takes names, not numbers.
CAP_NAMES = ("chown", "dac_override", "dac_read_search", "fowner", "fsetid", "kill", "setgid", "setuid", "setpcap",
             "linux_immutable", "net_bind_service", "net_broadcast", "net_admin", "net_raw", "ipc_lock", "ipc_owner",
             "sys_module", "sys_rawio", "sys_chroot", "sys_ptrace", "sys_pacct", "sys_admin", "sys_boot", "sys_nice",
             "sys_resource", "sys_time", "sys_tty_config", "mknod", "lease", "audit_write", "audit_control", "setfcap",
             "mac_override", "mac_admin", "syslog", "wake_alarm", "block_suspend", "audit_read", "perfmon", "bpf",
             "checkpoint_restore")
SETPRIV = "/usr/bin/setpriv"


@dataclass(frozen=True)
class Creds:
    """Who criu runs as for an ordinary user's dump: the user's ids, with every capability this
    process may hold (its bounding set) as inheritable and ambient ones."""
    uid: int
    gid: int
    groups: tuple[int, ...]
    caps: tuple[str, ...]


def _status(pid: int | str, proc: str = "/proc") -> dict[str, list[str]]:
    with open(f"{proc}/{pid}/status", "rb") as f:
        text = f.read(1 << 16).decode(errors="replace")
    return {k: v.split() for k, _, v in (ln.partition(":") for ln in text.splitlines())}


def owner_creds(pid: int, proc: str = "/proc") -> Creds:
    """The credentials criu needs to dump ``pid``'s tree as its owner (``dump(as_owner=...)``).

    Why not as root: root may lack CAP_SYS_RESOURCE (this machine's bounding set
    has it off), and then root's criu cannot read another uid's rlimits ("Can't
    get rlimit"); with the owner's ids it can, given CAP_SYS_ADMIN, SYS_PTRACE,
    DAC_OVERRIDE... as ambient capabilities and ``--unprivileged``."""
    try:
        st, own = _status(pid, proc), _status("self", proc)
        bnd = int(own["CapBnd"][0], 16)
    except (OSError, KeyError, IndexError, ValueError) as exc:
        raise CheckpointError(f"cannot read the credentials of pid {pid} ({exc}); not dumping") from None
    return Creds(uid=int(st["Uid"][0]), gid=int(st["Gid"][0]), groups=tuple(int(g) for g in st.get("Groups", [])),
                 caps=tuple(n for i, n in enumerate(CAP_NAMES) if bnd >> i & 1))


def as_creds_argv(setpriv_fd: int, creds: Creds) -> list[str]:
    """setpriv (executed from ``setpriv_fd``, opened in this mount namespace) that runs what follows
    with ``creds``."""
    caps = ",".join(f"+{c}" for c in creds.caps)
    groups = ",".join(map(str, creds.groups))
    return [f"/proc/self/fd/{setpriv_fd}", f"--reuid={creds.uid}", f"--regid={creds.gid}",
            f"--groups={groups}" if groups else "--clear-groups",
            f"--inh-caps=-all,{caps}", f"--ambient-caps=-all,{caps}", "--"]


def run_criu(criu: Criu, args: Sequence[str], timeout_s: float, what: str, then: str, *,
             pass_fds: Sequence[int] = (), net_of: int | None = None,
             slice_: str | None = None, creds: Creds | None = None) -> subprocess.CompletedProcess:
    """Run ``criu ARGS`` from a file descriptor opened here, in this process's mount namespace.

    The binary is opened before anything else (``/proc/self/fd/N`` is what is
    executed), so no later change to the path, and no mount namespace, decides
    which program runs as root. ``net_of``: in the network and UTS namespaces
    of that process (``nsenter --net --uts``, never ``--mount``). Killed after
    ``timeout_s``: CheckpointError. ``slice_``: in a scope of that slice (``scoped``).
    ``creds``: as that user with those capabilities (setpriv, also opened here;
    criu then gets ``--unprivileged``).
    """
    fd = os.open(criu.path, os.O_RDONLY | os.O_CLOEXEC)
    helper = None
    try:
        argv = [f"/proc/self/fd/{fd}", *args]
        if creds is not None:
            try:
                helper = os.open(SETPRIV, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                raise CheckpointError(f"cannot open {SETPRIV} ({exc.strerror}): dumping an ordinary user's rank "
                                      "needs setpriv (apt install util-linux)") from None
            argv = [*as_creds_argv(helper, creds), *argv, "--unprivileged"]
            pass_fds = (*pass_fds, helper)
        if net_of is not None:
            argv = ["nsenter", "-t", str(net_of), "--net", "--uts", "--", *argv]
        argv = scoped(argv, slice_)
        try:
            # a criu its user stopped is killed within seconds, not at timeout_s (watchdog.py)
            return watchdog.run(argv, timeout_s=timeout_s, pass_fds=(fd, *pass_fds), what=what, then=then)
        except subprocess.TimeoutExpired:
            raise CheckpointError(f"{what} did not finish in {timeout_s:g} s and was killed; {then}") from None
    finally:
        os.close(fd)
        if helper is not None:
            os.close(helper)


# -- image size and free space -------------------------------------------------------------------
# What a dump writes besides the tree's memory (core, fd and mm images, dump.log, the
# manifest) and how far the page images may exceed the /proc counts: a margin, so that a
# snapshot_dir that is nearly full refuses the dump before CRIU starts rather than in its middle.
IMAGE_MARGIN_BYTES = 16 << 20
IMAGE_MARGIN_FRACTION = 0.10


def image_estimate(pid: int, proc: str = "/proc") -> int:
    """Roughly the bytes a dump of ``pid``'s tree writes: the private memory CRIU copies out of
    each of its processes (anonymous and shared-memory pages, resident or swapped), plus a margin."""
    total = 0
    for p in tree_pids(pid, proc):
        try:
            st = _status(p, proc)
        except OSError:  # gone since: nothing of it to dump
            continue
        total += sum(int(st[k][0]) * 1024 for k in ("RssAnon", "RssShmem", "VmSwap") if st.get(k))  # "N kB"
    return int(total * (1 + IMAGE_MARGIN_FRACTION)) + IMAGE_MARGIN_BYTES


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged writer may still use on ``path``'s filesystem (what df shows as free)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def no_space(who: str, root: str | os.PathLike, need: int, free: int, during: bool = False) -> CheckpointError:
    """The one line of a dump that does not fit on the image disk."""
    when = " (the disk filled up during the dump)" if during else ""
    return CheckpointError(f"no space for {who}'s image on {root}: need ~{-(-need // 1_000_000)} MB, "
                           f"{free // 1_000_000} MB free{when}; free space there or set snapshot_dir to a larger "
                           "disk (the partial image was removed; the rank was left running)")


def check_space(who: str, root: str | os.PathLike, need: int) -> int:
    """Free bytes on ``root``; ``no_space`` when fewer than ``need``."""
    free = free_bytes(root)
    if free < need:
        raise no_space(who, root, need, free)
    return free


def _out_of_space(log: Path) -> bool:
    """Whether CRIU's log says a write failed for lack of space (ENOSPC, or EDQUOT of a quota)."""
    try:
        with open(log, "rb") as f:
            text = f.read(1 << 20).decode(errors="replace")
    except OSError:
        return False
    return "No space left on device" in text or "Disk quota exceeded" in text


def _dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.iterdir() if f.is_file() and not f.is_symlink())


# -- the dumped root's working directory ----------------------------------------------------
# CRIU's parasite, running inside the root of the dumped tree, makes and mounts a directory of
# one fixed name, "proc.crtools", in that process's cwd whenever the root's /proc is not its own
# PID namespace's (criu/pie/parasite.c, get_proc_fd): the case of every rank here (PID 1 of its
# namespace, /proc the node's). Two roots with one cwd dumped at once collide there: the second
# fails with "Can't create a directory (-17)" (EEXIST), and its move rolls back; a leftover
# one (criu killed half way) fails every later dump there. tpass-init therefore gives each rank
# a working directory of its own (slurm_spank/tpass_init.c): a node's ranks dump in parallel.
# It lies in TPASS_INIT_BASE, root's with group root and mode 0770 like each directory in it:
# the parasite mounts by path with tpass-init's CAP_SYS_ADMIN, so no process of the job user may
# change what that path names (tpass-init alone keeps group root).
CRIU_PROC_DIR = "proc.crtools"
TPASS_INIT_BASE = "/run/torchpass-init"


def cwd_record(pid: int, proc: str = "/proc") -> dict | None:
    """The manifest's note of the root's working directory (path, owner, mode), which a restore
    on another node must find there (``recreate_cwd``); None when it cannot be read."""
    try:
        path = os.readlink(f"{proc}/{pid}/cwd")
        st = os.stat(f"{proc}/{pid}/cwd")
    except OSError:
        return None
    return {"path": path, "uid": st.st_uid, "gid": st.st_gid, "mode": stat.S_IMODE(st.st_mode)}


STALE_PROC_DIR_S = 60.0


def clear_stale_proc_dir(pid: int, proc: str = "/proc", now: Callable[[], float] = time.time) -> bool:
    """Remove an empty ``proc.crtools`` left in ``pid``'s cwd by a CRIU killed half way. Only one
    older than STALE_PROC_DIR_S: a live parasite's lasts microseconds (should a cwd still be
    shared). A mount still on it, or anything else by that name, stays (rmdir refuses it) and
    CRIU then says why. True when one was removed."""
    path = f"{proc}/{pid}/cwd/{CRIU_PROC_DIR}"
    try:
        if now() - os.lstat(path).st_mtime < STALE_PROC_DIR_S:
            return False
        os.rmdir(path)
        return True
    except OSError:
        return False


def _root_owned_dir(path: str) -> int | None:
    """A directory fd of ``path`` when it is a directory root owns, reached without following a
    symlink at its last component; None otherwise (root makes nothing where a user points)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    if os.fstat(fd).st_uid != 0:
        os.close(fd)
        return None
    return fd


def make_tpass_init_base(base: str = TPASS_INIT_BASE) -> bool:
    """TPASS_INIT_BASE as tpass-init makes it (root:root 0770), on a node where no rank started yet
    (a spare): in a root-owned parent, without following a symlink. True when it is there now."""
    parent, name = os.path.split(base)
    dfd = _root_owned_dir(parent)
    if dfd is None:
        return False
    try:
        try:
            os.mkdir(name, 0o770, dir_fd=dfd)
        except FileExistsError:
            pass
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:
            st = os.fstat(fd)
            if st.st_uid != 0:
                return False
            os.fchown(fd, 0, 0)
            os.fchmod(fd, 0o770)
            return True
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        os.close(dfd)


def recreate_cwd(rec: dict | None) -> bool:
    """Make the dumped root's working directory when this node lacks it (CRIU's restore fails
    without it): tpass-init's own directory lives in the node-local /run of the node it started
    on. Only the last component, and only in a root-owned directory reached without a symlink,
    so the manifest (root's, checked) never makes root write where a user points. True when made."""
    if not rec or not isinstance(rec.get("path"), str) or os.path.lexists(rec["path"]):
        return False
    parent, name = os.path.split(rec["path"])
    if not name or name in (".", "..") or os.path.realpath(parent) != parent:
        return False
    if parent == TPASS_INIT_BASE:
        make_tpass_init_base()
    dfd = _root_owned_dir(parent)
    if dfd is None:
        return False
    try:
        try:
            os.mkdir(name, 0o700, dir_fd=dfd)
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except OSError:
            return False
        try:
            os.fchown(fd, int(rec["uid"]), int(rec["gid"]))
            os.fchmod(fd, int(rec["mode"]) & 0o7777)
        finally:
            os.close(fd)
        return True
    finally:
        os.close(dfd)


# -- cgroups ------------------------------------------------------------------------------------
# CRIU's default (--manage-cgroups=soft) puts a restored process back into the cgroup *path* it
# was dumped from, making it if missing: on a cluster with proctrack/cgroup and task/cgroup the
# restored rank would leave its restore step's cgroup for a made-up .../job_J/step_S/... on the
# spare, which Slurm neither tracks, signals nor limits (ConstrainRAMSpace). "ignore": CRIU
# neither dumps nor restores cgroups, so the restored tree stays in its restorer's cgroup: the
# restore step's (the restore agent is its task's child).
CGROUPS = ("--manage-cgroups=ignore",)


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
    fds_of: int | None = None,
    creds: Creds | None = None,
    who: str | None = None,
    space_root: str | os.PathLike | None = None,
    estimate: Callable[[int], int] = image_estimate,
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

    ``fds_of``: the process whose stdin/stdout/stderr the manifest records
    (the rank, when ``pid`` is its namespace's init, which holds only
    /dev/null). ``creds``: run criu as that user (``owner_creds``). The
    manifest records ``pid``'s cwd too (``cwd_record``), which a restore
    elsewhere makes when missing; a stale ``proc.crtools`` there is removed first.

    Space: when ``space_root`` (the disk's snapshot_dir) holds less than ``estimate(pid)``
    free, or a write fails for lack of space (CRIU's ENOSPC, the manifest's), one
    ``no_space`` line naming ``who`` (default "pid P"). A dump that fails for any reason
    removes what it wrote in ``images``: no partial image stays behind.
    """
    d = make_private_dir(images)
    if any(d.iterdir()):
        raise CheckpointError(f"image directory {d} is not empty; use a fresh directory per snapshot")
    try:
        return _dump_into(criu, pid, d, wait_no_sockets_s=wait_no_sockets_s, meta=meta, timeout_s=timeout_s,
                          net_of=net_of, fds_of=fds_of, creds=creds, who=who or f"pid {pid}",
                          space_root=space_root or d.parent, estimate=estimate)
    except BaseException:
        shutil.rmtree(d, ignore_errors=True)
        raise


def _dump_into(criu: Criu, pid: int, d: Path, *, wait_no_sockets_s: float, meta: dict | None, timeout_s: float,
               net_of: int | None, fds_of: int | None, creds: Creds | None, who: str, space_root: str | os.PathLike,
               estimate: Callable[[int], int]) -> DumpResult:
    need = estimate(pid)
    free = check_space(who, space_root, need)
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
        info[f"fd{fd}"] = fd_target(fds_of or pid, fd)
    info["cwd"] = cwd_record(pid)
    clear_stale_proc_dir(pid)
    t0 = time.monotonic()
    with TailHasher(d) as hasher:
        proc = run_criu(criu, ["dump", "-t", str(pid), "-D", str(d), "-o", "dump.log", "-v2", "--leave-running",
                               *CGROUPS],
                        timeout_s, f"criu dump of pid {pid}", "the rank was left running", net_of=net_of,
                        slice_=CRIU_SLICE, creds=creds)
        t1 = time.monotonic()
        seconds = t1 - t0
        if proc.returncode != 0:
            if _out_of_space(d / "dump.log"):
                raise no_space(who, space_root, max(need, _dir_bytes(d)), free, during=True)
            raise CheckpointError(f"criu dump of pid {pid} failed (exit {proc.returncode}): "
                                  f"{_log_tail(d / 'dump.log')}; the rank was left running")
        hashed = hasher.finish()
    info["dump_s"] = round(seconds, 4)
    try:
        manifest = write_manifest(d, info, hashed)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise no_space(who, space_root, max(need, _dir_bytes(d)), free, during=True) from None
        raise
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

    The dumped root's working directory (manifest ``meta.cwd``) is made
    first when this node lacks it (``recreate_cwd``).

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
        verified = verify_manifest(d)
    recreate_cwd(((verified if verified is not None else checked).get("meta") or {}).get("cwd"))
    args = ["restore", "-D", str(d), "-d", "--pidfile", str(pidfile), "-o", "restore.log", "-v2", *CGROUPS]
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
        corrupt = CheckpointError(f"snapshot {d}: the image check did not finish; take a new snapshot")
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
        # not our child (the root restore agent's tree goes to the restore task, its
        # subreaper): gone, or a zombie its reaper has yet to collect
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _running(pid):
            time.sleep(0.01)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read(4096).rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False
