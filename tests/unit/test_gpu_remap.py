"""A moved GPU rank's GPUs: the dump records the UUIDs its image names, the restore agent pairs them
with the restore step's GPUs in local order, the pairs reach the CUDA restore and the event.

No GPU here: the processes' maps and the step's devices cgroup are files under ``tmp_path`` laid
out as the kernel writes them, NVML's minor -> UUID is a dict, and libcuda is the C-callback
stand-in of test_cuda_gpu_pairs (cuCheckpointProcessRestore receives the raw
CUcheckpointRestoreArgs*, and the pair bytes are read back from memory).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_cuda_gpu_pairs import SOURCE, TARGET, CLibcuda
from test_decide import Sim
from torchpass.checkpoint import cuda, gpu_map, rank_dump
from torchpass.checkpoint import restore_agent as ra
from torchpass.checkpoint.rankwrap import resume_cuda_of
from torchpass.coordinator import machine as mc
from torchpass.coordinator import migration_actions
from torchpass.errors import CheckpointError

# NVML's view of the target node: minors 1 and 3 are the restore step's, 0 and 2 another's.
TARGET_BY_MINOR = {0: TARGET[2], 1: TARGET[0], 2: "GPU-22222222-2222-2222-2222-222222222222", 3: TARGET[1]}
SOURCE_BY_MINOR = {4: SOURCE[0], 6: SOURCE[1], 5: "GPU-55555555-5555-5555-5555-555555555555"}


def _inventory(by_minor, major=gpu_map.NVIDIA_MAJOR):
    return gpu_map.GpuInventory(major, dict(by_minor), {m: f"/dev/nvidia{m}" for m in by_minor})


def pair_bytes(pairs):
    return b"".join(cuda.uuid_bytes(u) for p in pairs for u in p)


def fake_proc(tmp_path: Path, pid: int, *, maps: str = "", devices_list: str | None = None) -> str:
    """/proc/PID/{maps,cgroup} and /proc/self/{cgroup,mountinfo} with a cgroup v1 devices hierarchy
    mounted at tmp_path/devices, whose step cgroup holds ``devices_list``."""
    proc = tmp_path / "proc"
    for p in (pid, "self"):
        (proc / str(p)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "maps").write_text(maps)
    step = "/slurm/uid_1000/job_7/step_2"
    (proc / str(pid) / "cgroup").write_text(f"5:devices:{step}\n4:freezer:{step}\n")
    (proc / "self" / "cgroup").write_text("5:devices:/\n")
    mount = tmp_path / "devices"
    (proc / "self" / "mountinfo").write_text(
        f"30 25 0:26 / {mount} rw,nosuid shared:10 - cgroup cgroup rw,devices\n")
    if devices_list is not None:
        d = mount / step.lstrip("/")
        d.mkdir(parents=True)
        (d / "devices.list").write_text(devices_list)
    return str(proc)


STEP_DEVICES = "c 195:255 rw\nc 195:254 rw\nc 195:3 rw\nc 195:1 rw\nc 1:3 rwm\nb 8:0 r\n"


def test_the_dump_records_the_gpus_the_holders_map_in_local_order(tmp_path):
    maps = ("7f00-7f01 rw-s 00000000 00:05 12 /dev/nvidiactl\n"
            "7f01-7f02 rw-s 00000000 00:05 13 /dev/nvidia6\n"
            "7f02-7f03 rw-s 00000000 00:05 14 /dev/nvidia4\n"
            "7f03-7f04 r-xp 00000000 08:01 99 /usr/lib/libcuda.so.1\n")
    proc = fake_proc(tmp_path, 4242, maps=maps)
    settings = rank_dump.NodeSettings(snapshot_dir=tmp_path, node="n1", proc=proc,
                                      gpu_uuids_by_minor=lambda: SOURCE_BY_MINOR)
    dumps = rank_dump.RankDumps(settings, None, None, lambda *a, **k: None)
    assert dumps._gpu_uuids([4242]) == [SOURCE[0], SOURCE[1]]  # minors 4, 6: ascending, nvidiactl left out


def test_a_stand_in_for_gpu_state_records_no_gpus_and_never_asks_nvml(tmp_path):
    proc = fake_proc(tmp_path, 4242, maps="7f03-7f04 r-xp 00000000 08:01 99 /usr/lib/libc.so.6\n")

    def no_nvml():
        raise AssertionError("NVML asked for a process that maps no GPU")

    settings = rank_dump.NodeSettings(snapshot_dir=tmp_path, node="n1", proc=proc, gpu_uuids_by_minor=no_nvml)
    assert rank_dump.RankDumps(settings, None, None, lambda *a, **k: None)._gpu_uuids([4242]) == []


def test_the_restore_steps_gpus_come_from_its_devices_cgroup(tmp_path):
    proc = fake_proc(tmp_path, 9000, devices_list=STEP_DEVICES)
    assert gpu_map.target_gpu_minors(9000, proc) == [1, 3]
    assert gpu_map.allowed_gpu_minors("a *:* rwm\n") is None
    assert gpu_map.allowed_gpu_minors("c 195:* rwm\n") is None


def test_a_step_whose_gpus_cannot_be_verified_is_refused_in_one_line(tmp_path):
    proc = fake_proc(tmp_path, 9000, devices_list="a *:* rwm\n")
    with pytest.raises(CheckpointError, match="allows every GPU") as exc:
        gpu_map.target_gpu_minors(9000, proc)
    assert "\n" not in str(exc.value)
    (Path(proc) / "9000" / "cgroup").write_text("0::/slurm/job_7/step_2\n")  # cgroup v2
    with pytest.raises(CheckpointError, match="no devices cgroup"):
        gpu_map.target_gpu_minors(9000, proc)


def test_pairs_map_each_source_gpu_onto_the_steps_gpu_in_local_order(tmp_path):
    proc = fake_proc(tmp_path, 9000, devices_list=STEP_DEVICES)
    meta = {"gpu": True, "gpu_uuids": SOURCE}
    pairs = ra.gpu_pairs_for(meta, 9000, proc, inventory=lambda: _inventory(TARGET_BY_MINOR))
    assert pairs == [(SOURCE[0], TARGET[0]), (SOURCE[1], TARGET[1])]


def test_an_old_manifest_without_gpu_uuids_restores_as_before(tmp_path):
    def no_nvml():
        raise AssertionError("NVML asked for an image that names no GPUs")

    # no devices cgroup at all: nothing is read for an image that names no GPUs
    assert ra.gpu_pairs_for({"gpu": True, "gpu_pids": [1]}, 9000, str(tmp_path), inventory=no_nvml) == []
    lib = CLibcuda()
    resume_cuda_of(4242, 4242, {"gpu": True}, cuda=cuda.CudaCheckpoint(lib))
    assert lib.restore_args == [bytes(64)]  # zeroed args: onto the same UUIDs, as before


class _Restored:
    """A real child of this process standing in for the tree criu restored (the task is us)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    def close(self):
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def agent_seams(tmp_path, monkeypatch):
    """restore_agent.restore with what needs root and criu replaced: the image check, the cgroup
    join, criu itself (a child process of ours is "restored"), libcuda (the C stand-in), and the
    step's devices cgroup and NVML (files and a dict)."""
    lib = CLibcuda()
    child = _Restored()
    criu_calls = []
    manifest = {"meta": {"job": 7, "rank": 1, "uid": os.getuid(), "gpu": True, "gpu_uuids": SOURCE}}
    monkeypatch.setattr(ra, "check_images", lambda images, job, rank, uid: (Path(images), manifest))
    monkeypatch.setattr(ra, "join_cgroups_of", lambda task, pidfd=None: [])
    monkeypatch.setattr(ra.criu_mod, "find_criu", lambda b: "criu")

    def criu_restore(c, images, **kw):
        criu_calls.append(images)
        return child.proc.pid, 0.01

    monkeypatch.setattr(ra.criu_mod, "restore", criu_restore)
    monkeypatch.setattr(cuda.CudaCheckpoint, "load", classmethod(lambda cls: cls(lib)))
    monkeypatch.setattr(gpu_map, "nvml_inventory", lambda: _inventory(TARGET_BY_MINOR))
    proc = fake_proc(tmp_path, os.getpid(), devices_list=STEP_DEVICES)
    real = gpu_map.target_gpu_minors
    monkeypatch.setattr(gpu_map, "target_gpu_minors", lambda task, _proc="/proc", inv=None: real(task, proc, inv=inv))
    yield lib, manifest, criu_calls
    child.close()


