"""`tpassctl devcluster kill-gpu`'s choice of ranks (torchpass.devcluster.gpu_kill): the ranks of the node
whose SLURM_LOCALID is the GPU, by the pids their wrappers recorded, checked against the node's
processes and the process's own environment; never another node's rank, a dead pid or a name."""

from __future__ import annotations

import json

from click.testing import CliRunner

from torchpass import layout
from torchpass.devcluster.gpu_kill import GpuRank, ranks_on_gpu
from tpassctl.cli import cli as main


def _record(state_dir, job, rank, node, pid):
    path = layout.rank_record(layout.rank_records_dir(state_dir, job), job, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"job": str(job), "rank": str(rank), "node": node, "pid": pid + 1000,
                                "rank_pid": pid, "wrapper_pid": pid + 2000}))


def test_only_the_ranks_of_that_node_on_that_gpu_that_still_run_there_are_chosen(tmp_path):
    envs = {11: {"SLURM_LOCALID": "0"}, 12: {"SLURM_LOCALID": "1"}, 21: {"SLURM_LOCALID": "0"},
            13: {"SLURM_LOCALID": "0"}}
    _record(tmp_path, 7, 0, "node1", 21)
    _record(tmp_path, 7, 1, "node2", 11)
    _record(tmp_path, 7, 2, "node2", 12)
    _record(tmp_path, 7, 3, "node2", 13)  # its pid is not among node2's processes (gone, or reused elsewhere)
    (tmp_path / "jobs" / "notajob").mkdir()
    found = ranks_on_gpu(tmp_path, "node2", 0, [11, 12, 99], environ=lambda p: envs.get(p, {}))
    assert found == [GpuRank("7", "1", 11)]
    assert ranks_on_gpu(tmp_path, "node2", 1, [11, 12], environ=lambda p: envs.get(p, {})) == [GpuRank("7", "2", 12)]
    assert ranks_on_gpu(tmp_path, "node3", 0, [11, 12, 21], environ=lambda p: envs.get(p, {})) == []


def test_under_torchrun_the_tasks_worker_of_that_local_rank_is_chosen_not_its_agent(tmp_path):
    agent = {"SLURM_LOCALID": "0", "SLURM_JOB_ID": "7", "TORCHPASS_TASK": "1"}
    worker = {**agent, "TORCHELASTIC_RUN_ID": "7"}
    envs = {40: agent, 41: {**worker, "LOCAL_RANK": "0", "RANK": "2"}, 42: {**worker, "LOCAL_RANK": "1", "RANK": "3"},
            51: {**worker, "TORCHPASS_TASK": "2", "LOCAL_RANK": "0", "RANK": "4"},  # another task's worker
            61: {**worker, "SLURM_JOB_ID": "8", "LOCAL_RANK": "0", "RANK": "2"}}  # another job's
    _record(tmp_path, 7, 1, "node2", 40)
    pids = [40, 41, 42, 51, 61]
    assert ranks_on_gpu(tmp_path, "node2", 0, pids, environ=lambda p: envs.get(p, {})) == [GpuRank("7", "2", 41)]
    assert ranks_on_gpu(tmp_path, "node2", 1, pids, environ=lambda p: envs.get(p, {})) == [GpuRank("7", "3", 42)]


def test_kill_gpu_is_a_devcluster_command_with_a_gpu_option():
    res = CliRunner().invoke(main, ["devcluster", "kill-gpu", "--help"])
    assert res.exit_code == 0 and "--gpu" in res.output and "SLURM_LOCALID" in res.output
