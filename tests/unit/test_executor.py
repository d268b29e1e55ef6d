"""The coordinator's driver + executor without Slurm or tpassd: fake tpassd answers, real decisions.

A migration whose snapshot fails rolls back: every rank gets a resume command
for the armed generation, the held rank's hold file appears (it resumes in
place), the source node is not drained, and the job's events say so.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from support.fake_slurm import FakeSlurm
from support.wait import until
from torchpass import layout
from torchpass.coordinator import contract as ct
from torchpass.coordinator import machine as mc
from torchpass.coordinator import migration_actions
from torchpass.coordinator.driver import Driver
from torchpass.coordinator.executor import Executor
from torchpass.coordinator.job_record import JobState
from torchpass.coordinator.policy import CoordinatorPolicy
from torchpass.coordinator.rank_commands import resume_port
from torchpass.errors import RemoteError


class FakeTpassd:
    def __init__(self, fail_dump: bool):
        self.fail_dump = fail_dump
        self.calls: list[tuple[str, str, dict]] = []

    def request(self, node, type_, body, timeout_s):
        self.calls.append((node, type_, dict(body)))
        if type_ == "tpassd.snapshot" and body["op"] == "dump" and self.fail_dump:
            raise RemoteError("failed", "criu dump of pid 7 failed (exit 1): boom; the rank was left running")
        return {}


def fake_srun(tmp_path) -> Path:
    """An srun that logs its argv and runs the step's program here (from the python on)."""
    p = tmp_path / "srun"
    p.write_text(f"""#!/bin/sh
echo "$@" >> {tmp_path}/srun.calls
while [ "$#" -gt 0 ] && [ "$1" != "{sys.executable}" ]; do shift; done
exec "$@"
""")
    p.chmod(0o755)
    return p


_open_executors: list[Executor] = []


@pytest.fixture(autouse=True)
def _close_executors():
    """Every test's executor is closed: its restore steps started at a pause (restore_gate
    processes waiting at their gate) are called off, so no test leaves a process behind."""
    yield
    while _open_executors:
        ex = _open_executors.pop()
        procs = ex.steps()
        ex.close()
        for p in procs:
            try:
                p.wait(10)
            except Exception:  # noqa: BLE001
                p.kill()
                p.wait()


def _driver(tmp_path, tp):
    job = JobState(job_id=42, spares=1)
    pol = CoordinatorPolicy()
    d = Driver(job, pol, spares=("n4",))
    slurm = FakeSlurm()
    d.executor = Executor(job, state_dir=tmp_path, post=d.post, policy=pol, tpassd=tp, slurm=slurm,
                          address_of=lambda n: {"n1": "10.0.0.1", "n2": "10.0.0.2", "n3": "10.0.0.3",
                                                "n4": "10.0.0.4"}[n], srun=str(fake_srun(tmp_path)))
    d.executor.restore_steps.output = str(tmp_path / "job.out")
    _open_executors.append(d.executor)
    for r, n in enumerate(("n1", "n2", "n3")):
        d.feed(mc.RankRegistered(r, n, 3))
    for n in ("n1", "n2", "n3", "n4"):
        d.feed(mc.NodeHealthChanged(n, "healthy"))
    return d, slurm


