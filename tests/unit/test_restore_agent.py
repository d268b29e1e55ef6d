"""The root restore agent trusts only Slurm and its own checks.

The agent runs as root in an ordinary user's restore step
(torchpass.checkpoint.restore_agent). Everything the user hands it (the
request file, the image path in it, the fd numbers of its pipes) is checked
before criu runs: real files, real directories, real processes; criu itself
is not needed to refuse.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from test_privilege_boundary import shared_tmp, user  # noqa: F401
from torchpass import layout
from torchpass.checkpoint import manifest as mf
from torchpass.checkpoint import restore_agent as ra

JOB, RANK, GEN = 7, 1, 3
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the agent's checks are about root-owned directories")


OWNER = 1001


def _snapshot(root: Path, job: int = JOB, rank: int = RANK, meta_job: int = JOB, meta_rank: int = RANK,
              owner: int = OWNER) -> Path:
    d = layout.images_dir(root, job, rank, GEN)
    d.mkdir(parents=True, mode=0o700)
    (d / "pages-1.img").write_bytes(b"x" * 100)
    mf.write_manifest(d, {"job": meta_job, "rank": meta_rank, "uid": owner, "fd1": "pipe:[1]", "fd2": "/dev/null",
                          "criu_creds": {"uid": owner, "gid": owner, "groups": [0, owner]}})
    return d


@root_only
def test_the_jobs_snapshot_under_a_root_owned_tree_is_accepted(tmp_path):
    d = _snapshot(tmp_path / "snap")
    path, manifest = ra.check_images(str(d), JOB, RANK, OWNER)
    assert path == d and manifest["meta"]["job"] == JOB


@root_only
def test_a_rank_of_a_whole_job_snapshot_is_accepted_and_another_ranks_refused(tmp_path):
    """A step relaunched from whole-job snapshot ID asks for SNAPSHOT_DIR/snapshots/jobJ/ID/rankR."""
    root = tmp_path / "snap"
    d = layout.snapshot_images_dir(root, JOB, "snap-7", RANK)
    d.mkdir(parents=True, mode=0o700)
    (d / "pages-1.img").write_bytes(b"x" * 100)
    mf.write_manifest(d, {"job": JOB, "rank": RANK, "uid": OWNER, "snapshot": "snap-7",
                          "criu_creds": {"uid": OWNER, "gid": OWNER, "groups": [OWNER]}})
    path, manifest = ra.check_images(str(d), JOB, RANK, OWNER)
    assert path == d and manifest["meta"]["snapshot"] == "snap-7"
    for other in (layout.snapshot_images_dir(root, JOB, "snap-7", 2),
                  layout.snapshot_images_dir(root, 8, "snap-7", RANK),
                  d.parent / ".." / "snap-7" / d.name):
        with pytest.raises(ra.Refused, match="refused"):
            ra.check_images(str(other), JOB, RANK, OWNER)
    with pytest.raises(ra.Refused, match="uid 1001, not of uid 1002"):
        ra.check_images(str(d), JOB, RANK, 1002)


@root_only
@pytest.mark.parametrize("how", ["relative", "other rank", "other job", "not a snapshot dir"])
def test_an_image_path_that_is_not_this_ranks_snapshot_is_refused(tmp_path, how):
    d = _snapshot(tmp_path / "snap")
    asked = {"relative": os.path.relpath(d), "other rank": str(layout.images_dir(tmp_path / "snap", JOB, 2, GEN)),
             "other job": str(layout.images_dir(tmp_path / "snap", 8, RANK, GEN)), "not a snapshot dir": str(tmp_path)}
    with pytest.raises(ra.Refused, match="refused"):
        ra.check_images(asked[how], JOB, RANK, OWNER)


@root_only
def test_a_manifest_of_another_job_or_rank_is_refused(tmp_path):
    """The directory name is right but the snapshot inside is another rank's (a rename by root
    error, or an old bug): the manifest decides."""
    d = _snapshot(tmp_path / "snap", meta_rank=2)
    with pytest.raises(ra.Refused, match="holds job 7 rank 2, not job 7 rank 1"):
        ra.check_images(str(d), JOB, RANK, OWNER)


@root_only
def test_a_snapshot_of_another_users_job_is_refused(tmp_path):
    """A restore step in a companion allocation names the rank's job itself (TORCHPASS_RESTORE_JOB):
    a user naming another user's job gets nothing restored."""
    d = _snapshot(tmp_path / "snap", owner=1002)
    with pytest.raises(ra.Refused, match="of a job of uid 1002, not of uid 1001"):
        ra.check_images(str(d), JOB, RANK, OWNER)


@root_only
def test_a_snapshot_under_a_user_owned_directory_is_refused(shared_tmp, user):  # noqa: F811
    """A user who owns a directory on the path could swap the images for their own choice."""
    base = shared_tmp / "mine"
    base.mkdir()
    d = _snapshot(base)
    os.chown(base, user.pw_uid, user.pw_gid)
    with pytest.raises(ra.Refused, match="not a root-owned directory"):
        ra.check_images(str(d), JOB, RANK, OWNER)


