"""What a task was given by Slurm (GPUs, CPUs, memory), read from ``scontrol show job -d`` and
``scontrol show step -d``, and the options that ask the same of a restore step or a spare.

Pure: text in, values out; no Slurm calls (the caller runs scontrol and passes ``expand``, its
hostlist expander). Every refusal is a ``PlacementRefused`` with a one-line message.

Formats (Slurm's ``slurm_sprint_job_info`` and ``slurm_sprint_job_step_info``):
  job -d, one line per group of nodes with the same allocation:
      ``  Nodes=n[1-2] CPU_IDs=0-3 Mem=8192 GRES=gpu:a100:2(IDX:0-1)``
  (Mem in MB; GRES lists each GRES with its device indices; "GRES=" empty without GRES)
  step: ``Nodes=2 CPUs=8 Tasks=4``, ``TRES=cpu=8,mem=16G,node=2`` and the GPUs as asked:
      ``TresPerTask=gres/gpu=1`` (--gpus-per-task), ``TresPerNode=gres/gpu:2`` (--gres,
      --gpus-per-node), ``TresPerStep=cpu:2,gres/gpu:2`` (--gpus). Slurm 24.11 puts no gres/gpu
      in the step's TRES (measured on the GRES devcluster); a TRES that has one (other versions,
      accounting setups) is read first.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from torchpass.errors import TorchpassError


class PlacementRefused(TorchpassError):
    """A rank cannot be given what it had (too few GPUs, a spare's GPUs that differ, MIG...)."""


@dataclass(frozen=True)
class NodeAllocation:
    """One node's share of a job: its CPU ids, memory (MB) and GPU device indices."""

    node: str
    cpu_ids: tuple[int, ...]
    mem_mb: int
    gpus: tuple[int, ...]
    gpu_type: str = ""

    @property
    def cpus(self) -> int:
        return len(self.cpu_ids)


@dataclass(frozen=True)
class TaskShare:
    """What one task of a step had: whole GPUs, CPUs and memory (MB)."""

    gpus: int
    cpus: int
    mem_mb: int


def _ranges(text: str) -> tuple[int, ...]:
    """"0-3,6" -> (0, 1, 2, 3, 6)."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise PlacementRefused(f"cannot read the index list {text!r} in Slurm's job record")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(out)


_NODE_LINE = re.compile(r"^\s*Nodes=(\S+)\s+CPU_IDs=(\S*)\s+Mem=(\d+)(?:\s+GRES=(\S*))?", re.M)
# gpu:2(IDX:0-1), gpu:a100:2(IDX:0,2), gpu:a100:2(S:0-1)(IDX:0-1)
_GPU_GRES = re.compile(r"(?:^|,)gpu(?::([A-Za-z0-9_.-]+))?:(\d+)(?:\([^()]*\))*?\(IDX:([0-9,\-]*)\)")


def _mem_mb(value: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)", value)
    if not m:
        raise PlacementRefused(f"cannot read the memory {value!r} in Slurm's step record")
    scale = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}[m.group(2)]
    return int(float(m.group(1)) * scale)


def parse_job_allocations(text: str, expand: Callable[[str], list[str]]) -> dict[str, NodeAllocation]:
    """Per node, what ``scontrol show job -d JOB`` says the job holds there."""
    out: dict[str, NodeAllocation] = {}
    for m in _NODE_LINE.finditer(text):
        hostlist, cpu_ids, mem, gres = m.group(1), m.group(2), int(m.group(3)), m.group(4) or ""
        gpus: tuple[int, ...] = ()
        gpu_type = ""
        for g in _GPU_GRES.finditer(gres):
            gpu_type = gpu_type or (g.group(1) or "")
            gpus += _ranges(g.group(3))
        for node in expand(hostlist):
            out[node] = NodeAllocation(node, _ranges(cpu_ids), mem, gpus, gpu_type)
    if not out:
        raise PlacementRefused("Slurm's job record (scontrol show job -d) lists no node allocation")
    return out


# gres/gpu:2, gres/gpu=1, gres/gpu:a100:2, gres/gpu:a100=2 in a Tres* list
_TRES_GPU = re.compile(r"(?:^|,)gres/gpu(?::[A-Za-z][A-Za-z0-9_.-]*)?[:=](\d+)(?=,|$)")


def _tres_gpus(text: str, key: str) -> int | None:
    m = re.search(rf"\b{key}=(\S+)", text)
    g = _TRES_GPU.search(m.group(1)) if m else None
    return int(g.group(1)) if g else None


def parse_step_share(text: str) -> TaskShare:
    """One task's share of a step from ``scontrol show step -d J.S`` (its TRES over its tasks).
    Memory is limited per step per node by Slurm's cgroup, so a task's share is the step's
    memory on its node divided among the node's tasks; this reads the whole-step TRES and
    divides by the tasks, which is the same for the evenly spread steps torchrun and srun start.
    GPUs: the TRES's gres/gpu when it has one, else what the step asked per task, per node
    (over the node's tasks) or for the whole step (over its tasks)."""
    tasks = re.search(r"\bTasks=(\d+)", text)
    tres = re.search(r"\bTRES=(\S+)", text)
    if not tasks or not tres or int(tasks.group(1)) == 0:
        raise PlacementRefused("Slurm's step record (scontrol show step -d) has no Tasks= or TRES=")
    n = int(tasks.group(1))
    nodes_m = re.search(r"\bNodes=(\d+)", text)
    nodes = int(nodes_m.group(1)) if nodes_m else 1
    fields = dict(kv.partition("=")[::2] for kv in tres.group(1).split(","))
    # Typed GPUs appear twice (gres/gpu=2,gres/gpu:a100=2): the untyped total is the count.
    if "gres/gpu" in fields:
        gpus = int(fields["gres/gpu"])
    elif (per_task := _tres_gpus(text, "TresPerTask")) is not None:
        gpus = per_task * n
    elif (per_node := _tres_gpus(text, "TresPerNode")) is not None:
        gpus = per_node * nodes
    else:
        gpus = _tres_gpus(text, "TresPerStep") or 0
    cpus = int(fields.get("cpu", "0"))
    mem = _mem_mb(fields["mem"]) if "mem" in fields else 0
    for what, total in (("GPUs", gpus), ("CPUs", cpus), ("MB of memory", mem)):
        if total % n:
            raise PlacementRefused(f"the step's {total} {what} are not shared evenly by its {n} tasks; "
                                   "a rank's share cannot be known")
    return TaskShare(gpus // n, cpus // n, mem // n)


def restore_step_options(share: TaskShare) -> list[str]:
    """srun options asking for what the replaced task had."""
    opts = [f"--cpus-per-task={max(1, share.cpus)}"]
    if share.mem_mb:
        opts.append(f"--mem={share.mem_mb}M")
    if share.gpus:
        opts.append(f"--gres=gpu:{share.gpus}")
    return opts


def spare_options(alloc: NodeAllocation) -> list[str]:
    """salloc options (with ``-N1 -n1``) asking for one node shaped like ``alloc``."""
    opts = [f"--cpus-per-task={max(1, alloc.cpus)}"]
    if alloc.mem_mb:
        opts.append(f"--mem={alloc.mem_mb}M")
    if alloc.gpus:
        opts.append(f"--gres=gpu:{alloc.gpu_type + ':' if alloc.gpu_type else ''}{len(alloc.gpus)}")
    return opts


def choose_gpus(need: int, on_node: tuple[int, ...], taken: set[int] | frozenset[int]) -> tuple[int, ...]:
    """The ``need`` lowest GPUs of ``on_node`` that no other restore step holds (``taken``): two
    restore steps never share a GPU. Too few: refused, and the rank is not started without them."""
    free = tuple(g for g in sorted(on_node) if g not in taken)
    if len(free) < need:
        raise PlacementRefused(f"the rank had {need} GPU(s) but only {len(free)} of the target's "
                               f"{len(on_node)} are free; the move is refused")
    return free[:need]


def check_same_driver(source: str, target: str) -> None:
    """The CUDA checkpoint image is restored by the same driver only."""
    if source != target:
        raise PlacementRefused(f"the spare runs NVIDIA driver {target}, the source {source}: a CUDA checkpoint "
                               "is restored by the same driver only; the move is refused")


def spare_strategies_for(strategies: tuple[str, ...], plugins: tuple[str, ...] | None) -> tuple[tuple[str, ...], str]:
    """The policy's spare strategies that work on this cluster, and why any was dropped ("" if none).

    Under ``TaskPlugin=task/affinity`` Slurm 24.11 does not record the cores of a node added by
    job expansion, and a step launched there fails: "expand" is dropped, the others keep their
    order. An unreadable slurm.conf (None) keeps the policy as it is."""
    if plugins is None or "task/affinity" not in plugins or "expand" not in strategies:
        return strategies, ""
    kept = tuple(s for s in strategies if s != "expand")
    return kept, (f"TaskPlugin={','.join(plugins)}: the expand spare strategy fails under task/affinity "
                  f"(the added node's cores are not recorded); spares use {', '.join(kept) or 'none'}")
