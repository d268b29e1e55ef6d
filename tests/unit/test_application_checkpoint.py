"""torchpass.checkpoint (application restore points) with real gloo ranks and real DCP files.

examples/train_checkpointed.py is examples/train_ddp.py plus ``Checkpointer``: a fault-free run
must print train_ddp's losses bit for bit, a relaunch must go on from the newest complete
checkpoint with the same losses, and under the runtime a rank about to be dumped must not
keep a checkpoint file open in its image. Losses compare as float.hex.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from torchpass.runtime.testing import MiniCoordinator, finish_ranks, free_port, hold_files, launch_ranks

REPO = Path(__file__).resolve().parents[2]
PLAIN = REPO / "examples" / "train_ddp.py"
CHECKPOINTED = REPO / "examples" / "train_checkpointed.py"
WORLD = 2
STEPS = 40
EVERY = 10
ARGS = ["--steps", str(STEPS), "--params", "200K"]
JOB = 4747

# The checkpointed example behind a slow filesystem: every data file stays open SLOW_WRITE_S
# before it is written, so a save is still being written when the test pauses the ranks.
SLOW = """
import contextlib, os, runpy, sys, time
from torch.distributed.checkpoint import filesystem as fsmod
orig = fsmod.FileSystem.create_stream
@contextlib.contextmanager
def slow(self, path, mode):
    with orig(self, path, mode) as stream:
        if str(path).endswith(".distcp"):
            time.sleep(float(os.environ["SLOW_WRITE_S"]))
        yield stream
fsmod.FileSystem.create_stream = slow
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run(tmp: Path, tag: str, script: Path, args: list[str], **kw) -> tuple[list[list[str]], list[str]]:
    procs = launch_ranks([sys.executable, str(script), *args], WORLD, tmp, tag, runtime=kw.pop("runtime", False),
                         job_id=JOB, **kw)
    return finish_ranks(procs, tmp, tag, timeout=180)


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> list[str]:
    tmp = tmp_path_factory.mktemp("plain")
    out, _ = run(tmp, "plain", PLAIN, ARGS)
    assert len(out[0]) == STEPS and out[0] == out[1]
    return out[0]


def open_paths(pid: int) -> list[str]:
    paths = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            paths.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass  # closed meanwhile
    return paths


def steps_of(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.iterdir() if p.name.startswith("step-"))


def test_saves_change_nothing_and_a_relaunch_goes_on_from_the_newest_complete_checkpoint(plain, tmp_path):
    ckpt = tmp_path / "ckpt"
    args = [*ARGS, "--ckpt-dir", str(ckpt), "--ckpt-every", str(EVERY)]
    out, errs = run(tmp_path, "first", CHECKPOINTED, args)
    assert out[0] == plain and out[1] == plain
    assert [f"ckpt saved step={s}" in errs[0] for s in (10, 20, 30)] == [True] * 3
    # keep=2: the two newest remain, each complete (DCP's .metadata, and torchpass.json last)
    assert steps_of(ckpt) == [20, 30]
    for step in (20, 30):
        d = ckpt / f"step-{step:09d}"
        record = json.loads((d / "torchpass.json").read_text())
        assert record["step"] == step and record["world_size"] == WORLD
        # the bytes of the checkpoint's data and .metadata (torchpass.json is written after them)
        assert record["bytes"] == sum(f.stat().st_size for f in d.iterdir() if f.name != "torchpass.json")
        assert (d / ".metadata").is_file() and not (d / ".torchpass-results").exists()
    # a save that never completed (the job died while writing it) is not a restore point
    torn = ckpt / "step-000000035"
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"half")
    # and one of a step the relaunch saves again, with a stale results file of rank 1
    stale = ckpt / "step-000000040" / ".torchpass-results"
    stale.mkdir(parents=True)
    (stale / "1.results").write_bytes(b"stale")
    out, errs = run(tmp_path, "relaunch", CHECKPOINTED, [*args[:1], "50", *args[2:]])
    assert "ckpt loaded step=30" in errs[0]
    assert out[0][:10] == plain[30:] and out[1][:10] == plain[30:]
    assert "ckpt saved step=40" in errs[0] and "failed" not in errs[0]
    # step 40 was saved anew (the stale results file did not pass for rank 1's part)
    assert steps_of(ckpt) == [30, 40]
    assert json.loads((ckpt / "step-000000040" / "torchpass.json").read_text())["step"] == 40


