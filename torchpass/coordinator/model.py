"""The decision core's state: what ``decide`` reads and returns (pure data, no I/O).

``CoordState`` is the whole decision state of one job: its ranks (the one
place the coordinator keeps their node and progress), node health, spares,
and at most one ``Migration`` in flight with its phase (torchpass.coordinator.
phases). Closed sets of values are enums; each is a ``StrEnum``, so it
compares equal to, and serialises as, its string value.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torchpass.coordinator.phases import PAUSED_PHASES, Phase, Result
from torchpass.coordinator.relaunch_phases import RelaunchKind, RelaunchPhase
from torchpass.coordinator.snapshot_phases import SnapPhase
from torchpass.health_state import State

if TYPE_CHECKING:  # the contract imports this module; the annotations stay strings
    from torchpass.coordinator.contract import SnapImage, SnapshotCommitted
    from torchpass.coordinator.decide_reroute import RailPlan


class SpareHow(enum.StrEnum):
    """Where a spare came from (and, in RequestSpare, the strategy to get one)."""

    HOT = "hot"  # a node of the allocation kept idle (--torchpass=spares=N)
    EXPAND = "expand"  # allocated by slurmctld and merged into the job
    COMPANION = "companion"  # allocated by slurmctld as a one-node job of its own


class SpareStatus(enum.StrEnum):
    FREE = "free"
    RESERVED = "reserved"  # the target of the migration in flight
    USED = "used"  # ranks moved there
    LOST = "lost"  # failed: never chosen again


class Trigger(enum.StrEnum):
    """Why a migration started."""

    HEALTH = "health"  # tpassd says the node is in a policy.migrate_on state
    STALL = "stall"  # a rank of the node stopped advancing
    FAILSLOW = "failslow"  # the node's ranks compute consistently slower than their peers (decide_failslow)
    OPERATOR = "operator"  # tpassctl migrate


class FailedStep(enum.StrEnum):
    """Which executor step a ``Failure`` reports."""

    DUMP = "dump"
    TRANSFER = "transfer"
    RESTORE = "restore"
    KILL = "kill"


@dataclass(frozen=True)
class NodeHealth:
    """What tpassd (through the health subscriber) says about one node."""

    node: str
    state: State = State.UNKNOWN
    reasons: tuple[str, ...] = ()
    reachable: bool = True  # false: tpassd and the node cannot be reached (no dump possible)
    since: float = 0.0  # coordinator clock when ``state`` last changed
    rails: tuple[tuple[str, str], ...] = ()  # (data rail, its state): tpassd's rail:NAME items


@dataclass(frozen=True)
class RankView:
    """One rank: the coordinator's only record of it (decide reads it; job.status shows it)."""

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
    # Coordinator clock until which its last report waits at the coordinator as a long poll: a
    # command reaches the rank at once until then (None: at its next report).
    listening_until: float | None = None
    # The Slurm task whose tree holds the rank: what tpassd dumps and restores. One task per rank
    # under srun; under torchrun a task is the agent with all its workers (several ranks).
    task: int = -1
    pinned: str = ""  # why the rank's node cannot move ("": it can), e.g. torchrun's store host
    # Its compute time per optimizer step (runtime/compute_time.py), the newest COMPUTE_KEPT steps,
    # oldest first, the last one of step ``compute_step`` (-1: none reported): decide_failslow.
    compute: tuple[float, ...] = ()
    compute_step: int = -1
    # What the rank said of itself, for job.status. Decide reads none of these, so they are left
    # out of comparisons: two states that decide cannot tell apart compare equal.
    pid: int = field(default=0, compare=False)
    generation: int = field(default=0, compare=False)  # the generation it last registered or resumed as
    last_report: float = field(default=0.0, compare=False)  # coordinator clock of its last message of any kind
    last_count: int = field(default=0, compare=False)  # collectives in its last message of any kind


@dataclass(frozen=True)
class SpareView:
    node: str
    how: SpareHow
    status: SpareStatus = SpareStatus.FREE
    # The slurmctld allocation it came from: the donor job merged into this one
    # ("expand"), or the companion job that holds it and runs its restore step.
    allocation: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "how", SpareHow(self.how))
        object.__setattr__(self, "status", SpareStatus(self.status))


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

    step: FailedStep
    why: str
    target_lost: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "step", FailedStep(self.step))


