"""The coordinator's decision core: a pure function of (now, state, policy).

Model: torchft's lighthouse. ``decide(now, state, policy)`` reads no clock
and does no I/O; it returns a ``Decision`` with

* ``actions``: what the executor must do now (typed; see ``Action``),
* ``reason``: one human-readable line for the log (log it when it changes;
  it never embeds the time, so it changes only when the decision does),
* ``state``: the next state (phase transitions, deadlines and durations
  recorded). The driver keeps it and applies executor outcomes to it with
  ``machine.apply`` before the next call.

A migration moves every rank of one node to a spare through explicit
phases (``Phase``), one migration per job at a time:

    SPARE -> PAUSE -> DUMP -> TRANSFER -> RESTORE -> KILL_SOURCE -> REBUILD -> DRAIN -> SHRINK
                 \\________\\_______\\_________\\__________/
                                 ROLLBACK (resume in place on the source)

Training is paused from PAUSE to the end of REBUILD (or ROLLBACK). Each of
those phases has a deadline from the policy; an expired deadline or a
failure rolls back while the source copy is still alive (CRIU dumps with
--leave-running semantics, and the source is killed only after every
restore succeeded). Every path that paused the job ends with a Resume or a
ResumeInPlace command: the job is never left paused by torchpass.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any, Union

from torchpass.coordinator.policy import CoordinatorPolicy
from torchpass.health import State


# ============================================================================
# Phases
# ============================================================================
class Phase(str, enum.Enum):
    SPARE = "spare"  # choosing a spare (hot, or asked of slurmctld); training runs
    PAUSE = "pause"  # PauseAt sent; waiting for every rank to quiesce at T
    DUMP = "dump"  # Snapshot sent to tpassd on the source for each moved rank
    TRANSFER = "transfer"  # images made readable on the target
    RESTORE = "restore"  # a job step on the target restores each moved rank
    KILL_SOURCE = "kill_source"  # the source copies (paused, alive) are killed
    REBUILD = "rebuild"  # Resume sent; every rank rebuilds generation g and resumes
    DRAIN = "drain"  # drain the bad node with "torchpass: <reason>"; training runs
    SHRINK = "shrink"  # release the bad node from the job; training runs
    ROLLBACK = "rollback"  # ResumeInPlace sent; every rank resumes on its old node

    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.value


PAUSED_PHASES = frozenset(
    {Phase.PAUSE, Phase.DUMP, Phase.TRANSFER, Phase.RESTORE, Phase.KILL_SOURCE, Phase.REBUILD, Phase.ROLLBACK}
)


# ============================================================================
# Inputs (state)
# ============================================================================
@dataclass(frozen=True)
class NodeHealth:
    """What tpassd (through the health subscriber) says about one node."""

    node: str
    state: State = State.UNKNOWN
    reasons: tuple[str, ...] = ()
    reachable: bool = True  # false: tpassd and the node cannot be reached (no dump possible)
    since: float = 0.0  # coordinator clock when ``state`` last changed


@dataclass(frozen=True)
class RankView:
    rank: int
    node: str
    collectives: int = 0
    step: int = -1
    last_advance: float = 0.0  # coordinator clock when ``collectives`` last grew
    # For choosing T (see pause_point); set by machine from progress reports.
    reported_at: float | None = None  # coordinator clock of the last progress report
    report_gap: float = 0.0  # seconds between its progress reports (smoothed)
    rate: float = 0.0  # collectives per second (smoothed; 0: not known yet)
    rate_base: tuple[float, int] | None = None  # (time, collectives) the next rate sample starts from
    boundary: int = -1  # collectives issued when its last optimizer step ended (-1: not reported)
    boundary_step: int = -1  # the step that ended there
    per_step: int = 0  # collectives per optimizer step, from two boundaries (0: not known)


@dataclass(frozen=True)
class SpareView:
    node: str
    how: str  # "hot" | "expand" | "companion"
    status: str = "free"  # "free" | "reserved" (target of the migration) | "used" | "lost"
    # The slurmctld allocation it came from: the donor job merged into this one
    # ("expand"), or the companion job that holds it and runs its restore step.
    allocation: int | None = None


@dataclass(frozen=True)
class OperatorRequest:
    id: str  # the migration id it will run as
    node: str
    to: str | None
    at: float


@dataclass(frozen=True)
class Image:
    rank: int
    path: str
    checksum: str


@dataclass(frozen=True)
class Failure:
    """An executor outcome said a step failed; ``decide`` acts on it."""

    step: str  # "dump" | "transfer" | "restore" | "kill"
    why: str
    target_lost: bool = False


@dataclass(frozen=True)
class Migration:
    id: str
    node: str  # the source (bad) node
    reason: str  # why it moves: health reasons, "rank N stalled", "operator request"
    trigger: str  # "health" | "stall" | "operator"
    ranks: tuple[int, ...]  # the ranks on the source node
    detected: float  # when the trigger was first true
    started: float
    phase: Phase
    phase_started: float
    deadline: float  # the current phase (or spare request) must be done before this
    generation: int  # the generation the ranks are armed for (current + 1)
    requested_to: str | None = None
    target: str | None = None
    target_how: str | None = None
    tried: tuple[str, ...] = ()  # targets given up on (lost)
    spare_requested: str | None = None  # strategy of the outstanding RequestSpare
    spare_failures: tuple[tuple[str, str], ...] = ()  # (strategy, why)
    pause_at: int | None = None
    pause_estimate: str = ""  # how T was chosen (for the event)
    rearms: int = 0
    refused: tuple[tuple[int, int], ...] = ()  # (rank, collectives) that refused PauseAt(T)
    quiesced: frozenset[int] = frozenset()
    images: dict[int, Image] = field(default_factory=dict)  # dumped, on the source side
    transferred: dict[int, Image] = field(default_factory=dict)  # readable on the target
    restored: frozenset[int] = frozenset()
    source_killed: bool = False
    resumed: frozenset[int] = frozenset()
    failure: Failure | None = None
    rollback_reason: str | None = None
    resume_attempts: int = 0
    paused_since: float | None = None  # PauseAt sent (ranks train on until they reach T)
    # Training stands still: the last rank reached T (or, for a rollback before
    # every rank did, the first one). "paused" in phase_durations runs from here.
    first_quiesced: float | None = None
    stood_still_since: float | None = None
    ready_at: float | None = None  # when the phase's completion condition became true (set by machine)
    notes: tuple[str, ...] = ()  # drain/shrink problems (training already runs)
    drain_done: bool = False
    shrink_done: bool = False
    phase_durations: dict[str, float] = field(default_factory=dict)
    tool_durations: dict[str, float] = field(default_factory=dict)  # reported by tpassd/restore (max over ranks)

    @property
    def paused(self) -> bool:
        return self.phase in PAUSED_PHASES


@dataclass(frozen=True)
class MigrationRecord:
    """A finished migration (kept for `tpassctl events` and tests)."""

    id: str
    node: str
    target: str | None
    outcome: str  # "completed" | "rolled_back" | "no_spare" | "cancelled" | "source_lost" | "stuck" | "rejected"
    reason: str
    phase_durations: dict[str, float]


@dataclass(frozen=True)
class CoordState:
    job_id: int
    world_size: int | None = None
    ranks: dict[int, RankView] = field(default_factory=dict)
    health: dict[str, NodeHealth] = field(default_factory=dict)
    spares: tuple[SpareView, ...] = ()
    generation: int = 0  # the process-group generation every rank runs now
    migration: Migration | None = None
    operator_requests: tuple[OperatorRequest, ...] = ()
    deferred: dict[str, float] = field(default_factory=dict)  # node -> no automatic migration before
    unprotected: frozenset[str] = frozenset()  # nodes deferred because no spare could be had
    failures: dict[str, int] = field(default_factory=dict)  # node -> failed migrations
    given_up: frozenset[str] = frozenset()
    handed: frozenset[str] = frozenset()  # handed to Slurm (lost outright)
    released: frozenset[str] = frozenset()  # migrated away and shrunk out of the job
    next_migration: int = 1
    history: tuple[MigrationRecord, ...] = ()

    def node_health(self, node: str) -> NodeHealth:
        return self.health.get(node) or NodeHealth(node=node, reasons=("no health report",))

    def rank_nodes(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, list[int]] = {}
        for r in sorted(self.ranks):
            out.setdefault(self.ranks[r].node, []).append(r)
        return {n: tuple(rs) for n, rs in out.items()}

    def spare(self, node: str | None) -> SpareView | None:
        for s in self.spares:
            if s.node == node:
                return s
        return None

    def all_registered(self) -> bool:
        return bool(self.ranks) and self.world_size is not None and len(self.ranks) >= self.world_size


# ============================================================================
# Actions (what the executor performs; each feeds back outcomes, see machine.py)
# ============================================================================
@dataclass(frozen=True)
class RequestSpare:
    """Obtain a spare node from slurmctld with this strategy ("expand" | "companion").
    Outcome: SpareGranted(migration, node, how) or SpareUnavailable(migration, strategy, why)."""

    migration: str
    strategy: str
    for_node: str


@dataclass(frozen=True)
class PauseAt:
    """Tell every rank: pause with exactly ``at`` collectives issued, to rebuild as
    ``generation``. Ranks in ``hold_ranks`` close every socket after quiescing and
    wait to be dumped. Outcomes: Armed(rank, ...) (refusals matter), Quiesced(rank, ...)."""

    migration: str
    at: int
    generation: int
    hold_ranks: tuple[int, ...]


@dataclass(frozen=True)
class Snapshot:
    """tpassd on ``node``: CUDA checkpoint + CRIU dump of ``rank``, leaving it running
    (paused). Outcome: SnapshotDone(migration, rank, image, checksum, durations) or
    SnapshotFailed(migration, rank, why)."""

    migration: str
    rank: int
    node: str


@dataclass(frozen=True)
class Transfer:
    """Make ``image`` readable on ``target`` (a no-op on a shared filesystem: answer at
    once). Outcome: TransferDone(migration, rank, target, image, checksum, durations) or
    TransferFailed(migration, rank, target, why, target_lost)."""

    migration: str
    rank: int
    image: str
    checksum: str
    source: str
    target: str


@dataclass(frozen=True)
class Restore:
    """A job step on ``target`` restores ``rank`` from ``image`` (it stays paused,
    holding). Outcome: RestoreDone(migration, rank, target, durations) or
    RestoreFailed(migration, rank, target, why, target_lost)."""

    migration: str
    rank: int
    target: str
    image: str
    checksum: str


@dataclass(frozen=True)
class AbortRestore:
    """Kill whatever was restored of ``ranks`` on ``target`` (best effort: the target
    may be dead). No outcome needed."""

    migration: str
    target: str
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class KillSource:
    """Kill the paused source copies of ``ranks`` on ``node`` (all restores succeeded).
    Outcome: SourceKilled(migration, node) or KillFailed(migration, node, why)."""

    migration: str
    node: str
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Resume:
    """Every rank (the moved ones at their new node) rebuilds its group as
    ``generation`` with the rendezvous hosted on ``master`` (the node of rank 0; the
    executor picks the address and port). Outcome: Resumed(rank, generation, ...)."""

    migration: str
    generation: int
    master: str


@dataclass(frozen=True)
class ResumeInPlace:
    """Roll back: every rank resumes where it is (the source copies included) as
    ``generation`` (a rank not yet torn down simply cancels its pause).
    Outcome: Resumed(rank, generation, cancelled=...)."""

    migration: str
    generation: int
    master: str
    why: str


@dataclass(frozen=True)
class Drain:
    """scontrol drain ``node`` with ``reason`` ("torchpass: ..."). Outcome: Drained or DrainFailed."""

    migration: str
    node: str
    reason: str


@dataclass(frozen=True)
class Shrink:
    """Release ``nodes`` from the job (scontrol update NodeList=<the rest>).
    Outcome: Shrunk or ShrinkFailed."""

    migration: str
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class HandToSlurm:
    """The node is lost with no clean dump possible: leave it to Slurm's normal
    behaviour (no torchpass action beyond the event). No outcome needed."""

    node: str
    reason: str


@dataclass(frozen=True)
class Event:
    """Record in the job's event log (`tpassctl events`)."""

    kind: str
    message: str
    data: dict[str, Any] = field(default_factory=dict)


