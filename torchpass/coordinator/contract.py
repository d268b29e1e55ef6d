"""The executor's contract: the actions ``decide`` asks for and the outcomes that come back.

Actions (``Action``) are what the executor performs; each docstring names the
outcome(s) it posts. Outcomes (``Outcome``) are facts that ``machine.apply``
records: the rank runtime's reports (registered, progress, armed, quiesced,
resumed), the health subscriber's changes, the operator's requests, and the
results of the executor's actions. Pure data: importing this loads no I/O
library.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from torchpass.coordinator.model import SpareHow
from torchpass.health_state import State


# ============================================================================
# Actions (what the executor performs)
# ============================================================================
@dataclass(frozen=True)
class RequestSpare:
    """Obtain a spare node from slurmctld with this strategy (SpareHow.EXPAND or .COMPANION).
    Outcome: SpareGranted(migration, node, how) or SpareUnavailable(migration, strategy, why)."""

    migration: str
    strategy: SpareHow
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
class MigrationDump:
    """tpassd on ``node``: CUDA checkpoint + CRIU dump of ``rank``, leaving it running
    (paused). Outcome: MigrationDumpDone(migration, rank, image, checksum, durations) or
    MigrationDumpFailed(migration, rank, why)."""

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
    rails: tuple[str, ...] = ()  # a reroute: rebuild on these data rails (the resume's "rails")


@dataclass(frozen=True)
class Drain:
    """Ask ``node``'s own tpassd to drain it (``tpassd.drain``) with ``reason`` ("torchpass: ...");
    tpassd does it as root only on its own evidence (docs/tpassd.md, "Drains"). Outcome: Drained or
    DrainFailed."""

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
    behaviour (no torchpass action beyond the event and the drain). No outcome needed.

    ``end_job``: the node was lost outright and the job cannot be relaunched: after the drain,
    do what slurmctld does to a job without ``--no-kill`` when it marks one of its nodes DOWN
    (requeue a requeueable batch job, else end its steps on the node), so that a job submitted
    with ``--no-kill`` for torchpass's relaunch does not hang instead (docs/coordinator.md)."""

    node: str
    reason: str
    end_job: bool = False
    # The node still answers and is at fault (a GPU failed under a rank: decide_rank_death): its
    # own tpassd drains it, on its own health evidence. Otherwise only a node lost outright is
    # drained (through another node's tpassd).
    drain_live: bool = False


@dataclass(frozen=True)
class Relaunch:
    """A node of the job is lost outright and the job has a restore point (an application checkpoint
    that torchpass.checkpoint reported complete, or a whole-job snapshot): start the job's training
    step again on the surviving nodes with the spare in the lost node's place. The executor rewrites
    the job's host file (the lost node's lines name the spare) and writes the relaunch verdict that
    srun's exit hook (the SPANK plugin) reads: the user's srun, ended by Slurm for the node failure,
    execs itself again with its own arguments and environment, and the job script's srun takes the
    relaunched step's exit status. No outcome: the relaunched ranks register."""

    count: int  # relaunches decided in this job so far, this one included
    replaced: tuple[tuple[str, str], ...]  # (lost node, the spare in its place)
    checkpoint_step: int
    # Relaunch from this whole-job snapshot ("": from the application checkpoint): the verdict
    # says snapshot=ID, and the relaunched srun's tasks restore their ranks from it instead of
    # starting the program (the SPANK plugin's rank_wrapper --restore-snapshot).
    snapshot: str = ""
    # Nodes whose steps the relaunch ends and starts again besides the replaced ones: where a
    # rank died (a relaunch on the same nodes replaces none).
    ended_on: tuple[str, ...] = ()
    # What ended the step (RelaunchKind's value): "lost_node", or "rank_died" on a live node; the
    # verdict carries it, and srun's exit hook says it.
    cause: str = "lost_node"


