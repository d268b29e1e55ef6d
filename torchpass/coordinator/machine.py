"""Applying inputs and executor outcomes (torchpass.coordinator.contract) to the decision state.

``apply(state, outcome, now) -> state`` is pure, like ``decide``: it records
facts (a rank quiesced, a dump finished, a spare was granted, a node's
health changed) and leaves every phase transition to ``decide``. When an
outcome completes the current phase it stamps ``ready_at`` so the phase's
duration ends when its last outcome arrived, not at the next decide call.

Outcomes that name a migration (or a generation, for the rank runtime's
reports) that is not the one in flight, or that arrive in another phase,
are stale and ignored: a late MigrationDumpDone of a rolled-back move can never
advance the next one.

The driver loop (driver.Driver) is::

    state = apply(state, outcome, clock())      # for every input / outcome
    d = decide(clock(), state, policy)          # on every input and every tick
    state = d.state; execute(d.actions)
    if reasons.changed(d.reason): log.info("decision", reason=d.reason)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torchpass.coordinator import snapshot_phases
from torchpass.coordinator.contract import (
    Armed,
    CheckpointCompleted,
    CheckpointLoaded,
    Drained,
    DrainFailed,
    JobRails,
    JobStopFailed,
    KillFailed,
    MigrationDumpDone,
    MigrationDumpFailed,
    NodeHealthChanged,
    OperatorMigrate,
    OperatorSnapshot,
    Outcome,
    Quiesced,
    RankDumped,
    RankDumpFailed,
    RankExited,
    RankProgress,
    RankRegistered,
    RankUnprotected,
    RestoreDone,
    RestoreFailed,
    Resumed,
    ShrinkFailed,
    Shrunk,
    SlurmReachability,
    SnapshotCommitFailed,
    SnapshotCommitted,
    SourceKilled,
    SpareAdded,
    SpareGranted,
    SpareLost,
    SpareUnavailable,
    TransferDone,
    TransferFailed,
)
from torchpass.coordinator.decide_migration import check_operator_request, phase_complete
from torchpass.coordinator.decide_reroute import initial_plan
from torchpass.coordinator.decide_snapshot import check_snapshot_request, snapshot_phase_complete
from torchpass.coordinator.model import (
    COMPUTE_KEPT,
    PINNED_CACHE,
    RANK_NODES_CACHE,
    CoordState,
    FailedStep,
    Failure,
    Image,
    Migration,
    NodeHealth,
    OperatorRequest,
    RankDeath,
    RankView,
    SnapshotRun,
    SpareStatus,
    SpareView,
)
from torchpass.coordinator.phases import Phase
from torchpass.coordinator.relaunch_phases import RelaunchPhase
from torchpass.coordinator.snapshot_phases import SnapPhase
from torchpass.errors import TorchpassError
from torchpass.health_state import State

# A ranks dict that the caller alone holds for a batch of reports (see apply), or None.
Owned = dict[int, RankView] | None


class OperatorRejected(TorchpassError):
    """`tpassctl migrate` cannot be accepted; ``code`` is the wire error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


# ============================================================================
def accept_operator(state: CoordState, node: str, to: str | None, now: float) -> tuple[CoordState, str]:
    """Queue an operator migration; (new state, migration id) or OperatorRejected."""
    err = check_operator_request(state, node, to)
    if err is not None:
        raise OperatorRejected(*err)
    mid = f"m{state.next_migration}"
    req = OperatorRequest(mid, node, to, now)
    return replace(state, operator_requests=state.operator_requests + (req,),
                   next_migration=state.next_migration + 1), mid


def accept_snapshot(state: CoordState, snapshot: str, now: float, trigger: str = "operator",
                    stop: bool = False) -> CoordState:
    """Queue a whole-job snapshot with id ``snapshot`` (tpassctl snapshot, or ``trigger`` "periodic":
    decide.periodic_snapshot_due; ``stop``: tpassctl snapshot --stop); OperatorRejected if refused."""
    err = check_snapshot_request(state)
    if err is not None:
        raise OperatorRejected(*err)
    if stop and state.relaunches:
        # The resumed run restores the Slurm step of the stopped one's id; a relaunched step has
        # another id than the same srun gets when the script runs again.
        raise OperatorRejected("conflict", f"job {state.job_id} was relaunched after a lost node: its training step "
                               "would not be found again when it resumes; snapshot it without --stop")
    snapshot_phases.check_transition(snapshot, None, SnapPhase.QUEUED)
    return replace(state, snapshot=SnapshotRun(snapshot, now, trigger=trigger, stop=stop))


