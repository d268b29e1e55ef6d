"""The whole-job snapshot machine: one handler per phase of ``snapshot_phases.SnapPhase``.

A snapshot saves every rank of the job and leaves it running
(snapshot_phases.py draws every edge). PAUSE: every rank pauses at the same
collective T (PauseAt, every rank held: a held rank closes its coordinator
link, so CRIU finds no socket). DUMP: every rank is dumped in parallel by
its node's tpassd into the snapshot's own directory. RESUME: every rank
resumes in place as the next generation (ResumeInPlace) while rank 0's
tpassd verifies the images and writes the job manifest (CommitSnapshot),
which then keeps the newest policy.snapshot_keep snapshots. STOP (``tpassctl
snapshot --stop``): the ranks stay paused until the manifest is written,
then the job is requeue-held. A failure or a timeout resumes every rank and
removes what was written. At most one snapshot runs, never beside a
migration (``decide.next_machine``). Every phase change goes through
``_snap_enter`` and every end through ``snapshot_phases.check_result``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torchpass.coordinator import snapshot_phases
from torchpass.coordinator.contract import (
    CommitSnapshot,
    DiscardSnapshot,
    DumpRank,
    HandToSlurm,
    PauseAt,
    ResumeInPlace,
    StopJob,
)
from torchpass.coordinator.decide_common import (
    _everyone_in,
    _lost,
    _Out,
    _pause_overdue,
    _r,
    in_place_master,
    pause_point,
)
from torchpass.coordinator.decide_reroute import reroute_ended
from torchpass.coordinator.model import (
    CoordState,
    SnapshotPoint,
    SnapshotRun,
)
from torchpass.coordinator.phases import (
    IllegalTransition,
)
from torchpass.coordinator.policy import (
    CoordinatorPolicy,
)
from torchpass.coordinator.snapshot_phases import (
    PAUSED_SNAP_PHASES,
    SnapPhase,
    SnapResult,
)


def check_snapshot_request(st: CoordState) -> tuple[str, str] | None:
    """Why `tpassctl snapshot` must be refused, as (wire error code, message); None if fine."""
    if st.job_unprotected is not None:
        return "conflict", f"job is unprotected: {st.job_unprotected}; torchpass cannot snapshot it"
    if st.snapshot is not None:
        return "conflict", f"snapshot {st.snapshot.id} of job {st.job_id} is already in flight; try again after it"
    if st.migration is not None or st.operator_requests:
        what = st.migration.id if st.migration is not None else st.operator_requests[0].id
        return "conflict", f"migration {what} of job {st.job_id} is in flight or queued; snapshot after it ends"
    lost = st.handed.intersection(st.rank_nodes())  # a relaunch left its lost node behind: not these
    if lost:
        return "conflict", f"node(s) {', '.join(sorted(lost))} of job {st.job_id} were lost; no snapshot"
    if not st.all_registered():
        return "conflict", (f"job {st.job_id} has {len(st.ranks)}/{st.world_size or '?'} ranks registered; "
                            "a snapshot needs every rank")
    if st.relaunch is not None and st.relaunch.snapshot:
        return "conflict", (f"job {st.job_id} is being restored from snapshot {st.relaunch.snapshot}; snapshot "
                            "after it resumed")
    if st.slurm_down:
        return "unavailable", f"slurmctld is unreachable ({st.slurm_down}); tpassd needs it to check the ranks"
    pinned = st.pinned_nodes()
    if pinned or any(rv.task not in (-1, r) for r, rv in st.ranks.items()):
        return "conflict", (f"job {st.job_id} runs several ranks per task (torchrun): whole-job snapshots of "
                            "such jobs are not covered yet; live migration is")
    return None


def periodic_snapshot_due(now: float, st: CoordState, policy: CoordinatorPolicy) -> bool:
    """A periodic snapshot (policy.snapshot_every_s) is to be asked for now: that long since the job
    was fully registered or the last snapshot ended, and one would be accepted. One that cannot
    (a migration runs, a rank is missing) waits until it can: the interval bounds the steps a
    restore recomputes, so a late snapshot is taken as soon as possible, never skipped."""
    every = policy.snapshot_every_s
    return (every > 0 and st.snapshot is None and st.snapshot_clock is not None
            and now - st.snapshot_clock >= every and check_snapshot_request(st) is None)


def snapshot_phase_complete(st: CoordState, s: SnapshotRun) -> bool:
    """The completion condition of the snapshot's phase (machine stamps ready_at with it)."""
    if s.phase == SnapPhase.PAUSE:
        return _everyone_in(st, s.quiesced)
    if s.phase == SnapPhase.DUMP:
        return {r for r, _ in s.ranks} <= set(s.images)
    if s.phase == SnapPhase.RESUME:
        return _everyone_in(st, s.resumed)
    if s.phase == SnapPhase.STOP:
        return s.committed is not None
    return False


