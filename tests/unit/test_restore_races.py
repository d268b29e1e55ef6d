"""Root's restore acts on nothing a user can change between its check and its use.

The root restore agent (torchpass.checkpoint.restore_agent) and criu.restore
run as root in an ordinary user's restore step. Each test plays a user who
races root, with real processes of an unprivileged user (tpuser1) and
repetition under a time budget, and checks that root did nothing for it:

* the task's fd swapped between a pipe and a root-only file while root takes it;
* an intermediate directory of a cwd record exchanged (renameat2) while root
  makes it;
* a pid that is not the restore task's child, or one left in the shared
  images directory, offered to root to signal.
"""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from test_privilege_boundary import USER_PYTHON, shared_tmp, user  # noqa: F401
from torchpass import layout
from torchpass.checkpoint import criu
from torchpass.checkpoint import manifest as mf
from torchpass.checkpoint import restore_agent as ra

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="plays root (the restore agent) against a user")

SWAPS = 2000  # at least this many swaps by the user, and calls by root, in each race
MIN_S = 1.0  # and for at least this long (the user swaps ~10^5 times a second here)
BUDGET_S = 20.0  # the races end by this, however slow the machine
FD = 20
SECRET = b"root only\n"


def _as_user(user, code: str, *args: str, cwd: str = "/") -> subprocess.Popen:  # noqa: F811
    return subprocess.Popen(["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
                             USER_PYTHON, "-c", code, *args], cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={"PATH": "/usr/bin:/bin"})


def _ready(p: subprocess.Popen) -> None:
    line = p.stdout.readline()
    assert line.strip() == "ready", (line, p.stderr.read() if p.poll() is not None else "")


def _stop(p: subprocess.Popen) -> int:
    """The user's process's swap count, after SIGTERM."""
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    return int(out.split()[-1])


# The user's task: fd FD flips between the write end of a pipe and an O_PATH fd of a file the
# user may not open (root's, 0600); an O_PATH open needs only search rights on the directory.
FLIPPER = """
import os, signal, sys
n, stop = int(sys.argv[1]), []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
r, w = os.pipe()
path = os.open(sys.argv[2], os.O_PATH)
swaps = 0
print("ready", flush=True)
while not stop:
    os.dup2(w, n)
    os.dup2(path, n)
    swaps += 2
print(swaps)
"""


def test_a_task_fd_flipped_between_a_pipe_and_a_root_only_file_never_gives_root_that_file(shared_tmp, user):  # noqa: F811
    """task_pipes as the agent calls it, against a task whose fd flips the whole time. Taking the fd
    with pidfd_getfd and checking the copy held, root gets either the pipe or a refusal; reopening
    /proc/TASK/fd/N after a readlink check gave root an O_WRONLY fd on the file in 5 tries."""
    secret = shared_tmp / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    want = os.stat(secret)
    p = _as_user(user, FLIPPER, str(FD), str(secret))
    pidfd = -1
    calls, got_pipe, refused, got_file = 0, 0, 0, []
    try:
        _ready(p)
        pidfd = os.pidfd_open(p.pid)
        start = time.monotonic()
        while time.monotonic() < start + BUDGET_S and (calls < SWAPS or time.monotonic() < start + MIN_S
                                                      or not got_pipe or not refused):
            calls += 1
            try:
                fds = ra.task_pipes(pidfd, {"1": FD}, {"fd1": "pipe:[1]"})
            except ra.Refused:
                refused += 1
                continue
            for fd in fds:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
                    got_file.append(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE)
                elif stat.S_ISFIFO(st.st_mode):
                    got_pipe += 1
                os.close(fd)
            if got_file:
                break
    finally:
        if pidfd >= 0:
            os.close(pidfd)
        swaps = _stop(p)
    print(f"\nfd race: {swaps} swaps, {calls} calls: {got_pipe} pipes, {refused} refused")
    assert not got_file, f"root got an fd on the root-only file after {calls} calls"
    assert secret.read_bytes() == SECRET and stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    # the race was run: the user swapped, and root saw both sides of it
    assert swaps >= SWAPS and calls >= SWAPS and got_pipe and refused, (swaps, calls, got_pipe, refused)


# The user's exchanger: in their own directory, "d" (a real directory holding "r") and "s" (a
# symlink to a root-owned directory that also holds "r") trade places with renameat2.
EXCHANGER = """
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
swaps = 0
print("ready", flush=True)
while not stop:
    if libc.renameat2(-100, b"d", -100, b"s", 2) != 0:  # AT_FDCWD, RENAME_EXCHANGE
        raise SystemExit(os.strerror(ctypes.get_errno()))
    swaps += 1
print(swaps)
"""


