"""A held rank's hold file: where it may lie, what it says when it wakes a copy restored from a
whole-job snapshot, and the marker that tells torchrun's agent a worker holds."""

from __future__ import annotations

import os

from torchpass import layout
from torchpass.runtime.say import say
from torchpass.runtime.store import AGENT_DIR_ENV, HELD_MARKER

# How often a held rank looks for its hold file (one stat; the hold lasts the dump and restore).
HOLD_POLL_S = 0.005


def hold_refusal(hold, state_dir: str | None, job_id: int, rank: int) -> str | None:
    """Why the pause's ``hold`` is refused (None: it is this rank's hold file in the layout,
    STATE_DIR/jobs/J/hold/M.rankR with M a valid id). Its contents can name the coordinator
    and secret a restored copy goes on with (``restored_wake``), so it must lie where only
    this job's coordinator and root write."""
    if not state_dir:
        return f"the pause names hold file {hold!r}, but TORCHPASS_STATE_DIR is not set"
    p = os.path.normpath(hold) if isinstance(hold, str) and os.path.isabs(hold) else None
    want = layout.job_dir(state_dir, job_id) / layout.HOLD
    suffix = f".rank{rank}"
    name = os.path.basename(p) if p else ""
    if (p is None or p != hold or os.path.dirname(p) != str(want) or not name.endswith(suffix)
            or not layout.valid_snapshot_id(name[:-len(suffix)])
            or str(layout.hold_file(state_dir, job_id, name[:-len(suffix)], rank)) != p):
        return (f"the pause names hold file {hold!r}, not this rank's under {want} "
                f"(M{suffix}): refused")
    return None


def restored_wake(hold: str) -> tuple[str, dict[str, str]] | None:
    """(snapshot id, its key=value lines) when the hold file says ``restored ID``: it woke a copy
    restored from that whole-job snapshot (rankwrap's --restore-snapshot); else None."""
    try:
        with open(hold, "rb") as f:
            lines = f.read(1024).decode(errors="replace").splitlines()
    except OSError:
        return None
    said = lines[0].split() if lines else []
    if len(said) == 2 and said[0] == layout.RESTORED_WAKE:
        return said[1], dict(line.split("=", 1) for line in lines[1:] if "=" in line)
    return None


def agent_marker(env=os.environ) -> tuple[str, str] | None:
    """(path, content) of this torchrun worker's hold marker for its agent (store.AgentHoldWatch):
    while every worker of the agent holds one, the agent closes its rendezvous connection, so the
    node's whole tree can be dumped. None outside torchrun."""
    d, local, world = env.get(AGENT_DIR_ENV), env.get("LOCAL_RANK"), env.get("LOCAL_WORLD_SIZE")
    if not d or not (local or "").isdigit() or not (world or "").isdigit():
        return None
    return os.path.join(d, HELD_MARKER.format(local_rank=int(local))), world


def write_marker(path: str, content: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(content)
    except OSError as exc:  # the agent keeps its connection: the dump refuses, the move rolls back
        say(f"cannot tell torchrun's agent that this worker holds ({path}: {exc})")