@dataclass(frozen=True)
class StopJob:
    """`tpassctl snapshot --stop`: snapshot ``snapshot`` is complete (its manifest written) and every
    rank waits paused. The executor writes the job's stop marker (layout.stopped_file: the
    snapshot, the Slurm step of the ranks, and what the resumed run's coordinator needs) and
    requeue-holds the job: every process of it ends and its nodes are free. Outcome on failure:
    JobStopFailed (the ranks then resume); on success none (the coordinator ends with the job)."""

    snapshot: str
    snapshot_step: int  # optimizer steps done when the ranks paused (the job's numbering)
    generation: int  # the generation the restored ranks resume as
    world_size: int
    step_offset: int
    nodes: tuple[str, ...]  # the nodes of the ranks (the Slurm step to restore is the one on them)


@dataclass(frozen=True)
class ForgetStopped:
    """The resumed job's ranks all resumed from the stopped snapshot: remove the stop marker, so
    that a later requeue of the job starts it afresh, as Slurm would."""

    snapshot: str


@dataclass(frozen=True)
class RelaunchPossible:
    """Tell srun's exit hook whether to wait for a verdict on a lost node: ``pending`` while a
    node of the job is silent and a relaunch could follow (a srun ending meanwhile waits for the
    verdict instead of exiting), cleared when that is no longer so. The file keeps the count of the
    relaunches carried out (their host file written). No outcome."""

    pending: bool
    node: str = ""


@dataclass(frozen=True)
class Event:
    """Record in the job's event log (`tpassctl events`)."""

    kind: str
    message: str
    data: dict[str, Any] = field(default_factory=dict)


# --- whole-job snapshots (tpassctl snapshot) ----------------------------------------
@dataclass(frozen=True)
class DumpRank:
    """tpassd on ``node``: CRIU dump of the quiesced, held ``rank`` into job snapshot ``snapshot``
    (layout.snapshot_images_dir), leaving it running; no hand-off marker (nothing moves).
    Outcome: RankDumped or RankDumpFailed. ``keep``: the snapshots of the job that retention
    keeps (tpassd refuses the dump before writing when the rank alone would take its owner past
    the snapshot quota, counting that retention)."""

    snapshot: str
    rank: int
    node: str
    generation: int
    keep: int = 1


@dataclass(frozen=True)
class SnapImage:
    """One rank's part of a job snapshot, as its node's tpassd reported it."""

    rank: int
    node: str
    images: str
    checksum: str
    bytes: int


@dataclass(frozen=True)
class CommitSnapshot:
    """tpassd on ``node`` (rank 0's) verifies every rank's images (root-written manifest, checksum),
    writes the job manifest, then keeps the newest ``keep`` complete snapshots of the job.
    Outcome: SnapshotCommitted or SnapshotCommitFailed."""

    snapshot: str
    node: str
    step: int
    generation: int
    collectives: int
    ranks: tuple[SnapImage, ...]
    keep: int


@dataclass(frozen=True)
class DiscardSnapshot:
    """Remove what a failed snapshot wrote (each node's tpassd, best effort). No outcome."""

    snapshot: str
    nodes: tuple[str, ...]


Action = Union[
    RequestSpare, PauseAt, MigrationDump, Transfer, Restore, AbortRestore, KillSource,
    Resume, ResumeInPlace, Drain, Shrink, HandToSlurm, Relaunch, RelaunchPossible, Event, DumpRank, CommitSnapshot,
    DiscardSnapshot, StopJob, ForgetStopped,
]


# ============================================================================
# Inputs from the job (rank runtime) and health subscriber
# ============================================================================
@dataclass(frozen=True)
class RankRegistered:
    rank: int
    node: str
    world_size: int
    pid: int = 0
    generation: int = 0
    task: int = -1  # the Slurm task whose tree holds the rank (-1: the rank itself)
    pinned: str = ""  # why the rank's node cannot move ("": it can)
    restored: str = ""  # a copy restored from this whole-job snapshot (a relaunch from it)


@dataclass(frozen=True)
class RankProgress:
    rank: int
    collectives: int
    step: int = -1
    node: str | None = None
    # collectives issued when optimizer step ``boundary_step`` ended (-1: not reported)
    boundary: int = -1
    boundary_step: int = -1
    # > 0: the report is a long poll, parked at the coordinator for up to this many seconds;
    # until then a command reaches the rank at once (decide.pause_point)
    wait_s: float = 0.0
    # the rank's compute time of each step ended since its last answered report (oldest first),
    # and its step count at the last of them (-1: none): decide_failslow compares them
    compute: tuple[float, ...] = ()
    compute_step: int = -1


