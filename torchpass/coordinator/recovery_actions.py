"""A restarted coordinator carries out ``recovery.recover``'s decision, before it serves a request.

A rollback is the executor's own resume in place (``MigrationActions.finish_resume_in_place``):
each held task's hand-off is marked aborted by the source's tpassd before its hold file lets the
source copy run on, so the source's task wrapper reports the rank's own exit code. A restored copy
the move may have left on the target is in a restore step whose ``srun`` the supervisor stopped
(it was the dead coordinator's child); its rank record goes back to the source copy
(``MigrationActions.give_record_back``), as after a failed abort. A completed move and a snapshot
only release their hold files. Then every rank's next reply carries its resume.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import structlog

from torchpass import layout
from torchpass.coordinator import contract as ct
from torchpass.coordinator.job_record import JobState
from torchpass.coordinator.recovery import Recovery, RecoveryAction, RunKind

log = structlog.get_logger("torchpass.coordinator.recovery")

EVENT_KIND = {
    (RunKind.MIGRATION, RecoveryAction.ROLL_BACK): "migration.rolled_back",
    (RunKind.MIGRATION, RecoveryAction.COMPLETE): "migration.completed",
    (RunKind.SNAPSHOT, RecoveryAction.ROLL_BACK): "snapshot.failed",
}


def settle(job: JobState, driver, decision: Recovery) -> None:
    """Carry out ``decision`` with ``driver``'s executor; the decision state starts after the dead
    coordinator's run (its generation, its migration numbers)."""
    run = decision.run
    if run is None:
        return
    st = driver.state
    driver.state = replace(st, generation=max(st.generation, run.generation),
                           next_migration=max(st.next_migration, run.next_migration))
    if decision.action is RecoveryAction.NOTHING:
        return
    ex = driver.executor
    mig = ex.migrations
    mv = mig.move(run.id)
    mv.hold, mv.hold_tasks = tuple(run.held), tuple(run.held_tasks)
    every = tuple(range(run.world_size))
    if run.kind is RunKind.MIGRATION and decision.action is RecoveryAction.ROLL_BACK:
        for task in run.held_tasks:
            _give_back(mig, ex.ports.rank_dir, job.job_id, task, run.target)
        mig.finish_resume_in_place(ct.ResumeInPlace(run.id, run.generation, decision.master, decision.reason),
                                   every, run.node)
    else:
        mig.rank_commands.send_resume(every, run.generation, decision.master)
        mig.release(run.id)
    data = {"migration": run.id, "node": run.node, "target": run.target} if run.kind is RunKind.MIGRATION \
        else {"snapshot": run.id}
    job.record(time.time(), EVENT_KIND[(run.kind, decision.action)],
               f"{run.id}: {decision.reason} (the coordinator died mid-{run.kind.value})", recovered=True, **data)
    ex.save_events()
    log.warning("settled the pause a dead coordinator left", job_id=job.job_id, action=decision.action.value,
                run=run.id, generation=run.generation, master=decision.master)


def _give_back(mig, rank_dir, job_id: int, task: int, target: str) -> None:
    """A record that names a copy restored on ``target`` goes back to the source copy."""
    if not target:
        return
    try:
        rec = json.loads(layout.rank_record(rank_dir, job_id, task).read_text())
    except (OSError, ValueError):
        return
    images = rec.get("restored_from") if isinstance(rec, dict) else None
    if images:
        mig.give_record_back(task, target, images)


__all__ = ["EVENT_KIND", "settle"]