def _snap_enter(s: SnapshotRun, phase: SnapPhase, now: float, deadline: float, **changes: Any) -> SnapshotRun:
    """``s`` in ``phase`` from ``now``: every phase change goes through here and the table."""
    snapshot_phases.check_transition(s.id, s.phase, phase)
    d = dict(s.phase_durations)
    if s.phase != SnapPhase.QUEUED:
        end = s.ready_at if s.ready_at is not None else now
        d[s.phase.value] = _r(d.get(s.phase.value, 0.0) + max(0.0, end - s.phase_started))
    return replace(s, phase=phase, phase_started=now, deadline=deadline, ready_at=None, phase_durations=d,
                   **changes)


def _snap_step_at(st: CoordState, at: int) -> int:
    """The optimizer steps done when every rank has issued ``at`` collectives (the ranks' step
    boundaries, when T is one of them; else the highest step a rank reported)."""
    views = list(st.ranks.values())
    b = max(views, key=lambda r: r.boundary) if views else None
    if b is not None and b.boundary >= 0 and b.per_step > 0 and at >= b.boundary \
            and (at - b.boundary) % b.per_step == 0:
        return b.boundary_step + (at - b.boundary) // b.per_step
    return max((r.step for r in views), default=-1)


def _snap_fail(out: _Out, st: CoordState, s: SnapshotRun, now: float, policy: CoordinatorPolicy,
               why: str) -> CoordState:
    """Every rank resumes in place; what was written is removed; the run ends once they resumed."""
    out.add(ResumeInPlace(s.id, s.generation, in_place_master(st), f"snapshot {s.id} failed: {why}"))
    nodes = tuple(sorted({n for _, n in s.ranks}))
    if nodes and s.rails is None:  # a reroute wrote nothing
        out.add(DiscardSnapshot(s.id, nodes))
    s = _snap_enter(s, SnapPhase.RESUME, now, now + policy.rebuild_timeout_s, failure=why, resumed=frozenset(),
                    resume_attempts=1, commit_deadline=None)
    return replace(st, snapshot=s)


def _snap_end(out: _Out, st: CoordState, s: SnapshotRun, now: float, policy: CoordinatorPolicy) -> CoordState:
    """Every rank resumed and the manifest is settled: the event, and the snapshot is no longer in flight."""
    d = dict(s.phase_durations)
    d[SnapPhase.RESUME.value] = _r(d.get(SnapPhase.RESUME.value, 0.0) + max(0.0, (s.ready_at or now) - s.phase_started))
    d["total"] = _r(now - s.asked)
    paused = s.paused_s if s.paused_s is not None else 0.0
    d["paused"] = paused
    data: dict[str, Any] = {"snapshot": s.id, "trigger": s.trigger, "step": s.step, "pause_at": s.pause_at,
                            "generation": s.generation, "pause_s": paused, "phase_durations": d}
    if s.dump_durations:
        data["tool_durations"] = dict(s.dump_durations)
    why = s.failure or s.commit_failed
    if s.rails is not None:
        return reroute_ended(out, st, s, now, why, paused, data)
    last = st.last_snapshot
    snapshot_phases.check_result(s.id, s.phase, SnapResult.COMPLETED if why is None and s.committed is not None
                                 else SnapResult.FAILED)
    if why is None and s.committed is not None:
        c = s.committed
        last = _snapshot_point(st, s)
        out.event("snapshot.completed", f"snapshot {s.id} of job {st.job_id} at step {s.step}: {len(s.images)} "
                  f"ranks, {c.bytes / 1e6:.1f} MB; training stood still {paused:.2f}s"
                  + (f"; removed older snapshot(s) {', '.join(c.removed)}" if c.removed else ""),
                  bytes=c.bytes, manifest=c.manifest, removed=list(c.removed), ranks=len(s.images), **data)
    else:
        if why is None:
            why = "no manifest was written"
        out.event("snapshot.failed", f"snapshot {s.id} of job {st.job_id} failed: {why}; every rank resumed "
                  f"after {paused:.2f}s", why=why, **data)
    return replace(st, snapshot=None, generation=max(st.generation, s.generation), snapshot_clock=now,
                   last_snapshot=last)


