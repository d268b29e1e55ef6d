"""The privilege boundary of tpassd's checkpoint service, attacked with real processes.

tpassd is root; the rank record, the rank directory and the rank itself are
the job user's. Each test plays a user who lies in one way, and checks that
root did nothing for it (docs/migration-internals.md, "Privilege boundary").
The rank wrapper's do-no-harm fallback for ordinary users is at the end.
Needs root (tests run as root here) and the unprivileged user tpuser1
(created if missing).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from support.wait import until
from torchpass import auth, layout, wire
from torchpass.checkpoint import manifest as mf
from torchpass.checkpoint import procs, rankwrap, safeio
from torchpass.checkpoint.criu import find_criu
from torchpass.checkpoint.service import CheckpointService
from torchpass.errors import RemoteError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="plays root (tpassd) against a user: needs root")

ROOT = auth.Identity(uid=0, gid=0)
JOB, RANK = 5, 1
USER = "tpuser1"
# What the old code checked (the rank's environment): every rank here carries it, so
# only the new checks can refuse.
RANK_ENV = {"SLURM_JOB_ID": str(JOB), "TORCHPASS_JOB_ID": str(JOB), "RANK": str(RANK), "SLURM_PROCID": str(RANK)}


@pytest.fixture(scope="module")
def user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", USER], check=True, timeout=30)
        return pwd.getpwnam(USER)


@pytest.fixture
def shared_tmp():
    """A directory other users can reach (pytest's tmp_path is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="tpass-boundary-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _popen(argv, **kw) -> subprocess.Popen:
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, **RANK_ENV}, **kw)


def _stop(*ps: subprocess.Popen) -> None:
    for p in ps:
        if p.poll() is None:
            p.kill()
        p.wait()


def _recording_criu(d: Path) -> tuple[Path, Path]:
    """A criu that notes every run (as which uid) and then fails: nothing may run it."""
    calls = d / "criu.calls"
    p = d / "criu"
    p.write_text(f"#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'Version: 4.1.1'; exit 0; fi\n"
                 f"id -u >> {calls}\nexit 1\n")
    p.chmod(0o755)
    return p, calls


def _service(tmp_path: Path, pids, owner: int = 0, **kw) -> CheckpointService:
    return CheckpointService(tmp_path / "snap", "n1", state_dir=tmp_path / "state", job_owner=lambda j: owner,
                             job_pids=lambda j: set(pids()), **kw)


def _record(tmp_path: Path, rec: dict) -> Path:
    rd = layout.rank_records_dir(tmp_path / "state", JOB)
    path = layout.rank_record(rd, JOB, RANK)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec))
    return rd


def _dump(svc: CheckpointService, **extra):
    return svc.snapshot(wire.Message("tpassd.snapshot", {"job_id": JOB, "rank": RANK, "op": "dump", "generation": 1,
                                                         **extra}), ROOT)


def _refused(call, match: str) -> RemoteError:
    with pytest.raises(RemoteError, match=match) as ei:
        call()
    assert ei.value.code == "forbidden" and "\n" not in str(ei.value)
    return ei.value


# -- whose processes -------------------------------------------------------------------------
def test_dump_refuses_a_wrapper_pid_that_is_not_the_ranks_parent(tmp_path):
    rank, other = _popen(["sleep", "60"]), _popen(["sleep", "60"])
    criu, calls = _recording_criu(tmp_path)
    try:
        # Both are the job's (Slurm lists them), both the owner's: only the parent is a lie.
        _record(tmp_path, {"pid": rank.pid, "wrapper_pid": other.pid})
        svc = _service(tmp_path, lambda: {rank.pid, other.pid, os.getpid()}, criu_binary=str(criu))
        _refused(lambda: _dump(svc), f"pid {rank.pid}'s parent is {os.getpid()}, not the wrapper {other.pid}")
        assert not calls.exists() and rank.poll() is None and other.poll() is None
        assert not layout.handoff(layout.rank_records_dir(tmp_path / "state", JOB), JOB, RANK).exists()
    finally:
        _stop(rank, other)


