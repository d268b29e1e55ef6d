"""A whole-job snapshot through the coordinator's driver and executor with a fake tpassd:
the tpassd requests it sends (snap per rank, commit to rank 0's node, discard after a failure), the
pause that holds every rank, and the resume in place that releases them."""

from __future__ import annotations

import pytest

from support.fake_slurm import FakeSlurm
from test_executor import _pump_until
from torchpass import layout
from torchpass.coordinator import machine as mc
from torchpass.coordinator.driver import Driver
from torchpass.coordinator.executor import Executor
from torchpass.coordinator.job_record import JobState
from torchpass.coordinator.policy import CoordinatorPolicy
from torchpass.errors import RemoteError
from torchpass.slurm.base import StepInfo

NODES = ("n1", "n2", "n3")


class FakeTpassd:
    def __init__(self, fail_rank: int | None = None):
        self.fail_rank = fail_rank
        self.calls: list[tuple[str, dict]] = []

    def request(self, node, type_, body, timeout_s):
        assert type_ == "tpassd.snapshot"
        self.calls.append((node, dict(body)))
        op = body["op"]
        if op == "snap":
            if body["rank"] == self.fail_rank:
                raise RemoteError("failed", "criu dump failed: boom")
            return {"images": f"/snap/snapshots/job42/{body['snapshot']}/rank{body['rank']}",
                    "checksum": f"c{body['rank']}", "bytes": 1000, "criu_dump_s": 0.1}
        if op == "commit":
            return {"manifest": f"/state/jobs/42/snapshots/{body['snapshot']}.json", "bytes": 3000, "removed": []}
        return {}

    def ops(self, op):
        return [(n, b) for n, b in self.calls if b["op"] == op]


def _driver(tmp_path, tp, pol: CoordinatorPolicy | None = None, **clocks):
    job = JobState(job_id=42)
    pol = pol or CoordinatorPolicy()
    d = Driver(job, pol, **clocks)
    d.executor = Executor(job, state_dir=tmp_path, post=d.post, policy=pol, tpassd=tp,
                          address_of=lambda n: {"n1": "10.0.0.1", "n2": "10.0.0.2", "n3": "10.0.0.3"}[n])
    for r, n in enumerate(NODES):
        d.feed(mc.RankRegistered(r, n, 3))
    for n in NODES:
        d.feed(mc.NodeHealthChanged(n, "healthy"))
    return d


def _pause_all(d, sid):
    ex = d.executor
    pause = {r: ex.command_for(r) for r in range(3)}
    assert {c["command"] for c in pause.values()} == {"pause"}
    at, gen = pause[0]["at"], pause[0]["generation"]
    # every rank held: it closes its coordinator link, so CRIU finds no socket to dump
    assert all(pause[r]["hold_file"] == str(layout.hold_file(d.executor.state_dir, 42, sid, r)) for r in range(3))
    for r in range(3):
        ex.acknowledge(r, "pause", gen, at)
        d.feed(mc.Quiesced(r, gen, at))
    return gen


def test_snapshot_dumps_every_rank_commits_on_rank0s_node_and_resumes_in_place(tmp_path):
    tp = FakeTpassd()
    d = _driver(tmp_path, tp)
    sid = d.accept_snapshot(1.7e9)
    assert sid.endswith("-1") and layout.valid_snapshot_id(sid)
    d.decide()
    gen = _pause_all(d, sid)
    _pump_until(d, lambda: len(tp.ops("commit")) == 1)
    assert sorted((n, b["rank"], b["snapshot"], b["generation"]) for n, b in tp.ops("snap")) == [
        ("n1", 0, sid, gen), ("n2", 1, sid, gen), ("n3", 2, sid, gen)]
    (node, commit), = tp.ops("commit")
    assert node == "n1" and commit["keep"] == 2 and [p["rank"] for p in commit["parts"]] == [0, 1, 2]
    ex = d.executor
    assert all(ex.command_for(r)["command"] == "resume" for r in range(3))
    assert all(layout.hold_file(tmp_path, 42, sid, r).exists() for r in range(3))  # released in place
    assert not tp.ops("abort") and not tp.ops("dump")  # no hand-off: nothing moves
    for r in range(3):
        ex.acknowledge(r, "resume", gen)
        d.feed(mc.Resumed(r, gen, NODES[r]))
    _pump_until(d, lambda: d.state.snapshot is None)
    (done,) = [e for e in d.job.events if e.kind == "snapshot.completed"]
    assert done.data["snapshot"] == sid and done.data["bytes"] == 3000


