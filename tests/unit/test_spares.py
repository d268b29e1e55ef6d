"""Spares from slurmctld and shrink, in the executor (the Slurm side is recorded; the CLI backend runs for
real in tests/integration/test_second_fault.py), and following a new spare's health."""

from __future__ import annotations

import json
import os
import time

import zmq

from support.fake_slurm import FakeSlurm
from torchpass import layout
from torchpass.checkpoint import moved_exit
from torchpass.coordinator import machine as mc
from torchpass.coordinator.contract import RequestSpare, Restore, Shrink
from torchpass.coordinator.executor import Executor
from torchpass.coordinator.job_record import JobState
from torchpass.coordinator.model import CoordState, SpareView
from torchpass.coordinator.policy import CoordinatorPolicy
from torchpass.errors import SlurmError
from torchpass.health import HealthSubscriber
from torchpass.slurm.base import StepInfo


def _slurm(*, grant="n4", merge_fails=False, steps=()) -> FakeSlurm:
    """Answers like slurmctld would for one running job (42 on n1..n3, batch host n1); a spare
    is donor job 77 on ``grant`` (None: no node is free)."""
    slurm = FakeSlurm(steps={42: list(steps)}, grant=None if grant is None else (77, grant))
    slurm.run_job(42, uid=1000, nodes=("n1", "n2", "n3"), batch_host="n1", partition="gpu", account="proj",
                  qos="normal", end_time=int(time.time()) + 600)
    if merge_fails:
        slurm.script("merge_into", SlurmError("job 42 did not take the nodes of donor 77"))
    return slurm


def _changes(slurm: FakeSlurm) -> list[tuple]:
    """What the executor asked Slurm to do (its questions left out), in order."""
    return [c for c in slurm.calls if c[0] not in ("job", "jobs", "nodes", "steps", "expand_nodelist")]


class Posted(list):
    """The outcomes an executor posted. The test plays the serve thread: ``_wait`` shows each
    new one to ``Executor.observe``, as ``Driver.pump`` does before machine.apply."""

    def __init__(self):
        super().__init__()
        self.ex = None
        self.observed = 0


def _executor(tmp_path, slurm, followed=None):
    posted = Posted()
    ex = Executor(JobState(job_id=42), state_dir=tmp_path, post=posted.append, policy=CoordinatorPolicy(),
                  slurm=slurm, follow=(followed.append if followed is not None else None))
    posted.ex = ex
    return ex, posted


def _wait(posted, n=1):
    end = time.monotonic() + 5
    while len(posted) < n and time.monotonic() < end:
        time.sleep(0.01)
    for outcome in posted[posted.observed:]:
        posted.ex.observe(outcome)
    posted.observed = len(posted)
    return posted


def _state(*spares):
    return CoordState(job_id=42, spares=tuple(spares))


def test_expand_allocates_a_donor_like_the_job_and_merges_it(tmp_path):
    slurm, followed = _slurm(), []
    ex, posted = _executor(tmp_path, slurm, followed)
    ex.perform(RequestSpare("m2", "expand", "n3"), _state(SpareView("n3", "hot", "used")))
    assert _wait(posted) == [mc.SpareGranted("m2", "n4", "expand", allocation=77)]
    (_, req), merge = _changes(slurm)
    assert merge == ("merge_into", 77, 42)
    assert req.expand and req.exclude == ("n1", "n2", "n3")
    assert (req.partition, req.account, req.qos) == ("gpu", "proj", "normal")
    assert req.name == "torchpass-spare-42" and "expand spare for job 42 (m2, replacing n3)" in req.comment
    assert 1 <= req.time_limit_min <= 11  # never outlives the job
    assert followed == ["n4"] and ex.companions == {}


def test_failed_merge_cancels_the_donor_and_reports_unavailable(tmp_path):
    slurm = _slurm(merge_fails=True)
    ex, posted = _executor(tmp_path, slurm)
    ex.perform(RequestSpare("m1", "expand", "n2"), _state())
    (out,) = _wait(posted)
    assert isinstance(out, mc.SpareUnavailable) and out.strategy == "expand" and "did not take" in out.why
    assert ("cancel", 77) in slurm.calls


def test_no_free_node_is_unavailable_with_slurms_words(tmp_path):
    ex, posted = _executor(tmp_path, _slurm(grant=None))
    ex.perform(RequestSpare("m1", "companion", "n2"), _state())
    (out,) = _wait(posted)
    assert out == mc.SpareUnavailable("m1", "companion", "salloc of a spare for job 42 failed: "
                                                       "Immediate execution impossible")


def test_companion_runs_the_restore_step_and_is_cancelled_at_close(tmp_path):
    slurm = _slurm()
    ex, posted = _executor(tmp_path, slurm)
    ex.perform(RequestSpare("m1", "companion", "n2"), _state())
    assert _wait(posted) == [mc.SpareGranted("m1", "n4", "companion", allocation=77)]
    assert not _changes(slurm)[0][1].expand and ex.companions == {77: "n4"}
    st = _state(SpareView("n4", "companion", "reserved", allocation=77))
    argv = ex.restore_argv(Restore("m1", 1, "n4", "/img", "sha"),
                           st.spare("n4").allocation)
    assert "--jobid=77" in argv and argv[argv.index("-w") + 1] == "n4"
    ex.close()
    assert ("cancel", 77) in slurm.calls and ex.companions == {}


