"""`tpassctl fleet report --plot`: each node's events on a timeline (matplotlib, the ``plot``
extra, imported only here and only when a plot is asked for)."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from torchpass.errors import DependencyError

# marker and colour per kind: faults red/orange, the audit purple, what jobs did blue/green
STYLE = {"health.change": ("o", "tab:red"), "audit.node": ("s", "tab:purple"), "audit.rail": ("D", "tab:pink"),
         "job.migration": (">", "tab:blue"), "job.snapshot": ("^", "tab:green"), "job.reroute": ("x", "tab:orange"),
         "job.relaunch": ("*", "tab:brown")}


def plotted(rec: dict[str, Any]) -> bool:
    """Events worth a mark: a state change into a fault, an audit outlier, anything a job did."""
    if rec["kind"] == "health.change":
        return rec.get("state") in ("failed", "degraded", "unknown")
    if rec["kind"].startswith("audit."):
        return bool(rec.get("outlier"))
    return True


def draw(records: list[dict[str, Any]], order: list[str], path: Path, title: str = "fleet history") -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never open a window
        import matplotlib.pyplot as plt
    except ImportError:
        raise DependencyError("--plot needs matplotlib: pip install 'torchpass[plot]'") from None
    rows = {n: i for i, n in enumerate(reversed(order))}
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.45 * max(1, len(rows))))
    for kind, (marker, colour) in STYLE.items():
        pts = [(datetime.fromtimestamp(r["ts"], timezone.utc), rows[r["node"]]) for r in records
               if r["kind"] == kind and r["node"] in rows and plotted(r)]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=colour, label=kind, s=40)
    ax.set_yticks(list(rows.values()), list(rows))
    ax.set_ylim(-0.7, max(rows.values(), default=0) + 0.7)
    ax.set_xlabel("time (UTC)")
    ax.set_title(f"{title}: most suspect node on top")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