@dataclass(frozen=True)
class CheckpointCompleted:
    """torchpass.checkpoint reported an application checkpoint of ``step`` complete (rank 0,
    after its torchpass.json was written): the job's newest restore point."""

    step: int
    path: str


@dataclass(frozen=True)
class RankExited:
    """The task wrapper of ``rank`` on ``node`` saw its rank's process end abnormally (an exit code
    other than 0, or a signal; ``how`` says which) and holds its own exit until the coordinator
    decided (decide_rank_death). ``gpu``: the task's SLURM_LOCALID (-1: not known)."""

    rank: int
    node: str
    how: str
    gpu: int = -1


@dataclass(frozen=True)
class CheckpointLoaded:
    """Rank 0 loaded the application checkpoint of ``step`` (the job goes on from it) when its
    runtime had counted ``steps_then`` optimizer steps: the job's step numbering is the runtime's
    count plus ``step - steps_then`` from now on."""

    step: int
    steps_then: int


@dataclass(frozen=True)
class NodeHealthChanged:
    node: str
    state: State | str
    reasons: tuple[str, ...] = ()
    reachable: bool = True
    rails: tuple[tuple[str, str], ...] = ()  # (data rail, state), fed for jobs with data rails only


@dataclass(frozen=True)
class JobRails:
    """The job's data rails, as its first rank to name them registered (rank.register "rails")."""

    rails: tuple[str, ...]


@dataclass(frozen=True)
class SpareAdded:
    """A hot spare of the allocation (the last N nodes with --torchpass=spares=N)."""

    node: str
    how: SpareHow = SpareHow.HOT


# --- rank runtime reports (wire: rank.armed, rank.quiesced, rank.resumed) ---------
@dataclass(frozen=True)
class Armed:
    rank: int
    at: int
    generation: int
    accepted: bool
    collectives: int
    # With accepted False: the rank is unprotected (why) and refuses every pause; no later T will do.
    unprotected: str = ""


@dataclass(frozen=True)
class RankUnprotected:
    """A rank said it cannot be protected (``why``: e.g. the job made a process group the runtime
    cannot move yet; wire field ``unprotected`` of rank.register/progress/armed). A job-level fact
    that never goes away: no migration starts, and a pause in flight is rolled back."""

    rank: int
    why: str


@dataclass(frozen=True)
class Quiesced:
    rank: int
    generation: int
    collectives: int
    drain_s: float = 0.0  # the rank's pause to torn down (wait for in-flight work, meet the others, close)
    released_mb: float | None = None  # a held rank: memory its allocator caches gave back before the dump


@dataclass(frozen=True)
class Resumed:
    rank: int
    generation: int
    node: str | None = None
    cancelled: bool = False  # armed but never torn down: it simply ran on
    collectives: int | None = None  # as reported (None: not said)


# --- executor outcomes --------------------------------------------------------------
@dataclass(frozen=True)
class SpareGranted:
    migration: str
    node: str
    how: SpareHow  # EXPAND or COMPANION
    allocation: int | None = None  # the slurmctld job id it came from (donor or companion)


@dataclass(frozen=True)
class SpareUnavailable:
    migration: str
    strategy: str
    why: str


@dataclass(frozen=True)
class SpareLost:
    node: str
    why: str


@dataclass(frozen=True)
class MigrationDumpDone:
    migration: str
    rank: int
    image: str
    checksum: str
    durations: dict[str, float] = field(default_factory=dict)
    # tpassd's dump result (pid, images, ...): the executor keeps it for KillSource / AbortRestore.
    result: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class MigrationDumpFailed:
    migration: str
    rank: int
    why: str


@dataclass(frozen=True)
class TransferDone:
    migration: str
    rank: int
    target: str
    image: str  # the path the target reads
    checksum: str
    durations: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TransferFailed:
    migration: str
    rank: int
    target: str
    why: str
    target_lost: bool = False


