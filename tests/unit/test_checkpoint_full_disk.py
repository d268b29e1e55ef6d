"""A full image disk and an aborted dump of a GPU rank (never left paused).

Real CRIU dumps a real rank into a small tmpfs mounted in a private mount
namespace (``unshare -m``: the mount vanishes with the namespace, nothing to
clean up on the host). The scenario runs in that namespace as this file's
``__main__`` (the dump requires the rank to share the dumper's mount namespace)
and prints what it saw as JSON; the tests assert on it.

The CUDA cases drive torchpass.checkpoint.cuda.CudaCheckpoint, the class tpassd
uses, over a fake libcuda (test_criu_checkpoint.FakeLib: the driver's
checkpoint state machine). There is no GPU here: the real driver path is only
exercised on a GPU machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchpass import auth, layout, wire
from torchpass.checkpoint import criu

TRACE_CALLS = ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore",
               "cuCheckpointProcessUnlock", "estimate")
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs and dumps as tpassd does: needs root")
NO_SPACE = re.compile(r"no space for rank 1's image on (\S+): need ~(\d+) MB, (\d+) MB free")


def _scenario(case: str, tmp: Path) -> dict:
    """Run in a private mount namespace: a tmpfs snapshot_dir, a rank, one dump request."""
    from test_criu_checkpoint import FakeLib
    from torchpass.checkpoint import cuda as cuda_mod
    from torchpass.checkpoint.service import CheckpointService

    size_mb, rank_mb = {"precheck": (8, 48), "midwrite": (2, 8), "cuda-midwrite": (2, 8),
                        "cuda-after-suspend": (8, 1)}[case]
    snap = tmp / "snap"
    snap.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", str(snap)], check=True)
    rank = subprocess.Popen([sys.executable, "-c", f"b = b'x' * ({rank_mb} << 20); import time; time.sleep(60)"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    trace: list[str] = []
    lib = FakeLib()
    lib.calls = trace  # the driver's calls and the space checks, in one order
    marker_at_unlock: list[str] = []
    rank_dir = layout.rank_records_dir(tmp / "state", 5)
    marker = layout.handoff(rank_dir, 5, 1)
    unlock = lib.cuCheckpointProcessUnlock

    def unlock_and_look(*args):
        marker_at_unlock.append(marker.read_text() if marker.exists() else "")
        return unlock(*args)

    lib.cuCheckpointProcessUnlock = unlock_and_look

    def estimate(pid: int) -> int:
        trace.append("estimate")
        if case == "precheck":
            return criu.image_estimate(pid)
        if case == "cuda-after-suspend" and lib.state == cuda_mod.ProcessState.CHECKPOINTED:
            return 1 << 40  # the GPU's memory, now in host memory, does not fit
        return 0  # the estimate misses: the disk fills while CRIU writes

    gpu = case.startswith("cuda")
    try:
        deadline = time.monotonic() + 10  # until the rank holds its memory
        while time.monotonic() < deadline and criu.image_estimate(rank.pid) < (rank_mb << 20):
            time.sleep(0.02)
        record = layout.rank_record(rank_dir, 5, 1)
        record.parent.mkdir(parents=True)
        record.write_text(json.dumps({"pid": rank.pid, "wrapper_pid": os.getpid()}))
        svc = CheckpointService(snap, "n1", state_dir=tmp / "state", job_owner=lambda j: 0,
                                job_pids=lambda j: {rank.pid, os.getpid()}, gpu_in_use=lambda pid: gpu,
                                cuda_loader=lambda: cuda_mod.CudaCheckpoint(lib), image_estimate=estimate)
        error = None
        try:
            svc.snapshot(wire.Message("tpassd.snapshot", {"job_id": 5, "rank": 1, "op": "dump", "generation": 1}),
                         auth.Identity(uid=0, gid=0))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            error = f"{type(exc).__name__}: {exc}"
        with open(f"/proc/{rank.pid}/stat") as f:
            rank_state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{rank.pid}/status") as f:
            tracer = next(ln.split()[1] for ln in f if ln.startswith("TracerPid:"))
        return {"error": error, "snap": str(snap), "left": sorted(str(p.relative_to(snap)) for p in snap.rglob("*")),
                "free": criu.free_bytes(snap), "size": size_mb << 20, "rank_alive": rank.poll() is None,
                "rank_state": rank_state, "tracer": tracer, "marker": marker.read_text() if marker.exists() else None,
                "trace": [c for c in trace if c in TRACE_CALLS], "marker_at_unlock": marker_at_unlock,
                "cuda_state": lib.state.name}
    finally:
        rank.kill()
        rank.wait()
        subprocess.run(["umount", str(snap)], check=False)


def _run(case: str, tmp_path: Path) -> dict:
    out = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, __file__, case, str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _untouched_and_running(r: dict) -> None:
    assert r["rank_alive"] and r["rank_state"] in "RS" and r["tracer"] == "0"  # not frozen, not ptraced
    assert r["free"] == r["size"]  # the partial image was removed: the tmpfs is empty again
    assert r["left"] in ([], ["job5"])  # at most the (empty) job directory


@root_only
def test_a_full_image_disk_refuses_the_dump_before_the_rank_is_touched(tmp_path):
    r = _run("precheck", tmp_path)
    m = NO_SPACE.search(r["error"] or "")
    assert m, r["error"]
    assert m.group(1) == r["snap"] and int(m.group(2)) > 48 and int(m.group(3)) <= 8
    assert "free space there or set snapshot_dir to a larger disk" in r["error"] and "during" not in r["error"]
    assert r["error"].count("\n") == 0
    assert r["marker"] is None and r["trace"] == ["estimate"]  # no hand-off started, no CRIU
    _untouched_and_running(r)


@root_only
def test_a_disk_that_fills_while_criu_writes_fails_cleanly_and_leaves_no_partial_image(tmp_path):
    r = _run("midwrite", tmp_path)
    m = NO_SPACE.search(r["error"] or "")
    assert m and "(the disk filled up during the dump)" in r["error"], r["error"]
    assert int(m.group(2)) >= 1 and int(m.group(3)) == 2  # what CRIU had written when the disk was full
    assert r["marker"] == "abort\n"
    _untouched_and_running(r)


@root_only
def test_a_dump_that_fills_the_disk_gives_a_gpu_rank_its_cuda_state_back_before_it_resumes(tmp_path):
    r = _run("cuda-midwrite", tmp_path)
    assert NO_SPACE.search(r["error"] or "") and "during the dump" in r["error"], r["error"]
    # lock, checkpoint, (space check) CRIU fails, restore, unlock; the move is called off after.
    assert r["trace"] == ["estimate", "cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint", "estimate",
                          "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock"]
    assert r["marker_at_unlock"] == ["moving\n"] and r["marker"] == "abort\n"
    assert r["cuda_state"] == "RUNNING"
    _untouched_and_running(r)


@root_only
def test_gpu_state_too_large_for_the_disk_after_the_suspend_rolls_cuda_back(tmp_path):
    r = _run("cuda-after-suspend", tmp_path)
    m = NO_SPACE.search(r["error"] or "")
    assert m and int(m.group(2)) == -(-(1 << 40) // 1_000_000) and "during" not in r["error"], r["error"]
    assert r["trace"] == ["estimate", "cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint", "estimate",
                          "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock"]
    assert r["marker_at_unlock"] == ["moving\n"] and r["marker"] == "abort\n" and r["cuda_state"] == "RUNNING"
    _untouched_and_running(r)


def test_the_rollback_event_quotes_the_no_space_line():
    """What the coordinator gets (the tpassd reply's message, as RemoteError words it) is
    the reason of its rollback and of the event it publishes."""
    from test_decide import Sim
    from torchpass.coordinator import machine as mc
    from torchpass.coordinator.contract import Event, ResumeInPlace
    from torchpass.errors import RemoteError

    line = str(criu.no_space("rank 3", "/var/lib/torchpass/snapshots", 70_000_000, 8_000_000))
    sim = Sim()
    sim.degrade("node2")
    sim.quiesce_all()
    d = sim.tick(0.2, mc.MigrationDumpFailed("m1", 3, str(RemoteError("failed", line))))
    assert line in sim.of(d, ResumeInPlace)[0].why
    (ev,) = [e for e in sim.of(d, Event) if e.kind == "migration.rollback"]
    assert line in ev.message and line in ev.data["why"] and ev.data["phase"] == "dump"


def test_image_estimate_counts_the_trees_private_memory(tmp_path):
    (tmp_path / "10" / "task" / "10").mkdir(parents=True)
    (tmp_path / "10" / "task" / "10" / "children").write_text("11")
    (tmp_path / "11" / "task" / "11").mkdir(parents=True)
    (tmp_path / "11" / "task" / "11" / "children").write_text("")
    (tmp_path / "10" / "status").write_text("Name:\tpy\nRssAnon:\t  1000 kB\nRssFile:\t 9999 kB\nRssShmem:\t 24 kB\n")
    (tmp_path / "11" / "status").write_text("Name:\tpy\nRssAnon:\t  500 kB\nVmSwap:\t  476 kB\n")
    want = (1000 + 24 + 500 + 476) * 1024  # file-backed pages are not dumped
    assert criu.image_estimate(10, str(tmp_path)) == int(want * (1 + criu.IMAGE_MARGIN_FRACTION)) + \
        criu.IMAGE_MARGIN_BYTES


if __name__ == "__main__":
    print(json.dumps(_scenario(sys.argv[1], Path(sys.argv[2]))))
