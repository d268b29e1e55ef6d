"""What a restarted coordinator does about the pause its predecessor left (pure decisions + one file).

The coordinator writes STATE_DIR/jobs/J/in_flight.json whenever the paused part of a migration or
whole-job snapshot changes (``InFlight``: which ranks are held, the generation they are armed for,
the phase reached), and removes it when nothing is paused. A coordinator restarted by its
supervisor (``supervisor.py``) reads it back and ``recover`` decides, from the phase alone::

    migration PAUSE, DUMP, TRANSFER, RESTORE, KILL_SOURCE   the source copies are alive (CRIU dumps
        (and ROLLBACK)                                      leave them running; they are killed only
                                                            once every restore succeeded)
                                                            -> ROLL_BACK: hold files released, every
                                                               rank resumes in place on its node
    migration REBUILD                                       the source copies are gone
                                                            -> COMPLETE: every rank resumes with the
                                                               moved ranks on the target
    snapshot PAUSE, DUMP, RESUME, STOP                      every rank is alive where it was
                                                            -> ROLL_BACK (the snapshot has no manifest:
                                                               it never becomes a restore point)
    no file, or a phase where nothing is paused             -> NOTHING

Either way every rank gets a resume for the pause's generation, with the rendezvous the dead
coordinator's own fallback named (rank 0's node; the target when rank 0 moved and the move
completes): a rank never stays paused, and a rank that would otherwise fall back at its deadline
gets the same resume earlier and stays protected.

The file is the job user's own (the coordinator runs as that user, and so does its supervisor):
what it says only steers resumes of the user's own ranks, which the user could send anyway.
Root (tpassd, the restore agent) trusts nothing in it.
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torchpass import layout
from torchpass.coordinator.model import CoordState
from torchpass.coordinator.phases import Phase
from torchpass.coordinator.snapshot_phases import SnapPhase

IN_FLIGHT_JSON = "in_flight.json"


class RunKind(enum.StrEnum):
    MIGRATION = "migration"
    SNAPSHOT = "snapshot"


class RecoveryAction(enum.StrEnum):
    NOTHING = "nothing"  # nothing was paused
    ROLL_BACK = "roll_back"  # every rank resumes where it was; the move or snapshot did not happen
    COMPLETE = "complete"  # the source copies are gone: every rank resumes with the moved ranks on the target


@dataclass(frozen=True)
class InFlight:
    """The paused part of the run in flight, as the coordinator last decided it."""

    kind: RunKind
    id: str
    phase: str  # a phases.Phase or snapshot_phases.SnapPhase value
    generation: int  # the generation every rank is armed for
    world_size: int
    held: tuple[int, ...]  # ranks kept by a hold file (hold/ID.rankR)
    node: str = ""  # a migration's source
    target: str = ""  # a migration's target ("" before one was chosen)
    master: str = ""  # rank 0's node when the pause began: the resume in place's rendezvous
    moved_rank0: bool = False  # rank 0 is among the moved ranks (its rendezvous moves with it)
    next_migration: int = 1  # the next migration's number, so a new one never reuses an id
    held_tasks: tuple[int, ...] = ()  # the tasks of ``held`` (their rank records; a task is a rank unless torchrun)


@dataclass(frozen=True)
class Recovery:
    action: RecoveryAction
    reason: str
    run: InFlight | None = None
    generation: int = 0
    master: str = ""  # the node whose rank serves the resume's rendezvous


def in_flight_of(st: CoordState) -> InFlight | None:
    """What to write now: the migration or snapshot whose ranks are paused, else None."""
    m = st.migration
    s = st.snapshot
    if not ((m is not None and m.paused) or (s is not None and s.phase is not SnapPhase.QUEUED)):
        return None
    # Rank 0 without a scan of every rank (this runs on each decision pass: at 8,192 ranks a
    # min() over the ranks each pass made registration 38 % slower and decisions 14x slower).
    lowest = st.ranks.get(0) or (st.ranks[min(st.ranks)] if st.ranks else None)
    master = lowest.node if lowest is not None else ""
    world = st.world_size or 0
    if m is not None and m.paused:
        return InFlight(RunKind.MIGRATION, m.id, m.phase.value, m.generation, world, tuple(m.ranks), m.node,
                        m.target or "", master, 0 in m.ranks, st.next_migration,
                        tuple(sorted({st.task_of(r) for r in m.ranks})))
    if s is not None and s.phase is not SnapPhase.QUEUED:
        return InFlight(RunKind.SNAPSHOT, s.id, s.phase.value, s.generation, world, tuple(r for r, _ in s.ranks),
                        master=master, next_migration=st.next_migration)
    return None


def _key_of(st: CoordState) -> tuple | None:
    """What in_flight_of(st) is made of, in O(1): equal keys give equal records."""
    m = st.migration
    if m is not None and m.paused:
        return ("migration", m.id, m.phase, m.generation, m.node, m.target, len(m.ranks), st.next_migration,
                st.world_size, len(st.ranks))
    s = st.snapshot
    if s is not None and s.phase is not SnapPhase.QUEUED:
        return ("snapshot", s.id, s.phase, s.generation, len(s.ranks), st.next_migration, st.world_size,
                len(st.ranks))
    return None


_SOURCE_ALIVE = frozenset({Phase.PAUSE, Phase.DUMP, Phase.TRANSFER, Phase.RESTORE, Phase.KILL_SOURCE, Phase.ROLLBACK})


def recover(run: InFlight | None) -> Recovery:
    """The restarted coordinator's decision about ``run`` (the dead coordinator's last in-flight record)."""
    if run is None:
        return Recovery(RecoveryAction.NOTHING, "nothing was paused when the coordinator died")
    what = f"{run.kind} {run.id} (phase {run.phase}, generation {run.generation})"
    if run.kind is RunKind.MIGRATION:
        phase = Phase(run.phase)
        if phase in _SOURCE_ALIVE:
            return Recovery(RecoveryAction.ROLL_BACK, f"{what}: the source copies on {run.node} are alive; "
                            f"rolled back, every rank resumes on its node", run, run.generation, run.master)
        if phase is Phase.REBUILD:
            master = run.target if run.moved_rank0 and run.target else run.master
            return Recovery(RecoveryAction.COMPLETE, f"{what}: the source copies on {run.node} are gone; "
                            f"completed, ranks {list(run.held)} resume on {run.target}", run, run.generation, master)
        return Recovery(RecoveryAction.NOTHING, f"{what}: nothing paused", run)
    SnapPhase(run.phase)  # an unknown phase raises: never guess
    return Recovery(RecoveryAction.ROLL_BACK, f"{what}: every rank resumes in place; the snapshot is not a "
                    "restore point", run, run.generation, run.master)


# --- the file --------------------------------------------------------------------------------------

def in_flight_path(state_dir: os.PathLike | str, job_id: int) -> Path:
    """STATE_DIR/jobs/J/in_flight.json."""
    return layout.job_dir(state_dir, job_id) / IN_FLIGHT_JSON


def encode(run: InFlight) -> str:
    return json.dumps(asdict(run), sort_keys=True)


def decode(text: str) -> InFlight:
    """The record; ValueError (or KeyError/TypeError as ValueError) on anything malformed."""
    try:
        d: dict[str, Any] = json.loads(text)
        return InFlight(RunKind(d["kind"]), str(d["id"]), str(d["phase"]), int(d["generation"]),
                        int(d["world_size"]), tuple(int(r) for r in d["held"]), str(d.get("node", "")),
                        str(d.get("target", "")), str(d.get("master", "")), bool(d.get("moved_rank0", False)),
                        int(d.get("next_migration", 1)), tuple(int(t) for t in d.get("held_tasks", ())))
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"malformed {IN_FLIGHT_JSON}: {exc}") from None


def read(state_dir: os.PathLike | str, job_id: int) -> InFlight | None:
    """The last record (None: no file). ValueError: a file that is not a record."""
    try:
        text = in_flight_path(state_dir, job_id).read_text()
    except FileNotFoundError:
        return None
    return decode(text)


class InFlightWriter:
    """Keeps in_flight.json equal to ``in_flight_of(state)``; writes only on a change."""

    def __init__(self, state_dir: os.PathLike | str, job_id: int):
        self.path = in_flight_path(state_dir, job_id)
        self.last: InFlight | None = None
        self.last_key: tuple | None = None

    def note(self, st: CoordState) -> None:
        # A cheap key first: the record is rebuilt (and compared, a snapshot's with every rank)
        # only when what it is made of may have changed, not on each of the thousands of decision
        # passes a pause of 8,192 ranks takes.
        key = _key_of(st)
        if key == self.last_key:
            return
        self.last_key = key
        run = in_flight_of(st)
        if run == self.last:
            return
        if run is None:
            self.path.unlink(missing_ok=True)
        else:
            tmp = self.path.with_name(f".{IN_FLIGHT_JSON}.{os.getpid()}")
            tmp.write_text(encode(run))
            os.replace(tmp, self.path)
        self.last = run


__all__ = ["IN_FLIGHT_JSON", "InFlight", "InFlightWriter", "Recovery", "RecoveryAction", "RunKind", "decode",
           "encode", "in_flight_of", "in_flight_path", "read", "recover"]
