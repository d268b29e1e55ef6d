"""The coordinator comes back: the supervisor's restart decision, its real restarts (stand-in
coordinators, real processes), and the restarted coordinator's decision about the pause it finds."""

from __future__ import annotations

import json
import signal
import sys
import textwrap
import time

import pytest

from torchpass.coordinator import recovery as rc
from torchpass.coordinator.model import CoordState, Migration, RankView, SnapshotRun
from torchpass.coordinator.phases import Phase
from torchpass.coordinator.policy import CoordinatorPolicy
from torchpass.coordinator.restart import ChildExit, SupervisorAction, decide_restart
from torchpass.coordinator.snapshot_phases import SnapPhase
from torchpass.coordinator.supervisor import Supervisor
from torchpass.errors import ConfigError

KILLED = ChildExit(None, signal.SIGKILL, ready=True)


# --- restart limits (pure) ------------------------------------------------------------------------

def test_a_killed_coordinator_is_restarted_with_a_growing_delay():
    first, third = decide_restart(KILLED, 0, 3, False), decide_restart(KILLED, 2, 3, False)
    assert first.action is SupervisorAction.RESTART and "restart 1 of 3" in first.reason
    assert "SIGKILL" in first.reason
    assert 0 < first.delay_s < third.delay_s <= 5.0


def test_restarts_stop_at_the_policy_limit():
    d = decide_restart(KILLED, 3, 3, False)
    assert d.action is SupervisorAction.GIVE_UP and "coordinator_restarts" in d.reason
    assert decide_restart(KILLED, 0, 0, False).action is SupervisorAction.GIVE_UP


def test_a_restart_that_dies_before_listening_is_a_crash_loop():
    d = decide_restart(ChildExit(1, None, ready=False), 1, 3, False)
    assert d.action is SupervisorAction.GIVE_UP and "crash loop" in d.reason


@pytest.mark.parametrize("ended, restarts, stopping", [
    (ChildExit(0, None, ready=True), 0, False),  # the job ended
    (ChildExit(None, signal.SIGTERM, ready=True), 1, True),  # the batch step ends
    (ChildExit(1, None, ready=False), 0, False),  # the first start failed: the plugin says so
])
def test_no_restart_when_the_coordinator_ended_as_it_should(ended, restarts, stopping):
    assert decide_restart(ended, restarts, 3, stopping).action is SupervisorAction.DONE


def test_the_policy_key_is_checked():
    assert CoordinatorPolicy().coordinator_restarts == 3
    with pytest.raises(ConfigError, match="coordinator_restarts"):
        CoordinatorPolicy(coordinator_restarts=-1).validate()


# --- what the restarted coordinator does about a pause (pure) -------------------------------------

def _migration(phase: Phase, ranks=(2, 3)) -> Migration:
    return Migration(id="m4", node="n1", reason="x", trigger="health", ranks=ranks, detected=1.0, started=1.0,
                     phase=phase, phase_started=1.0, deadline=60.0, generation=5, target="n3", pause_at=60)


def _state(**kw) -> CoordState:
    ranks = {r: RankView(r, f"n{r // 2}") for r in range(6)}
    return CoordState(job_id=1, world_size=6, ranks=ranks, next_migration=5, **kw)


@pytest.mark.parametrize("phase", [Phase.PAUSE, Phase.DUMP, Phase.TRANSFER, Phase.RESTORE, Phase.KILL_SOURCE,
                                   Phase.ROLLBACK])
def test_a_move_whose_source_copies_live_is_rolled_back(phase):
    run = rc.in_flight_of(_state(migration=_migration(phase)))
    assert run is not None and run.held == (2, 3) and run.generation == 5 and run.next_migration == 5
    d = rc.recover(run)
    assert d.action is rc.RecoveryAction.ROLL_BACK
    assert (d.generation, d.master) == (5, "n0")  # rank 0's node: the dead coordinator's own fallback


def test_a_move_past_the_source_kill_is_completed_on_the_target():
    d = rc.recover(rc.in_flight_of(_state(migration=_migration(Phase.REBUILD))))
    assert d.action is rc.RecoveryAction.COMPLETE and d.master == "n0"
    moved0 = rc.recover(rc.in_flight_of(_state(migration=_migration(Phase.REBUILD, ranks=(0, 1)))))
    assert moved0.action is rc.RecoveryAction.COMPLETE and moved0.master == "n3"  # rank 0 moved with them


