"""A rank that dies on a live node: matched to a GPU fault, relaunched from the newest restore point.

A GPU that falls off the bus (Xid 79), an uncorrectable ECC error or an
NCCL/gloo abort kills a rank's process while its node stays up. The rank's
task wrapper (torchpass.checkpoint.rankwrap) sees the process end and reports
it (``machine.RankExited``) at once, then holds its own exit until this
module decided: srun (and, with ``KillOnBadExit=1``, slurmstepd) decides
nothing about the step before the coordinator. The surviving ranks' gloo
failures come a few milliseconds later and are reported and held the same way:
they are part of the same death, not deaths of their own. Per pass, with the
deaths reported so far (``CoordState.deaths``)::

    a death's node reports a GPU fault      restore point and a free hot spare per faulted node
    (Xid, GPU lost, uncorrectable ECC)  --> yes: Relaunch (the spare in that node's place; the node
    within death_event_window_s                  drained with "torchpass: NODE's GPU failed ...")
                                            no:  released: the job ends as without torchpass
                                                 (the faulted node is still drained)
    no fault yet, the window still open --> wait (tpassd's event may come after the death)
    no fault, the window passed         --> unexplained (a bug in the script, an OOM kill): at most
                                            max_unexplained_relaunches relaunches on the same
                                            nodes; then released, and every later death too

"Released": each held wrapper is told to exit as its rank did
(``machine.death_verdict``), so the step ends with the rank's own status, as
it would without torchpass. A relaunch is the one a node lost outright gets
(decide_relaunch): the job's host file, the verdict srun's exit hook reads,
the step's end and its start again from the newest snapshot or checkpoint.
The held wrappers end with the step. A migration of a node where a rank died
ends first: its source cannot be dumped any more.

An OOM kill is a death with no hardware fault: the kernel's OOM killer sends
SIGKILL, as a GPU falling off the bus leaves the process, and the memory it
reclaimed is the script's own. It gets the unexplained relaunch (a leak that
grows again ends the job at its next kill).
"""

from __future__ import annotations

import re
from dataclasses import replace

from torchpass.coordinator.contract import AbortRestore, HandToSlurm, ResumeInPlace
from torchpass.coordinator.decide_common import _Out, in_place_master
from torchpass.coordinator.decide_migration import _finish
from torchpass.coordinator.decide_relaunch import (
    RelaunchCause,
    _no_relaunch_why,
    _relaunch,
    _relaunch_plan,
    drain_reason,
)
from torchpass.coordinator.model import CoordState, NodeHealth, RankDeath
from torchpass.coordinator.phases import RESULTS, Result
from torchpass.coordinator.policy import CoordinatorPolicy
from torchpass.coordinator.relaunch_phases import RelaunchKind
from torchpass.health_state import State

# tpassd's reasons for a GPU that kills the process on it (tpassd/rules.py words them):
# "gpu1: Xid 79 (...)", "gpu1: GPU is lost (NVML_ERROR_GPU_IS_LOST) ...",
# "gpu1: 2 uncorrectable (double-bit) ECC error(s) since the driver loaded".
_GPU_FAULT = re.compile(r"^gpu(\d+): (Xid \d+|GPU is lost|\d+ uncorrectable)")

# What becomes of the job when no relaunch follows a death: the wrappers end as their ranks did.
AS_WITHOUT_TORCHPASS = ("the ranks' task wrappers exit as their ranks did, so the step and the job end as "
                        "they would without torchpass")


def gpu_fault(h: NodeHealth, at: float, window_s: float) -> str:
    """The GPU fault of ``h`` that explains a death at ``at`` ("": none): a failed or degraded
    state with a GPU reason that began within ``window_s`` of the death, before or after it."""
    if h.state not in (State.FAILED, State.DEGRADED) or abs(h.since - at) > window_s:
        return ""
    return "; ".join(r for r in h.reasons if _GPU_FAULT.match(r))


def _first_fault(fault: str) -> str:
    """The first GPU reason, without tpassd's hold window: what a drain reason (at most 200
    characters, tpassd's DRAIN_REASON_MAX) has room for. The events carry every reason."""
    return fault.split("; ")[0].split(" within the last ")[0]


def _ranks_of(st: CoordState, d: RankDeath) -> list[int]:
    """The ranks that ``d``'s task held: the rank itself under a plain srun, the workers under
    torchrun (the wrapper reports its task, which is torchrun's agent)."""
    return sorted(r for r, rv in st.ranks.items() if st.task_of(r) == d.rank and rv.node == d.node) or [d.rank]


def _who(st: CoordState, d: RankDeath) -> str:
    ranks = _ranks_of(st, d)
    if ranks == [d.rank]:
        return f"rank {d.rank}"
    return f"task {d.rank} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"


def _deaths_text(st: CoordState) -> str:
    return ", ".join(f"{_who(st, d)} on {d.node} {d.how}" for d in sorted(st.deaths, key=lambda d: (d.at, d.rank)))


