"""A rank that dies on a live node (decide_rank_death): pure decisions with a hand-moved clock.

A death matched to a GPU fault of its node within death_event_window_s relaunches the job from its
newest restore point with a spare in the node's place and drains the node with a reason naming the
fault; a death with no fault waits the window, then relaunches on the same nodes at most
max_unexplained_relaunches times; no restore point, or no relaunch left: the wrappers are released
to exit as their ranks did, with an event that says why."""

from __future__ import annotations

from test_decide import P, Sim
from torchpass.coordinator import machine as mc
from torchpass.coordinator.contract import HandToSlurm, Relaunch
from torchpass.coordinator.decide_rank_death import gpu_fault
from torchpass.coordinator.model import CoordState, NodeHealth, SnapshotPoint
from torchpass.coordinator.relaunch_phases import RelaunchKind, RelaunchPhase
from torchpass.health import State

XID79 = "gpu0: Xid 79 (GPU has fallen off the bus) within the last 300 s"
LOST = "gpu0: GPU is lost (NVML_ERROR_GPU_IS_LOST): fell off the bus or hung"


def _sim(restore: str = "snapshot") -> Sim:
    sim = Sim(per_node=1)
    if restore == "snapshot":
        sim.state = _with(sim.state, last_snapshot=SnapshotPoint("s1", 6, 2, 0, 3))
    elif restore == "checkpoint":
        sim.feed(mc.CheckpointCompleted(5, "/ckpt/5"))
    sim.tick(0.1)
    return sim


def _with(st, **kw):
    from dataclasses import replace
    return replace(st, **kw)


def _gpu_dies(sim: Sim, node: str = "node2", rank: int = 1, dt: float = 0.2):
    return sim.tick(dt, mc.NodeHealthChanged(node, State.FAILED, (XID79, LOST)),
                    mc.RankExited(rank, node, "killed by signal 9 (SIGKILL)", 0))


def test_a_death_with_a_gpu_fault_relaunches_from_the_snapshot_with_the_spare_and_drains_the_node():
    sim = _sim()
    d = _gpu_dies(sim)
    (rl,) = sim.of(d, Relaunch)
    assert rl.replaced == (("node2", "node4"),) and rl.snapshot == "s1" and rl.checkpoint_step == 6
    (hand,) = sim.of(d, HandToSlurm)
    assert hand.node == "node2" and hand.reason.startswith("torchpass: node2 GPU failed under rank 1")
    assert "Xid 79" in hand.reason and not hand.end_job and len(hand.reason) <= 200  # tpassd's limit
    assert sim.state.relaunch.kind == RelaunchKind.RANK_DIED and sim.state.relaunch.phase == RelaunchPhase.RESTORING
    assert "node2" in sim.state.handed and sim.state.deaths == ()
    (died,) = sim.events("rank.died")
    assert died.data["cause"] == "hardware" and died.data["faults"]["node2"].startswith("GPU failed under rank 1")
    assert "GPU is lost" in died.data["reasons"]["node2"]  # every reason in the event
    assert sim.events("node.faulted") and sim.events("job.relaunching")
    assert not sim.events("migration.started")  # the death wins over a migration of the failed node


def test_the_survivors_deaths_are_absorbed_by_the_one_relaunch_and_their_wrappers_hold():
    sim = _sim()
    sim.tick(0.0, mc.RankExited(1, "node2", "killed by signal 9 (SIGKILL)"))
    sim.tick(0.01, mc.RankExited(0, "node1", "exit code 1"), mc.RankExited(2, "node3", "exit code 1"))
    assert not sim.events("job.relaunching")  # no fault yet: the window is open
    assert mc.death_verdict(sim.state, 0, "node1") == "hold"
    sim.tick(1.0, mc.NodeHealthChanged("node2", State.FAILED, (XID79,)))
    assert len(sim.events("job.relaunching")) == 1
    (rl,) = [a for a in sim.actions if isinstance(a, Relaunch)]
    assert rl.replaced == (("node2", "node4"),) and rl.ended_on == ("node1", "node3")
    # held until the relaunch ends the step (and the wrappers with it)
    assert {mc.death_verdict(sim.state, r, n) for r, n in ((0, "node1"), (1, "node2"), (2, "node3"))} == {"hold"}
    sim.tick(0.1, mc.RankExited(0, "node1", "exit code 1"))  # a held wrapper asks again: no new death
    assert sim.state.deaths == ()


