"""Fail-slow: the ranks' compute-time meter and the coordinator's pure rule (decide_failslow), with
the guards (one-off slow steps, a whole-job slowdown, a short slowdown, steps too short to judge),
driven by hand with an injected clock."""

from __future__ import annotations

import pytest

from torchpass.coordinator import decide_failslow as failslow
from torchpass.coordinator import machine as mc
from torchpass.coordinator.contract import Event, RequestSpare
from torchpass.coordinator.decide import decide
from torchpass.coordinator.model import CoordState, Trigger
from torchpass.coordinator.policy import CoordinatorPolicy
from torchpass.errors import ConfigError
from torchpass.health import State
from torchpass.runtime.compute_time import NOT_MEASURED, ComputeMeter

P = CoordinatorPolicy()  # the defaults: 1.5x, 3 windows of 10 steps, 20 ms excess, 15 s sustained
FAST, SLOW = 0.050, 0.120


# --- the rank's meter ------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Future:
    def __init__(self):
        self.callbacks = []

    def add_done_callback(self, cb):
        self.callbacks.append(cb)

    def complete(self):
        for cb in self.callbacks:
            cb(self)


class Work:
    def __init__(self):
        self.future = Future()

    def get_future(self):
        return self.future


def test_compute_time_is_the_step_minus_the_time_a_collective_is_in_flight():
    clock = Clock()
    m = ComputeMeter(clock)
    m.step_ended()  # the first step: set-up, no figure
    assert m.pending() == {}
    clock.t += 0.030  # forward and backward
    w = Work()
    m.issued(w)
    clock.t += 0.200  # waiting for a slow peer: not compute
    w.future.complete()
    clock.t += 0.010  # the optimizer step
    m.step_ended()
    # a synchronous collective that completes at once (the slow rank itself)
    clock.t += 0.090
    w2 = Work()
    m.issued(w2)
    w2.future.complete()
    clock.t += 0.030
    m.step_ended()
    assert m.pending() == {"compute_s": [0.04, 0.12], "compute_step": 3}
    m.sent(2)
    assert m.pending() == {"compute_s": [0.12], "compute_step": 3}
    m.sent(3)
    assert m.pending() == {}


def test_overlapping_collectives_count_once_and_a_paused_step_is_not_measured():
    clock = Clock()
    m = ComputeMeter(clock)
    m.step_ended()
    a, b = Work(), Work()
    clock.t += 0.010
    m.issued(a)
    clock.t += 0.020  # compute beside a's all-reduce: not counted
    m.issued(b)
    clock.t += 0.050
    a.future.complete()
    clock.t += 0.050
    b.future.complete()  # nothing in flight from here
    clock.t += 0.005
    m.step_ended()
    m.paused()  # a migration in the next step
    clock.t += 5.0
    m.step_ended()
    # a collective whose Work never completes does not stop the next step's measurement
    m.issued(Work())
    m.step_ended()
    clock.t += 0.007
    m.step_ended()
    figures = m.pending()["compute_s"]
    assert figures[:2] == [pytest.approx(0.015), NOT_MEASURED]
    assert figures[3] == pytest.approx(0.007)


# --- the wire's figures --------------------------------------------------------------------
def test_bad_figures_are_dropped_never_the_report():
    assert failslow.compute_figures({"compute_s": [0.1, -1, 2], "compute_step": 9}) == ((0.1, -1.0, 2.0), 9)
    for bad in ({"compute_s": [0.1, True], "compute_step": 9}, {"compute_s": [-0.5], "compute_step": 9},
                {"compute_s": [0.1] * 65, "compute_step": 99}, {"compute_s": [0.1], "compute_step": -1},
                {"compute_s": "0.1", "compute_step": 1}, {}):
        assert failslow.compute_figures(bad) == ((), -1)


def test_a_report_sent_twice_is_taken_once_and_a_restart_starts_afresh():
    st = mc.apply(CoordState(job_id=1), mc.RankRegistered(0, "node1", 1), 0.0)
    st = mc.apply(st, mc.RankProgress(0, 10, 3, compute=(0.1, 0.2), compute_step=3), 1.0)
    st = mc.apply(st, mc.RankProgress(0, 12, 4, compute=(0.1, 0.2, 0.3), compute_step=4), 2.0)
    assert st.ranks[0].compute == (0.1, 0.2, 0.3) and st.ranks[0].compute_step == 4
    st = mc.apply(st, mc.RankProgress(0, 12, 4, compute=(0.3,), compute_step=4), 3.0)
    assert st.ranks[0].compute == (0.1, 0.2, 0.3)
    st = mc.apply(st, mc.RankProgress(0, 2, 1, compute=(0.9,), compute_step=1), 4.0)
    assert st.ranks[0].compute == (0.9,) and st.ranks[0].compute_step == 1


# --- the rule ------------------------------------------------------------------------------
class Job:
    """Three training nodes of two ranks each and a hot spare; every rank reports its figures."""

    def __init__(self, nodes=("node1", "node2", "node3"), per_node=2, policy=P):
        self.now, self.policy, self.step = 1000.0, policy, 0
        self.state = CoordState(job_id=7)
        self.events: list[Event] = []
        self.actions: list = []
        self.nodes = {n: tuple(range(i * per_node, (i + 1) * per_node)) for i, n in enumerate(nodes)}
        for n, ranks in self.nodes.items():
            for r in ranks:
                self.feed(mc.RankRegistered(r, n, len(nodes) * per_node))
        for n in (*nodes, "node4"):
            self.feed(mc.NodeHealthChanged(n, State.HEALTHY))
        self.feed(mc.SpareAdded("node4"))

    def feed(self, *events):
        for ev in events:
            self.state = mc.apply(self.state, ev, self.now)

    def train(self, seconds: float, figure, step_s: float = 0.1):
        """``seconds`` of training, one report per rank a second; ``figure(rank, step)`` is the
        rank's compute time of that step. Returns the events decided."""
        out = []
        for _ in range(int(seconds)):
            first = self.step + 1
            self.step += int(1 / step_s)
            for r in self.state.ranks:
                figs = tuple(figure(r, s) for s in range(first, self.step + 1))
                self.feed(mc.RankProgress(r, self.step * 2, self.step, compute=figs, compute_step=self.step))
            self.now += 1.0
            d = decide(self.now, self.state, self.policy)
            self.state = d.state
            self.actions += d.actions
            out += [a for a in d.actions if isinstance(a, Event)]
        self.events += out
        return out

    def kinds(self):
        return [e.kind for e in self.events]


def slow_on(job: Job, node: str, slow: float = SLOW, fast: float = FAST):
    ranks = job.nodes[node]
    return lambda r, s: slow if r in ranks else fast


def test_a_node_slower_than_its_peers_moves_to_a_spare_saying_what_was_measured():
    job = Job()
    assert job.train(10, lambda r, s: FAST) == []
    job.train(40, slow_on(job, "node2"))
    detected = [e for e in job.events if e.kind == "failslow.detected"]
    assert len(detected) == 1, job.kinds()
    d = detected[0].data
    assert d["node"] == "node2" and d["ratio"] == pytest.approx(SLOW / FAST, rel=1e-3)
    assert d["node_compute_s"] == SLOW and d["peers_median_s"] == FAST
    assert (d["window_steps"], d["windows"]) == (10, 3) and d["slow_for_s"] >= P.failslow_sustain_s
    started = next(e for e in job.events if e.kind == "migration.started")
    assert started.data["node"] == "node2" and started.data["trigger"] == Trigger.FAILSLOW
    assert job.state.migration is not None and job.state.migration.node == "node2"
    # the same planned move as a degrading node's: to the hot spare
    assert job.state.migration.target == "node4" or any(isinstance(a, RequestSpare) for a in job.actions)


def test_the_decision_waits_for_the_windows_and_the_sustain_time():
    job = Job()
    job.train(10, lambda r, s: FAST)
    job.train(int(P.failslow_sustain_s) - 1, slow_on(job, "node2"))
    assert "failslow.detected" not in job.kinds()
    assert "node2" in job.state.slow  # found slow, not yet for long enough
    job.train(6, slow_on(job, "node2"))
    assert "failslow.detected" in job.kinds()


def test_one_off_slow_steps_move_nothing():
    job = Job()
    # node2's ranks take 10x as long every fourth step: each window's median is still its peers'
    job.train(60, lambda r, s: FAST * 10 if r in job.nodes["node2"] and s % 4 == 0 else FAST)
    assert job.state.slow == {} and "failslow.detected" not in job.kinds()


def test_a_slowdown_of_the_whole_job_moves_nothing():
    job = Job()
    job.train(10, lambda r, s: FAST)
    job.train(60, lambda r, s: SLOW * (1.02 if r % 2 else 1.0))  # every node slower, within noise of each other
    assert job.state.slow == {} and "failslow.detected" not in job.kinds()


def test_a_short_slowdown_moves_nothing():
    job = Job()
    job.train(10, lambda r, s: FAST)
    job.train(5, slow_on(job, "node3", slow=FAST * 10))
    job.train(60, lambda r, s: FAST)
    assert "failslow.detected" not in job.kinds() and job.state.migration is None
    assert job.state.slow == {}


def test_steps_too_short_to_judge_move_nothing():
    job = Job()
    job.train(60, slow_on(job, "node1", slow=0.004, fast=0.001))  # 4x, but 3 ms: a scheduler's noise
    assert "failslow.detected" not in job.kinds()


def test_a_paused_rank_gives_no_verdict_until_its_windows_are_measured_again():
    job = Job()
    job.train(10, lambda r, s: FAST)
    job.train(60, lambda r, s: NOT_MEASURED if r == 0 else (SLOW if r in job.nodes["node2"] else FAST))
    assert job.state.slow == {}


def test_fail_slow_off_and_bad_thresholds():
    job = Job(policy=CoordinatorPolicy(failslow_ratio=0))
    job.train(60, slow_on(job, "node2"))
    assert "failslow.detected" not in job.kinds()
    for bad in ({"failslow_ratio": 1.0}, {"failslow_window_steps": 1}, {"failslow_windows": 0},
                {"failslow_window_steps": 50, "failslow_windows": 3}, {"failslow_sustain_s": -1},
                {"failslow_min_excess_s": -0.1}):
        with pytest.raises(ConfigError, match="failslow"):
            CoordinatorPolicy(**bad).validate()


def test_a_slow_node_among_many_is_found_by_the_job_wide_median():
    nodes = tuple(f"n{i}" for i in range(failslow.EXACT_PEERS + 6))  # past the exact peers' median
    job = Job(nodes=nodes, per_node=1)
    job.train(45, slow_on(job, "n7"))
    assert [e.data["node"] for e in job.events if e.kind == "failslow.detected"] == ["n7"]


def test_job_status_says_what_the_rule_sees_per_node():
    from torchpass.coordinator.job_record import JobState, compute_status

    job = Job()
    job.train(20, slow_on(job, "node3"))
    seen = compute_status(job.state, job.now)
    assert seen["compute_per_node_s"] == {"node1": FAST, "node2": FAST, "node3": SLOW}
    assert set(seen["slow_nodes"]) == {"node3"} and seen["slow_nodes"]["node3"]["ratio"] == pytest.approx(2.4)
    assert JobState(job_id=7).status(job.now, job.state)["compute_per_node_s"] == seen["compute_per_node_s"]