Action = Union[
    RequestSpare, PauseAt, Snapshot, Transfer, Restore, AbortRestore, KillSource,
    Resume, ResumeInPlace, Drain, Shrink, HandToSlurm, Event,
]


@dataclass(frozen=True)
class Decision:
    actions: tuple[Action, ...]
    reason: str
    state: CoordState


# ============================================================================
# Helpers
# ============================================================================
class _Out:
    def __init__(self) -> None:
        self.actions: list[Action] = []

    def add(self, *acts: Action) -> None:
        self.actions.extend(acts)

    def event(self, kind: str, message: str, **data: Any) -> None:
        self.actions.append(Event(kind, message, data))


def _r(x: float) -> float:
    return round(x, 3)


def _lost(h: NodeHealth) -> bool:
    return h.state == State.FAILED and not h.reachable


def _health_text(h: NodeHealth) -> str:
    return "; ".join(h.reasons) if h.reasons else h.state.value


def spare_usable(st: CoordState, sp: SpareView, policy: CoordinatorPolicy) -> bool:
    if sp.status != "free" or sp.node in st.handed:
        return False
    h = st.node_health(sp.node)
    if policy.spare_requires_healthy:
        return h.state == State.HEALTHY
    return h.state in (State.HEALTHY, State.UNKNOWN)


