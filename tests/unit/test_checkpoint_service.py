"""tpassd.snapshot / tpassd.restore: authorization, pid checks, and the CUDA step around a real CRIU dump."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from torchpass import auth, wire
from torchpass.errors import CheckpointError, RemoteError
from tpassd.checkpoint_service import CheckpointService, pid_in_job


def _proc(tmp_path, pid, env):
    d = tmp_path / "proc" / str(pid)
    d.mkdir(parents=True)
    (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")
    return str(tmp_path / "proc")


def test_pid_must_carry_the_job_and_rank(tmp_path):
    proc = _proc(tmp_path, 77, {"SLURM_JOB_ID": "5", "SLURM_PROCID": "1"})
    assert pid_in_job(77, 5, 1, proc)
    assert not pid_in_job(77, 6, 1, proc)
    assert not pid_in_job(77, 5, 0, proc)
    assert not pid_in_job(78, 5, None, proc)


def test_only_root_or_the_jobs_owner(tmp_path):
    svc = CheckpointService(tmp_path, "n1", job_owner=lambda j: {5: 1000}.get(j))
    svc.authorize(auth.Identity(uid=0, gid=0), 5)
    svc.authorize(auth.Identity(uid=1000, gid=1000), 5)
    with pytest.raises(auth.AuthFailure):
        svc.authorize(auth.Identity(uid=1001, gid=1001), 5)
    with pytest.raises(RemoteError, match="not known"):
        svc.authorize(auth.Identity(uid=1000, gid=1000), 6)


def test_kill_refuses_a_pid_outside_the_job(tmp_path):
    proc = _proc(tmp_path, 77, {"SLURM_JOB_ID": "9", "RANK": "1"})
    svc = CheckpointService(tmp_path, "n1", job_owner=lambda j: 0, proc=proc)
    msg = wire.Message("tpassd.snapshot", {"job_id": 5, "rank": 1, "op": "kill", "pid": 77,
                                           "rank_dir": str(tmp_path / "r")})
    with pytest.raises(RemoteError, match="not rank 1 of job 5"):
        svc.snapshot(msg, auth.Identity(uid=0, gid=0))


def test_verify_checks_the_manifest_checksum(tmp_path):
    from tpassd.checkpoint import criu

    d = tmp_path / "img"
    d.mkdir()
    (d / "core-1.img").write_bytes(b"x" * 100)
    criu.write_manifest(d, {"job": 5, "rank": 1})
    svc = CheckpointService(tmp_path, "n4", job_owner=lambda j: 0)
    ok = wire.Message("tpassd.restore", {"job_id": 5, "rank": 1, "op": "verify", "images": str(d)})
    assert svc.restore(ok, auth.Identity(uid=0, gid=0))["files"] == 1
    bad = wire.Message("tpassd.restore", {"job_id": 5, "rank": 1, "op": "verify", "images": str(d),
                                          "checksum": "0" * 64})
    with pytest.raises(RemoteError, match="does not match its checksum"):
        svc.restore(bad, auth.Identity(uid=0, gid=0))


def test_restore_fail_drill_corrupts_a_verified_snapshot_once(tmp_path):
    """The restore-fail drill: verify still passes, the restore's own SHA-256 check then refuses."""
    from torchpass.errors import CheckpointError
    from tpassd.checkpoint import criu

    d = tmp_path / "img"
    d.mkdir()
    (d / "core-1.img").write_bytes(b"c" * 10)
    (d / "pages-1.img").write_bytes(bytes(range(256)) * 4)
    criu.write_manifest(d, {"job": 5, "rank": 1})
    armed = [True]

    def take() -> bool:
        was, armed[0] = armed[0], False
        return was

    svc = CheckpointService(tmp_path, "n4", job_owner=lambda j: 0, restore_fault=take)
    msg = wire.Message("tpassd.restore", {"job_id": 5, "rank": 1, "op": "verify", "images": str(d),
                                          "checksum": criu_checksum(d)})
    assert svc.restore(msg, auth.Identity(uid=0, gid=0))["files"] == 2
    with pytest.raises(CheckpointError, match="pages-1.img fails its SHA-256 check"):
        criu.verify_manifest(d)
    # One-shot: a second snapshot verified here is left alone.
    d2 = tmp_path / "img2"
    d2.mkdir()
    (d2 / "pages-1.img").write_bytes(b"p" * 64)
    criu.write_manifest(d2, {"job": 5, "rank": 1})
    msg2 = wire.Message("tpassd.restore", {"job_id": 5, "rank": 1, "op": "verify", "images": str(d2)})
    svc.restore(msg2, auth.Identity(uid=0, gid=0))
    criu.verify_manifest(d2)


def criu_checksum(d):
    from tpassd.checkpoint_service import manifest_checksum

    return manifest_checksum(d)