def _pump_until(d, pred, timeout_s=5.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        d.pump()
        if pred():
            return
        time.sleep(0.01)
    raise AssertionError(f"not reached; reason now: {d.reasons.last}")


def test_failed_snapshot_rolls_back_and_resumes_in_place(tmp_path):
    tp = FakeTpassd(fail_dump=True)
    d, slurm = _driver(tmp_path, tp)
    ex = d.executor
    d.feed(mc.NodeHealthChanged("n2", "degraded", ("gpu0: ecc storm",)))
    pause = {r: ex.command_for(r) for r in range(3)}
    assert {c["command"] for c in pause.values()} == {"pause"}
    at, gen = pause[0]["at"], pause[0]["generation"]
    assert gen == 1 and "hold_file" in pause[1] and "hold_file" not in pause[0]
    hf = layout.hold_file(tmp_path, 42, "m1", 1)
    assert pause[1]["hold_file"] == str(hf) and not hf.exists()
    for r in range(3):
        ex.acknowledge(r, "pause", gen, at)
        d.feed(mc.Armed(r, at, gen, True, 10))
    assert all(ex.command_for(r) is None for r in range(3))
    for r in range(3):
        d.feed(mc.Quiesced(r, gen, at))
    _pump_until(d, lambda: ex.command_for(0) is not None)
    resume = ex.command_for(0)
    assert resume == {"command": "resume", "generation": gen, "master_addr": "10.0.0.1",
                      "master_port": resume_port(42, gen, CoordinatorPolicy().rendezvous_port_range())}
    assert all(ex.command_for(r) == resume for r in range(3))
    # What every paused rank was told to do on its own after deadline_s without a resume: this same
    # resume in place (docs/coordinator.md, "Never left paused"); 3630 s with the default policy.
    assert all(pause[r]["fallback"] == resume and pause[r]["deadline_s"] == 3630.0 for r in range(3))
    # ... and how long the ranks of that fallback wait for each other before failing (the rebuild's timeout)
    assert all(pause[r]["join_s"] == ex.policy.rebuild_timeout_s for r in range(3))
    # the held source copy wakes up where it is, once its hand-off is marked aborted (off the serve thread)
    until(hf.exists, "the hold file", 5.0)
    assert ("n2", "tpassd.snapshot") in [(n, t) for n, t, b in tp.calls if b["op"] == "abort"]
    for r in range(3):
        ex.acknowledge(r, "resume", gen)
        d.feed(mc.Resumed(r, gen, ("n1", "n2", "n3")[r]))
    kinds = [e.kind for e in d.job.events]
    assert kinds[-2:] == ["migration.rollback", "migration.rolled_back"], kinds
    assert "dump failed" in d.job.events[-1].message and d.state.migration is None
    assert not [c for c in tp.calls if c[1] == "tpassd.drain"]  # rolled back: nothing drained
    assert layout.events_json(tmp_path, 42).exists()


def test_rank_commands_repeat_until_acknowledged_and_stale_acks_are_ignored(tmp_path):
    d, _ = _driver(tmp_path, FakeTpassd(fail_dump=False))
    ex = d.executor
    d.feed(mc.NodeHealthChanged("n3", "degraded", ("x",)))
    cmd = ex.command_for(2)
    ex.acknowledge(2, "pause", cmd["generation"], cmd["at"] + 1)  # another T: not this command
    ex.acknowledge(2, "resume", cmd["generation"])
    assert ex.command_for(2) == cmd
    ex.acknowledge(2, "pause", cmd["generation"], cmd["at"])
    assert ex.command_for(2) is None


def test_restore_step_starts_at_the_pause_and_a_rollback_cancels_it(tmp_path):
    """The restore step is launched when the pause is armed (its srun start overlaps the
    ranks' way to T and the dump) and waits at its gate; a rollback calls it off."""
    tp = FakeTpassd(fail_dump=True)
    d, _ = _driver(tmp_path, tp)
    ex = d.executor
    d.feed(mc.NodeHealthChanged("n2", "degraded", ("gpu0: ecc storm",)))
    key = [(mid, r) for mid, mv in ex.moves.items() for r in mv.gates]
    assert key == [("m1", 1)]
    target, proc, go, _t = ex.moves["m1"].gates[1]
    assert target == "n4" and proc.poll() is None and not go.exists()
    end = time.monotonic() + 10
    while not (tmp_path / "srun.calls").exists() and time.monotonic() < end:
        time.sleep(0.01)
    calls = (tmp_path / "srun.calls").read_text()
    assert "-w n4" in calls and "torchpass.checkpoint.restore_gate" in calls and "--restore" not in calls
    at, gen = ex.command_for(0)["at"], ex.command_for(0)["generation"]
    # before its srun, the target's tpassd set up the restore: without that token the plugin
    # starts no root restore agent for the step
    assert [(n, t, b) for n, t, b in tp.calls if b["op"] == "prepare"] == [
        ("n4", "tpassd.restore", {"job_id": 42, "rank": 1, "op": "prepare", "kind": "migration", "generation": gen})]
    for r in range(3):
        d.feed(mc.Quiesced(r, gen, at))
    _pump_until(d, lambda: d.state.migration is not None and d.state.migration.phase.value == "rollback")
    assert ex.moves["m1"].gates == {} and go.read_text().strip() == "cancel"
    assert proc.wait(10) == 0  # it left its gate without restoring anything


def test_restore_is_released_at_the_gate_with_the_image(tmp_path):
    tp = FakeTpassd(fail_dump=False)
    tp.request = lambda node, type_, body, timeout_s: (  # a dump result, then verify answers
        {"images": str(tmp_path / "img"), "checksum": "c", "pid": 7, "bytes": 1}
        if type_ == "tpassd.snapshot" else {})
    d, _ = _driver(tmp_path, tp)
    ex = d.executor
    d.feed(mc.NodeHealthChanged("n2", "degraded", ("x",)))
    _t, proc, go, _s = ex.moves["m1"].gates[1]
    at, gen = ex.command_for(0)["at"], ex.command_for(0)["generation"]
    for r in range(3):
        d.feed(mc.Quiesced(r, gen, at))
    # dump -> transfer -> restore: the waiting step gets the image and runs the restore wrapper,
    # which refuses a snapshot without a manifest: the restore fails with its reason, and rolls back.
    _pump_until(d, lambda: any(e.kind == "migration.rollback" for e in d.job.events), timeout_s=30)
    assert go.read_text().strip() == f"restore {tmp_path / 'img'}"
    rb = [e for e in d.job.events if e.kind == "migration.rollback"][0]
    assert "restore on n4 failed" in rb.message and "manifest.json" in rb.message, rb.message
    assert (tmp_path / "srun.calls").read_text().count("\n") == 1  # one step, launched at the pause


def _refusing_srun(tmp_path, refusals: int) -> Path:
    """An srun that slurmctld refuses ``refusals`` times (as right after a slurmctld restart,
    until the job's nodes have registered again), then runs the step like fake_srun."""
    p = tmp_path / "srun"
    p.write_text(f"""#!/bin/sh
echo "$@" >> {tmp_path}/srun.calls
n=$(wc -l < {tmp_path}/srun.calls)
if [ "$n" -le {refusals} ]; then
  echo "srun: error: Unable to create step for job 42: Memory required by task is not available" >&2
  exit 1
fi
while [ "$#" -gt 0 ] && [ "$1" != "{sys.executable}" ]; do shift; done
exec "$@"
""")
    p.chmod(0o755)
    return p


def _dump_ok_tpassd(tmp_path):
    tp = FakeTpassd(fail_dump=False)
    tp.request = lambda node, type_, body, timeout_s: (
        {"images": str(tmp_path / "img"), "checksum": "c", "pid": 7, "bytes": 1}
        if type_ == "tpassd.snapshot" else {})
    return tp


def _move_n2_until_rollback(d):
    """n2 degrades, every rank quiesces at the pause; the rollback event that follows."""
    ex = d.executor
    d.feed(mc.NodeHealthChanged("n2", "degraded", ("x",)))
    at, gen = ex.command_for(0)["at"], ex.command_for(0)["generation"]
    for r in range(3):
        d.feed(mc.Quiesced(r, gen, at))
    _pump_until(d, lambda: any(e.kind == "migration.rollback" for e in d.job.events), timeout_s=30)
    return [e for e in d.job.events if e.kind == "migration.rollback"][0]


def test_a_restore_step_slurmctld_refuses_for_a_while_is_launched_again(tmp_path):
    d, _ = _driver(tmp_path, _dump_ok_tpassd(tmp_path))
    ex = d.executor
    ex.srun = str(_refusing_srun(tmp_path, 2))  # the step at the pause and the first relaunch refused
    rb = _move_n2_until_rollback(d)
    # The third launch ran the restore wrapper (which refuses an image without a manifest).
    assert "manifest.json" in rb.message and "Unable to create step" not in rb.message, rb.message
    assert (tmp_path / "srun.calls").read_text().count("\n") == 3


def test_a_restore_step_slurmctld_keeps_refusing_fails_with_its_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(migration_actions, "STEP_CREATE_RETRY_S", 1.0)
    d, _ = _driver(tmp_path, _dump_ok_tpassd(tmp_path))
    ex = d.executor
    ex.srun = str(_refusing_srun(tmp_path, 1000))
    rb = _move_n2_until_rollback(d)
    assert "Memory required by task is not available" in rb.message, rb.message
    # Tried again, with backoff, then gave up. Under a loaded machine's process starts the 1 s
    # retry window held only 2 calls (a 1.8 s run idle held 3), so "again" is at least 2.
    assert 2 <= (tmp_path / "srun.calls").read_text().count("\n") < 10


def test_rollback_after_a_restore_resumes_the_source_only_once_the_restored_copy_is_gone(tmp_path):
    """The restored copy on the target waits at the same hold file as the source copy (it is
    the same process image): releasing the hold, or sending the resume, before the abort of
    that copy finished would let both copies rejoin as the rank and hang the group."""
    import threading


    release = threading.Event()

    class SlowAbortTpassd(FakeTpassd):
        def request(self, node, type_, body, timeout_s):
            super().request(node, type_, body, timeout_s)
            if type_ == "tpassd.restore" and body["op"] == "abort":
                assert release.wait(10), "abort never released"
            return {}

    tp = SlowAbortTpassd(fail_dump=False)
    d, _ = _driver(tmp_path, tp)
    ex = d.executor
    st = d.state
    ex.move("m1").hold = (1,)
    ex.move("m1").dumps[1] = {"images": str(tmp_path / "img"), "pid": 7}
    ex.perform(ct.AbortRestore("m1", "n4", (1,)), st)
    ex.perform(ct.ResumeInPlace("m1", 2, "n1", "kill of the source failed"), st)
    end = time.monotonic() + 0.3
    while time.monotonic() < end:  # the serve loop runs on; the abort is still under way
        d.pump()
        time.sleep(0.01)
    hold = layout.hold_file(tmp_path, 42, "m1", 1)
    assert not hold.exists() and ex.command_for(0) is None and ex.command_for(1) is None
    release.set()
    end = time.monotonic() + 5
    while not hold.exists() and time.monotonic() < end:
        d.pump()
        time.sleep(0.01)
    assert hold.exists()
    assert all(ex.command_for(r)["command"] == "resume" and ex.command_for(r)["generation"] == 2 for r in range(3))
    assert [(n, t, b["op"]) for n, t, b in tp.calls] == [("n4", "tpassd.restore", "abort")]


def test_forged_rank_armed_does_not_consume_a_pending_pause(tmp_path):
    """rank.armed without the job's signature (none, another job's secret, a replay) is refused
    before it reaches the executor: the pause command stays pending; the rank's own signed ack lands."""
    import threading

    import zmq

    from torchpass import jobauth, wire, zmqio
    from torchpass.coordinator.server import CoordinatorServer

    secret, other = b"a" * 64, b"b" * 64
    d, _ = _driver(tmp_path, FakeTpassd(fail_dump=False))
    ex = d.executor
    d.feed(mc.NodeHealthChanged("n3", "degraded", ("x",)))
    cmd = ex.command_for(2)
    assert cmd["command"] == "pause"
    server = CoordinatorServer(d.job, bind_address="127.0.0.1", driver=d, job_secret=secret)
    t = threading.Thread(target=server.serve, daemon=True)
    t.start()
    ep = f"tcp://127.0.0.1:{server.port}"
    body = {"job_id": 42, "rank": 2, "at": cmd["at"], "generation": cmd["generation"], "collectives": 10,
            "accepted": True}
    try:
        for auth in (None, jobauth.JobSigner(other)):
            with pytest.raises(RemoteError) as refused:
                zmqio.request(ep, "rank.armed", body, timeout_s=2, retries=0, auth=auth)
            assert refused.value.code == "unauthenticated"
            assert ex.command_for(2) == cmd  # still pending
        # The rank's own signed ack lands; the same frame sent again is a replay.
        frame = wire.encode("rank.armed", body, id="r2-1", **jobauth.JobSigner(secret).envelope("rank.armed", "r2-1",
                                                                                              body))
        replies = []
        for _ in range(2):
            s = zmq.Context.instance().socket(zmq.REQ)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            s.send(frame)
            assert s.poll(2000)
            replies.append(wire.decode_reply(s.recv()))
            s.close()
        assert replies[0].ok and ex.command_for(2) is None  # acknowledged by the rank itself
        assert (replies[1].ok, replies[1].code) == (False, "unauthenticated") and "replayed" in replies[1].message
    finally:
        server.stop()
        t.join(5)


def test_a_batch_of_reports_is_decided_once_and_leaves_earlier_states_untouched(tmp_path, monkeypatch):
    d, _ = _driver(tmp_path, FakeTpassd(fail_dump=False))
    decided: list[int] = []
    real = d.decide
    monkeypatch.setattr(d, "decide", lambda: (decided.append(1), real())[1])
    before = d.state
    d.begin_batch()
    for r in range(3):
        d.feed(mc.RankProgress(r, 10 + r, 1, None))
    d.feed(mc.RankRegistered(0, "n1", 3, pid=7))
    assert decided == []  # nothing decided inside the batch
    d.end_batch()
    assert decided == [1]  # once for the batch
    assert [before.ranks[r].collectives for r in range(3)] == [0, 0, 0]  # the pre-batch state is unchanged
    assert [d.state.ranks[r].collectives for r in range(3)] == [10, 11, 12]
    assert d.state.ranks[0].pid == 7
    # After the batch, reports copy again: the state of the batch is not written into.
    batch_state = d.state
    d.feed(mc.RankProgress(1, 20, 2, None))
    assert batch_state.ranks[1].collectives == 11 and d.state.ranks[1].collectives == 20


def test_progress_reports_alone_are_decided_on_the_progress_tick(tmp_path, monkeypatch):
    from torchpass.coordinator import driver as exmod

    d, _ = _driver(tmp_path, FakeTpassd(fail_dump=False))
    now = [1000.0]
    d.clock = lambda: now[0]
    decided: list[float] = []
    real = d.decide
    monkeypatch.setattr(d, "decide", lambda: (decided.append(now[0]), real())[1])
    d.pump()
    assert decided == [1000.0]
    d.post(mc.RankProgress(0, 5, 1, None))
    now[0] += exmod.PROGRESS_TICK_S / 2
    d.pump()
    assert decided == [1000.0] and d.state.ranks[0].collectives == 5  # applied, not yet decided on
    now[0] += exmod.PROGRESS_TICK_S / 2
    d.pump()
    assert len(decided) == 2
    d.post(mc.Quiesced(0, 1, 5))  # anything else: decided at once
    d.pump()
    assert len(decided) == 3


def test_a_task_of_several_ranks_is_dumped_verified_and_restored_once(tmp_path):
    """torchrun: n2's Slurm task 1 is torchrun's agent with two workers, ranks 1 and 2 (they
    register task 1). tpassd, the rank wrapper and the restore step know tasks: one dump, one
    verify and one restore step for the task, every outcome reported for both ranks."""
    calls = []

    def request(node, type_, body, timeout_s):
        calls.append((node, type_, body.get("op"), body.get("rank")))
        if type_ == "tpassd.snapshot" and body["op"] == "dump":
            return {"images": str(tmp_path / "img"), "checksum": "c", "pid": 7, "bytes": 1}
        return {}

    tp = FakeTpassd(fail_dump=False)
    tp.request = request
    job = JobState(job_id=42, spares=1)
    pol = CoordinatorPolicy()
    d = Driver(job, pol, spares=("n4",))
    d.executor = Executor(job, state_dir=tmp_path, post=d.post, policy=pol, tpassd=tp, slurm=FakeSlurm(),
                          address_of=lambda n: "10.0.0." + n[1:], srun=str(fake_srun(tmp_path)))
    d.executor.restore_steps.output = str(tmp_path / "job.out")
    _open_executors.append(d.executor)
    for r, n, task in ((0, "n1", 0), (1, "n2", 1), (2, "n2", 1), (3, "n3", 2)):
        d.feed(mc.RankRegistered(r, n, 4, task=task))
    for n in ("n1", "n2", "n3", "n4"):
        d.feed(mc.NodeHealthChanged(n, "healthy"))
    ex = d.executor
    d.feed(mc.NodeHealthChanged("n2", "degraded", ("x",)))
    assert list(ex.moves["m1"].gates) == [1]  # one restore step for task 1, launched at the pause
    assert {r for r in range(4) if "hold_file" in ex.command_for(r)} == {1, 2}  # both workers hold
    at, gen = ex.command_for(0)["at"], ex.command_for(0)["generation"]
    for r in range(4):
        d.feed(mc.Quiesced(r, gen, at))
    # dump -> transfer -> restore (the restore wrapper refuses an image without a manifest): rollback
    _pump_until(d, lambda: any(e.kind == "migration.rollback" for e in d.job.events), timeout_s=30)
    assert [c for c in calls if c[2] == "dump"] == [("n2", "tpassd.snapshot", "dump", 1)]
    assert [c for c in calls if c[2] == "verify"] == [("n4", "tpassd.restore", "verify", 1)]
    assert (tmp_path / "srun.calls").read_text().count("\n") == 1
    m = d.state.migration
    assert set(m.images) == {1, 2} and set(m.transferred) == {1, 2}  # each worker got the task's outcome
    rb = [e for e in d.job.events if e.kind == "migration.rollback"][0]
    assert "restore on n4 failed" in rb.message, rb.message
    _pump_until(d, lambda: [c for c in calls if c[2] == "abort"], timeout_s=10)
    assert {c[3] for c in calls if c[2] == "abort"} == {1}  # the hand-off of task 1 is called off


def test_a_pause_fan_in_is_added_in_place_in_a_batch_and_decided_when_complete(tmp_path, monkeypatch):
    """Issue 13: the acknowledgments of a pause go into one set per batch (not a copy per report),
    a report that completes nothing waits for the progress tick, and the one that completes the
    phase is decided on at once. Every state outside a batch holds frozen sets; the states
    before the batch are untouched."""
    from torchpass.coordinator import driver as exmod

    d, _ = _driver(tmp_path, FakeTpassd(fail_dump=True))  # the dump after the pause fails: rolled back
    d.feed(mc.NodeHealthChanged("n3", "degraded", ("x",)))
    cmd = d.executor.command_for(0)
    assert cmd["command"] == "pause" and d.state.migration.phase.value == "pause"
    now = [time.monotonic()]
    d.clock = lambda: now[0]
    decided: list[float] = []
    real = d.decide
    monkeypatch.setattr(d, "decide", lambda: (decided.append(now[0]), real())[1])
    d.pump(force=True)
    decided.clear()
    before = d.state

    d.begin_batch()
    for r in (0, 1):
        d.feed(mc.Quiesced(r, cmd["generation"], cmd["at"]))
    d.end_batch()
    assert decided == []  # two of three: nothing to decide before the tick
    m = d.state.migration
    assert type(m.quiesced) is frozenset and m.quiesced == {0, 1} and m.ready_at is None
    assert before.migration.quiesced == frozenset()  # the state before the batch: unchanged
    now[0] += exmod.PROGRESS_TICK_S
    d.pump()
    assert decided == [now[0]]  # the tick decides on them

    d.begin_batch()
    d.feed(mc.Quiesced(2, cmd["generation"], cmd["at"]))
    d.end_batch()
    assert len(decided) == 2  # the last one: at once
    m = d.state.migration
    assert m.phase.value != "pause" or m.ready_at is not None
    assert type(m.quiesced) is frozenset and m.quiesced == {0, 1, 2}


def test_a_health_change_is_read_and_decided_on_at_the_next_pump(tmp_path, monkeypatch):
    """Issue 13: the health subscriber's on_change (Driver.health_changed) makes the next pump read
    the health view and decide, without waiting for the health poll's interval."""
    from torchpass.coordinator import driver as exmod

    d, _ = _driver(tmp_path, FakeTpassd(fail_dump=True))

    class Health:
        def __init__(self):
            self.view = {n: ("healthy", (), 0.5) for n in ("n1", "n2", "n3", "n4")}
            self.reads = 0

        def brief(self):
            self.reads += 1
            return dict(self.view)

    d.health = Health()
    now = [time.monotonic()]
    d.clock = lambda: now[0]
    d.pump(force=True)
    reads = d.health.reads
    now[0] += exmod.HEALTH_POLL_S / 4  # before the next poll is due, and no other news
    d.health.view["n3"] = ("degraded", ("xid 79",), 0.5)
    d.pump()
    assert d.health.reads == reads and d.state.migration is None  # not read: nothing said it changed
    d.health_changed()
    d.pump()
    assert d.health.reads == reads + 1
    assert d.state.migration is not None and d.state.migration.node == "n3"  # decided at once


def test_a_pauses_restore_steps_start_after_its_replies_when_the_server_says_so(tmp_path):
    """With defer_prelaunch (the coordinator's server sets it), the pause's commands are ready at
    once but its restore steps (an srun fork each) start only at run_deferred(), which the server
    calls once the pause's replies are sent; any later action runs them first."""
    tp = FakeTpassd(fail_dump=True)
    d, _ = _driver(tmp_path, tp)
    ex = d.executor
    ex.defer_prelaunch = True
    d.feed(mc.NodeHealthChanged("n2", "degraded", ("gpu0: ecc storm",)))
    assert {ex.command_for(r)["command"] for r in range(3)} == {"pause"}
    assert ex.moves["m1"].gates == {} and not (tmp_path / "srun.calls").exists()
    ex.run_deferred()
    assert list(ex.moves["m1"].gates) == [1]
    ex.run_deferred()  # nothing twice
    assert list(ex.moves["m1"].gates) == [1]
    end = time.monotonic() + 10
    while not (tmp_path / "srun.calls").exists() and time.monotonic() < end:
        time.sleep(0.01)
    assert (tmp_path / "srun.calls").read_text().count("\n") == 1


def test_a_deferred_restore_step_starts_before_the_next_action(tmp_path):
    """A rollback right after the pause (the next action) finds the restore step started, and
    calls it off, as without the deferral: nothing is left waiting at a gate."""
    tp = FakeTpassd(fail_dump=True)
    d, _ = _driver(tmp_path, tp)
    ex = d.executor
    ex.defer_prelaunch = True
    d.feed(mc.NodeHealthChanged("n2", "degraded", ("gpu0: ecc storm",)))
    at, gen = ex.command_for(0)["at"], ex.command_for(0)["generation"]
    for r in range(3):
        d.feed(mc.Quiesced(r, gen, at))
    _pump_until(d, lambda: d.state.migration is not None and d.state.migration.phase.value == "rollback")
    assert ex._deferred == [] and ex.moves["m1"].gates == {}
    assert ex.gate_file("m1", 1).read_text().strip() == "cancel"  # started, then called off


def test_a_job_ending_while_its_source_node_is_released_records_the_move_as_completed(tmp_path):
    """The serve loop ends with the job (CI, mesh3d: training ended while slurmctld was slow to
    answer the shrink). A move whose ranks already train on the target is recorded, in the event
    log tpassctl and the tests read, not lost with the coordinator."""
    from torchpass.coordinator import decide as dc
    from torchpass.coordinator.phases import Phase

    d, _ = _driver(tmp_path, FakeTpassd(fail_dump=False))
    now, pol = d.clock(), d.policy
    st = d.state
    for r in range(3):
        st = mc.apply(st, mc.RankProgress(r, 100, 10), now)

    def step(*outcomes, dt=0.1):  # the pure core alone, as far as the drain: no action runs
        nonlocal st, now
        now += dt
        for o in outcomes:
            st = mc.apply(st, o, now)
        st = dc.decide(now, st, pol).state
        return st.migration

    m = step(mc.NodeHealthChanged("n2", "degraded", ("gpu0: ecc storm",)))
    m = step(*[mc.Quiesced(r, m.generation, m.pause_at) for r in range(3)])
    m = step(mc.MigrationDumpDone(m.id, 1, "/img/r1", "sha", {}))
    m = step(mc.TransferDone(m.id, 1, m.target, "/img/r1", "sha"))
    m = step(mc.RestoreDone(m.id, 1, m.target, {}))
    m = step(mc.SourceKilled(m.id, "n2"))
    m = step(*[mc.Resumed(r, m.generation, st.ranks[r].node) for r in range(3)])
    assert m.phase == Phase.DRAIN and m.target == "n4"
    d.state = st
    layout.events_json(tmp_path, 42).parent.mkdir(parents=True)  # the coordinator's state dir
    d.close()
    done = [e for e in d.job.events if e.kind == "migration.completed"]
    assert len(done) == 1 and done[0].data["outcome"] == "completed" and d.state.migration is None
    assert "the job ended before n2 was released" in done[0].message
    assert "migration.completed" in layout.events_json(tmp_path, 42).read_text()


def _two_tasks_on_n2(tmp_path, tp) -> tuple[Driver, Executor]:
    """A driver and executor for ranks 0-3 on n1, n2, n2, n3 (two srun tasks on n2)."""
    job, pol = JobState(job_id=42, spares=1), CoordinatorPolicy()
    d = Driver(job, pol, spares=("n4",))
    ex = Executor(job, state_dir=tmp_path, post=d.post, policy=pol, tpassd=tp, slurm=FakeSlurm(),
                  address_of=lambda n: "10.0.0.1", srun=str(fake_srun(tmp_path)))
    _open_executors.append(ex)
    for r, n in enumerate(("n1", "n2", "n2", "n3")):
        d.feed(mc.RankRegistered(r, n, 4))
    return d, ex


@pytest.mark.parametrize("refuse", [False, True], ids=["killed", "refused"])
def test_a_nodes_source_copies_are_killed_in_one_request(tmp_path, refuse):
    """Two tasks on the source node: one tpassd.snapshot op=kill names both (tpassd checks
    both before it kills either, then kills them at once); its refusal is one KillFailed."""
    class KillTpassd(FakeTpassd):
        def request(self, node, type_, body, timeout_s):
            super().request(node, type_, body, timeout_s)
            if refuse and body.get("op") == "kill":
                raise RemoteError("failed", "fault drill kill-fail on n2: the source copy of rank 1 was not killed")
            return {}

    d, ex = _two_tasks_on_n2(tmp_path, tp := KillTpassd(fail_dump=False))
    ex.move("m1").dumps.update({1: {"pid": 101}, 2: {"pid": 102}})
    ex.perform(ct.KillSource("m1", "n2", (1, 2)), d.state)
    outcome = d.queue.get(timeout=5)
    kills = [(n, b) for n, t, b in tp.calls if t == "tpassd.snapshot"]
    assert kills == [("n2", {"job_id": 42, "rank": 1, "op": "kill", "pid": 101, "tasks": [[2, 102]],
                             "rank_dir": str(ex.rank_dir)})]
    if refuse:
        assert isinstance(outcome, ct.KillFailed) and "kill-fail" in outcome.why
    else:
        assert outcome == ct.SourceKilled("m1", "n2")


def test_a_rollback_does_not_wait_in_the_serve_thread_for_a_slow_source_tpassd(tmp_path):
    """Rolled back after the source node's tpassd stopped answering in time: every rank's resume
    is set at once, the held tasks' hand-offs are marked aborted together, and only then their
    hold files appear (5 s a task in the serve thread delayed every rank's resume before)."""
    both = threading.Barrier(2, timeout=10)  # broken (BrokenBarrierError) if marked one after the other

    class SlowTpassd(FakeTpassd):
        def request(self, node, type_, body, timeout_s):
            super().request(node, type_, body, timeout_s)
            if body.get("op") == "abort":
                time.sleep(1.0)
                both.wait()
            return {}

    _, ex = _two_tasks_on_n2(tmp_path, tp := SlowTpassd(fail_dump=False))
    mv = ex.move("m1")
    mv.hold, mv.hold_tasks = (1, 2), (1, 2)
    started = time.monotonic()
    ex.migrations.finish_resume_in_place(ct.ResumeInPlace("m1", 2, "n1", "dump failed"), (0, 1, 2, 3), "n2")
    assert time.monotonic() - started < 0.5
    assert all(ex.command_for(r)["command"] == "resume" for r in range(4))
    holds = [layout.hold_file(tmp_path, 42, "m1", r) for r in (1, 2)]
    assert not any(h.exists() for h in holds)
    until(lambda: all(h.exists() for h in holds), "both hold files", 15.0)
    assert not both.broken
    assert sorted(b["rank"] for _, _, b in tp.calls if b["op"] == "abort") == [1, 2]


def test_the_jobs_output_file_given_at_the_start_is_not_asked_again(tmp_path):
    """main.py passes Slurm's record of the job's output file: the first restore step, launched in
    the serve thread at a pause, does not ask slurmctld (15 s at most, when it is away)."""
    class CountingSlurm(FakeSlurm):
        asked = 0

        def job(self, job_id):
            CountingSlurm.asked += 1
            raise AssertionError("slurmctld asked for the job's output file")

    job, pol = JobState(job_id=42, spares=1), CoordinatorPolicy()
    ex = Executor(job, state_dir=tmp_path, post=lambda o: None, policy=pol, slurm=CountingSlurm(),
                  srun=str(fake_srun(tmp_path)), output="/home/u/slurm-42.out")
    _open_executors.append(ex)
    argv = ex.restore_argv(ct.Restore("m1", 1, "n4", "/img/r1", "sha"))
    assert argv[argv.index("-o") + 1] == "/home/u/slurm-42.out" and CountingSlurm.asked == 0


def _relaunch_n2_to_n4(tmp_path, tp) -> str:
    """A relaunch of job 42 (hosts n1..n3) from snapshot s1 with n4 in n2's place, by an executor
    with no Slurm: the verdict file's text, once written (5 s at most)."""
    d, _ = _driver(tmp_path, tp)
    d.executor.slurm = None
    layout.hostfile(tmp_path, 42).parent.mkdir(parents=True, exist_ok=True)
    layout.hostfile(tmp_path, 42).write_text("n1\nn2\nn3\n")
    d.executor.perform(ct.Relaunch(1, (("n2", "n4"),), 0, "s1"), d.state)
    verdict = layout.relaunch_file(tmp_path, 42)
    end = time.monotonic() + 5
    while not verdict.exists() and time.monotonic() < end:
        time.sleep(0.01)
    return verdict.read_text()


def test_a_relaunch_from_a_snapshot_is_prepared_on_every_node_before_its_verdict(tmp_path):
    """Each node of the new host file gets its restore token (tpassd.restore op=prepare, kind snapshot)
    before the verdict lets srun's exit hook start the step again: its tasks take the token at launch."""
    seen: list[tuple[str, bool]] = []
    verdict = layout.relaunch_file(tmp_path, 42)

    class Tp(FakeTpassd):
        def request(self, node, type_, body, timeout_s):
            seen.append((node, verdict.exists()))
            return super().request(node, type_, body, timeout_s)

    tp = Tp(fail_dump=False)
    assert "snapshot=s1" in _relaunch_n2_to_n4(tmp_path, tp)
    assert sorted(seen) == [("n1", False), ("n3", False), ("n4", False)]
    assert {(t, b["op"], b["kind"], b["snapshot"]) for _, t, b in tp.calls} == {
        ("tpassd.restore", "prepare", "snapshot", "s1")}


def test_a_node_whose_tpassd_did_not_answer_the_prepare_is_asked_again_before_the_verdict(tmp_path):
    """A node's tpassd that misses the first prepare (a loaded node) is asked once more, given longer,
    before the verdict: without its token the node's tasks of the relaunched step fail to restore."""
    from torchpass.coordinator.lost_node_actions import RETRY_PREPARE_TIMEOUT_S
    from torchpass.errors import UnreachableError

    seen: list[tuple[str, float, bool]] = []
    verdict = layout.relaunch_file(tmp_path, 42)

    class Tp(FakeTpassd):
        def request(self, node, type_, body, timeout_s):
            seen.append((node, timeout_s, verdict.exists()))
            if node == "n1" and len([s for s in seen if s[0] == "n1"]) == 1:
                raise UnreachableError("no reply from n1's tpassd")
            return super().request(node, type_, body, timeout_s)

    assert "snapshot=s1" in _relaunch_n2_to_n4(tmp_path, Tp(fail_dump=False))
    assert [s for s in seen if s[0] == "n1"] == [("n1", 5.0, False), ("n1", RETRY_PREPARE_TIMEOUT_S, False)]
    assert sorted(s[0] for s in seen) == ["n1", "n1", "n3", "n4"]


@pytest.mark.parametrize("abort", ["answered", "unanswered"])
def test_a_restored_copy_whose_abort_tpassd_does_not_answer_gives_the_rank_record_back(tmp_path, abort):
    """The copy restored on the target names itself in the rank record (its ``previous``: the copy
    the move started from). tpassd's abort puts ``previous`` back; when tpassd does not answer, the
    coordinator does it before srun ends the step. Left naming the killed copy, the record would
    make the surviving copy write no exit code when the rank ends, and the rank's first task
    wrapper would wait for one for ever (the job never ends)."""
    import json

    from torchpass.errors import TorchpassError

    class AbortTpassd(FakeTpassd):
        def request(self, node, type_, body, timeout_s):
            super().request(node, type_, body, timeout_s)
            if type_ == "tpassd.restore" and body["op"] == "abort" and abort == "unanswered":
                raise TorchpassError("tpassd on n4 did not answer in 10 s")
            return {}

    tp = AbortTpassd(fail_dump=False)
    d, _ = _driver(tmp_path, tp)
    ex = d.executor
    images = str(tmp_path / "img")
    record = layout.rank_record(layout.rank_records_dir(tmp_path, 42), 42, 1)
    record.parent.mkdir(parents=True)
    source = {"job": "42", "rank": "1", "wrapper_pid": 111, "pid": 7, "node": "n2", "restored_from": "gen1"}
    restored = {"job": "42", "rank": "1", "wrapper_pid": 222, "pid": 8, "node": "n4", "restored_from": images,
                "previous": source}
    record.write_text(json.dumps(restored))
    ex.move("m1").dumps[1] = {"images": images, "pid": 7}
    ex.perform(ct.AbortRestore("m1", "n4", (1,)), d.state)
    for t in ex.move("m1").aborts:
        t.join(10)
    want = source if abort == "unanswered" else restored  # answered: tpassd (root) rewrote it, not this fake
    assert json.loads(record.read_text()) == want
    assert [(n, t, b["op"]) for n, t, b in tp.calls] == [("n4", "tpassd.restore", "abort")]


def test_giving_the_record_back_leaves_a_record_that_names_another_copy(tmp_path):
    import json

    d, _ = _driver(tmp_path, FakeTpassd(fail_dump=False))
    record = layout.rank_record(layout.rank_records_dir(tmp_path, 42), 42, 1)
    record.parent.mkdir(parents=True)
    other = {"wrapper_pid": 333, "pid": 9, "node": "n3", "restored_from": "gen2", "previous": {"wrapper_pid": 1}}
    record.write_text(json.dumps(other))
    d.executor.migrations.give_record_back(1, "n4", str(tmp_path / "img"))
    assert json.loads(record.read_text()) == other