@pytest.mark.parametrize("phase", [Phase.SPARE, Phase.DRAIN, Phase.SHRINK])
def test_nothing_is_written_while_no_rank_is_paused(phase):
    assert rc.in_flight_of(_state(migration=_migration(phase))) is None
    assert rc.recover(None).action is rc.RecoveryAction.NOTHING


@pytest.mark.parametrize("phase", [SnapPhase.PAUSE, SnapPhase.DUMP, SnapPhase.RESUME])
def test_a_snapshot_in_flight_is_rolled_back(phase):
    snap = SnapshotRun(id="s9", asked=1.0, phase=phase, generation=7, ranks=tuple((r, f"n{r // 2}") for r in range(6)))
    run = rc.in_flight_of(_state(snapshot=snap))
    d = rc.recover(run)
    assert d.action is rc.RecoveryAction.ROLL_BACK and run.held == tuple(range(6)) and d.generation == 7
    assert rc.in_flight_of(_state(snapshot=SnapshotRun(id="s9", asked=1.0))) is None  # queued: nothing paused


def test_the_record_round_trips_and_a_bad_one_is_refused(tmp_path):
    st = _state(migration=_migration(Phase.DUMP))
    w = rc.InFlightWriter(tmp_path, 1)
    w.path.parent.mkdir(parents=True)
    w.note(st)
    assert rc.read(tmp_path, 1) == rc.in_flight_of(st)
    w.note(_state())  # nothing paused any more: the record goes
    assert rc.read(tmp_path, 1) is None
    w.path.write_text(json.dumps({"kind": "migration"}))
    with pytest.raises(ValueError):
        rc.read(tmp_path, 1)


def test_the_record_is_rebuilt_only_when_what_it_is_made_of_changes(tmp_path, monkeypatch):
    """The writer runs on every decision pass (thousands per pause at 8,192 ranks): an unchanged
    pause costs an O(1) key, not a new record; a new phase is written."""
    w = rc.InFlightWriter(tmp_path, 1)
    w.path.parent.mkdir(parents=True)
    st = _state(migration=_migration(Phase.DUMP))
    w.note(st)
    built = []
    real = rc.in_flight_of
    monkeypatch.setattr(rc, "in_flight_of", lambda s: built.append(1) or real(s))
    for _ in range(100):
        w.note(st)
    assert built == []
    later = _state(migration=_migration(Phase.TRANSFER))
    w.note(later)
    assert built == [1] and rc.read(tmp_path, 1) == real(later)


# --- the supervisor, with stand-in coordinators (real processes) ----------------------------------

