"""The reroute wired into the pure decision core: a data rail down on one node of the job pauses
every rank at one collective and resumes them in place on the rails left (nothing dumped, no rank
moved); a flapping rail gives one reroute; the rail back for the hysteresis restores the original
rails; a node whose last rail is down is left to the migration rules; jobs without rails see none of
it. Driven with an injected clock, the executor played by hand (machine.apply)."""

from __future__ import annotations

import pytest

from torchpass.coordinator import contract as ct
from torchpass.coordinator import machine as mc
from torchpass.coordinator.decide import decide
from torchpass.coordinator.decide_reroute import RETRY_AFTER_FAILED_S
from torchpass.coordinator.model import CoordState
from torchpass.coordinator.policy import CoordinatorPolicy
from torchpass.health_state import State

P = CoordinatorPolicy(pause_timeout_s=10.0, rebuild_timeout_s=10.0, rail_restore_after_s=30.0)
NODES = ("node1", "node2")
RAILS = ("rail0", "rail1")
UP = (("rail0", "healthy"), ("rail1", "healthy"))


class Sim:
    def __init__(self, rails=RAILS):
        self.now = 1000.0
        self.state = CoordState(job_id=7)
        self.actions: list = []
        for r, n in enumerate(NODES):
            self.feed(mc.RankRegistered(r, n, len(NODES)))
        if rails:
            self.feed(ct.JobRails(rails))
        self.health("node1", UP)
        self.health("node2", UP)
        self.feed(*[mc.RankProgress(r, 100, 10) for r in range(len(NODES))])
        self.tick()

    def feed(self, *events):
        for ev in events:
            self.state = mc.apply(self.state, ev, self.now)

    def health(self, node, rails, state=State.HEALTHY):
        self.feed(ct.NodeHealthChanged(node, state, (), True, rails))

    def tick(self, dt: float = 0.0, *events) -> list:
        self.now += dt
        self.feed(*events)
        d = decide(self.now, self.state, P, strict=True)
        self.state = d.state
        self.actions.extend(d.actions)
        return list(d.actions)

    def of(self, cls, acts=None) -> list:
        return [a for a in (self.actions if acts is None else acts) if isinstance(a, cls)]

    def events(self, kind: str) -> list:
        return [a for a in self.of(ct.Event) if a.kind == kind]

    def reroute(self, pause: ct.PauseAt, quiesce_dt: float = 0.3, resume_dt: float = 0.2) -> ct.ResumeInPlace:
        acts = self.tick(quiesce_dt, *[mc.Quiesced(r, pause.generation, pause.at) for r in range(len(NODES))])
        (resume,) = self.of(ct.ResumeInPlace, acts)
        self.tick(resume_dt, *[mc.Resumed(r, pause.generation) for r in range(len(NODES))])
        return resume


def test_a_rail_down_on_one_node_reroutes_every_rank_in_place_onto_the_rails_left():
    sim = Sim()
    sim.health("node2", (("rail0", "failed"), ("rail1", "healthy")))
    acts = sim.tick(1.0)
    (down,) = sim.events("link.down")
    assert down.data["rail"] == "rail0" and down.data["nodes"] == ["node2"]
    (pause,) = sim.of(ct.PauseAt, acts)
    assert pause.hold_ranks == () and pause.generation == 1  # nobody is held: nothing is dumped
    resume = sim.reroute(pause)
    assert resume.rails == ("rail1",) and resume.master == "node1" and resume.generation == 1
    (done,) = sim.events("link.rerouted")
    assert done.data["rails"] == ["rail1"] and done.data["rails_before"] == ["rail0", "rail1"]
    assert done.data["pause_s"] == pytest.approx(0.2)  # the last rank at T to the last resumed
    assert sim.state.snapshot is None and sim.state.generation == 1 and sim.state.migration is None
    assert not sim.of(ct.DumpRank) and not sim.of(ct.CommitSnapshot) and not sim.of(ct.DiscardSnapshot)
    assert {r: v.node for r, v in sim.state.ranks.items()} == {0: "node1", 1: "node2"}
    assert not sim.events("snapshot.started") and not sim.events("snapshot.completed")


