"""Slurm's record of a job and a step read into what a rank had, and the options that ask for it again."""

from __future__ import annotations

import pytest

from torchpass.slurm.gres import (
    NodeAllocation,
    PlacementRefused,
    TaskShare,
    check_same_driver,
    choose_gpus,
    parse_job_allocations,
    parse_step_share,
    restore_step_options,
    spare_options,
)

# The shape of `scontrol show job -d` (Slurm 23.11/24.11): one line per group of nodes.
JOB_D = """JobId=4711 JobName=train
   UserId=alice(1000) GroupId=alice(1000) MCS_label=N/A
   JobState=RUNNING Reason=None Dependency=(null)
   NodeList=gpu[1-2],gpu4 BatchHost=gpu1
   NumNodes=3 NumCPUs=24 NumTasks=6 CPUs/Task=4 ReqB:S:C:T=0:0:*:*
   ReqTRES=cpu=24,mem=48G,node=3,billing=24,gres/gpu=6
   AllocTRES=cpu=24,mem=48G,node=3,billing=24,gres/gpu=6,gres/gpu:h100=6
   JOB_GRES=gpu:h100:6
     Nodes=gpu[1-2] CPU_IDs=0-7 Mem=16384 GRES=gpu:h100:2(IDX:0-1)
     Nodes=gpu4 CPU_IDs=8-11,20-23 Mem=16384 GRES=gpu:h100:2(IDX:2,3)
   MinCPUsNode=8 MinMemoryNode=16G MinTmpDiskNode=0
   TresPerTask=cpu=4,gres/gpu:1
"""
JOB_D_NO_GRES = """JobId=12 JobName=cpu
   NumNodes=1 NumCPUs=2 NumTasks=2
     Nodes=n1 CPU_IDs=0-1 Mem=0 GRES=
"""
STEP_D = """StepId=4711.0 UserId=1000 StartTime=2026-12-07T11:00:00 TimeLimit=UNLIMITED
   State=RUNNING Partition=gpu NodeList=gpu[1-2],gpu4
   Nodes=3 CPUs=24 Tasks=6 Name=python Network=(null)
   TRES=cpu=24,mem=48G,node=3,gres/gpu=6,gres/gpu:h100=6
   ResvPorts=(null)
   CPUFreqReq=Default Dist=Block
   SrunHost:Pid=gpu1:2345
"""


def expand(hostlist: str) -> list[str]:
    return {"gpu[1-2]": ["gpu1", "gpu2"], "gpu4": ["gpu4"], "n1": ["n1"]}[hostlist]


def test_job_record_gives_each_nodes_cpus_memory_and_gpu_indices():
    alloc = parse_job_allocations(JOB_D, expand)
    assert sorted(alloc) == ["gpu1", "gpu2", "gpu4"]
    assert alloc["gpu1"] == NodeAllocation("gpu1", tuple(range(8)), 16384, (0, 1), "h100")
    assert alloc["gpu4"].cpu_ids == (8, 9, 10, 11, 20, 21, 22, 23) and alloc["gpu4"].gpus == (2, 3)
    cpu_only = parse_job_allocations(JOB_D_NO_GRES, expand)["n1"]
    assert cpu_only.gpus == () and cpu_only.cpus == 2


def test_step_record_gives_one_tasks_share():
    assert parse_step_share(STEP_D) == TaskShare(gpus=1, cpus=4, mem_mb=8192)
    with pytest.raises(PlacementRefused, match="not shared evenly"):
        parse_step_share(STEP_D.replace("Tasks=6", "Tasks=4"))
    with pytest.raises(PlacementRefused, match="no Tasks= or TRES="):
        parse_step_share("StepId=1.0 State=RUNNING")


# Slurm 24.11's step records on the GRES devcluster (2 nodes, 2 tasks each): no gres/gpu in TRES;
# the GPUs as the step asked for them.
STEP_GPUS_PER_TASK = """StepId=55200001.0 UserId=1001 StartTime=2026-12-07T15:27:19 TimeLimit=UNLIMITED
   State=RUNNING Partition=debug NodeList=node[1-2]
   Nodes=2 CPUs=4 Tasks=4 Name=sleep Network=(null)
   TRES=cpu=4,mem=4000M,node=2
   ResvPorts=(null)
   CPUFreqReq=Default Dist=Block
   SrunHost:Pid=node1:2998
   TresBind=gres/gpu:per_task:1
   TresPerStep=cpu:4
   TresPerTask=gres/gpu=1
"""


@pytest.mark.parametrize("asked", ["TresPerTask=gres/gpu=1", "TresPerNode=gres/gpu:2",
                                   "TresPerStep=cpu:4,gres/gpu:4", "TresPerNode=gres/gpu:a100:2"])