STAND_IN = textwrap.dedent("""
    import os, signal, subprocess, sys
    args = sys.argv[1:]
    log = args[args.index("--log") + 1]
    ready = int(args[args.index("--ready-fd") + 1])
    secret = os.read(int(args[args.index("--secret-fd") + 1]), 100).decode() if "--secret-fd" in args else ""
    port = args[args.index("--port") + 1] if "--port" in args else "5555"
    restart = args[args.index("--restart") + 1] if "--restart" in args else "0"
    orphan = subprocess.Popen(["sleep", "600"]).pid  # a restore step's srun, say
    with open(log, "a") as f:
        f.write(f"{restart} {port} {secret} {orphan}\\n")
    os.write(ready, f"tcp://127.0.0.1:{port}\\n".encode())
    if int(restart) < int(os.environ.get("STAND_IN_DIES", "1")):
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(0)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def _supervise(tmp_path, monkeypatch, dies: int, limit: int):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    log = tmp_path / "runs.log"
    (tmp_path / "jobs" / "7").mkdir(parents=True)
    monkeypatch.setenv("STAND_IN_DIES", str(dies))
    import os

    r, w = os.pipe()
    sup = Supervisor(["--log", str(log)], job_id=7, state_dir=tmp_path, limit=limit, ready_fd=w,
                     secret=b"ab" * 32, program=[sys.executable, str(script)])
    t0 = time.monotonic()
    pid = os.fork()  # the supervisor becomes a subreaper: in a process of its own, never pytest's
    if pid == 0:
        code = 1
        try:
            code = sup.run()
        finally:
            os._exit(code)
    os.close(w)
    rc_ = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    ready = os.read(r, 100).decode()
    os.close(r)
    runs = [line.split() for line in log.read_text().splitlines()]
    return rc_, ready, runs, time.monotonic() - t0


def test_the_supervisor_restarts_a_killed_coordinator_where_the_ranks_look(tmp_path, monkeypatch):
    code, ready, runs, took = _supervise(tmp_path, monkeypatch, dies=2, limit=3)
    assert code == 0 and ready == "tcp://127.0.0.1:5555\n"  # the plugin hears the first start only
    assert [r[0] for r in runs] == ["0", "1", "2"]  # killed twice, restarted twice, then ended
    assert all(r[1] == "5555" and r[2] == "ab" * 32 for r in runs)  # same port, the secret every time
    assert not any(_alive(int(r[3])) for r in runs)  # each dead coordinator's orphans were stopped
    assert took < 10


def test_the_supervisor_gives_up_after_the_limit_with_an_event(tmp_path, monkeypatch):
    code, _, runs, _ = _supervise(tmp_path, monkeypatch, dies=99, limit=2)
    assert code == 0 and len(runs) == 3  # the first start and 2 restarts
    events = json.loads((tmp_path / "jobs" / "7" / "events.json").read_text())
    assert [e["kind"] for e in events] == ["coordinator.gave_up"]
    assert "2 restarts" in events[0]["message"]


# --- the restarted coordinator carries the decision out (a real executor, a stand-in tpassd) -------

def _settled(tmp_path, run: rc.InFlight):
    from support.fake_slurm import FakeSlurm
    from support.wait import until
    from test_executor import FakeTpassd
    from torchpass import layout
    from torchpass.coordinator.driver import Driver
    from torchpass.coordinator.executor import Executor
    from torchpass.coordinator.job_record import JobState
    from torchpass.coordinator.recovery_actions import settle

    job, pol, tp = JobState(job_id=42, spares=1), CoordinatorPolicy(), FakeTpassd(fail_dump=False)
    d = Driver(job, pol)
    d.executor = Executor(job, state_dir=tmp_path, post=d.post, policy=pol, tpassd=tp, slurm=FakeSlurm(),
                          address_of=lambda n: "10.0.0." + n[1:])
    settle(job, d, rc.recover(run))
    hold = [layout.hold_file(tmp_path, 42, run.id, r) for r in run.held]
    until(lambda: all(p.exists() for p in hold), "the hold files released", 5)
    d.executor.close()
    return d, tp, job


def test_a_restarted_coordinator_rolls_a_move_back_as_the_executor_does(tmp_path):
    run = rc.InFlight(rc.RunKind.MIGRATION, "m3", "dump", 4, 3, (1,), "n2", "n4", "n1", False, 4, (1,))
    d, tp, job = _settled(tmp_path, run)
    assert (d.state.generation, d.state.next_migration) == (4, 4)  # the next pause arms 5, as m4
    cmds = d.executor.commands
    assert sorted(cmds) == [0, 1, 2] and {c["generation"] for c in cmds.values()} == {4}
    assert {c["master_addr"] for c in cmds.values()} == {"10.0.0.1"}  # rank 0's node: the pause's fallback
    assert [(n, t, b["op"], b["rank"]) for n, t, b in tp.calls] == [("n2", "tpassd.snapshot", "abort", 1)]
    ev = [e for e in job.events if e.kind == "migration.rolled_back"]
    assert len(ev) == 1 and ev[0].data["recovered"] and ev[0].data["node"] == "n2"


def test_a_restarted_coordinator_completes_a_move_past_the_source_kill(tmp_path):
    run = rc.InFlight(rc.RunKind.MIGRATION, "m3", "rebuild", 4, 3, (0,), "n1", "n4", "n1", True, 4, (0,))
    d, tp, job = _settled(tmp_path, run)
    assert {c["master_addr"] for c in d.executor.commands.values()} == {"10.0.0.4"}  # rank 0 moved to n4
    assert tp.calls == []  # no hand-off to call off: the source copies are gone
    assert [e.kind for e in job.events] == ["migration.completed"]
