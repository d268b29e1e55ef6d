"""A move rolled back after its restore succeeded (the second move of a rank).

The rank moved node2 -> node3 once (its first task wrapper, the one Slurm
tracks, waits for the moved rank's exit code); it is moved again node3 ->
node4 and that move is called off after node4's restore succeeded (the kill
of the source failed). Real processes and the real shared files: the first
task wrapper runs `python -m torchpass.checkpoint.rankwrap` (its own PID
namespace: needs root), the restored copies run rankwrap's own take_over /
finish_restored around a real child process, and tpassd's CheckpointService
does the kill, the abort and the hand-off markers as the coordinator asks
for them. Only CRIU is left out (the markers the dump sets are set the same
way by hand; tests/integration covers the dump itself).
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.wait import until
from torchpass import auth, layout, wire
from torchpass.checkpoint import rankwrap as rw
from torchpass.checkpoint.criu import tree_pids
from torchpass.checkpoint.service import CheckpointService
from torchpass.errors import RemoteError

ROOT = auth.Identity(uid=0, gid=0)
JOB, RANK = 5, 1
ENV = {**os.environ, "TORCHPASS_JOB_ID": str(JOB), "RANK": str(RANK)}

# A restored copy: what `rankwrap --restore` does once CRIU has brought the rank
# back (take over the record, wait for the rank, report or not), with a plain
# child process as the rank.
COPY = """
import subprocess, sys
from torchpass.checkpoint import rankwrap as rw
state_dir, images, go = sys.argv[1:4]
paths = rw.Paths(state_dir, "5", "1")
rank = subprocess.Popen(["sh", "-c", f"while [ ! -e {go} ]; do sleep 0.05; done"])
rw.take_over(paths, "5", "1", rank.pid, images, {"job": 5, "rank": 1}, 0.1)
sys.exit(rw.finish_restored(paths, images, rw.Relay({}).wait(rank.pid)))
"""


# A restore and its record take seconds on a loaded machine.
_until = functools.partial(until, timeout_s=30.0)


def _copy(state_dir: Path, images: str, go: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", COPY, str(state_dir), images, str(go)], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _mark(rank_dir: Path, text: str) -> None:
    """What the dump sets (CRIU is left out here)."""
    layout.handoff(rank_dir, JOB, RANK).write_text(text + "\n")


def _service(tmp_path: Path, procs: list[subprocess.Popen]) -> CheckpointService:
    """tpassd's service; Slurm's view of the job on this node: the test's wrappers and their trees."""
    return CheckpointService(tmp_path / "snap", socket.gethostname(), state_dir=tmp_path / "state",
                             job_owner=lambda j: 0,
                             job_pids=lambda j: {p for w in procs for p in tree_pids(w.pid)})


@pytest.mark.skipif(os.geteuid() != 0, reason="the task wrapper's PID namespace needs root")
def test_rolled_back_second_move_gives_the_rank_back_and_its_137_is_never_the_ranks_exit(tmp_path):
    rd = layout.rank_records_dir(tmp_path / "state", JOB)
    paths = rw.Paths(str(rd), str(JOB), str(RANK))
    procs: list[subprocess.Popen] = []
    svc = _service(tmp_path, procs)
    body = {"job_id": JOB, "rank": RANK, "rank_dir": str(rd)}
    go1, go3, go4 = tmp_path / "go1", tmp_path / "go3", tmp_path / "go4"
    img1, img2 = str(tmp_path / "snap/job5/rank1.gen1"), str(tmp_path / "snap/job5/rank1.gen2")
    try:
        # The training step's task wrapper on "node2".
        w1 = subprocess.Popen([sys.executable, "-m", "torchpass.checkpoint.rankwrap", "--state-dir", str(rd), "--",
                               "sh", "-c", f"while [ ! -e {go1} ]; do sleep 0.05; done"], env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        procs.append(w1)
        first = _until(lambda: paths.read_record().get("wrapper_pid") == w1.pid and paths.read_record(),
                       "the task wrapper's record")

        # Move 1 (node2 -> node3) succeeds: dumped, restored, source killed.
        _mark(rd, "moving")
        _mark(rd, "moved")
        c3 = _copy(rd, img1, go3)
        procs.append(c3)
        _until(lambda: paths.read_record().get("restored_from") == img1, "the first restore's record")
        res = svc.snapshot(wire.Message("tpassd.snapshot", {**body, "op": "kill", "pid": first["pid"]}), ROOT)
        assert res["killed"] is True
        time.sleep(0.5)
        assert w1.poll() is None, "the task wrapper must wait for the moved rank's exit code"
        third = paths.read_record()

        # Move 2 (node3 -> node4): restored on node4, then called off (the kill of the
        # node3 copy failed): tpassd.restore op=abort on node4, then the hand-off is
        # marked aborted on node3 (ResumeInPlace).
        _mark(rd, "moving")
        _mark(rd, "moved")
        c4 = _copy(rd, img2, go4)
        procs.append(c4)
        fourth = _until(lambda: paths.read_record().get("restored_from") == img2 and paths.read_record(),
                        "the second restore's record")
        assert fourth["previous"]["wrapper_pid"] == c3.pid
        res = svc.restore(wire.Message("tpassd.restore", {**body, "op": "abort", "images": img2}), ROOT)
        assert res["killed"] is True and res["record"] == "previous"
        assert c4.wait(timeout=30) == 0
        assert "was called off" in c4.stderr.read()
        svc.snapshot(wire.Message("tpassd.snapshot", {**body, "op": "abort"}), ROOT)

        # (b) The record names the node3 copy again: a later move finds the rank there.
        rec = paths.read_record()
        assert (rec["wrapper_pid"], rec["pid"], rec["restored_from"]) == (c3.pid, third["pid"], img1)
        # (a) The aborted copy's 137 reached nobody: no exit code, the task wrapper waits on.
        assert not paths.exit.exists()
        time.sleep(0.5)
        assert w1.poll() is None

        # Training ends on node3: its exit code (0) is the rank's, and the task wrapper's.
        go3.touch()
        assert c3.wait(timeout=30) == 0
        assert json.loads(paths.exit.read_text())["wrapper_pid"] == c3.pid
        assert w1.wait(timeout=30) == 0, w1.stderr.read()
    finally:
        for p in (go1, go3, go4):
            p.touch()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="the task wrapper's PID namespace needs root")