@dataclass(frozen=True)
class RestoreDone:
    migration: str
    rank: int
    target: str
    durations: dict[str, float] = field(default_factory=dict)
    # (source GPU UUID, target GPU UUID) in local order, as the root restore agent remapped them
    gpu_pairs: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class RestoreFailed:
    migration: str
    rank: int
    target: str
    why: str
    target_lost: bool = False  # the spare itself died (try the next one) vs. the restore failed


@dataclass(frozen=True)
class SourceKilled:
    migration: str
    node: str


@dataclass(frozen=True)
class KillFailed:
    migration: str
    node: str
    why: str


@dataclass(frozen=True)
class Drained:
    migration: str
    node: str


@dataclass(frozen=True)
class DrainFailed:
    migration: str
    node: str
    why: str


@dataclass(frozen=True)
class Shrunk:
    migration: str
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class ShrinkFailed:
    migration: str
    why: str


@dataclass(frozen=True)
class OperatorMigrate:
    node: str
    to: str | None = None


@dataclass(frozen=True)
class SlurmReachability:
    """slurmctld stopped answering for a while (available False, why) or answers again."""

    available: bool
    why: str = ""


# --- whole-job snapshots ---------------------------------------------------------------
@dataclass(frozen=True)
class OperatorSnapshot:
    """`tpassctl snapshot JOBID`: take snapshot ``snapshot`` (its id, chosen when accepted)."""

    snapshot: str


@dataclass(frozen=True)
class JobStopFailed:
    """StopJob could not hold the job (the marker or ``scontrol requeuehold`` failed)."""

    snapshot: str
    why: str


@dataclass(frozen=True)
class RankDumped:
    snapshot: str
    image: SnapImage
    durations: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RankDumpFailed:
    snapshot: str
    rank: int
    why: str


@dataclass(frozen=True)
class SnapshotCommitted:
    snapshot: str
    manifest: str  # the job manifest's path
    bytes: int
    removed: tuple[str, ...] = ()  # older snapshots removed by the retention rule


@dataclass(frozen=True)
class SnapshotCommitFailed:
    snapshot: str
    why: str


Outcome = Union[
    RankRegistered, RankProgress, NodeHealthChanged, SpareAdded, Armed, RankUnprotected, Quiesced, Resumed,
    SpareGranted, SpareUnavailable, SpareLost, MigrationDumpDone, MigrationDumpFailed, TransferDone, TransferFailed,
    RestoreDone, RestoreFailed, SourceKilled, KillFailed, Drained, DrainFailed, Shrunk, ShrinkFailed, OperatorMigrate,
    SlurmReachability, OperatorSnapshot, RankDumped, RankDumpFailed, SnapshotCommitted, SnapshotCommitFailed,
    CheckpointCompleted, CheckpointLoaded, JobStopFailed, JobRails, RankExited,
]


__all__ = [
    "RequestSpare", "PauseAt", "MigrationDump", "Transfer", "Restore", "AbortRestore", "KillSource", "Resume",
    "ResumeInPlace", "Drain", "Shrink", "HandToSlurm", "Relaunch", "RelaunchPossible", "Event", "Action",
    "CheckpointCompleted", "CheckpointLoaded", "RankExited",
    "RankRegistered", "RankProgress", "NodeHealthChanged", "SpareAdded", "Armed", "RankUnprotected", "Quiesced",
    "Resumed", "SpareGranted", "SpareUnavailable", "SpareLost", "MigrationDumpDone", "MigrationDumpFailed",
    "TransferDone", "TransferFailed", "RestoreDone", "RestoreFailed", "SourceKilled", "KillFailed", "Drained",
    "DrainFailed",
    "Shrunk", "ShrinkFailed", "OperatorMigrate", "SlurmReachability", "Outcome",
    "DumpRank", "SnapImage", "CommitSnapshot", "DiscardSnapshot", "OperatorSnapshot", "RankDumped",
    "RankDumpFailed", "SnapshotCommitted", "SnapshotCommitFailed", "StopJob", "ForgetStopped", "JobStopFailed",
    "JobRails",
]