def test_the_agent_passes_the_pairs_to_the_cuda_restore_and_returns_the_table(agent_seams):
    lib, _manifest, criu_calls = agent_seams
    out = ra.restore(os.getpid(), {"images": "/snap/job7/rank1.gen3"}, 7, 1, os.getuid())
    assert criu_calls == [Path("/snap/job7/rank1.gen3")]
    assert out["gpu_pairs"] == [[SOURCE[0], TARGET[0]], [SOURCE[1], TARGET[1]]]
    (raw,), (sent,) = lib.restore_args, lib.restore_pairs
    assert int.from_bytes(raw[8:12], sys.byteorder) == 2
    assert sent == pair_bytes([(SOURCE[0], TARGET[0]), (SOURCE[1], TARGET[1])])
    assert lib.state == cuda.ProcessState.RUNNING


def test_fewer_gpus_on_the_step_is_refused_before_criu_runs(agent_seams, monkeypatch):
    lib, manifest, criu_calls = agent_seams
    manifest["meta"]["gpu_uuids"] = [*SOURCE, "GPU-77777777-7777-7777-7777-777777777777"]
    with pytest.raises(CheckpointError, match=r"used 3 GPU\(s\) but its restore step has 2") as exc:
        ra.restore(os.getpid(), {"images": "/snap/job7/rank1.gen3"}, 7, 1, os.getuid())
    assert "\n" not in str(exc.value)
    assert criu_calls == [] and lib.restore_args == []  # nothing restored: the move rolls back


