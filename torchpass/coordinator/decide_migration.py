"""The migration machine: one handler per phase of ``phases.Phase`` (``_HANDLERS``).

A migration moves every rank of one node to a spare, one migration per job
at a time (phases.py draws every edge, the ends included)::

    SPARE -> PAUSE -> DUMP -> TRANSFER -> RESTORE -> KILL_SOURCE -> REBUILD -> DRAIN -> SHRINK
                 \\________\\_______\\_________\\__________/
                                 ROLLBACK (resume in place on the source)

``_advance`` first deals with a lost source or target, which can cut any
paused phase short, then calls the phase's handler. Training is paused from
PAUSE to the end of REBUILD (or ROLLBACK). Each of those phases has a
deadline from the policy; an expired deadline or a failure rolls back while
the source copy is still alive (CRIU dumps with --leave-running semantics,
and the source is killed only after every restore succeeded). Every path
that paused the job ends with a Resume or a ResumeInPlace command. Every
phase change goes through ``_enter`` and every end through ``_finish``: both
check the table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from torchpass.coordinator import decide_failslow as failslow
from torchpass.coordinator.contract import (
    AbortRestore,
    Drain,
    HandToSlurm,
    KillSource,
    MigrationDump,
    PauseAt,
    RequestSpare,
    Restore,
    Resume,
    ResumeInPlace,
    Shrink,
    Transfer,
)
from torchpass.coordinator.decide_common import (
    _everyone_in,
    _health_text,
    _lost,
    _master,
    _Out,
    _pause_overdue,
    _r,
    _set_spare,
    pause_point,
    spare_usable,
    stalled_ranks,
)
from torchpass.coordinator.model import (
    CoordState,
    Migration,
    MigrationRecord,
    SpareHow,
    SpareStatus,
    SpareView,
    Trigger,
)
from torchpass.coordinator.phases import (
    IllegalTransition,
    Phase,
    Result,
    check_result,
    check_transition,
)
from torchpass.coordinator.policy import (
    CoordinatorPolicy,
)
from torchpass.health_state import (
    State,
)


def _pick_spare(st: CoordState, m: Migration, policy: CoordinatorPolicy) -> SpareView | None:
    allowed_hot = SpareHow.HOT in policy.spare_strategies
    order = {s: i for i, s in enumerate(policy.spare_strategies)}
    usable = [
        sp for sp in st.spares
        if spare_usable(st, sp, policy) and sp.node not in m.tried and sp.node != m.node
        and (sp.how != SpareHow.HOT or allowed_hot)
    ]
    usable.sort(key=lambda sp: (order.get(sp.how, 99), sp.node))
    return usable[0] if usable else None


def _target_lost(st: CoordState, m: Migration) -> bool:
    if m.target is None:
        return False
    sp = st.spare(m.target)
    return (sp is not None and sp.status == SpareStatus.LOST) or st.node_health(m.target).state == State.FAILED


def _source_lost(st: CoordState, m: Migration) -> bool:
    return _lost(st.node_health(m.node))


@dataclass(frozen=True)
class Candidate:
    node: str
    reason: str
    trigger: Trigger
    detected: float


def candidates(now: float, st: CoordState, policy: CoordinatorPolicy) -> list[Candidate]:
    """Nodes that need an automatic migration, oldest first (excludes the one in flight)."""
    busy = {st.migration.node} if st.migration else set()
    busy |= {r.node for r in st.operator_requests}
    skip = busy | set(st.handed) | set(st.released) | set(st.given_up)
    found: dict[str, Candidate] = {}
    # Only a node with a health report can trigger (unknown and healthy never do): the few in a
    # triggering state, found in one pass over the reports (decide runs every tick).
    triggering = [n for n, h in st.health.items()
                  if h.state is not State.HEALTHY and h.state.value in policy.migrate_on]
    nodes = st.rank_nodes() if triggering else {}
    for node in sorted(triggering):
        if node not in nodes or node in skip or st.deferred.get(node, float("-inf")) > now:
            continue
        h = st.health[node]
        if _lost(h):
            continue  # lost is handed to Slurm
        found[node] = Candidate(node, _health_text(h), Trigger.HEALTH, h.since)
    for r in stalled_ranks(now, st, policy):
        if r.node in skip or r.node in found or st.deferred.get(r.node, float("-inf")) > now:
            continue
        if _lost(st.node_health(r.node)):
            continue
        found[r.node] = Candidate(r.node, f"rank {r.rank} stalled", Trigger.STALL,
                                  r.last_advance + policy.stall_s)
    for w in failslow.due(st, now, policy) if st.slow else ():
        if w.node in skip or w.node in found or w.node not in st.rank_nodes() \
                or st.deferred.get(w.node, float("-inf")) > now or _lost(st.node_health(w.node)):
            continue
        found[w.node] = Candidate(w.node, failslow.reason(w), Trigger.FAILSLOW, w.since)
    return sorted(found.values(), key=lambda c: (c.detected, c.node))


def check_operator_request(st: CoordState, node: str, to: str | None) -> tuple[str, str] | None:
    """Why `tpassctl migrate` must be refused, as (wire error code, message); None if fine."""
    if st.job_unprotected is not None:
        return "conflict", f"job is unprotected: {st.job_unprotected}; torchpass cannot migrate it"
    nodes = st.rank_nodes()
    if node not in nodes:
        return "not_found", (
            f"node {node} runs no rank of job {st.job_id} (its nodes: {', '.join(sorted(nodes)) or 'none registered'})"
        )
    if node in st.handed:
        return "conflict", f"node {node} was lost and handed to Slurm; it cannot be migrated"
    pinned = st.pinned_nodes().get(node)
    if pinned:
        return "conflict", f"node {node} cannot move: {pinned}"
    if (st.migration is not None and st.migration.node == node) or any(r.node == node for r in st.operator_requests):
        return "conflict", f"a migration of {node} is already in flight or queued"
    if to is not None:
        if to == node:
            return "bad_request", f"--to {to} is the node being migrated"
        sp = st.spare(to)
        if sp is None:
            spares = ", ".join(s.node for s in st.spares) or "none"
            return "not_found", f"node {to} is not a spare of job {st.job_id} (spares: {spares})"
        if sp.status != SpareStatus.FREE:
            return "conflict", f"spare {to} is {sp.status}, not free"
    if not st.all_registered():
        return "conflict", (
            f"job {st.job_id} has {len(st.ranks)}/{st.world_size or '?'} ranks registered; "
            "a migration needs every rank to be reachable"
        )
    return None


def phase_complete(st: CoordState, m: Migration) -> bool:
    """The completion condition of the current phase (used by machine for ready_at)."""
    if m.phase == Phase.PAUSE:
        return _everyone_in(st, m.quiesced)
    if m.phase == Phase.DUMP:
        return set(m.ranks) <= set(m.images)
    if m.phase == Phase.TRANSFER:
        return set(m.ranks) <= set(m.transferred)
    if m.phase == Phase.RESTORE:
        return set(m.ranks) <= m.restored
    if m.phase == Phase.KILL_SOURCE:
        return m.source_killed
    if m.phase in (Phase.REBUILD, Phase.ROLLBACK):
        return _everyone_in(st, m.resumed)
    if m.phase == Phase.DRAIN:
        return m.drain_done
    if m.phase == Phase.SHRINK:
        return m.shrink_done
    return False


def _stood_still(m: Migration) -> float | None:
    """When training stood still: every rank at T, else (rolled back before they all got
    there) the first rank that stopped; None if no rank ever stopped."""
    return m.stood_still_since if m.stood_still_since is not None else m.first_quiesced


def _close_phase(m: Migration, now: float) -> dict[str, float]:
    d = dict(m.phase_durations)
    end = m.ready_at if m.ready_at is not None else now
    d[m.phase.value] = _r(d.get(m.phase.value, 0.0) + max(0.0, end - m.phase_started))
    return d


def _enter(m: Migration, phase: Phase, now: float, deadline: float, **changes: Any) -> Migration:
    """``m`` in ``phase`` from ``now``: every phase change goes through here and the table."""
    check_transition(m.id, m.phase, phase)
    return replace(m, phase=phase, phase_started=now, deadline=deadline, ready_at=None,
                   phase_durations=_close_phase(m, now), **changes)


def _finish(out: _Out, st: CoordState, m: Migration, now: float, outcome: Result, policy: CoordinatorPolicy,
            message: str, kind: str, *, checked: bool = True, extra: dict[str, Any] | None = None) -> CoordState:
    """End ``m`` with ``outcome`` (every end goes through here and the table; ``checked=False``
    only for the recovery from an illegal transition)."""
    if checked:
        check_result(m.id, m.phase, outcome)
    durations = _close_phase(m, now)
    durations["total"] = _r(now - m.started)
    if "paused" not in durations and m.paused:
        since = _stood_still(m)
        durations["paused"] = _r(now - since) if since is not None else 0.0
    m = replace(m, phase_durations=durations)
    if m.target is not None:
        sp = st.spare(m.target)
        if sp is not None and sp.status == SpareStatus.RESERVED:
            st = _set_spare(st, m.target, SpareStatus.USED if outcome == Result.COMPLETED else SpareStatus.FREE)
    rec = MigrationRecord(m.id, m.node, m.target, outcome, m.reason, durations)
    st = replace(st, migration=None, history=(st.history + (rec,))[-50:])
    data: dict[str, Any] = {"migration": m.id, "node": m.node, "target": m.target, "outcome": outcome,
                            "phase_durations": durations}
    if m.tool_durations:
        data["tool_durations"] = dict(m.tool_durations)
    if m.gpu_pairs:  # each rank's GPUs: source UUID -> target UUID, in local order
        data["gpu_pairs"] = {str(r): [list(p) for p in pairs] for r, pairs in sorted(m.gpu_pairs.items())}
    if m.pause_at is not None:
        data["pause_at"] = m.pause_at
        data["pause_estimate"] = m.pause_estimate
    data.update(extra or {})
    out.event(kind, message, **data)
    if outcome in (Result.COMPLETED, Result.CANCELLED, Result.SOURCE_LOST, Result.REJECTED, Result.ABORTED):
        return st
    if outcome == Result.NO_SPARE:
        return replace(st, deferred={**st.deferred, m.node: now + policy.spare_retry_s},
                       unprotected=st.unprotected | {m.node})
    # rolled_back / stuck: count the failure; back off, then try again or give up.
    n = st.failures.get(m.node, 0) + 1
    st = replace(st, failures={**st.failures, m.node: n},
                 deferred={**st.deferred, m.node: now + policy.retry_backoff_s})
    if n >= policy.max_attempts_per_node and m.node not in st.given_up and m.trigger != Trigger.OPERATOR:
        st = replace(st, given_up=st.given_up | {m.node})
        out.event("migration.abandoned",
                  f"{m.node}: {n} migrations failed; torchpass stops trying (tpassctl migrate can still try)",
                  node=m.node, failures=n)
    return st


def _rollback(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, why: str) -> CoordState:
    if _source_lost(st, m):
        return _job_lost(out, st, m, now, policy, f"{why}, and {m.node} is lost")
    if m.target is not None and (m.restored or m.phase in (Phase.RESTORE, Phase.KILL_SOURCE)):
        out.add(AbortRestore(m.id, m.target, tuple(m.ranks)))
    if m.target is not None:
        sp = st.spare(m.target)
        if sp is not None and sp.status == SpareStatus.RESERVED:
            st = _set_spare(st, m.target, SpareStatus.FREE)
    master = _master(st, None)
    out.add(ResumeInPlace(m.id, m.generation, master, why))
    out.event("migration.rollback", f"{m.id}: {why}; resuming on {m.node}", migration=m.id, node=m.node,
              phase=m.phase.value, why=why)
    m = _enter(m, Phase.ROLLBACK, now, now + policy.rebuild_timeout_s, resumed=frozenset(), resume_attempts=1,
               rollback_reason=why, failure=None)
    return replace(st, migration=m)


def _job_lost(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, why: str) -> CoordState:
    """The source died before its ranks could be saved: no clean move is possible."""
    if m.node not in st.handed:
        reason = f"torchpass: {m.node} lost during migration {m.id} ({why}); no clean dump possible"
        out.add(HandToSlurm(m.node, reason))
        st = replace(st, handed=st.handed | {m.node})
    if m.paused:
        # Never hold the survivors: release them; the job's fate is Slurm's now.
        if m.target is not None and m.restored:
            out.add(AbortRestore(m.id, m.target, tuple(m.ranks)))
        out.add(ResumeInPlace(m.id, m.generation, _master(st, None), f"{m.node} lost"))
        st = replace(st, generation=max(st.generation, m.generation))
    return _finish(out, st, m, now, Result.SOURCE_LOST, policy,
                   f"{m.id}: {m.node} was lost ({why}); no clean dump possible: handed to Slurm", "node.lost")


def _replace_target(out: _Out, st: CoordState, m: Migration, policy: CoordinatorPolicy, why: str
                    ) -> tuple[CoordState, Migration | None]:
    """The target died: mark it lost and take the next free spare, if allowed."""
    lost = m.target
    st = _set_spare(st, lost, SpareStatus.LOST)
    tried = m.tried + ((lost,) if lost else ())
    m = replace(m, tried=tried, target=None, target_how=None)
    if len(tried) >= policy.max_spare_attempts:
        return st, None
    sp = _pick_spare(st, m, policy)
    if sp is None:
        return st, None
    st = _set_spare(st, sp.node, SpareStatus.RESERVED)
    out.event("spare.replaced", f"{m.id}: spare {lost} lost ({why}); continuing with {sp.node} ({sp.how})",
              migration=m.id, lost=lost, target=sp.node, how=sp.how)
    return st, replace(m, target=sp.node, target_how=sp.how)


def _start_pause(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy) -> CoordState:
    at, how = pause_point(now, st.ranks, policy)
    out.add(PauseAt(m.id, at, m.generation, m.ranks))
    m = _enter(m, Phase.PAUSE, now, now + policy.pause_timeout_s, pause_at=at, pause_estimate=how,
               paused_since=now, first_quiesced=None, stood_still_since=None, quiesced=frozenset(), refused=())
    return replace(st, migration=m)


def _on_spare(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, done: bool = False
              ) -> CoordState:
    """Nothing is paused yet: reserve a usable spare and pause, ask slurmctld for one, or give up
    (the node runs on unprotected); a trigger that went away cancels the move."""
    if _source_lost(st, m):
        return _job_lost(out, st, m, now, policy, "failed and unreachable")
    if st.job_unprotected is not None:
        return _finish(out, st, m, now, Result.CANCELLED, policy,
                       f"{m.id}: the job is unprotected ({st.job_unprotected}); not moving {m.node}",
                       "migration.cancelled")
    if m.trigger == Trigger.HEALTH:
        h = st.node_health(m.node)
        if h.state.value not in policy.migrate_on and not _lost(h):
            return _finish(out, st, m, now, Result.CANCELLED, policy,
                           f"{m.id}: {m.node} is {h.state.value} again before anything was paused; not moving it",
                           "migration.cancelled")
    if m.trigger == Trigger.STALL and not any(r.node == m.node for r in stalled_ranks(now, st, policy)):
        return _finish(out, st, m, now, Result.CANCELLED, policy,
                       f"{m.id}: the ranks on {m.node} advance again before anything was paused; not moving it",
                       "migration.cancelled")
    if m.requested_to is not None:
        sp = st.spare(m.requested_to)
        if sp is None or not spare_usable(st, sp, policy):
            state = "unknown" if sp is None else (
                sp.status if sp.status != SpareStatus.FREE else st.node_health(sp.node).state.value)
            return _finish(out, st, m, now, Result.REJECTED, policy,
                           f"{m.id}: requested target {m.requested_to} is not usable ({state}); nothing was paused",
                           "migration.rejected")
        chosen: SpareView | None = sp
    else:
        chosen = _pick_spare(st, m, policy)
    if chosen is not None:
        st = _set_spare(st, chosen.node, SpareStatus.RESERVED)
        origin = {SpareHow.EXPAND: f", allocation {chosen.allocation} merged into job {st.job_id}",
                  SpareHow.COMPANION: f", companion allocation {chosen.allocation}"}.get(chosen.how, "")
        out.event("spare.chosen", f"{m.id}: moving {m.node} to {chosen.node} ({chosen.how} spare{origin})",
                  migration=m.id, node=m.node, target=chosen.node, how=chosen.how,
                  **({"allocation": chosen.allocation} if chosen.allocation is not None else {}))
        m = replace(m, target=chosen.node, target_how=chosen.how, spare_requested=None)
        return _start_pause(out, st, m, now, policy)
    if m.spare_requested is not None:
        if now < m.deadline:
            return st
        m = replace(m, spare_failures=m.spare_failures + ((m.spare_requested, "no answer in time"),),
                    spare_requested=None)
        st = replace(st, migration=m)
    # A granted spare whose tpassd has not reported yet: wait for it until the deadline.
    pending = [s for s in st.spares if s.status == SpareStatus.FREE and s.how != SpareHow.HOT and s.node not in m.tried
               and st.node_health(s.node).state == State.UNKNOWN]
    if pending and now < m.deadline:
        return st
    asked = {s for s, _ in m.spare_failures}
    for strategy in policy.spare_strategies:
        if strategy == SpareHow.HOT or strategy in asked:
            continue
        out.add(RequestSpare(m.id, SpareHow(strategy), m.node))
        out.event("spare.requested", f"{m.id}: no hot spare for {m.node}; asking slurmctld ({strategy})",
                  migration=m.id, node=m.node, strategy=strategy)
        m = replace(m, spare_requested=strategy, deadline=now + policy.spare_timeout_s)
        return replace(st, migration=m)
    tried = "; ".join(f"{s}: {w}" for s, w in m.spare_failures) or "no strategy allowed by the policy"
    hot = "no free hot spare" if SpareHow.HOT in policy.spare_strategies else "hot spares not allowed by the policy"
    return _finish(out, st, m, now, Result.NO_SPARE, policy,
                   f"{m.id}: no spare for {m.node} ({hot}; {tried}); training continues on {m.node} unprotected",
                   "spare.unavailable")


def _advance(out: _Out, st: CoordState, now: float, policy: CoordinatorPolicy) -> CoordState:
    m = st.migration
    assert m is not None
    ph = m.phase
    if ph == Phase.SPARE:  # nothing paused: a lost node only ends or re-plans the move
        return _on_spare(out, st, m, now, policy)

    # --- the source node died -------------------------------------------------------
    if _source_lost(st, m):
        saved = set(m.ranks) <= set(m.images)
        if ph in (Phase.PAUSE, Phase.ROLLBACK) or (ph == Phase.DUMP and not saved):
            return _job_lost(out, st, m, now, policy, "failed and unreachable before its ranks were saved")
        if ph == Phase.KILL_SOURCE and not m.source_killed:
            # its copies died with it
            m = replace(m, source_killed=True, ready_at=now if m.ready_at is None else m.ready_at)
            st = replace(st, migration=m)
        # DUMP (all saved) / TRANSFER / RESTORE carry on from the images; later phases no longer need it.

    # --- the target died --------------------------------------------------------------
    if ph in (Phase.PAUSE, Phase.DUMP, Phase.TRANSFER, Phase.RESTORE) and (
        _target_lost(st, m) or (m.failure is not None and m.failure.target_lost)
    ):
        why = m.failure.why if m.failure is not None and m.failure.target_lost else f"{m.target} failed"
        restored_any = bool(m.restored) or ph == Phase.RESTORE
        if restored_any and m.target:
            out.add(AbortRestore(m.id, m.target, tuple(m.ranks)))
        st, m2 = _replace_target(out, st, m, policy, why)
        if m2 is None:
            m = replace(m, target=None, failure=None)
            return _rollback(out, st, m, now, policy, f"spare {m.tried[-1] if m.tried else '?'} lost ({why}) "
                             "and no other spare is free")
        m2 = replace(m2, failure=None, restored=frozenset(), transferred={})
        if ph in (Phase.TRANSFER, Phase.RESTORE):
            # Images are on the source side already: send them to the new target.
            st = replace(st, migration=m2)
            return _start_transfer(out, st, m2, now, policy)
        return replace(st, migration=m2)
    if ph in (Phase.REBUILD,) and _target_lost(st, m):
        # Source copies are gone, the moved ranks died with the target: nothing to resume.
        if m.target not in st.handed:
            out.add(HandToSlurm(m.target, f"torchpass: spare {m.target} failed while ranks {list(m.ranks)} "
                                          "were resuming there; no copy left"))
            st = replace(st, handed=st.handed | {m.target})
        return _finish(out, st, m, now, Result.STUCK, policy,
                       f"{m.id}: target {m.target} failed after the source copies were killed; handed to Slurm",
                       "job.stuck")

    # --- the job turned unprotected: its ranks refuse the pause; nothing is killed yet -------
    if st.job_unprotected is not None and ph in (Phase.PAUSE, Phase.DUMP, Phase.TRANSFER, Phase.RESTORE):
        return _rollback(out, st, m, now, policy, f"the job is unprotected ({st.job_unprotected})")

    done = phase_complete(st, m)
    return _HANDLERS[ph](out, st, m, now, policy, done)


def _on_pause(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, done: bool
              ) -> CoordState:
    """Every rank quiesced at T: dump the moved ones. Refusals re-arm a later T."""
    if done:
        for r in m.ranks:
            out.add(MigrationDump(m.id, r, m.node))
        # Training stands still from the moment the last rank reached T.
        m = replace(m, stood_still_since=m.ready_at if m.ready_at is not None else now)
        return replace(st, migration=_enter(m, Phase.DUMP, now, now + policy.dump_timeout_s))
    rearmed, why = _pause_overdue(out, st, m, now, policy, m.ranks, m.id, migration=m.id)
    if rearmed is not None:
        return replace(st, migration=rearmed)
    if why is not None:
        return _rollback(out, st, m, now, policy, why)
    return st


def _paused_step(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, done: bool, *,
                 failed: str, late: str, then: Callable[[], CoordState]) -> CoordState:
    """DUMP, TRANSFER, RESTORE, KILL_SOURCE: a failure or the deadline rolls back (``failed``:
    what failed, ``late``: what timed out); ``then`` once every outcome arrived."""
    if m.failure is not None:
        return _rollback(out, st, m, now, policy, f"{failed}: {m.failure.why}")
    if done:
        return then()
    if now >= m.deadline:
        return _rollback(out, st, m, now, policy, late)
    return st


def _on_dump(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, done: bool
             ) -> CoordState:
    """Every moved rank dumped (left running, paused): make the images readable on the target."""
    missing = sorted(set(m.ranks) - set(m.images))
    return _paused_step(out, st, m, now, policy, done, failed="dump failed",
                        late=f"dump timed out after {policy.dump_timeout_s:g}s (ranks {missing})",
                        then=lambda: _start_transfer(out, replace(st, migration=m), m, now, policy))


def _on_transfer(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, done: bool
                 ) -> CoordState:
    """Every image readable on the target: restore the ranks there (they stay paused, holding)."""
    def restore() -> CoordState:
        for r in m.ranks:
            img = m.transferred[r]
            out.add(Restore(m.id, r, m.target or "", img.path, img.checksum))
        return replace(st, migration=_enter(m, Phase.RESTORE, now, now + policy.restore_timeout_s))

    return _paused_step(out, st, m, now, policy, done, failed="transfer failed",
                        late=f"transfer timed out after {policy.transfer_timeout_s:g}s", then=restore)


def _on_restore(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, done: bool
                ) -> CoordState:
    """Every rank restored on the target: kill the source copies."""
    def kill() -> CoordState:
        out.add(KillSource(m.id, m.node, m.ranks))
        return replace(st, migration=_enter(m, Phase.KILL_SOURCE, now, now + policy.kill_timeout_s))

    missing = sorted(set(m.ranks) - m.restored)
    return _paused_step(out, st, m, now, policy, done, failed=f"restore on {m.target} failed",
                        late=f"restore on {m.target} timed out after {policy.restore_timeout_s:g}s (ranks {missing})",
                        then=kill)


def _on_kill_source(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, done: bool
                    ) -> CoordState:
    """The source copies are dead (``done``: ``m.source_killed``): the moved ranks live on the
    target; every rank rebuilds."""
    def rebuild() -> CoordState:
        ranks = {**st.ranks}
        for r in m.ranks:
            if r in ranks:
                # its compute figures were measured on the source: the fail-slow rule starts afresh
                ranks[r] = replace(ranks[r], node=m.target or ranks[r].node, compute=())
        moved = replace(st, ranks=ranks)
        out.add(Resume(m.id, m.generation, _master(moved, None)))
        m2 = _enter(m, Phase.REBUILD, now, now + policy.rebuild_timeout_s, resumed=frozenset(), resume_attempts=1)
        return replace(moved, migration=m2)

    return _paused_step(out, st, m, now, policy, done, failed="could not kill the source copies",
                        late=f"the source copies on {m.node} were not killed within {policy.kill_timeout_s:g}s",
                        then=rebuild)


def _resuming(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, done: bool
              ) -> CoordState:
    """REBUILD and ROLLBACK: wait for every rank to resume; ask again, then hand the laggards to Slurm."""
    ph = m.phase
    if done:
        end = m.ready_at if m.ready_at is not None else now
        since = _stood_still(m)
        durations = {**m.phase_durations, "paused": _r(max(0.0, end - since)) if since is not None else 0.0}
        m = replace(m, phase_durations=durations)
        st = replace(st, generation=max(st.generation, m.generation))
        if ph == Phase.ROLLBACK:
            return _finish(out, st, m, now, Result.ROLLED_BACK, policy,
                           f"{m.id}: rolled back ({m.rollback_reason}); training resumed on {m.node} after "
                           f"{durations['paused']:.2f}s paused", "migration.rolled_back")
        out.add(Drain(m.id, m.node, f"torchpass: {m.reason}"))
        out.event("migration.resumed", f"{m.id}: ranks {list(m.ranks)} resumed on {m.target}; training paused "
                  f"{durations['paused']:.2f}s", migration=m.id, node=m.node, target=m.target,
                  phase_durations=durations)
        return replace(st, migration=_enter(m, Phase.DRAIN, now, now + policy.finalize_timeout_s))
    if now >= m.deadline:
        missing = sorted(set(st.ranks) - m.resumed)
        if m.resume_attempts < policy.max_resume_attempts:
            if ph == Phase.REBUILD:
                out.add(Resume(m.id, m.generation, _master(st, None)))
            else:
                out.add(ResumeInPlace(m.id, m.generation, _master(st, None), m.rollback_reason or "rollback"))
            out.event("resume.retried", f"{m.id}: ranks {missing} did not resume; asking again",
                      migration=m.id, missing=missing)
            m = replace(m, resume_attempts=m.resume_attempts + 1, deadline=now + policy.rebuild_timeout_s)
            return replace(st, migration=m)
        culprits = sorted({st.ranks[r].node for r in missing if r in st.ranks})
        for node in culprits:
            if node not in st.handed:
                out.add(HandToSlurm(node, f"torchpass: ranks on {node} did not resume after migration {m.id}"))
                st = replace(st, handed=st.handed | {node})
        st = replace(st, generation=max(st.generation, m.generation))
        return _finish(out, st, m, now, Result.STUCK, policy,
                       f"{m.id}: ranks {missing} did not resume after {m.resume_attempts} resume commands; "
                       "handed to Slurm", "job.stuck")
    return st


def _settled(m: Migration, now: float, policy: CoordinatorPolicy, done: bool, what: str) -> Migration | None:
    """DRAIN and SHRINK (training runs): ``m`` once confirmed or, noting that ``what`` was not
    confirmed, once the deadline passed; None while waiting."""
    if done:
        return m
    if now < m.deadline:
        return None
    return replace(m, notes=m.notes + (f"{what} not confirmed in {policy.finalize_timeout_s:g}s",))


def _on_drain(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, done: bool
              ) -> CoordState:
    """Drain confirmed (or not in time): release the node from the job."""
    m2 = _settled(m, now, policy, done, f"drain of {m.node}")
    if m2 is None:
        return st
    out.add(Shrink(m2.id, (m2.node,)))
    return replace(st, migration=_enter(m2, Phase.SHRINK, now, now + policy.finalize_timeout_s))


def _on_shrink(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, done: bool
               ) -> CoordState:
    """Shrink confirmed (or not in time): the migration is complete."""
    m2 = _settled(m, now, policy, done, "shrink")
    if m2 is None:
        return st
    st = replace(st, released=st.released | {m2.node}, unprotected=st.unprotected - {m2.node})
    notes = f" ({'; '.join(m2.notes)})" if m2.notes else ""
    # Say what happened to the node: a shrink that failed leaves it in the job.
    kept = [n for n in m2.notes if n.startswith(("shrink failed", "shrink not confirmed"))]
    # The event's data says it too, for scripts and tests: "released" (out of the job: it can be
    # powered off or returned to Slurm) or "kept", with why.
    source = {"source": "kept", "source_kept_why": "; ".join(kept)} if kept else {"source": "released"}
    # ... and whether its tpassd drained it (it refuses a healthy node for a user's job).
    drained = not any(n.startswith("drain of") for n in m2.notes)
    return _finish(out, st, m2, now, Result.COMPLETED, policy,
                   f"{m2.id}: moved ranks {list(m2.ranks)} from {m2.node} to {m2.target}; {m2.node} "
                   f"{'drained' if drained else 'not drained'} and {'kept in the job' if kept else 'released'}"
                   f"{notes}", "migration.completed", extra=source)


def _on_rebuild(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, done: bool
                ) -> CoordState:
    """Every rank (the moved ones on the target) rebuilds the new generation: then drain the node."""
    return _resuming(out, st, m, now, policy, done)


def _on_rollback(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, done: bool
                 ) -> CoordState:
    """Every rank resumes where it was: the migration ends rolled back."""
    return _resuming(out, st, m, now, policy, done)


# One handler per phase, as in the module docstring (and phases.TRANSITIONS).
_HANDLERS = {
    Phase.SPARE: _on_spare,
    Phase.PAUSE: _on_pause,
    Phase.DUMP: _on_dump,
    Phase.TRANSFER: _on_transfer,
    Phase.RESTORE: _on_restore,
    Phase.KILL_SOURCE: _on_kill_source,
    Phase.REBUILD: _on_rebuild,
    Phase.ROLLBACK: _on_rollback,
    Phase.DRAIN: _on_drain,
    Phase.SHRINK: _on_shrink,
}


def _start_transfer(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy) -> CoordState:
    for r in m.ranks:
        img = m.images[r]
        out.add(Transfer(m.id, r, img.path, img.checksum, m.node, m.target or ""))
    m = _enter(m, Phase.TRANSFER, now, now + policy.transfer_timeout_s, transferred={}, restored=frozenset(),
               failure=None)
    return replace(st, migration=m)


def _new_migration(st: CoordState, now: float, *, mid: str, node: str, reason: str, trigger: Trigger,
                   detected: float, to: str | None, policy: CoordinatorPolicy) -> Migration:
    check_transition(mid, None, Phase.SPARE)
    return Migration(
        id=mid, node=node, reason=reason, trigger=trigger, ranks=st.rank_nodes().get(node, ()),
        detected=detected, started=now, phase=Phase.SPARE, phase_started=now,
        deadline=now + policy.spare_timeout_s, generation=st.generation + 1, requested_to=to,
        phase_durations={"detect": _r(max(0.0, now - detected))},
    )


def _say_skipped(out: _Out, said: frozenset[str], cands, why: Callable[[str], tuple[str, dict]]) -> frozenset[str]:
    """One migration.skipped per node of ``cands`` not in ``said`` (``why(node)``: what keeps it,
    and the event's data for it); ``said`` with those nodes."""
    for c in cands:
        if c.node not in said:
            text, data = why(c.node)
            out.event("migration.skipped", f"{c.node} needs to move ({c.reason}), but {text}: not moving it",
                      node=c.node, reason=c.reason, **data)
            said = said | {c.node}
    return said


def _skip_unprotected(out: _Out, st: CoordState, now: float, policy: CoordinatorPolicy) -> CoordState:
    """The job is unprotected: drop queued operator requests, and say once per node that a
    node needing a move is not moved."""
    why = st.job_unprotected
    for req in st.operator_requests:
        out.event("migration.rejected", f"{req.id}: the job is unprotected ({why}); dropped",
                  migration=req.id, node=req.node)
    said = _say_skipped(out, st.unprotected_skipped, candidates(now, st, policy),
                        lambda _node: (f"the job is unprotected ({why})", {"unprotected": why}))
    if not st.operator_requests and said == st.unprotected_skipped:
        return st
    return replace(st, operator_requests=(), unprotected_skipped=said)


def _skip_pinned(out: _Out, st: CoordState, cands: list, pinned: dict[str, str]) -> CoordState:
    """Nodes that need to move but cannot (a rank there said why, e.g. torchrun's agent there
    serves a store every node uses): said once per node; the rest of the job stays protected."""
    said = _say_skipped(out, st.unprotected_skipped, cands,
                        lambda node: (f"it cannot move ({pinned[node]})", {"pinned": pinned[node]}))
    return st if said == st.unprotected_skipped else replace(st, unprotected_skipped=said)


def _start_next(out: _Out, st: CoordState, now: float, policy: CoordinatorPolicy) -> CoordState:
    if not st.all_registered() or st.slurm_down:
        return st  # a move needs slurmctld (spare, restore step, drain): wait for it
    if st.job_unprotected is not None:
        return _skip_unprotected(out, st, now, policy)
    while st.operator_requests:
        req, rest = st.operator_requests[0], st.operator_requests[1:]
        st = replace(st, operator_requests=rest)
        if req.node not in st.rank_nodes() or req.node in st.handed:
            out.event("migration.rejected", f"{req.id}: {req.node} no longer runs ranks of the job; dropped",
                      migration=req.id, node=req.node)
            continue
        pinned = st.pinned_nodes().get(req.node)
        if pinned:
            out.event("migration.rejected", f"{req.id}: {req.node} cannot move ({pinned}); dropped",
                      migration=req.id, node=req.node, pinned=pinned)
            continue
        m = _new_migration(st, now, mid=req.id, node=req.node, reason="operator request", trigger=Trigger.OPERATOR,
                           detected=req.at, to=req.to, policy=policy)
        out.event("migration.started", f"{m.id}: operator asked to move {req.node}"
                  + (f" to {req.to}" if req.to else ""), migration=m.id, node=req.node, to=req.to,
                  trigger=Trigger.OPERATOR)
        return replace(st, migration=m)
    cands = candidates(now, st, policy)
    if not cands:
        return st
    pinned = st.pinned_nodes()
    if pinned:
        st = _skip_pinned(out, st, [c for c in cands if c.node in pinned], pinned)
        cands = [c for c in cands if c.node not in pinned]
        if not cands:
            return st
    c = cands[0]
    mid = f"m{st.next_migration}"
    m = _new_migration(st, now, mid=mid, node=c.node, reason=c.reason, trigger=c.trigger,
                       detected=c.detected, to=None, policy=policy)
    if c.trigger == Trigger.FAILSLOW and c.node in st.slow:
        w = st.slow[c.node]
        out.event("failslow.detected", f"{c.node} computes {w.ratio:g}x slower than its peers: "
                  f"{w.node_s * 1000:.1f} ms per step against their median {w.peers_s * 1000:.1f} ms, in each of "
                  f"{w.windows} windows of {w.window_steps} steps (to step {w.last_step}), for "
                  f"{now - w.since:.1f} s; {mid} moves it", migration=mid, **failslow.detected_data(w, now))
    out.event("migration.started", f"{mid}: {c.node} needs to move ({c.reason})", migration=mid, node=c.node,
              trigger=c.trigger, reason=c.reason)
    return replace(st, migration=m, next_migration=st.next_migration + 1,
                   unprotected=st.unprotected - {c.node})


_PHASE_TEXT = {
    Phase.PAUSE: "pausing every rank at collective {at} (generation {gen}; {how})",
    Phase.DUMP: "dumping ranks {ranks} on {node}",
    Phase.TRANSFER: "transferring images of ranks {ranks} to {target}",
    Phase.RESTORE: "restoring ranks {ranks} on {target}",
    Phase.KILL_SOURCE: "killing the source copies on {node}",
    Phase.REBUILD: "ranks rebuilding generation {gen} with {ranks} on {target}",
    Phase.DRAIN: "draining {node}",
    Phase.SHRINK: "releasing {node} from the job",
    Phase.ROLLBACK: "rolling back ({why}): resuming on {node}",
}


def _recover_migration(out: _Out, st: CoordState, now: float, policy: CoordinatorPolicy, exc: IllegalTransition
                       ) -> CoordState:
    """End the migration in flight (rolled back to where the ranks can still resume), and resume
    every rank."""
    m = st.migration
    out.event("migration.illegal_transition", f"torchpass bug: {exc}; "
              + ("no migration in flight" if m is None else f"abandoning {m.id} and resuming every rank"),
              migration=exc.migration, src=None if exc.src is None else exc.src.value,
              dst=None if exc.dst is None else exc.dst.value)
    if m is None:
        return st
    if m.paused:
        if m.phase == Phase.REBUILD:  # the source copies are gone: the moved ranks resume on the target
            out.add(Resume(m.id, m.generation, _master(st, None)))
        else:
            if m.target is not None and (m.restored or m.phase in (Phase.RESTORE, Phase.KILL_SOURCE)):
                out.add(AbortRestore(m.id, m.target, tuple(m.ranks)))
            out.add(ResumeInPlace(m.id, m.generation, _master(st, None), f"illegal transition: {exc}"))
        st = replace(st, generation=max(st.generation, m.generation))
    return _finish(out, st, m, now, Result.ABORTED, policy, f"{m.id}: abandoned after a torchpass bug ({exc})",
                   "migration.aborted", checked=False)