def test_shrink_keeps_a_node_where_a_step_still_has_a_task(tmp_path):
    slurm = _slurm(steps=[StepInfo("42.batch", "batch", ("n1",), "RUNNING"),
                                  StepInfo("42.0", "python", ("n1", "n2"), "RUNNING")])
    ex, posted = _executor(tmp_path, slurm)
    ex.spares.settle_grace_s = 0.5  # no launch wrapper says it left: waited for, then kept
    ex.perform(Shrink("m1", ("n2",)), _state())
    (out,) = _wait(posted)
    assert isinstance(out, mc.ShrinkFailed)
    assert "step 42.0 (python) still has a task on n2 that did not leave it" in out.why
    assert not any(c[0] == "shrink" for c in slurm.calls)
    # a rank the rank records place there: kept at once
    job_dir = layout.rank_job_dir(layout.rank_records_dir(tmp_path, 42), 42)
    job_dir.mkdir(parents=True)
    layout.rank_record(layout.rank_records_dir(tmp_path, 42), 42, 1).write_text(json.dumps({"node": "n2"}))
    ex.spares.settle_grace_s = 60.0
    ex.perform(Shrink("m1", ("n2",)), _state())
    (_, out) = _wait(posted, 2)
    assert isinstance(out, mc.ShrinkFailed) and "ranks ['1'] run there" in out.why, out


def test_shrink_releases_a_node_whose_moved_ranks_launch_wrapper_left(tmp_path):
    slurm = _slurm(steps=[StepInfo("42.batch", "batch", ("n1",), "RUNNING"),
                                  StepInfo("42.0", "python", ("n1", "n2"), "RUNNING")])
    rank_dir = layout.rank_records_dir(tmp_path, 42)
    layout.rank_job_dir(rank_dir, 42).mkdir(parents=True)
    layout.rank_record(rank_dir, 42, 1).write_text(json.dumps({"node": "n4", "restored_from": "/img"}))
    released = layout.released_file(rank_dir, 42, 1)
    released.write_text(json.dumps(moved_exit.Released("1", "0", "n2", 4242, 137).as_json()))
    old = time.time() - 10  # written long enough ago: the wrapper has exited
    os.utime(released, (old, old))
    ex, posted = _executor(tmp_path, slurm)
    ex.perform(Shrink("m1", ("n2",)), _state())
    assert _wait(posted) == [mc.Shrunk("m1", ("n2",))]
    assert ("shrink", 42, ("n1", "n3")) in slurm.calls


def test_shrink_releases_a_node_no_step_runs_on(tmp_path):
    slurm = _slurm(steps=[StepInfo("42.batch", "batch", ("n1",), "RUNNING"),
                                  StepInfo("42.0", "python", ("n1", "n2"), "RUNNING")])
    ex, posted = _executor(tmp_path, slurm)
    ex.perform(Shrink("m2", ("n3",)), _state())
    assert _wait(posted) == [mc.Shrunk("m2", ("n3",))]
    assert ("shrink", 42, ("n1", "n2")) in slurm.calls


def test_shrink_never_releases_the_batch_host(tmp_path):
    ex, posted = _executor(tmp_path, _slurm())
    ex.perform(Shrink("m1", ("n1",)), _state())
    (out,) = _wait(posted)
    assert isinstance(out, mc.ShrinkFailed) and "batch host" in out.why


def test_shrink_of_a_companion_node_cancels_its_allocation(tmp_path):
    slurm = _slurm()
    ex, posted = _executor(tmp_path, slurm)
    ex.companions[77] = "n4"
    ex.perform(Shrink("m3", ("n4",)), _state(SpareView("n4", "companion", "used", allocation=77)))
    assert _wait(posted) == [mc.Shrunk("m3", ("n4",))]
    assert ("cancel", 77) in slurm.calls and ex.companions == {}


def test_subscriber_follows_a_node_added_while_running():
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    asked = []

    def snap(node, endpoint):
        asked.append((node, endpoint))
        return {"incarnation": "i1", "seq": 3, "last_event_seq": 2, "state": "healthy", "reasons": [],
                "components": {}, "interval_s": 1.0}

    s = HealthSubscriber({}, snapshot=snap)
    try:
        s.follow("n9", f"tcp://127.0.0.1:{port}", "tcp://127.0.0.1:1")
        assert s.nodes()["n9"]["state"] == "unknown"  # visible at once, unknown until it reports
        assert s.brief()["n9"] == ("unknown", ("no heartbeat seen yet",), None)
        s.follow("n9", "tcp://127.0.0.1:2", "tcp://127.0.0.1:3")  # a second follow changes nothing
        s.poll_once(50)
        assert asked == [("n9", "tcp://127.0.0.1:1")]
        assert s.nodes()["n9"]["state"] == "healthy"
        state, reasons, age = s.brief()["n9"]  # the coordinator's poll: what nodes() says, lean
        assert (state, reasons) == ("healthy", ()) and age is not None and age >= 0
    finally:
        s.close()
        pub.close(linger=0)