def _snapshot_step(out: _Out, st: CoordState, now: float, policy: CoordinatorPolicy) -> CoordState:
    """One transition of the snapshot in flight (``st.snapshot``), or none: a lost node or an
    unprotected job fails a snapshot whose ranks are paused (before the job is held), then the
    phase's handler acts."""
    s = st.snapshot
    assert s is not None
    if s.phase in (SnapPhase.PAUSE, SnapPhase.DUMP) or (s.phase == SnapPhase.STOP and s.stop_sent is None):
        nodes = {n for _, n in s.ranks} or set(st.rank_nodes())
        lost = sorted(n for n in nodes if n in st.handed or _lost(st.node_health(n)))
        if lost:
            return _snap_fail(out, st, s, now, policy, f"node(s) {', '.join(lost)} lost")
        if st.job_unprotected is not None:
            return _snap_fail(out, st, s, now, policy, f"the job is unprotected ({st.job_unprotected})")
    return _SNAP_HANDLERS[s.phase](out, st, s, now, policy, snapshot_phase_complete(st, s))


def _on_queued(out: _Out, st: CoordState, s: SnapshotRun, now: float, policy: CoordinatorPolicy, done: bool
               ) -> CoordState:
    """Asked for: pause every rank at one collective T, or end it not taken if it is refused now."""
    why = check_snapshot_request(replace(st, snapshot=None))
    if why is not None and s.rails is not None:
        return reroute_ended(out, st, s, now, why[1], 0.0, {"snapshot": s.id})
    if why is not None:
        snapshot_phases.check_result(s.id, s.phase, SnapResult.NOT_TAKEN)
        out.event("snapshot.failed", f"snapshot {s.id} of job {st.job_id} not taken: {why[1]}",
                  snapshot=s.id, why=why[1])
        return replace(st, snapshot=None)
    at, how = pause_point(now, st.ranks, policy)
    ranks = tuple((r, v.node) for r, v in sorted(st.ranks.items()))
    if s.rails is not None:  # a reroute: nobody is held for a dump
        out.add(PauseAt(s.id, at, st.generation + 1, ()))
        out.event("link.rerouting", f"{s.id}: pausing every rank at collective {at} to rebuild on data rails "
                  f"{', '.join(s.rails)}", snapshot=s.id, pause_at=at, rails=list(s.rails))
    else:
        out.add(PauseAt(s.id, at, st.generation + 1, tuple(r for r, _ in ranks)))
        out.event("snapshot.started", f"snapshot {s.id}: pausing every rank at collective {at}",
                  snapshot=s.id, pause_at=at, pause_estimate=how)
    s = _snap_enter(s, SnapPhase.PAUSE, now, now + policy.pause_timeout_s, generation=st.generation + 1,
                    pause_at=at, pause_estimate=how, ranks=ranks)
    return replace(st, snapshot=s)