def test_a_cwd_record_raced_with_renameat2_never_makes_root_create_a_directory_for_the_user(
        shared_tmp, user, monkeypatch):  # noqa: F811
    """recreate_cwd called directly: no user entry point reaches it today (the dumped tree's root is
    tpass-init, whose cwd is root's, in TPASS_INIT_BASE), but it acts on the image's record. Here
    TPASS_INIT_BASE is made to lie below a directory the user owns and exchanges, so the record
    names base/x as a real one does: the walk from / must refuse the user's directory. Checking
    the path and then opening it made root create x, the user's and 0777, in a root-owned
    directory after a few hundred tries."""
    rootdir = shared_tmp / "rootdir"
    (rootdir / "r").mkdir(parents=True)
    mine = shared_tmp / "u"
    (mine / "d" / "r").mkdir(parents=True)
    (mine / "s").symlink_to(rootdir)
    for q in (mine, mine / "d", mine / "d" / "r", mine / "s"):
        os.lchown(q, user.pw_uid, user.pw_gid)
    base = mine / "d" / "r"
    monkeypatch.setattr(criu, "TPASS_INIT_BASE", str(base))
    rec = {"path": str(base / "x"), "uid": user.pw_uid, "gid": user.pw_gid, "mode": 0o777}
    p = _as_user(user, EXCHANGER, cwd=str(mine))
    calls, made = 0, []
    try:
        _ready(p)
        start = time.monotonic()
        while time.monotonic() < start + BUDGET_S and (calls < SWAPS or time.monotonic() < start + MIN_S):
            calls += 1
            try:
                ok = criu.recreate_cwd(rec)
            except OSError:  # a path that changed under a check (realpath's readlink: EINVAL): not made
                ok = False
            if ok:
                made.append(calls)
                if (rootdir / "r" / "x").exists():
                    break
                for where in (mine / "d" / "r" / "x", mine / "s" / "r" / "x"):
                    try:
                        where.rmdir()  # made in the user's own directory: root's, 0770; try again
                    except OSError:
                        pass
    finally:
        swaps = _stop(p)
    print(f"\ncwd race: {swaps} exchanges, {calls} calls")
    assert not (rootdir / "r" / "x").exists(), f"root made {rootdir}/r/x for the user after {calls} calls"
    assert not made, f"root made a directory below the user's {mine} (calls {made[:5]})"
    assert swaps >= SWAPS and calls >= SWAPS, (swaps, calls)


def test_a_cwd_record_names_only_a_new_directory_of_tpass_inits_base_and_never_its_owner_or_mode(
        tmp_path, monkeypatch, user):  # noqa: F811
    base = tmp_path / "run" / "torchpass-init"
    base.parent.mkdir()
    monkeypatch.setattr(criu, "TPASS_INIT_BASE", str(base))
    assert criu.recreate_cwd({"path": str(base / "abc123"), "uid": user.pw_uid, "gid": user.pw_gid, "mode": 0o6777})
    for q in (base, base / "abc123"):
        st = os.lstat(q)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o770), q
    for path in ("/etc/x", "/run/x", str(tmp_path / "x"), f"{base}/a/b", f"{base}/..", f"{base}/.", str(base)):
        assert not criu.recreate_cwd({"path": path, "uid": 0, "gid": 0, "mode": 0o700}), path
    assert not Path("/etc/x").exists() and not (tmp_path / "x").exists() and not (base / "a").exists()


# -- the restored pid ----------------------------------------------------------------------------
JOB, RANK, GEN = 7, 1, 3


def _victim() -> int:
    """A process that is nobody's here to kill: not a child of the restore task (double fork)."""
    out = subprocess.run(["sh", "-c", "setsid sleep 300 </dev/null >/dev/null 2>&1 & echo $!"], capture_output=True,
                         text=True, timeout=10, check=True)
    return int(out.stdout)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _fake_criu(bindir: Path, victim: int, where: str) -> None:
    """A criu whose "restore" writes ``victim`` where ``where`` says, as if it had restored it:
    "images": restored.pid in the shared images directory (-D), where another node's restore of
    the same images writes; "pidfile": its own --pidfile (a pid that is not the task's child)."""
    bindir.mkdir()
    put = '"$D/restored.pid"' if where == "images" else '"$P"'
    (bindir / "criu").write_text(
        "#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'Version: 4.1.1'; exit 0; fi\n"
        "while [ $# -gt 0 ]; do case \"$1\" in -D) D=$2;; --pidfile) P=$2;; esac; shift; done\n"
        f"echo {victim} > {put}\n")
    (bindir / "criu").chmod(0o755)


@pytest.mark.parametrize("where", ["images", "pidfile"])
@pytest.mark.parametrize("kill", ["corrupt images", "CUDA not back"])
def test_a_pid_that_is_not_the_tasks_child_is_never_signalled(tmp_path, monkeypatch, where, kill):
    """The agent's restore (after the request is read), its task this test process. A snapshot
    that fails its hash check, or a GPU rank whose CUDA state does not come back, has root kill the
    restored tree: only ever a child of the task, found in this restore's own root-only pidfile."""
    d = layout.images_dir(tmp_path / "snap", JOB, RANK, GEN)
    d.mkdir(parents=True, mode=0o700)
    (d / "pages-1.img").write_bytes(b"x" * 100)
    meta = {"job": JOB, "rank": RANK, "uid": 0, "fd1": "/dev/null", "fd2": "/dev/null"}
    if kill == "CUDA not back":
        meta["gpu"] = True
    mf.write_manifest(d, meta)
    if kill == "corrupt images":
        (d / "pages-1.img").write_bytes(b"y" * 100)  # same size: found by the hash during the restore
    victim = _victim()
    _fake_criu(tmp_path / "bin", victim, where)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    try:
        with pytest.raises(Exception) as ei:
            ra.restore(os.getpid(), {"images": str(d)}, JOB, RANK, 0)
        assert "\n" not in str(ei.value)
        time.sleep(0.2)
        assert _alive(victim), f"root killed pid {victim}: {ei.value}"
    finally:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass
