"""`tpassctl events JOB --plot FILE.png`: each migration's and snapshot's phases on a time axis,
with the time the ranks stood still under them.

The bars come from the end events alone (``migration.completed``/``rolled_back``/...,
``snapshot.completed``/``failed``, ``job.stopping``): each carries ``phase_durations``, the
seconds spent in each phase, in the order the phases ran (the coordinator adds a phase when it
leaves it), with ``total`` (from the start to the end event) and ``paused``. A migration's
``detect`` ran before its start. The phases are laid end to end from the start (the event's time
less ``total``); a phase a decision left before the next began leaves a gap of at most one
decision interval, so the last bar may end slightly before the event. The ranks stood still for
``paused`` seconds, up to the end of the phase that let them go on (rebuild or rollback for a
migration; resume or stop for a snapshot).

matplotlib is the ``plot`` extra, imported only to draw (never on a node's root venv by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchpass.errors import DependencyError

# Not phases: the whole, the ranks' standstill, and (migration) what ran before the start.
NOT_SEQUENTIAL = ("total", "paused", "detect")
# The phase whose end lets the ranks go on: the standstill ends there.
RELEASING = ("rebuild", "rollback", "resume", "stop")
END_KINDS = ("migration.", "snapshot.completed", "snapshot.failed", "job.stopping")


@dataclass(frozen=True)
class Bar:
    operation: str  # "m1 node2 -> node4" or "snapshot s-..."
    phase: str  # a phase, or "paused" (the ranks stood still)
    start: float  # seconds since the epoch
    duration: float


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _label(ev: dict[str, Any]) -> str | None:
    data = ev.get("data") or {}
    if ev.get("kind", "").startswith("migration.") and data.get("migration"):
        where = f"{data.get('node')} -> {data.get('target') or '-'}"
        return f"{data['migration']} {where} ({data.get('outcome', ev['kind'].split('.', 1)[1])})"
    if data.get("snapshot"):
        return f"snapshot {data['snapshot']} ({ev['kind']})"
    return None


def bars(events: list[dict[str, Any]]) -> list[Bar]:
    """The bars of every operation that ended in ``events``, in the order they ended."""
    out: list[Bar] = []
    for ev in events:
        data = ev.get("data") or {}
        d = data.get("phase_durations")
        end, label = _num(ev.get("time")), _label(ev)
        if not (isinstance(d, dict) and d and end is not None and label and ev.get("kind", "").startswith(END_KINDS)):
            continue
        total = _num(d.get("total"))
        if total is None:
            continue
        start = end - total
        if _num(d.get("detect")):
            out.append(Bar(label, "detect", start - float(d["detect"]), float(d["detect"])))
        t, released = start, None
        for phase, secs in d.items():
            secs = _num(secs)
            if phase in NOT_SEQUENTIAL or secs is None:
                continue
            out.append(Bar(label, phase, t, secs))
            t += secs
            if phase in RELEASING:
                released = t
        paused = _num(d.get("paused"))
        if paused:
            stop = released if released is not None else end
            out.append(Bar(label, "paused", stop - paused, paused))
    return out


def draw(job_id: int, found: list[Bar], path: Path) -> Path:
    """Draw ``found`` to ``path`` (PNG): one row of phases per operation, and under it the ranks'
    standstill, on seconds since the first bar."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never open a window
        import matplotlib.pyplot as plt
    except ImportError:
        raise DependencyError("--plot needs matplotlib: pip install 'torchpass[plot]'") from None
    ops = list(dict.fromkeys(b.operation for b in found))
    t0 = min(b.start for b in found)
    phases = list(dict.fromkeys(b.phase for b in found if b.phase != "paused"))
    colour = {p: plt.get_cmap("tab10")(i % 10) for i, p in enumerate(phases)}
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.9 * len(ops)))
    labels, ticks = [], []
    for i, op in enumerate(ops):
        y = -2 * i
        for b in (b for b in found if b.operation == op):
            if b.phase == "paused":
                ax.barh(y - 0.8, b.duration, left=b.start - t0, height=0.4, color="black")
            else:
                ax.barh(y, b.duration, left=b.start - t0, height=0.8, color=colour[b.phase], label=b.phase)
        labels += [op, "ranks stood still"]
        ticks += [y, y - 0.8]
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles))
    ax.legend(unique.values(), unique.keys(), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    ax.set_yticks(ticks, labels, fontsize="small")
    ax.set_xlabel("seconds")
    ax.set_title(f"job {job_id}: migrations and snapshots, by phase")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["Bar", "bars", "draw"]
