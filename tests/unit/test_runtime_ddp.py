"""The rank runtime under real multi-process gloo DDP.

examples/train_ddp.py knows nothing about torchpass; the runtime is loaded
only through boot/sitecustomize.py on PYTHONPATH, exactly as in a job. The
pause/resume protocol is driven over ZeroMQ by torchpass.runtime.testing's
MiniCoordinator. Losses are compared as float.hex against plain gloo.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

from torchpass.runtime.testing import MiniCoordinator, finish_ranks, free_port, hold_files, launch_ranks

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train_ddp.py"
WORLD = 2
STEPS = 14
ARGS = ["--steps", str(STEPS), "--params", "20K", "--bucket-mb", "0.02", "--sleep", "0.05"]
JOB = 4242


def launch(tmp: Path, tag: str, runtime: bool, coordinator: str | None = None, args=ARGS):
    return launch_ranks([sys.executable, str(TRAIN), *args], WORLD, tmp, tag, runtime=runtime, job_id=JOB,
                        coordinator=coordinator, env={"TORCHPASS_DEBUG": "1"})


def finish(procs, tmp: Path, tag: str, timeout: float = 120) -> list[list[str]]:
    return finish_ranks(procs, tmp, tag, timeout)[0]


def step_counts(err: str) -> dict[int, int]:
    return {int(s): int(c) for s, c in re.findall(r"torchpass: rank \d+ step (\d+) collectives (\d+)", err)}


def sockets_of(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    plain = finish(launch(tmp, "plain", runtime=False), tmp, "plain")
    assert len(plain[0]) == STEPS and plain[0] == plain[1]
    # the runtime on, no pause: same losses, and the step -> collectives map
    on = finish(launch(tmp, "on", runtime=True), tmp, "on")
    err = (tmp / "on.0.err").read_text()
    assert "unprotected" not in err
    return plain[0], on[0], step_counts(err)


def test_runtime_loaded_without_pause_is_bit_identical(reference):
    plain, on, counts = reference
    assert on == plain
    assert sorted(counts) == list(range(1, STEPS + 1))
    per_step = counts[2] - counts[1]
    assert per_step >= 3  # >= 2 DDP buckets + the loss all_reduce: pauses can fall between buckets


def test_reconfigurations_mid_backward_are_bit_identical(reference, tmp_path):
    plain, _on, counts = reference
    # Pause points: before the first bucket of step 4 (in backward), between
    # two buckets of step 8 (mid-backward), and at the step boundary (T = the
    # count when step 11 ended: the rank stops in the optimizer-step hook,
    # before the loss all_reduce that follows, with nothing in flight).
    plan = [(3, counts[3] + 1), (7, counts[7] + 2), (11, counts[11])]
    with MiniCoordinator(WORLD, JOB) as coord:
        procs = launch(tmp_path, "mig", runtime=True, coordinator=coord.endpoint)
        try:
            coord.wait_registered()
            pids = {r: v.pid for r, v in coord.ranks.items()}
            for i, (step, at) in enumerate(plan):
                coord.wait_collectives(counts[max(step - 3, 1)] - 2 if i else 0)
                hold = hold_files(tmp_path, JOB, f"m{i}", [1])
                got_at, gen = coord.pause(margin=0, at=at, hold_files=hold)
                assert got_at == at and gen == i + 1
                q = coord.wait_quiesced()
                assert {r: q[r]["collectives"] for r in q} == {0: at, 1: at}
                assert q[1]["hold"] and not q[0]["hold"]
                # the held rank closes its last socket (the control link): CRIU could dump it now
                deadline = time.monotonic() + 5
                while sockets_of(pids[1]) and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert sockets_of(pids[1]) == 0
                # rank 0 (the store master) holds only its control link, if anything
                assert q[0]["sockets"] <= 2
                Path(hold[1]).touch()
                coord.resume(gen, "127.0.0.1", free_port())
                res = coord.wait_resumed(gen)
                assert all(res[r]["collectives"] == at for r in res)
            out = finish(procs, tmp_path, "mig")
            compute = {r: dict(v.compute) for r, v in coord.ranks.items()}
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    assert out[0] == plain and out[1] == plain
    # Every step after the first has its compute time (fail-slow); the steps that paused are not
    # measured (-1); the others are positive and include the script's 50 ms sleep.
    for r, figures in compute.items():
        assert set(figures) <= set(range(2, STEPS + 1)) and len(figures) >= STEPS - 3, (r, figures)
        paused = [s for s, f in figures.items() if f == -1]
        assert 1 <= len(paused) <= 3, (r, figures)
        assert all(0.04 < f < 5 for f in figures.values() if f != -1), (r, figures)
    err = (tmp_path / "mig.1.err").read_text()
    assert err.count("(in backward)") == 2, err
    assert err.count("(at a step end)") == 1, err
    assert err.count("resumed as generation") == 3


def test_rearm_when_a_rank_is_already_past_T(reference, tmp_path):
    """A rank that refuses T (already past it) makes the coordinator re-arm
    everyone at a later T; ranks waiting at the old T run on."""
    plain, _on, counts = reference
    with MiniCoordinator(WORLD, JOB) as coord:
        procs = launch(tmp_path, "rearm", runtime=True, coordinator=coord.endpoint)
        try:
            coord.wait_registered()
            coord.wait_collectives(counts[4])
            # T already behind every rank: both refuse; pause() re-arms above them
            at, gen = coord.pause(margin=counts[3] - counts[1], at=counts[2])
            assert at > counts[4]
            assert any(not a for r, v in coord.ranks.items() for (kind, b) in v.history
                       if kind == "armed" for a in [b["accepted"]])
            coord.wait_quiesced()
            coord.resume(gen, "127.0.0.1", free_port())
            coord.wait_resumed(gen)
            out = finish(procs, tmp_path, "rearm")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    assert out[0] == plain


def test_cancel_before_T_leaves_the_group_untouched(reference, tmp_path):
    plain, _on, counts = reference
    with MiniCoordinator(WORLD, JOB) as coord:
        procs = launch(tmp_path, "cancel", runtime=True, coordinator=coord.endpoint)
        try:
            coord.wait_registered()
            at, gen = coord.pause(margin=0, at=counts[STEPS] + 1000)  # never reached
            coord.resume(gen, "127.0.0.1", 1)  # cancels: no rebuild, the port is not used
            res = coord.wait_resumed(gen)
            assert all(r.get("cancelled") for r in res.values())
            out = finish(procs, tmp_path, "cancel")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    assert out[0] == plain
    assert "resumed as generation" not in (tmp_path / "cancel.0.err").read_text()