def test_a_failed_dump_resumes_every_rank_and_discards_on_every_node(tmp_path):
    tp = FakeTpassd(fail_rank=1)
    d = _driver(tmp_path, tp)
    sid = d.accept_snapshot(1.7e9)
    d.decide()
    gen = _pause_all(d, sid)
    _pump_until(d, lambda: d.executor.command_for(0) is not None and len(tp.ops("discard")) == 3)
    assert not tp.ops("commit")
    assert sorted(n for n, _ in tp.ops("discard")) == list(NODES)
    for r in range(3):
        d.feed(mc.Resumed(r, gen, NODES[r]))
    _pump_until(d, lambda: d.state.snapshot is None)
    (failed,) = [e for e in d.job.events if e.kind == "snapshot.failed"]
    assert "criu dump failed: boom" in failed.data["why"]
    with pytest.raises(mc.OperatorRejected):  # a queued migration refuses a snapshot
        d.accept_operator("n2", None)
        d.accept_snapshot(1.7e9)


def test_the_driver_asks_for_a_periodic_snapshot_and_records_it(tmp_path):
    tp = FakeTpassd()
    now = [500.0]
    d = _driver(tmp_path, tp, CoordinatorPolicy(snapshot_every_s=30.0), clock=lambda: now[0],
                wall=lambda: 1.7e9 + now[0])
    job = d.job
    now[0] += 29.0
    d.decide()
    assert d.state.snapshot is None
    now[0] += 1.0
    d.decide()
    (asked,) = [e for e in job.events if e.kind == "snapshot.requested"]
    sid = asked.data["snapshot"]
    assert asked.data["trigger"] == "periodic" and asked.data["every_s"] == 30.0
    assert d.state.snapshot is not None and d.state.snapshot.id == sid and d.state.snapshot.trigger == "periodic"
    assert {d.executor.command_for(r)["command"] for r in range(3)} == {"pause"}


def _slurm(refuse: str | None = None) -> FakeSlurm:
    """What StopJob asks of slurmctld: job 42's steps, then requeuehold (``refuse``: its error)."""
    slurm = FakeSlurm(steps={42: [StepInfo("42.batch", "batch", ("n1",), "RUNNING"),
                                  StepInfo("42.0", "hostname", ("n1",), "RUNNING"),
                                  StepInfo("42.1", "python", NODES, "RUNNING")]})
    if refuse:
        slurm.refuse("requeue_hold", refuse)
    return slurm


def _stop(tmp_path, slurm):
    from torchpass.coordinator.stopped import read_stopped

    tp = FakeTpassd()
    d = _driver(tmp_path, tp)
    d.executor.slurm = slurm
    sid = d.accept_snapshot(1.7e9, stop=True)
    d.decide()
    _pause_all(d, sid)
    return d, sid, read_stopped


def test_stop_writes_the_marker_of_the_ranks_step_and_holds_the_job_with_no_resume(tmp_path):
    slurm = _slurm()
    d, sid, read_stopped = _stop(tmp_path, slurm)
    _pump_until(d, lambda: slurm.calls_of("requeue_hold") == [(42,)])
    stopped = read_stopped(tmp_path, 42)
    assert stopped == {"snapshot": sid, "step": 1, "snapshot_step": d.state.snapshot.step, "generation": 1,
                       "world_size": 3, "step_offset": 0}  # step 1: the one on every rank's node
    assert all((d.executor.command_for(r) or {}).get("command") != "resume" for r in range(3))
    assert not any(layout.hold_file(tmp_path, 42, sid, r).exists() for r in range(3)), "the ranks stay held"
    saved = layout.events_json(tmp_path, 42).read_text()  # on disk before the hold ends the coordinator
    assert "job.stopping" in saved


def test_a_refused_hold_removes_the_marker_and_resumes_every_rank(tmp_path):
    slurm = _slurm(refuse="'scontrol requeuehold 42' failed: Access/permission denied")
    d, sid, read_stopped = _stop(tmp_path, slurm)
    _pump_until(d, lambda: d.executor.command_for(0) is not None and d.executor.command_for(0)["command"] == "resume")
    assert read_stopped(tmp_path, 42) is None
    (failed,) = [e for e in d.job.events if e.kind == "job.stop_failed"]
    assert "Access/permission denied" in failed.message
