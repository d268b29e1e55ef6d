"""Whether a node a rank moved away from can leave the job (the shrink after a migration's drain).

Slurm (24.11) kills a step's tasks on a node removed from the job: removing a node whose task
still runs gives ``srun: error: node2: task 1: Killed``, the step is force-terminated and srun
exits 137; removing a node whose task has already exited leaves the step running, and it ends
with 0. So a node may leave only when no task of any of the job's steps runs there any more.

A training step's task on the source is the moved rank's launch wrapper. Started by the SPANK
plugin (``--on-handoff release``), it leaves once a restored copy holds the rank and writes
``rankR.released`` first (torchpass.checkpoint.moved_exit); srun's exit hook then owes the rank's
exit code. A restore step's wrapper whose rank moved on again exits 0 by itself. Anything else
(the batch host, a step of the user's own, a wrapper that still waits) keeps the node.

``release_blocker`` is the decision, pure: Slurm's view of the job and its steps, and the rank
directory's records, in; a reason (or None) out.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from torchpass.checkpoint.moved_exit import Released
from torchpass.coordinator.restore_steps import RESTORE_STEP_NAME
from torchpass.slurm.base import JobInfo, StepInfo


class Hold(enum.Enum):
    """Why a node stays in the job for now."""

    SETTLING = "settling"  # its tasks are leaving (a wrapper that just left, a restore step ending): ask again
    KEPT = "kept"  # it stays in the job until the job (or the step) ends


@dataclass(frozen=True)
class Blocked:
    hold: Hold
    why: str


def release_blocker(node: str, job_id: int, info: JobInfo | None, steps: Collection[StepInfo],
                    released: Collection[Released], records: Mapping[str, Mapping], settled: Collection[str] = ()
                    ) -> Blocked | None:
    """Why ``node`` cannot leave job ``job_id`` now (None: it can).

    ``released``: the rank directory's released records; ``records``: rank -> its rank record
    (the copy that holds the rank names its node); ``settled``: ranks whose released record is
    old enough that their wrapper has exited (it exits right after writing it)."""
    if info is None or not info.active:
        return Blocked(Hold.KEPT, f"job {job_id} is {'gone' if info is None else info.state}")
    if node not in info.nodes:
        return None
    if node == info.batch_host:
        return Blocked(Hold.KEPT, f"{node} is the batch host (the batch script and the coordinator run there)")
    if set(info.nodes) <= {node}:
        return Blocked(Hold.KEPT, f"{node} is the job's last node")
    for step in steps:
        if not step.user_step or node not in step.nodes:
            continue
        if step.name.startswith(RESTORE_STEP_NAME):
            # A restore step whose rank moved on ends by itself right after the hand-off (its
            # wrapper exits 0), but Slurm may still list it for a moment.
            return Blocked(Hold.SETTLING, f"restore step {step.step_id} ({step.name}) still runs on {node}")
        number = step.step_id.split(".", 1)[-1]
        left = {r.rank for r in released if r.step == number and r.node == node}
        here = sorted((r for r, rec in records.items() if rec.get("node") == node), key=_rank_order)
        if here:
            return Blocked(Hold.KEPT, f"step {step.step_id} ({step.name}) still has a task on {node}: ranks {here} "
                                      "run there; releasing the node would kill them and fail the step, so it "
                                      "stays in the job until the step ends")
        if left and left <= set(settled):
            continue
        if left:
            return Blocked(Hold.SETTLING, f"the task wrappers of ranks {sorted(left, key=_rank_order)} of step "
                                          f"{step.step_id} are leaving {node}")
        # No rank runs there any more, but no launch wrapper has said it left: the moved rank's
        # wrapper writes its record within a second or so of the source copy's kill (it drains
        # the rank's pipes first), or the task is not one of torchpass's.
        return Blocked(Hold.SETTLING, f"step {step.step_id} ({step.name}) still has a task on {node} that did "
                                      "not leave it (no moved rank's launch wrapper released it: a step of the "
                                      "job's own, or one started without torchpass's SPANK plugin); releasing the "
                                      "node would kill that task and fail the step, so it stays in the job until "
                                      "the step ends")
    return None


def _rank_order(rank: str) -> tuple[int, str]:
    return (int(rank), "") if rank.isdigit() else (1 << 30, rank)