def _on_pause(out: _Out, st: CoordState, s: SnapshotRun, now: float, policy: CoordinatorPolicy, done: bool
              ) -> CoordState:
    """Every rank quiesced at T: dump them all. Refusals re-arm a later T; a timeout fails it."""
    if done and s.rails is not None:  # a reroute: every rank rebuilds in place on the new rails
        stood = s.ready_at if s.ready_at is not None else now
        out.add(ResumeInPlace(s.id, s.generation, in_place_master(st), f"{s.id}: onto {', '.join(s.rails)}",
                              rails=s.rails))
        s = _snap_enter(s, SnapPhase.RESUME, now, now + policy.rebuild_timeout_s, stood_still_since=stood,
                        resumed=frozenset(), resume_attempts=1, commit_deadline=None)
        return replace(st, snapshot=s)
    if done:
        stood = s.ready_at if s.ready_at is not None else now
        for r, node in s.ranks:
            out.add(DumpRank(s.id, r, node, s.generation, policy.snapshot_keep))
        s = _snap_enter(s, SnapPhase.DUMP, now, now + policy.dump_timeout_s, stood_still_since=stood,
                        step=_snap_step_at(st, s.pause_at or 0))
        return replace(st, snapshot=s)
    hold = () if s.rails is not None else tuple(r for r, _ in s.ranks)  # a reroute holds nobody
    rearmed, why = _pause_overdue(out, st, s, now, policy, hold, f"snapshot {s.id}", snapshot=s.id)
    if rearmed is not None:
        return replace(st, snapshot=rearmed)
    return _snap_fail(out, st, s, now, policy, why) if why is not None else st


def _on_dump(out: _Out, st: CoordState, s: SnapshotRun, now: float, policy: CoordinatorPolicy, done: bool
             ) -> CoordState:
    """Every rank dumped: write the manifest, and resume every rank meanwhile (with --stop: hold
    them paused until the manifest is written). A failure or the deadline fails it."""
    if s.failure is not None:
        return _snap_fail(out, st, s, now, policy, s.failure)
    if not done:
        if now >= s.deadline:
            missing = sorted({r for r, _ in s.ranks} - set(s.images))
            return _snap_fail(out, st, s, now, policy,
                              f"dump timed out after {policy.dump_timeout_s:g}s (ranks {missing})")
        return st
    master = in_place_master(st)
    images = tuple(s.images[r] for r, _ in s.ranks)
    commit = CommitSnapshot(s.id, master, s.step, s.generation, s.pause_at or 0, images, policy.snapshot_keep)
    if s.stop:  # the ranks stay paused until the manifest is written and the job held
        out.add(commit)
        s = _snap_enter(s, SnapPhase.STOP, now, now + policy.dump_timeout_s,
                        commit_deadline=now + policy.dump_timeout_s)
        return replace(st, snapshot=s)
    out.add(ResumeInPlace(s.id, s.generation, master, f"snapshot {s.id} taken"))
    out.add(commit)
    s = _snap_enter(s, SnapPhase.RESUME, now, now + policy.rebuild_timeout_s, resumed=frozenset(),
                    resume_attempts=1, commit_deadline=now + policy.dump_timeout_s)
    return replace(st, snapshot=s)


def _on_resume(out: _Out, st: CoordState, s: SnapshotRun, now: float, policy: CoordinatorPolicy, done: bool
               ) -> CoordState:
    """The ranks resume in place while the manifest is written: the snapshot ends once both are
    settled. Ranks that do not resume are asked again, then handed to Slurm."""
    if done and s.paused_s is None:
        since = s.stood_still_since if s.stood_still_since is not None else s.first_quiesced
        end = s.ready_at if s.ready_at is not None else now
        s = replace(s, paused_s=_r(max(0.0, end - since)) if since is not None else 0.0)
        st = replace(st, snapshot=s)
    if not done:
        return _resume_overdue(out, st, s, now, policy) if now >= s.deadline else st
    if s.failure is not None or s.rails is not None:  # a reroute writes no manifest
        return _snap_end(out, st, s, now, policy)
    if s.committed is None and s.commit_failed is None:
        if s.commit_deadline is not None and now >= s.commit_deadline:
            s = replace(s, commit_failed=f"the job manifest was not written within {policy.dump_timeout_s:g}s")
        else:
            return st
    if s.commit_failed is not None:
        out.add(DiscardSnapshot(s.id, tuple(sorted({n for _, n in s.ranks}))))
    return _snap_end(out, st, s, now, policy)