def test_kill_and_abort_discard_the_ranks_images(tmp_path):
    """After a move (kill) or a rollback (abort) a rank's snapshots on this node are removed."""
    # A pid above any pid_max (2**22): never a real process, so the SIGKILL cannot hit one.
    gone = 5_000_000
    proc = _proc(tmp_path, gone, {"SLURM_JOB_ID": "5", "RANK": "1"})
    svc = CheckpointService(tmp_path / "snap", "n1", job_owner=lambda j: 0, proc=proc)
    for name in ("rank1.gen1", "rank1.gen2", "rank2.gen1"):
        d = tmp_path / "snap" / "job5" / name
        d.mkdir(parents=True)
        (d / "pages-1.img").write_bytes(b"x" * 1_000_000)
    root = auth.Identity(uid=0, gid=0)
    body = {"job_id": 5, "rank": 1, "rank_dir": str(tmp_path / "r")}
    res = svc.snapshot(wire.Message("tpassd.snapshot", {**body, "op": "kill", "pid": gone}), root)
    assert res["discarded_mb"] == 2.0 and res["killed"] is False  # it was already gone
    assert sorted(p.name for p in (tmp_path / "snap" / "job5").iterdir()) == ["rank2.gen1"]
    res = svc.snapshot(wire.Message("tpassd.snapshot", {**body, "rank": 2, "op": "abort"}), root)
    assert res["discarded_mb"] == 1.0 and not (tmp_path / "snap" / "job5").exists()


class _CudaRecorder:
    """Stands in for the driver's checkpoint API (no GPU here): records the calls."""

    def __init__(self, fail_suspend: bool = False):
        self.calls: list[tuple[str, int]] = []
        self.fail_suspend = fail_suspend

    def suspend(self, pid):
        self.calls.append(("suspend", pid))
        if self.fail_suspend:
            from torchpass.errors import CheckpointError

            raise CheckpointError(f"cuCheckpointProcessCheckpoint(pid {pid}) failed: CUresult 2")

    def resume(self, pid):
        self.calls.append(("resume", pid))


def _gpu_rank(tmp_path):
    import subprocess
    import sys

    env = {**os.environ, "SLURM_JOB_ID": "5", "RANK": "1"}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    # Until the child has exec'd, /proc/PID/environ is still the test's own (no SLURM_JOB_ID).
    import time

    deadline = time.monotonic() + 10
    while b"SLURM_JOB_ID=5" not in Path(f"/proc/{proc.pid}/environ").read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    rank_dir = tmp_path / "ranks" / "job5"
    rank_dir.mkdir(parents=True)
    record = rank_dir / "rank1.json"
    record.write_text(json.dumps({"pid": proc.pid, "wrapper_pid": os.getpid()}))
    return proc, record, rank_dir / "rank1.handoff"


def test_dump_of_a_gpu_rank_suspends_cuda_around_a_real_criu_dump(tmp_path):
    # Real CRIU, real process; only the GPU (absent here) is stood in for.
    import time

    cuda = _CudaRecorder()
    proc, record, marker = _gpu_rank(tmp_path)
    try:
        time.sleep(0.5)
        svc = CheckpointService(tmp_path / "snap", "n1", job_owner=lambda j: 0,
                                gpu_in_use=lambda pid: True, cuda_loader=lambda: cuda)
        out = svc._dump(5, 1, 1, record, marker)
        assert cuda.calls == [("suspend", proc.pid), ("resume", proc.pid)]
        manifest = json.loads((Path(out["images"]) / "manifest.json").read_text())
        assert manifest["meta"]["gpu"] is True  # the restore wrapper resumes CUDA on the target
        assert marker.read_text() == "moved\n"
        assert proc.poll() is None  # left running: a rollback resumes it in place
    finally:
        proc.kill()
        proc.wait()


def test_failed_cuda_checkpoint_aborts_the_move_and_leaves_the_rank_running(tmp_path):
    cuda = _CudaRecorder(fail_suspend=True)
    proc, record, marker = _gpu_rank(tmp_path)
    try:
        svc = CheckpointService(tmp_path / "snap", "n1", job_owner=lambda j: 0,
                                gpu_in_use=lambda pid: True, cuda_loader=lambda: cuda)
        with pytest.raises(CheckpointError, match=r"cuCheckpointProcessCheckpoint\(pid \d+\) failed"):
            svc._dump(5, 1, 1, record, marker)
        assert cuda.calls == [("suspend", proc.pid)]  # never dumped, nothing to give back
        assert marker.read_text() == "abort\n" and proc.poll() is None
        assert not (tmp_path / "snap" / "job5" / "rank1.gen1").exists()
    finally:
        proc.kill()
        proc.wait()


def test_a_gpu_rank_on_a_node_without_cuda_checkpoint_is_refused_before_anything_moves(tmp_path):
    from torchpass.errors import DependencyError

    def no_driver():
        raise DependencyError("libcuda not found (x): GPU ranks cannot be checkpointed on this node")

    proc, record, marker = _gpu_rank(tmp_path)
    try:
        svc = CheckpointService(tmp_path / "snap", "n1", job_owner=lambda j: 0,
                                gpu_in_use=lambda pid: True, cuda_loader=no_driver)
        with pytest.raises(RemoteError, match="holds GPU state but this node cannot checkpoint CUDA: libcuda"):
            svc._dump(5, 1, 1, record, marker)
        assert not marker.exists() and proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_gpu_detection_reads_the_process_maps(tmp_path):
    from tpassd.checkpoint_service import maps_nvidia_device

    (tmp_path / "proc" / "10").mkdir(parents=True)
    (tmp_path / "proc" / "10" / "maps").write_text("7f00-7f01 rw-s 00000000 00:05 12 /dev/nvidia0\n")
    (tmp_path / "proc" / "11").mkdir(parents=True)
    (tmp_path / "proc" / "11" / "maps").write_text("7f00-7f01 r-xp 00000000 08:01 99 /usr/lib/libc.so.6\n")
    proc = str(tmp_path / "proc")
    assert maps_nvidia_device(10, proc) and not maps_nvidia_device(11, proc) and not maps_nvidia_device(12, proc)
    assert not maps_nvidia_device(os.getpid())  # no GPU on this machine
