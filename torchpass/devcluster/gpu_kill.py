"""`tpassctl devcluster kill-gpu`: a GPU that falls off the bus under a rank, as the hardware does it.

Two things happen when a GPU is lost: the driver reports Xid 79 and NVML answers
GPU-is-lost for it, and the processes using it die. On the devcluster the
first is tpassd's fault drill ``xid79`` on the node's fake NVML provider
(which also marks the GPU lost); the second is SIGKILL of the ranks of the node
whose ``SLURM_LOCALID`` is the GPU's index, one GPU per local rank as
``srun --gpus-per-task=1`` binds them. The ranks are found by the pids their
task wrappers recorded (``STATE_DIR/jobs/J/ranks/jobJ/rankR.json``: ``node``,
``rank_pid``), and each pid is checked against the node's network namespace
and its environment: never by process name.

Under ``srun torchrun`` the task is torchrun's agent and its workers are the
ranks: worker ``LOCAL_RANK`` N uses GPU N (torchrun's one GPU per worker), so
the processes killed are the task's workers of that ``LOCAL_RANK`` (their
environment: torchrun's ``TORCHELASTIC_RUN_ID``, the wrapper's
``TORCHPASS_TASK`` and the job's id), and the agent is left to see its worker
die, as it would on the hardware.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from torchpass import envnames, layout


@dataclass(frozen=True)
class GpuRank:
    job: str
    rank: str
    pid: int  # the rank's process, as the node sees it (the record's rank_pid)


def _environ(pid: int, proc: str = "/proc") -> dict[str, str]:
    try:
        raw = Path(f"{proc}/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def ranks_on_gpu(state_dir: Path, node: str, gpu: int, node_pids: Iterable[int],
                 environ: Callable[[int], dict[str, str]] = _environ) -> list[GpuRank]:
    """The live ranks on ``node`` whose SLURM_LOCALID is ``gpu``, of every job with rank records
    under ``state_dir``: a record that names the node, a rank pid in ``node_pids`` (the node's
    processes), and that process's own environment saying SLURM_LOCALID=gpu."""
    pids = set(node_pids)
    found: list[GpuRank] = []
    for jobs in sorted(Path(state_dir, "jobs").glob("*")):
        if not jobs.name.isdigit():
            continue
        rank_dir = layout.rank_job_dir(layout.rank_records_dir(state_dir, jobs.name), jobs.name)
        for rec_path in sorted(rank_dir.glob(f"rank*{layout.RECORD_SUFFIX}")):
            try:
                rec = json.loads(rec_path.read_text())
            except (OSError, ValueError):
                continue
            pid = rec.get("rank_pid") or rec.get("pid")
            if rec.get("node") != node or not isinstance(pid, int) or pid not in pids:
                continue
            task = str(rec.get("rank", ""))
            workers = _torchrun_workers(jobs.name, task, pids, environ)
            if workers:
                found.extend(GpuRank(jobs.name, env.get("RANK", ""), p) for p, env in workers
                             if env.get("LOCAL_RANK") == str(gpu))
            elif environ(pid).get("SLURM_LOCALID") == str(gpu):
                found.append(GpuRank(jobs.name, task, pid))
    return found


def _torchrun_workers(job: str, task: str, pids: set[int], environ: Callable[[int], dict[str, str]]
                      ) -> list[tuple[int, dict[str, str]]]:
    """The torchrun workers of ``task`` of ``job`` among ``pids`` (pid, environment), in pid order;
    none for a task that is not torchrun's agent."""
    out = []
    for p in sorted(pids):
        env = environ(p)
        if "TORCHELASTIC_RUN_ID" in env and env.get(envnames.TASK) == task and env.get("SLURM_JOB_ID") == job \
                and "LOCAL_RANK" in env:
            out.append((p, env))
    return out


__all__ = ["GpuRank", "ranks_on_gpu"]
