"""A node lost outright: its tpassd falls silent; the coordinator asks slurmctld, and
only when slurmctld does not hear the node either is it lost: one ``node.lost`` event that says
no snapshot exists and what Slurm will do, ``HandToSlurm``, no pause, no migration.

Driver + executor with a fake health view and a fake Slurm (no services)."""

from __future__ import annotations

import json
import time

from torchpass import layout
from torchpass.coordinator import machine as mc
from torchpass.coordinator.decide_relaunch import SLURM_ON_LOST_NODE
from torchpass.coordinator.decide_snapshot import check_snapshot_request
from torchpass.coordinator.driver import Driver
from torchpass.coordinator.executor import Executor
from torchpass.coordinator.job_record import JobState
from torchpass.coordinator.lost_node_actions import slurm_lost
from torchpass.coordinator.policy import CoordinatorPolicy
from torchpass.slurm.base import JobInfo, NodeInfo, StepInfo

NODES = ("n1", "n2", "n3", "n4")


class FakeHealth:
    """The health subscriber's view: n2's tpassd silent for ``age`` seconds (unknown)."""

    def __init__(self):
        self.silent: dict[str, float] = {}
        self.failed: dict[str, str] = {}  # node -> reason (its tpassd answers)

    def brief(self):
        def one(n):
            if n in self.failed:
                return "failed", (self.failed[n],), 0.5
            return ("unknown", ("no heartbeat",), self.silent[n]) if n in self.silent else ("healthy", (), 0.5)
        return {n: one(n) for n in NODES}


class FakeSlurm:
    def __init__(self, states: dict[str, tuple[str, ...]], requeueable: bool | None = True, state: str = "RUNNING"):
        self.states = states
        self.asked = 0
        self.cancelled: list[str] = []
        self.requeueable = requeueable
        self.state = state
        self.calls: list[str] = []  # requeue, cancel_step, in order
        self.state_dir = None  # where the coordinator saves its events (set by the test)
        self.saved_at_requeue: list[str] | None = None  # the kinds on disk when requeue was called

    def steps(self, job_id):
        return [StepInfo(f"{job_id}.batch", "batch", ("n1",), "RUNNING"),
                StepInfo(f"{job_id}.0", "python", ("n1", "n2", "n3"), "RUNNING"),
                StepInfo(f"{job_id}.1", "sleep", ("n1",), "RUNNING")]

    def cancel_step(self, step_id):
        self.cancelled.append(step_id)
        self.calls.append(f"cancel {step_id}")

    def requeue(self, job_id):
        self.calls.append(f"requeue {job_id}")
        self.saved_at_requeue = _saved_kinds(self.state_dir) if self.state_dir else None

    def job(self, job_id):
        return JobInfo(job_id, "train", "u", 1001, self.state, NODES, batch_host="n1", requeue=self.requeueable)

    def nodes(self):
        self.asked += 1
        return [NodeInfo(n, n, self.states.get(n, ("MIXED",)),
                         "Not responding" if "NOT_RESPONDING" in self.states.get(n, ()) else "") for n in NODES]


def _driver(tmp_path, slurm: FakeSlurm, health: FakeHealth) -> Driver:
    job = JobState(job_id=42, spares=1)
    pol = CoordinatorPolicy()
    d = Driver(job, pol, spares=("n4",), health=health)
    d.executor = Executor(job, state_dir=tmp_path, post=d.post, policy=pol, slurm=slurm,
                          address_of=lambda n: "10.0.0." + n[1:])
    for r, n in enumerate(("n1", "n2", "n3")):
        d.feed(mc.RankRegistered(r, n, 3))
    return d


def _pump_for(d: Driver, seconds: float, until=lambda: False) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and not until():
        d.pump(force=True)
        time.sleep(0.02)


def _lost_events(d: Driver):
    return [e for e in d.job.events if e.kind == "node.lost"]