def test_rolled_back_first_move_gives_the_rank_back_to_its_task_wrapper(tmp_path):
    """The first move called off after its restore: the record is the task wrapper's again, and
    the rank's own exit (here 3) is what the task wrapper reports, not the aborted copy's 137."""
    rd = layout.rank_records_dir(tmp_path / "state", JOB)
    paths = rw.Paths(str(rd), str(JOB), str(RANK))
    procs: list[subprocess.Popen] = []
    svc = _service(tmp_path, procs)
    body = {"job_id": JOB, "rank": RANK, "rank_dir": str(rd)}
    go1, go3 = tmp_path / "go1", tmp_path / "go3"
    img1 = str(tmp_path / "snap/job5/rank1.gen1")
    try:
        w1 = subprocess.Popen([sys.executable, "-m", "torchpass.checkpoint.rankwrap", "--state-dir", str(rd), "--",
                               "sh", "-c", f"while [ ! -e {go1} ]; do sleep 0.05; done; exit 3"], env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        procs.append(w1)
        first = _until(lambda: paths.read_record().get("wrapper_pid") == w1.pid and paths.read_record(),
                       "the task wrapper's record")
        _mark(rd, "moving")
        _mark(rd, "moved")
        c3 = _copy(rd, img1, go3)
        procs.append(c3)
        _until(lambda: paths.read_record().get("restored_from") == img1, "the restore's record")
        res = svc.restore(wire.Message("tpassd.restore", {**body, "op": "abort", "images": img1}), ROOT)
        assert res["killed"] is True
        assert c3.wait(timeout=30) == 0 and not paths.exit.exists()
        svc.snapshot(wire.Message("tpassd.snapshot", {**body, "op": "abort"}), ROOT)
        rec = paths.read_record()
        assert (rec["wrapper_pid"], rec["pid"], rec.get("restored_from")) == (w1.pid, first["pid"], None)
        go1.touch()
        assert w1.wait(timeout=30) == 3
    finally:
        for p in (go1, go3):
            p.touch()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_exit_code_counts_only_from_the_copy_the_record_names(tmp_path):
    paths = rw.Paths(str(tmp_path), "5", "1")
    host = socket.gethostname()
    rw.write_json(paths.record, {"wrapper_pid": 11, "node": host, "restored_from": "/i/gen1"})
    assert paths.read_exit() is None
    paths.exit.parent.mkdir(parents=True, exist_ok=True)
    paths.exit.write_text(json.dumps({"code": 137, "wrapper_pid": 22, "node": host, "restored_from": "/i/gen2"}))
    assert paths.read_exit() is None  # an aborted copy's
    paths.exit.write_text(json.dumps({"code": 0, "wrapper_pid": 11, "node": host, "restored_from": "/i/gen1"}))
    assert paths.read_exit() == 0
    rw.write_json(paths.record, {"wrapper_pid": 11, "node": host, "restored_from": "/i/gen1", "aborted": True})
    assert paths.read_exit() is None
    paths.exit.write_text("7\n")  # the plain form (a wrapper that does not name itself)
    assert paths.read_exit() == 7


def test_abort_without_a_saved_record_marks_the_copy_aborted(tmp_path):
    gone = 5_000_000  # above any pid_max: never a real process
    svc = CheckpointService(tmp_path / "snap", "n4", state_dir=tmp_path / "state", job_owner=lambda j: 0,
                            job_pids=lambda j: {gone})
    rd = layout.rank_records_dir(tmp_path / "state", 5)
    rec_path = layout.rank_record(rd, 5, 1)
    rec_path.parent.mkdir(parents=True)
    img, other = str(layout.images_dir("/s", 5, 1, 1)), str(layout.images_dir("/s", 5, 1, 2))
    rec_path.write_text(json.dumps({"wrapper_pid": 9, "pid": gone, "node": "n4", "restored_from": img}))
    body = {"job_id": 5, "rank": 1, "rank_dir": str(rd), "images": img}
    # Another copy's images: nothing is touched.
    res = svc.restore(wire.Message("tpassd.restore", {**body, "op": "abort", "images": other}), ROOT)
    assert res["killed"] is False and "aborted" not in json.loads(rec_path.read_text())
    res = svc.restore(wire.Message("tpassd.restore", {**body, "op": "abort"}), ROOT)
    assert res["record"] == "aborted" and json.loads(rec_path.read_text())["aborted"] is True


def test_kill_fail_drill_refuses_one_kill(tmp_path):
    from tpassd.drills import Drills
    from tpassd.policy import Policy

    drills = Drills(None, tmp_path / "sys", Policy(), enabled=True)
    gone = 5_000_000
    svc = CheckpointService(tmp_path / "snap", "n3", job_owner=lambda j: 0, job_pids=lambda j: {gone},
                            kill_fault=drills.take_kill_fault)
    msg = wire.Message("tpassd.snapshot", {"job_id": 5, "rank": 1, "op": "kill", "pid": gone})
    assert "refused" in drills.apply("kill-fail").description
    with pytest.raises(RemoteError, match="kill-fail"):
        svc.snapshot(msg, ROOT)
    assert svc.snapshot(msg, ROOT)["killed"] is False  # one-shot: the next kill goes through
    drills.apply("kill-fail")
    assert "kill-fail disarmed" in drills.apply("clear").description
    assert svc.snapshot(msg, ROOT)["killed"] is False


def test_kill_fail_drill_refuses_a_nodes_kill_before_killing_any(tmp_path):
    """The drill refuses the whole request for a node's tasks: no copy of the node dies, so the
    rollback that follows resumes the job as it stood (with one kill per task, the copies
    killed before the refusal left the job stuck)."""
    from tpassd.drills import Drills
    from tpassd.policy import Policy

    copies = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    try:
        drills = Drills(None, tmp_path / "sys", Policy(), enabled=True)
        svc = CheckpointService(tmp_path / "snap", "n3", job_owner=lambda j: 0,
                                job_pids=lambda j: {c.pid for c in copies}, kill_fault=drills.take_kill_fault)
        msg = wire.Message("tpassd.snapshot", {"job_id": 5, "rank": 1, "op": "kill", "pid": copies[0].pid,
                                               "tasks": [[2, copies[1].pid], [3, copies[2].pid]]})
        drills.apply("kill-fail")
        with pytest.raises(RemoteError, match="kill-fail on n3: the source copies of ranks 1, 2, 3 were not killed"):
            svc.snapshot(msg, ROOT)
        time.sleep(0.1)
        assert [c.poll() for c in copies] == [None, None, None]
        res = svc.snapshot(msg, ROOT)
        assert res["killed"] is True and [t["killed"] for t in res["tasks"]] == [True, True]
        assert [c.wait(5) for c in copies] == [-9, -9, -9]
    finally:
        for c in copies:
            c.kill()
            c.wait()


def test_a_second_restore_of_the_same_snapshot_keeps_the_copy_the_move_started_from(tmp_path):
    """The first target was lost before its copy could be called off (its record stayed): the
    restore on the next spare must still remember the source copy, not the lost one."""
    paths = rw.Paths(str(tmp_path), "5", "1")
    source = {"wrapper_pid": 30, "pid": 31, "node": "node3", "restored_from": "/s/rank1.gen1"}
    rw.write_json(paths.record, {"wrapper_pid": 40, "pid": 41, "node": "node4", "restored_from": "/s/rank1.gen2",
                                 "previous": source})
    rw.take_over(paths, "5", "1", 51, "/s/rank1.gen2", {}, 0.1)
    rec = paths.read_record()
    assert (rec["pid"], rec["previous"]) == (51, source)
    rw.take_over(paths, "5", "1", 61, "/s/rank1.gen3", {}, 0.1)  # a later move: the previous is this copy
    assert paths.read_record()["previous"]["pid"] == 51


def test_tpass_rankwrap_defaults_to_the_jobs_shared_rank_directory():
    """The SPANK plugin starts `tpass-rankwrap` without --state-dir: the job's STATE_DIR/jobs/J/ranks,
    exported so the rank (and a wrapper it starts) sees the same."""
    env = {"TORCHPASS_STATE_DIR": "/s", "TORCHPASS_JOB_ID": "7"}
    assert rw.default_state_dir(env) == "/s/jobs/7/ranks" == env["TORCHPASS_RANK_STATE_DIR"]
    assert rw.default_state_dir({**env, "TORCHPASS_RANK_STATE_DIR": "/r"}) == "/r"
    assert rw.default_state_dir({"TORCHPASS_JOB_ID": "7"}) == "/run/torchpass/ranks"