def test_dump_and_kill_refuse_a_pid_not_owned_by_the_jobs_owner(tmp_path, user):
    rank = _popen(["sleep", "60"])  # root's process; the job belongs to tpuser1
    criu, calls = _recording_criu(tmp_path)
    try:
        _record(tmp_path, {"pid": rank.pid, "wrapper_pid": os.getpid()})
        svc = _service(tmp_path, lambda: {rank.pid, os.getpid()}, owner=user.pw_uid, criu_binary=str(criu))
        _refused(lambda: _dump(svc), f"runs as uid 0/0/0/0, not as job {JOB}'s owner \\(uid {user.pw_uid}\\)")
        kill = wire.Message("tpassd.snapshot", {"job_id": JOB, "rank": RANK, "op": "kill", "pid": rank.pid})
        _refused(lambda: svc.snapshot(kill, ROOT), "not as job")
        assert not calls.exists() and rank.poll() is None
    finally:
        _stop(rank)


def test_kill_refuses_a_pid_slurm_does_not_list_for_the_job(tmp_path):
    victim = _popen(["sleep", "60"])  # carries the job's environment, but is not the job's
    try:
        svc = _service(tmp_path, lambda: set())
        kill = wire.Message("tpassd.snapshot", {"job_id": JOB, "rank": RANK, "op": "kill", "pid": victim.pid})
        _refused(lambda: svc.snapshot(kill, ROOT), "not a process of job 5 on this node")
        time.sleep(0.1)
        assert victim.poll() is None
    finally:
        _stop(victim)


def _kill(pid: int, tasks: list) -> wire.Message:
    return wire.Message("tpassd.snapshot", {"job_id": JOB, "rank": RANK, "op": "kill", "pid": pid, "tasks": tasks})


def test_a_nodes_kill_checks_every_copy_before_it_kills_any(tmp_path):
    """One op=kill for a node's tasks: one copy that is not the job's refuses the request and
    leaves every copy paused (a rollback can still resume them); all the job's: all killed."""
    a, b, stranger = _popen(["sleep", "60"]), _popen(["sleep", "60"]), _popen(["sleep", "60"])
    try:
        svc = _service(tmp_path, lambda: {a.pid, b.pid})
        _refused(lambda: svc.snapshot(_kill(a.pid, [[2, b.pid], [3, stranger.pid]]), ROOT),
                 f"pid {stranger.pid} is not a process of job {JOB} on this node")
        time.sleep(0.1)
        assert a.poll() is None and b.poll() is None and stranger.poll() is None
        res = svc.snapshot(_kill(a.pid, [[2, b.pid]]), ROOT)
        assert (res["rank"], res["killed"]) == (RANK, True)
        assert [(t["rank"], t["pid"], t["killed"]) for t in res["tasks"]] == [(2, b.pid, True)]
        assert a.wait(5) == -9 and b.wait(5) == -9 and stranger.poll() is None
    finally:
        _stop(a, b, stranger)


@pytest.mark.parametrize("tasks", [[[2]], [[2, 1]], [[-1, 4242]], [[RANK, 4242]], "2:4242", [[2, True]]],
                         ids=["short", "pid-1", "negative-rank", "rank-twice", "not-a-list", "bool"])
def test_a_malformed_kill_list_is_refused_and_kills_nothing(tmp_path, tasks):
    a = _popen(["sleep", "60"])
    try:
        svc = _service(tmp_path, lambda: {a.pid})
        with pytest.raises(RemoteError, match="op kill") as ei:
            svc.snapshot(_kill(a.pid, tasks), ROOT)
        assert ei.value.code == "bad_request" and "\n" not in str(ei.value)
        time.sleep(0.1)
        assert a.poll() is None
    finally:
        _stop(a)