def test_silent_tpassd_and_slurmctld_not_hearing_the_node_is_a_lost_node(tmp_path):
    health = FakeHealth()
    slurm = FakeSlurm({"n2": ("MIXED", "NOT_RESPONDING")})
    d = _driver(tmp_path, slurm, health)
    health.silent["n2"] = 12.0
    _pump_for(d, 5.0, until=lambda: bool(_lost_events(d)))
    (ev,) = _lost_events(d)
    assert "n2 failed and is unreachable (tpassd silent; slurmctld reports MIXED+NOT_RESPONDING (Not responding))" \
        in ev.message, ev.message
    assert ("no complete snapshot (snapshot_every) or application checkpoint (torchpass.checkpoint)"
            " of the job to relaunch it from" in ev.message) and SLURM_ON_LOST_NODE in ev.message
    assert ev.data["node"] == "n2" and ev.data["snapshot"] is None and ev.data["ranks"] == [1]
    assert d.state.handed == frozenset({"n2"}) and d.state.migration is None
    assert all(d.executor.command_for(r) is None for r in range(3))  # nobody paused
    asked = slurm.asked
    _pump_for(d, 2.5)
    assert slurm.asked == asked and len(_lost_events(d)) == 1  # handed once; slurmctld not asked again


def test_a_silent_tpassd_alone_is_not_a_lost_node(tmp_path):
    """slurmctld still hears the node (a tpassd restart): unknown, nothing happens; asked at most every 2 s."""
    health = FakeHealth()
    slurm = FakeSlurm({})
    d = _driver(tmp_path, slurm, health)
    health.silent["n2"] = 12.0
    _pump_for(d, 3.0)
    assert not _lost_events(d) and not d.state.handed and d.state.migration is None
    assert 1 <= slurm.asked <= 2, slurm.asked
    assert "health unknown (not a reason to move): n2" in d.reasons.last


def test_slurm_lost_needs_the_job_on_the_node_and_slurmctld_not_hearing_it():
    job = JobInfo(7, "j", "u", 1, "RUNNING", ("a", "b"))
    assert slurm_lost(job, NodeInfo("b", "b", ("DOWN",), "Not responding")) == \
        "tpassd silent; slurmctld reports DOWN (Not responding)"
    assert slurm_lost(job, NodeInfo("b", "b", ("MIXED",))) == ""
    assert slurm_lost(job, NodeInfo("c", "c", ("DOWN",))) == ""  # not the job's node
    ended = JobInfo(7, "j", "u", 1, "NODE_FAIL", ("a", "b"))
    assert slurm_lost(ended, NodeInfo("b", "b", ("DOWN",))) == ""
    assert slurm_lost(None, NodeInfo("b", "b", ("DOWN",))) == ""


class WitnessTpassd:
    """tpassd's answers to ``tpassd.drain`` of a lost node, by witness node: a dict for success,
    an exception to raise."""

    def __init__(self, answers: dict):
        self.answers = answers
        self.calls: list[tuple[str, str, dict]] = []

    def request(self, node, type_, body, timeout_s):
        self.calls.append((node, type_, dict(body)))
        ans = self.answers.get(node, {"slurm_state": "MIXED+NOT_RESPONDING"})
        if isinstance(ans, Exception):
            raise ans
        return ans


def _lost_with(tmp_path, tp: WitnessTpassd) -> Driver:
    health = FakeHealth()
    d = _driver(tmp_path, FakeSlurm({"n2": ("MIXED", "NOT_RESPONDING")}), health)
    d.executor.tpassd = tp
    layout.events_json(tmp_path, 42).parent.mkdir(parents=True)  # made by the coordinator's start
    health.silent["n2"] = 12.0
    _pump_for(d, 6.0, until=lambda: [e for e in d.job.events if e.kind.startswith("node.drain")])
    return d


def test_a_lost_node_is_drained_through_another_node_of_the_jobs_tpassd(tmp_path):
    """The lost node's own tpassd died with it: the first healthy other node's tpassd is asked to
    drain it (it checks with slurmctld itself), and the job's events say so."""
    tp = WitnessTpassd({})
    d = _lost_with(tmp_path, tp)
    drains = [c for c in tp.calls if c[1] == "tpassd.drain"]
    assert len(drains) == 1
    witness, _, body = drains[0]
    assert witness == "n1" and body["node"] == "n2" and body["job_id"] == 42
    assert body["reason"].startswith("torchpass: n2 failed outright")
    (ev,) = [e for e in d.job.events if e.kind == "node.drained"]
    assert ev.data == {"node": "n2", "witness": "n1", "reason": body["reason"]}
    assert "n2 drained through n1's tpassd (slurmctld reports it MIXED+NOT_RESPONDING)" in ev.message
    saved = json.loads(layout.events_json(tmp_path, 42).read_text())  # what tpassctl events shows
    assert [e["kind"] for e in saved if e["kind"].startswith("node.")] == ["node.lost", "node.drained"]