def _pick_spare(st: CoordState, m: Migration, policy: CoordinatorPolicy) -> SpareView | None:
    allowed_hot = "hot" in policy.spare_strategies
    order = {s: i for i, s in enumerate(policy.spare_strategies)}
    usable = [
        sp for sp in st.spares
        if spare_usable(st, sp, policy) and sp.node not in m.tried and sp.node != m.node
        and (sp.how != "hot" or allowed_hot)
    ]
    usable.sort(key=lambda sp: (order.get(sp.how, 99), sp.node))
    return usable[0] if usable else None


def _set_spare(st: CoordState, node: str | None, status: str) -> CoordState:
    if node is None or st.spare(node) is None:
        return st
    return replace(st, spares=tuple(replace(s, status=status) if s.node == node else s for s in st.spares))


def _target_lost(st: CoordState, m: Migration) -> bool:
    if m.target is None:
        return False
    sp = st.spare(m.target)
    return (sp is not None and sp.status == "lost") or st.node_health(m.target).state == State.FAILED


def _source_lost(st: CoordState, m: Migration) -> bool:
    return _lost(st.node_health(m.node))


def _master(st: CoordState, moved: Migration | None) -> str:
    if not st.ranks:
        return moved.target if moved and moved.target else ""
    first = min(st.ranks)
    if moved is not None and first in moved.ranks and moved.target:
        return moved.target
    return st.ranks[first].node


def stalled_ranks(now: float, st: CoordState, policy: CoordinatorPolicy) -> list[RankView]:
    """Ranks behind another rank's collective count that have not advanced for stall_s."""
    if policy.stall_s <= 0 or len(st.ranks) < 2:
        return []
    top = max(r.collectives for r in st.ranks.values())
    return [
        r for _, r in sorted(st.ranks.items())
        if r.collectives < top and now - r.last_advance >= policy.stall_s
    ]


@dataclass(frozen=True)
class Candidate:
    node: str
    reason: str
    trigger: str
    detected: float