def test_the_migration_event_holds_each_ranks_gpu_table():
    rec = {"restored_from": "/img", "restore_s": 0.1, "gpu_pairs": [[SOURCE[0], TARGET[0]]]}
    assert migration_actions._gpu_pairs(rec) == ((SOURCE[0], TARGET[0]),)
    assert migration_actions._gpu_pairs({"gpu_pairs": [["a"]]}) == ()  # not pairs of strings: shown as none
    sim = Sim()
    sim.to_restore()
    m = sim.m
    sim.tick(0.2, *[mc.RestoreDone(m.id, r, m.target, {}, ((SOURCE[r - 2], TARGET[r - 2]),)) for r in m.ranks])
    sim.kill_source()
    sim.resume_all()
    sim.finish()
    (done,) = sim.events("migration.completed")
    assert done.data["gpu_pairs"] == {"2": [[SOURCE[0], TARGET[0]]], "3": [[SOURCE[1], TARGET[1]]]}


def test_nvml_collector_reads_the_driver_version_once_a_gpu_is_seen():
    from tpassd.collectors.nvml import NvmlCollector
    from tpassd.nvml_provider import FakeNvmlProvider

    fake = FakeNvmlProvider(gpus=2, driver_version="570.86.15")
    fake.init()
    c = NvmlCollector(fake, events=False)
    c.collect(0.0)
    assert c.driver_version == "570.86.15"


def _tpassd_with_drivers(tmp_path, drivers: dict[str, str], calls: list):
    """test_executor's fake tpassd whose tpassd.health names each node's NVIDIA driver; every
    (node, type, op) asked goes into ``calls``, and every dump succeeds."""
    import test_executor as tx

    def request(node, type_, body, timeout_s):
        calls.append((node, type_, body.get("op")))
        if type_ == "tpassd.health":
            return {"state": "healthy", "gpu_driver": drivers[node]}
        if type_ == "tpassd.snapshot":
            return {"images": str(tmp_path / "img"), "checksum": "c", "pid": 7, "bytes": 1}
        return {}

    tp = tx.FakeTpassd(fail_dump=False)
    tp.request = request
    return tp


