"""tpassd.snapshot / tpassd.restore: authorization, pid checks, and the CUDA step around a real CRIU dump.

The adversarial checks of the privilege boundary are in test_privilege_boundary.py."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from torchpass import auth, layout, wire
from torchpass.checkpoint import manifest as mf
from torchpass.checkpoint import procs
from torchpass.checkpoint.criu import tree_pids
from torchpass.checkpoint.node_settings import maps_nvidia_device
from torchpass.checkpoint.service import CheckpointService
from torchpass.errors import CheckpointError, RemoteError

ROOT = auth.Identity(uid=0, gid=0)


def _sleeper(**kw) -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, **kw)


def test_only_root_or_the_jobs_owner(tmp_path):
    svc = CheckpointService(tmp_path, "n1", job_owner=lambda j: {5: 1000}.get(j))
    svc.authorize(auth.Identity(uid=0, gid=0), 5)
    svc.authorize(auth.Identity(uid=1000, gid=1000), 5)
    with pytest.raises(auth.AuthFailure):
        svc.authorize(auth.Identity(uid=1001, gid=1001), 5)
    with pytest.raises(RemoteError, match="not known"):
        svc.authorize(auth.Identity(uid=1000, gid=1000), 6)


def test_kill_refuses_a_pid_outside_the_job(tmp_path):
    other = _sleeper()  # a live process Slurm does not list for job 5
    try:
        svc = CheckpointService(tmp_path, "n1", job_owner=lambda j: 0, job_pids=lambda j: set())
        msg = wire.Message("tpassd.snapshot", {"job_id": 5, "rank": 1, "op": "kill", "pid": other.pid})
        with pytest.raises(RemoteError, match=f"pid {other.pid} is not a process of job 5 on this node"):
            svc.snapshot(msg, ROOT)
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_a_request_asks_slurm_each_question_once(tmp_path):
    """A user's kill: the owner is asked once (its authorization's answer pins the pid too), the
    job's pids once. Each question costs 6-14 ms while a migrating job stands still."""
    asked: list[str] = []
    victim = _sleeper()  # not listed for the job: the pin refuses it after asking

    def owner(job_id):
        asked.append("owner")
        return 1000

    def pids(job_id):
        asked.append("pids")
        return set()

    try:
        svc = CheckpointService(tmp_path, "n1", job_owner=owner, job_pids=pids)
        msg = wire.Message("tpassd.snapshot", {"job_id": 5, "rank": 1, "op": "kill", "pid": victim.pid})
        with pytest.raises(RemoteError, match="is not a process of job 5"):
            svc.snapshot(msg, auth.Identity(uid=1000, gid=1000))
        assert sorted(asked) == ["owner", "pids"] and victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.parametrize("uid", [0], ids=["root"])
