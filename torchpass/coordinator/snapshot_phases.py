"""The phases of a whole-job snapshot and the one table of legal transitions between them.

A whole-job snapshot (``tpassctl snapshot``, or a periodic one) saves every
rank and leaves the job running; at most one is asked for or in flight
(``None``: none)::

    None -> QUEUED -> PAUSE -> DUMP -> RESUME -> None (completed, or failed: every rank resumed)
              |         \\        \\-> STOP -> None (--stop: the job is held once the manifest is written)
              |          \\--------\\----\\--> RESUME (failed: ResumeInPlace, DiscardSnapshot)
              +-> None (not taken: refused when it was to start)

    any phase -> None: a node was lost while it ran and the job is relaunched (its ranks end with the step).

Every phase change of the snapshot machine goes through ``check_transition``
and every end through ``check_result`` (as ``phases`` does for migrations).
An illegal edge raises ``IllegalSnapshotTransition``; ``decide`` re-raises it
in strict mode and otherwise resumes every rank in place, discards what was
written and ends the snapshot as failed (a ``snapshot.failed`` event naming
the bug): a snapshot never leaves ranks paused.
"""

from __future__ import annotations

import enum

from torchpass.coordinator.phases import IllegalTransition


class SnapPhase(enum.StrEnum):
    QUEUED = "queued"  # asked for; starts at the next decision if the job can be snapshotted then
    PAUSE = "pause"  # PauseAt sent to every rank (held); waiting for every rank to quiesce at T
    DUMP = "dump"  # every rank dumped in parallel by its node's tpassd
    RESUME = "resume"  # every rank resumes in place; the manifest is written meanwhile (or it failed)
    STOP = "stop"  # --stop: ranks stay paused until the manifest is written, then the job is held


class SnapResult(enum.StrEnum):
    """How a whole-job snapshot ended."""

    COMPLETED = "completed"  # every rank resumed and the manifest is written
    FAILED = "failed"  # every rank resumed; what was written is removed
    NOT_TAKEN = "not_taken"  # refused when it was to start (a migration, a missing rank, ...)
    RELAUNCHED = "relaunched"  # a node was lost while it ran: the job is relaunched, the snapshot ends with it
    ABORTED = "aborted"  # an illegal transition (a bug): every rank resumed, what was written removed


# Phases in which the ranks stand paused for the snapshot (PauseAt sent, not yet resumed).
PAUSED_SNAP_PHASES = frozenset({SnapPhase.PAUSE, SnapPhase.DUMP, SnapPhase.STOP, SnapPhase.RESUME})

# The one table: phase -> the phases it may go to (None: the snapshot ends).
SNAP_TRANSITIONS: dict[SnapPhase | None, frozenset[SnapPhase | None]] = {
    None: frozenset({SnapPhase.QUEUED}),
    SnapPhase.QUEUED: frozenset({SnapPhase.PAUSE, None}),
    SnapPhase.PAUSE: frozenset({SnapPhase.DUMP, SnapPhase.RESUME, None}),
    SnapPhase.DUMP: frozenset({SnapPhase.STOP, SnapPhase.RESUME, None}),
    SnapPhase.STOP: frozenset({SnapPhase.RESUME, None}),
    SnapPhase.RESUME: frozenset({None}),
}

# How a snapshot may end in each phase (the edges to None above, by result).
SNAP_RESULTS: dict[SnapPhase, frozenset[SnapResult]] = {
    SnapPhase.QUEUED: frozenset({SnapResult.NOT_TAKEN, SnapResult.RELAUNCHED}),
    SnapPhase.PAUSE: frozenset({SnapResult.RELAUNCHED}),
    SnapPhase.DUMP: frozenset({SnapResult.RELAUNCHED}),
    SnapPhase.STOP: frozenset({SnapResult.RELAUNCHED}),
    SnapPhase.RESUME: frozenset({SnapResult.COMPLETED, SnapResult.FAILED, SnapResult.RELAUNCHED}),
}


class IllegalSnapshotTransition(IllegalTransition):
    """The snapshot machine tried a phase change ``SNAP_TRANSITIONS`` does not allow (a bug in the core)."""


def legal(src: SnapPhase | None, dst: SnapPhase | None) -> bool:
    return dst in SNAP_TRANSITIONS.get(src, frozenset())


def check_transition(snapshot: str, src: SnapPhase | None, dst: SnapPhase | None) -> None:
    if not legal(src, dst):
        raise IllegalSnapshotTransition(f"snapshot {snapshot}", src, dst)


def check_result(snapshot: str, phase: SnapPhase, result: SnapResult) -> None:
    """A snapshot in ``phase`` may end with ``result``."""
    if not legal(phase, None) or result not in SNAP_RESULTS.get(phase, frozenset()):
        raise IllegalSnapshotTransition(f"snapshot {snapshot}", phase, None, result)


__all__ = ["SnapPhase", "SnapResult", "PAUSED_SNAP_PHASES", "SNAP_TRANSITIONS", "SNAP_RESULTS",
           "IllegalSnapshotTransition", "legal", "check_transition", "check_result"]
