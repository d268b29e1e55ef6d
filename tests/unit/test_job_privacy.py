"""A job's state directory (STATE_DIR/jobs/J) against the other users, and root's reads of it.

tpassctl knows a job by the name and the owner of jobs/J (only root makes one, in a jobs/
that is root's alone); whatever a file inside says changes nothing. Root (an admin's
tpassctl, the coordinator's stop marker) reads the files of that user-owned directory only
as plain files of the owner: a FIFO planted there must not hang it, a symlink or a hard
link must not make it read someone else's file. Each test plays the user who plants the
file, and root or another user who runs tpassctl (in-process: CliRunner, or a forked
child that became the other user). The plugin's own modes (2750, group SlurmUser) are
checked on a real job in tests/integration/test_multiuser.py.

Needs root and the users tpuser1 and tpuser2 (created if missing).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from torchpass import layout
from torchpass.coordinator.stopped import read_stopped, stopped_text
from torchpass.errors import TorchpassError
from torchpass.slurm.base import JobInfo
from tpassctl.cli import cli

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="plays root and two users: needs root")

JOB = 9
HANG_S = 10.0  # what a read of a planted FIFO would wait: forever


def _user(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True, timeout=30)
        return pwd.getpwnam(name)


@pytest.fixture(scope="module")
def owner() -> pwd.struct_passwd:
    return _user("tpuser1")


@pytest.fixture(scope="module")
def intruder() -> pwd.struct_passwd:
    return _user("tpuser2")


@pytest.fixture
def state(monkeypatch) -> Path:
    """A state directory as the plugin leaves it: jobs/ root's 0755 (in a /tmp dir others can reach)."""
    monkeypatch.setenv("SLURM_CONF", "/nonexistent/slurm.conf")  # Slurm cannot be asked: fails fast
    d = Path(tempfile.mkdtemp(prefix="tpass-privacy-", dir="/tmp"))
    os.chmod(d, 0o755)
    (d / layout.JOBS).mkdir(mode=0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _job_dir(state: Path, job: int, user: pwd.struct_passwd, mode: int = 0o755) -> Path:
    d = layout.job_dir(state, job)
    d.mkdir()
    os.chown(d, user.pw_uid, user.pw_gid)
    os.chmod(d, mode)
    return d


def _put(path: Path, text: str, user: pwd.struct_passwd) -> Path:
    path.write_text(text)
    os.chown(path, user.pw_uid, user.pw_gid)
    return path


def _tpassctl(state: Path, *args: str):
    return CliRunner().invoke(cli, ["--state-dir", str(state), *args])


def _in_thread(fn, timeout_s: float = HANG_S):
    """fn()'s result, or AssertionError if it is still running after timeout_s (blocked on a FIFO)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    return t, out


def _unblock(fifo: Path, thread: threading.Thread) -> None:
    """Let a thread blocked opening ``fifo`` go on (the test has failed already)."""
    for flags in (os.O_RDONLY | os.O_NONBLOCK, os.O_WRONLY | os.O_NONBLOCK):
        try:
            fd = os.open(fifo, flags)
        except OSError:
            continue
        thread.join(2)
        os.close(fd)
    thread.join(5)


def _as_user(user: pwd.struct_passwd, fn):
    """fn() in a forked child that is ``user`` alone: (exit_code, output) of a CliRunner result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setresgid(user.pw_gid, user.pw_gid, user.pw_gid)
            os.setresuid(user.pw_uid, user.pw_uid, user.pw_uid)
            res = fn()
            os.write(w, json.dumps([res.exit_code, res.output]).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return tuple(json.loads(data))


# --- who sees a job -----------------------------------------------------------------------------

def test_a_registration_is_keyed_by_its_directory_not_by_the_job_id_it_names(state, owner, intruder):
    """tpuser2 writes, in a job directory of their own, a registration that names tpuser1's job 9
    and a server of theirs: an admin's (root's) events, status and migrate of job 9 never reach it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.5)
    forged = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    try:
        _job_dir(state, JOB, owner)  # tpuser1's job 9: ended, its coordinator's registration gone
        _put(layout.events_json(state, JOB), json.dumps([{"seq": 1, "time": 1.7e9, "kind": "job.started",
                                                          "message": "the owner's event"}]), owner)
        _job_dir(state, 10, intruder)
        _put(layout.coordinator_json(state, 10), json.dumps({"job_id": JOB, "endpoint": forged, "pid": 1, "host": "h",
                                                             "uid": intruder.pw_uid}), intruder)
        events = _tpassctl(state, "events", str(JOB), "--json", "--timeout", "0.2")
        status = _tpassctl(state, "status", str(JOB), "--json", "--timeout", "0.2")
        migrate = _tpassctl(state, "migrate", str(JOB), "--node", "node1", "--timeout", "0.2")
        for res in (events, status, migrate):
            assert forged not in res.output, res.output
        try:
            conn, _ = listener.accept()
            conn.close()
            raise AssertionError(f"tpassctl connected to the server {forged} a registration of job 10 named")
        except TimeoutError:
            pass
        assert events.exit_code == 0 and "the owner's event" in events.output, events.output
        # job 9 has no registration of its own: ended (Slurm does not run it), not job 10's coordinator
        assert status.exit_code == 0 and json.loads(status.output)["jobs"][0]["state"] == "finished", status.output
        assert migrate.exit_code == 4 and f"job {JOB} has no torchpass coordinator registered" in migrate.output
        # In a listing, job 10's registration is job 10's (its directory), not job 9's.
        listing = _tpassctl(state, "status", "--json", "--timeout", "0.2")
        assert [j["job_id"] for j in json.loads(listing.output)["jobs"]] == [10], listing.output
    finally:
        listener.close()


def test_another_user_gets_one_line_for_a_job_running_ended_or_absent(state, owner, intruder):
    """Whatever the modes of jobs/9 (here 0755 and 0644, as an older plugin left them), tpuser2's
    status and events of tpuser1's job get the line a job id with no job gets: nothing leaks, not
    even that the job exists. The owner reads it (the control)."""
    _job_dir(state, JOB, owner)
    _put(layout.events_json(state, JOB), json.dumps([{"seq": 1, "time": 1.7e9, "kind": "job.started",
                                                      "message": "secret argv"}]), owner)
    _put(layout.coordinator_json(state, JOB), json.dumps({"job_id": JOB, "endpoint": "tcp://127.0.0.1:9", "pid": 1,
                                                          "host": "h", "uid": owner.pw_uid}), owner)

    def line(job: int) -> str:
        return json.dumps({"error": {"code": "not_found", "message": (
            f"job {job}: no torchpass job of yours with this id in {state} (only its owner or an admin "
            "can see a job; check the id and --state-dir)")}}) + "\n"

    for what in ("events", "status"):
        for job in (JOB, 4242):
            code, out = _as_user(intruder, lambda: _tpassctl(state, what, str(job), "--json", "--timeout", "0.2"))
            assert (code, out) == (4, line(job)), (what, job, out)
        code, out = _as_user(intruder, lambda: _tpassctl(state, what, "--json", "--timeout", "0.2"))
        assert code == 0 and "secret argv" not in out and f'"job_id": {JOB}' not in out, (what, out)
    code, out = _as_user(owner, lambda: _tpassctl(state, "events", str(JOB), "--json", "--timeout", "0.2"))
    assert code == 0 and "secret argv" in out, out


# --- root's reads in the user's directory --------------------------------------------------------

def test_root_reads_no_fifo_symlink_or_hard_link_as_the_stop_marker(state, owner):
    """The coordinator of a resumed job and an admin's `tpassctl resume` read jobs/J/stopped."""
    d = _job_dir(state, JOB, owner)
    marker = d / layout.STOPPED
    fields = {"snapshot": "s1", "step": 0, "snapshot_step": 5, "generation": 1, "world_size": 2, "step_offset": 0}
    os.mkfifo(marker)
    os.chown(marker, owner.pw_uid, owner.pw_gid)
    t, out = _in_thread(lambda: read_stopped(state, JOB))
    if t.is_alive():
        _unblock(marker, t)
        raise AssertionError("reading a FIFO planted as the stop marker blocked")
    assert isinstance(out.get("error"), TorchpassError) and "FIFO" in str(out["error"]), out
    marker.unlink()
    # A marker root alone can read, reached by a symlink or a hard link from the user's directory.
    secret = _put(state / "root-only", stopped_text(fields), pwd.getpwuid(0))
    os.chmod(secret, 0o600)
    for plant in (lambda: marker.symlink_to(secret), lambda: os.link(secret, marker)):
        plant()
        with pytest.raises(TorchpassError, match="symlink|uid 0"):
            read_stopped(state, JOB)
        marker.unlink()
    _put(marker, stopped_text(fields), owner)  # the control: the owner's own marker
    assert read_stopped(state, JOB) == fields


def test_root_reads_no_fifo_or_symlink_as_a_coordinator_registration(state, owner):
    d = _job_dir(state, JOB, owner)
    reg = d / layout.COORDINATOR_JSON
    os.mkfifo(reg)
    os.chown(reg, owner.pw_uid, owner.pw_gid)
    t, out = _in_thread(lambda: _tpassctl(state, "status", "--json", "--timeout", "0.2"))
    if t.is_alive():
        _unblock(reg, t)
        raise AssertionError("tpassctl status blocked on a FIFO planted as coordinator.json")
    assert out["value"].exit_code == 0 and json.loads(out["value"].output)["jobs"] == [], out["value"].output
    reg.unlink()
    # root's own file, through a symlink: not a registration of job 9 by uid 0
    rootfile = _put(state / "root.json", json.dumps({"job_id": JOB, "endpoint": "tcp://127.0.0.1:9", "pid": 1,
                                                     "host": "h", "uid": 0}), pwd.getpwuid(0))
    reg.symlink_to(rootfile)
    res = _tpassctl(state, "status", "--json", "--timeout", "0.2")
    assert res.exit_code == 0 and json.loads(res.output)["jobs"] == [], res.output


# --- tpassctl resume (an admin: root) ------------------------------------------------------------

class _HeldJob:
    """Slurm's view for resume: job 9 of ``user``, requeued and held, its output ``output``."""

    def __init__(self, user: pwd.struct_passwd, output: Path):
        self.user, self.output, self.released = user, output, []

    def job(self, job_id):
        return JobInfo(job_id=job_id, name="train", user=self.user.pw_name, user_id=self.user.pw_uid,
                       state="PENDING", nodes=(), output=str(self.output), error=str(self.output))

    def release(self, job_id):
        self.released.append(job_id)


def _stopped_job(state: Path, owner: pwd.struct_passwd, monkeypatch, output_mode: int = 0o644):
    d = _job_dir(state, JOB, owner, mode=0o2750)
    _put(d / layout.STOPPED, stopped_text({"snapshot": "s1", "step": 0, "snapshot_step": 5, "generation": 1,
                                           "world_size": 1, "step_offset": 0}), owner)
    layout.snapshot_manifests_dir(state, JOB).mkdir(mode=0o750)
    layout.snapshot_manifest(state, JOB, "s1").write_text("{}")
    output = _put(state / "slurm-9.out", "printed before the stop\n", owner)
    os.chmod(output, output_mode)
    slurm = _HeldJob(owner, output)
    monkeypatch.setattr("torchpass.slurm.client", lambda *a, **k: slurm)
    return d, slurm


def test_resume_never_opens_a_fifo_planted_in_the_job_directory(state, owner, monkeypatch):
    """The user plants a FIFO where root's copy of the output would go (the name it used:
    .stopped.out.PID of tpassctl): resume neither hangs nor writes anywhere but stopped.out."""
    d, slurm = _stopped_job(state, owner, monkeypatch)
    fifo = d / f".{layout.STOPPED_OUT}.{os.getpid()}"
    os.mkfifo(fifo)
    os.chown(fifo, owner.pw_uid, owner.pw_gid)
    t, out = _in_thread(lambda: _tpassctl(state, "resume", str(JOB), "--json"))
    if t.is_alive():
        _unblock(fifo, t)
        raise AssertionError("tpassctl resume blocked on a FIFO planted in the job's directory")
    res = out["value"]
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["notes"] == [] and slurm.released == [JOB]
    kept = d / layout.STOPPED_OUT
    assert kept.read_text() == "printed before the stop\n" and kept.stat().st_uid == owner.pw_uid
    assert sorted(p.name for p in d.iterdir() if p.name.startswith(".")) == [fifo.name]  # no temp left


def test_resume_reads_the_output_with_the_job_users_rights(state, owner, monkeypatch):
    """An admin's resume copies as the job's user: a file the user cannot read (mode 0200)
    is not copied with root's rights."""
    d, slurm = _stopped_job(state, owner, monkeypatch, output_mode=0o200)
    res = _tpassctl(state, "resume", str(JOB), "--json")
    assert res.exit_code == 0, res.output
    (note,) = json.loads(res.output)["notes"]
    assert "Permission denied" in note, note
    assert not (d / layout.STOPPED_OUT).exists() and slurm.released == [JOB]


# --- snapshot manifests (tpassd, root) -----------------------------------------------------------

def _user_in_group(name: str, group: str) -> pwd.struct_passwd:
    """A user whose primary group is the shared ``group`` (no user-private group)."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "-N", "-g", group, "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                       check=True, timeout=30)
        return pwd.getpwnam(name)


def test_a_manifest_is_the_owners_alone_when_their_primary_group_is_shared(state):
    """tpassd commits a whole-job snapshot of a user whose primary group is "users": another member
    of "users" cannot read its manifest (even where jobs/J is 0755, as an older plugin left it); the
    owner can (an ACL entry), through the same tpassctl snapshots listing."""
    from torchpass import auth, wire
    from torchpass.checkpoint import manifest as mf
    from torchpass.checkpoint.service import CheckpointService

    a, b = _user_in_group("tpshared1", "users"), _user_in_group("tpshared2", "users")
    _job_dir(state, 5, a)
    snap_dir = state / "snap"
    svc = CheckpointService(snap_dir, "n1", state_dir=state, job_owner=lambda j: a.pw_uid, wall=lambda: 1000.0)
    parts = []
    for rank in range(2):
        d = layout.snapshot_images_dir(snap_dir, 5, "s1", rank)
        d.mkdir(parents=True)
        (d / "pages-1.img").write_bytes(b"x" * 10)
        mf.write_manifest(d, {"job": 5, "rank": rank, "snapshot": "s1", "node": "n1"})
        parts.append({"rank": rank, "node": "n1", "images": str(d), "checksum": mf.checksum(d)})
    body = {"job_id": 5, "rank": 0, "op": "commit", "snapshot": "s1", "step": 1, "generation": 1, "collectives": 1,
            "keep": 2, "parts": parts}
    svc.snapshot(wire.Message("tpassd.snapshot", body), auth.Identity(uid=a.pw_uid, gid=a.pw_gid))
    path = str(layout.snapshot_manifest(state, 5, "s1"))

    def read():
        class R:  # the shape _as_user reports
            exit_code, output = 0, ""
        try:
            R.output = open(path).read()
        except OSError as exc:
            R.exit_code, R.output = 1, exc.strerror
        return R

    assert _as_user(b, read) == (1, "Permission denied")
    code, text = _as_user(a, read)
    assert code == 0 and json.loads(text)["snapshot"] == "s1", text
    code, out = _as_user(a, lambda: _tpassctl(state, "snapshots", "5", "--json"))
    assert code == 0 and [r["snapshot"] for r in json.loads(out)["snapshots"]] == ["s1"], out
