"""The coordinator's driver + executor without Slurm or tpassd: fake tpassd answers, real decisions.

A migration whose snapshot fails rolls back: every rank gets a resume command
for the armed generation, the held rank's hold file appears (it resumes in
place), the source node is not drained, and the job's events say so.
"""

from __future__ import annotations

import time

from torchpass.coordinator import machine as mc
from torchpass.coordinator.executor import Driver, Executor, hold_file, resume_port
from torchpass.coordinator.policy import CoordinatorPolicy
from torchpass.coordinator.state import JobState
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


class FakeSlurm:
    def __init__(self):
        self.drained: list[tuple[str, str]] = []

    def drain(self, node, reason):
        self.drained.append((node, reason))


def _driver(tmp_path, tp):
    job = JobState(job_id=42, spares=1)
    pol = CoordinatorPolicy()
    d = Driver(job, pol, spares=("n4",))
    slurm = FakeSlurm()
    d.executor = Executor(job, state_dir=tmp_path, post=d.post, policy=pol, tpassd=tp, slurm=slurm,
                          address_of=lambda n: {"n1": "10.0.0.1", "n2": "10.0.0.2", "n3": "10.0.0.3",
                                                "n4": "10.0.0.4"}[n])
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
    hf = hold_file(tmp_path, 42, "m1", 1)
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
                      "master_port": resume_port(42, gen)}
    assert all(ex.command_for(r) == resume for r in range(3))
    assert hf.exists()  # the held source copy wakes up where it is
    assert ("n2", "tpassd.snapshot") in [(n, t) for n, t, b in tp.calls if b["op"] == "abort"]
    for r in range(3):
        ex.acknowledge(r, "resume", gen)
        d.feed(mc.Resumed(r, gen, ("n1", "n2", "n3")[r]))
    kinds = [e.kind for e in d.job.events]
    assert kinds[-2:] == ["migration.rollback", "migration.rolled_back"], kinds
    assert "dump failed" in d.job.events[-1].message and d.state.migration is None
    assert slurm.drained == []
    assert (tmp_path / "jobs" / "42" / "events.json").exists()


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
