"""Lost nodes and the relaunch machine (``relaunch_phases.RelaunchPhase``).

A node lost outright leaves nothing to dump. When the job has a restore
point and a free hot spare for every lost node, the job's training step is
started again inside the allocation: the executor rewrites the job's host
file (each lost node's lines name its spare) and writes the verdict that the
SPANK plugin's srun exit hook reads. The user's srun, ended by Slurm for the
node failure, execs itself again with its own arguments and environment. The
job is not requeued. Slurm ends the job anyway unless it runs with --no-kill
(docs/coordinator.md, "A node lost outright"). The restore point is the
newer of:

- the newest application checkpoint torchpass.checkpoint reported complete:
  the script goes on from it; every rank registers again, as generation 0
  (fresh processes): REGISTERING;
- the newest whole-job snapshot that completed (a tie goes to the snapshot:
  nothing reloads): the verdict names it, and every task of the relaunched
  srun restores its rank from it instead of starting the program. Each
  restored copy registers again naming the snapshot, paused where the
  snapshot paused it (RESTORING); once all are back, they resume as the
  snapshot's generation around a new rendezvous (ResumeInPlace, RESUMING),
  and the relaunch ends when all resumed.

A job stopped with ``tpassctl snapshot --stop`` and resumed starts its
coordinator in RESTORING too (``resumed_from_stop``, kind RESUMED_STOP).
Without a relaunch, a lost node is handed to Slurm's normal handling.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from torchpass.coordinator import relaunch_phases
from torchpass.coordinator.contract import (
    ForgetStopped,
    HandToSlurm,
    Relaunch,
    RelaunchPossible,
    ResumeInPlace,
)
from torchpass.coordinator.decide_common import (
    _health_text,
    _lost,
    _Out,
    _r,
    _set_spare,
    in_place_master,
    spare_usable,
)
from torchpass.coordinator.decide_migration import (
    _rollback,
)
from torchpass.coordinator.decide_snapshot import (
    _committed,
    _end_snapshot_for_relaunch,
)
from torchpass.coordinator.model import (
    CoordState,
    RelaunchRun,
    SnapshotPoint,
    SpareHow,
    SpareStatus,
    SpareView,
)
from torchpass.coordinator.phases import (
    IllegalTransition,
    Phase,
)
from torchpass.coordinator.policy import (
    CoordinatorPolicy,
)
from torchpass.coordinator.relaunch_phases import (
    RelaunchKind,
    RelaunchPhase,
    RelaunchResult,
)
from torchpass.health_state import (
    State,
)

# What Slurm does with a job whose node stopped answering (when torchpass has no checkpoint or
# snapshot to relaunch it from): measured on the devcluster (tests/integration/test_hard_failure.py).
SLURM_ON_LOST_NODE = ("slurmctld marks the node DOWN once it stops answering (SlurmdTimeout) and ends the job "
                      "as a node failure: a requeueable batch job is requeued, any other ends NODE_FAIL")


# What the coordinator itself does then (HandToSlurm end_job): the same, at once, also for a job
# submitted with --no-kill (which torchpass's relaunch needs), which slurmctld would leave running
# with ranks waiting in their collectives for a peer that is gone.
ENDED_LIKE_SLURM = ("torchpass does the same now, after the drain, also for a job run with --no-kill: "
                    "requeues it if it is a requeueable batch job, else ends its steps on the node")


# tpassd drains with a reason of at most this many characters (tpassd's DRAIN_REASON_MAX).
DRAIN_REASON_MAX = 200


def drain_reason(text: str) -> str:
    """``text`` cut to what tpassd accepts as a drain reason (its end replaced by "...")."""
    return text if len(text) <= DRAIN_REASON_MAX else text[:DRAIN_REASON_MAX - 3] + "..."


def _handle_lost(out: _Out, st: CoordState, now: float, policy: CoordinatorPolicy) -> CoordState:
    m = st.migration
    # Spares that died are never chosen again.
    for sp in st.spares:
        if sp.status in (SpareStatus.FREE, SpareStatus.RESERVED) and st.node_health(sp.node).state == State.FAILED:
            st = _set_spare(st, sp.node, SpareStatus.LOST)
            out.event("spare.lost", f"spare {sp.node} failed ({_health_text(st.node_health(sp.node))})",
                      node=sp.node)
    involved = {m.node, m.target} if m else set()
    # Lost needs a report (state failed, unreachable): only those are looked at.
    lost = [n for n, h in st.health.items() if not h.reachable and _lost(h)]
    if lost:
        nodes = st.rank_nodes()
        lost = sorted(n for n in lost if n in nodes and n not in st.handed and n not in st.released
                      and n not in involved)
    if lost and (plan := _relaunch_plan(st, lost, policy)) is not None:
        return _relaunch(out, st, now, plan)
    for node in lost:
        h = st.node_health(node)
        reason = f"torchpass: {node} failed outright ({_health_text(h)}); no clean dump possible"
        out.add(HandToSlurm(node, reason, end_job=True))
        out.event("node.lost", f"{node} failed and is unreachable ({_health_text(h)}): no clean dump possible "
                  f"and {_no_relaunch_why(st, lost, policy)}; handed to Slurm's normal handling: "
                  f"{SLURM_ON_LOST_NODE}; {ENDED_LIKE_SLURM}",
                  node=node, snapshot=st.last_snapshot.id if st.last_snapshot else None,
                  checkpoint=st.restore_point[0] if st.restore_point else None, ranks=list(st.rank_nodes()[node]))
        st = replace(st, handed=st.handed | {node},
                     operator_requests=tuple(r for r in st.operator_requests if r.node != node))
        if st.migration is not None and st.migration.paused and st.migration.phase != Phase.ROLLBACK \
                and st.migration.phase != Phase.REBUILD:
            st = _rollback(out, st, st.migration, now, policy, f"{node} (not part of the move) was lost")
    return _relaunch_watch(out, st, now, policy)




def _relaunch_spares(st: CoordState, policy: CoordinatorPolicy) -> list[SpareView]:
    """Free spares a relaunched srun can run on: the hot spares (--torchpass=spares=N). They are
    in the job's host file, which places every srun of the batch script; a spare slurmctld grants
    later is not (nor can the job's srun reach a companion allocation)."""
    return [sp for sp in st.spares if sp.how == SpareHow.HOT and spare_usable(st, sp, policy)]


def _from_snapshot(st: CoordState) -> SnapshotPoint | None:
    """The whole-job snapshot a relaunch restores from, when it is the job's newest restore point."""
    snap = _committed(st).last_snapshot
    if snap is None or snap.world_size != st.world_size:
        return None
    return snap if st.restore_point is None or snap.step >= st.restore_point[0] else None


def _relaunch_plan(st: CoordState, lost: list[str], policy: CoordinatorPolicy) -> tuple[tuple[str, str], ...] | None:
    """(lost node, spare) for every lost node, or None when the job cannot be relaunched."""
    # A snapshot in flight does not stop it: it ends with the step (_end_snapshot_for_relaunch).
    if (st.restore_point is None and _from_snapshot(st) is None) or st.migration is not None \
            or (st.relaunch is not None and st.relaunch.snapshot):
        return None
    spares = _relaunch_spares(st, policy)
    if len(spares) < len(lost):
        return None
    return tuple(zip(lost, (sp.node for sp in spares)))


def _no_relaunch_why(st: CoordState, lost: list[str], policy: CoordinatorPolicy) -> str:
    if st.restore_point is None and _from_snapshot(st) is None:
        return ("no complete snapshot (snapshot_every) or application checkpoint (torchpass.checkpoint) of the "
                "job to relaunch it from")
    if st.relaunch is not None and st.relaunch.snapshot:
        return f"relaunch {st.relaunch.count} from snapshot {st.relaunch.snapshot} has not resumed yet"
    if st.migration is not None:
        return f"migration {st.migration.id} is in flight, so the job is not relaunched"
    free = len(_relaunch_spares(st, policy))
    snap = _from_snapshot(st)
    point = (f"snapshot {snap.id} of step {snap.step}" if snap is not None
             else f"checkpoint of step {st.restore_point[0]}" if st.restore_point is not None else "restore point")
    return f"no free hot spare for every lost node ({free} for {len(lost)}) to relaunch the job on from its {point}"


@dataclass(frozen=True)
class RelaunchCause:
    """Why the step is relaunched, for the drain reasons and the events: a node lost outright
    (the default) or ranks that died on live nodes (decide_rank_death)."""

    kind: RelaunchKind = RelaunchKind.LOST_NODE
    # node -> what failed there ("its GPU failed under rank 1 (gpu0: Xid 79 ...)"); the nodes of
    # the plan not named here were lost outright.
    faults: dict[str, str] = field(default_factory=dict)
    ended_on: tuple[str, ...] = ()  # nodes whose steps end besides the replaced ones (Relaunch.ended_on)
    deaths: str = ""  # the deaths, as the events name them ("rank 1 on node2 killed by signal 9")


def _relaunch(out: _Out, st: CoordState, now: float, plan: tuple[tuple[str, str], ...],
              cause: RelaunchCause | None = None) -> CoordState:
    cause = cause or RelaunchCause()
    st = _end_snapshot_for_relaunch(out, st, {n for n, _ in plan} | set(cause.ended_on))
    snap = _from_snapshot(st)
    count = st.relaunches + 1
    # The newest step a rank completed, in the job's numbering: the runtime reports how many
    # optimizer steps it completed (its own count, from 0 in a fresh process; step_offset shifts it).
    done = max((rv.step for rv in st.ranks.values()), default=0)
    last = done + st.step_offset - 1
    if snap is not None:
        step = snap.step
        drained = f"its snapshot {snap.id} of step {step}"
        lost_how = f"every rank restored from snapshot {snap.id} of step {step}"
        going = f"every rank is restored from snapshot {snap.id} of step {step}"
        point: dict[str, Any] = {"snapshot": snap.id, "checkpoint": None}
        going_data: dict[str, Any] = {**point, "snapshot_step": step}
    else:
        assert st.restore_point is not None
        step, path = st.restore_point
        drained = f"its checkpoint of step {step}"
        lost_how = f"from the application checkpoint of step {step}"
        going = f"the script goes on from its checkpoint of step {step} ({path})"
        point = {"snapshot": None, "checkpoint": step}
        going_data = {"checkpoint": step, "path": path}
    recompute = max(0, last - step + 1)
    nodes = st.rank_nodes()
    moved = ", ".join(f"{spare} for {node}" for node, spare in plan) or "the same nodes"
    for node, spare in plan:
        h = st.node_health(node)
        fault = cause.faults.get(node)
        if fault is not None:
            out.add(HandToSlurm(node, drain_reason(f"torchpass: {node} {fault}; the job was relaunched from {drained}"),
                                drain_live=True))
            out.event("node.faulted", f"{node}: {fault}; relaunching the job's training step with spare {spare} "
                      f"in its place, {lost_how}", node=node, spare=spare, ranks=list(nodes.get(node, ())),
                      relaunch=count, fault=fault, **point)
            continue
        out.add(HandToSlurm(node, f"torchpass: {node} failed outright ({_health_text(h)}); the job was "
                                  f"relaunched from {drained}"))
        out.event("node.lost", f"{node} failed and is unreachable ({_health_text(h)}): no clean dump possible; "
                  f"relaunching the job's training step with spare {spare} in its place, {lost_how}", node=node,
                  spare=spare, ranks=list(nodes[node]), relaunch=count, **point)
    ended_on = tuple(n for n in cause.ended_on if n not in dict(plan))  # the first death's node first
    out.add(Relaunch(count, plan, step, snapshot=snap.id if snap is not None else "", ended_on=ended_on,
                     cause=cause.kind.value))
    after = f" after {cause.deaths}" if cause.deaths else ""
    out.event("job.relaunching", f"relaunch {count}{after}: the training step starts again on the surviving nodes "
              f"with {moved}; {going}: steps {step}..{last} ({recompute}) are computed again", relaunch=count,
              last_step=last, recompute_steps=recompute, replaced=dict(plan), cause=cause.kind.value, **going_data)
    for _node, spare in plan:
        st = _set_spare(st, spare, SpareStatus.USED)
    # The node the events name the relaunch after: the first replaced one, else the first where a rank died.
    first, spare0 = plan[0] if plan else ((cause.ended_on or ("",))[0], "")
    if snap is not None:
        # The restored ranks keep their own step counts (in their images) and resume as the
        # snapshot's generation.
        relaunch_phases.check_transition(f"relaunch{count}", None, RelaunchPhase.RESTORING)
        resumes = {"generation": snap.generation, "step_offset": snap.step_offset,
                   "relaunch": RelaunchRun(count, first, spare0, now, step, last, snapshot=snap.id, kind=cause.kind,
                                           phase=RelaunchPhase.RESTORING, generation=snap.generation)}
    else:  # fresh processes, generation 0; steps numbered from the checkpoint until rank 0 says what it loaded
        relaunch_phases.check_transition(f"relaunch{count}", None, RelaunchPhase.REGISTERING)
        resumes = {"generation": 0, "step_offset": step,
                   "relaunch": RelaunchRun(count, first, spare0, now, step, last, kind=cause.kind,
                                           phase=RelaunchPhase.REGISTERING)}
    return replace(st, handed=st.handed | {n for n, _ in plan}, ranks={}, relaunches=count,
                   relaunch_pending="", snapshot_clock=None, deaths=(), deaths_released=frozenset(),
                   operator_requests=tuple(r for r in st.operator_requests if r.node not in dict(plan)), **resumes)


def _relaunch_id(r: RelaunchRun) -> str:
    """The name the restored ranks' resume goes under (the executor's commands for it)."""
    return f"resume-{r.snapshot}" if r.kind == RelaunchKind.RESUMED_STOP else f"relaunch{r.count}"


def _relaunch_end(st: CoordState, r: RelaunchRun, result: RelaunchResult, **changes: Any) -> CoordState:
    """``st`` with the relaunch ended with ``result`` (every end goes through here and the table)."""
    relaunch_phases.check_result(_relaunch_id(r), r.phase, result)
    return replace(st, relaunch=None, **changes)


def resumed_from_stop(job_id: int, now: float, snapshot: str, snapshot_step: int, generation: int,
                      world_size: int, step_offset: int) -> CoordState:
    """The first state of the coordinator of a job stopped with `tpassctl snapshot --stop` and
    resumed: every rank comes back restored from ``snapshot`` (the plugin restores the step the
    stop marker names) and is resumed once all are back, as after a relaunch from a snapshot."""
    point = SnapshotPoint(snapshot, snapshot_step, generation, step_offset, world_size)
    relaunch_phases.check_transition(f"resume-{snapshot}", None, RelaunchPhase.RESTORING)
    return CoordState(job_id=job_id, world_size=world_size, generation=generation, step_offset=step_offset,
                      last_snapshot=point,
                      relaunch=RelaunchRun(0, "", "", now, snapshot_step, snapshot_step - 1, snapshot=snapshot,
                                           kind=RelaunchKind.RESUMED_STOP, phase=RelaunchPhase.RESTORING,
                                           generation=generation))


def _relaunch_words(st: CoordState, r: RelaunchRun) -> tuple[str, str]:
    """How the events name the relaunch, and since when its clock runs."""
    if r.kind == RelaunchKind.LOST_NODE:
        return f"relaunch {r.count}", f"after {r.lost} was found lost"
    if r.kind == RelaunchKind.RANK_DIED:
        return f"relaunch {r.count}", f"after a rank on {r.lost} died"
    return f"resume of job {st.job_id}", "after this coordinator started"


def _on_registering(out: _Out, st: CoordState, r: RelaunchRun, now: float, policy: CoordinatorPolicy
                    ) -> CoordState:
    """From a checkpoint: the relaunch ends once every fresh rank registered."""
    if not st.all_registered():
        return st
    what, since = _relaunch_words(st, r)
    out.event("job.relaunched", f"{what}: every rank of the relaunched training step registered "
              f"{now - r.decided:.1f} s {since}; it goes on from its checkpoint of step "
              f"{r.checkpoint_step}", relaunch=r.count, decision_to_registered_s=_r(now - r.decided),
              checkpoint=r.checkpoint_step)
    return _relaunch_end(st, r, RelaunchResult.RELAUNCHED)


def _on_restoring(out: _Out, st: CoordState, r: RelaunchRun, now: float, policy: CoordinatorPolicy
                  ) -> CoordState:
    """From a snapshot: resume the restored ranks once all are back; ranks that came back as fresh
    processes end it (restore missed: they train on)."""
    world = st.world_size or 0
    what, since = _relaunch_words(st, r)
    if st.all_registered() and len(r.back) < world and set(st.ranks) - r.back:
        # Ranks registered that are not copies of the snapshot: the step was started afresh
        # (its id was not the one the stop marker named). They train on: nothing to resume.
        fresh = sorted(set(st.ranks) - r.back)
        out.event("job.restore_missed", f"{what}: ranks {fresh} registered as fresh processes, not restored "
                  f"from snapshot {r.snapshot}: the job's step started again from its beginning",
                  relaunch=r.count, snapshot=r.snapshot, fresh=fresh)
        if r.kind == RelaunchKind.RESUMED_STOP:
            out.add(ForgetStopped(r.snapshot))
        return _relaunch_end(st, r, RelaunchResult.RESTORE_MISSED, snapshot_clock=now)
    if not (world and len(r.back) >= world and st.all_registered()):
        return st
    master = in_place_master(st)
    out.add(ResumeInPlace(_relaunch_id(r), r.generation, master,
                          f"{what}: every rank restored from snapshot {r.snapshot}"))
    out.event("job.restored", f"{what}: all {world} ranks were restored from snapshot "
              f"{r.snapshot} and registered {now - r.decided:.1f} s {since}; "
              f"resuming them as generation {r.generation} (rendezvous on {master})",
              relaunch=r.count, snapshot=r.snapshot, decision_to_restored_s=_r(now - r.decided),
              generation=r.generation)
    relaunch_phases.check_transition(_relaunch_id(r), r.phase, RelaunchPhase.RESUMING)
    return replace(st, relaunch=replace(r, phase=RelaunchPhase.RESUMING, resume_sent=now, resume_attempts=1))


def _on_resuming(out: _Out, st: CoordState, r: RelaunchRun, now: float, policy: CoordinatorPolicy
                 ) -> CoordState:
    """The restored ranks were told to resume: the relaunch ends when all resumed; ask again when
    some did not."""
    world = st.world_size or 0
    what, since = _relaunch_words(st, r)
    if world and len(r.resumed) >= world:
        if r.kind != RelaunchKind.RESUMED_STOP:
            out.event("job.relaunched", f"{what}: every rank restored from snapshot {r.snapshot} resumed "
                      f"{now - r.decided:.1f} s {since}; training goes on from step "
                      f"{r.checkpoint_step} (steps {r.checkpoint_step}..{r.last_step} are computed again)",
                      relaunch=r.count, snapshot=r.snapshot, decision_to_resumed_s=_r(now - r.decided),
                      snapshot_step=r.checkpoint_step, last_step=r.last_step,
                      recompute_steps=max(0, r.last_step - r.checkpoint_step + 1))
        else:
            out.add(ForgetStopped(r.snapshot))
            out.event("job.resumed", f"{what}: every rank restored from snapshot {r.snapshot} resumed "
                      f"{now - r.decided:.1f} s {since}; training goes on from step {r.checkpoint_step}, "
                      "where it stopped", snapshot=r.snapshot, decision_to_resumed_s=_r(now - r.decided),
                      snapshot_step=r.checkpoint_step)
        return _relaunch_end(st, r, RelaunchResult.RELAUNCHED, snapshot_clock=now)
    if now - (r.resume_sent or now) >= policy.rebuild_timeout_s and r.resume_attempts < policy.max_resume_attempts:
        missing = sorted(set(range(world)) - r.resumed)
        out.add(ResumeInPlace(_relaunch_id(r), r.generation, in_place_master(st),
                              f"{what}: resume again"))
        out.event("resume.retried", f"{what}: ranks {missing} did not resume; asking again",
                  relaunch=r.count, missing=missing)
        return replace(st, relaunch=replace(r, resume_sent=now, resume_attempts=r.resume_attempts + 1))
    return st


# One handler per phase, as relaunch_phases draws them.
_RELAUNCH_HANDLERS = {
    RelaunchPhase.REGISTERING: _on_registering,
    RelaunchPhase.RESTORING: _on_restoring,
    RelaunchPhase.RESUMING: _on_resuming,
}


def _relaunch_watch(out: _Out, st: CoordState, now: float, policy: CoordinatorPolicy) -> CoordState:
    """Advance the relaunch in flight (its phase's handler), and keep srun's exit hook told
    whether a silent node of the job could lead to a relaunch (it then waits for the verdict)."""
    r = st.relaunch
    if r is not None:
        st = _RELAUNCH_HANDLERS[r.phase](out, st, r, now, policy)
    pending = ""
    if st.restore_point is not None or st.last_snapshot is not None:  # none: no relaunch, nothing to tell srun
        nodes = st.rank_nodes()  # a pass over the health reports (few silent), no sort of every node
        silent = min((n for n, h in st.health.items() if not h.reachable and n in nodes and n not in st.handed),
                     default="")
        pending = silent if silent and _relaunch_plan(st, [silent], policy) is not None else ""
    if pending != st.relaunch_pending:
        out.add(RelaunchPossible(bool(pending), pending))
        st = replace(st, relaunch_pending=pending)
    return st


def _recover_relaunch(out: _Out, st: CoordState, exc: IllegalTransition) -> CoordState:
    """A relaunch cannot be undone: it ends as failed and the job goes on as it would without
    torchpass. Restored copies already back (paused, waiting for their resume) are resumed; srun's
    exit hook is told that no relaunch is pending."""
    r = st.relaunch
    why = f"torchpass bug: {exc}"
    if r is not None and r.snapshot and r.back:
        out.add(ResumeInPlace(_relaunch_id(r), r.generation, in_place_master(st), f"relaunch failed: {why}"))
    if r is not None and r.kind == RelaunchKind.RESUMED_STOP:
        out.add(ForgetStopped(r.snapshot))
    what = "no relaunch in flight" if r is None else (
        f"torchpass stops following {_relaunch_id(r)}; the job goes on as it would without torchpass")
    out.event("job.relaunch_failed", f"{why}; {what}", relaunch=None if r is None else r.count,
              relaunch_kind=None if r is None else r.kind.value, snapshot=None if r is None else (r.snapshot or None),
              src=None if exc.src is None else exc.src.value, dst=None if exc.dst is None else exc.dst.value,
              outcome=RelaunchResult.FAILED)
    if st.relaunch_pending:
        out.add(RelaunchPossible(False, ""))
    return replace(st, relaunch=None, relaunch_pending="")