# -- whose paths ----------------------------------------------------------------------------------
def test_a_rank_dir_outside_the_jobs_own_directory_is_refused(tmp_path):
    rank = _popen(["sleep", "60"])
    criu, calls = _recording_criu(tmp_path)
    try:
        evil = tmp_path / "evil"  # a rank directory of the user's choosing, with a record that checks out
        (evil / f"job{JOB}").mkdir(parents=True)
        layout.rank_record(evil, JOB, RANK).write_text(json.dumps({"pid": rank.pid, "wrapper_pid": os.getpid()}))
        svc = _service(tmp_path, lambda: {rank.pid, os.getpid()}, criu_binary=str(criu))
        _refused(lambda: _dump(svc, rank_dir=str(evil)), f"rank_dir {evil} is not job 5's rank directory")
        abort = wire.Message("tpassd.snapshot", {"job_id": JOB, "rank": RANK, "op": "abort", "rank_dir": str(evil)})
        _refused(lambda: svc.snapshot(abort, ROOT), "is not job 5's rank directory")
        assert not calls.exists() and not layout.handoff(evil, JOB, RANK).exists()
    finally:
        _stop(rank)


def test_images_outside_the_jobs_own_snapshot_directories_are_refused(tmp_path, user, shared_tmp):
    svc = _service(tmp_path, set)
    # A snapshot-shaped directory the user owns (the path names job 5, rank 1, generation 1).
    users = shared_tmp / "u"
    d = layout.images_dir(users, JOB, RANK, 1)
    d.mkdir(parents=True)
    (d / "pages-1.img").write_bytes(b"p" * 64)
    mf.write_manifest(d, {"job": JOB, "rank": RANK})
    for p in (users, d.parent, d):
        os.chown(p, user.pw_uid, user.pw_gid)

    def verify(images):
        return svc.restore(wire.Message("tpassd.restore", {"job_id": JOB, "rank": RANK, "op": "verify",
                                                           "images": str(images)}), ROOT)

    _refused(lambda: verify(d), f"{users} is owned by uid {user.pw_uid}")
    _refused(lambda: verify("/etc"), "/etc is not a snapshot directory of rank 1 of job 5")
    _refused(lambda: verify(layout.images_dir(tmp_path / "snap", JOB + 1, RANK, 1)), "not a snapshot directory")
    _refused(lambda: verify(f"{tmp_path}/snap/job5/../job5/rank1.gen1"), "not a snapshot directory")
    abort = wire.Message("tpassd.restore", {"job_id": JOB, "rank": RANK, "op": "abort", "images": "/etc/passwd"})
    _refused(lambda: svc.restore(abort, ROOT), "not a snapshot directory")
    # The same snapshot in this tpassd's own snapshot directory is fine, and so is one in
    # another tree root alone may write (another node's snapshot_dir; /tmp above it is sticky).
    own = layout.images_dir(tmp_path / "snap", JOB, RANK, 1)
    shutil.copytree(d, own)
    assert verify(own)["files"] == 1
    roots = layout.images_dir(shared_tmp / "node2-snapshots", JOB, RANK, 1)
    shutil.copytree(d, roots)
    for p in (roots.parent.parent, roots.parent, roots):
        os.chown(p, 0, 0)
    assert verify(roots)["files"] == 1
    os.chmod(roots.parent, 0o777)  # writable by others, not sticky: a user could swap rank1.gen1
    _refused(lambda: verify(roots), "mode 777: not a root-owned directory")


# -- symlinks planted by the user ----------------------------------------------------------------
def test_a_symlink_planted_as_the_last_component_leaves_its_target_unchanged(tmp_path):
    svc = _service(tmp_path, set)
    rd = _record(tmp_path, {})
    marker = layout.handoff(rd, JOB, RANK)
    targets = [tmp_path / "precious1", tmp_path / "precious2"]
    for t in targets:
        t.write_text("precious\n")
    # The marker itself, and the temporary name a writer might use next to it.
    marker.symlink_to(targets[0])
    Path(f"{marker}.tmp").symlink_to(targets[1])
    out = svc.snapshot(wire.Message("tpassd.snapshot", {"job_id": JOB, "rank": RANK, "op": "abort"}), ROOT)
    assert out["marker"] == "abort"
    assert [t.read_text() for t in targets] == ["precious\n", "precious\n"]
    assert not marker.is_symlink() and marker.read_text() == "abort\n"  # the link was replaced, not followed


