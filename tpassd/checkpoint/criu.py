"""CRIU dump and restore of one rank's process tree.

What a rank must look like for this to work (see docs/migration-internals.md
and /work/shared/notes/criu-migration.md): PID 1 of its own PID namespace
(rankwrap.py makes that), no socket open (the runtime has torn its process
group down and closed its control link), stdin /dev/null, stdout/stderr
pipes to its wrapper, no private mount namespace.

Images live in a root-only directory (0700, files 0600) with a
``manifest.json`` holding the SHA-256 and size of every image file; restore
verifies it first, so a corrupt or incomplete snapshot gives one clear
CheckpointError and never a half-restored process.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from torchpass.errors import CheckpointError, DependencyError

MIN_VERSION = (4, 0)
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_LOG_SUFFIX = ".log"


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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _image_files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.is_file() and p.name != MANIFEST and not p.name.endswith(_LOG_SUFFIX))


class TailHasher:
    """SHA-256 of the image files of a directory, computed while CRIU writes them.

    CRIU writes every image file once, front to back (a fresh directory per
    dump). A thread follows each file's end and hashes what has been
    written so far; when CRIU has exited, ``finish`` hashes the rest. The
    dump then costs max(CRIU, hashing), not their sum (measured at 10M
    parameters: CRIU 0.40 s + a separate SHA-256 pass 0.39 s over 440 MB,
    while every rank of the job stood still). Only files of at least
    ``min_bytes`` are followed (the pages); the small ones are hashed at the
    end. If a file were ever rewritten in place the digest would not match
    its content, and the restore side's check refuses the snapshot: the
    failure is safe (a rollback), never a corrupt rank.
    """

    def __init__(self, d: str | os.PathLike, *, min_bytes: int = 1 << 20, chunk: int = 4 << 20):
        self.d = Path(d)
        self.min_bytes = min_bytes
        self.chunk = chunk
        self._files: dict[str, tuple] = {}  # name -> (file object, hash, bytes hashed)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tail-hasher", daemon=True)

    def __enter__(self) -> "TailHasher":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for f, _h, _n in self._files.values():
            f.close()

    def _pass(self) -> None:
        for p in _image_files(self.d):
            ent = self._files.get(p.name)
            if ent is None:
                try:
                    if p.stat().st_size < self.min_bytes:
                        continue
                    ent = (open(p, "rb"), hashlib.sha256(), 0)
                except OSError:
                    continue
                self._files[p.name] = ent
            f, h, n = ent
            while chunk := f.read(self.chunk):
                h.update(chunk)
                n += len(chunk)
            self._files[p.name] = (f, h, n)

    def _run(self) -> None:
        try:
            while not self._stop.wait(0.005):
                self._pass()
        except BaseException as exc:  # noqa: BLE001 - reported by finish(); the manifest then hashes afresh
            self._error = exc

    def finish(self) -> dict[str, tuple[int, str]]:
        """Stop following; hash what is left. {name: (bytes hashed, sha256 hex)}."""
        self._stop.set()
        self._thread.join()
        if self._error is not None:
            return {}
        self._pass()
        return {name: (n, h.hexdigest()) for name, (_f, h, n) in self._files.items()}


def write_manifest(d: str | os.PathLike, meta: dict | None = None,
                   hashed: dict[str, tuple[int, str]] | None = None) -> dict:
    """Checksum every image file of ``d`` into d/manifest.json (files 0600).

    ``hashed``: digests already computed (TailHasher), used for a file whose
    size is exactly the number of bytes they covered.
    """
    d = Path(d)
    files = {}
    for p in _image_files(d):
        os.chmod(p, 0o600)
        size = p.stat().st_size
        known = (hashed or {}).get(p.name)
        files[p.name] = {"size": size, "sha256": known[1] if known and known[0] == size else _sha256(p)}
    if not files:
        raise CheckpointError(f"snapshot {d} holds no image files")
    manifest = {"format": MANIFEST_FORMAT, "files": files, "meta": meta or {}}
    tmp = d / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.chmod(tmp, 0o600)
    os.replace(tmp, d / MANIFEST)
    return manifest


def verify_manifest(d: str | os.PathLike) -> dict:
    """Check every image file against the manifest; CheckpointError naming the first problem."""
    manifest = read_manifest(d)
    check_hashes(d, manifest)
    return manifest


def check_hashes(d: str | os.PathLike, manifest: dict) -> None:
    """The SHA-256 of every image file against ``manifest`` (from read_manifest)."""
    d = Path(d)
    for name, want in sorted(manifest["files"].items()):
        if _sha256(d / name) != want.get("sha256"):
            raise CheckpointError(f"snapshot {d} is corrupt: {name} fails its SHA-256 check; take a new snapshot")


def read_manifest(d: str | os.PathLike) -> dict:
    """The manifest, with every image file present at its size (contents not hashed:
    check_hashes, or restore(checked=...) which hashes while CRIU restores)."""
    d = Path(d)
    mpath = d / MANIFEST
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"snapshot {d} has no {MANIFEST}: it is incomplete (the dump did not finish); "
                              "take a new snapshot") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"snapshot {d}: {MANIFEST} is unreadable ({exc}); take a new snapshot") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict) or not files:
        raise CheckpointError(f"snapshot {d}: {MANIFEST} is not a torchpass manifest (format "
                              f"{manifest.get('format')!r}); take a new snapshot")
    for name, want in sorted(files.items()):
        p = d / name
        if "/" in name or not p.is_file():
            raise CheckpointError(f"snapshot {d} is corrupt: image file {name} is missing; take a new snapshot")
        size = p.stat().st_size
        if size != want.get("size"):
            raise CheckpointError(f"snapshot {d} is corrupt: {name} has {size} bytes, the manifest says "
                                  f"{want.get('size')}; take a new snapshot")
    return manifest


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
    ns_pid: int | None = None,
    wait_no_sockets_s: float = 5.0,
    meta: dict | None = None,
    extra_args: Sequence[str] = (),
    leave_running: bool = False,
) -> DumpResult:
    """Dump (and kill) the process tree rooted at ``pid`` into ``images``.

    ``ns_pid``: run criu inside that process's network, UTS and mount
    namespaces (the rank's wrapper on a namespaced node: CRIU must see the
    task's namespaces as its own). Waits up to ``wait_no_sockets_s`` for the
    tree to hold no socket (the runtime closes its control link right after
    reporting quiesced); a socket still open after that is a CheckpointError
    before CRIU runs. On failure CRIU leaves the task running; with
    ``leave_running`` it also does on success (kill it before restoring the
    copy elsewhere).
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
    argv = [criu.path, "dump", "-t", str(pid), "-D", str(d), "-o", "dump.log", "-v2", *extra_args]
    if leave_running:
        argv.append("--leave-running")
    if ns_pid is not None:
        argv = ["nsenter", "-t", str(ns_pid), "--net", "--uts", "--mount", "--", *argv]
    t0 = time.monotonic()
    with TailHasher(d) as hasher:
        proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
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
    extra_args: Sequence[str] = (),
    verified: dict | None = None,
    checked: dict | None = None,
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
    argv = [criu.path, "restore", "-D", str(d), "-d", "--pidfile", str(pidfile), "-o", "restore.log", "-v2"]
    for fd, key in sorted((inherit or {}).items()):
        argv += ["--inherit-fd", f"fd[{fd}]:{key}"]
    argv += list(extra_args)
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
    proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
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