def test_a_step_that_asked_for_gpus_gives_each_task_its_share(asked):
    text = STEP_GPUS_PER_TASK.replace("TresPerStep=cpu:4\n", "").replace("TresPerTask=gres/gpu=1", asked)
    assert parse_step_share(text) == TaskShare(gpus=1, cpus=1, mem_mb=1000)
    no_gpus = STEP_GPUS_PER_TASK.replace("   TresPerTask=gres/gpu=1\n", "").replace(
        "   TresBind=gres/gpu:per_task:1\n", "")
    assert parse_step_share(no_gpus) == TaskShare(gpus=0, cpus=1, mem_mb=1000)


def test_restore_steps_and_spares_ask_for_what_the_rank_had():
    share = parse_step_share(STEP_D)
    assert restore_step_options(share) == ["--cpus-per-task=4", "--mem=8192M", "--gres=gpu:1"]
    assert restore_step_options(TaskShare(0, 1, 0)) == ["--cpus-per-task=1"]  # CPU-only: as before
    node = parse_job_allocations(JOB_D, expand)["gpu1"]
    assert spare_options(node) == ["--cpus-per-task=8", "--mem=16384M", "--gres=gpu:h100:2"]


def test_two_restore_steps_never_share_a_gpu_and_too_few_is_refused():
    first = choose_gpus(1, (0, 1, 2, 3), set())
    second = choose_gpus(1, (0, 1, 2, 3), set(first))
    assert first == (0,) and second == (1,)
    assert choose_gpus(2, (3, 1, 2), {1}) == (2, 3)
    with pytest.raises(PlacementRefused, match=r"had 2 GPU\(s\) but only 1 of the target's 2 are free") as exc:
        choose_gpus(2, (0, 1), {0})
    assert "\n" not in str(exc.value)


def test_a_different_driver_is_refused_in_one_line():
    check_same_driver("580.82.07", "580.82.07")
    with pytest.raises(PlacementRefused, match="driver 575.57.08, the source 580.82.07"):
        check_same_driver("580.82.07", "575.57.08")


def test_a_gpu_restore_step_is_a_step_of_its_own_and_a_cpu_one_is_as_before():
    from torchpass.slurm.base import overlap_step_argv

    cpu = overlap_step_argv("srun", 7, "n3", name="r", output="o")
    assert cpu[:7] == ["srun", "--jobid=7", "--overlap", "-w", "n3", "-N1", "-n1"]
    gpu = overlap_step_argv("srun", 7, "n3", name="r", output="o", resources=restore_step_options(TaskShare(2, 8, 0)))
    # An overlapping step shares the GRES of the steps beside it: two restore steps could get one GPU.
    assert "--overlap" not in gpu and "--exact" in gpu
    assert gpu[gpu.index("-n1") + 1:gpu.index("--torchpass=off")] == ["--cpus-per-task=8", "--gres=gpu:2"]


def test_expand_is_dropped_under_task_affinity_and_the_reason_says_so(tmp_path):
    from torchpass.slurm.conf import task_plugins
    from torchpass.slurm.gres import spare_strategies_for

    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\nTaskPlugin=task/cgroup,task/affinity\n")
    plugins = task_plugins(str(conf))
    assert plugins == ("task/cgroup", "task/affinity")
    kept, why = spare_strategies_for(("hot", "expand", "companion"), plugins)
    assert kept == ("hot", "companion") and "task/affinity" in why and "hot, companion" in why
    conf.write_text("TaskPlugin=task/cgroup\n")
    assert spare_strategies_for(("hot", "expand", "companion"), task_plugins(str(conf))) == (
        ("hot", "expand", "companion"), "")
    assert spare_strategies_for(("expand",), task_plugins(str(tmp_path / "missing"))) == (("expand",), "")


def test_a_refused_gpu_spare_says_what_it_asked_for(monkeypatch):
    """salloc's refusal of a GPU job's spare names the GPUs, CPUs and memory it asked for: the one
    line a user reads in spare.unavailable says why no node fits (too few GPUs). salloc's answer is
    the one Slurm 24.11 gave on the GRES devcluster (tests/integration/test_gres_cluster.py)."""
    import subprocess

    from torchpass.errors import SlurmError
    from torchpass.slurm import cli
    from torchpass.slurm.base import SpareRequest

    said = "salloc: error: Job submit/allocate failed: Requested node configuration is not available\n"
    asked = []
    monkeypatch.setattr(cli.shutil, "which", lambda name, path=None: f"/usr/bin/{name}")
    monkeypatch.setattr(cli.subprocess, "run", lambda argv, **kw: asked.append(argv)
                        or subprocess.CompletedProcess(argv, 1, "", said))
    req = SpareRequest(job_id=7, name="s", comment="c", resources=("--cpus-per-task=2", "--gres=gpu:2"))
    with pytest.raises(SlurmError) as exc:
        cli.CliSlurmClient(environ={"PATH": "/usr/bin"}).allocate(req)
    assert asked[0][-2:] == ["--cpus-per-task=2", "--gres=gpu:2"]
    assert str(exc.value) == ("salloc of a spare (--cpus-per-task=2 --gres=gpu:2) for job 7 failed: salloc: error: "
                              "Job submit/allocate failed: Requested node configuration is not available")