def test_a_migration_started_by_the_gpu_fault_ends_when_the_rank_dies_and_the_job_is_relaunched():
    sim = _sim()
    sim.tick(0.2, mc.NodeHealthChanged("node2", State.FAILED, (XID79,)))
    assert sim.m is not None and sim.m.node == "node2"
    d = sim.tick(0.05, mc.RankExited(1, "node2", "killed by signal 9 (SIGKILL)"))
    assert sim.m is None and sim.events("migration.rank_died")
    (rl,) = sim.of(d, Relaunch)
    assert rl.replaced == (("node2", "node4"),)


def test_a_paused_migration_ended_by_a_death_with_no_relaunch_resumes_the_survivors():
    from torchpass.coordinator.contract import ResumeInPlace

    sim = _sim(restore="none")
    sim.tick(0.2, mc.NodeHealthChanged("node2", State.FAILED, (XID79,)))
    assert sim.m is not None and sim.m.paused
    d = sim.tick(0.05, mc.RankExited(1, "node2", "killed by signal 9 (SIGKILL)"))
    assert sim.m is None and sim.of(d, ResumeInPlace) and sim.events("job.not_relaunched")


def test_a_fault_outside_the_window_does_not_explain_the_death():
    h = NodeHealth("node2", State.FAILED, (XID79,), since=100.0)
    assert gpu_fault(h, 100.0 + P.death_event_window_s + 0.1, P.death_event_window_s) == ""
    assert gpu_fault(h, 100.0 - P.death_event_window_s + 0.1, P.death_event_window_s).startswith("gpu0: Xid 79")
    assert gpu_fault(NodeHealth("node2", State.FAILED, ("disk full",), since=100.0), 100.0, 10.0) == ""
    assert gpu_fault(NodeHealth("node2", State.HEALTHY, (), since=100.0), 100.0, 10.0) == ""


def test_a_death_with_no_fault_waits_the_window_then_relaunches_once_on_the_same_nodes():
    sim = _sim(restore="checkpoint")
    sim.tick(0.1, mc.RankExited(1, "node2", "exit code 1"))
    sim.tick(P.death_event_window_s - 0.5)
    assert not sim.events("job.relaunching")
    d = sim.tick(1.0)
    (rl,) = sim.of(d, Relaunch)
    assert rl.replaced == () and rl.ended_on == ("node2",) and rl.checkpoint_step == 5
    assert not sim.of(d, HandToSlurm)  # no node is at fault
    assert sim.events("rank.died")[0].data["cause"] == "unexplained"
    assert sim.state.unexplained_relaunches == 1
    # the relaunched ranks register; the bug kills rank 1 again: released, the job ends as without torchpass
    sim.tick(5.0, *[mc.RankRegistered(r, n, 3) for r, n in enumerate(("node1", "node2", "node3"))])
    assert sim.state.relaunch is None
    sim.tick(1.0, mc.RankExited(1, "node2", "exit code 1"))
    assert mc.death_verdict(sim.state, 1, "node2") == "hold"
    d = sim.tick(P.death_event_window_s + 0.1)
    assert not sim.of(d, Relaunch)
    (ended,) = sim.events("job.not_relaunched")
    assert "max_unexplained_relaunches = 1" in ended.message and "without torchpass" in ended.message
    assert mc.death_verdict(sim.state, 1, "node2") == "exit"
    # a survivor's death afterwards is released at once
    sim.tick(0.1, mc.RankExited(0, "node1", "exit code 1"))
    sim.tick(0.0)
    assert mc.death_verdict(sim.state, 0, "node1") == "exit"
    assert len(sim.events("job.not_relaunched")) == 1