def test_the_rail_back_for_the_hysteresis_restores_the_original_rails():
    sim = Sim()
    sim.health("node2", (("rail0", "failed"), ("rail1", "healthy")))
    sim.reroute(sim.of(ct.PauseAt, sim.tick(1.0))[0])
    sim.health("node2", UP)
    sim.tick(0.5)  # usable on every node from here
    assert not sim.of(ct.PauseAt, sim.tick(P.rail_restore_after_s - 1.0))  # not yet: the hysteresis
    (pause,) = sim.of(ct.PauseAt, sim.tick(2.0))
    resume = sim.reroute(pause)
    assert resume.rails == RAILS
    (back,) = sim.events("link.restored")
    assert back.data["rails"] == list(RAILS)


def test_a_rail_that_flaps_five_times_gives_one_reroute():
    sim = Sim()
    pauses = []
    for _ in range(5):
        sim.health("node1", (("rail0", "failed"), ("rail1", "healthy")))
        pauses += sim.of(ct.PauseAt, sim.tick(1.0))
        if sim.state.snapshot is not None and sim.of(ct.PauseAt):
            sim.reroute(sim.of(ct.PauseAt)[-1])
        sim.health("node1", (("rail0", "degraded"), ("rail1", "healthy")))  # up again, flaps counted
        sim.tick(5.0)
        sim.health("node1", UP)
        sim.tick(5.0)
    assert len(sim.of(ct.PauseAt)) == 1 and len(sim.events("link.rerouted")) == 1


def test_a_node_with_no_rail_left_is_not_rerouted():
    sim = Sim()
    sim.health("node2", (("rail0", "failed"), ("rail1", "failed")), State.FAILED)
    sim.tick(1.0)
    assert not sim.events("link.rerouted") and not any(p.hold_ranks == () for p in sim.of(ct.PauseAt))
    assert sim.state.rail_plan.using == RAILS


def test_a_job_without_rails_ignores_rail_states():
    sim = Sim(rails=())
    sim.health("node2", (("rail0", "failed"), ("rail1", "healthy")))
    sim.tick(1.0)
    assert sim.state.rail_plan is None and not sim.of(ct.PauseAt) and not sim.events("link.down")


def test_a_refused_pause_resumes_on_the_rails_in_use_and_says_so():
    sim = Sim()
    sim.health("node2", (("rail0", "failed"), ("rail1", "healthy")))
    (pause,) = sim.of(ct.PauseAt, sim.tick(1.0))
    acts = sim.tick(P.pause_timeout_s + 0.1, mc.Quiesced(0, pause.generation, pause.at))
    (resume,) = sim.of(ct.ResumeInPlace, acts)
    assert resume.rails == ()  # the rails they have
    sim.tick(0.2, *[mc.Resumed(r, pause.generation) for r in range(2)])
    (failed,) = sim.events("link.reroute_failed")
    assert "did not quiesce" in failed.data["why"]
    assert sim.state.rail_plan.using == RAILS
    # The rail is still down: one more try, but not at once (each try stands the job still).
    assert not sim.of(ct.PauseAt, sim.tick(RETRY_AFTER_FAILED_S - 1.0))
    (again,) = sim.of(ct.PauseAt, sim.tick(1.5))
    assert again.hold_ranks == () and again.generation == 2


def test_status_shows_the_rails_the_job_uses():
    from torchpass.coordinator.job_record import rails_status
    from tpassctl.status_cmd import job_lines

    sim = Sim()
    assert rails_status(sim.state) == {"rails": {"all": list(RAILS), "using": list(RAILS), "down": []}}
    sim.health("node2", (("rail0", "failed"), ("rail1", "healthy")))
    sim.reroute(sim.of(ct.PauseAt, sim.tick(1.0))[0])
    shown = rails_status(sim.state)
    assert shown == {"rails": {"all": list(RAILS), "using": ["rail1"], "down": ["rail0"]}}
    row = {"job_id": 7, "state": "running", "reachable": True, **shown}
    assert "  data rails: rail1 (rail0 left out); unusable now: rail0" in job_lines(row)
    assert rails_status(Sim(rails=()).state) == {}
