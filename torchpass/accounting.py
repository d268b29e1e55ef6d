"""What torchpass did to a job, as one ``torchpass: ...`` part of a Slurm job field (pure).

tpassd writes it, as root, into the job's AdminComment (or the field its ``accounting_field``
names) after each migration, snapshot, reroute and relaunch, so that ``scontrol show job`` (and
``sacct``, where slurmdbd keeps it) says what happened to the job without torchpass' own tools::

    site: foo | torchpass: mig 2 (n3->n7 ok 0.6s; n5->n8 rolled_back); snap 1; reroute 1; relaunch 1

Parts of the field are separated by ``SEPARATOR`` (" | "). The part that starts with ``PREFIX``
is torchpass', replaced where it stands; every other part (another tool's, an admin's) is kept
as it was, byte for byte, and a new torchpass part goes last.

The text is built here from the job's event log (STATE_DIR/jobs/J/events.json), which the job's
owner can write: nothing of it is copied as text. Counts are counted, durations are numbers
formatted here, outcomes come from a fixed table and node names must be Slurm node names
(anything else reads ``?``), so no text a user chose reaches the field, and the part is at most
``PART_MAX`` characters (the newest migrations' details are kept, older ones become ``...``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

PREFIX = "torchpass:"
SEPARATOR = " | "
# Our part's length at most. Slurm stores AdminComment as a free string; 200 characters also fit
# `scontrol show job` on one screen line and leave a field shared with other tools room.
PART_MAX = 200
# The fields tpassd may write (scontrol update JobId=J FIELD=...) -> their key in `scontrol show
# job --json`. AdminComment: only root, SlurmUser and Slurm administrators may set it, so a user
# cannot forge it. Comment: the job's owner may overwrite it, so it only says what the owner
# allows. SystemComment is not here: scontrol's man page lists no update of it.
FIELDS = {"AdminComment": "admin_comment", "Comment": "comment"}
DEFAULT_FIELD = "AdminComment"

# Event kinds that change the summary: the coordinator asks tpassd to update the field after each.
MIGRATION_END_KINDS = frozenset({"migration.completed", "migration.rolled_back", "job.stuck",
                                 "migration.aborted", "migration.rank_died"})
SNAPSHOT_KINDS = frozenset({"snapshot.completed"})
REROUTE_KINDS = frozenset({"link.rerouted", "link.restored"})
RELAUNCH_KINDS = frozenset({"job.relaunched"})
ACCOUNTED_KINDS = MIGRATION_END_KINDS | SNAPSHOT_KINDS | REROUTE_KINDS | RELAUNCH_KINDS

# A migration's outcome (its event's data "outcome", torchpass.coordinator.phases.Result) -> its
# word in the part. Migrations that moved nothing (no spare, cancelled, rejected) are not counted.
OUTCOME_WORDS = {"completed": "ok", "rolled_back": "rolled_back", "stuck": "stuck", "aborted": "aborted",
                 "source_lost": "source_lost"}
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


@dataclass(frozen=True)
class Move:
    source: str
    target: str
    outcome: str
    paused_s: float | None

    def text(self) -> str:
        paused = f" {self.paused_s:.1f}s" if self.paused_s is not None and self.outcome == "ok" else ""
        return f"{self.source}->{self.target} {self.outcome}{paused}"


@dataclass(frozen=True)
class Summary:
    moves: tuple[Move, ...] = ()
    snapshots: int = 0
    reroutes: int = 0
    relaunches: int = 0
    counts: dict[str, int] = field(default_factory=dict, compare=False)

    @property
    def empty(self) -> bool:
        return not (self.moves or self.snapshots or self.reroutes or self.relaunches)


def _node(v: Any) -> str:
    return v if isinstance(v, str) and NODE_NAME.fullmatch(v) else "?"


def _seconds(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        return None
    return float(min(v, 1e6))


def summarize(events: Iterable[Any]) -> Summary:
    """The job's migrations, snapshots, reroutes and relaunches in its event log (a list of
    ``{"kind", "data", ...}``; anything else in it is skipped)."""
    moves: list[Move] = []
    snapshots = reroutes = relaunches = 0
    for e in events:
        if not isinstance(e, dict) or not isinstance(e.get("kind"), str):
            continue
        kind = e["kind"]
        data = e.get("data") if isinstance(e.get("data"), dict) else {}
        if kind in MIGRATION_END_KINDS:
            word = OUTCOME_WORDS.get(data.get("outcome"))
            if word is None:
                continue
            durations = data.get("phase_durations") if isinstance(data.get("phase_durations"), dict) else {}
            moves.append(Move(_node(data.get("node")), _node(data.get("target")), word,
                              _seconds(durations.get("paused"))))
        elif kind in SNAPSHOT_KINDS:
            snapshots += 1
        elif kind in REROUTE_KINDS:
            reroutes += 1
        elif kind in RELAUNCH_KINDS:
            relaunches += 1
    return Summary(tuple(moves), snapshots, reroutes, relaunches)


def render(s: Summary, limit: int = PART_MAX) -> str:
    """``torchpass: mig N (details); snap N; reroute N; relaunch N`` (only what happened), at most
    ``limit`` characters: the oldest migrations' details go first, then all details."""
    tail = [f"{word} {n}" for word, n in (("snap", s.snapshots), ("reroute", s.reroutes),
                                          ("relaunch", s.relaunches)) if n]

    def build(details: list[str], dropped: bool) -> str:
        parts = []
        if s.moves:
            inner = "; ".join((["..."] if dropped else []) + details)
            parts.append(f"mig {len(s.moves)}" + (f" ({inner})" if inner else ""))
        return f"{PREFIX} " + "; ".join(parts + tail)

    details = [m.text() for m in s.moves]
    for keep in range(len(details), -1, -1):
        text = build(details[len(details) - keep:], keep < len(details) and keep > 0)
        if len(text) <= limit:
            return text
    return build([], False)[:limit]


def split_parts(value: str) -> list[str]:
    """A field's parts, as SEPARATOR divides them ("" has none)."""
    return value.split(SEPARATOR) if value else []


def merge(current: str, part: str) -> str:
    """``current`` with its torchpass part replaced by ``part`` where it stands (appended when it
    had none); every other part kept as it was. More than one torchpass part: the first is
    replaced, the others removed."""
    if not part.startswith(PREFIX):
        raise ValueError(f"not a torchpass part: {part!r}")
    out: list[str] = []
    placed = False
    for p in split_parts(current):
        if p.startswith(PREFIX):
            if not placed:
                out.append(part)
                placed = True
            continue
        out.append(p)
    if not placed:
        out.append(part)
    return SEPARATOR.join(out)


__all__ = ["ACCOUNTED_KINDS", "DEFAULT_FIELD", "FIELDS", "PART_MAX", "PREFIX", "SEPARATOR", "Move", "Summary",
           "merge", "render", "split_parts", "summarize"]