def _snapshot_report(st: CoordState, ev: Outcome, now: float, owned: dict[int, RankView] | None = None
                     ) -> CoordState:
    """A rank's armed / quiesced / resumed report, for the whole-job snapshot in flight (the rank's own
    view was recorded already). Reports of another generation or phase are stale and ignored."""
    s = st.snapshot
    if s is None:
        return st
    if isinstance(ev, Armed):
        if s.phase == SnapPhase.PAUSE and ev.generation == s.generation and ev.at == s.pause_at and not ev.accepted:
            refused = tuple(x for x in s.refused if x[0] != ev.rank) + ((ev.rank, ev.collectives),)
            return replace(st, snapshot=replace(s, refused=refused))
    elif isinstance(ev, Quiesced):
        if s.phase == SnapPhase.PAUSE and ev.generation == s.generation and ev.collectives == s.pause_at:
            first = s.first_quiesced if s.first_quiesced is not None else now
            return replace(st, snapshot=replace(s, quiesced=_with_ack(s.quiesced, ev.rank, owned),
                                                first_quiesced=first))
    elif isinstance(ev, Resumed):
        if s.phase == SnapPhase.RESUME and (ev.generation == s.generation or ev.cancelled):
            return replace(st, snapshot=replace(s, resumed=_with_ack(s.resumed, ev.rank, owned)))
    return st


def _on_operator_snapshot(st: CoordState, ev: OperatorSnapshot, now: float, owned: Owned) -> CoordState:
    return accept_snapshot(st, ev.snapshot, now)


def _on_rank_dumped(st: CoordState, ev: RankDumped, now: float, owned: Owned) -> CoordState:
    s = st.snapshot
    if s is not None and ev.snapshot == s.id and s.phase == SnapPhase.DUMP:
        return replace(st, snapshot=replace(s, images={**s.images, ev.image.rank: ev.image},
                                            dump_durations=_merge_max(s.dump_durations, "dump", ev.durations)))
    return st


def _on_rank_dump_failed(st: CoordState, ev: RankDumpFailed, now: float, owned: Owned) -> CoordState:
    s = st.snapshot
    if s is not None and ev.snapshot == s.id and s.phase == SnapPhase.DUMP and s.failure is None:
        return replace(st, snapshot=replace(s, failure=f"dump of rank {ev.rank} failed: {ev.why}"))
    return st


def _manifest_awaited(s: SnapshotRun | None, snapshot: str) -> bool:
    return s is not None and snapshot == s.id and s.phase in (SnapPhase.RESUME, SnapPhase.STOP) \
        and s.committed is None and s.commit_failed is None


def _on_snapshot_committed(st: CoordState, ev: SnapshotCommitted, now: float, owned: Owned) -> CoordState:
    s = st.snapshot
    return replace(st, snapshot=replace(s, committed=ev)) if _manifest_awaited(s, ev.snapshot) else st


def _on_snapshot_commit_failed(st: CoordState, ev: SnapshotCommitFailed, now: float, owned: Owned) -> CoordState:
    s = st.snapshot
    return replace(st, snapshot=replace(s, commit_failed=ev.why)) if _manifest_awaited(s, ev.snapshot) else st


def _on_job_stop_failed(st: CoordState, ev: JobStopFailed, now: float, owned: Owned) -> CoordState:
    s = st.snapshot
    if s is not None and ev.snapshot == s.id and s.phase == SnapPhase.STOP and s.stop_failed is None:
        return replace(st, snapshot=replace(s, stop_failed=ev.why))
    return st


