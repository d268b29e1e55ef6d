"""CRIU never runs with root's power over an ordinary user's files.

A real tree as the plugin makes it (a PID namespace, tpass-init as its PID 1
with the job's uid, gid and groups plus group root and CAP_SYS_ADMIN alone,
the rank as the user under it) is dumped and restored by real CRIU through
``criu.dump(creds=owner_creds(...))`` and ``criu.restore`` (what tpassd's
dump and the root restore agent run; the agent itself is started by the
SPANK plugin in a Slurm step, which this machine's unit tests do not have).
The criu binary is a stand-in (``criu_binary``): a shell that records its own
/proc/self/status with builtins, before anything else, then execs the real
criu.
"""

from __future__ import annotations

import os
import pwd
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from test_privilege_boundary import _dump as _svc_dump
from test_privilege_boundary import _record, _refused, _service, user  # noqa: F401 - a pytest fixture, used by name
from test_tpass_init import init_program  # noqa: F401
from torchpass.checkpoint import criu, procs
from torchpass.errors import CheckpointError, RemoteError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="root dumps and restores a user's tree here")

# root: a PID namespace with tpass-init as PID 1 (what the plugin's task_init_privileged does),
# then the task becomes the user (uid, gid and the gid as its one group, as Slurm's initgroups
# gives) and double-forks the rank under tpass-init, relaying its output to our stdout.
TREE = """
import ctypes, os, sys
init, uid, gid, script = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
assert ctypes.CDLL(None, use_errno=True).unshare(0x20000000) == 0
task = os.getpid()
if os.fork() == 0:
    os.execv(init, [init, str(uid), str(gid), str(task)])
os.setgroups([gid]); os.setresgid(gid, gid, gid); os.setresuid(uid, uid, uid)
r, w = os.pipe()
if os.fork() == 0:
    if os.fork() != 0:
        os._exit(0)
    os.setsid(); os.dup2(w, 1); os.dup2(w, 2)
    os.execv("/usr/bin/python3", ["python3", "-c", script])
os.wait(); os.close(w)
while (b := os.read(r, 4096)):
    os.write(1, b)
"""
RANK = """
import os, sys, time
fd = os.open({path!r}, os.O_RDWR)
if {spawn!r}:
    import subprocess
    subprocess.Popen({spawn!r})
print("ready", flush=True)
while not os.path.exists({go!r}):
    time.sleep(0.02)
print("after", os.readlink(f"/proc/self/fd/{{fd}}"), flush=True)
time.sleep(30)
"""
CAP_BIT = {n: i for i, n in enumerate(criu.CAP_NAMES)}


def _mask(names) -> int:
    return sum(1 << CAP_BIT[n] for n in names)