def test_the_owner_and_the_pids_are_asked_at_once(tmp_path, uid):
    """Both questions go out together for root (whose request asks the owner only to pin): a barrier
    both must reach, broken if asked in turn. A user's request asks for the pids only once its
    authorization (the owner, from tpassd's admission cache) said yes: the next test."""
    both = threading.Barrier(2, timeout=5)
    victim = _sleeper()

    def owner(job_id):
        both.wait()
        return uid

    def pids(job_id):
        both.wait()
        return set()

    try:
        svc = CheckpointService(tmp_path, "n1", job_owner=owner, job_pids=pids)
        msg = wire.Message("tpassd.snapshot", {"job_id": 5, "rank": 1, "op": "kill", "pid": victim.pid})
        with pytest.raises(RemoteError, match="is not a process of job 5"):
            svc.snapshot(msg, auth.Identity(uid=uid, gid=uid))
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_a_refused_request_never_asks_slurmd_for_the_jobs_pids(tmp_path):
    """scontrol listpids costs a thread and a slurmd call: a request from a uid that does not own
    the job is refused before it (and the owner's own request asks it after its authorization)."""
    asked: list[tuple[str, int]] = []

    def owner(job_id):
        asked.append(("owner", job_id))
        return 1000

    def pids(job_id):
        asked.append(("pids", job_id))
        return set()

    victim = _sleeper()
    try:
        svc = CheckpointService(tmp_path, "n1", job_owner=owner, job_pids=pids)
        msg = wire.Message("tpassd.snapshot", {"job_id": 5, "rank": 1, "op": "kill", "pid": victim.pid})
        with pytest.raises(auth.AuthFailure, match="does not own job 5"):
            svc.snapshot(msg, auth.Identity(uid=1001, gid=1001))
        time.sleep(0.2)  # a pids question started in a thread would have been recorded by now
        assert asked == [("owner", 5)]
        with pytest.raises(RemoteError, match="is not a process of job 5"):
            svc.snapshot(msg, auth.Identity(uid=1000, gid=1000))
        assert asked[1:] == [("owner", 5), ("pids", 5)]
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_a_failed_pids_question_is_the_requests_error(tmp_path):
    def pids(job_id):
        raise RemoteError("unavailable", "'scontrol listpids 5' did not answer in 10 s; is this node's slurmd up?")

    victim = _sleeper()
    try:
        svc = CheckpointService(tmp_path, "n1", job_owner=lambda j: 0, job_pids=pids)
        msg = wire.Message("tpassd.snapshot", {"job_id": 5, "rank": 1, "op": "kill", "pid": victim.pid})
        with pytest.raises(RemoteError, match="slurmd up") as ei:
            svc.snapshot(msg, ROOT)
        assert ei.value.code == "unavailable" and victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_verify_checks_the_manifest_checksum(tmp_path):
    d = layout.images_dir(tmp_path / "snap", 5, 1, 1)
    d.mkdir(parents=True)
    (d / "core-1.img").write_bytes(b"x" * 100)
    mf.write_manifest(d, {"job": 5, "rank": 1})
    svc = CheckpointService(tmp_path / "snap", "n4", job_owner=lambda j: 0)
    ok = wire.Message("tpassd.restore", {"job_id": 5, "rank": 1, "op": "verify", "images": str(d)})
    assert svc.restore(ok, auth.Identity(uid=0, gid=0))["files"] == 1
    bad = wire.Message("tpassd.restore", {"job_id": 5, "rank": 1, "op": "verify", "images": str(d),
                                          "checksum": "0" * 64})
    with pytest.raises(RemoteError, match="does not match its checksum"):
        svc.restore(bad, auth.Identity(uid=0, gid=0))


def test_restore_fail_drill_corrupts_a_verified_snapshot_once(tmp_path):
    """The restore-fail drill: verify still passes, the restore's own BLAKE3 check then refuses."""
    from torchpass.errors import CheckpointError
    d = layout.images_dir(tmp_path / "snap", 5, 1, 1)
    d.mkdir(parents=True)
    (d / "core-1.img").write_bytes(b"c" * 10)
    (d / "pages-1.img").write_bytes(bytes(range(256)) * 4)
    mf.write_manifest(d, {"job": 5, "rank": 1})
    armed = [True]

    def take() -> bool:
        was, armed[0] = armed[0], False
        return was

    svc = CheckpointService(tmp_path / "snap", "n4", job_owner=lambda j: 0, restore_fault=take)
    msg = wire.Message("tpassd.restore", {"job_id": 5, "rank": 1, "op": "verify", "images": str(d),
                                          "checksum": mf.checksum(d)})
    assert svc.restore(msg, auth.Identity(uid=0, gid=0))["files"] == 2
    with pytest.raises(CheckpointError, match="pages-1.img fails its BLAKE3 check"):
        mf.verify_manifest(d)
    # One-shot: a second snapshot verified here is left alone.
    d2 = layout.images_dir(tmp_path / "snap", 5, 1, 2)
    d2.mkdir()
    (d2 / "pages-1.img").write_bytes(b"p" * 64)
    mf.write_manifest(d2, {"job": 5, "rank": 1})
    msg2 = wire.Message("tpassd.restore", {"job_id": 5, "rank": 1, "op": "verify", "images": str(d2)})
    svc.restore(msg2, auth.Identity(uid=0, gid=0))
    mf.verify_manifest(d2)