def test_a_witness_that_does_not_answer_is_skipped_and_a_refusal_is_recorded(tmp_path):
    from torchpass.errors import RemoteError

    tp = WitnessTpassd({"n1": RemoteError("unavailable", "no reply from tcp://10.0.0.1:7461")})
    _lost_with(tmp_path, tp)
    assert [c[0] for c in tp.calls if c[1] == "tpassd.drain"] == ["n1", "n3"]  # n4 (the spare) not needed

    refusal = RemoteError("conflict", "slurmctld still hears n2 (MIXED)")
    tp = WitnessTpassd({"n1": refusal, "n3": {}})
    d = _lost_with(tmp_path / "b", tp)
    assert [c[0] for c in tp.calls if c[1] == "tpassd.drain"] == ["n1"]  # slurmctld's answer: the same anywhere
    (ev,) = [e for e in d.job.events if e.kind == "node.drain_failed"]
    assert "n2 was not drained (n1: " in ev.message and "slurmctld still hears n2" in ev.message


def _with_hostfile(tmp_path, d: Driver) -> None:
    """The job's host file as the SPANK plugin writes it (one line per task of the active nodes),
    and the job's newest application checkpoint: step 20 (its ranks completed 23 steps)."""
    layout.job_dir(tmp_path, 42).mkdir(parents=True, exist_ok=True)
    layout.hostfile(tmp_path, 42).write_text("n1\nn2\nn3\n")
    d.feed(mc.CheckpointCompleted(15, "/ckpt/step-15"))
    d.feed(mc.CheckpointCompleted(20, "/ckpt/step-20"))
    d.feed(mc.CheckpointCompleted(10, "/ckpt/step-10"))  # late report of an older one: not the restore point
    for r in range(3):
        d.feed(mc.RankProgress(r, 100, step=23))


def _verdict(tmp_path) -> dict[str, str]:
    text = layout.relaunch_file(tmp_path, 42).read_text()
    return dict(line.split("=", 1) for line in text.splitlines())


def test_a_lost_node_with_a_checkpoint_and_a_hot_spare_relaunches_the_step_on_the_spare(tmp_path):
    """While n2's tpassd is silent, srun's exit hook is told to wait (pending=1); once slurmctld
    does not hear n2 either, the host file names n4 in its place and the verdict counts one
    relaunch; the ranks register again (on n4 for rank 1) and the relaunch is said to be done."""
    health = FakeHealth()
    slurm = FakeSlurm({})
    stale = layout.relaunch_file(tmp_path, 42)
    stale.parent.mkdir(parents=True)
    stale.write_text("count=5\npending=0\nnode=n3\n")  # an earlier run of the job (requeued)
    d = _driver(tmp_path, slurm, health)
    assert not stale.exists()  # this run's sruns must not compare against its count
    _with_hostfile(tmp_path, d)
    assert d.state.restore_point == (20, "/ckpt/step-20")
    health.silent["n2"] = 12.0
    _pump_for(d, 1.0)
    assert _verdict(tmp_path) == {"count": "0", "pending": "1", "node": "n2"}, "silent n2: srun must wait"
    assert not _lost_events(d)

    slurm.states["n2"] = ("MIXED", "NOT_RESPONDING")
    _pump_for(d, 5.0, until=lambda: bool(_lost_events(d)))
    (ev,) = _lost_events(d)
    assert "relaunching the job's training step with spare n4 in its place, from the application checkpoint " \
           "of step 20" in ev.message, ev.message
    assert ev.data["checkpoint"] == 20 and ev.data["spare"] == "n4" and ev.data["relaunch"] == 1
    (go,) = [e for e in d.job.events if e.kind == "job.relaunching"]
    # the ranks completed 23 steps (0..22): 20, 21 and 22 are computed again
    assert go.data["recompute_steps"] == 3 and go.data["last_step"] == 22 and go.data["replaced"] == {"n2": "n4"}
    _pump_for(d, 2.0, until=lambda: bool(slurm.cancelled))  # the executor's worker
    assert layout.hostfile(tmp_path, 42).read_text() == "n1\nn4\nn3\n"
    # step 0 ran on n2: its srun starts again; step 1 (on n1 only) is none of the relaunch's
    assert _verdict(tmp_path) == {"count": "1", "pending": "0", "node": "n2", "steps": "0", "cause": "lost_node",
                                  "spares": "n4"}
    assert slurm.cancelled == ["42.0"]  # the step on n2 ends now, not at Slurm's SlurmdTimeout
    st = d.state
    assert st.handed == frozenset({"n2"}) and st.ranks == {} and st.relaunches == 1 and st.generation == 0
    assert st.spare("n4").status == "used"
    assert not [e for e in d.job.events if e.kind == "job.relaunched"]

    for r, n in enumerate(("n1", "n4", "n3")):  # the relaunched srun's ranks
        d.feed(mc.RankRegistered(r, n, 3, pid=5000 + r))
    _pump_for(d, 0.3)
    (done,) = [e for e in d.job.events if e.kind == "job.relaunched"]
    assert done.data["relaunch"] == 1 and done.data["checkpoint"] == 20 and done.data["decision_to_registered_s"] >= 0
    assert d.state.relaunch is None and d.state.rank_nodes() == {"n1": (0,), "n4": (1,), "n3": (2,)}
    assert _verdict(tmp_path)["count"] == "1"
    # the job is whole again: snapshots may be taken (the lost node no longer runs a rank of it)
    assert check_snapshot_request(d.state) is None