class Tree:
    def __init__(self, init: Path, u, work: Path, held: Path, spawn: list[str] | None = None):
        self.go = work / "go"
        self.task = subprocess.Popen([sys.executable, "-c", TREE, str(init), str(u.pw_uid), str(u.pw_gid),
                                      RANK.format(path=str(held), go=str(self.go), spawn=spawn)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert self.task.stdout.readline() == b"ready\n"
        self.init = next(c for c in _children(self.task.pid) if procs.ns_pid(c) == 1)
        self.rank = _children(self.init)[0]
        self.pidfds = [os.pidfd_open(self.init)]
        # tpass-init drops to the user after it forks: "ready" can come first (a loaded machine
        # read uid 0 for the init, and the dump then refused the tree as not the owner's).
        _await_uid(self.init, u.pw_uid)

    def end(self) -> None:
        self.go.touch()
        for fd in self.pidfds:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            select.select([fd], [], [], 10)
            os.close(fd)
        self.pidfds = []
        self.task.kill()
        self.task.wait()


def _await_uid(pid: int, uid: int) -> None:
    end = time.monotonic() + 10
    while time.monotonic() < end:
        with open(f"/proc/{pid}/status") as f:
            uids = next(line.split()[1:] for line in f if line.startswith("Uid:"))
        if all(int(u) == uid for u in uids):
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} still has uids {uids}, not {uid}")


def _children(pid: int) -> list[int]:
    end = time.monotonic() + 10
    while time.monotonic() < end:
        out = [int(c) for t in os.listdir(f"/proc/{pid}/task")
               for c in open(f"/proc/{pid}/task/{t}/children").read().split()]
        if out:
            return out
        time.sleep(0.01)
    raise AssertionError(f"no child of {pid}")


@pytest.fixture(autouse=True)
def subreaper():
    """criu.restore takes only a restored root that is the caller's child: as the restore task is
    for the restore agent, this test process is the child subreaper criu's detached root goes to."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    yield
    libc.prctl(36, 0, 0, 0, 0)


@pytest.fixture
def userdir(user):  # noqa: F811
    """A directory of the user's, and a stand-in criu that records its status there."""
    d = Path(tempfile.mkdtemp(prefix="tpass-criucreds-", dir="/tmp"))
    os.chmod(d, 0o755)
    mine = d / "u"
    mine.mkdir()
    os.chown(mine, user.pw_uid, user.pw_gid)
    rec = d / "criu.status"
    rec.mkdir()
    os.chmod(rec, 0o777)
    standin = d / "criu"
    standin.write_text("#!/bin/bash\n"
                       f"while IFS= read -r l; do echo \"$l\"; done < /proc/$$/status > {rec}/$$.${{1:-none}}\n"
                       f"echo \"$*\" > {rec}/$$.${{1:-none}}.argv\n"
                       f"exec {criu.find_criu(None).path} \"$@\"\n")
    standin.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


# What criu may hold (measured; criu.py says why): restore needs these four, and CAP_SYS_RESOURCE
# where the bounding set has it; the dump the same (tpass-init stays dumpable), plus CAP_SYS_PTRACE
# only where Yama confines ptrace to descendants.
RESTORE = ("sys_admin", "checkpoint_restore", "setgid", "setpcap")


def _yama_confines_ptrace() -> bool:
    try:
        return int(Path(criu.YAMA_PTRACE_SCOPE).read_text()) >= 1
    except (OSError, ValueError):
        return False


DUMP = (*RESTORE, "sys_ptrace") if _yama_confines_ptrace() else RESTORE


def _check_criu_creds(d: Path, u, verb: str) -> None:
    """The stand-in's record: the owner's ids and groups, exactly the listed capabilities."""
    bnd = int(open("/proc/self/status").read().split("CapBnd:")[1].split()[0], 16)
    want = _mask(DUMP if verb == "dump" else RESTORE) | (_mask(("sys_resource",)) & bnd)
    seen = _statuses(d, verb)
    assert seen, f"the stand-in criu did not run for {verb}"
    for st in seen:
        assert st["Uid"] == [str(u.pw_uid)] * 4 and st["Gid"] == [str(u.pw_gid)] * 4, (verb, st["Uid"], st["Gid"])
        # tpass-init's groups: the job's and group root (for its working directory, root:root 0770)
        assert sorted(map(int, st["Groups"])) == sorted({u.pw_gid, 0}), (verb, st["Groups"])
        for k in ("CapPrm", "CapEff", "CapAmb"):
            assert int(st[k][0], 16) == want, (verb, k, st[k])
        assert not int(st["CapEff"][0], 16) & _mask(("dac_override", "fowner", "setuid")), (verb, st["CapEff"])


def _statuses(d: Path, verb: str) -> list[dict[str, list[str]]]:
    out = []
    for p in sorted((d / "criu.status").glob(f"*.{verb}")):  # (not the .argv files)
        out.append({k: v.split() for k, _, v in (ln.partition(":") for ln in p.read_text().splitlines())})
    return out


@pytest.fixture
def images(tmp_path):
    base = criu.make_private_dir(tmp_path / "snap" / "job1")  # root-only, as tpassd's
    return base / "rank0.gen1"


def _dump(c, t: Tree, images: Path) -> criu.DumpResult:
    return criu.dump(c, t.init, images, fds_of=t.rank, creds=criu.owner_creds(t.init), who="rank 0",
                     meta={"init": True, "uid": os.stat(f"/proc/{t.rank}").st_uid})


def _kill_source(t: Tree) -> int:
    """Our fd on the rank's stdout pipe (for --inherit-fd), then the source tree killed."""
    w = os.open(f"/proc/{t.rank}/fd/1", os.O_WRONLY | os.O_CLOEXEC)
    fd = t.pidfds.pop()
    signal.pidfd_send_signal(fd, signal.SIGKILL)
    select.select([fd], [], [], 10)
    os.close(fd)
    return w


def test_criu_dumps_and_restores_as_the_owner_with_the_listed_capabilities_only(
        user, userdir, images, init_program):  # noqa: F811
    held = userdir / "u" / "data"
    held.write_bytes(b"x" * 100)
    os.chown(held, user.pw_uid, user.pw_gid)
    c = criu.find_criu(str(userdir / "criu"))
    t = Tree(init_program, user, userdir, held)
    try:
        res = _dump(c, t, images)
        _check_criu_creds(userdir, user, "dump")
        tree = res.manifest["meta"]["tree"]
        assert [r["ns_pid"] for r in tree] == [1, procs.ns_pid(t.rank)]
        w = _kill_source(t)
        pid, _ = criu.restore(c, images, inherit={w: os.readlink(f"/proc/self/fd/{w}")})
        os.close(w)
        t.pidfds.append(os.pidfd_open(pid))
        _check_criu_creds(userdir, user, "restore")
        # the restored tree: tpass-init with CAP_SYS_ADMIN alone, the rank with nothing; every
        # process's credentials what the dump recorded
        assert "--file-validation=buildid" in _argv_of(userdir, "restore")
        assert criu.restored_creds_differ(pid, tree) is None
        now = {r["ns_pid"]: r for r in (procs.creds_of(p) for p in criu.tree_pids(pid))}
        assert now == {r["ns_pid"]: r for r in tree}
        assert now[1]["caps"]["CapEff"] == 1 << 21 and all(v == 0 for v in now[tree[1]["ns_pid"]]["caps"].values())
        # the restored tpass-init is dumpable as the dumped one was: a second move of the rank
        # dumps it with the same list
        again = criu.dump(c, pid, images.with_name("rank0.gen2"), fds_of=criu.tree_pids(pid)[1],
                          creds=criu.owner_creds(pid), who="rank 0", meta={"init": True, "uid": user.pw_uid})
        assert [r["ns_pid"] for r in again.manifest["meta"]["tree"]] == [r["ns_pid"] for r in tree]
        _check_criu_creds(userdir, user, "dump")
        t.go.touch()
        assert t.task.stdout.readline() == f"after {held}\n".encode()
        # at rest the images are root's alone again
        assert {(os.stat(p).st_uid, os.stat(p).st_mode & 0o777) for p in images.iterdir()} == {(0, 0o600)}
        assert (os.stat(images).st_uid, os.stat(images).st_mode & 0o777) == (0, 0o700)
    finally:
        t.end()


def test_a_held_file_swapped_for_a_symlink_to_a_root_only_file_refuses_the_restore(
        user, userdir, images, init_program):  # noqa: F811
    """The user's rank holds its own file open for writing, is dumped, then the user replaces the
    file by a symlink to a root-only 0600 file of the same size. Before: criu restored as root
    and the restored rank held the root-only file open for writing."""
    secret_dir = Path(tempfile.mkdtemp(prefix="tpass-secret-", dir="/var/tmp"))
    os.chmod(secret_dir, 0o755)
    secret = secret_dir / "shadow"
    secret.write_bytes(b"s" * 100)
    os.chmod(secret, 0o600)
    held = userdir / "u" / "data"
    held.write_bytes(b"x" * 100)
    os.chown(held, user.pw_uid, user.pw_gid)
    os.chmod(held, 0o600)  # the target's size and mode: CRIU's own check compares only those
    c = criu.find_criu(None)
    t = Tree(init_program, user, userdir, held)
    try:
        _dump(c, t, images)
        w = _kill_source(t)
        # the user's own move: their file becomes a symlink to the root-only one
        subprocess.run(["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
                        "sh", "-c", f"rm {held} && ln -s {secret} {held}"], check=True, timeout=10)
        pid = None
        try:
            pid, _ = criu.restore(c, images, inherit={w: os.readlink(f"/proc/self/fd/{w}")})
        except CheckpointError as exc:
            assert str(exc).count("\n") == 0 and f"{held} is a symlink" in str(exc), exc
        finally:
            os.close(w)
        if pid is not None:
            t.pidfds.append(os.pidfd_open(pid))
            t.go.touch()
            line = t.task.stdout.readline()
            pytest.fail(f"restored, and the rank holds {line!r} open for writing")
        assert secret.read_bytes() == b"s" * 100
    finally:
        t.end()
        shutil.rmtree(secret_dir, ignore_errors=True)


@pytest.mark.parametrize("change", ["size", "owner", "mode"])
def test_a_held_file_changed_since_the_dump_refuses_the_restore_naming_it(
        user, userdir, images, init_program, change):  # noqa: F811
    held = userdir / "u" / "data"
    held.write_bytes(b"x" * 100)
    os.chown(held, user.pw_uid, user.pw_gid)
    c = criu.find_criu(None)
    t = Tree(init_program, user, userdir, held)
    try:
        _dump(c, t, images)
        w = _kill_source(t)
        if change == "size":
            held.write_bytes(b"x" * 101)
        elif change == "owner":
            os.chown(held, user.pw_uid, 0)
        else:
            os.chmod(held, 0o666)
        with pytest.raises(CheckpointError, match=f"{held}: {change}"):
            criu.restore(c, images, inherit={w: os.readlink(f"/proc/self/fd/{w}")})
        os.close(w)
    finally:
        t.end()


def test_a_tree_with_a_setgid_process_is_refused_before_criu_runs(user, userdir, images, init_program,  # noqa: F811
                                                                   tmp_path):
    """The rank runs a root-owned setgid program (its effective and saved gid become root's)."""
    prog = userdir / "sgid-sleep"
    shutil.copy("/usr/bin/sleep", prog)
    os.chown(prog, 0, 0)
    os.chmod(prog, 0o2755)
    held = userdir / "u" / "data"
    held.write_bytes(b"x")
    os.chown(held, user.pw_uid, user.pw_gid)
    c = criu.find_criu(str(userdir / "criu"))
    t = Tree(init_program, user, userdir, held, spawn=[str(prog), "30"])
    try:
        kid = _children(t.rank)[0]
        end = time.monotonic() + 10
        while Path(f"/proc/{kid}/status").read_text().split("Gid:")[1].split()[1] != "0":  # until the exec
            assert time.monotonic() < end
            time.sleep(0.01)
        # through a tpassd request (tpassd.snapshot op=dump), the way a user reaches a dump
        _record(tmp_path, {"pid": t.init, "rank_pid": t.rank, "wrapper_pid": t.task.pid})
        svc = _service(tmp_path, lambda: {t.task.pid, t.init, t.rank, kid}, owner=user.pw_uid,
                       criu_binary=str(userdir / "criu"))
        _refused(lambda: _svc_dump(svc), f"process {kid} of the tree of pid {t.init} runs as gid "
                                         f"{user.pw_gid}/0/0/0, not {user.pw_gid}")
        with pytest.raises(RemoteError, match=f"process {kid} of the tree of pid {t.init} runs as gid"):
            _dump(c, t, images)
        assert not _statuses(userdir, "dump"), "criu ran"
    finally:
        t.end()


def test_a_process_with_capabilities_or_group_root_is_refused(user, userdir, images, init_program):  # noqa: F811
    """Only tpass-init may hold CAP_SYS_ADMIN and group root: the same tree whose root is not
    tpass-init (``init`` false) is refused for both."""
    held = userdir / "u" / "data"
    held.write_bytes(b"x")
    os.chown(held, user.pw_uid, user.pw_gid)
    t = Tree(init_program, user, userdir, held)
    try:
        with pytest.raises(RemoteError, match=f"process {t.init} .* holds groups"):
            procs.check_tree_creds(t.init, user.pw_uid, init=False)
        assert len(procs.check_tree_creds(t.init, user.pw_uid, init=True)) == 2
        with pytest.raises(RemoteError, match="runs as uid"):
            procs.check_tree_creds(t.init, user.pw_uid + 1, init=True)
    finally:
        t.end()


@pytest.mark.parametrize("size", [100, 2 << 20])
def test_an_unlinked_held_file_is_copied_up_to_the_ghost_limit_and_recreated_by_the_owner(
        user, userdir, images, init_program, size):  # noqa: F811
    """No link-remap file is ever made: an unlinked file the rank holds is copied into the image
    (CRIU's ghost file) up to criu.GHOST_LIMIT and recreated at the restore by the owner's criu;
    a larger one fails the dump with one line, the rank left running."""
    held = userdir / "u" / "data"
    held.write_bytes(b"x" * size)
    os.chown(held, user.pw_uid, user.pw_gid)
    c = criu.find_criu(str(userdir / "criu"))
    t = Tree(init_program, user, userdir, held)
    try:
        held.unlink()
        if size > criu.GHOST_LIMIT:
            with pytest.raises(CheckpointError, match=f"rank .* holds an unlinked file larger than 1 MiB \\({held}, "
                                                      f"{size} bytes\\).*close it before a move") as err:
                _dump(c, t, images)
            assert "\n" not in str(err.value) and procs.creds_of(t.rank)  # still running
            return
        _dump(c, t, images)
        argv = _argv_of(userdir, "dump")
        assert f"--ghost-limit={criu.GHOST_LIMIT}" in argv and not any("link-remap" in a for a in argv), argv
        w = _kill_source(t)
        pid, _ = criu.restore(c, images, inherit={w: os.readlink(f"/proc/self/fd/{w}")})
        os.close(w)
        t.pidfds.append(os.pidfd_open(pid))
        t.go.touch()
        assert t.task.stdout.readline() == f"after {held} (deleted)\n".encode()
        assert not held.exists() and not [p for p in held.parent.iterdir()]  # nothing left behind
    finally:
        t.end()


def test_a_rank_holding_an_inotify_watch_is_refused_with_one_line_and_left_running(
        user, userdir, images, init_program):  # noqa: F811
    """CRIU checks a watch's file handle with open_by_handle_at, which needs CAP_DAC_READ_SEARCH, and
    the dump's criu does not get it: a tree holding an inotify watch is not dumped, and says why."""
    held = userdir / "u" / "data"
    held.write_bytes(b"x")
    os.chown(held, user.pw_uid, user.pw_gid)
    watcher = ("import ctypes, time; libc = ctypes.CDLL(None); fd = libc.inotify_init(); "
               f"assert libc.inotify_add_watch(fd, {str(userdir / 'u').encode()!r}, 2) > 0; print('watching', "
               "flush=True); time.sleep(60)")
    t = Tree(init_program, user, userdir, held, spawn=["/usr/bin/python3", "-c", watcher])
    try:
        assert t.task.stdout.readline() == b"watching\n"
        with pytest.raises(CheckpointError, match="rank 0 holds an inotify or fanotify watch, which CRIU dumps only "
                                                  "with CAP_DAC_READ_SEARCH") as err:
            _dump(c=criu.find_criu(str(userdir / "criu")), t=t, images=images)
        assert "\n" not in str(err.value) and procs.creds_of(t.rank)  # still running
    finally:
        t.end()


def _argv_of(d: Path, verb: str) -> list[str]:
    """Every argument the stand-in criu got for ``verb``."""
    return [a for p in (d / "criu.status").glob(f"*.{verb}.argv") for a in p.read_text().split()]


# As the job user (the rank's uid, no capability), against tpass-init: each way one process reads
# or takes over another. tpass-init stays dumpable, so the only thing that stops these is the
# kernel's rule that the tracer's permitted capabilities include the tracee's: tpass-init holds
# CAP_SYS_ADMIN and the user's processes do not.
PROBE = """
import ctypes, errno, os, sys
pid, libc = int(sys.argv[1]), ctypes.CDLL(None, use_errno=True)
def attempt(name, f):
    try:
        f()
        print(name, "allowed")
    except OSError as e:
        print(name, errno.errorcode.get(e.errno, e.errno))
def check(rc):
    if rc < 0:
        raise OSError(ctypes.get_errno(), "")
    return rc
def seize():
    check(libc.ptrace(0x4206, pid, 0, 0))  # PTRACE_SEIZE
    libc.ptrace(17, pid, 0, 0)  # PTRACE_DETACH
def mem():
    start = int(open(f"/proc/{pid}/maps").readline().split("-")[0], 16)
    fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    try:
        os.pread(fd, 16, start)
    finally:
        os.close(fd)
def getfd():
    pfd = os.pidfd_open(pid)
    try:
        os.close(check(libc.syscall(438, pfd, 0, 0)))  # pidfd_getfd
    finally:
        os.close(pfd)
attempt("ptrace", seize)
attempt("mem", mem)
attempt("environ", lambda: open(f"/proc/{pid}/environ", "rb").read())
attempt("fd", lambda: os.close(os.open(f"/proc/{pid}/fd/0", os.O_RDONLY)))
attempt("cwd", lambda: os.readlink(f"/proc/{pid}/cwd"))
attempt("getfd", getfd)
"""


def _probe(pid: int, u, caps: tuple[str, ...]) -> dict[str, str]:
    """PROBE run against ``pid`` as ``u`` with exactly ``caps``: {what: "allowed" or the errno}."""
    caps_arg = ",".join(["-all", *(f"+{c}" for c in caps)])
    out = subprocess.run([criu.SETPRIV, f"--reuid={u.pw_uid}", f"--regid={u.pw_gid}", "--clear-groups",
                          f"--inh-caps={caps_arg}", f"--ambient-caps={caps_arg}", "--",
                          "/usr/bin/python3", "-c", PROBE, str(pid)],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return dict(line.split() for line in out.splitlines())


def test_the_job_user_cannot_ptrace_or_read_tpass_init_which_the_dumps_criu_can(
        user, userdir, init_program):  # noqa: F811
    """tpass-init is dumpable (so the dump's criu needs no CAP_SYS_PTRACE or CAP_DAC_READ_SEARCH),
    yet the job user, whose uid it has, cannot ptrace it, read its memory, environment or fds, or
    take one of them: it would be code running with CAP_SYS_ADMIN. criu's list (as the same user)
    can, which is what the dump needs; another user cannot even with criu's list."""
    held = userdir / "u" / "data"
    held.write_bytes(b"x")
    os.chown(held, user.pw_uid, user.pw_gid)
    t = Tree(init_program, user, userdir, held)
    try:
        status = Path(f"/proc/{t.init}/status").read_text()
        assert f"Uid:\t{user.pw_uid}\t" in status and "CapPrm:\t0000000000200000" in status, status
        assert os.stat(f"/proc/{t.init}/fd").st_uid == user.pw_uid  # dumpable: its /proc is the user's
        assert _probe(t.init, user, ()) == {"ptrace": "EPERM", "mem": "EACCES", "environ": "EACCES",
                                             "fd": "EACCES", "cwd": "EACCES", "getfd": "EPERM"}
        assert set(_probe(t.init, user, DUMP).values()) == {"allowed"}
        assert _probe(t.init, pwd.getpwnam("nobody"), DUMP)["ptrace"] == "EPERM"
    finally:
        t.end()


def test_the_dump_adds_sys_ptrace_only_where_yama_confines_ptrace_to_descendants(tmp_path):
    scope = tmp_path / "ptrace_scope"
    assert criu.dump_caps(str(scope)) == criu.RESTORE_CAPS  # no Yama
    for value, extra in (("0", ()), ("1", ("sys_ptrace",)), ("2", ("sys_ptrace",))):
        scope.write_text(value + "\n")
        assert criu.dump_caps(str(scope)) == (*criu.RESTORE_CAPS, *extra)
    assert not {"dac_read_search", "dac_override", "fowner", "setuid"} & set(criu.dump_caps(str(scope)))