def _close(d) -> None:
    """The driver's executor closed, and the restore steps it started waited for."""
    import test_executor as tx

    tx._open_executors.remove(d.executor)
    procs = d.executor.steps()
    d.executor.close()
    for p in procs:
        p.wait(10)


def _move_n2(d) -> None:
    """n2 degrades and the job's 3 ranks quiesce where told: the move of n2 starts its dump."""
    ex = d.executor
    d.feed(mc.NodeHealthChanged("n2", "degraded", ("x",)))
    at, gen = ex.command_for(0)["at"], ex.command_for(0)["generation"]
    for r in range(3):
        d.feed(mc.Quiesced(r, gen, at))


@pytest.mark.parametrize("target_driver", ["575.51.03", "570.86.15"])
def test_a_spare_whose_nvidia_driver_differs_is_refused_and_the_move_rolls_back(tmp_path, target_driver):
    """The CUDA checkpoint is restored by the same driver only: the target's tpassd.health names
    its driver (NVML), and a different one fails the transfer in one line, before the images
    are verified there or a restore step is released: the move rolls back."""
    import test_executor as tx

    calls = []
    tp = _tpassd_with_drivers(tmp_path, {"n2": "570.86.15", "n4": target_driver}, calls)
    d, _ = tx._driver(tmp_path, tp)
    try:
        _move_n2(d)
        tx._pump_until(d, lambda: any(e.kind == "migration.rollback" for e in d.job.events), timeout_s=30)
        rb = [e for e in d.job.events if e.kind == "migration.rollback"][0]
        verified = [c for c in calls if c[2] == "verify"]
        if target_driver == "575.51.03":
            assert "runs NVIDIA driver 575.51.03, the source 570.86.15" in rb.message, rb.message
            assert "\n" not in rb.message
            assert verified == []  # never verified on the target, no restore step released
        else:  # the same driver: the move goes on to the restore (which fails here: no manifest)
            assert verified == [("n4", "tpassd.restore", "verify")]
            assert "driver" not in rb.message, rb.message
    finally:
        _close(d)


@pytest.mark.parametrize("gpus", [True, False], ids=["gpu-job", "cpu-job"])
def test_only_a_job_whose_tasks_have_gpus_asks_both_tpassds_for_their_driver(tmp_path, gpus):
    """Slurm's record of the training step (gres/gpu in its TRES) says whether a rank can hold CUDA
    state: a CPU job's transfer asks no tpassd for its NVIDIA driver, a GPU job's asks the target
    and the source before the images are verified on the target."""
    import test_executor as tx
    from test_slurm_gres import STEP_D
    from torchpass.slurm.base import StepInfo

    calls = []
    tp = _tpassd_with_drivers(tmp_path, {n: "570.86.15" for n in ("n1", "n2", "n3", "n4")}, calls)
    d, slurm = tx._driver(tmp_path, tp)
    slurm.step_table[42] = [StepInfo("42.0", "python", ("n1", "n2", "n3"), "RUNNING")]
    slurm.step_detail = lambda step_id: STEP_D if gpus else STEP_D.replace(",gres/gpu=6,gres/gpu:h100=6", "")
    try:
        _move_n2(d)
        tx._pump_until(d, lambda: any(c[2] == "verify" for c in calls), timeout_s=30)
        asked = sorted(c[0] for c in calls if c[1] == "tpassd.health")
        assert asked == (["n2", "n4"] if gpus else []), calls
    finally:
        _close(d)