def test_a_lost_node_with_a_checkpoint_but_no_free_spare_is_handed_to_slurm(tmp_path):
    health = FakeHealth()
    slurm = FakeSlurm({"n2": ("MIXED", "NOT_RESPONDING")})
    d = _driver(tmp_path, slurm, health)
    _with_hostfile(tmp_path, d)
    health.failed["n4"] = "gpu lost"  # the hot spare
    health.silent["n2"] = 12.0
    _pump_for(d, 5.0, until=lambda: bool(_lost_events(d)))
    (ev,) = _lost_events(d)
    assert "no free hot spare for every lost node (0 for 1) to relaunch the job on from its checkpoint of step 20" \
        in ev.message and SLURM_ON_LOST_NODE in ev.message, ev.message
    assert ev.data["checkpoint"] == 20 and "relaunch" not in ev.data
    assert layout.hostfile(tmp_path, 42).read_text() == "n1\nn2\nn3\n"
    assert not layout.relaunch_file(tmp_path, 42).exists()  # no relaunch possible: srun never waits
    assert d.state.relaunches == 0 and d.state.ranks and d.state.handed == frozenset({"n2"})
    _pump_for(d, 3.0, until=lambda: bool(slurm.calls))
    assert slurm.calls == ["requeue 42"]  # as slurmctld would, also for a --no-kill job; no step ended
    assert "were lost; no snapshot" in check_snapshot_request(d.state)[1]  # n2's rank is gone with it


# -- no relaunch possible: what slurmctld does to a job without --no-kill, done now ------------------
class OrderedWitness(WitnessTpassd):
    """The witness's drain, logged in the same list as Slurm's calls (the drain must come first)."""

    def __init__(self, calls: list[str]):
        super().__init__({})
        self.log = calls

    def request(self, node, type_, body, timeout_s):
        self.log.append(f"drain {body['node']} via {node}")
        return super().request(node, type_, body, timeout_s)


def _saved_kinds(state_dir) -> list[str]:
    path = layout.events_json(state_dir, 42)
    return [e["kind"] for e in json.loads(path.read_text())] if path.exists() else []


def _lost_no_relaunch(tmp_path, slurm: FakeSlurm) -> Driver:
    health = FakeHealth()
    slurm.state_dir = tmp_path
    d = _driver(tmp_path, slurm, health)
    d.executor.tpassd = OrderedWitness(slurm.calls)
    layout.events_json(tmp_path, 42).parent.mkdir(parents=True)
    health.silent["n2"] = 12.0
    _pump_for(d, 6.0, until=lambda: [e for e in d.job.events
                                      if e.kind.startswith("job.") and e.kind != "job.requeuing"])
    return d