def candidates(now: float, st: CoordState, policy: CoordinatorPolicy) -> list[Candidate]:
    """Nodes that need an automatic migration, oldest first (excludes the one in flight)."""
    busy = {st.migration.node} if st.migration else set()
    busy |= {r.node for r in st.operator_requests}
    skip = busy | set(st.handed) | set(st.released) | set(st.given_up)
    found: dict[str, Candidate] = {}
    nodes = st.rank_nodes()
    for node in sorted(nodes):
        if node in skip or st.deferred.get(node, float("-inf")) > now:
            continue
        h = st.node_health(node)
        if _lost(h) or h.state.value not in policy.migrate_on:
            continue  # unknown and healthy never trigger; lost is handed to Slurm
        found[node] = Candidate(node, _health_text(h), "health", h.since)
    for r in stalled_ranks(now, st, policy):
        if r.node in skip or r.node in found or st.deferred.get(r.node, float("-inf")) > now:
            continue
        if _lost(st.node_health(r.node)):
            continue
        found[r.node] = Candidate(r.node, f"rank {r.rank} stalled", "stall", r.last_advance + policy.stall_s)
    return sorted(found.values(), key=lambda c: (c.detected, c.node))


def check_operator_request(st: CoordState, node: str, to: str | None) -> tuple[str, str] | None:
    """Why `tpassctl migrate` must be refused, as (wire error code, message); None if fine."""
    nodes = st.rank_nodes()
    if node not in nodes:
        return "not_found", (
            f"node {node} runs no rank of job {st.job_id} (its nodes: {', '.join(sorted(nodes)) or 'none registered'})"
        )
    if node in st.handed:
        return "conflict", f"node {node} was lost and handed to Slurm; it cannot be migrated"
    if (st.migration is not None and st.migration.node == node) or any(r.node == node for r in st.operator_requests):
        return "conflict", f"a migration of {node} is already in flight or queued"
    if to is not None:
        if to == node:
            return "bad_request", f"--to {to} is the node being migrated"
        sp = st.spare(to)
        if sp is None:
            spares = ", ".join(s.node for s in st.spares) or "none"
            return "not_found", f"node {to} is not a spare of job {st.job_id} (spares: {spares})"
        if sp.status != "free":
            return "conflict", f"spare {to} is {sp.status}, not free"
    if not st.all_registered():
        return "conflict", (
            f"job {st.job_id} has {len(st.ranks)}/{st.world_size or '?'} ranks registered; "
            "a migration needs every rank to be reachable"
        )
    return None


def phase_complete(st: CoordState, m: Migration) -> bool:
    """The completion condition of the current phase (used by machine for ready_at)."""
    everyone = set(st.ranks)
    if m.phase == Phase.PAUSE:
        return bool(everyone) and everyone <= m.quiesced
    if m.phase == Phase.DUMP:
        return set(m.ranks) <= set(m.images)
    if m.phase == Phase.TRANSFER:
        return set(m.ranks) <= set(m.transferred)
    if m.phase == Phase.RESTORE:
        return set(m.ranks) <= m.restored
    if m.phase == Phase.KILL_SOURCE:
        return m.source_killed
    if m.phase in (Phase.REBUILD, Phase.ROLLBACK):
        return bool(everyone) and everyone <= m.resumed
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
    return replace(m, phase=phase, phase_started=now, deadline=deadline, ready_at=None,
                   phase_durations=_close_phase(m, now), **changes)


def _finish(out: _Out, st: CoordState, m: Migration, now: float, outcome: str, policy: CoordinatorPolicy,
            message: str, kind: str) -> CoordState:
    durations = _close_phase(m, now)
    durations["total"] = _r(now - m.started)
    if "paused" not in durations and m.paused:
        since = _stood_still(m)
        durations["paused"] = _r(now - since) if since is not None else 0.0
    m = replace(m, phase_durations=durations)
    if m.target is not None:
        sp = st.spare(m.target)
        if sp is not None and sp.status == "reserved":
            st = _set_spare(st, m.target, "used" if outcome == "completed" else "free")
    rec = MigrationRecord(m.id, m.node, m.target, outcome, m.reason, durations)
    st = replace(st, migration=None, history=(st.history + (rec,))[-50:])
    data: dict[str, Any] = {"migration": m.id, "node": m.node, "target": m.target, "outcome": outcome,
                            "phase_durations": durations}
    if m.tool_durations:
        data["tool_durations"] = dict(m.tool_durations)
    if m.pause_at is not None:
        data["pause_at"] = m.pause_at
        data["pause_estimate"] = m.pause_estimate
    out.event(kind, message, **data)
    if outcome in ("completed", "cancelled", "source_lost", "rejected"):
        return st
    if outcome == "no_spare":
        return replace(st, deferred={**st.deferred, m.node: now + policy.spare_retry_s},
                       unprotected=st.unprotected | {m.node})
    # rolled_back / stuck: count the failure; back off, then try again or give up.
    n = st.failures.get(m.node, 0) + 1
    st = replace(st, failures={**st.failures, m.node: n},
                 deferred={**st.deferred, m.node: now + policy.retry_backoff_s})
    if n >= policy.max_attempts_per_node and m.node not in st.given_up and m.trigger != "operator":
        st = replace(st, given_up=st.given_up | {m.node})
        out.event("migration.abandoned",
                  f"{m.node}: {n} migrations failed; torchpass stops trying (tpassctl migrate can still try)",
                  node=m.node, failures=n)
    return st


# ============================================================================
# Rollback and loss
# ============================================================================
def _rollback(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy, why: str) -> CoordState:
    if _source_lost(st, m):
        return _job_lost(out, st, m, now, policy, f"{why}, and {m.node} is lost")
    if m.target is not None and (m.restored or m.phase in (Phase.RESTORE, Phase.KILL_SOURCE)):
        out.add(AbortRestore(m.id, m.target, tuple(m.ranks)))
    if m.target is not None:
        sp = st.spare(m.target)
        if sp is not None and sp.status == "reserved":
            st = _set_spare(st, m.target, "free")
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
    return _finish(out, st, m, now, "source_lost", policy,
                   f"{m.id}: {m.node} was lost ({why}); no clean dump possible: handed to Slurm", "node.lost")