def test_under_slurms_deny_rules_the_steps_gpus_are_asked_from_inside_its_devices_cgroup(tmp_path, monkeypatch):
    """Slurm 24.11 denies the node's other GPUs under the default-allow rule: devices.list reads
    ``a *:* rwm``. The agent, in the step's devices cgroup, asks the kernel per GPU; not in it, or
    with no inventory to ask about, it refuses in one line as before."""
    proc = fake_proc(tmp_path, 9000, devices_list="a *:* rwm\n")
    inv = _inventory(TARGET_BY_MINOR)
    asked = []
    monkeypatch.setattr(gpu_map, "accessible_gpu_minors", lambda i: asked.append(i) or [1, 3])
    with pytest.raises(CheckpointError, match="allows every GPU"):
        gpu_map.target_gpu_minors(9000, proc, inv=inv)  # this process is not in the step's cgroup
    assert asked == []
    (Path(proc) / "self" / "cgroup").write_text("5:devices:/slurm/uid_1000/job_7/step_2\n")
    assert gpu_map.target_gpu_minors(9000, proc, inv=inv) == [1, 3] and asked == [inv]
    with pytest.raises(CheckpointError, match="allows every GPU"):
        gpu_map.target_gpu_minors(9000, proc)  # no inventory: nothing to ask about


def test_a_rank_without_gpu_state_is_paired_too_and_a_step_that_may_open_every_gpu_is_refused(tmp_path,
                                                                                              monkeypatch):
    """gloo on a GPU allocation: the manifest names the GPUs its task was allowed (gpu: false),
    the agent pairs them all the same (the event's table, the too-few refusal); a step allowed
    all four GPUs of the node for a rank that had two is not confined, and is refused."""
    proc = fake_proc(tmp_path, 9000, devices_list=STEP_DEVICES)
    meta = {"gpu": False, "gpu_uuids": SOURCE}
    assert ra.gpu_pairs_for(meta, 9000, proc, inventory=lambda: _inventory(TARGET_BY_MINOR)) == [
        (SOURCE[0], TARGET[0]), (SOURCE[1], TARGET[1])]
    every = fake_proc(tmp_path / "every", 9000, devices_list="c 195:0 rw\nc 195:1 rw\nc 195:2 rw\nc 195:3 rw\n")
    with pytest.raises(CheckpointError, match="ConstrainDevices is off") as exc:
        ra.gpu_pairs_for(meta, 9000, every, inventory=lambda: _inventory(TARGET_BY_MINOR))
    assert "\n" not in str(exc.value)


def test_the_dump_of_a_rank_without_gpu_state_records_the_gpus_its_task_may_open(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(gpu_map, "allowed_in_cgroup_of", lambda pid, inv, proc: seen.append(pid) or [4, 6])
    settings = rank_dump.NodeSettings(snapshot_dir=tmp_path, node="n1", proc=str(tmp_path),
                                      gpu_inventory=lambda: _inventory(SOURCE_BY_MINOR))
    dumps = rank_dump.RankDumps(settings, None, None, lambda *a, **k: None)
    assert dumps._allocated_gpu_uuids(4242) == [SOURCE[0], SOURCE[1]] and seen == [4242]

    def no_nvml():
        raise CheckpointError("NVML did not start")

    settings.gpu_inventory = no_nvml  # a node whose GPUs cannot be read: the rank moves as a CPU rank
    assert dumps._allocated_gpu_uuids(4242) == []
    settings.gpu_inventory = None  # a node without GPUs: its cgroup is never asked
    assert dumps._allocated_gpu_uuids(4243) == [] and seen == [4242]


def test_an_inventory_file_is_roots_and_well_formed(tmp_path):
    good = tmp_path / "gpus.json"
    good.write_text('{"major": 120, "gpus": [{"minor": 0, "uuid": "%s", "path": "/run/x/gpu0"}]}' % TARGET[0])
    bad = tmp_path / "bad.json"
    bad.write_text('{"major": 120, "gpus": [{"minor": 0}]}')
    if os.geteuid() == 0:
        inv = gpu_map.file_inventory(good)
        assert (inv.major, inv.uuids, inv.paths) == (120, {0: TARGET[0]}, {0: "/run/x/gpu0"})
        assert gpu_map.inventory_loader(good)() == inv
    else:  # not root's: refused
        with pytest.raises(CheckpointError, match="cannot read the GPU inventory"):
            gpu_map.file_inventory(good)
    with pytest.raises(CheckpointError) as exc:
        gpu_map.file_inventory(bad)
    assert "\n" not in str(exc.value)
    assert gpu_map.inventory_loader(None) is gpu_map.nvml_inventory
