"""The coordinator->rank commands are defined once (torchpass.wire.RANK_COMMANDS): the executor
gives no other, and the rank's control link carries out each one (a command the link did not
know would be said as unknown and ignored, leaving the job standing at T)."""

from __future__ import annotations

import queue

from test_never_left_paused import FALLBACK, make
from torchpass import wire
from torchpass.coordinator import contract as ct
from torchpass.coordinator.executor import Executor
from torchpass.coordinator.job_record import JobState
from torchpass.coordinator.model import CoordState, RankView
from torchpass.coordinator.policy import CoordinatorPolicy

# One command of each kind, as the coordinator sends it.
SAMPLES = {
    wire.COMMAND_PAUSE: {"command": wire.COMMAND_PAUSE, "at": 50, "generation": 3, "deadline_s": 30.0,
                         "fallback": FALLBACK, "join_s": 5.0},
    wire.COMMAND_RESUME: {"command": wire.COMMAND_RESUME, "generation": 3, "master_addr": "10.0.0.1",
                          "master_port": 2},
}


def test_every_command_has_a_sample_here():
    assert set(SAMPLES) == set(wire.RANK_COMMANDS)
    assert len(set(wire.RANK_COMMANDS)) == len(wire.RANK_COMMANDS) and wire.COMMAND_NONE not in wire.RANK_COMMANDS


def test_the_link_carries_out_every_command(tmp_path, capfd):
    link, _now, _ = make(tmp_path)
    try:
        link._handle({"command": SAMPLES[wire.COMMAND_PAUSE]})
        assert link.pg.arms == [(50, 3)]
        link._handle({"command": SAMPLES[wire.COMMAND_RESUME]})
        assert [gen for gen, _rv in link.pg.resumes] == [3]
        link._handle({"command": {"command": wire.COMMAND_NONE}})
    finally:
        link.stop()
    assert "unknown coordinator command" not in capfd.readouterr().err


def test_the_executor_gives_only_the_defined_commands(tmp_path):
    posted: queue.Queue = queue.Queue()
    ex = Executor(JobState(job_id=7), state_dir=tmp_path, post=posted.put, policy=CoordinatorPolicy(),
                  address_of=lambda n: "10.0.0.1", prelaunch_restore=False)
    st = CoordState(job_id=7, ranks={r: RankView(rank=r, node=f"n{r}") for r in range(3)})
    try:
        ex.perform(ct.PauseAt("m1", 50, 3, (2,)), st)
        given = {c["command"] for c in ex.commands.values()} | {ex.commands[0]["fallback"]["command"]}
        ex.perform(ct.Resume("m1", 3, "n0"), st)
        given |= {c["command"] for c in ex.commands.values()}
    finally:
        ex.close()
    assert given == set(wire.RANK_COMMANDS)
