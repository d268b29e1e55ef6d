"""Several ranks of one node dumped at once, and the working directory
that makes it possible.

CRIU's parasite, inside the root of each dumped tree (tpass-init, PID 1 of the
rank's namespace, whose /proc is the node's), makes and mounts a directory of
one fixed name, ``proc.crtools``, in that process's cwd. With /tmp as every
tpass-init's cwd, two dumps at once collided there ("Can't create a directory
(-17)") and the move rolled back. Each tpass-init now has a directory of its
own; the dump records it in the manifest and a restore on a node that lacks
it makes it (torchpass.checkpoint.criu).

Trees are made as test_tpass_init.py makes them (a root job: what the SPANK
plugin's task_init_privileged does); real CRIU dumps them.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from test_privilege_boundary import RANK_ENV, USER_PYTHON
from test_rankwrap_transparent import _record
from test_tpass_init import PLUGIN, init_program  # noqa: F401
from torchpass.checkpoint import criu, manifest
from torchpass.errors import CheckpointError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="tpass-init is started by root, and root dumps here")
NOBODY = 65534
TASK = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]):\n    time.sleep(0.05)\n"


class Trees:
    """``n`` rank tasks, each a tree rooted at its own tpass-init (as ``uid``), waiting for ``go``."""

    def __init__(self, init: Path, tmp: Path, n: int, uid: int = 0):
        self.go = tmp / "go"
        rank = [sys.executable, "-c", TASK, str(self.go)]
        if uid:  # the rank is the user's too (a tree of one owner, as in a job), running a python the user
            # can reach: the dump's criu, as the user, stats each mapped file by path
            rank = ["setpriv", f"--reuid={uid}", f"--regid={uid}", f"--groups={uid}",  # as initgroups gives
                    USER_PYTHON, *rank[1:]]
        self.tasks, self.roots, self.pidfds = [], [], []
        for i in range(n):
            state = tmp / f"task{i}"
            state.mkdir()
            p = subprocess.Popen([sys.executable, "-c", PLUGIN, str(init), str(uid), str(state), *rank],
                                 env={**os.environ, **RANK_ENV},
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            self.tasks.append(p)
            root = _record(state, p)["pid"]
            self.roots.append(root)
            self.pidfds.append(os.pidfd_open(root))

    def cwd(self, i: int) -> str:
        return os.readlink(f"/proc/{self.roots[i]}/cwd")

    def end(self) -> list[int]:
        """Let the ranks go; a root still there after 10 s is killed (its namespace with it)."""
        if not self.pidfds:  # ended already
            return [p.wait() for p in self.tasks]
        self.go.touch()
        for fd in self.pidfds:
            if not select.select([fd], [], [], 10)[0]:  # readable once the process ended
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            os.close(fd)
        self.pidfds = []
        codes = []
        for p in self.tasks:
            try:
                codes.append(p.wait(timeout=30))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        return codes


@pytest.fixture
def trees(tmp_path, init_program):  # noqa: F811
    made: list[Trees] = []

    def make(n: int, uid: int = 0, tmp: Path | None = None) -> Trees:
        made.append(Trees(init_program, tmp or tmp_path, n, uid))
        return made[-1]

    yield make
    for t in made:
        t.end()


def test_each_tpass_init_works_in_a_directory_of_its_own_removed_with_it(trees):
    t = trees(3)
    cwds = [t.cwd(i) for i in range(3)]
    # before: /tmp for all (the collision)
    assert len(set(cwds)) == 3 and "/tmp" not in cwds, cwds
    for d in cwds:
        st = os.lstat(d)
        assert stat.S_ISDIR(st.st_mode) and (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o770)
        assert os.path.dirname(d) == criu.TPASS_INIT_BASE  # a restore makes it where missing
    assert t.end() == [0, 0, 0]
    assert not any(os.path.lexists(d) for d in cwds)  # the rank ended: its tpass-init removed it


def _as_nobody(fn) -> int:
    """errno of ``fn()`` in a child running as nobody with no groups (0: it succeeded)."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
            fn()
        except OSError as exc:
            code = exc.errno or 255
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_users_rank_cannot_touch_tpass_inits_directory_and_is_still_dumped(trees, tmp_path):
    """CRIU's parasite makes proc.crtools in tpass-init's cwd and mounts a proc there by path with
    tpass-init's CAP_SYS_ADMIN: a rank able to write that directory could swap the name for a
    symlink in between and have root mount over (or detach) any path of the node. The user's
    processes can neither enter nor change it; tpass-init (group root) can, so the dump works."""
    base = Path(tempfile.mkdtemp(prefix="tpass-test-"))  # the rank (nobody) reads its go file here
    base.chmod(0o755)
    t = trees(1, uid=NOBODY, tmp=base)
    cwd = t.cwd(0)
    groups = Path(f"/proc/{t.roots[0]}/status").read_text().split("Groups:")[1].split("\n")[0].split()
    assert sorted(groups) == sorted(["0", str(NOBODY)]), groups  # the job's groups, and root's for the cwd
    import errno
    assert _as_nobody(lambda: os.mkdir(os.path.join(cwd, criu.CRIU_PROC_DIR))) == errno.EACCES
    assert _as_nobody(lambda: os.listdir(criu.TPASS_INIT_BASE)) == errno.EACCES
    assert _as_nobody(lambda: os.symlink("/etc", os.path.join(cwd, criu.CRIU_PROC_DIR))) == errno.EACCES
    res = criu.dump(criu.find_criu(), t.roots[0], tmp_path / "images", creds=criu.owner_creds(t.roots[0]))
    assert isinstance(res, criu.DumpResult) and not os.path.lexists(os.path.join(cwd, criu.CRIU_PROC_DIR))
    assert t.end() == [0]
    assert not os.path.lexists(cwd)  # tpass-init, not root, removed its directory: group root can
    shutil.rmtree(base)


