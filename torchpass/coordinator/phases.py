"""The phases of a migration and the one table of legal transitions between them.

A migration moves every rank of one node to a spare, one migration per job
at a time (``None`` below: no migration in flight)::

    None -> SPARE -> PAUSE -> DUMP -> TRANSFER -> RESTORE -> KILL_SOURCE -> REBUILD -> DRAIN -> SHRINK -> None
             |         \\________\\________\\_________\\___________/              |
             |                         ROLLBACK -> None                          +-> None (stuck)
             +-> None (cancelled, rejected, no spare)

    TRANSFER/RESTORE -> TRANSFER: the target died; the images go to the next spare.
    any phase before REBUILD, and ROLLBACK -> None: the source was lost (handed to Slurm).

Every phase change of ``decide`` goes through ``check_transition`` (style:
NVIDIA resiliency-ext's ``rank_monitor_state_machine.py``), and every end of
a migration through ``check_result``. An edge that is not in ``TRANSITIONS``
raises ``IllegalTransition``; ``decide`` re-raises it in strict mode (tests,
development) and otherwise rolls the migration back, resumes every rank and
records a ``migration.illegal_transition`` event: a bug in the core must
never leave the job paused.

Strict mode: ``TORCHPASS_STRICT_TRANSITIONS=1`` (the test suite sets it for
itself and every coordinator its jobs start: tests/conftest.py), else off.
``decide(..., strict=...)`` overrides it.
"""

from __future__ import annotations

import enum
import os

from torchpass import envnames
from torchpass.errors import TorchpassError


class Phase(str, enum.Enum):
    SPARE = "spare"  # choosing a spare (hot, or asked of slurmctld); training runs
    PAUSE = "pause"  # PauseAt sent; waiting for every rank to quiesce at T
    DUMP = "dump"  # MigrationDump sent to tpassd on the source for each moved rank
    TRANSFER = "transfer"  # images made readable on the target
    RESTORE = "restore"  # a job step on the target restores each moved rank
    KILL_SOURCE = "kill_source"  # the source copies (paused, alive) are killed
    REBUILD = "rebuild"  # Resume sent; every rank rebuilds generation g and resumes
    DRAIN = "drain"  # drain the bad node with "torchpass: <reason>"; training runs
    SHRINK = "shrink"  # release the bad node from the job; training runs
    ROLLBACK = "rollback"  # ResumeInPlace sent; every rank resumes on its old node

    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.value


class Result(enum.StrEnum):
    """How a migration ended (``MigrationRecord.outcome``)."""

    COMPLETED = "completed"  # ranks moved, the node drained (and released unless a step holds it)
    ROLLED_BACK = "rolled_back"  # every rank resumed where it was
    NO_SPARE = "no_spare"  # no spare could be had; training runs on unprotected
    CANCELLED = "cancelled"  # the trigger went away before anything was paused
    SOURCE_LOST = "source_lost"  # the source died before its ranks were saved: handed to Slurm
    STUCK = "stuck"  # ranks did not resume: handed to Slurm
    REJECTED = "rejected"  # the operator's requested target is not usable
    ABORTED = "aborted"  # an illegal transition (a bug): rolled back, every rank resumed


PAUSED_PHASES = frozenset(
    {Phase.PAUSE, Phase.DUMP, Phase.TRANSFER, Phase.RESTORE, Phase.KILL_SOURCE, Phase.REBUILD, Phase.ROLLBACK}
)

# The one table: phase -> the phases it may go to (None: the migration ends).
TRANSITIONS: dict[Phase | None, frozenset[Phase | None]] = {
    None: frozenset({Phase.SPARE}),
    Phase.SPARE: frozenset({Phase.PAUSE, None}),
    Phase.PAUSE: frozenset({Phase.DUMP, Phase.ROLLBACK, None}),
    Phase.DUMP: frozenset({Phase.TRANSFER, Phase.ROLLBACK, None}),
    Phase.TRANSFER: frozenset({Phase.RESTORE, Phase.TRANSFER, Phase.ROLLBACK, None}),
    Phase.RESTORE: frozenset({Phase.KILL_SOURCE, Phase.TRANSFER, Phase.ROLLBACK, None}),
    Phase.KILL_SOURCE: frozenset({Phase.REBUILD, Phase.ROLLBACK, None}),
    Phase.REBUILD: frozenset({Phase.DRAIN, None}),
    Phase.DRAIN: frozenset({Phase.SHRINK, None}),  # None: the job ended first (decide.job_ended)
    Phase.SHRINK: frozenset({None}),
    Phase.ROLLBACK: frozenset({None}),
}

# How a migration may end in each phase (the edges to None above, by result).
RESULTS: dict[Phase, frozenset[Result]] = {
    Phase.SPARE: frozenset({Result.CANCELLED, Result.REJECTED, Result.NO_SPARE, Result.SOURCE_LOST}),
    Phase.PAUSE: frozenset({Result.SOURCE_LOST}),
    Phase.DUMP: frozenset({Result.SOURCE_LOST}),
    Phase.TRANSFER: frozenset({Result.SOURCE_LOST}),
    Phase.RESTORE: frozenset({Result.SOURCE_LOST}),
    Phase.KILL_SOURCE: frozenset({Result.SOURCE_LOST}),
    Phase.REBUILD: frozenset({Result.STUCK}),
    Phase.DRAIN: frozenset({Result.COMPLETED}),
    Phase.SHRINK: frozenset({Result.COMPLETED}),
    Phase.ROLLBACK: frozenset({Result.ROLLED_BACK, Result.STUCK, Result.SOURCE_LOST}),
}


class IllegalTransition(TorchpassError):
    """``decide`` tried a phase change that ``TRANSITIONS`` does not allow (a bug in the core). The
    whole-job snapshot and relaunch machines raise subclasses of it (snapshot_phases,
    relaunch_phases); ``migration`` then names the snapshot or the relaunch."""

    def __init__(self, migration: str, src: enum.Enum | None, dst: enum.Enum | None,
                 result: enum.Enum | None = None):
        self.migration, self.src, self.dst, self.result = migration, src, dst, result
        how = f" ({result})" if result is not None else ""
        super().__init__(f"{migration}: illegal phase transition {_name(src)} -> {_name(dst)}{how}")


def _name(p: enum.Enum | None) -> str:
    return "none" if p is None else p.value


def legal(src: Phase | None, dst: Phase | None) -> bool:
    return dst in TRANSITIONS.get(src, frozenset())


def check_transition(migration: str, src: Phase | None, dst: Phase | None) -> None:
    if not legal(src, dst):
        raise IllegalTransition(migration, src, dst)


def check_result(migration: str, phase: Phase, result: Result) -> None:
    """A migration in ``phase`` may end with ``result``."""
    if not legal(phase, None) or result not in RESULTS.get(phase, frozenset()):
        raise IllegalTransition(migration, phase, None, result)


def strict_default() -> bool:
    """Whether an illegal transition raises (see the module docstring)."""
    return os.environ.get(envnames.STRICT_TRANSITIONS, "") not in ("", "0")


__all__ = ["Phase", "Result", "PAUSED_PHASES", "TRANSITIONS", "RESULTS", "IllegalTransition", "legal",
           "check_transition", "check_result", "strict_default"]