def test_a_lost_node_without_a_relaunch_requeues_a_requeueable_job_after_the_drain(tmp_path):
    """No restore point: the job is requeued now, as slurmctld would at DOWN without --no-kill
    (with --no-kill it would leave the other ranks waiting in their collectives)."""
    slurm = FakeSlurm({"n2": ("MIXED", "NOT_RESPONDING")})
    d = _lost_no_relaunch(tmp_path, slurm)
    assert slurm.calls == ["drain n2 via n1", "requeue 42"], slurm.calls
    kinds = [e.kind for e in d.job.events if e.kind.startswith(("node.", "job."))]
    assert kinds == ["node.lost", "node.drained", "job.requeuing", "job.requeued"], kinds
    for kind in ("job.requeuing", "job.requeued"):
        (ev,) = [e for e in d.job.events if e.kind == kind]
        assert "n2 lost, no relaunch possible" in ev.message and ev.data == {"node": "n2"}
    # The requeue ends the batch step and this coordinator with it: what it says is on disk before.
    assert slurm.saved_at_requeue is not None and slurm.saved_at_requeue[-1] == "job.requeuing", \
        slurm.saved_at_requeue
    assert "job.requeued" in _saved_kinds(tmp_path)
    _pump_for(d, 1.0)
    assert slurm.calls.count("requeue 42") == 1  # once


def test_a_lost_node_without_a_relaunch_ends_the_steps_on_it_when_the_job_is_not_requeueable(tmp_path):
    slurm = FakeSlurm({"n2": ("MIXED", "NOT_RESPONDING")}, requeueable=False)
    d = _lost_no_relaunch(tmp_path, slurm)
    # only the step with a task on n2; not the batch step, not a step on n1 alone
    assert slurm.calls == ["drain n2 via n1", "cancel 42.0"], slurm.calls
    (ev,) = [e for e in d.job.events if e.kind == "job.steps_ended"]
    assert ev.data["steps"] == ["42.0"] and "not requeueable" in ev.message, ev.message
    # a record without the requeue flag: not requeued on a guess, and said so
    unknown = FakeSlurm({"n2": ("MIXED", "NOT_RESPONDING")}, requeueable=None)
    d = _lost_no_relaunch(tmp_path / "b", unknown)
    assert unknown.calls == ["drain n2 via n1", "cancel 42.0"], unknown.calls
    (ev,) = [e for e in d.job.events if e.kind == "job.steps_ended"]
    assert "slurmctld does not say whether the job may be requeued" in ev.message, ev.message


def test_a_job_slurmctld_already_ended_is_left_as_it_is(tmp_path):
    slurm = FakeSlurm({"n2": ("DOWN", "NOT_RESPONDING")}, state="COMPLETING")
    d = _lost_no_relaunch(tmp_path, slurm)
    assert [c for c in slurm.calls if not c.startswith("drain")] == []
    (ev,) = [e for e in d.job.events if e.kind == "job.not_ended"]
    assert "slurmctld reports the job COMPLETING already" in ev.message, ev.message


# -- relaunch from a whole-job snapshot ----------------------------------------------------------
def _with_snapshot(d: Driver, step: int) -> None:
    """A whole-job snapshot of step ``step`` completed (generation 2) before the loss."""
    from dataclasses import replace

    from torchpass.coordinator.model import SnapshotPoint

    d.state = replace(d.state, last_snapshot=SnapshotPoint("snap-7", step, 2, 0, 3), generation=2)


def _lose_n2(tmp_path, d: Driver, health: FakeHealth, slurm: FakeSlurm):
    health.silent["n2"] = 12.0
    slurm.states["n2"] = ("MIXED", "NOT_RESPONDING")
    _pump_for(d, 5.0, until=lambda: bool(_lost_events(d)))
    _pump_for(d, 2.0, until=lambda: bool(slurm.cancelled))
    (ev,) = _lost_events(d)
    return ev