def _dump_all(c: criu.Criu, roots: list[int], tmp: Path) -> list[criu.DumpResult | CheckpointError]:
    out: list = [None] * len(roots)

    def one(i: int) -> None:
        try:
            out[i] = criu.dump(c, roots[i], tmp / f"images{i}")
        except CheckpointError as exc:
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(roots))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    return out


def test_a_nodes_ranks_dump_at_once_and_a_collision_stays_with_its_own_rank(trees, tmp_path):
    """Three trees dumped at the same time, as tpassd dumps a node's ranks. Rank 0's cwd holds a
    fresh proc.crtools (what a parasite of another dump in the same cwd holds): its dump fails
    with CRIU's EEXIST, the cause of the rolled-back moves, and the others' do not."""
    c = criu.find_criu()
    t = trees(3)
    assert len({t.cwd(i) for i in range(3)}) == 3  # (never plant in a shared /tmp)
    planted = Path(t.cwd(0)) / criu.CRIU_PROC_DIR
    planted.mkdir()
    res = _dump_all(c, t.roots, tmp_path)
    assert isinstance(res[0], CheckpointError) and "Can't create a directory (-17)" in str(res[0]), res[0]
    for i in (1, 2):
        assert isinstance(res[i], criu.DumpResult), res[i]
        assert res[i].manifest["meta"]["cwd"] == {"path": t.cwd(i), "uid": 0, "gid": 0, "mode": 0o770}
        manifest.verify_manifest(res[i].images)
    # one left by a CRIU killed half way (older than a live parasite's) no longer blocks the rank
    old = time.time() - 2 * criu.STALE_PROC_DIR_S
    os.utime(planted, (old, old))
    assert isinstance(criu.dump(c, t.roots[0], tmp_path / "again"), criu.DumpResult)
    assert not planted.exists()
    assert t.end() == [0, 0, 0]  # every tree was left running


