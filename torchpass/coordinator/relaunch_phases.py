"""The phases of a relaunch of the job's training step and the one table of legal transitions.

A relaunch starts the job's training step again inside the allocation after
a node was lost outright (``RelaunchKind.LOST_NODE``) or a rank died on a live
node (``RelaunchKind.RANK_DIED``: a spare in place of a node whose GPU failed,
or the same nodes after a death with no hardware fault), or brings back every
rank of a job stopped with ``tpassctl snapshot --stop`` and resumed
(``RelaunchKind.RESUMED_STOP``: the first state of that run's coordinator)::

    None -> REGISTERING -> None        from an application checkpoint: fresh processes register
    None -> RESTORING -> RESUMING -> None
               |                       from a whole-job snapshot: the restored copies register
               +-> None (restore missed: the ranks came back as fresh processes and train on)

Every phase change goes through ``check_transition``, every end through
``check_result``. A relaunch cannot be undone (the lost node's ranks are
gone, the step was started again), so an illegal edge in production mode
ends it as failed: torchpass stops following it, srun's exit hook is told
no relaunch is pending, restored copies that wait paused are resumed, and a
``job.relaunch_failed`` event says so; the job goes on as it would without
torchpass. In strict mode it raises ``IllegalRelaunchTransition``.
"""

from __future__ import annotations

import enum

from torchpass.coordinator.phases import IllegalTransition


class RelaunchKind(enum.StrEnum):
    LOST_NODE = "lost_node"  # a node was lost outright: the step is started again with a spare in its place
    RESUMED_STOP = "resumed_stop"  # `tpassctl resume` of a job stopped with `tpassctl snapshot --stop`
    RANK_DIED = "rank_died"  # a rank died on a live node (decide_rank_death): the step is started again


class RelaunchPhase(enum.StrEnum):
    REGISTERING = "registering"  # from a checkpoint: waiting for every fresh rank to register
    RESTORING = "restoring"  # from a snapshot: waiting for every restored copy to register (paused)
    RESUMING = "resuming"  # ResumeInPlace sent to the restored copies; waiting for every rank to resume


class RelaunchResult(enum.StrEnum):
    RELAUNCHED = "relaunched"  # every rank registered (checkpoint) or resumed (snapshot)
    RESTORE_MISSED = "restore_missed"  # ranks registered as fresh processes, not restored: they train on
    FAILED = "failed"  # an illegal transition (a bug): torchpass stops following the relaunch


RELAUNCH_TRANSITIONS: dict[RelaunchPhase | None, frozenset[RelaunchPhase | None]] = {
    None: frozenset({RelaunchPhase.REGISTERING, RelaunchPhase.RESTORING}),
    RelaunchPhase.REGISTERING: frozenset({None}),
    RelaunchPhase.RESTORING: frozenset({RelaunchPhase.RESUMING, None}),
    RelaunchPhase.RESUMING: frozenset({None}),
}

RELAUNCH_RESULTS: dict[RelaunchPhase, frozenset[RelaunchResult]] = {
    RelaunchPhase.REGISTERING: frozenset({RelaunchResult.RELAUNCHED}),
    RelaunchPhase.RESTORING: frozenset({RelaunchResult.RESTORE_MISSED}),
    RelaunchPhase.RESUMING: frozenset({RelaunchResult.RELAUNCHED}),
}


class IllegalRelaunchTransition(IllegalTransition):
    """The relaunch machine tried a phase change ``RELAUNCH_TRANSITIONS`` does not allow (a bug)."""


def legal(src: RelaunchPhase | None, dst: RelaunchPhase | None) -> bool:
    return dst in RELAUNCH_TRANSITIONS.get(src, frozenset())


def check_transition(relaunch: str, src: RelaunchPhase | None, dst: RelaunchPhase | None) -> None:
    if not legal(src, dst):
        raise IllegalRelaunchTransition(relaunch, src, dst)


def check_result(relaunch: str, phase: RelaunchPhase, result: RelaunchResult) -> None:
    """A relaunch in ``phase`` may end with ``result``."""
    if not legal(phase, None) or result not in RELAUNCH_RESULTS.get(phase, frozenset()):
        raise IllegalRelaunchTransition(relaunch, phase, None, result)


__all__ = ["RelaunchKind", "RelaunchPhase", "RelaunchResult", "RELAUNCH_TRANSITIONS", "RELAUNCH_RESULTS",
           "IllegalRelaunchTransition", "legal", "check_transition", "check_result"]