def test_a_symlink_planted_as_an_intermediate_component_leaves_its_target_unchanged(tmp_path):
    svc = _service(tmp_path, set)
    elsewhere = tmp_path / "elsewhere"  # what root must not write into
    victim = layout.handoff(elsewhere, JOB, RANK)
    victim.parent.mkdir(parents=True)
    victim.write_text("precious\n")
    ranks = layout.rank_records_dir(tmp_path / "state", JOB)
    ranks.parent.mkdir(parents=True)
    ranks.symlink_to(elsewhere)  # STATE_DIR/jobs/5/ranks -> elsewhere
    abort = wire.Message("tpassd.snapshot", {"job_id": JOB, "rank": RANK, "op": "abort"})
    _refused(lambda: svc.snapshot(abort, ROOT), "is a symlink or not a directory")
    assert victim.read_text() == "precious\n" and sorted(os.listdir(victim.parent)) == [victim.name]


# -- special files -------------------------------------------------------------------------------
def _in_time(fn, limit: float):
    """Run ``fn`` on a thread; (finished within ``limit``, its exception or result)."""
    box: list = []

    def run():
        try:
            box.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(limit)
    return (not t.is_alive(), box[0] if box else None, time.monotonic() - t0)


@pytest.mark.parametrize("kind", ["fifo", "dev_zero_node", "dev_zero_link"])
def test_a_fifo_or_dev_zero_manifest_is_answered_within_a_second(tmp_path, kind):
    svc = _service(tmp_path, set)
    d = layout.images_dir(tmp_path / "snap", JOB, RANK, 1)
    d.mkdir(parents=True)
    m = d / mf.MANIFEST
    if kind == "fifo":
        os.mkfifo(m)
    elif kind == "dev_zero_node":
        os.mknod(m, stat.S_IFCHR | 0o600, os.makedev(1, 5))
    else:
        m.symlink_to("/dev/zero")
    msg = wire.Message("tpassd.restore", {"job_id": JOB, "rank": RANK, "op": "verify", "images": str(d),
                                          "checksum": "0" * 64})
    try:
        done, got, took = _in_time(lambda: svc.restore(msg, ROOT), 1.0)
        assert done, f"verify of a {kind} manifest still running after 1 s"
        assert isinstance(got, RemoteError) and got.code == "failed", got
        assert "refused" in str(got) and "\n" not in str(got) and took < 1.0
    finally:
        if kind == "fifo":  # release a reader still blocked in open() (the old code's)
            try:
                os.close(os.open(m, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass


def test_tpassd_health_keeps_flowing_while_a_fifo_manifest_is_verified(tmp_path):
    from tpassd.daemon import Tpassd
    from tpassd.testing import call, fake_node_config, private_munged

    with private_munged() as munge:
        cfg = fake_node_config(tmp_path, "node1", munge.socket, interval_s=0.2, collector_timeout_s=0.15)
        d = layout.images_dir(cfg.snapshot_dir, JOB, RANK, 1)
        d.mkdir(parents=True)
        os.mkfifo(d / mf.MANIFEST)
        node = Tpassd(cfg)
        node.start()
        try:
            ctl = f"tcp://127.0.0.1:{node.ports()['control_port']}"
            body = {"job_id": JOB, "rank": RANK, "op": "verify", "images": str(d)}
            verify = threading.Thread(target=lambda: _in_time(
                lambda: call(ctl, "node1", "tpassd.restore", body, munge.socket, timeout_s=5.0), 6.0), daemon=True)
            verify.start()
            t0 = time.monotonic()
            for _ in range(3):
                assert call(ctl, "node1", "tpassd.health", munge_socket=munge.socket, timeout_s=1.0)
            assert time.monotonic() - t0 < 3.0
            with pytest.raises(RemoteError, match="is a FIFO; refused"):
                call(ctl, "node1", "tpassd.restore", body, munge.socket, timeout_s=1.0)
        finally:
            try:
                os.close(os.open(d / mf.MANIFEST, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
            node.stop()


def test_reads_are_capped(tmp_path):
    big = tmp_path / "big"
    big.write_bytes(b"x" * 1001)
    with pytest.raises(OSError, match="more than the 1000 allowed"):
        safeio.read_regular(big, 1000)
    assert safeio.read_regular(big, 1001) == b"x" * 1001


# -- criu in the user's mount namespace ---------------------------------------------------------
def test_a_rank_in_its_own_user_and_mount_namespace_gets_nothing_run_as_root(tmp_path, user, shared_tmp):
    """The user's wrapper and rank live in `unshare -Urm` with a bind mount over criu: root runs
    no criu at all (the old code ran `nsenter --mount -- criu` there: the user's program, as root)."""
    real = find_criu().path
    ran = shared_tmp / "ran"
    evil = shared_tmp / "evil-criu"
    evil.write_text(f"#!/bin/sh\nid -u >> {ran}\nexit 1\n")
    evil.chmod(0o755)
    os.chmod(shared_tmp, 0o777)  # the payload may note its run as any uid
    pidfile = shared_tmp / "rank.pid"
    script = (f"mount --bind {evil} {real} && sleep 60 </dev/null >/dev/null 2>&1 & "
              f"echo $! > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; wait")
    wrapper = subprocess.Popen(["unshare", "-Urm", "sh", "-c", script], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, user=user.pw_uid,
                               group=user.pw_gid, extra_groups=[], env={**os.environ, **RANK_ENV}, cwd="/")
    try:
        rank = until(lambda: pidfile.exists() and int(pidfile.read_text()), "the user's rank")
        # The bind mount is there, seen from the wrapper's mount namespace.
        until(lambda: subprocess.run(["nsenter", "-t", str(wrapper.pid), "--mount", "--", "cat", real],
                                      capture_output=True, timeout=10).stdout.startswith(b"#!/bin/sh"),
               "the bind mount over criu")
        until(lambda: procs.read_stat(rank).ppid == wrapper.pid, "the rank under its wrapper")
        _record(tmp_path, {"pid": rank, "wrapper_pid": wrapper.pid})
        svc = _service(tmp_path, lambda: {wrapper.pid, rank}, owner=user.pw_uid)
        _refused(lambda: _dump(svc), "namespace\\(s\\) of its own")
        time.sleep(0.2)
        assert not ran.exists(), f"the user's criu ran as uid {ran.read_text().split()}"
    finally:
        _stop(wrapper)


def test_scontrol_listpids_is_parsed_and_bounded_in_time():
    out = ("PID      JOBID    STEPID   LOCALID GLOBALID\n"
           "4242     5        0        0       0\n"
           "4243     5        0        -       -\n")
    seen = {}

    def run(argv, **kw):
        seen.update(argv=argv, timeout=kw.get("timeout"))
        return subprocess.CompletedProcess(argv, 0, out, "")

    assert procs.slurm_job_pids(5, run=run) == {4242, 4243}
    assert seen == {"argv": ["scontrol", "listpids", "5"], "timeout": procs.SCONTROL_TIMEOUT_S}
    assert procs.slurm_job_pids(5, run=lambda a, **k: subprocess.CompletedProcess(a, 1, "", "no job")) == set()

    def hang(argv, **kw):
        raise subprocess.TimeoutExpired(argv, kw["timeout"])

    with pytest.raises(RemoteError, match="did not answer in 10 s") as ei:
        procs.slurm_job_pids(5, run=hang)
    assert ei.value.code == "unavailable"


def test_every_request_leaves_one_audit_line(tmp_path):
    logs = _requests_with_captured_logs(_service(tmp_path, set))
    lines = [e for e in logs if e.get("event") == "privileged action"]
    assert [(e["requester_uid"], e["job_id"], e["rank"], e["pid"], e["action"], e["outcome"]) for e in lines] == [
        (0, JOB, RANK, 5_000_000, "snapshot.kill", "ok"), (0, JOB, RANK, None, "snapshot.abort", "forbidden")]


def _requests_with_captured_logs(svc) -> list[dict]:
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        svc.snapshot(wire.Message("tpassd.snapshot", {"job_id": JOB, "rank": RANK, "op": "kill", "pid": 5_000_000}),
                     auth.Identity(uid=0, gid=0))
        with pytest.raises(RemoteError):
            svc.snapshot(wire.Message("tpassd.snapshot", {"job_id": JOB, "rank": RANK, "op": "abort",
                                                          "rank_dir": "/tmp"}), ROOT)
    return logs


# -- the rank wrapper: do no harm ------------------------------------------------------------------
USER_PYTHON = "/usr/bin/python3"  # the venv's python lives under /root (0700): not the user's
_PACKAGE = Path(rankwrap.__file__).resolve().parents[1]  # torchpass/


@pytest.fixture(scope="module")
def user_pythonpath():
    """A copy of the torchpass package the user can read: the checkout may lie under a
    directory only root can enter (/root is 0700), and the wrapper needs only the stdlib."""
    d = Path(tempfile.mkdtemp(prefix="tpass-userpath-", dir="/tmp"))
    shutil.copytree(_PACKAGE, d / "torchpass", ignore=shutil.ignore_patterns("__pycache__"))
    for p in [d, *d.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    yield str(d)
    shutil.rmtree(d, ignore_errors=True)


def _as_user_wrapper(user, pythonpath: str, state_dir: Path, task: str, prefix: tuple[str, ...] = (),
                     **kw) -> subprocess.Popen:
    """The wrapper as ``user`` (setpriv execs it: its pid is the Popen's), after ``prefix`` run as root."""
    return subprocess.Popen([*prefix, "setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
                             USER_PYTHON, "-m", "torchpass.checkpoint.rankwrap", "--state-dir", str(state_dir), "--",
                             "sh", "-c", task],
                            cwd="/", env={"PATH": "/usr/bin:/bin", "PYTHONPATH": pythonpath, **RANK_ENV}, **kw)


def test_an_ordinary_user_without_a_prepared_namespace_runs_the_task_unprotected(user, user_pythonpath, shared_tmp):
    """unshare is refused (EPERM): the wrapper execs the task in its own place. Same pid as the
    task Slurm started, same stdin, same extra fds, the task's own exit code and signal."""
    state = shared_tmp / "ranks"
    r, w = os.pipe()
    # The task: a Python program that reports its pid and stdin on the inherited fd `w`.
    task = (f"exec {USER_PYTHON} -c 'import os, sys; os.write({w}, f\"pid {{os.getpid()}}\\n\".encode()); "
            f"os.write({w}, (\"got \" + sys.stdin.readline()).encode()); sys.exit(7)'")
    p = _as_user_wrapper(user, user_pythonpath, state, task, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, pass_fds=(w,))
    os.close(w)
    out, err = p.communicate(b"hello\n", timeout=30)
    with os.fdopen(r) as f:
        said = f.read().split("\n")
    assert p.returncode == 7, err
    assert said[:2] == [f"pid {p.pid}", "got hello"]
    assert err.decode().splitlines() == [f"torchpass: rank {RANK} unprotected: cannot make its PID namespace "
                                         "([Errno 1] unshare: Operation not permitted; needs root or torchpass's "
                                         "SPANK plugin); it runs without live migration"]
    assert not state.exists()  # no record: tpassd will not try to move it
    # A signal ends it as it would end the task (SIGPIPE too, which Python itself ignores).
    for sig, task in ((15, "kill -TERM $$"), (13, "yes | head -c1 >/dev/null; kill -PIPE $$")):
        p = _as_user_wrapper(user, user_pythonpath, state, task, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert p.wait(timeout=30) == -sig


def test_a_namespace_prepared_by_root_is_used_not_made_again(user, user_pythonpath, shared_tmp):
    """What the SPANK plugin does in task_init_privileged: root unshares CLONE_NEWPID, then the
    task (the wrapper, as the user) forks the rank as PID 1 of that namespace."""
    state = shared_tmp / "ranks"
    state.mkdir()
    os.chown(state, user.pw_uid, user.pw_gid)
    go = shared_tmp / "go"
    p = _as_user_wrapper(user, user_pythonpath, state, f"while [ ! -e {go} ]; do sleep 0.05; done; echo pid $$; exit 3",
                         prefix=("unshare", "--pid"), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        paths = rankwrap.Paths(str(state), str(JOB), str(RANK))
        rec = until(lambda: paths.read_record(), "the wrapper's record")
        assert rec["wrapper_pid"] == p.pid
        prepared = os.readlink(f"/proc/{p.pid}/ns/pid_for_children")
        assert os.readlink(f"/proc/{rec['pid']}/ns/pid") == prepared != os.readlink(f"/proc/{p.pid}/ns/pid")
        go.touch()
        out, err = p.communicate(timeout=30)
        assert p.returncode == 3 and out == b"pid 1\n" and b"unprotected" not in err, err
    finally:
        go.touch()
        _stop(p)


def test_the_fallback_seam_without_a_user(tmp_path):
    """make_pid_namespace with an injected refusal: exec in place, or carry on without timens."""
    said = []
    calls = []

    def refuse(flags):
        calls.append(flags)
        raise PermissionError(1, "unshare: Operation not permitted")

    # Prepared: only the optional time namespace is asked for, and its refusal is not fatal.
    rankwrap.make_pid_namespace(["true"], "2", True, unshare_fn=refuse, prepared_fn=lambda: True)
    assert calls == [rankwrap.CLONE_NEWTIME]
    rankwrap.make_pid_namespace(["true"], "2", False, unshare_fn=refuse, prepared_fn=lambda: True)
    assert calls == [rankwrap.CLONE_NEWTIME]  # nothing to make
    assert said == []
    # Not prepared: the program replaces this process (run in a child, which then is `sh`).
    code = ("import sys\nfrom torchpass.checkpoint import rankwrap as rw\n"
            "def refuse(flags): raise PermissionError(1, 'unshare: Operation not permitted')\n"
            "rw.make_pid_namespace(['sh', '-c', 'exit 5'], '4', False, unshare_fn=refuse, prepared_fn=lambda: False)\n"
            "sys.exit(99)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert p.returncode == 5 and p.stderr.startswith("torchpass: rank 4 unprotected: cannot make its PID namespace")


def test_a_prepared_namespace_whose_first_process_is_gone_runs_the_task_unprotected(tmp_path):
    """A TaskProlog (or anything) forked first into the prepared namespace and exited: no
    process can enter it again (fork: ENOMEM). The task still runs, unprotected."""
    wrapper = f"exec {sys.executable} -m torchpass.checkpoint.rankwrap --state-dir {tmp_path} -- sh -c 'exit 4'"
    p = subprocess.run(["unshare", "--pid", "sh", "-c", f"/bin/true; {wrapper}"], capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL, env={**os.environ, **RANK_ENV})
    assert p.returncode == 4, p.stderr
    assert p.stderr.splitlines() == [f"torchpass: rank {RANK} unprotected: its PID namespace is gone (fork: Cannot "
                                     "allocate memory); it runs without live migration"]