def _replace_target(out: _Out, st: CoordState, m: Migration, policy: CoordinatorPolicy, why: str
                    ) -> tuple[CoordState, Migration | None]:
    """The target died: mark it lost and take the next free spare, if allowed."""
    lost = m.target
    st = _set_spare(st, lost, "lost")
    tried = m.tried + ((lost,) if lost else ())
    m = replace(m, tried=tried, target=None, target_how=None)
    if len(tried) >= policy.max_spare_attempts:
        return st, None
    sp = _pick_spare(st, m, policy)
    if sp is None:
        return st, None
    st = _set_spare(st, sp.node, "reserved")
    out.event("spare.replaced", f"{m.id}: spare {lost} lost ({why}); continuing with {sp.node} ({sp.how})",
              migration=m.id, lost=lost, target=sp.node, how=sp.how)
    return st, replace(m, target=sp.node, target_how=sp.how)


# ============================================================================
# The phases
# ============================================================================
def pause_point(now: float, ranks: dict[int, RankView], policy: CoordinatorPolicy,
                floor: int = 0) -> tuple[int, str]:
    """T: the smallest collective count every rank can still reach, and how it was chosen.

    A rank learns of the pause in the reply to its next progress report:
    ``report_gap`` after its last one (or at once if that is already
    overdue), plus ``pause_slack_s`` for the decision and the reply. Until
    then it keeps issuing collectives at the job's rate (every rank issues
    the same collectives, so the fastest measured rate is the job's). T =
    max over ranks of that estimate + ``pause_margin_collectives``. When the
    ranks report optimizer-step boundaries a fixed number of collectives
    apart, T is rounded up to the next boundary: the ranks then stop between
    two steps, with no gradient all-reduce in flight. Without a rate (too few
    reports) T = max reported + ``pause_fallback_collectives``. ``floor``:
    T is at least this (a re-arm after refusals).
    """
    views = list(ranks.values())
    top = max([r.collectives for r in views] + [floor, 0])
    rate = max((r.rate for r in views), default=0.0)
    if rate <= 0:
        return top + policy.pause_fallback_collectives, (
            f"no rate measured yet: max reported {top} + {policy.pause_fallback_collectives}")
    reach = top
    if floor > 0:  # a count seen just now (a refusal): that rank learns of the new T one report later
        reach = floor + int(-(-rate * (max((r.report_gap for r in views), default=0.0) + policy.pause_slack_s) // 1))
    for r in views:
        since = now - r.reported_at if r.reported_at is not None else 0.0
        horizon = max(since, r.report_gap) + policy.pause_slack_s
        reach = max(reach, r.collectives + int(-(-rate * horizon // 1)))  # ceil
    at = reach + policy.pause_margin_collectives
    how = f"max reported {top}, {rate:.1f} collectives/s, reachable {reach}, + {policy.pause_margin_collectives}"
    per = {r.per_step for r in views}
    b = max(views, key=lambda r: r.boundary) if views else None
    if len(per) == 1 and b is not None and b.boundary >= 0 and b.per_step > 0:
        k = -(-(at - b.boundary) // b.per_step)
        aligned = b.boundary + max(0, k) * b.per_step
        if aligned >= at:
            how += f", rounded up to a step boundary ({b.per_step} collectives/step)"
            at = aligned
    return at, how


def _start_pause(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy) -> CoordState:
    at, how = pause_point(now, st.ranks, policy)
    out.add(PauseAt(m.id, at, m.generation, m.ranks))
    m = _enter(m, Phase.PAUSE, now, now + policy.pause_timeout_s, pause_at=at, pause_estimate=how,
               paused_since=now, first_quiesced=None, stood_still_since=None, quiesced=frozenset(), refused=())
    return replace(st, migration=m)


def _advance_spare(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy) -> CoordState:
    if m.trigger == "health":
        h = st.node_health(m.node)
        if h.state.value not in policy.migrate_on and not _lost(h):
            return _finish(out, st, m, now, "cancelled", policy,
                           f"{m.id}: {m.node} is {h.state.value} again before anything was paused; not moving it",
                           "migration.cancelled")
    if m.trigger == "stall" and not any(r.node == m.node for r in stalled_ranks(now, st, policy)):
        return _finish(out, st, m, now, "cancelled", policy,
                       f"{m.id}: the ranks on {m.node} advance again before anything was paused; not moving it",
                       "migration.cancelled")
    if m.requested_to is not None:
        sp = st.spare(m.requested_to)
        if sp is None or not spare_usable(st, sp, policy):
            state = "unknown" if sp is None else (sp.status if sp.status != "free" else st.node_health(sp.node).state.value)
            return _finish(out, st, m, now, "rejected", policy,
                           f"{m.id}: requested target {m.requested_to} is not usable ({state}); nothing was paused",
                           "migration.rejected")
        chosen: SpareView | None = sp
    else:
        chosen = _pick_spare(st, m, policy)
    if chosen is not None:
        st = _set_spare(st, chosen.node, "reserved")
        origin = {"expand": f", allocation {chosen.allocation} merged into job {st.job_id}",
                  "companion": f", companion allocation {chosen.allocation}"}.get(chosen.how, "")
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
    pending = [s for s in st.spares if s.status == "free" and s.how != "hot" and s.node not in m.tried
               and st.node_health(s.node).state == State.UNKNOWN]
    if pending and now < m.deadline:
        return st
    asked = {s for s, _ in m.spare_failures}
    for strategy in policy.spare_strategies:
        if strategy == "hot" or strategy in asked:
            continue
        out.add(RequestSpare(m.id, strategy, m.node))
        out.event("spare.requested", f"{m.id}: no hot spare for {m.node}; asking slurmctld ({strategy})",
                  migration=m.id, node=m.node, strategy=strategy)
        m = replace(m, spare_requested=strategy, deadline=now + policy.spare_timeout_s)
        return replace(st, migration=m)
    tried = "; ".join(f"{s}: {w}" for s, w in m.spare_failures) or "no strategy allowed by the policy"
    hot = "no free hot spare" if "hot" in policy.spare_strategies else "hot spares not allowed by the policy"
    return _finish(out, st, m, now, "no_spare", policy,
                   f"{m.id}: no spare for {m.node} ({hot}; {tried}); training continues on {m.node} unprotected",
                   "spare.unavailable")


def _advance(out: _Out, st: CoordState, now: float, policy: CoordinatorPolicy) -> CoordState:
    m = st.migration
    assert m is not None
    ph = m.phase
    if ph == Phase.SPARE:
        if _source_lost(st, m):
            return _job_lost(out, st, m, now, policy, "failed and unreachable")
        return _advance_spare(out, st, m, now, policy)

    # --- the source node died -------------------------------------------------------
    if _source_lost(st, m):
        saved = set(m.ranks) <= set(m.images)
        if ph in (Phase.PAUSE, Phase.ROLLBACK) or (ph == Phase.DUMP and not saved):
            return _job_lost(out, st, m, now, policy, "failed and unreachable before its ranks were saved")
        if ph == Phase.KILL_SOURCE and not m.source_killed:
            m = replace(m, source_killed=True, ready_at=now if m.ready_at is None else m.ready_at)  # its copies died with it
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
        return _finish(out, st, m, now, "stuck", policy,
                       f"{m.id}: target {m.target} failed after the source copies were killed; handed to Slurm",
                       "job.stuck")

    done = phase_complete(st, m)
    if ph == Phase.PAUSE:
        if done:
            for r in m.ranks:
                out.add(Snapshot(m.id, r, m.node))
            # Training stands still from the moment the last rank reached T.
            m = replace(m, stood_still_since=m.ready_at if m.ready_at is not None else now)
            return replace(st, migration=_enter(m, Phase.DUMP, now, now + policy.dump_timeout_s))
        if m.refused:
            if m.rearms < policy.max_pause_rearms:
                top = max([c for _, c in m.refused] + [m.pause_at or 0])
                at, how = pause_point(now, st.ranks, policy, floor=top)
                out.add(PauseAt(m.id, at, m.generation, m.ranks))
                out.event("pause.rearmed", f"{m.id}: rank(s) {[r for r, _ in m.refused]} were past collective "
                          f"{m.pause_at}; pausing at {at} instead", migration=m.id, at=at)
                m = replace(m, pause_at=at, pause_estimate=how, refused=(), quiesced=frozenset(),
                            first_quiesced=None, rearms=m.rearms + 1, deadline=now + policy.pause_timeout_s)
                return replace(st, migration=m)
            return _rollback(out, st, m, now, policy,
                             f"ranks {[r for r, _ in m.refused]} were past the pause point {m.rearms + 1} times")
        if now >= m.deadline:
            missing = sorted(set(st.ranks) - m.quiesced)
            return _rollback(out, st, m, now, policy,
                             f"pause timed out after {policy.pause_timeout_s:g}s: ranks {missing} did not quiesce "
                             f"at collective {m.pause_at}")
        return st

    if ph == Phase.DUMP:
        if m.failure is not None:
            return _rollback(out, st, m, now, policy, f"dump failed: {m.failure.why}")
        if done:
            st = replace(st, migration=m)
            return _start_transfer(out, st, m, now, policy)
        if now >= m.deadline:
            missing = sorted(set(m.ranks) - set(m.images))
            return _rollback(out, st, m, now, policy,
                             f"dump timed out after {policy.dump_timeout_s:g}s (ranks {missing})")
        return st

    if ph == Phase.TRANSFER:
        if m.failure is not None:
            return _rollback(out, st, m, now, policy, f"transfer failed: {m.failure.why}")
        if done:
            for r in m.ranks:
                img = m.transferred[r]
                out.add(Restore(m.id, r, m.target or "", img.path, img.checksum))
            return replace(st, migration=_enter(m, Phase.RESTORE, now, now + policy.restore_timeout_s))
        if now >= m.deadline:
            return _rollback(out, st, m, now, policy, f"transfer timed out after {policy.transfer_timeout_s:g}s")
        return st

    if ph == Phase.RESTORE:
        if m.failure is not None:
            return _rollback(out, st, m, now, policy, f"restore on {m.target} failed: {m.failure.why}")
        if done:
            out.add(KillSource(m.id, m.node, m.ranks))
            return replace(st, migration=_enter(m, Phase.KILL_SOURCE, now, now + policy.kill_timeout_s))
        if now >= m.deadline:
            missing = sorted(set(m.ranks) - m.restored)
            return _rollback(out, st, m, now, policy,
                             f"restore on {m.target} timed out after {policy.restore_timeout_s:g}s (ranks {missing})")
        return st

    if ph == Phase.KILL_SOURCE:
        if m.failure is not None:
            return _rollback(out, st, m, now, policy, f"could not kill the source copies: {m.failure.why}")
        if m.source_killed or done:
            # The moved ranks now live on the target.
            ranks = {**st.ranks}
            for r in m.ranks:
                if r in ranks:
                    ranks[r] = replace(ranks[r], node=m.target or ranks[r].node)
            st = replace(st, ranks=ranks)
            out.add(Resume(m.id, m.generation, _master(st, None)))
            m = _enter(m, Phase.REBUILD, now, now + policy.rebuild_timeout_s, resumed=frozenset(), resume_attempts=1)
            return replace(st, migration=m)
        if now >= m.deadline:
            return _rollback(out, st, m, now, policy,
                             f"the source copies on {m.node} were not killed within {policy.kill_timeout_s:g}s")
        return st

    if ph in (Phase.REBUILD, Phase.ROLLBACK):
        if done:
            end = m.ready_at if m.ready_at is not None else now
            since = _stood_still(m)
            durations = {**m.phase_durations, "paused": _r(max(0.0, end - since)) if since is not None else 0.0}
            m = replace(m, phase_durations=durations)
            st = replace(st, generation=max(st.generation, m.generation))
            if ph == Phase.ROLLBACK:
                return _finish(out, st, m, now, "rolled_back", policy,
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
            return _finish(out, st, m, now, "stuck", policy,
                           f"{m.id}: ranks {missing} did not resume after {m.resume_attempts} resume commands; "
                           "handed to Slurm", "job.stuck")
        return st

    if ph == Phase.DRAIN:
        if done or now >= m.deadline:
            if not done:
                m = replace(m, notes=m.notes + (f"drain of {m.node} not confirmed in {policy.finalize_timeout_s:g}s",))
            out.add(Shrink(m.id, (m.node,)))
            return replace(st, migration=_enter(m, Phase.SHRINK, now, now + policy.finalize_timeout_s))
        return st

    if ph == Phase.SHRINK:
        if done or now >= m.deadline:
            if not done:
                m = replace(m, notes=m.notes + (f"shrink not confirmed in {policy.finalize_timeout_s:g}s",))
            st = replace(st, released=st.released | {m.node},
                         unprotected=st.unprotected - {m.node})
            notes = f" ({'; '.join(m.notes)})" if m.notes else ""
            # Say what happened to the node: a shrink that failed leaves it in the job.
            kept = any(n.startswith(("shrink failed", "shrink not confirmed")) for n in m.notes)
            return _finish(out, st, m, now, "completed", policy,
                           f"{m.id}: moved ranks {list(m.ranks)} from {m.node} to {m.target}; {m.node} drained and "
                           f"{'kept in the job' if kept else 'released'}{notes}", "migration.completed")
        return st
    raise AssertionError(f"unhandled phase {ph}")  # pragma: no cover


def _start_transfer(out: _Out, st: CoordState, m: Migration, now: float, policy: CoordinatorPolicy) -> CoordState:
    for r in m.ranks:
        img = m.images[r]
        out.add(Transfer(m.id, r, img.path, img.checksum, m.node, m.target or ""))
    m = _enter(m, Phase.TRANSFER, now, now + policy.transfer_timeout_s, transferred={}, restored=frozenset(),
               failure=None)
    return replace(st, migration=m)


# ============================================================================
# Starting migrations, lost nodes
# ============================================================================
def _handle_lost(out: _Out, st: CoordState, now: float, policy: CoordinatorPolicy) -> CoordState:
    m = st.migration
    # Spares that died are never chosen again.
    for sp in st.spares:
        if sp.status in ("free", "reserved") and st.node_health(sp.node).state == State.FAILED:
            st = _set_spare(st, sp.node, "lost")
            out.event("spare.lost", f"spare {sp.node} failed ({_health_text(st.node_health(sp.node))})",
                      node=sp.node)
    involved = {m.node, m.target} if m else set()
    for node in sorted(st.rank_nodes()):
        if node in st.handed or node in st.released or node in involved:
            continue
        h = st.node_health(node)
        if not _lost(h):
            continue
        reason = f"torchpass: {node} failed outright ({_health_text(h)}); no clean dump possible"
        out.add(HandToSlurm(node, reason))
        out.event("node.lost", f"{node} failed and is unreachable ({_health_text(h)}): no clean dump possible; "
                  "handed to Slurm's normal handling", node=node)
        st = replace(st, handed=st.handed | {node},
                     operator_requests=tuple(r for r in st.operator_requests if r.node != node))
        if st.migration is not None and st.migration.paused and st.migration.phase != Phase.ROLLBACK \
                and st.migration.phase != Phase.REBUILD:
            st = _rollback(out, st, st.migration, now, policy, f"{node} (not part of the move) was lost")
    return st


def _new_migration(st: CoordState, now: float, *, mid: str, node: str, reason: str, trigger: str,
                   detected: float, to: str | None, policy: CoordinatorPolicy) -> Migration:
    return Migration(
        id=mid, node=node, reason=reason, trigger=trigger, ranks=st.rank_nodes().get(node, ()),
        detected=detected, started=now, phase=Phase.SPARE, phase_started=now,
        deadline=now + policy.spare_timeout_s, generation=st.generation + 1, requested_to=to,
        phase_durations={"detect": _r(max(0.0, now - detected))},
    )


def _start_next(out: _Out, st: CoordState, now: float, policy: CoordinatorPolicy) -> CoordState:
    if not st.all_registered():
        return st
    while st.operator_requests:
        req, rest = st.operator_requests[0], st.operator_requests[1:]
        st = replace(st, operator_requests=rest)
        if req.node not in st.rank_nodes() or req.node in st.handed:
            out.event("migration.rejected", f"{req.id}: {req.node} no longer runs ranks of the job; dropped",
                      migration=req.id, node=req.node)
            continue
        m = _new_migration(st, now, mid=req.id, node=req.node, reason="operator request", trigger="operator",
                           detected=req.at, to=req.to, policy=policy)
        out.event("migration.started", f"{m.id}: operator asked to move {req.node}"
                  + (f" to {req.to}" if req.to else ""), migration=m.id, node=req.node, to=req.to,
                  trigger="operator")
        return replace(st, migration=m)
    cands = candidates(now, st, policy)
    if not cands:
        return st
    c = cands[0]
    mid = f"m{st.next_migration}"
    m = _new_migration(st, now, mid=mid, node=c.node, reason=c.reason, trigger=c.trigger,
                       detected=c.detected, to=None, policy=policy)
    out.event("migration.started", f"{mid}: {c.node} needs to move ({c.reason})", migration=mid, node=c.node,
              trigger=c.trigger, reason=c.reason)
    return replace(st, migration=m, next_migration=st.next_migration + 1,
                   unprotected=st.unprotected - {c.node})


# ============================================================================
# Reasons
# ============================================================================
_PHASE_TEXT = {
    Phase.PAUSE: "pausing every rank at collective {at} (generation {gen})",
    Phase.DUMP: "dumping ranks {ranks} on {node}",
    Phase.TRANSFER: "transferring images of ranks {ranks} to {target}",
    Phase.RESTORE: "restoring ranks {ranks} on {target}",
    Phase.KILL_SOURCE: "killing the source copies on {node}",
    Phase.REBUILD: "ranks rebuilding generation {gen} with {ranks} on {target}",
    Phase.DRAIN: "draining {node}",
    Phase.SHRINK: "releasing {node} from the job",
    Phase.ROLLBACK: "rolling back ({why}): resuming on {node}",
}


def _reason(now: float, st: CoordState, policy: CoordinatorPolicy) -> str:
    parts: list[str] = []
    m = st.migration
    if m is not None:
        if m.phase == Phase.SPARE:
            text = (f"waiting for a {m.spare_requested} spare from slurmctld" if m.spare_requested
                    else "waiting for a granted spare to report healthy")
        else:
            text = _PHASE_TEXT[m.phase].format(at=m.pause_at, gen=m.generation, ranks=list(m.ranks), node=m.node,
                                               target=m.target, why=m.rollback_reason)
        parts.append(f"{m.id} {m.node} -> {m.target or '?'} ({m.reason}): {text}")
        queued = [r.node for r in st.operator_requests] + [c.node for c in candidates(now, st, policy)]
        if queued:
            parts.append(f"queued: {', '.join(queued)}")
    else:
        if not st.all_registered():
            parts.append(f"waiting for ranks to register ({len(st.ranks)}/{st.world_size or '?'})")
        else:
            parts.append("no migration needed")
    nodes = st.rank_nodes()
    unknown = sorted(n for n in nodes if st.node_health(n).state == State.UNKNOWN and n not in st.handed)
    if unknown:
        parts.append(f"health unknown (not a reason to move): {', '.join(unknown)}")
    unprot = sorted(n for n in st.unprotected if n in nodes and n not in st.handed)
    if unprot:
        parts.append(f"no spare, running unprotected: {', '.join(unprot)}")
    if st.given_up:
        parts.append(f"given up on: {', '.join(sorted(st.given_up))}")
    if st.handed:
        parts.append(f"handed to Slurm: {', '.join(sorted(st.handed))}")
    return "; ".join(parts)


# ============================================================================
# decide
# ============================================================================
def decide(now: float, state: CoordState, policy: CoordinatorPolicy) -> Decision:
    """What to do now. Pure: reads nothing but its arguments."""
    out = _Out()
    st = _handle_lost(out, state, now, policy)
    for _ in range(32):  # a few transitions can happen in one call (SPARE -> PAUSE)
        if st.migration is None:
            nxt = _start_next(out, st, now, policy)
            if nxt is st:
                break
            st = nxt
            continue
        nxt = _advance(out, st, now, policy)
        if nxt is st:
            break
        st = nxt
    return Decision(tuple(out.actions), _reason(now, st, policy), st)


__all__ = [
    "Phase", "PAUSED_PHASES", "NodeHealth", "RankView", "SpareView", "OperatorRequest", "Image", "Failure",
    "Migration", "MigrationRecord", "CoordState", "RequestSpare", "PauseAt", "Snapshot", "Transfer", "Restore",
    "AbortRestore", "KillSource", "Resume", "ResumeInPlace", "Drain", "Shrink", "HandToSlurm", "Event",
    "Action", "Decision", "decide", "candidates", "stalled_ranks", "check_operator_request", "phase_complete",
    "spare_usable", "pause_point",
]
