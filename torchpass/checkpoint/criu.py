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
import secrets
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from torchpass.checkpoint import pidfds, safeio, watchdog
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


# Handles CRIU cannot checkpoint. The RDMA verbs devices: NCCL's IB transport opens
# /dev/infiniband/uverbs* when its network plugin starts and keeps them (and their mmaps) for the
# life of the process, not of a communicator, and CRIU has no plugin for them. io_uring: CRIU has
# no support for its rings.
UNDUMPABLE_PREFIXES = ("/dev/infiniband/", "anon_inode:[io_uring]")


def undumpable_handles(pid: int, proc: str = "/proc") -> list[str]:
    """'PID: what' for every open fd or mapping of the tree rooted at ``pid`` that CRIU cannot
    dump (UNDUMPABLE_PREFIXES). Read from /proc, as open_sockets does, before the dump touches
    anything: a dump that would fail half way is refused instead."""
    found: list[str] = []
    for p in tree_pids(pid, proc):
        held: set[str] = set()
        try:
            fds = os.listdir(f"{proc}/{p}/fd")
        except OSError:
            fds = []
        for fd in fds:
            try:
                target = os.readlink(f"{proc}/{p}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(UNDUMPABLE_PREFIXES):
                held.add(target)
        try:
            with open(f"{proc}/{p}/maps") as f:
                for line in f:
                    path = line.split(maxsplit=5)[5].strip() if line.count(" ") >= 5 else ""
                    if path.startswith(UNDUMPABLE_PREFIXES):
                        held.add(path)
        except (OSError, IndexError):
            pass
        found.extend(f"{p}: {h}" for h in sorted(held))
    return found


def fd_target(pid: int, fd: int, proc: str = "/proc") -> str | None:
    try:
        return os.readlink(f"{proc}/{pid}/fd/{fd}")
    except OSError:
        return None


LOG_TAIL_BYTES = 256 << 10


def _log_tail(path: Path, n: int = 6) -> str:
    """The last error lines of a criu log: its last LOG_TAIL_BYTES, read without following a
    symlink or blocking on a FIFO (criu may run with the owner's ids and write there)."""
    try:
        lines = safeio.read_tail(path, LOG_TAIL_BYTES).decode(errors="replace").splitlines()
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


# criu's capabilities when it acts for an ordinary user's job (``owner_creds``, ``restore_creds``):
# never CAP_DAC_OVERRIDE or CAP_FOWNER, so it opens no file its owner could not. Measured with CRIU
# 4.1.1 on Linux 6.18, tpass-init at the root of the tree:
# - restore: CAP_SYS_ADMIN (the new PID namespace, tpass-init's capability), CAP_CHECKPOINT_RESTORE
#   (pids, /proc/PID/map_files, the mm map), CAP_SETGID (each process's groups), CAP_SETPCAP (the
#   bounding sets); CAP_SYS_RESOURCE where the bounding set has it (rlimits above criu's own).
#   Not CAP_SETUID: with it CRIU's restore children call setuid(0) (cr-restore.c,
#   prepare_userns_creds, taken whenever criu holds CAP_SETUID) and then reopen the image's files as
#   uid 0, the owner of every root file, which gives root's access back without any DAC capability
#   (measured: "Unable to reopen the pipe /proc/self/fd/1", and tty-info.img unreadable, as uid 0).
#   Every process of the tree runs as the owner's uid, so none needs a setuid to restore.
# - dump: the same list. tpass-init stays dumpable (slurm_spank/tpass_init.c, drop_privileges), so
#   its /proc files are the owner's and criu, as the owner with CAP_SYS_ADMIN among its
#   capabilities, may ptrace it: the kernel asks the tracer's permitted capabilities to include the
#   tracee's (cap_ptrace_access_check), which the job user's own processes' do not (measured: they
#   get EPERM/EACCES on ptrace, /proc/PID/mem, environ and fd links; tests/unit/
#   test_criu_owner_creds.py). With tpass-init not dumpable the dump needed CAP_SYS_PTRACE
#   ("Unable to interrupt task: Operation not permitted") and CAP_DAC_READ_SEARCH (its
#   /proc/PID/map_files root's 0500). The dump opens no path of the user's: its files are read
#   through /proc/PID/fd and map_files, and it makes no link-remap file (no --link-remap).
#   Where Yama's ptrace_scope is 1 or 2, a process may ptrace only its descendants without
#   CAP_SYS_PTRACE, and criu attaches to a tree it did not start: ``dump_caps`` adds it there
#   (not measured: this development kernel has no Yama).
# Both run with the tree root's groups: tpass-init's include group root, which reaches its working
# directory (root:root 0770, CRIU_PROC_DIR says why). The restore reopens it by path; the dump stats
# it by path (without group root and CAP_DAC_READ_SEARCH: "Can't stat path: Permission denied",
# criu/files-reg.c, measured). Group root is the group tpass-init itself holds: what it gives beyond
# that directory is in docs/security.md, "Known limits".
RESTORE_CAPS = ("sys_admin", "checkpoint_restore", "setgid", "setpcap")
DUMP_CAPS = RESTORE_CAPS
YAMA_PTRACE_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"
OPTIONAL_CAPS = ("sys_resource",)
NEVER_CAPS = ("dac_override", "fowner", "setuid")
# An unlinked file a rank still holds is copied into the image up to this size (CRIU's ghost file,
# recreated at the restore by the owner's criu in the file's directory); a larger one fails the dump.
GHOST_LIMIT = 1 << 20
CRIU_WORK_BASE = "/run/torchpass-criu"


@dataclass(frozen=True)
class Creds:
    """Who criu runs as for an ordinary user's job: the tree root's ids, with ``caps`` (a minimal
    list: ``dump_caps()`` or ``RESTORE_CAPS``) as inheritable and ambient capabilities."""
    uid: int
    gid: int
    groups: tuple[int, ...]
    caps: tuple[str, ...]


def _status(pid: int | str, proc: str = "/proc") -> dict[str, list[str]]:
    with open(f"{proc}/{pid}/status", "rb") as f:
        text = f.read(1 << 16).decode(errors="replace")
    return {k: v.split() for k, _, v in (ln.partition(":") for ln in text.splitlines())}


def bounded_caps(wanted: Sequence[str], proc: str = "/proc") -> tuple[str, ...]:
    """``wanted`` and those of OPTIONAL_CAPS that this process's bounding set has; CheckpointError
    when it lacks one of ``wanted``."""
    try:
        bnd = int(_status("self", proc)["CapBnd"][0], 16)
    except (OSError, KeyError, IndexError, ValueError) as exc:
        raise CheckpointError(f"cannot read this process's capabilities ({exc})") from None
    missing = [c for c in wanted if not bnd >> CAP_NAMES.index(c) & 1]
    if missing:
        raise CheckpointError(f"criu needs cap_{', cap_'.join(missing)}, which this daemon's bounding set lacks; "
                              "give it back (systemd CapabilityBoundingSet)")
    return (*wanted, *(c for c in OPTIONAL_CAPS if bnd >> CAP_NAMES.index(c) & 1))


def dump_caps(yama_ptrace_scope: str = YAMA_PTRACE_SCOPE) -> tuple[str, ...]:
    """The dump's capabilities: ``DUMP_CAPS``, and CAP_SYS_PTRACE where Yama lets a process without
    it ptrace only its own descendants (ptrace_scope 1 or 2)."""
    try:
        with open(yama_ptrace_scope) as f:
            scope = int(f.read().strip())
    except (OSError, ValueError):  # no Yama: the kernel's own ptrace check alone
        return DUMP_CAPS
    return (*DUMP_CAPS, "sys_ptrace") if scope >= 1 else DUMP_CAPS


def owner_creds(pid: int, proc: str = "/proc", caps: Sequence[str] | None = None) -> Creds:
    """The credentials criu needs to dump ``pid``'s tree as its owner (``dump(creds=...)``): the
    ids and groups of ``pid`` (the tree's root, tpass-init: the job's and group root;
    procs.check_tree_creds checks them), and ``caps`` (default ``dump_caps()``)."""
    caps = dump_caps() if caps is None else caps
    try:
        st = _status(pid, proc)
    except OSError as exc:
        raise CheckpointError(f"cannot read the credentials of pid {pid} ({exc}); not dumping") from None
    try:
        return Creds(uid=int(st["Uid"][0]), gid=int(st["Gid"][0]),
                     groups=tuple(int(g) for g in st.get("Groups", [])), caps=bounded_caps(caps, proc))
    except (KeyError, IndexError, ValueError) as exc:
        raise CheckpointError(f"cannot read the credentials of pid {pid} ({exc}); not dumping") from None


def restore_creds(meta: dict) -> Creds | None:
    """Who criu restores a snapshot as: the dumped tree root's ids (the manifest's ``criu_creds``,
    written by root; tpass-init's groups include group root), with RESTORE_CAPS; None for a
    snapshot dumped as root (a root job's)."""
    rec = meta.get("criu_creds")
    if not isinstance(rec, dict):
        return None
    try:
        uid, gid, groups = int(rec["uid"]), int(rec["gid"]), tuple(int(g) for g in rec["groups"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError("the snapshot's manifest names no usable criu credentials; take a new snapshot") from None
    if uid == 0:
        return None
    return Creds(uid=uid, gid=gid, groups=groups, caps=bounded_caps(RESTORE_CAPS))


def as_creds_argv(setpriv_fd: int, creds: Creds) -> list[str]:
    """setpriv (executed from ``setpriv_fd``, opened in this mount namespace) that runs what follows
    with ``creds``: exactly those capabilities (inheritable and ambient; no other survives the
    change of uid and the exec)."""
    if set(creds.caps) & set(NEVER_CAPS):
        raise CheckpointError(f"criu must not run with cap_{', cap_'.join(set(creds.caps) & set(NEVER_CAPS))}")
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


# -- criu as the owner: the directories it works in ------------------------------------------------
# Images stay in root-only directories (SNAPSHOT_DIR/jobJ and SNAPSHOT_DIR/snapshots/jobJ/ID are
# 0700 root), which criu running as the owner cannot enter: it gets the image directory as
# /proc/self/fd/N, a descriptor opened here (the magic link reaches it without a search of its
# parents; the directory's own mode still applies).
def _open_dir(path: str | os.PathLike) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def _each_image(dfd: int) -> Iterator[int]:
    """A descriptor of each entry of ``dfd``: regular files of one link only (CheckpointError else)."""
    for name in os.listdir(dfd):
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                raise CheckpointError(f"image directory holds {name!r}, not a regular file of one link; "
                                      "take a new snapshot")
            yield fd
        finally:
            os.close(fd)


def give_images_to(dfd: int, creds: Creds) -> None:
    """The (empty, root-only-parented) image directory ``dfd``, the dump's criu's to write: its owner's."""
    os.fchown(dfd, creds.uid, creds.gid)
    os.fchmod(dfd, 0o700)


def take_images_back(dfd: int) -> None:
    """The image directory and every file in it root's again, 0700/0600 (after the owner's criu)."""
    for fd in _each_image(dfd):
        os.fchown(fd, 0, 0)
        os.fchmod(fd, 0o600)
    os.fchown(dfd, 0, 0)
    os.fchmod(dfd, 0o700)


def _root_only_parent(d: Path) -> None:
    st = os.stat(d.parent, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o077:
        raise CheckpointError(f"snapshot {d}: its directory {d.parent} is not root-only (0700 root); "
                              "not restoring as the job's owner")


def _root_owned_dir(path: str) -> int | None:
    """A directory fd of ``path`` when every directory on it is root's and writable by root alone
    (``safeio.open_root_owned_dir``, no symlink followed); None otherwise."""
    try:
        return safeio.open_root_owned_dir(path)
    except OSError:
        return None


@contextmanager
def owner_restore_dirs(d: Path, creds: Creds) -> Iterator[tuple[int, int, Path]]:
    """(image dir fd, work dir fd, work dir) for a restore by ``creds``' criu: the image files
    readable (0755/0644) while it runs, reached only through their root-only parent; a fresh
    work directory of the owner's (log, pidfile) in root-only CRIU_WORK_BASE. Modes go back to
    0700/0600 and the work directory is removed after."""
    _root_only_parent(d)
    parent = _root_owned_dir(os.path.dirname(CRIU_WORK_BASE))
    if parent is None:
        raise CheckpointError(f"{os.path.dirname(CRIU_WORK_BASE)} is not a root-owned directory")
    try:
        try:
            os.mkdir(os.path.basename(CRIU_WORK_BASE), 0o700, dir_fd=parent)
        except FileExistsError:
            pass
    finally:
        os.close(parent)
    base = _root_owned_dir(CRIU_WORK_BASE)
    if base is None:
        raise CheckpointError(f"{CRIU_WORK_BASE} is not a root-owned directory; remove it")
    os.fchmod(base, 0o700)
    os.close(base)
    work = Path(tempfile.mkdtemp(prefix="restore.", dir=CRIU_WORK_BASE))
    dfd = wfd = -1
    try:
        wfd = _open_dir(work)
        os.fchown(wfd, creds.uid, creds.gid)
        dfd = _open_dir(d)
        for fd in _each_image(dfd):
            os.fchmod(fd, 0o644)
        os.fchmod(dfd, 0o755)
        yield dfd, wfd, work
    finally:
        if dfd >= 0:
            for fd in _each_image(dfd):
                os.fchmod(fd, 0o600)
            os.fchmod(dfd, 0o700)
            os.close(dfd)
        if wfd >= 0:
            os.close(wfd)
        shutil.rmtree(work, ignore_errors=True)


def _copy_out(work: Path, name: str, dest: str | os.PathLike, cap: int = 1 << 20) -> None:
    """``work``/``name`` (written by the owner's criu) copied to ``dest`` by root, neither followed
    through a symlink; nothing when it is missing."""
    try:
        fd = os.open(work / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return
    try:
        data = os.read(fd, cap) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    finally:
        os.close(fd)
    out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(out, data)
    finally:
        os.close(out)


def restored_creds_differ(pid: int, tree: list[dict], proc: str = "/proc") -> str | None:
    """Whether the restored tree under ``pid`` holds exactly the processes and credentials the dump
    recorded (``tree``, procs.check_tree_creds); one line naming the first difference, else None."""
    from torchpass.checkpoint import procs

    want = {r["ns_pid"]: r for r in tree}
    seen = 0
    for p in tree_pids(pid, proc):
        try:
            got = procs.creds_of(p, proc)
        except (OSError, ValueError, KeyError, IndexError):
            continue  # gone since: nothing of it runs
        rec = want.get(got["ns_pid"])
        if rec is None:
            return f"restored process {p} (pid {got['ns_pid']} in its namespace) was not in the dumped tree"
        for k in ("uid", "gid", "groups", "caps"):
            if got[k] != rec[k]:
                return f"restored process {p} has {k} {got[k]}, dumped with {rec[k]}"
        seen += 1
    return None if seen else f"restored tree {pid} is gone"


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
        text = safeio.read_tail(log, 1 << 20).decode(errors="replace")
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


def make_tpass_init_base(base: str | None = None) -> bool:
    """TPASS_INIT_BASE as tpass-init makes it (root:root 0770), on a node where no rank started yet
    (a spare): in a root-owned parent, without following a symlink. True when it is there now."""
    try:
        os.close(_open_tpass_init_base(base or TPASS_INIT_BASE))
        return True
    except OSError:
        return False


def _open_tpass_init_base(base: str) -> int:
    """A directory fd of ``base``, made root:root 0770 if missing. Its parent is walked from ``/``
    one component at a time with O_NOFOLLOW, each one root's and writable by root alone
    (``safeio.open_root_owned_dir``); ``base`` itself must be root's with group root (tpass-init's
    group, which the restored tpass-init needs to enter its directory). OSError otherwise."""
    parent, name = os.path.split(base)
    pfd = safeio.open_root_owned_dir(parent)
    try:
        try:
            os.mkdir(name, 0o770, dir_fd=pfd)
        except FileExistsError:
            pass
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
        except OSError as exc:
            raise OSError(exc.errno, f"{base} is a symlink or not a directory; refused") from None
    finally:
        os.close(pfd)
    try:
        st = os.fstat(fd)
        if st.st_uid != 0:
            raise OSError(errno.EPERM, f"{base} belongs to uid {st.st_uid}, not to root; refused")
        if st.st_gid != 0:  # as tpass-init does (slurm_spank/tpass_init.c, root_dir_0770)
            os.fchown(fd, 0, 0)
        os.fchmod(fd, 0o770)
    except BaseException:
        os.close(fd)
        raise
    return fd


def recreate_cwd(rec: dict | None, base: str | None = None) -> bool:
    """Make the dumped root's working directory when this node lacks it (CRIU's restore fails
    without it): tpass-init's own directory lives in the node-local /run of the node it started
    on. True when made.

    Only ``TPASS_INIT_BASE/<name>`` (one component), reached from ``/`` per component with
    O_NOFOLLOW in root-owned directories (``_open_tpass_init_base``), made root:root 0770 like
    every directory tpass-init makes there; the record's uid, gid and mode are never used. The
    record is the image's: a path, owner and mode taken as given let a user who swapped an
    intermediate directory (renameat2 RENAME_EXCHANGE, between a check and the mkdir) have root
    make a directory of the user's, mode 0777, in a root-owned directory."""
    base = base or TPASS_INIT_BASE
    path = rec.get("path") if isinstance(rec, dict) else None
    if not isinstance(path, str):
        return False
    parent, name = os.path.split(path)
    if parent != base or not name or name in (".", "..") or "\0" in name:
        return False
    try:
        dfd = _open_tpass_init_base(base)
    except OSError:
        return False
    try:
        try:
            os.mkdir(name, 0o700, dir_fd=dfd)
        except OSError:
            return False  # there already (left as it is), or not makeable
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except OSError:
            return False
        try:
            os.fchown(fd, 0, 0)
            os.fchmod(fd, 0o770)
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
    /dev/null). ``creds``: run criu as that user (``owner_creds``), after
    every process of the tree was found to hold the owner's ids alone
    (procs.check_tree_creds, before the dump and again after); the image
    directory is the owner's while criu writes it, root's (0700/0600) after,
    and the manifest records the tree's credentials, criu's ids and the owner
    of each file the image reopens (for ``restore``). The
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


# No --link-remap: CRIU then makes no link in a user's directory for an unlinked file; such a file
# (up to GHOST_LIMIT) is copied into the image, and recreated at the restore by the owner's criu.
DUMP_FILES = (f"--ghost-limit={GHOST_LIMIT}",)


def _big_ghost(log: Path) -> str | None:
    """The deleted file CRIU's log says was over --ghost-limit ("Can't dump ghost file PATH of N size")."""
    try:
        with open(log, "rb") as f:
            text = f.read(1 << 20).decode(errors="replace")
    except OSError:
        return None
    m = re.search(r"Can't dump ghost file (.*) of (\d+) size", text)
    return f"{m.group(1)}, {m.group(2)} bytes" if m else None


def _holds_fsnotify_watch(log: Path) -> bool:
    """Whether CRIU's log says it could not dump an inotify or fanotify watch. CRIU records a watch
    by its file handle and checks the handle with open_by_handle_at, which needs
    CAP_DAC_READ_SEARCH: the dump's criu does not hold it (dump_caps), so a watched tree is refused
    (measured: "fsnotify: Can't dump that handle", criu/fsnotify.c)."""
    try:
        with open(log, "rb") as f:
            text = f.read(1 << 20).decode(errors="replace")
    except OSError:
        return False
    return "fsnotify:" in text and "Can't dump that handle" in text


def _owner_tree(pid: int, creds: Creds | None, info: dict) -> list[dict] | None:
    """For a dump as the owner: the tree's credentials checked (procs.check_tree_creds) and
    recorded in ``info`` with criu's ids, which its restore runs with (``restore_creds``)."""
    if creds is None:
        return None
    from torchpass.checkpoint import procs

    # "init": tpass-init at the root (tpassd says so; else a root that is PID 1 of its namespace)
    info.setdefault("init", procs.ns_pid(pid) == 1)
    tree = procs.check_tree_creds(pid, creds.uid, init=bool(info["init"]))
    info["tree"] = tree
    # the root's, for the restore
    info["criu_creds"] = {"uid": creds.uid, "gid": creds.gid, "groups": tree[0]["groups"]}
    return tree


def _owner_tree_after(pid: int, creds: Creds, info: dict, tree: list[dict], d: Path) -> None:
    """After the dump: every process of the image was checked before it, and none has other
    credentials now (one that exited since is fine: it is not restored, or gone from the image);
    the owner of each file the image reopens is recorded (criu_files: the restore compares them)."""
    from torchpass.checkpoint import criu_files, procs

    checked = {c["ns_pid"]: c for c in tree}
    now = procs.check_tree_creds(pid, creds.uid, init=bool(info.get("init")))
    changed = [c["ns_pid"] for c in now if c["ns_pid"] in checked and c != checked[c["ns_pid"]]]
    unchecked = sorted(set(criu_files.image_pids(d)) - set(checked))
    if changed or unchecked:
        raise CheckpointError(f"the tree of pid {pid} changed during its dump (pids {changed or unchecked} in its "
                              "namespace: new credentials, or born after the check); not dumped, the rank was left "
                              "running")
    info["files"] = criu_files.owners(criu_files.reg_files(d))


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
    tree = _owner_tree(pid, creds, info)
    t0 = time.monotonic()
    dfd = _open_dir(d)
    try:
        with TailHasher(d) as hasher:
            if creds is not None:
                give_images_to(dfd, creds)
            proc = run_criu(criu, ["dump", "-t", str(pid), "-D", str(d) if creds is None else f"/proc/self/fd/{dfd}",
                                   "-o", "dump.log", "-v2", "--leave-running", *DUMP_FILES, *CGROUPS],
                            timeout_s, f"criu dump of pid {pid}", "the rank was left running", net_of=net_of,
                            slice_=CRIU_SLICE, creds=creds, pass_fds=(dfd,))
            if creds is not None:
                take_images_back(dfd)
            t1 = time.monotonic()
            seconds = t1 - t0
            if proc.returncode != 0:
                if _out_of_space(d / "dump.log"):
                    raise no_space(who, space_root, max(need, _dir_bytes(d)), free, during=True)
                if big := _big_ghost(d / "dump.log"):
                    raise CheckpointError(f"{who} holds an unlinked file larger than {GHOST_LIMIT >> 20} MiB ({big}): "
                                          "CRIU copies a deleted open file into the image up to that size only; "
                                          "close it before a move or snapshot (the rank was left running)")
                if creds is not None and _holds_fsnotify_watch(d / "dump.log"):
                    raise CheckpointError(f"{who} holds an inotify or fanotify watch, which CRIU dumps only with "
                                          "CAP_DAC_READ_SEARCH (not given to a dump run as the job's user): "
                                          "remove the watch before a move or snapshot (the rank was left running)")
                raise CheckpointError(f"criu dump of pid {pid} failed (exit {proc.returncode}): "
                                      f"{_log_tail(d / 'dump.log')}; the rank was left running")
            hashed = hasher.finish()
    finally:
        os.close(dfd)
    if tree is not None:
        _owner_tree_after(pid, creds, info, tree, d)
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


# Each restore's pidfile lies in a directory of its own, made fresh (mkdir of a random name: it
# fails on an existing one) in this root-only (root:root 0700) node-local directory: the pid that
# root signals is criu's word, never a file in the shared images directory, where another node's
# restore, or anyone who can write there, may have left one. The per-restore directory is
# root:root 0770 (criu may run with the owner's ids and group root); criu reaches it through
# ``/proc/self/fd/N`` of a descriptor it inherits, so it needs no search right on the parent.
RESTORE_PID_DIR = "/run/torchpass-restore"
PIDFILE = "restored.pid"
MAX_PIDFILE_BYTES = 64


def _fresh_pid_dir(base: str) -> tuple[int, str]:
    """(directory fd, name) of a new directory for one restore's pidfile, in ``base`` (made
    root:root 0700 if missing; refused unless root's). OSError otherwise."""
    parent, top = os.path.split(base)
    pfd = safeio.open_root_owned_dir(parent)
    try:
        try:
            os.mkdir(top, 0o700, dir_fd=pfd)
        except FileExistsError:
            pass
        bfd = safeio.open_dir_at(pfd, top)
    finally:
        os.close(pfd)
    try:
        st = os.fstat(bfd)
        if st.st_uid != 0:
            raise OSError(errno.EPERM, f"{base} belongs to uid {st.st_uid}, not to root; refused")
        if st.st_gid != 0:
            os.fchown(bfd, 0, 0)
        os.fchmod(bfd, 0o700)
        name = secrets.token_hex(8)
        os.mkdir(name, 0o700, dir_fd=bfd)  # FileExistsError on a name taken: never reused
        fd = safeio.open_dir_at(bfd, name)
        os.fchown(fd, 0, 0)
        os.fchmod(fd, 0o770)
        return fd, name
    finally:
        os.close(bfd)


def _remove_pid_dir(base: str, name: str, fd: int) -> None:
    try:
        try:
            os.unlink(PIDFILE, dir_fd=fd)
        except FileNotFoundError:
            pass
        bfd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.rmdir(name, dir_fd=bfd)
        finally:
            os.close(bfd)
    except OSError:
        pass  # root's, in node-local /run: gone at the next boot
    finally:
        os.close(fd)


def _read_pid(fd: int) -> int:
    text = safeio.read_regular(PIDFILE, MAX_PIDFILE_BYTES, dir_fd=fd).decode(errors="replace").strip()
    if not text.isdigit():
        raise ValueError(f"pidfile holds {text[:20]!r}, not a pid")
    return int(text)


def restore(
    criu: Criu,
    images: str | os.PathLike,
    *,
    inherit: dict[int, str] | None = None,
    verified: dict | None = None,
    checked: dict | None = None,
    timeout_s: float = RESTORE_TIMEOUT_S,
    reaper: int | None = None,
    reaper_pidfd: int | None = None,
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
    restored task gets that descriptor in its place. The restored root is
    reparented to a child subreaper (PR_SET_CHILD_SUBREAPER), ``reaper``
    (default: this process), whose pidfd ``reaper_pidfd`` the caller holds
    (default: opened here): criu's pid (its pidfile: ``RESTORE_PID_DIR``)
    must be a child of it, or this refuses (``pidfds.child_pidfd``); it is
    killed, if at all, through a pidfd. Without ``-d`` criu's exit status
    says nothing about the restored tree.

    A snapshot dumped as an ordinary user (its manifest's ``criu_creds``) is
    restored by criu with those ids and RESTORE_CAPS alone, after each file
    the image reopens was walked as the owner (``owner_restore_check``); the
    restored tree's credentials must then equal the dump's record, else it
    is killed (``restored_creds_differ``).
    """
    d = Path(images)
    if verified is None and checked is None:
        verified = verify_manifest(d)
    recreate_cwd(((verified if verified is not None else checked).get("meta") or {}).get("cwd"))
    own_reaper = reaper_pidfd is None
    if reaper is None:
        reaper = os.getpid()
    if own_reaper:
        reaper_pidfd = os.pidfd_open(reaper)
    try:
        base = RESTORE_PID_DIR
        try:
            pfd, pname = _fresh_pid_dir(base)
        except OSError as exc:
            raise CheckpointError(f"cannot make this restore's pidfile directory in {base} ({exc}); "
                                  "not restoring") from None
        try:
            return _restore_with(criu, d, inherit, verified, checked, timeout_s, pfd, reaper, reaper_pidfd)
        finally:
            _remove_pid_dir(base, pname, pfd)
    finally:
        if own_reaper:
            os.close(reaper_pidfd)


def _restore_with(criu: Criu, d: Path, inherit: dict[int, str] | None, verified: dict | None, checked: dict | None,
                  timeout_s: float, pfd: int, reaper: int, reaper_pidfd: int) -> tuple[int, float]:
    meta = (verified if verified is not None else checked).get("meta") or {}
    creds = owner_restore_check(d, meta)
    args = ["restore", "-D", str(d), "-d", "--pidfile", f"/proc/self/fd/{pfd}/{PIDFILE}", "-o", "restore.log",
            "-v2", *CGROUPS]
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
    fds = (*(inherit or {}).keys(), pfd)
    if creds is not None:
        # the owner's criu writes the pidfile: this restore's own directory becomes the owner's
        # (group root, 0770), reachable only through pfd, as the root-only RESTORE_PID_DIR holds it
        os.fchown(pfd, creds.uid, 0)
    if creds is None:
        proc = run_criu(criu, args, timeout_s, f"criu restore from {d}", "take a new snapshot", pass_fds=fds)
    else:
        proc = run_owner_restore(criu, d, args, creds, timeout_s, fds)
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
    pid = pidfd = None
    try:
        pid = _read_pid(pfd)
        pidfd = pidfds.child_pidfd(pid, reaper, reaper_pidfd)
    except (OSError, ValueError) as exc:
        if corrupt is None:
            raise CheckpointError(f"criu restore from {d} wrote no usable pidfile ({exc}); "
                                  "the restored tree is left to its reaper") from None
    if corrupt is None and creds is not None and pidfd is not None \
            and (why := restored_creds_differ(pid, meta.get("tree") or [])):
        corrupt = CheckpointError(f"snapshot {d}: {why}; the restored tree was killed")
    try:
        if corrupt is not None:
            if pidfd is not None:
                _kill_restored(pidfd)
            raise corrupt
    finally:
        if pidfd is not None:
            os.close(pidfd)
    return pid, seconds


def _kill_restored(pidfd: int) -> None:
    """Kill a restored tree that must not run (its snapshot failed the check) through its pidfd,
    and reap it if it is our child; the root is PID 1 of its namespace: the rest dies with it.
    Not our child (the root restore agent's tree goes to the restore task, its subreaper): wait
    until it has exited, and its reaper collects it."""
    pidfds.kill_and_wait(pidfd)
def owner_restore_check(d: Path, meta: dict) -> Creds | None:
    """For a snapshot dumped as its owner: criu's credentials for the restore (``restore_creds``),
    after each file the image reopens was found as dumped (criu_files.check, walked as the
    owner); CheckpointError naming the file otherwise. None for a root job's snapshot."""
    creds = restore_creds(meta)
    if creds is None:
        return None
    from torchpass.checkpoint import criu_files

    bad = criu_files.check(criu_files.reg_files(d), meta.get("files") or {}, creds.uid, creds.gid,
                           list(creds.groups))
    if bad:
        raise CheckpointError(f"snapshot {d} not restored: {bad} (a file the rank held is not the one dumped; "
                              "put it back as it was, or take a new snapshot)")
    return creds


def run_owner_restore(criu: Criu, d: Path, args: list[str], creds: Creds, timeout_s: float,
                      pass_fds: tuple[int, ...]) -> subprocess.CompletedProcess:
    """``criu restore ARGS`` as ``creds`` (``owner_restore_dirs``): the image directory and a work
    directory (its log) by descriptor; the log is then copied to ``d``/restore.log by root. The
    pidfile goes to the restore's own directory (``RESTORE_PID_DIR``, among ``pass_fds``): criu
    keeps tpass-init's group root, which may write there. Executables are checked by build-id (CRIU's own check)."""
    with owner_restore_dirs(d, creds) as (dfd, wfd, work):
        args = list(args)
        args[args.index("-D") + 1] = f"/proc/self/fd/{dfd}"
        args += ["-W", f"/proc/self/fd/{wfd}", "--file-validation=buildid"]
        try:
            return run_criu(criu, args, timeout_s, f"criu restore from {d}", "take a new snapshot",
                            pass_fds=(*pass_fds, dfd, wfd), creds=creds)
        finally:
            _copy_out(work, "restore.log", d / "restore.log")