def test_kill_and_abort_discard_the_ranks_images(tmp_path):
    """After a move (kill) or a rollback (abort) a rank's snapshots on this node are removed."""
    # A pid above any pid_max (2**22): never a real process, so the SIGKILL cannot hit one.
    gone = 5_000_000
    svc = CheckpointService(tmp_path / "snap", "n1", state_dir=tmp_path / "state", job_owner=lambda j: 0,
                            job_pids=lambda j: {gone})
    for name in ("rank1.gen1", "rank1.gen2", "rank2.gen1"):
        d = tmp_path / "snap" / "job5" / name
        d.mkdir(parents=True)
        (d / "pages-1.img").write_bytes(b"x" * 1_000_000)
    root = auth.Identity(uid=0, gid=0)
    body = {"job_id": 5, "rank": 1}
    res = svc.snapshot(wire.Message("tpassd.snapshot", {**body, "op": "kill", "pid": gone}), root)
    assert res["discarded_mb"] == 2.0 and res["killed"] is False  # it was already gone
    # gone from the rank's names when the reply goes; the bytes are removed after it
    assert layout.images_dirs(tmp_path / "snap", 5, 1) == []
    later = tmp_path / "snap" / "job5" / "rank1.gen3"  # a later dump of the rank, made meanwhile
    later.mkdir()
    assert svc.wait_discarded(10.0)
    assert sorted(p.name for p in (tmp_path / "snap" / "job5").iterdir()) == ["rank1.gen3", "rank2.gen1"]
    later.rmdir()
    res = svc.snapshot(wire.Message("tpassd.snapshot", {**body, "rank": 2, "op": "abort"}), root)
    assert res["discarded_mb"] == 1.0 and svc.wait_discarded(10.0)
    assert not (tmp_path / "snap" / "job5").exists()


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

    def resume(self, pid, pairs=()):
        self.calls.append(("resume", pid))


def _gpu_rank(tmp_path):
    """A rank (this test's child) with its record where tpassd looks, and a service
    for which Slurm lists it and this test (its wrapper) as job 5's."""
    proc = _sleeper(start_new_session=True)
    rank_dir = layout.rank_records_dir(tmp_path / "state", 5)
    record = layout.rank_record(rank_dir, 5, 1)
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"pid": proc.pid, "wrapper_pid": os.getpid()}))
    return proc, layout.handoff(rank_dir, 5, 1)


def _service(tmp_path, proc, cuda_loader):
    return CheckpointService(tmp_path / "snap", "n1", state_dir=tmp_path / "state", job_owner=lambda j: 0,
                             job_pids=lambda j: {proc.pid, os.getpid()}, gpu_in_use=lambda pid: True,
                             cuda_loader=cuda_loader)


def _dump(svc):
    return svc.snapshot(wire.Message("tpassd.snapshot", {"job_id": 5, "rank": 1, "op": "dump", "generation": 1}),
                        ROOT)


def test_dump_of_a_gpu_rank_suspends_cuda_around_a_real_criu_dump(tmp_path):
    # Real CRIU, real process; only the GPU (absent here) is stood in for.
    cuda = _CudaRecorder()
    proc, marker = _gpu_rank(tmp_path)
    try:
        time.sleep(0.5)
        out = _dump(_service(tmp_path, proc, lambda: cuda))
        assert cuda.calls == [("suspend", proc.pid), ("resume", proc.pid)]
        manifest = json.loads((Path(out["images"]) / "manifest.json").read_text())
        assert manifest["meta"]["gpu"] is True  # the restore wrapper resumes CUDA on the target
        assert marker.read_text() == "moved\n"
        assert proc.poll() is None  # left running: a rollback resumes it in place
    finally:
        proc.kill()
        proc.wait()


def test_the_dumps_manifest_names_the_ranks_gpus_in_local_order(tmp_path, monkeypatch):
    """The restore remaps the GPUs the image names: the manifest records their UUIDs, ascending by
    device minor (the /dev/nvidiaN the rank maps: stood in for here, there is no GPU)."""
    from torchpass.checkpoint import gpu_map

    uuids = {4: "GPU-1f0e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", 6: "GPU-00112233-4455-6677-8899-aabbccddeeff"}
    proc, marker = _gpu_rank(tmp_path)
    monkeypatch.setattr(gpu_map, "mapped_gpu_minors", lambda pids, _proc="/proc": [4, 6] if proc.pid in pids else [])
    try:
        svc = _service(tmp_path, proc, _CudaRecorder)
        svc.settings.gpu_uuids_by_minor = lambda: uuids
        out = _dump(svc)
        meta = json.loads((Path(out["images"]) / "manifest.json").read_text())["meta"]
        assert meta["gpu_uuids"] == [uuids[4], uuids[6]]
    finally:
        proc.kill()
        proc.wait()