@root_only
def test_a_symlink_on_the_image_path_is_refused(tmp_path):
    real = _snapshot(tmp_path / "real")
    (tmp_path / "snap").symlink_to(tmp_path / "real")
    with pytest.raises(ra.Refused, match="symlink"):
        ra.check_images(str(layout.images_dir(tmp_path / "snap", JOB, RANK, GEN)), JOB, RANK, OWNER)
    assert real.is_dir()


def _rank_dir(state: Path) -> Path:
    d = layout.rank_job_dir(layout.rank_records_dir(state, JOB), JOB)
    d.mkdir(parents=True)
    return d


def _alive_pidfd() -> int:
    return os.pidfd_open(os.getpid())


@root_only
def test_a_request_not_written_by_the_job_user_is_refused(tmp_path, user):  # noqa: F811
    d = _rank_dir(tmp_path)
    req = ra.request_file(d, RANK, os.getpid())
    req.write_text(json.dumps({"images": "/x"}))  # root's, not the user's
    pidfd = _alive_pidfd()
    try:
        with pytest.raises(ra.Refused, match=f"not a regular file of uid {user.pw_uid}"):
            ra.wait_request(str(tmp_path), JOB, RANK, user.pw_uid, pidfd)
        req.unlink()
        req.symlink_to(tmp_path / "elsewhere")
        os.lchown(req, user.pw_uid, user.pw_gid)
        with pytest.raises(ra.Refused, match="not a regular file"):
            ra.wait_request(str(tmp_path), JOB, RANK, user.pw_uid, pidfd)
    finally:
        os.close(pidfd)


@root_only
def test_the_job_users_request_is_read(tmp_path, user):  # noqa: F811
    d = _rank_dir(tmp_path)
    req = ra.request_file(d, RANK, os.getpid())
    req.write_text(json.dumps({"images": "/x", "fds": {"1": 5}}))
    os.chown(req, user.pw_uid, user.pw_gid)
    pidfd = _alive_pidfd()
    try:
        dfd, got = ra.wait_request(str(tmp_path), JOB, RANK, user.pw_uid, pidfd)
        os.close(dfd)
    finally:
        os.close(pidfd)
    assert got == {"images": "/x", "fds": {"1": 5}}


def test_a_request_written_while_it_waits_is_found_and_no_fd_is_left(tmp_path):
    """The rank directory and then the request appear while the agent waits (a step at its gate):
    it finds the request within a few polls and keeps no descriptor but the one it returns."""
    def write_later():
        time.sleep(0.05)
        d = _rank_dir(tmp_path)
        time.sleep(0.05)
        ra.request_file(d, RANK, os.getpid()).write_text(json.dumps({"images": "/x"}))

    before = set(os.listdir("/proc/self/fd"))
    pidfd = _alive_pidfd()
    writer = threading.Thread(target=write_later)
    writer.start()
    try:
        dfd, got = ra.wait_request(str(tmp_path), JOB, RANK, os.getuid(), pidfd)
        assert got == {"images": "/x"}
        os.close(dfd)
    finally:
        writer.join()
        os.close(pidfd)
    assert set(os.listdir("/proc/self/fd")) == before


def test_the_task_waits_for_its_agents_exit_and_gives_up_at_its_deadline():
    from torchpass.checkpoint.rankwrap import wait_agent

    done = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(0.2); sys.exit(3)"])
    status = wait_agent(done.pid, 30.0)
    assert status is not None and os.waitstatus_to_exitcode(status) == 3
    done.returncode = 3  # reaped above: Popen must not wait for it again
    hung = subprocess.Popen(["sleep", "60"])
    try:
        assert wait_agent(hung.pid, 0.2) is None
    finally:
        hung.kill()
        hung.wait()