@dataclass(frozen=True)
class Migration:
    id: str
    node: str  # the source (bad) node
    reason: str  # why it moves: health reasons, "rank N stalled", "operator request"
    trigger: Trigger
    ranks: tuple[int, ...]  # the ranks on the source node
    detected: float  # when the trigger was first true
    started: float
    phase: Phase
    phase_started: float
    deadline: float  # the current phase (or spare request) must be done before this
    generation: int  # the generation the ranks are armed for (current + 1)
    requested_to: str | None = None
    target: str | None = None
    target_how: SpareHow | None = None
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
    # rank -> ((source GPU UUID, target GPU UUID), ...): the CUDA restore's remap, for the event
    gpu_pairs: dict[int, tuple[tuple[str, str], ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "trigger", Trigger(self.trigger))

    @property
    def paused(self) -> bool:
        return self.phase in PAUSED_PHASES


@dataclass(frozen=True)
class MigrationRecord:
    """A finished migration (kept for `tpassctl events` and tests)."""

    id: str
    node: str
    target: str | None
    outcome: Result
    reason: str
    phase_durations: dict[str, float]

    def __post_init__(self) -> None:
        object.__setattr__(self, "outcome", Result(self.outcome))


# --- whole-job snapshots (tpassctl snapshot): snapshot_phases.py draws the phases ----------------
SNAP_QUEUED, SNAP_PAUSE, SNAP_DUMP, SNAP_RESUME = SnapPhase.QUEUED, SnapPhase.PAUSE, SnapPhase.DUMP, SnapPhase.RESUME
# `tpassctl snapshot --stop`: after the dump the ranks stay paused while the manifest is written,
# then the job is requeue-held (decide.StopJob); a failure resumes them (SNAP_RESUME) instead.
SNAP_STOP = SnapPhase.STOP


@dataclass(frozen=True)
class SnapshotRun:
    """The whole-job snapshot asked for or in flight (``CoordState.snapshot``)."""

    id: str
    asked: float
    trigger: str = "operator"  # or "periodic" (policy.snapshot_every_s)
    stop: bool = False  # tpassctl snapshot --stop: the job is held once it is saved, its nodes freed
    phase: SnapPhase = SnapPhase.QUEUED
    phase_started: float = 0.0
    deadline: float = 0.0
    generation: int = 0
    pause_at: int | None = None
    pause_estimate: str = ""
    rearms: int = 0
    refused: tuple[tuple[int, int], ...] = ()
    quiesced: frozenset[int] = frozenset()
    first_quiesced: float | None = None
    stood_still_since: float | None = None
    ready_at: float | None = None  # set by machine when the phase's outcomes are all in
    step: int = -1
    ranks: tuple[tuple[int, str], ...] = ()  # (rank, node) when the pause began
    images: dict[int, SnapImage] = field(default_factory=dict)
    dump_durations: dict[str, float] = field(default_factory=dict)
    failure: str | None = None  # why it failed; the ranks still resume
    resumed: frozenset[int] = frozenset()
    resume_attempts: int = 0
    paused_s: float | None = None  # training stood still: the last rank at T to the last resumed
    commit_deadline: float | None = None
    committed: SnapshotCommitted | None = None
    commit_failed: str | None = None
    phase_durations: dict[str, float] = field(default_factory=dict)
    stop_sent: float | None = None  # --stop: when StopJob went out (the job is being requeue-held)
    stop_failed: str | None = None  # --stop: why the job could not be held (it resumed instead)
    # A reroute (decide_reroute.track), not a snapshot: every rank pauses at T and resumes in place
    # on these data rails; nothing is dumped. None: a snapshot.
    rails: tuple[str, ...] | None = None
    rails_before: tuple[str, ...] = ()  # the rails in use before it (a failed reroute keeps them)

    def __post_init__(self) -> None:
        object.__setattr__(self, "phase", SnapPhase(self.phase))


@dataclass(frozen=True)
class SnapshotPoint:
    """The newest whole-job snapshot that completed (its manifest written): a relaunch after a
    lost node restores every rank from it (``CoordState.last_snapshot``)."""

    id: str
    step: int  # optimizer steps done when every rank paused for it (the job's numbering)
    generation: int  # the generation its ranks resume as: a restored copy waits for that resume
    step_offset: int  # CoordState.step_offset then (the ranks' own step counts are in the images)
    world_size: int


@dataclass(frozen=True)
class RelaunchRun:
    """A relaunch of the job's training step (relaunch_phases.py draws its phases): after a node
    was lost outright (decide.Relaunch), until every rank registered again; from a whole-job
    snapshot, until every restored rank registered again and resumed. The resumed run of a job
    stopped with `tpassctl snapshot --stop` starts with one (``kind`` RESUMED_STOP)."""

    count: int  # the job's relaunch number (CoordState.relaunches; 0 for RESUMED_STOP, which is none)
    lost: str
    spare: str
    decided: float  # coordinator clock of the decision (the node was found lost then)
    checkpoint_step: int  # the restore point the relaunched script (or the snapshot) goes on from
    last_step: int  # the newest step any rank reported before the loss (-1: none)
    snapshot: str = ""  # the whole-job snapshot every rank is restored from ("": a checkpoint)
    kind: RelaunchKind = RelaunchKind.LOST_NODE
    phase: RelaunchPhase = RelaunchPhase.REGISTERING
    generation: int = 0  # from a snapshot: the generation its restored ranks resume as
    back: frozenset[int] = frozenset()  # ranks registered again as copies restored from it
    resume_sent: float | None = None  # when the resume went to them (decide resends it)
    resume_attempts: int = 0
    resumed: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", RelaunchKind(self.kind))
        object.__setattr__(self, "phase", RelaunchPhase(self.phase))


@dataclass(frozen=True)
class RankDeath:
    """A rank whose process ended on a live node, as its task wrapper reported it
    (``machine.RankExited``), not decided yet (decide_rank_death)."""

    rank: int
    node: str
    how: str  # "killed by signal 9 (SIGKILL)", "exit code 1"
    at: float  # coordinator clock of the first report
    gpu: int = -1  # the rank's SLURM_LOCALID (its GPU where one GPU per rank), -1: not known


# Per-step compute figures kept per rank: the fail-slow rule's windows (policy.failslow_windows x
# failslow_window_steps) must fit in them.
COMPUTE_KEPT = 128


@dataclass(frozen=True)
class SlowWatch:
    """A node the fail-slow rule finds slow (decide_failslow): since when (coordinator clock), and
    what was measured against what in the newest evaluation."""

    node: str
    since: float
    ratio: float  # the node's compute per step over the peers' median, in the newest window
    node_s: float  # the node's compute per step (its slowest rank's median), newest window
    peers_s: float  # the median of the other nodes' ranks' medians, newest window
    window_steps: int
    windows: int
    last_step: int  # the newest step the windows covered
    ranks: tuple[int, ...] = ()


RANK_NODES_CACHE = "_rank_nodes"  # CoordState.rank_nodes(), kept in the instance's __dict__
PINNED_CACHE = "_pinned_nodes"  # CoordState.pinned_nodes(), found in the same pass
# The lowest RankView.last_advance seen over the ranks (decide.stalled_ranks). A rank's
# last_advance never goes back (machine sets it to the clock's now), and a rank that joins starts
# at now, so the floor of an earlier pass stays a lower bound for every later state.
STALL_FLOOR_CACHE = "_stall_floor"


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
    slurm_down: str | None = None  # why slurmctld is unreachable: no migration starts meanwhile
    # The job cannot be protected ("rank R unprotected: why", from the first rank that said so;
    # machine.RankUnprotected): it never goes away. No migration starts, a pause is rolled back.
    job_unprotected: str | None = None
    unprotected_skipped: frozenset[str] = frozenset()  # nodes not moved because of it (said once each)
    # The whole-job snapshot asked for or in flight (tpassctl snapshot): at most one; no migration starts
    # while it runs, and it is refused while a migration runs or is queued.
    snapshot: SnapshotRun | None = None
    # When the interval to the next periodic snapshot (policy.snapshot_every_s) began: every rank
    # registered, then the end of each snapshot. None until the job is fully registered.
    snapshot_clock: float | None = None
    # The newest application checkpoint reported complete (torchpass.checkpoint): (step, path).
    restore_point: tuple[int, str] | None = None
    # The newest whole-job snapshot that completed (decide relaunches the job from it when a node
    # is lost, when it is at least as new as restore_point).
    last_snapshot: SnapshotPoint | None = None
    relaunches: int = 0  # training-step relaunches decided so far (decide.Relaunch)
    relaunch: RelaunchRun | None = None  # the one whose ranks have not all registered yet
    relaunch_pending: str = ""  # the silent node srun's exit hook was told to wait for ("": none)
    # The job's step is the runtime's count of optimizer steps plus this (a script that went on from
    # a checkpoint numbers its steps from there: machine.CheckpointLoaded).
    step_offset: int = 0
    # Nodes the fail-slow rule finds slow now (decide_failslow.track), and when it last looked:
    # (coordinator clock, the step its newest window ended at).
    slow: dict[str, SlowWatch] = field(default_factory=dict)
    slow_checked: tuple[float, int] | None = None
    # Ranks that died on a live node and are not decided yet (decide_rank_death): their task
    # wrappers hold their exits until then, so that srun decides nothing before the coordinator.
    deaths: tuple[RankDeath, ...] = ()
    # (rank, node) of deaths decided without a relaunch: their wrappers may exit now, as the
    # rank did (the job goes on as it would without torchpass).
    deaths_released: frozenset[tuple[int, str]] = frozenset()
    # Why a death is no longer recovered in this job ("": it is): every later death is released.
    deaths_unrecovered: str = ""
    unexplained_relaunches: int = 0  # relaunches after a death with no hardware fault
    # Data rails (decide_reroute): the job's rails as its ranks registered them (() = none: nothing
    # below is used), the rule's plan, and the rails found unusable at the last look.
    job_rails: tuple[str, ...] = ()
    rail_plan: RailPlan | None = None
    rails_down: frozenset[str] = frozenset()

    def node_health(self, node: str) -> NodeHealth:
        return self.health.get(node) or NodeHealth(node=node, reasons=("no health report",))

    def pinned_nodes(self) -> dict[str, str]:
        """Nodes that cannot move, and why (what their ranks said at registration). Found in
        rank_nodes()'s pass and cached with it; callers must not modify the returned dict."""
        cached = self.__dict__.get(PINNED_CACHE)
        if cached is None:
            self.rank_nodes()
            cached = self.__dict__[PINNED_CACHE]
        return cached

    def task_of(self, rank: int) -> int:
        rv = self.ranks.get(rank)
        return rv.task if rv is not None and rv.task >= 0 else rank

    def rank_nodes(self) -> dict[str, tuple[int, ...]]:
        """Each node's ranks, in rank order. Computed once per state (decide asks several times);
        machine drops it when it updates the ranks of a state in place (a batch of reports).
        Callers must not modify the returned dict."""
        cached = self.__dict__.get(RANK_NODES_CACHE)
        if cached is not None:
            return cached
        out: dict[str, list[int]] = {}
        pinned: dict[str, str] = {}
        for r in sorted(self.ranks):
            rv = self.ranks[r]
            out.setdefault(rv.node, []).append(r)
            if rv.pinned:
                pinned[rv.node] = rv.pinned
        nodes = {n: tuple(rs) for n, rs in out.items()}
        # not fields: frozen, equality and replace() ignore them
        self.__dict__[RANK_NODES_CACHE], self.__dict__[PINNED_CACHE] = nodes, pinned
        return nodes

    def carry_views(self, new: CoordState, *, copied_ranks: bool = False) -> CoordState:
        """``new``, made from this state with the same ranks (dataclasses.replace of other fields;
        ``copied_ranks``: its ranks are a copy of this state's dict), with this state's
        rank_nodes() and pinned_nodes() instead of building them again over every rank (at
        8,192 ranks each build took ~2 ms, on every batch and every health poll), and the
        stall floor (STALL_FLOOR_CACHE)."""
        if new is not self and (copied_ranks or new.ranks is self.ranks):
            for key in (RANK_NODES_CACHE, PINNED_CACHE, STALL_FLOOR_CACHE):
                if key in self.__dict__ and key not in new.__dict__:
                    new.__dict__[key] = self.__dict__[key]
        return new

    def spare(self, node: str | None) -> SpareView | None:
        for s in self.spares:
            if s.node == node:
                return s
        return None

    def all_registered(self) -> bool:
        return bool(self.ranks) and self.world_size is not None and len(self.ranks) >= self.world_size


__all__ = [
    "SpareHow", "SpareStatus", "Trigger", "FailedStep", "NodeHealth", "RankView", "SpareView",
    "OperatorRequest", "Image", "Failure", "Migration", "MigrationRecord", "CoordState", "SnapshotPoint",
    "SNAP_QUEUED", "SNAP_PAUSE", "SNAP_DUMP", "SNAP_RESUME", "SNAP_STOP", "SnapshotRun", "RelaunchRun",
    "SnapPhase", "RelaunchKind", "RelaunchPhase", "SlowWatch", "COMPUTE_KEPT", "RankDeath",
]