def test_failed_cuda_checkpoint_aborts_the_move_resumes_cuda_and_leaves_the_rank_running(tmp_path):
    """An aborted dump gives the rank its GPU back: a suspend that failed half way may have
    left it locked (resume restores and unlocks whatever state it is in)."""
    cuda = _CudaRecorder(fail_suspend=True)
    proc, marker = _gpu_rank(tmp_path)
    try:
        with pytest.raises(CheckpointError, match=r"cuCheckpointProcessCheckpoint\(pid \d+\) failed"):
            _dump(_service(tmp_path, proc, lambda: cuda))
        assert cuda.calls == [("suspend", proc.pid), ("resume", proc.pid)]  # never dumped; CUDA given back
        assert marker.read_text() == "abort\n" and proc.poll() is None
        assert not (tmp_path / "snap" / "job5" / "rank1.gen1").exists()
    finally:
        proc.kill()
        proc.wait()


def test_a_failed_criu_dump_of_a_gpu_rank_resumes_cuda(tmp_path):
    cuda = _CudaRecorder()
    proc, marker = _gpu_rank(tmp_path)
    failing = tmp_path / "criu"
    failing.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'Version: 4.1.1'; exit 0; fi\nexit 1\n")
    failing.chmod(0o755)
    try:
        svc = _service(tmp_path, proc, lambda: cuda)
        svc.criu_binary = str(failing)
        with pytest.raises(CheckpointError, match="criu dump of pid"):
            _dump(svc)
        assert cuda.calls == [("suspend", proc.pid), ("resume", proc.pid)]
        assert marker.read_text() == "abort\n" and proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_a_gpu_rank_on_a_node_without_cuda_checkpoint_is_refused_before_anything_moves(tmp_path):
    from torchpass.errors import DependencyError

    def no_driver():
        raise DependencyError("libcuda not found (x): GPU ranks cannot be checkpointed on this node")

    proc, marker = _gpu_rank(tmp_path)
    try:
        with pytest.raises(RemoteError, match="holds GPU state but this node cannot checkpoint CUDA: libcuda"):
            _dump(_service(tmp_path, proc, no_driver))
        assert not marker.exists() and proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def _agent_with_workers(tmp_path, n=3):
    """A torchrun-shaped task: a main process (the agent, no GPU) with ``n`` children (the
    workers), recorded where tpassd looks; the children's pids once they all run."""
    agent = subprocess.Popen(["sh", "-c", " ".join(["sleep 60 &"] * n) + " wait"], stdin=subprocess.DEVNULL,
                             start_new_session=True)
    deadline = time.monotonic() + 10
    while len(workers := [q for q in tree_pids(agent.pid) if q != agent.pid]) < n:
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.01)
    rank_dir = layout.rank_records_dir(tmp_path / "state", 5)
    record = layout.rank_record(rank_dir, 5, 1)
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"pid": agent.pid, "wrapper_pid": os.getpid()}))
    return agent, sorted(workers), layout.handoff(rank_dir, 5, 1)


def test_under_torchrun_the_dump_suspends_each_worker_not_the_agent(tmp_path):
    """The task's main process is torchrun's agent; its workers hold the GPU. tpassd suspends
    each of them (the agent holds no CUDA context: a suspend of it would fail), records them in
    the image for the restore side, and gives each its GPU back after the dump."""
    cuda = _CudaRecorder()
    agent, workers, marker = _agent_with_workers(tmp_path)
    try:
        svc = CheckpointService(tmp_path / "snap", "n1", state_dir=tmp_path / "state", job_owner=lambda j: 0,
                                job_pids=lambda j: {agent.pid, os.getpid()}, gpu_in_use=workers.__contains__,
                                cuda_loader=lambda: cuda)
        out = _dump(svc)
        suspended = [pid for op, pid in cuda.calls if op == "suspend"]
        assert sorted(suspended) == workers
        assert cuda.calls == [("suspend", pid) for pid in suspended] + [("resume", pid) for pid in suspended]
        meta = json.loads((Path(out["images"]) / "manifest.json").read_text())["meta"]
        # no PID namespace here: the numbers the restore gets back are these pids
        assert meta["gpu"] is True and sorted(meta["gpu_pids"]) == workers
        assert marker.read_text() == "moved\n" and agent.poll() is None
    finally:
        os.killpg(agent.pid, 9)
        agent.wait()