def test_the_agent_exits_when_its_task_is_gone(tmp_path):
    """A restore step called off at its gate: the task exits, the agent with it (no request ever)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    pidfd = os.pidfd_open(p.pid)
    p.wait()
    try:
        assert ra.wait_request(str(tmp_path), JOB, RANK, os.getuid(), pidfd, poll_s=0.001) is None
    finally:
        os.close(pidfd)


def test_a_task_fd_that_is_not_a_pipe_is_refused(tmp_path):
    me = os.pidfd_open(os.getpid())
    f = open(tmp_path / "plain", "w")
    try:
        with pytest.raises(ra.Refused, match="not a pipe"):
            ra.task_pipes(me, {"1": f.fileno()}, {"fd1": "pipe:[123]"})
        r, w = os.pipe()
        try:
            with pytest.raises(ra.Refused, match="not the write end"):
                ra.task_pipes(me, {"1": r}, {"fd1": "pipe:[123]"})
            got = ra.task_pipes(me, {"1": w, "2": w}, {"fd1": "pipe:[123]", "fd2": "/dev/null"})
            assert list(got.values()) == ["pipe:[123]"]  # only where the dumped rank had a pipe
            (ours,) = got
            assert os.fstat(ours).st_ino == os.fstat(w).st_ino and ours != w  # our own copy of the task's
            os.close(ours)
        finally:
            os.close(r)
            os.close(w)
    finally:
        f.close()
        os.close(me)


def test_the_result_never_follows_a_planted_symlink(tmp_path):
    d = tmp_path / "ranks"
    d.mkdir()
    target = tmp_path / "target"
    target.write_text("unchanged")
    ra.result_file(d, RANK, os.getpid()).symlink_to(target)
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(FileExistsError):
            ra.write_result(dfd, RANK, os.getuid(), {"pid": 1})
    finally:
        os.close(dfd)
    assert target.read_text() == "unchanged"


def test_the_agent_refuses_to_run_for_a_task_that_is_not_its_parent(tmp_path, capsys):
    assert ra.main(JOB, RANK, os.getpid(), os.getuid(), str(tmp_path), 0) == 2
    assert "parent is not the task" in capsys.readouterr().err


@root_only
def test_a_request_with_a_second_link_is_refused_on_the_descriptor_read(tmp_path, user):  # noqa: F811
    """The owner and link count are checked on the descriptor read, not only by the name's stat
    before: a file swapped in between, or a hard link to another file, is not what root reads."""
    d = _rank_dir(tmp_path)
    req = ra.request_file(d, RANK, os.getpid())
    req.write_text(json.dumps({"images": "/x"}))
    os.chown(req, user.pw_uid, user.pw_gid)
    os.link(req, d / "second")
    pidfd = _alive_pidfd()
    try:
        with pytest.raises(ra.Refused, match="with one link"):
            ra.wait_request(str(tmp_path), JOB, RANK, user.pw_uid, pidfd)
    finally:
        os.close(pidfd)


def test_the_agent_restores_only_the_images_its_token_names():
    """The plugin passes what the token names (--generation G or --snapshot ID): a request for any
    other images, however valid, is refused before anything is read."""
    dump = str(layout.images_dir("/snap", JOB, RANK, 3))
    part = str(layout.snapshot_images_dir("/snap", JOB, "s1", RANK))
    ra.allowed_images(dump, JOB, RANK, 3, None)
    ra.allowed_images(part, JOB, RANK, None, "s1")
    for images, gen, snap in [(str(layout.images_dir("/snap", JOB, RANK, 2)), 3, None),  # another generation
                              (part, 3, None),  # a snapshot for a migration's token
                              (dump, None, "s1"),  # a dump for a snapshot's token
                              (str(layout.snapshot_images_dir("/snap", JOB, "s2", RANK)), None, "s1"),
                              (str(layout.images_dir("/snap", JOB, RANK + 1, 3)), 3, None),
                              ("relative/rank0.gen3", 3, None)]:
        with pytest.raises(ra.Refused):
            ra.allowed_images(images, JOB, RANK, gen, snap)


def test_the_agent_needs_the_images_its_token_names(tmp_path, capsys):
    assert ra.main(JOB, RANK, os.getppid(), os.getuid(), str(tmp_path)) == 2
    assert "one of --generation --snapshot" in capsys.readouterr().err


@root_only
def test_a_users_snapshot_not_dumped_as_the_user_is_refused(tmp_path):
    """A manifest without the dump's criu credentials (or with root's) would have criu restore an
    ordinary user's tree as root: refused before criu runs."""
    d = layout.images_dir(tmp_path / "snap", JOB, RANK, GEN)
    d.mkdir(parents=True, mode=0o700)
    (d / "pages-1.img").write_bytes(b"x" * 100)
    for creds in (None, {"uid": 0, "gid": 0, "groups": [0]}):
        meta = {"job": JOB, "rank": RANK, "uid": OWNER, **({"criu_creds": creds} if creds else {})}
        mf.write_manifest(d, meta)
        with pytest.raises(ra.Refused, match=f"was not dumped as uid {OWNER}"):
            ra.check_images(str(d), JOB, RANK, OWNER)


def test_the_agent_is_a_program_of_its_own_that_takes_only_the_plugins_arguments(capsys):
    """tpass-restore-agent (not a mode of the user-side rank wrapper): the job, rank, task, uid and
    state directory, and exactly one of the token's generation or snapshot."""
    base = ["--job", str(JOB), "--rank", str(RANK), "--task-pid", "1", "--uid", "0", "--jobs-state-dir", "/s"]
    for argv in ([], base, [*base, "--generation", "3", "--snapshot", "s1"]):
        with pytest.raises(SystemExit) as exc:
            ra.cli(argv)
        assert exc.value.code == 2
    assert "one of the arguments --generation --snapshot is required" in capsys.readouterr().err
    # its parent is not task 1: the agent exits at once, before it reads anything
    assert ra.cli([*base, "--generation", "3"]) == 2
    assert "my parent is not the task 1" in capsys.readouterr().err