def _release(out: _Out, st: CoordState, why: str, fault_nodes: dict[str, str]) -> CoordState:
    """No relaunch: every death's wrapper exits as its rank did; later deaths too."""
    for node, fault in sorted(fault_nodes.items()):
        out.add(HandToSlurm(node, drain_reason(f"torchpass: {node} {fault}; the job was not relaunched"),
                            drain_live=True))
    out.event("job.not_relaunched", f"{_deaths_text(st)}: {why}; {AS_WITHOUT_TORCHPASS}",
              deaths=[{"rank": d.rank, "node": d.node, "how": d.how} for d in st.deaths], why=why,
              faults=fault_nodes)
    # A faulted node is handed over: no migration of it starts (its ranks are gone).
    return replace(st, deaths=(), deaths_unrecovered=why, handed=st.handed | set(fault_nodes),
                   deaths_released=st.deaths_released | {(d.rank, d.node) for d in st.deaths})


def _end_migration(out: _Out, st: CoordState, now: float, policy: CoordinatorPolicy, nodes: set[str]
                   ) -> CoordState | None:
    """A migration in flight cannot go on once a rank died: its ranks are relaunched or end. It ends
    as a lost source does (SOURCE_LOST: nothing can be dumped any more). None while it is past
    the point of ending that way (its ranks already run on the target): decide later."""
    m = st.migration
    if m is None:
        return st
    if Result.SOURCE_LOST not in RESULTS.get(m.phase, frozenset()):
        return None
    if m.target is not None and m.restored:
        out.add(AbortRestore(m.id, m.target, tuple(m.ranks)))
    if m.paused:
        # Never left paused: without a relaunch the survivors must run into the dead rank and end
        # as they would without torchpass (with one, the step's end takes them anyway).
        out.add(ResumeInPlace(m.id, m.generation, in_place_master(st), f"{m.id}: a rank died"))
        st = replace(st, generation=max(st.generation, m.generation))
    return _finish(out, st, m, now, Result.SOURCE_LOST, policy,
                   f"{m.id}: ended: {_deaths_text(st)} (on {', '.join(sorted(nodes))}); nothing to dump",
                   "migration.rank_died")


def handle_deaths(out: _Out, st: CoordState, now: float, policy: CoordinatorPolicy) -> CoordState:
    """Decide the deaths reported so far (the module docstring draws the rule)."""
    if not st.deaths:
        return st
    if st.deaths_unrecovered:
        return replace(st, deaths=(), deaths_released=st.deaths_released | {(d.rank, d.node) for d in st.deaths})
    window = policy.death_event_window_s
    faults: dict[str, str] = {}
    for d in st.deaths:
        fault = gpu_fault(st.node_health(d.node), d.at, window)
        if fault and d.node not in faults:
            ranks = sorted(r for x in st.deaths if x.node == d.node for r in _ranks_of(st, x))
            faults[d.node] = f"GPU failed under rank{'s' if len(ranks) > 1 else ''} " \
                             f"{', '.join(map(str, ranks))} ({_first_fault(fault)})"
    first = min(d.at for d in st.deaths)
    if not faults and now - first < window:
        return st  # tpassd's event may still come
    # the nodes where ranks died, the first death's first (the events name the relaunch after it)
    nodes = tuple(dict.fromkeys(d.node for d in sorted(st.deaths, key=lambda d: (d.at, d.rank))))
    ended = _end_migration(out, st, now, policy, set(nodes))
    if ended is None:
        return st
    st = ended
    deaths = _deaths_text(st)
    if faults:
        lost = sorted(faults)
        plan = _relaunch_plan(st, lost, policy)
        if plan is None:
            return _release(out, st, f"a GPU fault killed the rank, but {_no_relaunch_why(st, lost, policy)}",
                            faults)
        reasons = {n: gpu_fault(st.node_health(n), first, window) for n in faults}
        out.event("rank.died", f"{deaths}: explained by a GPU fault ({'; '.join(reasons.values())}); relaunching",
                  deaths=[{"rank": d.rank, "node": d.node, "how": d.how} for d in st.deaths], faults=faults,
                  reasons=reasons, cause="hardware")
        return _relaunch(out, st, now, plan, RelaunchCause(RelaunchKind.RANK_DIED, faults, nodes, deaths))
    # No hardware fault within the window: a bug in the script, or the OOM killer.
    why = f"no GPU fault on {', '.join(sorted(nodes))} within {window:g} s of the death"
    if st.unexplained_relaunches >= policy.max_unexplained_relaunches:
        return _release(out, st, f"{why}, and {st.unexplained_relaunches} relaunch(es) after such a death "
                                 f"already (max_unexplained_relaunches = {policy.max_unexplained_relaunches})", {})
    plan = _relaunch_plan(st, [], policy)
    if plan is None:
        return _release(out, st, f"{why}, and {_no_relaunch_why(st, [], policy)}", {})
    out.event("rank.died", f"{deaths}: {why} (a bug in the script, or an OOM kill); relaunching on the same "
              f"nodes, {st.unexplained_relaunches + 1} of at most {policy.max_unexplained_relaunches} such "
              "relaunches", deaths=[{"rank": d.rank, "node": d.node, "how": d.how} for d in st.deaths],
              faults={}, cause="unexplained")
    st = replace(st, unexplained_relaunches=st.unexplained_relaunches + 1)
    return _relaunch(out, st, now, (), RelaunchCause(RelaunchKind.RANK_DIED, {}, nodes, deaths))


__all__ = ["handle_deaths", "gpu_fault", "AS_WITHOUT_TORCHPASS"]
