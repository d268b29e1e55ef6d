"""A node a rank moved away from leaves the job: the decisions, pure.

- source_release.release_blocker: whether the coordinator may remove the node (Slurm kills a
  step's tasks on a removed node, so only a node none of whose tasks still runs may go).
- moved_exit.leave_source: when the moved rank's launch wrapper may leave the source node.
- moved_exit.moved_rank_end / srun_code / collect: the exit code srun then exits with.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from torchpass import layout
from torchpass.checkpoint import moved_exit as mx
from torchpass.coordinator.source_release import Hold, release_blocker
from torchpass.slurm.base import JobInfo, StepInfo

JOB = 7


def _job(nodes=("node1", "node2", "node3", "node4"), batch="node1", state="RUNNING") -> JobInfo:
    return JobInfo(job_id=JOB, name="train", user="u", user_id=1000, state=state, nodes=tuple(nodes),
                   batch_host=batch)


TRAIN = StepInfo(step_id=f"{JOB}.0", name="python", nodes=("node1", "node2", "node3"), state="RUNNING")
RESTORE = StepInfo(step_id=f"{JOB}.1", name="torchpass-restore-1", nodes=("node4",), state="RUNNING")
LEFT = mx.Released(rank="1", step="0", node="node2", wrapper_pid=4242, code=137)
# rank 1 now runs on node4; ranks 0 and 2 where they started
RECORDS = {"0": {"node": "node1"}, "1": {"node": "node4", "restored_from": "/img"}, "2": {"node": "node3"}}


def test_a_node_whose_moved_rank_wrapper_left_is_released():
    assert release_blocker("node2", JOB, _job(), [TRAIN, RESTORE], [LEFT], RECORDS, settled=["1"]) is None


def test_without_a_released_record_the_training_steps_task_keeps_the_node():
    # its wrapper may still be on its way out (it drains the rank's pipes first): asked again, then kept
    got = release_blocker("node2", JOB, _job(), [TRAIN, RESTORE], [], RECORDS, settled=[])
    assert got is not None and got.hold == Hold.SETTLING
    assert f"step {JOB}.0 (python) still has a task on node2 that did not leave it" in got.why
    # a rank the records place on the node: kept at once
    got = release_blocker("node2", JOB, _job(), [TRAIN], [], {**RECORDS, "1": {"node": "node2"}}, settled=[])
    assert got is not None and got.hold == Hold.KEPT and "ranks ['1'] run there" in got.why


def test_a_wrapper_that_just_left_is_given_time_not_kept():
    got = release_blocker("node2", JOB, _job(), [TRAIN], [LEFT], RECORDS, settled=[])
    assert got is not None and got.hold == Hold.SETTLING and "ranks ['1']" in got.why


def test_a_rank_still_running_on_the_node_keeps_it_even_when_another_left():
    records = {**RECORDS, "5": {"node": "node2"}}
    got = release_blocker("node2", JOB, _job(), [TRAIN], [LEFT], records, settled=["1"])
    assert got is not None and got.hold == Hold.KEPT and "ranks ['5'] run there" in got.why


def test_a_released_record_of_another_step_or_node_frees_nothing():
    for other in (mx.Released("1", "3", "node2", 1, 0), mx.Released("1", "0", "node3", 1, 0)):
        got = release_blocker("node2", JOB, _job(), [TRAIN], [other], RECORDS, settled=["1"])
        assert got is not None and "did not leave it" in got.why


def test_the_batch_host_is_never_released_even_when_its_wrapper_left():
    left = mx.Released("0", "0", "node1", 1, 137)
    got = release_blocker("node1", JOB, _job(), [TRAIN], [left], {"0": {"node": "node4"}}, settled=["0"])
    assert got is not None and got.hold == Hold.KEPT and "batch host" in got.why


def test_a_restore_step_still_listed_is_waited_for():
    got = release_blocker("node4", JOB, _job(), [RESTORE], [], {}, settled=[])
    assert got is not None and got.hold == Hold.SETTLING and "torchpass-restore-1" in got.why


def test_a_job_that_ended_or_a_node_already_gone():
    assert release_blocker("node2", JOB, None, [], [], {}).hold == Hold.KEPT
    assert release_blocker("node2", JOB, _job(state="COMPLETED"), [], [], {}).hold == Hold.KEPT
    assert release_blocker("node2", JOB, _job(nodes=("node1", "node3")), [TRAIN], [], {}) is None
    assert "last node" in release_blocker("node2", JOB, _job(nodes=("node2",), batch="node9"), [], [], {}).why


def test_the_wrapper_leaves_only_once_a_restored_copy_holds_the_rank():
    me = (4242, "node2")
    assert not mx.leave_source({"wrapper_pid": 4242, "node": "node2"}, *me)  # nothing took over yet
    assert not mx.leave_source({}, *me)
    assert mx.leave_source({"wrapper_pid": 77, "node": "node4", "restored_from": "/img"}, *me)
    # a move called off after the restore, with no record to give back: no copy holds it
    assert not mx.leave_source({"wrapper_pid": 77, "node": "node4", "restored_from": "/img", "aborted": True}, *me)


def test_the_moved_ranks_end_comes_from_the_copy_its_record_names():
    rec = {"wrapper_pid": 77, "node": "node4", "restored_from": "/img"}
    assert mx.moved_rank_end(LEFT, rec, None, True) == (mx.Outcome.WAIT, None)
    assert mx.moved_rank_end(LEFT, rec, {**rec, "code": 3}, True) == (mx.Outcome.ENDED, 3)
    # an exit of a copy the record no longer names (moved on again) is not the rank's
    stale = {"wrapper_pid": 66, "node": "node3", "restored_from": "/old", "code": 137}
    assert mx.moved_rank_end(LEFT, rec, stale, True) == (mx.Outcome.WAIT, None)
    # rolled back to the copy that left: it ended as the source copy did
    back = {"wrapper_pid": 4242, "node": "node2"}
    assert mx.moved_rank_end(LEFT, back, None, True) == (mx.Outcome.ROLLED_BACK, 137)
    assert mx.moved_rank_end(LEFT, {**rec, "aborted": True}, None, True) == (mx.Outcome.ROLLED_BACK, 137)
    assert mx.moved_rank_end(LEFT, rec, None, False) == (mx.Outcome.LOST, 1)


def test_srun_exits_with_the_largest_code():
    assert mx.srun_code(0, []) == 0
    assert mx.srun_code(0, [0]) == 0
    assert mx.srun_code(0, [3]) == 3
    assert mx.srun_code(5, [3]) == 5
    assert mx.srun_code(0, [137, 2]) == 137


def _own_pid_file(state_dir: Path) -> None:
    """The coordinator's pid file, naming this test's process (it runs)."""
    start = Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[-1].split()[19]
    path = layout.coordinator_pid(state_dir, JOB)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{os.getpid()} {start} {socket.gethostname()}\n")


def test_collect_waits_for_the_moved_copy_and_takes_its_code(tmp_path):
    state = tmp_path / "state"
    rank_dir = layout.rank_records_dir(state, JOB)
    _own_pid_file(state)
    layout.rank_job_dir(rank_dir, JOB).mkdir(parents=True)
    copy = {"wrapper_pid": 77, "node": "node4", "restored_from": "/img"}
    layout.rank_record(rank_dir, JOB, 1).write_text(json.dumps(copy))
    layout.released_file(rank_dir, JOB, 1).write_text(json.dumps(LEFT.as_json()))
    # a released rank of another step is not this srun's
    layout.released_file(rank_dir, JOB, 2).write_text(json.dumps(mx.Released("2", "9", "node3", 5, 0).as_json()))
    sleeps = []

    def sleep(s):  # the copy ends after srun began to wait
        sleeps.append(s)
        layout.exit_file(rank_dir, JOB, 1).write_text(json.dumps({**copy, "code": 3}))

    assert mx.collect("0", 0, str(rank_dir), str(state), str(JOB), sleep=sleep) == 3
    assert len(sleeps) == 1
    # nothing released in step 4: srun's own status, at once
    assert mx.collect("4", 2, str(rank_dir), str(state), str(JOB), sleep=sleep) == 2


def test_collect_gives_up_when_the_coordinator_is_gone(tmp_path):
    state = tmp_path / "state"
    rank_dir = layout.rank_records_dir(state, JOB)
    layout.rank_job_dir(rank_dir, JOB).mkdir(parents=True)
    layout.rank_record(rank_dir, JOB, 1).write_text(json.dumps({"wrapper_pid": 77, "node": "node4",
                                                               "restored_from": "/img"}))
    layout.released_file(rank_dir, JOB, 1).write_text(json.dumps(LEFT.as_json()))
    clock = [0.0]

    def sleep(s):
        clock[0] += s

    assert mx.collect("0", 0, str(rank_dir), str(state), str(JOB), now=lambda: clock[0], sleep=sleep) == 1
    assert clock[0] >= mx.COORDINATOR_GONE_S


def test_the_launch_wrapper_leaves_with_a_released_record_once_the_restored_copy_holds_the_rank(tmp_path, monkeypatch):
    from torchpass.checkpoint import rankwrap as rw

    rank_dir = layout.rank_records_dir(tmp_path / "state", JOB)
    paths = rw.Paths(str(rank_dir), str(JOB), "1")
    paths.dir.mkdir(parents=True)
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    me = {"wrapper_pid": os.getpid(), "node": socket.gethostname()}
    paths.record.write_text(json.dumps(me))
    assert not rw.release_source(paths, str(JOB), "1", -9)  # nothing took the rank over: it stays
    assert not layout.released_file(rank_dir, JOB, 1).exists()
    paths.record.write_text(json.dumps({"wrapper_pid": 77, "node": "node4", "restored_from": "/img"}))
    assert rw.release_source(paths, str(JOB), "1", -9)
    got = mx.read_released(layout.released_file(rank_dir, JOB, 1))
    assert got == mx.Released("1", "0", socket.gethostname(), os.getpid(), 137)
    assert mx.released_records(layout.rank_job_dir(rank_dir, JOB)) == [got]