def test_a_corrupt_checkpoint_is_one_clear_error(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = [*ARGS[:2], "20", *ARGS[2:], "--ckpt-dir", str(ckpt), "--ckpt-every", str(EVERY)]
    run(tmp_path, "first", CHECKPOINTED, args[:1] + args[2:])  # --steps 20: one checkpoint, step 10
    (ckpt / "step-000000010" / ".metadata").write_bytes(b"not a pickle")
    procs = launch_ranks([sys.executable, str(CHECKPOINTED), *args[:1], *args[2:]], WORLD, tmp_path, "bad",
                         runtime=False, job_id=JOB)
    for p in procs:
        p.wait(120)
    err = (tmp_path / "bad.0.err").read_text()
    assert all(p.returncode != 0 for p in procs)
    assert "torchpass.errors.CheckpointError" in err or "CheckpointError" in err
    assert "cannot load checkpoint" in err and "move that directory aside" in err


def test_a_rank_about_to_be_dumped_waits_for_its_write_and_one_that_stays_does_not(plain, tmp_path):
    """A pause during a save: the held rank (to be dumped) reports quiesced only once its
    background write ended, with no checkpoint file open; the other rank quiesces at once while
    its write goes on. Training is bit-identical and every checkpoint completes."""
    ckpt = tmp_path / "ckpt"
    slow_s = 2.0
    args = [str(CHECKPOINTED), *ARGS, "--ckpt-dir", str(ckpt), "--ckpt-every", str(EVERY), "--sleep", "0.02"]
    with MiniCoordinator(WORLD, JOB) as coord:
        procs = launch_ranks([sys.executable, "-c", SLOW, *args], WORLD, tmp_path, "pause", runtime=True,
                             job_id=JOB, coordinator=coord.endpoint, env={"SLOW_WRITE_S": str(slow_s)})
        try:
            coord.wait_registered()
            pid1 = coord.ranks[1].pid
            deadline = time.monotonic() + 60
            while "ckpt saved step=10" not in (tmp_path / "pause.0.err").read_text():
                assert time.monotonic() < deadline, "no save in 60 s"
                time.sleep(0.01)
            t_saved = time.monotonic()
            hold = hold_files(tmp_path, JOB, "m1", [1])
            _at, gen = coord.pause(margin=1, hold_files=hold)
            q = coord.wait_quiesced()
            waited = time.monotonic() - t_saved
            open_files = open_paths(pid1)
            assert not [f for f in open_files if f.startswith(str(ckpt))], open_files
            assert q[1]["hold"] and not q[0]["hold"]
            # the rank about to be dumped freed its allocator caches; the one that stays kept them
            assert q[1]["released_mb"] >= 0 and "released_mb" not in q[0], q
            assert q[1]["drain_s"] > 0.5 * slow_s, q  # it waited for its write
            assert q[0]["drain_s"] < 0.5 * slow_s, q  # the rank that stays did not
            assert waited >= 0.5 * slow_s
            Path(hold[1]).touch()
            coord.resume(gen, "127.0.0.1", free_port())
            coord.wait_resumed(gen)
            out, _errs = finish_ranks(procs, tmp_path, "pause", timeout=180)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        reports = [(c["rank"], c["outcome"], c["step"]) for c in coord.checkpoints]
    assert out[0] == plain and out[1] == plain
    assert reports == [(0, "completed", 10), (0, "completed", 20), (0, "completed", 30)]
    first = coord.checkpoints[0]
    assert first["path"] == str(ckpt / "step-000000010") and first["bytes"] > 0
    assert first["write_s"] >= slow_s and first["blocking_s"] < first["write_s"]
    assert first["removed"] == [] and coord.checkpoints[2]["removed"] == [10]


# FSDP2 (fully_shard on 2 ranks) with Adam: each rank holds half of every parameter and of its
# optimizer state; ModelState saves the shards (DTensors) and loads them back in place.
FSDP = """
import os, sys, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.fsdp import fully_shard
import torchpass.checkpoint as tpc
steps, every, die_after, root = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
fully_shard(m[0]); fully_shard(m[2]); fully_shard(m)
opt = torch.optim.Adam(m.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(rank)
class Data:
    def state_dict(self): return {f"rank{rank}": g.get_state()}
    def load_state_dict(self, s): g.set_state(s[f"rank{rank}"])
ckpt = tpc.Checkpointer(root)
state = {"train": tpc.ModelState(m, opt), "data": Data()}
start = ckpt.load(state) or 0
print(f"start={start}", flush=True)
for n in range(start, steps):
    loss = m(torch.randn(16, 32, generator=g)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    t = loss.detach().clone(); dist.all_reduce(t)
    print(f"step={n} loss={(t.item() / 2).hex()}", flush=True)
    if (n + 1) % every == 0:
        ckpt.save(n + 1, state)
    if n + 1 == die_after:
        ckpt.close()
        sys.stdout.flush()
        os._exit(0)  # the job died here: a relaunch goes on from the newest complete checkpoint
ckpt.close()
del m, opt, state
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""


def test_fsdp2_shards_and_their_optimizer_state_come_back_bit_identical(tmp_path):
    def fsdp(tag: str, *args) -> list[str]:
        procs = launch_ranks([sys.executable, "-c", FSDP, *map(str, args)], WORLD, tmp_path, tag,
                             runtime=False, job_id=JOB)
        out, _ = finish_ranks(procs, tmp_path, tag, timeout=180)
        assert out[0] == out[1]
        return out[0]

    clean = fsdp("clean", 30, 100, 0, tmp_path / "none")
    died = fsdp("died", 30, 10, 25, tmp_path / "ckpt")
    relaunched = fsdp("relaunch", 30, 10, 0, tmp_path / "ckpt")
    assert clean[0] == "start=0" and died[0] == "start=0" and relaunched[0] == "start=20"
    assert died[1:] == clean[1:26]
    assert relaunched[1:] == clean[21:]  # only steps 20..24 were computed twice


def test_rank_0_clears_a_steps_directory_without_removing_it_under_the_other_ranks(tmp_path):
    """Rank 0 clears what an earlier run left in a step's directory while the other ranks' DCP
    writers create that directory (mkdir(parents=True, exist_ok=True), before the plan's
    collectives). Removing the directory itself failed another rank's mkdir with FileExistsError
    when it vanished between that rank's mkdir and its check (likely how a CI run lost a rank, 2026-12-05).
    Here a thread does what the other ranks' writers do, while rank 0 (world 1) saves the same
    step again and again."""
    import threading

    import torch

    from torchpass.checkpoint import application as app

    ckpt = app.Checkpointer(tmp_path / "ckpt", keep=1)
    path = app.step_dir(ckpt.root, 10)
    state = {"w": {"t": torch.arange(1000, dtype=torch.float32)}}
    errors: list[Exception] = []
    stop = threading.Event()

    def other_ranks_writer():
        while not stop.is_set():
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                errors.append(exc)

    t = threading.Thread(target=other_ranks_writer)
    t.start()
    try:
        for _ in range(40):
            (path / app.RESULTS_DIR).mkdir(parents=True, exist_ok=True)
            (path / app.RESULTS_DIR / "stale").write_text("an earlier run's")
            ckpt.save(10, state)
            assert not (path / app.RESULTS_DIR / "stale").exists()  # cleared before this save's plan
            assert ckpt.wait(60)
            assert json.loads((path / app.COMPLETE).read_text())["step"] == 10
    finally:
        stop.set()
        t.join()
        ckpt.close()
    assert errors == []


def test_clearing_a_steps_directory_never_follows_a_symlink(tmp_path):
    """A symlink where a step's directory belongs is removed, and what it points at is left."""
    from torchpass.checkpoint import application as app

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("not the checkpoint's")
    link = tmp_path / "step-000000010"
    link.symlink_to(elsewhere)
    app._empty_dir(link)
    assert not link.exists() and not link.is_symlink()
    assert (elsewhere / "keep").read_text() == "not the checkpoint's"
    app._empty_dir(tmp_path / "missing")  # nothing there: nothing to do