def _resume_overdue(out: _Out, st: CoordState, s: SnapshotRun, now: float, policy: CoordinatorPolicy
                    ) -> CoordState:
    """RESUME past its deadline: ask the missing ranks again, or hand their nodes to Slurm and end."""
    missing = sorted(set(st.ranks) - s.resumed)
    if s.resume_attempts < policy.max_resume_attempts:
        out.add(ResumeInPlace(s.id, s.generation, in_place_master(st), f"snapshot {s.id}: resume again",
                              rails=s.rails if s.rails is not None and s.failure is None else ()))
        out.event("resume.retried", f"snapshot {s.id}: ranks {missing} did not resume; asking again",
                  snapshot=s.id, missing=missing)
        return replace(st, snapshot=replace(s, resume_attempts=s.resume_attempts + 1,
                                            deadline=now + policy.rebuild_timeout_s))
    for node in sorted({st.ranks[r].node for r in missing if r in st.ranks}):
        if node not in st.handed:
            out.add(HandToSlurm(node, f"torchpass: ranks on {node} did not resume after snapshot {s.id}"))
            st = replace(st, handed=st.handed | {node})
    out.event("job.stuck", f"snapshot {s.id}: ranks {missing} did not resume after {s.resume_attempts} "
              "resume commands; handed to Slurm", snapshot=s.id, missing=missing)
    s = replace(s, failure=s.failure or f"ranks {missing} did not resume")
    return _snap_end(out, st, s, now, policy)


def _on_stop(out: _Out, st: CoordState, s: SnapshotRun, now: float, policy: CoordinatorPolicy, done: bool
             ) -> CoordState:
    """`tpassctl snapshot --stop` after the dump: once the manifest is written, hold the job
    (StopJob); if the manifest or the hold fails, every rank resumes and the job goes on."""
    if s.stop_failed is not None:  # the job could not be held: the snapshot stays, training goes on
        out.event("job.stop_failed", f"job {st.job_id} could not be stopped after snapshot {s.id} ({s.stop_failed}); "
                  "every rank resumes and the job goes on", snapshot=s.id, why=s.stop_failed)
        out.add(ResumeInPlace(s.id, s.generation, in_place_master(st), f"snapshot {s.id}: the stop failed"))
        s = _snap_enter(s, SnapPhase.RESUME, now, now + policy.rebuild_timeout_s, resumed=frozenset(),
                        resume_attempts=1,
                        commit_deadline=None)
        return replace(st, snapshot=s)
    if s.commit_failed is not None:
        return _snap_fail(out, st, s, now, policy, f"the job manifest was not written ({s.commit_failed})")
    if s.committed is None:
        if now >= (s.commit_deadline or s.deadline):
            return _snap_fail(out, st, s, now, policy, f"the job manifest was not written within "
                              f"{policy.dump_timeout_s:g}s")
        return st
    if s.stop_sent is not None:
        return st  # the job is being requeue-held: every process of it, this coordinator too, ends
    since = s.stood_still_since if s.stood_still_since is not None else s.first_quiesced
    c = s.committed
    d = dict(s.phase_durations)
    d["total"] = _r(now - s.asked)
    out.event("job.stopping", f"snapshot {s.id} of job {st.job_id} at step {s.step} is complete ({len(s.images)} "
              f"ranks, {c.bytes / 1e6:.1f} MB): the job is held now and its nodes freed; "
              f"'tpassctl resume {st.job_id}' brings it back, every rank restored from it",
              snapshot=s.id, trigger=s.trigger, step=s.step, generation=s.generation, bytes=c.bytes,
              manifest=c.manifest, removed=list(c.removed), ranks=len(s.images), stop=True,
              paused_s=_r(now - since) if since is not None else None, phase_durations=d)
    nodes = tuple(sorted({n for _, n in s.ranks}))
    out.add(StopJob(s.id, s.step, s.generation, len(s.ranks), st.step_offset, nodes))
    return replace(st, snapshot=replace(s, stop_sent=now), last_snapshot=_snapshot_point(st, s))


# One handler per phase, as snapshot_phases draws them.
_SNAP_HANDLERS = {
    SnapPhase.QUEUED: _on_queued,
    SnapPhase.PAUSE: _on_pause,
    SnapPhase.DUMP: _on_dump,
    SnapPhase.STOP: _on_stop,
    SnapPhase.RESUME: _on_resume,
}


