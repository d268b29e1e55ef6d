"""op=kill: SIGKILL a move's source copies once every restore succeeded, and op=abort of a restore
kills what a failed move restored. Every copy is checked (pinned) before any is killed."""

from __future__ import annotations

import signal
import time
from typing import Any

import structlog

from torchpass.checkpoint import criu as criu_mod
from torchpass.checkpoint import procs
from torchpass.checkpoint.admission import Admission, Audit
from torchpass.checkpoint.node_settings import NodeSettings
from torchpass.errors import RemoteError

log = structlog.get_logger("tpassd.checkpoint")

# op=kill's ``tasks``: a node's other source copies of one move (one srun task per GPU: 8 on
# most GPU nodes; a CPU job may run one per core).
MAX_KILL_TASKS = 1024


def kill_targets(b: dict[str, Any]) -> list[tuple[int, int]]:
    """(rank, pid) of every source copy an op=kill names: ``rank``/``pid``, then ``tasks``."""
    pid, more = b.get("pid"), b.get("tasks") or []
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        raise RemoteError("bad_request", "op kill needs the source copy's pid")
    if (not isinstance(more, list) or len(more) > MAX_KILL_TASKS
            or not all(isinstance(t, list) and len(t) == 2
                       and all(isinstance(x, int) and not isinstance(x, bool) for x in t)
                       and t[0] >= 0 and t[1] > 1 for t in more)):
        raise RemoteError("bad_request", f"op kill: tasks must be a list of at most {MAX_KILL_TASKS} "
                                         "[rank, pid] pairs of the node's other source copies")
    copies = [(b["rank"], pid), *((r, p) for r, p in more)]
    if len({r for r, _ in copies}) != len(copies) or len({p for _, p in copies}) != len(copies):
        raise RemoteError("bad_request", "op kill names a rank or a pid twice")
    return copies


class RankKills:
    def __init__(self, settings: NodeSettings, admission: Admission):
        self.settings = settings
        self.admission = admission

    def kill_sources(self, b: dict[str, Any], act: Audit) -> list[dict[str, Any]]:
        """op=kill: the source copies ``rank``/``pid`` and ``tasks`` of one move on this node, one
        reply part per copy (the request's own first)."""
        job_id, rank = b["job_id"], b["rank"]
        copies = kill_targets(b)
        act.fields["pid"] = copies[0][1]
        if len(copies) > 1:
            act.fields["tasks"] = [list(c) for c in copies[1:]]
        # Every copy is checked (pinned) before any is killed: a refusal leaves them all
        # paused, so the coordinator's rollback resumes the job where it stood.
        pinned: list[tuple[int, int, procs.Pinned | None]] = []
        try:
            for r, pid in copies:
                pinned.append((r, pid, self.admission.pin_unless_gone(job_id, pid, act=act)))
            if self.settings.kill_fault():
                log.warning("fault drill kill-fail: refusing to kill the source copy", job_id=job_id,
                            ranks=[r for r, _ in copies], pids=[pid for _, pid in copies])
                which = (f"the source copy of rank {rank} (pid {copies[0][1]}) was" if len(copies) == 1 else
                         f"the source copies of ranks {', '.join(str(r) for r, _ in copies)} were")
                raise RemoteError("failed", f"fault drill kill-fail on {self.settings.node}: {which} not killed")
        except BaseException:
            for _, _, p in pinned:
                if p is not None:
                    p.close()
            raise
        return self.kill_all_pinned(job_id, pinned)

    def kill_pinned(self, job_id: int, rank: int, pid: int, pinned: procs.Pinned | None) -> dict[str, Any]:
        return self.kill_all_pinned(job_id, [(rank, pid, pinned)])[0]

    def kill_all_pinned(self, job_id: int, copies: list[tuple[int, int, procs.Pinned | None]]
                        ) -> list[dict[str, Any]]:
        """SIGKILL every pinned source copy at once, then wait until none can run its own code
        (one wait for all: a node's 8 tasks cost one kill's time, not 8). Closes the pins."""
        out = {r: {"node": self.settings.node, "rank": r, "pid": pid, "killed": False} for r, pid, _ in copies}
        dying: list[tuple[int, int, procs.Pinned, list[tuple[int, int]]]] = []
        try:
            for r, pid, pinned in copies:
                if pinned is None:
                    continue
                before = self._tree_identities(pid)
                if pinned.kill(signal.SIGKILL):
                    dying.append((r, pid, pinned, before))
                    out[r]["killed"] = True
            # Done once no process of a tree can run its own code again: the tree's root is a PID
            # namespace's init, whose death kills every process in the namespace. The kernel then
            # frees their memory, which took 55-120 ms for a 2.2 GB rank here (and grows with it:
            # seconds on a GPU node) while every rank of the job stood still waiting for this reply;
            # nothing needs it to have finished (the source node is drained next).
            deadline = time.monotonic() + 5.0
            while dying and time.monotonic() < deadline:
                dying = [d for d in dying if not self._tree_dead(d[1], d[2], d[3])]
                if dying:
                    time.sleep(0.002)  # every rank stands still until this reply
        finally:
            for _, _, pinned in copies:
                if pinned is not None:
                    pinned.close()
        for r, pid, _ in copies:
            if out[r]["killed"]:
                log.info("source copy killed", job_id=job_id, rank=r, pid=pid)
        return [out[r] for r, _, _ in copies]

    def _tree_identities(self, pid: int) -> list[tuple[int, int]]:
        """(pid, start time) of every process of the tree rooted at ``pid`` now (those still there)."""
        out = []
        for p in criu_mod.tree_pids(pid, self.settings.proc):
            try:
                out.append((p, procs.read_stat(p, self.settings.proc).start))
            except (OSError, ValueError, IndexError):
                continue
        return out

    def _tree_dead(self, pid: int, pinned: procs.Pinned, before: list[tuple[int, int]]) -> bool:
        """True once no process of the killed tree rooted at ``pid`` can run its own code."""
        proc = self.settings.proc
        if not pinned.alive():
            return True
        try:  # a zombie awaiting its wrapper counts as gone
            if procs.read_stat(pid, proc).state == "Z":
                return True
        except (OSError, ValueError, IndexError):
            return True
        return (all(procs.dying(p, start, proc) for p, start in before)
                and all(procs.dying(p, None, proc) for p in criu_mod.tree_pids(pid, proc)))


__all__ = ["MAX_KILL_TASKS", "RankKills", "kill_targets"]