def test_a_fresh_proc_dir_is_left_alone_and_a_stale_one_removed(tmp_path):
    """A live parasite's proc.crtools is microseconds old: never touched; a stale one is."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    sleeper = subprocess.Popen(["sleep", "60"], cwd=cwd)
    try:
        d = cwd / criu.CRIU_PROC_DIR
        d.mkdir()
        now = time.time()
        assert not criu.clear_stale_proc_dir(sleeper.pid, now=lambda: now) and d.is_dir()
        (d / "x").touch()  # not empty: not CRIU's
        later = lambda: now + 2 * criu.STALE_PROC_DIR_S  # noqa: E731
        assert not criu.clear_stale_proc_dir(sleeper.pid, now=later) and d.is_dir()
        (d / "x").unlink()
        os.utime(d, (now, now))
        assert criu.clear_stale_proc_dir(sleeper.pid, now=later) and not d.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def _restoring_criu(tmp_path: Path, watch: Path, restored: int) -> criu.Criu:
    """A criu whose "restore" notes whether ``watch`` exists, writes ``restored`` (a child of the
    caller, as criu's restored root is of its subreaper) to --pidfile."""
    p = tmp_path / "criu"
    p.write_text(f"#!/bin/sh\nstat -c '%u %g %a' {watch} > {tmp_path}/seen 2>&1\n"
                 "while [ \"$1\" != --pidfile ]; do shift; done\n"
                 f"echo {restored} > \"$2\"\n")
    p.chmod(0o755)
    return criu.Criu(str(p), (4, 1))


def test_restore_makes_the_recorded_working_directory_before_criu_runs(tmp_path, monkeypatch):
    """tpass-init's directory is in the node-local /run of the node it started on: on the spare
    CRIU's restore would find no cwd. It is made there first, root:root 0770 as tpass-init makes
    it, whatever owner and mode the record names."""
    base = tmp_path / "torchpass-init"
    monkeypatch.setattr(criu, "TPASS_INIT_BASE", str(base))
    cwd = base / "abc123"
    d = tmp_path / "snap"
    d.mkdir()
    (d / "core-1.img").write_bytes(b"x" * 100)
    manifest.write_manifest(d, {"cwd": {"path": str(cwd), "uid": NOBODY, "gid": NOBODY, "mode": 0o777}})
    sleeper = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        pid, _s = criu.restore(_restoring_criu(tmp_path, cwd, sleeper.pid), d)
        assert pid == sleeper.pid
    finally:
        sleeper.kill()
        sleeper.wait()
    assert (tmp_path / "seen").read_text().split() == ["0", "0", "770"]


def test_the_recorded_directory_is_made_only_as_a_new_leaf_of_tpass_inits_base(tmp_path, monkeypatch):
    base = tmp_path / "torchpass-init"
    monkeypatch.setattr(criu, "TPASS_INIT_BASE", str(base))
    rec = lambda p: {"path": str(p), "uid": NOBODY, "gid": NOBODY, "mode": 0o777}  # noqa: E731
    assert criu.recreate_cwd(rec(base / "new"))
    st = os.lstat(base / "new")
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o770)
    # already there: left as it is
    (base / "have").mkdir(mode=0o755)
    assert not criu.recreate_cwd(rec(base / "have")) and stat.S_IMODE(os.lstat(base / "have").st_mode) == 0o755
    # anywhere but one new component right in the base: refused, whoever owns it
    (tmp_path / "users").mkdir()
    os.chown(tmp_path / "users", NOBODY, NOBODY)
    (base / "real").mkdir()
    (base / "link").symlink_to(base / "real")
    for path in (tmp_path / "users" / "x", tmp_path / "x", base / "link" / "x", base / "real" / "x",
                 base / "missing" / "x", f"{base}/../x", f"{base}/.", f"{base}/..", f"{base}/"):
        assert not criu.recreate_cwd(rec(path)), path
    assert not criu.recreate_cwd(None) and not criu.recreate_cwd({"path": 3})
    assert not (tmp_path / "users" / "x").exists() and not (base / "real" / "x").exists()
    assert not (tmp_path / "x").exists()


def test_tpass_inits_base_is_made_roots_with_group_root_0770_never_through_a_symlink(tmp_path):
    """A spare where no rank ever started lacks TPASS_INIT_BASE: the restore makes it as tpass-init
    does (the parasite mounts by path there with CAP_SYS_ADMIN: no user may change it)."""
    base = tmp_path / "torchpass-init"
    assert criu.make_tpass_init_base(str(base))
    st = os.lstat(base)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o770)
    base.chmod(0o777)  # an older or hand-made one is put right
    assert criu.make_tpass_init_base(str(base)) and stat.S_IMODE(os.lstat(base).st_mode) == 0o770
    users = tmp_path / "users"
    users.mkdir()
    os.chown(users, NOBODY, NOBODY)
    assert not criu.make_tpass_init_base(str(users / "torchpass-init"))
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "torchpass-init").symlink_to(theirs)
    assert not criu.make_tpass_init_base(str(tmp_path / "x" / "torchpass-init"))
    assert os.lstat(theirs).st_uid == NOBODY and stat.S_IMODE(os.lstat(theirs).st_mode) != 0o770