def test_a_worker_whose_suspend_fails_aborts_the_move_and_every_suspended_worker_gets_its_gpu_back(tmp_path):
    agent, workers, marker = _agent_with_workers(tmp_path)

    class FailsOnSecond(_CudaRecorder):
        def suspend(self, pid):
            self.calls.append(("suspend", pid))
            if len([c for c in self.calls if c[0] == "suspend"]) == 2:
                raise CheckpointError(f"cuCheckpointProcessLock(pid {pid}) failed: CUresult 2")

    cuda = FailsOnSecond()
    try:
        svc = CheckpointService(tmp_path / "snap", "n1", state_dir=tmp_path / "state", job_owner=lambda j: 0,
                                job_pids=lambda j: {agent.pid, os.getpid()}, gpu_in_use=workers.__contains__,
                                cuda_loader=lambda: cuda)
        with pytest.raises(CheckpointError, match=r"cuCheckpointProcessLock\(pid \d+\) failed"):
            _dump(svc)
        tried = [pid for op, pid in cuda.calls if op == "suspend"]
        assert len(tried) == 2  # the third worker was never touched
        assert [c for c in cuda.calls if c[0] == "resume"] == [("resume", pid) for pid in tried]
        assert marker.read_text() == "abort\n" and agent.poll() is None
    finally:
        os.killpg(agent.pid, 9)
        agent.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="a PID namespace of its own needs root (unshare --pid)")
def test_after_a_restore_cuda_resumes_the_workers_by_their_pids_in_the_tasks_namespace():
    """The image records the suspended processes by their pid in the task's PID namespace
    (what a restore gives back); the restore side finds them in the restored tree, whose host
    pids differ, and resumes them in the recorded order."""
    from torchpass.checkpoint.rankwrap import resume_cuda_of

    tree = subprocess.Popen(["unshare", "--pid", "--fork", "sh", "-c", "sleep 60 & sleep 60 & sleep 60 & wait"],
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(pids := tree_pids(tree.pid)) < 5:  # unshare, sh (pid 1 inside), 3 sleeps
            assert time.monotonic() < deadline, "the tree did not start"
            time.sleep(0.01)
        inner = {procs.ns_pid(q): q for q in pids if q != tree.pid}
        assert sorted(inner) == [1, 2, 3, 4] and all(q > 4 for q in inner.values())
        cuda = _CudaRecorder()
        resume_cuda_of(tree.pid, rank_pid=inner[1], meta={"gpu": True, "gpu_pids": [3, 2]}, cuda=cuda)
        assert cuda.calls == [("resume", inner[3]), ("resume", inner[2])]
        # an image of a tpassd that suspended the task's main process alone
        cuda = _CudaRecorder()
        resume_cuda_of(tree.pid, rank_pid=inner[1], meta={"gpu": True}, cuda=cuda)
        assert cuda.calls == [("resume", inner[1])]
        with pytest.raises(CheckpointError, match="restored tree has no process 9 of those whose GPU state"):
            resume_cuda_of(tree.pid, rank_pid=inner[1], meta={"gpu": True, "gpu_pids": [2, 9]}, cuda=_CudaRecorder())
    finally:
        os.killpg(tree.pid, 9)
        tree.wait()


def test_gpu_detection_reads_the_process_maps(tmp_path):
    (tmp_path / "proc" / "10").mkdir(parents=True)
    (tmp_path / "proc" / "10" / "maps").write_text("7f00-7f01 rw-s 00000000 00:05 12 /dev/nvidia0\n")
    (tmp_path / "proc" / "11").mkdir(parents=True)
    (tmp_path / "proc" / "11" / "maps").write_text("7f00-7f01 r-xp 00000000 08:01 99 /usr/lib/libc.so.6\n")
    proc = str(tmp_path / "proc")
    assert maps_nvidia_device(10, proc) and not maps_nvidia_device(11, proc) and not maps_nvidia_device(12, proc)
    assert not maps_nvidia_device(os.getpid())  # no GPU on this machine