def test_no_restore_point_ends_the_job_as_without_torchpass_with_an_event_and_still_drains_the_faulted_node():
    sim = _sim(restore="none")
    d = _gpu_dies(sim)
    assert not sim.of(d, Relaunch)
    (ended,) = sim.events("job.not_relaunched")
    assert "no complete snapshot" in ended.message and "GPU fault" in ended.message
    (hand,) = sim.of(d, HandToSlurm)
    assert hand.node == "node2" and "Xid 79" in hand.reason and "not relaunched" in hand.reason
    assert mc.death_verdict(sim.state, 1, "node2") == "exit"
    sim.tick(5.0)
    assert not sim.events("migration.started")  # the failed node is handed over, not moved


def test_max_unexplained_relaunches_zero_never_relaunches_a_death_with_no_fault():
    sim = _sim()
    sim.policy = _with(P, max_unexplained_relaunches=0)
    sim.tick(0.1, mc.RankExited(1, "node2", "exit code 1"))
    sim.tick(P.death_event_window_s + 0.1)
    assert not [a for a in sim.actions if isinstance(a, Relaunch)] and sim.events("job.not_relaunched")


def test_an_unknown_rank_or_a_wrapper_of_a_step_relaunched_since_is_told_to_exit_or_hold():
    sim = _sim()
    sim.tick(0.1, mc.RankExited(9, "node2", "exit code 1"))
    assert sim.state.deaths == () and mc.death_verdict(sim.state, 9, "node2") == "exit"
    _gpu_dies(sim)
    # during the relaunch: every wrapper holds (the step's end kills it)
    sim.tick(0.1, mc.RankExited(0, "node1", "exit code 1"))
    assert sim.state.deaths == () and mc.death_verdict(sim.state, 0, "node1") == "hold"


def test_the_drain_reason_limit_is_tpassds():
    """One fact, two places: the coordinator cuts drain reasons to what tpassd accepts."""
    from torchpass.coordinator.decide_relaunch import DRAIN_REASON_MAX, drain_reason
    from tpassd.daemon import DRAIN_REASON_MAX as TPASSD_MAX

    assert DRAIN_REASON_MAX == TPASSD_MAX
    long = "torchpass: " + "x" * 300
    assert len(drain_reason(long)) == TPASSD_MAX and drain_reason(long).endswith("...")
    assert drain_reason("torchpass: short") == "torchpass: short"


def test_a_torchrun_task_whose_worker_died_is_matched_by_its_task_and_relaunched_from_the_checkpoint():
    """Under torchrun the Slurm task is the agent, its workers the ranks: the wrapper reports its task
    (task 1 on node2 holds ranks 2 and 3), which is no rank number of that node."""
    sim = Sim(per_node=1)
    sim.state = CoordState(job_id=7)
    for rank in range(6):
        sim.feed(mc.RankRegistered(rank, f"node{rank // 2 + 1}", 6, task=rank // 2))
    for n in ("node1", "node2", "node3", "node4"):
        sim.feed(mc.NodeHealthChanged(n, State.HEALTHY))
    sim.feed(mc.SpareAdded("node4"), *[mc.RankProgress(r, 100, 10) for r in range(6)],
             mc.CheckpointCompleted(5, "/ckpt/5"))
    sim.tick(0.1)
    sim.tick(0.1, mc.RankExited(2, "node2", "exit code 1"))  # task 2 runs on node3: not this node's
    assert sim.state.deaths == () and mc.death_verdict(sim.state, 2, "node2") == "exit"
    d = sim.tick(0.2, mc.NodeHealthChanged("node2", State.FAILED, (XID79, LOST)),
                 mc.RankExited(1, "node2", "exit code 1", 0))
    (rl,) = sim.of(d, Relaunch)
    assert rl.replaced == (("node2", "node4"),) and rl.snapshot == "" and rl.checkpoint_step == 5
    assert mc.death_verdict(sim.state, 1, "node2") == "hold"
    (died,) = sim.events("rank.died")
    assert died.data["cause"] == "hardware" and died.message.startswith("task 1 (ranks 2, 3) on node2 exit code 1")
    assert died.data["faults"]["node2"].startswith("GPU failed under ranks 2, 3 (gpu0: Xid 79")