def test_a_lost_node_with_a_newer_snapshot_relaunches_every_rank_from_it_and_resumes_them_once_all_are_back(
        tmp_path):
    """The snapshot (step 21) is newer than the checkpoint (step 20): the verdict names it, the
    restored copies register again naming it, and only when all three are back do they get the
    resume, as the snapshot's generation; the relaunch ends when all resumed."""
    health, slurm = FakeHealth(), FakeSlurm({})
    d = _driver(tmp_path, slurm, health)
    _with_hostfile(tmp_path, d)
    _with_snapshot(d, 21)
    ev = _lose_n2(tmp_path, d, health, slurm)
    assert "every rank restored from snapshot snap-7 of step 21" in ev.message, ev.message
    assert ev.data["snapshot"] == "snap-7" and ev.data["checkpoint"] is None
    (go,) = [e for e in d.job.events if e.kind == "job.relaunching"]
    assert go.data["recompute_steps"] == 2 and go.data["snapshot_step"] == 21  # steps 21 and 22 again
    assert _verdict(tmp_path) == {"count": "1", "pending": "0", "node": "n2", "steps": "0", "snapshot": "snap-7",
                                  "cause": "lost_node", "spares": "n4"}
    assert layout.hostfile(tmp_path, 42).read_text() == "n1\nn4\nn3\n"
    assert d.state.generation == 2 and d.state.ranks == {}
    assert check_snapshot_request(d.state) is not None  # nothing else starts while the copies come back

    d.feed(mc.RankRegistered(0, "n1", 3, pid=1, generation=1, restored="snap-7"))
    d.feed(mc.RankRegistered(2, "n3", 3, pid=1, generation=1, restored="snap-7"))
    _pump_for(d, 0.3)
    assert d.executor.command_for(0) is None, "no resume before every restored copy is back"
    d.feed(mc.RankRegistered(1, "n4", 3, pid=1, generation=1, restored="snap-7"))
    _pump_for(d, 0.3)
    cmds = [d.executor.command_for(r) for r in range(3)]
    assert all(c is not None and c["command"] == "resume" and c["generation"] == 2 for c in cmds), cmds
    assert cmds[0]["master_addr"] == "10.0.0.1"  # rank 0's node
    (restored,) = [e for e in d.job.events if e.kind == "job.restored"]
    assert restored.data["snapshot"] == "snap-7"
    assert not [e for e in d.job.events if e.kind == "job.relaunched"]

    for r, n in enumerate(("n1", "n4", "n3")):
        d.feed(mc.Resumed(r, 2, n))
    _pump_for(d, 0.3)
    (done,) = [e for e in d.job.events if e.kind == "job.relaunched"]
    assert done.data["snapshot"] == "snap-7" and done.data["recompute_steps"] == 2
    assert d.state.relaunch is None and d.state.rank_nodes() == {"n1": (0,), "n4": (1,), "n3": (2,)}
    assert check_snapshot_request(d.state) is None


def test_a_checkpoint_newer_than_the_snapshot_is_what_the_job_is_relaunched_from(tmp_path):
    health, slurm = FakeHealth(), FakeSlurm({})
    d = _driver(tmp_path, slurm, health)
    _with_hostfile(tmp_path, d)
    _with_snapshot(d, 19)
    ev = _lose_n2(tmp_path, d, health, slurm)
    assert "from the application checkpoint of step 20" in ev.message, ev.message
    assert "snapshot" not in _verdict(tmp_path)
    assert d.state.generation == 0 and d.state.relaunch.snapshot == ""


def test_a_snapshot_alone_is_enough_to_relaunch(tmp_path):
    """No application checkpoint at all: the newest snapshot is the restore point."""
    health, slurm = FakeHealth(), FakeSlurm({})
    d = _driver(tmp_path, slurm, health)
    layout.job_dir(tmp_path, 42).mkdir(parents=True, exist_ok=True)
    layout.hostfile(tmp_path, 42).write_text("n1\nn2\nn3\n")
    _with_snapshot(d, 4)
    health.silent["n2"] = 12.0
    _pump_for(d, 1.0)
    assert _verdict(tmp_path)["pending"] == "1", "a silent node with a snapshot: srun must wait for the verdict"
    ev = _lose_n2(tmp_path, d, health, slurm)
    assert ev.data["snapshot"] == "snap-7" and _verdict(tmp_path)["snapshot"] == "snap-7"