def _merge_max(into: dict[str, float], prefix: str, durations: dict[str, Any]) -> dict[str, float]:
    out = dict(into)
    for k, v in (durations or {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            key = f"{prefix}.{k}"
            out[key] = max(out.get(key, 0.0), float(v))
    return out


# A rate sample needs this much time between its two reports: paused ranks poll
# every 20 ms, and one collective over 20 ms would read as 50 per second.
RATE_MIN_SPAN_S = 0.2


def _pace(prev: RankView, ev: RankProgress, now: float, standing_at: tuple[int | None, ...] = ()) -> dict[str, Any]:
    """Report interval, collective rate and step boundaries of a rank (inputs of decide.pause_point).

    Smoothed (half old, half new) so that one slow interval (a checkpoint
    write, a loaded node) does not halve the estimate; a count that went
    backwards (a restored copy reporting) restarts the measurement. An
    interval in which the rank issued nothing (paused at T, or standing
    behind a paused peer) is not a sample: the rate is the job's when it
    trains, and a T chosen from a rate lowered by a pause is passed before
    the ranks hear of it (every rank refused the next pause in the
    coordinator bench once reports became long polls). Nor is one that ends
    at the pause point T the rank stands at (``standing_at``: it may have
    stood there most of the interval). A resume starts a new measurement
    (Resumed clears ``rate_base``).
    """
    out: dict[str, Any] = {"reported_at": now}
    if prev.reported_at is not None and now > prev.reported_at:
        gap = now - prev.reported_at
        out["report_gap"] = gap if prev.report_gap <= 0 else 0.5 * prev.report_gap + 0.5 * gap
    base = prev.rate_base
    if base is None or ev.collectives < base[1]:
        out["rate_base"] = (now, ev.collectives)
        if base is not None:
            out["rate"] = 0.0
    elif now - base[0] >= RATE_MIN_SPAN_S and prev.rate > 0 and (ev.collectives == base[1]
                                                                 or ev.collectives in standing_at):
        out["rate_base"] = (now, ev.collectives)  # issued nothing, or stood at T: not the rate it trains at
    elif now - base[0] >= RATE_MIN_SPAN_S:
        sample = (ev.collectives - base[1]) / (now - base[0])
        out["rate"] = sample if prev.rate <= 0 else 0.5 * prev.rate + 0.5 * sample
        out["rate_base"] = (now, ev.collectives)
    if ev.boundary >= 0 and ev.boundary_step >= 0 and (ev.boundary, ev.boundary_step) != (prev.boundary,
                                                                                         prev.boundary_step):
        out["boundary"], out["boundary_step"] = ev.boundary, ev.boundary_step
        steps = ev.boundary_step - prev.boundary_step
        if prev.boundary >= 0 and steps > 0 and ev.boundary > prev.boundary:
            n, rest = divmod(ev.boundary - prev.boundary, steps)
            # Not a whole number per step, or not the number measured before: the
            # steps differ; do not align to them until two measurements agree.
            out["per_step"] = n if rest == 0 and prev.per_step in (0, n) else 0
        elif prev.boundary >= 0 and (steps <= 0 or ev.boundary <= prev.boundary):
            out["per_step"] = 0
    return out


def _compute(prev: RankView, ev: RankProgress) -> dict[str, Any]:
    """The rank's per-step compute figures with the report's new ones (decide_failslow reads them).
    A figure of a step it had already reported (a report sent again) is not taken twice; a step
    count that went back (a copy restored from a snapshot, a relaunched script) starts afresh."""
    if ev.compute_step < 0 or not ev.compute:
        return {}
    if ev.compute_step < prev.compute_step:
        return {"compute": tuple(ev.compute[-COMPUTE_KEPT:]), "compute_step": ev.compute_step}
    new = ev.compute_step - prev.compute_step
    if new <= 0:
        return {}
    fresh = ev.compute[-new:] if new < len(ev.compute) else ev.compute
    return {"compute": (prev.compute + tuple(fresh))[-COMPUTE_KEPT:], "compute_step": ev.compute_step}


def _put_rank(st: CoordState, rank: int, rv: RankView, owned: dict[int, RankView] | None) -> CoordState:
    """``st`` with ``ranks[rank] = rv``: in place when the caller owns ``st.ranks`` (a batch of
    reports, Driver.begin_batch: one copy of the ranks per batch instead of one per report),
    otherwise on a copy."""
    # ``st`` is always the state apply() was given (every caller puts the rank first): apply carries
    # that state's views to its result (CoordState.carry_views) unless they were dropped here.
    if owned is not None and st.ranks is owned:
        prev = owned.get(rank)
        owned[rank] = rv
        if prev is None or prev.node != rv.node or prev.pinned != rv.pinned:
            # rank_nodes() reads only these: a progress report keeps the views (rebuilding them over
            # 8,192 ranks on every batch was a large part of each decision).
            st.__dict__.pop(RANK_NODES_CACHE, None)
            st.__dict__.pop(PINNED_CACHE, None)
        return st
    return replace(st, ranks={**st.ranks, rank: rv})


def thaw_acks(st: CoordState) -> CoordState:
    """``st`` with the acknowledgment sets (quiesced, resumed) of the pause or resume in flight as
    plain sets that apply(owned=...) adds to in place, for a batch of outcomes (Driver.begin_batch).
    A frozenset copied on every rank's report grows the fan-in quadratically: at 8,192 ranks each
    quiesced report cost ~0.4 ms to copy the set. freeze_acks() ends it."""
    return _recast_acks(st, set)


def freeze_acks(st: CoordState) -> CoordState:
    """``st`` with the sets thaw_acks() made frozen again: what decide and every later state see."""
    return _recast_acks(st, frozenset)


def _recast_acks(st: CoordState, kind: type) -> CoordState:
    """``st`` with the migration's and the snapshot's acknowledgment sets as ``kind`` (copies).
    Every state outside a batch holds frozen sets, so thawing always makes the batch its own sets."""
    runs = {"migration": st.migration, "snapshot": st.snapshot}
    changed = {name: replace(run, quiesced=kind(run.quiesced), resumed=kind(run.resumed))
               for name, run in runs.items()
               if run is not None and not (type(run.quiesced) is kind and type(run.resumed) is kind)}
    return st.carry_views(replace(st, **changed)) if changed else st


def _with_ack(acks: frozenset[int], rank: int, owned: dict[int, RankView] | None) -> frozenset[int]:
    """``acks`` and ``rank``: in place in a batch's thawed set (thaw_acks), else a new frozenset."""
    if owned is not None and type(acks) is set:
        acks.add(rank)
        return acks
    return acks | {rank}


def _reported(st: CoordState, rank: int, now: float, owned: dict[int, RankView] | None = None,
              **said: Any) -> CoordState:
    """A registered rank spoke (job.status shows when); nothing decide reads changes."""
    rv = st.ranks.get(rank)
    if rv is None:
        return st
    # Its client sends one request at a time: a long poll it had parked was answered now.
    return _put_rank(st, rank, replace(rv, last_report=now, listening_until=None, **said), owned)


def unprotected_text(rank: int, why: str) -> str:
    """How ``CoordState.job_unprotected`` (and the job.unprotected event) say it."""
    return f"rank {rank} unprotected: {why}"


def _unprotected(st: CoordState, rank: int, why: str) -> CoordState:
    """The job is unprotected from the first rank that said so (a fact that never goes away)."""
    if not why or st.job_unprotected is not None:
        return st
    return replace(st, job_unprotected=unprotected_text(rank, why))


def _for(m: Migration | None, mid: str, *phases: Phase) -> bool:
    return m is not None and m.id == mid and m.phase in phases


def _on_checkpoint_completed(st: CoordState, ev: CheckpointCompleted, now: float, owned: Owned) -> CoordState:
    newest = st.restore_point
    return st if newest is not None and newest[0] > ev.step else replace(st, restore_point=(ev.step, ev.path))


def _on_checkpoint_loaded(st: CoordState, ev: CheckpointLoaded, now: float, owned: Owned) -> CoordState:
    return replace(st, step_offset=ev.step - max(0, ev.steps_then))


def _on_rank_exited(st: CoordState, ev: RankExited, now: float, owned: Owned) -> CoordState:
    """A rank's death joins the ones to decide: once per (rank, node), and only for a task this
    state knows on that node (a wrapper of a step relaunched since reports a rank the new step
    runs elsewhere, or none yet while the relaunch is in flight).

    The wrapper reports its task (the key of its rank record: the rank under a plain srun, the
    Slurm task under torchrun, whose agent is the task and whose workers are the ranks): it is
    matched with the registered ranks' ``task``, which a plain srun's ranks register as their rank."""
    if (ev.rank, ev.node) in st.deaths_released or any(d.rank == ev.rank and d.node == ev.node for d in st.deaths):
        return st
    if st.relaunch is not None or not any(st.task_of(r) == ev.rank and rv.node == ev.node
                                          for r, rv in st.ranks.items()):
        return st
    return replace(st, deaths=st.deaths + (RankDeath(ev.rank, ev.node, ev.how, now, ev.gpu),))


def death_verdict(st: CoordState, rank: int, node: str) -> str:
    """What the wrapper of a dead ``rank`` on ``node`` does now: "exit" (as the rank did: no
    relaunch, or nothing for torchpass to do) or "hold" (a decision or a relaunch is pending: the
    relaunch ends the step, and the wrapper with it)."""
    if (rank, node) in st.deaths_released:
        return "exit"
    if any(d.rank == rank and d.node == node for d in st.deaths) or st.relaunch is not None:
        return "hold"
    return "exit"


def _on_rank_registered(st: CoordState, ev: RankRegistered, now: float, owned: Owned) -> CoordState:
    prev = st.ranks.get(ev.rank)
    rv = RankView(ev.rank, ev.node, prev.collectives if prev else 0, prev.step if prev else -1,
                  now if prev is None or prev.node != ev.node else prev.last_advance,
                  task=ev.task if ev.task >= 0 else ev.rank, pinned=ev.pinned,
                  pid=ev.pid, generation=ev.generation, last_report=now, last_count=prev.last_count if prev else 0)
    st = _put_rank(st, ev.rank, rv, owned)
    r = st.relaunch
    if r is not None and r.snapshot and ev.restored == r.snapshot:
        st = replace(st, relaunch=replace(r, back=r.back | {ev.rank}))
    return st if st.world_size == ev.world_size else replace(st, world_size=ev.world_size)


def _on_rank_progress(st: CoordState, ev: RankProgress, now: float, owned: Owned) -> CoordState:
    prev = st.ranks.get(ev.rank)
    if prev is None:
        return st  # progress of a rank that never registered: nothing to attach it to
    m = st.migration
    advanced = ev.collectives != prev.collectives
    rv = replace(prev, collectives=ev.collectives, step=ev.step if ev.step >= 0 else prev.step,
                 node=ev.node or prev.node, last_advance=now if advanced else prev.last_advance,
                 last_report=now, last_count=ev.collectives,
                 listening_until=now + ev.wait_s if ev.wait_s > 0 else None,
                 **_compute(prev, ev),
                 **_pace(prev, ev, now, (m.pause_at if m is not None else None,
                                         st.snapshot.pause_at if st.snapshot is not None else None)))
    return _put_rank(st, ev.rank, rv, owned)


def _on_node_health(st: CoordState, ev: NodeHealthChanged, now: float, owned: Owned) -> CoordState:
    state = State(ev.state)
    prev = st.health.get(ev.node)
    since = prev.since if prev is not None and prev.state == state else now
    h = NodeHealth(ev.node, state, tuple(ev.reasons), ev.reachable, since, tuple(ev.rails))
    return replace(st, health={**st.health, ev.node: h})


def _on_job_rails(st: CoordState, ev: JobRails, now: float, owned: Owned) -> CoordState:
    if st.rail_plan is not None or not ev.rails:
        return st
    return replace(st, job_rails=tuple(ev.rails), rail_plan=initial_plan(tuple(ev.rails)))


def _on_slurm_reachability(st: CoordState, ev: SlurmReachability, now: float, owned: Owned) -> CoordState:
    return replace(st, slurm_down=None if ev.available else (ev.why or "slurmctld unreachable"))


def _on_spare_added(st: CoordState, ev: SpareAdded, now: float, owned: Owned) -> CoordState:
    if st.spare(ev.node) is not None:
        return st
    return replace(st, spares=st.spares + (SpareView(ev.node, ev.how),))


def _on_rank_unprotected(st: CoordState, ev: RankUnprotected, now: float, owned: Owned) -> CoordState:
    return _unprotected(st, ev.rank, ev.why)


def _on_armed(st: CoordState, ev: Armed, now: float, owned: Owned) -> CoordState:
    m = st.migration
    st = _unprotected(_reported(st, ev.rank, now, owned), ev.rank, ev.unprotected)
    if m is not None and m.phase == Phase.PAUSE and ev.generation == m.generation and ev.at == m.pause_at \
            and not ev.accepted:
        refused = tuple(x for x in m.refused if x[0] != ev.rank) + ((ev.rank, ev.collectives),)
        return replace(st, migration=replace(m, refused=refused))
    return st


def _on_quiesced(st: CoordState, ev: Quiesced, now: float, owned: Owned) -> CoordState:
    m = st.migration
    st = _reported(st, ev.rank, now, owned, last_count=ev.collectives)
    if m is not None and m.phase == Phase.PAUSE and ev.generation == m.generation \
            and ev.collectives == m.pause_at:
        first = m.first_quiesced if m.first_quiesced is not None else now
        tools = _merge_max(m.tool_durations, "quiesce", {"drain_s": round(ev.drain_s, 4)}) \
            if ev.drain_s > 0 else m.tool_durations
        if ev.released_mb is not None:
            tools = _merge_max(tools, "quiesce", {"released_mb": round(ev.released_mb, 1)})
        return replace(st, migration=replace(m, quiesced=_with_ack(m.quiesced, ev.rank, owned),
                                             first_quiesced=first, tool_durations=tools))
    return st


def _on_resumed(st: CoordState, ev: Resumed, now: float, owned: Owned) -> CoordState:
    m = st.migration
    rv = st.ranks.get(ev.rank)
    if rv is not None:
        said = {"last_count": ev.collectives} if ev.collectives is not None else {}
        st = _put_rank(st, ev.rank, replace(rv, last_advance=now, node=ev.node or rv.node,
                                            generation=ev.generation, last_report=now, rate_base=None,
                                            listening_until=None, **said), owned)
    r = st.relaunch
    if r is not None and r.phase == RelaunchPhase.RESUMING and ev.generation == r.generation:
        return replace(st, relaunch=replace(r, resumed=r.resumed | {ev.rank}))
    if m is not None and m.phase in (Phase.REBUILD, Phase.ROLLBACK) and (
        ev.generation == m.generation or (ev.cancelled and m.phase == Phase.ROLLBACK)
    ):
        return replace(st, migration=replace(m, resumed=_with_ack(m.resumed, ev.rank, owned)))
    return st


def _on_spare_granted(st: CoordState, ev: SpareGranted, now: float, owned: Owned) -> CoordState:
    m = st.migration
    spares = st.spares
    if st.spare(ev.node) is None:
        spares = spares + (SpareView(ev.node, ev.how, allocation=ev.allocation),)
    st = replace(st, spares=spares)
    if m is not None and m.id == ev.migration and m.phase == Phase.SPARE:
        st = replace(st, migration=replace(m, spare_requested=None))
    return st


def _on_spare_unavailable(st: CoordState, ev: SpareUnavailable, now: float, owned: Owned) -> CoordState:
    m = st.migration
    if _for(m, ev.migration, Phase.SPARE) and m.spare_requested == ev.strategy:
        m2 = replace(m, spare_requested=None, spare_failures=m.spare_failures + ((ev.strategy, ev.why),))
        return replace(st, migration=m2)
    return st


def _on_spare_lost(st: CoordState, ev: SpareLost, now: float, owned: Owned) -> CoordState:
    if st.spare(ev.node) is None:
        return st
    return replace(st, spares=tuple(replace(s, status=SpareStatus.LOST) if s.node == ev.node else s
                                    for s in st.spares))


def _on_migration_dump_done(st: CoordState, ev: MigrationDumpDone, now: float, owned: Owned) -> CoordState:
    m = st.migration
    if _for(m, ev.migration, Phase.DUMP) and ev.rank in m.ranks:
        m2 = replace(m, images={**m.images, ev.rank: Image(ev.rank, ev.image, ev.checksum)},
                     tool_durations=_merge_max(m.tool_durations, "dump", ev.durations))
        return replace(st, migration=m2)
    return st


def _record_failure(st: CoordState, ev, phase: Phase, failure: Failure, *, at_target: bool = False) -> CoordState:
    """The migration's first failure, if ``ev`` answers its current ``phase`` (and, for the
    steps on the spare, comes from its target); later failures of the same step add nothing."""
    m = st.migration
    if _for(m, ev.migration, phase) and (not at_target or ev.target == m.target) and m.failure is None:
        return replace(st, migration=replace(m, failure=failure))
    return st


def _on_migration_dump_failed(st: CoordState, ev: MigrationDumpFailed, now: float, owned: Owned) -> CoordState:
    return _record_failure(st, ev, Phase.DUMP, Failure(FailedStep.DUMP, f"rank {ev.rank}: {ev.why}"))


def _on_transfer_done(st: CoordState, ev: TransferDone, now: float, owned: Owned) -> CoordState:
    m = st.migration
    if _for(m, ev.migration, Phase.TRANSFER) and ev.target == m.target and ev.rank in m.ranks:
        m2 = replace(m, transferred={**m.transferred, ev.rank: Image(ev.rank, ev.image, ev.checksum)},
                     tool_durations=_merge_max(m.tool_durations, "transfer", ev.durations))
        return replace(st, migration=m2)
    return st


def _on_transfer_failed(st: CoordState, ev: TransferFailed, now: float, owned: Owned) -> CoordState:
    failure = Failure(FailedStep.TRANSFER, f"rank {ev.rank} to {ev.target}: {ev.why}", ev.target_lost)
    return _record_failure(st, ev, Phase.TRANSFER, failure, at_target=True)


def _on_restore_done(st: CoordState, ev: RestoreDone, now: float, owned: Owned) -> CoordState:
    m = st.migration
    if _for(m, ev.migration, Phase.RESTORE) and ev.target == m.target and ev.rank in m.ranks:
        m2 = replace(m, restored=m.restored | {ev.rank},
                     tool_durations=_merge_max(m.tool_durations, "restore", ev.durations),
                     gpu_pairs={**m.gpu_pairs, ev.rank: ev.gpu_pairs} if ev.gpu_pairs else m.gpu_pairs)
        return replace(st, migration=m2)
    return st


def _on_restore_failed(st: CoordState, ev: RestoreFailed, now: float, owned: Owned) -> CoordState:
    failure = Failure(FailedStep.RESTORE, f"rank {ev.rank}: {ev.why}", ev.target_lost)
    return _record_failure(st, ev, Phase.RESTORE, failure, at_target=True)


def _on_source_killed(st: CoordState, ev: SourceKilled, now: float, owned: Owned) -> CoordState:
    m = st.migration
    return replace(st, migration=replace(m, source_killed=True)) if _for(m, ev.migration, Phase.KILL_SOURCE) else st


def _on_kill_failed(st: CoordState, ev: KillFailed, now: float, owned: Owned) -> CoordState:
    return _record_failure(st, ev, Phase.KILL_SOURCE, Failure(FailedStep.KILL, ev.why))


def _finish_cleanup_step(st: CoordState, ev, phase: Phase, flag: str, failed_note: str | None) -> CoordState:
    """A cleanup step after the move (drain, shrink) is done whether or not it worked; a failure
    becomes a note of the migration's event, never a rollback."""
    m = st.migration
    if not _for(m, ev.migration, phase):
        return st
    notes = m.notes + ((failed_note,) if failed_note else ())
    return replace(st, migration=replace(m, notes=notes, **{flag: True}))


def _on_drained(st: CoordState, ev: Drained | DrainFailed, now: float, owned: Owned) -> CoordState:
    note = f"drain of {ev.node} failed: {ev.why}" if isinstance(ev, DrainFailed) else None
    return _finish_cleanup_step(st, ev, Phase.DRAIN, "drain_done", note)


def _on_shrunk(st: CoordState, ev: Shrunk | ShrinkFailed, now: float, owned: Owned) -> CoordState:
    note = f"shrink failed: {ev.why}" if isinstance(ev, ShrinkFailed) else None
    return _finish_cleanup_step(st, ev, Phase.SHRINK, "shrink_done", note)


def _on_operator_migrate(st: CoordState, ev: OperatorMigrate, now: float, owned: Owned) -> CoordState:
    return accept_operator(st, ev.node, ev.to, now)[0]


# One handler per outcome type (contract.Outcome): what each records. A test checks that every
# type of the Outcome union has one.
APPLY: dict[type, Callable[[CoordState, Any, float, Owned], CoordState]] = {
    RankRegistered: _on_rank_registered,
    RankProgress: _on_rank_progress,
    NodeHealthChanged: _on_node_health,
    JobRails: _on_job_rails,
    SpareAdded: _on_spare_added,
    Armed: _on_armed,
    RankUnprotected: _on_rank_unprotected,
    Quiesced: _on_quiesced,
    Resumed: _on_resumed,
    SpareGranted: _on_spare_granted,
    SpareUnavailable: _on_spare_unavailable,
    SpareLost: _on_spare_lost,
    MigrationDumpDone: _on_migration_dump_done,
    MigrationDumpFailed: _on_migration_dump_failed,
    TransferDone: _on_transfer_done,
    TransferFailed: _on_transfer_failed,
    RestoreDone: _on_restore_done,
    RestoreFailed: _on_restore_failed,
    SourceKilled: _on_source_killed,
    KillFailed: _on_kill_failed,
    Drained: _on_drained,
    DrainFailed: _on_drained,
    Shrunk: _on_shrunk,
    ShrinkFailed: _on_shrunk,
    OperatorMigrate: _on_operator_migrate,
    SlurmReachability: _on_slurm_reachability,
    CheckpointCompleted: _on_checkpoint_completed,
    CheckpointLoaded: _on_checkpoint_loaded,
    RankExited: _on_rank_exited,
    OperatorSnapshot: _on_operator_snapshot,
    RankDumped: _on_rank_dumped,
    RankDumpFailed: _on_rank_dump_failed,
    SnapshotCommitted: _on_snapshot_committed,
    SnapshotCommitFailed: _on_snapshot_commit_failed,
    JobStopFailed: _on_job_stop_failed,
}


def _apply(st: CoordState, ev: Outcome, now: float, owned: Owned) -> CoordState:
    handler = APPLY.get(type(ev))
    if handler is None:
        raise TypeError(f"not an outcome: {ev!r}")
    return handler(st, ev, now, owned)


def apply(state: CoordState, outcome: Outcome, now: float, *, owned: dict[int, RankView] | None = None
          ) -> CoordState:
    """The state after ``outcome`` arrived at ``now`` (coordinator clock).

    ``owned``: a ranks dict that the caller alone holds (it copied it for a batch of reports);
    when it is ``state.ranks``, rank updates write into it instead of copying every rank.
    """
    st = state.carry_views(_apply(state, outcome, now, owned))
    if isinstance(outcome, (Armed, Quiesced, Resumed)):
        st = _snapshot_report(st, outcome, now, owned)
    s = st.snapshot
    if s is not None and s.ready_at is None and s is not state.snapshot and snapshot_phase_complete(st, s):
        st = replace(st, snapshot=replace(s, ready_at=now))
    m = st.migration
    if m is not None and m.ready_at is None and m is not state.migration and phase_complete(st, m):
        st = replace(st, migration=replace(m, ready_at=now))
    return st


class ReasonLog:
    """Remembers the last reason so the driver logs a decision only when it changes."""

    def __init__(self) -> None:
        self.last: str | None = None

    def changed(self, reason: str) -> bool:
        if reason == self.last:
            return False
        self.last = reason
        return True


__all__ = [
    "RankRegistered", "RankProgress", "NodeHealthChanged", "SpareAdded", "Armed", "RankUnprotected", "Quiesced",
    "Resumed", "SpareGranted", "SpareUnavailable", "SpareLost", "MigrationDumpDone", "MigrationDumpFailed",
    "TransferDone", "TransferFailed", "RestoreDone", "RestoreFailed", "SourceKilled", "KillFailed", "Drained",
    "DrainFailed",
    "Shrunk", "ShrinkFailed", "OperatorMigrate", "Outcome", "OperatorRejected", "accept_operator", "apply",
    "ReasonLog", "unprotected_text", "accept_snapshot", "CheckpointCompleted", "CheckpointLoaded", "thaw_acks",
    "freeze_acks", "JobStopFailed", "APPLY", "RankExited", "death_verdict",
]