def snapshot_reason(st: CoordState) -> str | None:
    """The reason line's part for the snapshot in flight."""
    s = st.snapshot
    if s is None:
        return None
    text = {SnapPhase.QUEUED: "starting", SnapPhase.PAUSE: f"pausing every rank at collective {s.pause_at}",
            SnapPhase.DUMP: f"dumping ranks {sorted(r for r, _ in s.ranks)}",
            SnapPhase.RESUME: "resuming every rank" + (f" ({s.failure})" if s.failure else ", writing the manifest"),
            SnapPhase.STOP: "writing the manifest, then holding the job (--stop)" if s.stop_sent is None
            else "the job is being held (--stop)"}
    return f"snapshot {s.id}: {text.get(s.phase, s.phase)}"


def _snapshot_point(st: CoordState, s: SnapshotRun) -> SnapshotPoint:
    return SnapshotPoint(s.id, s.step, s.generation, st.step_offset, len(s.ranks))


def _committed(st: CoordState) -> CoordState:
    """``st`` with the snapshot in flight as its newest complete one if its manifest is written
    (the ranks were still resuming): retention may already have removed the one before it."""
    s = st.snapshot
    if s is None or s.committed is None or s.failure is not None or s.commit_failed is not None:
        return st
    return replace(st, last_snapshot=_snapshot_point(st, s))


def _end_snapshot_for_relaunch(out: _Out, st: CoordState, lost: set[str]) -> CoordState:
    """A node was lost while a whole-job snapshot ran and the job is relaunched: the snapshot ends
    here (its ranks are ended with their step; a complete one is kept, else what was written on
    the surviving nodes is removed)."""
    s = st.snapshot
    if s is None:
        return st
    snapshot_phases.check_result(s.id, s.phase, SnapResult.RELAUNCHED)
    st = _committed(st)
    if st.last_snapshot is not None and st.last_snapshot.id == s.id:
        out.event("snapshot.completed", f"snapshot {s.id} of job {st.job_id} at step {s.step}: complete (its manifest "
                  f"is written) when {', '.join(sorted(lost))} was lost; the job is relaunched from it",
                  snapshot=s.id, trigger=s.trigger, step=s.step, generation=s.generation, ranks=len(s.ranks),
                  bytes=s.committed.bytes if s.committed else 0, manifest=s.committed.manifest if s.committed else "",
                  removed=list(s.committed.removed) if s.committed else [], pause_s=s.paused_s)
    else:
        nodes = tuple(sorted({n for _, n in s.ranks} - lost))
        if nodes and s.failure is None:  # a failed one's images are being removed already (_snap_fail)
            out.add(DiscardSnapshot(s.id, nodes))
        out.event("snapshot.failed", f"snapshot {s.id} of job {st.job_id} failed: node(s) {', '.join(sorted(lost))} "
                  "lost while it ran; the job is relaunched from its newest complete restore point",
                  snapshot=s.id, trigger=s.trigger, why=f"node(s) {', '.join(sorted(lost))} lost", step=s.step)
    return replace(st, snapshot=None)


def _recover_snapshot(out: _Out, st: CoordState, now: float, exc: IllegalTransition) -> CoordState:
    """Roll the snapshot in flight back: every rank resumes in place, what was written is removed,
    and it ends as failed (snapshot.failed names the bug). No rank is left paused."""
    s = st.snapshot
    why = f"torchpass bug: {exc}"
    if s is None:
        out.event("snapshot.failed", f"{why}; no snapshot in flight", why=why, outcome=SnapResult.ABORTED)
        return st
    if s.phase in PAUSED_SNAP_PHASES:
        out.add(ResumeInPlace(s.id, s.generation, in_place_master(st), f"snapshot {s.id} aborted: {why}"))
        nodes = tuple(sorted({n for _, n in s.ranks}))
        if nodes:
            out.add(DiscardSnapshot(s.id, nodes))
        st = replace(st, generation=max(st.generation, s.generation))
    out.event("snapshot.failed", f"snapshot {s.id} of job {st.job_id} failed: {why}; every rank resumes in place "
              "and what was written is removed", snapshot=s.id, trigger=s.trigger, why=why, step=s.step,
              outcome=SnapResult.ABORTED, phase=s.phase.value)
    return replace(st, snapshot=None, snapshot_clock=now)