def test_a_node_lost_while_a_snapshot_runs_ends_that_snapshot_and_relaunches_from_the_one_before(tmp_path):
    """The periodic snapshot in flight (ranks paused) cannot complete without the lost node: it
    fails, what was written on the surviving nodes is removed, and the job is relaunched from the
    newest complete snapshot."""
    from dataclasses import replace

    from torchpass.coordinator.model import SNAP_DUMP, SnapshotRun

    health, slurm = FakeHealth(), FakeSlurm({})
    d = _driver(tmp_path, slurm, health)
    _with_hostfile(tmp_path, d)
    _with_snapshot(d, 21)
    running = SnapshotRun("snap-8", 0.0, trigger="periodic", phase=SNAP_DUMP, phase_started=time.monotonic(),
                          deadline=time.monotonic() + 600, generation=3, pause_at=130, step=22,
                          ranks=((0, "n1"), (1, "n2"), (2, "n3")))
    d.state = replace(d.state, snapshot=running)
    asked: list[tuple[str, str]] = []

    class Tpassds:
        def request(self, node, type_, body, timeout_s):
            asked.append((node, body.get("op")))
            return {}

    d.executor.tpassd = Tpassds()
    ev = _lose_n2(tmp_path, d, health, slurm)
    assert ev.data["snapshot"] == "snap-7", ev.message
    failed = [e for e in d.job.events if e.kind == "snapshot.failed"]
    assert [e.data["snapshot"] for e in failed] == ["snap-8"], failed
    assert d.state.snapshot is None and d.state.relaunch.snapshot == "snap-7"
    assert _verdict(tmp_path)["snapshot"] == "snap-7"
    _pump_for(d, 2.0, until=lambda: len([a for a in asked if a[1] == "discard"]) >= 2)
    assert sorted(a for a in asked if a[1] == "discard") == [("n1", "discard"), ("n3", "discard")], asked


def test_a_gpu_that_failed_under_a_rank_is_drained_by_its_own_nodes_tpassd(tmp_path):
    """A node that still answers and whose GPU killed a rank (decide_rank_death) is drained by its own
    tpassd, which checks its own health view (no ``node`` in the request: not a witness's drain)."""
    health = FakeHealth()
    d = _driver(tmp_path, FakeSlurm({}), health)
    tp = WitnessTpassd({"n2": {"node": "n2", "health": "failed"}})
    d.executor.tpassd = tp
    layout.events_json(tmp_path, 42).parent.mkdir(parents=True)
    d.feed(mc.RankExited(1, "n2", "killed by signal 9 (SIGKILL)"))
    health.failed["n2"] = "gpu0: Xid 79 (GPU has fallen off the bus) within the last 600 s"
    _pump_for(d, 3.0, until=lambda: [e for e in d.job.events if e.kind.startswith("node.drain")])
    drains = [c for c in tp.calls if c[1] == "tpassd.drain"]
    assert [(n, "node" in b) for n, _, b in drains] == [("n2", False)], tp.calls
    assert drains[0][2]["reason"].startswith("torchpass: n2 GPU failed under rank 1 (gpu0: Xid 79")
    (ev,) = [e for e in d.job.events if e.kind == "node.drained"]
    assert "n2 drained by its own tpassd" in ev.message


def test_a_death_with_no_fault_relaunches_the_step_on_the_same_nodes_and_ends_it(tmp_path):
    """A script bug (no GPU fault within the window): the host file stays, the verdict counts one
    relaunch, names the node where the rank died and lists the step with a task there, and that
    step is ended (its held wrappers with it), so srun's exit hook starts it again."""
    health = FakeHealth()
    slurm = FakeSlurm({})
    job = JobState(job_id=42, spares=1)
    pol = CoordinatorPolicy(death_event_window_s=0.3)
    d = Driver(job, pol, spares=("n4",), health=health)
    d.executor = Executor(job, state_dir=tmp_path, post=d.post, policy=pol, slurm=slurm,
                          address_of=lambda n: "10.0.0." + n[1:])
    for r, n in enumerate(("n1", "n2", "n3")):
        d.feed(mc.RankRegistered(r, n, 3))
    _with_hostfile(tmp_path, d)
    d.feed(mc.RankExited(1, "n2", "exit code 1"))
    _pump_for(d, 3.0, until=lambda: slurm.cancelled)
    assert layout.hostfile(tmp_path, 42).read_text() == "n1\nn2\nn3\n"
    v = _verdict(tmp_path)
    assert v["count"] == "1" and v["node"] == "n2" and v["steps"] == "0" and "snapshot" not in v
    # srun's exit hook says a rank died, and that the step starts again on the same nodes
    assert v["cause"] == "rank_died" and v["spares"] == ""
    assert slurm.cancelled == ["42.0"]
    assert [e.kind for e in d.job.events if e.kind in ("rank.died", "job.relaunching")] == \
        ["rank.died", "job.relaunching"]
