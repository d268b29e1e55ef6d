"""The coordinator's driver and executor: decisions in, real actions out.

``Driver`` keeps the decision state (``model.CoordState``), applies every
input and executor outcome with ``machine.apply``, calls ``decide`` and hands
the actions (``contract``) to ``Executor``. Everything runs in the
coordinator's serve thread: handlers call ``Driver.feed``; actions that take
time (a CRIU dump through tpassd, the restore job step) run in worker
threads that only ``post`` outcomes to a queue, which the serve loop drains
(``Driver.pump``). A worker never writes the executor's bookkeeping: the
serve thread records what an outcome tells the executor (``Executor.observe``:
a dump's pid, a companion allocation) before ``machine.apply`` sees it, and
work that must wait for workers (a rollback waiting for the aborts of
restored copies) waits for an outcome of its own (``AbortsFinished``). So
handlers, workers and the decision loop never race.

The executor's bookkeeping: ``commands`` (rank -> the command repeated in
its replies until acknowledged), ``moves`` (migration -> ``Move``: held
ranks, dump results, restore steps, gates, aborts, a pending rollback) and
``companions`` (companion allocation -> node). The ranks themselves (node,
progress) are the decision state's alone (``model.CoordState.ranks``).

How each action is performed (docs/coordinator.md, "Migration end to end"):

* PauseAt / Resume / ResumeInPlace: a command per rank, sent in the reply to
  the rank's next ``rank.*`` request until acknowledged (rank.armed /
  rank.resumed). Held ranks wait for a hold file in the job's state dir,
  created by the coordinator only once the source copy is dead (Resume) or
  the move is off (ResumeInPlace).
* Snapshot / KillSource: ``tpassd.snapshot`` (op dump / kill) to the source
  node's tpassd, munge-authenticated. The dump leaves the rank running
  (paused, holding) so that any later failure resumes it in place.
* Transfer: ``tpassd.restore`` op verify on the target's tpassd (the image is
  on a shared filesystem: the target checks its manifest and checksum).
* Restore: first ``tpassd.restore`` op prepare (kind migration, the rank and the
  dump's generation) to the target's tpassd, which writes the restore token
  without which the SPANK plugin starts no root restore agent for the step
  (torchpass.checkpoint.restore_token); then
  ``srun --jobid=J --overlap -w TARGET -N1 -n1 --torchpass=off -o
  <job output> --open-mode=append <python> -m torchpass.checkpoint.rankwrap
  --restore IMAGES`` (``torchpass.slurm.overlap_step_argv``), from the batch
  host; done when the restore wrapper has recorded the restored rank. The
  step is started already at PauseAt (the target is known then) behind
  torchpass.checkpoint.restore_gate, which waits for the image path: the
  step launch overlaps the ranks' way to T and the dump instead of adding to
  the standstill. A move called off (or sent
  to another target) cancels the gate.
* RequestSpare: one node from slurmctld (``salloc --no-shell --exclusive``
  on the job's partition/account/QOS, the job's nodes excluded). "expand":
  allocated with ``--dependency=expand:J`` and merged into the job
  (``scontrol update JobId=DONOR NumNodes=0``); "companion": kept as a
  one-node job of its own, named ``torchpass-spare-J``, whose only step is
  the restore; cancelled when the coordinator exits. The new node's tpassd is
  followed from then on.
* Drain: ``tpassd.drain`` to the drained node's tpassd (root; slurmctld refuses a
  job user's drain), which drains only a node it finds degraded or failed, unless
  the coordinator runs as root or SlurmUser.
* HandToSlurm: a log line (decide records the ``node.lost`` event); Slurm's normal handling
  applies. A node is lost outright when its tpassd fell silent and slurmctld, asked by
  ``check_silent`` in a worker at most every SILENT_CHECK_S, does not hear it either
  (docs/coordinator.md, "A node lost outright"). Such a node is also drained, through
  another node's tpassd (``tpassd.drain`` with ``node``; event ``node.drained``). With
  ``end_job`` (no relaunch possible), after the drain the job is requeued if slurmctld
  may requeue it (``scontrol requeue``, events ``job.requeuing`` saved before the call, which
  may end this coordinator, and ``job.requeued``), else its steps with a
  task on the node are ended (``job.steps_ended``): what slurmctld does at DOWN to a job
  without ``--no-kill``, done at once and also for a ``--no-kill`` job.
* Relaunch: the job's host file (layout.hostfile, which places every srun of
  the batch script) gets each lost node's lines replaced by its spare, then the
  relaunch verdict (layout.relaunch_file) counts one more relaunch and lists the
  job's steps with a task on a lost node; then those steps are cancelled
  (``scancel J.S``: Slurm would end them only when it marks the node DOWN).
  srun's exit hook (the SPANK plugin) reads the verdict: the user's srun of a
  listed step execs itself again. A relaunch from a whole-job snapshot is
  first prepared (``tpassd.restore`` op prepare, kind snapshot) on every node
  of the new host file, before the verdict is written. RelaunchPossible writes the same file with
  ``pending=1`` while a silent node may lead to a relaunch, so that a srun that
  ends meanwhile waits for the verdict.
* Shrink and every other Slurm query or update: the torchpass.slurm
  client. Shrink: ``scontrol update JobId=J NodeList=<the rest>`` only when
  no step of the job still runs on the node (the source's task wrapper waits
  for the moved rank's exit code: releasing its node would kill it and fail
  the step); a companion node is released by cancelling its allocation.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import structlog

from torchpass import auth, layout, zmqio
from torchpass.checkpoint.rankwrap import RESTORE_JOB_ENV, RESTORE_RANK_ENV
from torchpass.checkpoint.restore_gate import write_gate
from torchpass.coordinator import contract as ct
from torchpass.coordinator import decide as dc
from torchpass.coordinator import machine as mc
from torchpass.coordinator.model import CoordState, SpareHow
from torchpass.coordinator.policy import CoordinatorPolicy
from torchpass.coordinator.state import JobState, encode_events
from torchpass.coordinator.stopped import stopped_text
from torchpass.errors import RemoteError, SlurmError, TorchpassError
from torchpass.health_state import State
from torchpass.ports import TPASSD_CONTROL_PORT
from torchpass.slurm.base import JobInfo, NodeInfo, SlurmClient, SpareRequest, overlap_step_argv

log = structlog.get_logger("torchpass.coordinator.executor")


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` (a reader, such as the SPANK plugin, never sees half of it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)

RESTORE_STEP_NAME = "torchpass-restore-"  # job name of restore steps (-J torchpass-restore-RANK)
RESTORE_STEP_END_GRACE_S = 10.0
# How long a rollback waits for a called-off restore step (srun ending it, with the copy)
ABORT_WAIT_S = 15.0
# How often a restore's waiter reads the rank record for "restored" while the job stands still.
RESTORE_POLL_S = 0.002
# The programs a restore step runs (python -m ...): the restore wrapper, and the gate in front of it.
RANKWRAP_MODULE = "torchpass.checkpoint.rankwrap"
RESTORE_GATE_MODULE = "torchpass.checkpoint.restore_gate"
# A paused rank waits at most policy.max_pause_s() + this for its resume (the coordinator ends every
# pause well before; docs/coordinator.md, "Never left paused"): the pause command's deadline_s.
HOLD_MARGIN_S = 60.0
# tpassd.drain: tpassd's own scontrol call has a 15 s timeout.
DRAIN_TIMEOUT_S = 20.0
# A lost node's requeue waits at most this long for the serve thread to save job.requeuing (it
# serves within a batch; a serve thread that busy is not worth leaving the other ranks waiting).
REQUEUE_RECORD_WAIT_S = 5.0
# srun's line when slurmctld refused the step itself (no task ran). Right after slurmctld restarts it
# refuses steps ("Memory required by task is not available") until the job's nodes have registered
# again, a few seconds: the restore step is launched again for up to this long, with backoff.
STEP_NOT_CREATED = "Unable to create step for job"
# A restore's prepare (tpassd.restore op=prepare: a token written on the target) is one request
# that checks the job's owner with slurmctld; a tpassd that does not answer in this time fails
# the restore (its step then fails at launch with the plugin's line why).
PREPARE_TIMEOUT_S = 5.0
STEP_CREATE_RETRY_S = 30.0


# check_silent: slurmctld is asked about job nodes whose tpassd fell silent at most this often.
SILENT_CHECK_S = 2.0

def slurm_lost(job: JobInfo | None, node: NodeInfo | None) -> str:
    """Why slurmctld confirms that ``node`` of ``job`` is lost ("" if it does not): the job
    runs on it and slurmctld does not hear its slurmd either."""
    if job is None or node is None or not job.active or node.name not in job.nodes:
        return ""
    if not node.not_answering:
        return ""
    said = f" ({node.reason})" if node.reason else ""
    return f"tpassd silent; slurmctld reports {'+'.join(node.state)}{said}"


def hold_deadline_s(policy: CoordinatorPolicy) -> float:
    """How long a paused rank may wait for its resume: 3630 s with the default policy."""
    return policy.hold_deadline_s or policy.max_pause_s() + HOLD_MARGIN_S


def _read_from(path: Path, offset: int) -> str:
    """What was appended to ``path`` since ``offset`` ("" when it is not there)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def resume_port(job_id: int, generation: int, ports: tuple[int, int]) -> int:
    """The rendezvous port of a generation, within ``ports`` (policy ``rendezvous_ports``):
    spread by job and generation, so that jobs sharing rank 0's node rarely pick the same."""
    lo, hi = ports
    return lo + (job_id * 131 + generation * 977) % (hi - lo + 1)


class TpassdClient:
    """Authenticated requests to a node's tpassd control endpoint."""

    def __init__(self, address_of: Callable[[str], str], *, port: int = TPASSD_CONTROL_PORT,
                 munge_socket: str | None = None):
        self.address_of = address_of
        self.port = port
        self.munge_socket = munge_socket

    def request(self, node: str, type_: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        ep = f"tcp://{self.address_of(node)}:{self.port}"
        return zmqio.request(ep, type_, body, timeout_s=timeout_s, retries=0,
                             auth=auth.credential_for(type_, body, node, self.munge_socket))


# ============================================================================
# The executor's bookkeeping
# ============================================================================
class Gate(NamedTuple):
    """A restore step started at PauseAt, waiting at its gate for the image."""

    target: str
    proc: subprocess.Popen
    go: Path  # the gate file (layout.restore_go_file)
    started: float  # time.monotonic() at launch


@dataclass
class Move:
    """What the executor keeps about one migration (``Executor.moves[migration]``)."""

    hold: tuple[int, ...] = ()  # ranks told to hold after quiescing (PauseAt.hold_ranks)
    hold_tasks: tuple[int, ...] = ()  # their tasks (what tpassd knows; see Executor._task)
    dumps: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> tpassd's dump result (pid, images)
    gates: dict[int, Gate] = field(default_factory=dict)  # rank -> restore step waiting at its gate
    restores: dict[int, subprocess.Popen] = field(default_factory=dict)  # rank -> restore step running
    aborts: list[threading.Thread] = field(default_factory=list)  # AbortRestore workers of restored copies
    rollback: tuple[ct.ResumeInPlace, tuple[int, ...], str | None] | None = None  # waits for ``aborts``


@dataclass(frozen=True)
class AbortsFinished:
    """Executor-internal outcome: every abort of ``migration``'s restored copies has ended
    (or given up), so its pending rollback may release the source copies."""

    migration: str


@dataclass(frozen=True)
class LostNodeEnded:
    """Executor-internal outcome: what became of a job that lost ``node`` and cannot be
    relaunched (HandToSlurm ``end_job``): ``how`` "requeued", "steps_ended" or "" (nothing done:
    ``why``). Recorded as an event."""

    node: str
    how: str
    why: str
    steps: tuple[str, ...] = ()


def _as_slurm_requeues(node: str) -> str:
    """Why a job that lost ``node`` is requeued (events job.requeuing and job.requeued)."""
    return (f"as slurmctld requeues a batch job that loses a node ({node} lost, no relaunch possible): it "
            "starts again from its batch script under the same job id")


@dataclass(frozen=True)
class LostNodeRequeuing:
    """Executor-internal outcome: the job that lost ``node`` is about to be requeued. Recorded
    (``job.requeuing``) and saved, then ``recorded`` is set: the requeue ends the batch step and
    this coordinator with it, often before an event recorded after it would reach the disk."""

    node: str
    recorded: threading.Event = field(compare=False, repr=False)


@dataclass(frozen=True)
class LostNodeDrain:
    """Executor-internal outcome: the drain of a node lost outright, through another node's
    tpassd (``witness``), succeeded (``error`` None) or not. Recorded as an event."""

    node: str
    reason: str
    witness: str | None
    slurm_state: str
    error: str | None


# ============================================================================
class Executor:
    """Performs decide's actions; outcomes go to ``post`` (thread-safe)."""

    def __init__(
        self,
        job: JobState,
        *,
        state_dir: str | os.PathLike,
        post: Callable[[Any], None],
        policy: CoordinatorPolicy,
        tpassd: TpassdClient | None = None,
        slurm: SlurmClient | None = None,
        address_of: Callable[[str], str] = socket.gethostbyname,
        wall: Callable[[], float] = time.time,
        python: str = sys.executable,
        srun: str = "srun",
        follow: Callable[[str], None] | None = None,
        prelaunch_restore: bool = True,
        output: str = "",
    ):
        self.job = job
        self.job_id = job.job_id
        self.state_dir = Path(state_dir)
        self.post = post
        self.policy = policy
        self.tpassd = tpassd
        self.slurm = slurm
        self.address_of = address_of
        self.wall = wall
        self.python = python
        self.srun = srun
        self.follow = follow  # (node) -> None: follow a new spare's tpassd
        self.prelaunch_restore = prelaunch_restore
        # A pause's restore steps (prelaunch_restore) start after the pause's replies are sent, when
        # the caller says it will call run_deferred() then (the coordinator's server does). Each is
        # an srun forked from this process: at 8,192 ranks, started before the replies, the 8 of a
        # node held the pause back 0.1-0.26 s (issue 13). They have seconds until the dump is done.
        self.defer_prelaunch = False
        self._deferred: list[Callable[[], None]] = []
        self.commands: dict[int, dict[str, Any]] = {}  # rank -> command repeated until acknowledged
        # The ranks of the newest pause that are held (the moving node's): the server sends them
        # their command first. The move waits on them (they quiesce, then are dumped); the others
        # only stand at T. At 8,192 ranks the pause's replies take the serve thread 0.25-0.6 s.
        self.urgent: tuple[int, ...] = ()
        self.moves: dict[str, Move] = {}
        self._restores_lock = threading.Lock()  # Move.restores: a relaunch must not revive a called-off step
        self.companions: dict[int, str] = {}  # companion allocation -> node (cancelled at close)
        # The job's stdout file (cached). Given at the start (main.py has Slurm's record then), so
        # the first restore step, launched in the serve thread at a pause, asks slurmctld nothing.
        self._output: str | None = output or None
        self._silent_check: threading.Thread | None = None  # check_silent's worker
        # The relaunch verdict: written by the serve thread (RelaunchPossible) and by a Relaunch's
        # worker, under this lock; the steps the newest relaunch ended stay in every later write.
        self._verdict_lock = threading.Lock()
        # (count, steps, snapshot) of the newest relaunch published
        self._verdict_steps: tuple[int, list[str] | None, str] = (0, None, "")
        # A verdict left by an earlier run of the job (requeued) would hide this run's relaunches
        # from its sruns (they compare counts): this run's sruns start after its coordinator.
        layout.relaunch_file(self.state_dir, self.job_id).unlink(missing_ok=True)
        self._next_silent_check = 0.0

    def move(self, migration: str) -> Move:
        return self.moves.setdefault(migration, Move())

    @property
    def rank_dir(self) -> Path:
        """Where the rank wrappers keep the job's rank records (shared by every node of the job)."""
        return layout.rank_records_dir(self.state_dir, self.job_id)

    # --- rank commands -----------------------------------------------------------------------
    def command_for(self, rank: int) -> dict[str, Any] | None:
        return self.commands.get(rank)

    def acknowledge(self, rank: int, kind: str, generation: int, at: int | None = None) -> None:
        cmd = self.commands.get(rank)
        if cmd is None or cmd["command"] != kind or cmd["generation"] != generation:
            return
        if kind == "pause" and cmd["at"] != at:
            return
        del self.commands[rank]

    # --- tasks: what tpassd dumps and restores ------------------------------------------------
    # tpassd, the rank wrapper and the restore step know a Slurm task (its rank record's key), not
    # a rank. Under srun a task holds one rank (its own number); under torchrun a task is the agent
    # with all its workers. The decision core still speaks of ranks: for a task of several ranks,
    # its lowest rank (the lead) does the task's work and reports the outcome for every rank of
    # the task; the others' actions do nothing.
    @staticmethod
    def _task(st: CoordState, rank: int) -> tuple[int, tuple[int, ...]] | None:
        """(task, the ranks in it) when ``rank`` leads its task; None for the task's other ranks."""
        task = st.task_of(rank)
        rv = st.ranks.get(rank)
        if rv is None:
            return task, (rank,)
        ranks = tuple(r for r in st.rank_nodes().get(rv.node, ()) if st.task_of(r) == task)
        return (task, ranks) if ranks and ranks[0] == rank else None

    @staticmethod
    def _tasks(st: CoordState, ranks) -> dict[int, int]:
        """Each task of ``ranks`` with its lead (lowest) rank."""
        out: dict[int, int] = {}
        for r in sorted(ranks):
            out.setdefault(st.task_of(r), r)
        return out

    def _hold(self, migration: str, rank: int) -> Path:
        return layout.hold_file(self.state_dir, self.job_id, migration, rank)

    def _release(self, migration: str) -> None:
        for r in self.move(migration).hold:
            p = self._hold(migration, r)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.touch()

    def _resume_command(self, generation: int, master: str) -> dict[str, Any]:
        addr = self.address_of(master) if master else "127.0.0.1"
        return {"command": "resume", "generation": generation, "master_addr": addr,
                "master_port": resume_port(self.job_id, generation, self.policy.rendezvous_port_range())}

    def _resume_cmd(self, ranks, generation: int, master: str) -> None:
        cmd = self._resume_command(generation, master)
        for r in ranks:
            self.commands[r] = cmd  # one object for all (never modified: see _do_PauseAt)

    # --- outcomes, seen in the serve thread ----------------------------------------------------
    def observe(self, outcome: Any) -> bool:
        """Record what a worker's outcome tells the executor (serve thread, before machine.apply).
        True: the outcome was the executor's own (``AbortsFinished``), not one for machine.apply."""
        if isinstance(outcome, ct.SnapshotDone) and outcome.result:
            self.move(outcome.migration).dumps[outcome.rank] = dict(outcome.result)
        elif isinstance(outcome, ct.SpareGranted):
            if outcome.how == SpareHow.COMPANION and outcome.allocation is not None:
                self.companions[outcome.allocation] = outcome.node
            if self.follow is not None:
                try:
                    self.follow(outcome.node)
                except (OSError, TorchpassError) as exc:
                    log.warning("cannot follow the new spare's health", node=outcome.node, error=str(exc))
        elif isinstance(outcome, ct.Shrunk):
            for alloc in [a for a, n in self.companions.items() if n in outcome.nodes]:
                del self.companions[alloc]
        elif isinstance(outcome, LostNodeDrain):
            if outcome.error is None:
                self.job.record(self.wall(), "node.drained",
                                f"{outcome.node} drained through {outcome.witness}'s tpassd (slurmctld reports it "
                                f"{outcome.slurm_state or 'not answering'}): {outcome.reason}",
                                node=outcome.node, witness=outcome.witness, reason=outcome.reason)
            else:
                self.job.record(self.wall(), "node.drain_failed",
                                f"{outcome.node} was not drained ({outcome.error}); slurmctld's own DOWN state is "
                                "what remains", node=outcome.node, error=outcome.error)
            log.warning("lost node drained" if outcome.error is None else "lost node not drained", node=outcome.node,
                        witness=outcome.witness, error=outcome.error)
            self.save_events()
            return True
        elif isinstance(outcome, LostNodeRequeuing):
            self.job.record(self.wall(), "job.requeuing",
                            f"torchpass requeues the job, {_as_slurm_requeues(outcome.node)}", node=outcome.node)
            log.warning("requeuing the job after a lost node", node=outcome.node)
            self.save_events()
            outcome.recorded.set()
            return True
        elif isinstance(outcome, LostNodeEnded):
            if outcome.how == "requeued":
                self.job.record(self.wall(), "job.requeued",
                                f"job requeued by torchpass, {_as_slurm_requeues(outcome.node)}", node=outcome.node)
            elif outcome.how == "steps_ended":
                self.job.record(self.wall(), "job.steps_ended",
                                f"{outcome.why}: step(s) {', '.join(outcome.steps)} with a task on {outcome.node} "
                                "ended, as slurmctld would end the job; the batch script goes on",
                                node=outcome.node, steps=list(outcome.steps), why=outcome.why)
            else:
                self.job.record(self.wall(), "job.not_ended",
                                f"the job was left as it is after losing {outcome.node}: {outcome.why}",
                                node=outcome.node, why=outcome.why)
            log.warning("job after a lost node", node=outcome.node, how=outcome.how or "left", why=outcome.why,
                        steps=list(outcome.steps))
            self.save_events()
            return True
        elif isinstance(outcome, AbortsFinished):
            mv = self.moves.get(outcome.migration)
            if mv is not None and mv.rollback is not None:
                a, ranks, node = mv.rollback
                mv.rollback = None
                self._resume_in_place(a, ranks, node)
            return True
        return False

    # --- dispatch ----------------------------------------------------------------------------
    def run_deferred(self) -> None:
        """Start what waited for the replies (see defer_prelaunch)."""
        todo, self._deferred = self._deferred, []
        for fn in todo:
            try:
                fn()
            except Exception:  # noqa: BLE001 - as perform(): logged, the move goes on without it
                log.exception("deferred action failed")

    def perform(self, action: Any, state: CoordState) -> None:
        name = type(action).__name__
        if self._deferred and not isinstance(action, ct.PauseAt):
            self.run_deferred()  # any later action sees the restore steps started, as before
        try:
            getattr(self, f"_do_{name}")(action, state)
        except Exception as exc:  # noqa: BLE001 - an action that crashed is a failed action
            log.exception("action failed", action=name)
            self._fail(action, f"{type(exc).__name__}: {exc}")

    def _fail(self, a: Any, why: str) -> None:
        fails = {
            ct.Snapshot: lambda: ct.SnapshotFailed(a.migration, a.rank, why),
            ct.Transfer: lambda: ct.TransferFailed(a.migration, a.rank, a.target, why),
            ct.Restore: lambda: ct.RestoreFailed(a.migration, a.rank, a.target, why),
            ct.KillSource: lambda: ct.KillFailed(a.migration, a.node, why),
            ct.Drain: lambda: ct.DrainFailed(a.migration, a.node, why),
            ct.Shrink: lambda: ct.ShrinkFailed(a.migration, why),
            ct.RequestSpare: lambda: ct.SpareUnavailable(a.migration, a.strategy, why),
            ct.DumpRank: lambda: ct.RankDumpFailed(a.snapshot, a.rank, why),
            ct.CommitSnapshot: lambda: ct.SnapshotCommitFailed(a.snapshot, why),
        }
        f = fails.get(type(a))
        if f is not None:
            self.post(f())

    def _thread(self, fn: Callable[[], None], name: str) -> threading.Thread:
        t = threading.Thread(target=fn, name=name, daemon=True)
        t.start()
        return t

    # --- actions -------------------------------------------------------------------------------
    def _do_Event(self, a: ct.Event, st: CoordState) -> None:
        self.job.record(self.wall(), a.kind, a.message, **a.data)
        log.info("event", kind=a.kind, message=a.message)
        self.save_events()

    def save_events(self) -> None:
        """STATE_DIR/jobs/J/events.json: the event log outlives the coordinator (tpassctl, tests)."""
        try:
            write_atomically(layout.events_json(self.state_dir, self.job_id), encode_events(self.job.events))
        except OSError as exc:
            log.warning("cannot save the event log", error=str(exc))

    def spare_request(self, a: ct.RequestSpare, st: CoordState, companions: Collection[str] = ()
                      ) -> SpareRequest:
        """The salloc request for a spare: same partition/account/QOS as the job, none of its nodes
        (nor the spares and companion nodes it has)."""
        info = self.slurm.job(self.job_id)
        if info is None or not info.active:
            raise SlurmError(f"job {self.job_id} is {'gone' if info is None else info.state}")
        exclude = sorted(set(info.nodes) | {s.node for s in st.spares} | set(companions))
        limit = None
        if info.end_time is not None:
            limit = max(1, int((info.end_time - self.wall()) // 60) + 1)  # never outlive the job
        return SpareRequest(
            job_id=self.job_id, name=f"torchpass-spare-{self.job_id}",
            comment=f"torchpass: {a.strategy} spare for job {self.job_id} ({a.migration}, replacing {a.for_node})",
            exclude=tuple(exclude), partition=info.partition, account=info.account, qos=info.qos,
            time_limit_min=limit, immediate_s=max(1, int(min(self.policy.spare_timeout_s, 60.0))),
            expand=a.strategy == SpareHow.EXPAND,
        )

    def _do_RequestSpare(self, a: ct.RequestSpare, st: CoordState) -> None:
        if a.strategy not in (SpareHow.EXPAND, SpareHow.COMPANION):
            self.post(ct.SpareUnavailable(a.migration, a.strategy, f"unknown spare strategy {a.strategy!r}"))
            return
        if self.slurm is None:
            self.post(ct.SpareUnavailable(a.migration, a.strategy, "no Slurm client"))
            return
        companions = set(self.companions.values())

        def run() -> None:
            t0 = time.monotonic()
            try:
                req = self.spare_request(a, st, companions)
                alloc, node = self.slurm.allocate(req)
                if a.strategy == SpareHow.EXPAND:
                    try:
                        self.slurm.merge_into(alloc, self.job_id)
                    except TorchpassError:
                        self._cancel(alloc)
                        raise
            except TorchpassError as exc:
                log.warning("no spare from slurmctld", strategy=a.strategy, migration=a.migration, error=str(exc))
                self.post(ct.SpareUnavailable(a.migration, a.strategy, str(exc)))
                return
            log.info("spare obtained from slurmctld", strategy=a.strategy, node=node, allocation=alloc,
                     job_id=self.job_id, seconds=round(time.monotonic() - t0, 3))
            self.post(ct.SpareGranted(a.migration, node, a.strategy, allocation=alloc))

        self._thread(run, f"spare-{a.strategy}")

    def _cancel(self, alloc: int) -> None:
        try:
            self.slurm.cancel(alloc)
        except TorchpassError as exc:
            log.warning("could not cancel a spare allocation", allocation=alloc, error=str(exc))

    def _do_PauseAt(self, a: ct.PauseAt, st: CoordState) -> None:
        self.move(a.migration).hold = tuple(a.hold_ranks)
        self.move(a.migration).hold_tasks = tuple(self._tasks(st, a.hold_ranks))
        self.urgent = tuple(a.hold_ranks)
        # What a rank does if no resume comes within deadline_s (the coordinator died): the
        # rollback's own resume in place (docs/coordinator.md, "Never left paused").
        fallback = self._resume_command(a.generation, dc.in_place_master(st))
        # One command object for every rank that is not held (never modified; the server encodes
        # it once for all of them: a pause to 8,192 ranks is one batch of replies).
        cmd = {"command": "pause", "at": a.at, "generation": a.generation,
               "deadline_s": hold_deadline_s(self.policy), "fallback": fallback,
               "join_s": self.policy.rebuild_timeout_s}  # the fallback's ranks wait this long for each other
        held = set(a.hold_ranks)
        for r in st.ranks:
            if r in held:
                p = self._hold(a.migration, r)
                p.parent.mkdir(parents=True, exist_ok=True)
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass
                self.commands[r] = {**cmd, "hold_file": str(p)}
            else:
                self.commands[r] = cmd
        m = st.migration
        if self.prelaunch_restore and m is not None and m.id == a.migration and m.target:
            tasks, target = tuple(self._tasks(st, a.hold_ranks)), m.target

            def prelaunch() -> None:
                for task in tasks:
                    self._prelaunch(a.migration, task, target, st, a.generation)

            if self.defer_prelaunch:
                self._deferred.append(prelaunch)
            else:
                prelaunch()

    def _do_Snapshot(self, a: ct.Snapshot, st: CoordState) -> None:
        gen = st.migration.generation if st.migration else st.generation + 1
        unit = self._task(st, a.rank)
        if unit is None:
            return  # its task's lead dumps the task and reports for this rank too
        task, ranks = unit
        body = {"job_id": self.job_id, "rank": task, "generation": gen, "op": "dump",
                "rank_dir": str(self.rank_dir)}

        def run() -> None:
            try:
                res = self.tpassd.request(a.node, "tpassd.snapshot", body, self.policy.dump_timeout_s)
            except TorchpassError as exc:
                self.post(ct.SnapshotFailed(a.migration, a.rank, str(exc)))
                return
            durations = {k: res[k] for k in ("criu_dump_s", "total_s") if isinstance(res.get(k), (int, float))}
            durations["image_mb"] = round(res.get("bytes", 0) / 1e6, 1)
            for r in ranks:
                self.post(ct.SnapshotDone(a.migration, r, res["images"], res["checksum"], durations, result=res))

        self._thread(run, f"snapshot-{task}")

    def _do_Transfer(self, a: ct.Transfer, st: CoordState) -> None:
        unit = self._task(st, a.rank)
        if unit is None:
            return  # its task's lead verifies the task's images and reports for this rank too
        task, ranks = unit
        body = {"job_id": self.job_id, "rank": task, "op": "verify", "images": a.image, "checksum": a.checksum}

        def run() -> None:
            t0 = time.monotonic()
            try:
                self.tpassd.request(a.target, "tpassd.restore", body, self.policy.transfer_timeout_s)
            except RemoteError as exc:
                self.post(ct.TransferFailed(a.migration, a.rank, a.target, str(exc)))
                return
            except TorchpassError as exc:  # the target's tpassd does not answer: the target is lost
                self.post(ct.TransferFailed(a.migration, a.rank, a.target, str(exc), target_lost=True))
                return
            for r in ranks:
                self.post(ct.TransferDone(a.migration, r, a.target, a.image, a.checksum,
                                          {"verify_s": round(time.monotonic() - t0, 4)}))

        self._thread(run, f"transfer-{task}")

    def job_output(self) -> str:
        """The job's stdout file (where the restored rank's lines go)."""
        if self._output is None:
            path = ""
            if self.slurm is not None:
                try:
                    info = self.slurm.job(self.job_id)
                    path = info.output if info is not None else ""
                except (OSError, TorchpassError) as exc:
                    log.warning("cannot read the job's output file from Slurm", error=str(exc))
            self._output = path or str(layout.restored_ranks_out(self.state_dir, self.job_id))
        return self._output

    def restore_err(self, a: ct.Restore) -> Path:
        """srun's stderr plus the restore wrapper's reason for failing: the rollback event quotes its
        tail (the wrapper's own stderr goes to the job's output with the restored rank's)."""
        return layout.restore_error_file(self.state_dir, self.job_id, a.migration, a.rank)

    def restore_argv(self, a: ct.Restore, jobid: int | None = None, gate: Path | None = None) -> list[str]:
        """The restore step: in the job itself, or in the companion allocation that holds the target.
        With ``gate``: the step waits for the image path in that file (restore_gate)."""
        if gate is None:
            prog = ["-m", RANKWRAP_MODULE, "--restore", a.image]
        else:
            p = self.policy
            wait = (p.pause_timeout_s * (1 + p.max_pause_rearms) + p.dump_timeout_s
                    + p.transfer_timeout_s * p.max_spare_attempts + 60.0)
            prog = ["-m", RESTORE_GATE_MODULE, str(gate), f"{wait:g}", "--"]
        step = overlap_step_argv(self.srun, jobid or self.job_id, a.target, name=f"{RESTORE_STEP_NAME}{a.rank}",
                                 output=self.job_output())
        return [*step, self.python, *prog, "--state-dir", str(self.rank_dir), "--error-file", str(self.restore_err(a))]

    def gate_file(self, migration: str, rank: int) -> Path:
        return layout.restore_go_file(self.state_dir, self.job_id, migration, rank)

    def prepare(self, node: str, kind: str, *, rank: int = 0, timeout_s: float = PREPARE_TIMEOUT_S,
                **fields: Any) -> str | None:
        """Ask ``node``'s tpassd to set up one restore (``tpassd.restore`` op=prepare: it checks the
        request and writes the restore token the SPANK plugin needs before it starts its root restore
        agent). None when done, else why not (logged; the step then fails with the plugin's line)."""
        if self.tpassd is None:
            return "no tpassd client"
        body = {"job_id": self.job_id, "rank": rank, "op": "prepare", "kind": kind,
                **{k: v for k, v in fields.items() if v is not None}}
        try:
            self.tpassd.request(node, "tpassd.restore", body, timeout_s)
        except TorchpassError as exc:
            log.warning("cannot set up the restore on its node", node=node, kind=kind, rank=rank, error=str(exc))
            return str(exc)
        return None

    def prepare_all(self, nodes: Collection[str], kind: str, **fields: Any) -> dict[str, str]:
        """``prepare`` on each of ``nodes`` at once; node -> why it failed, for those that did."""
        out: dict[str, str] = {}
        lock = threading.Lock()

        def one(node: str) -> None:
            why = self.prepare(node, kind, **fields)
            if why is not None:
                with lock:
                    out[node] = why

        threads = [threading.Thread(target=one, args=(n,), name=f"prepare-{n}", daemon=True) for n in sorted(nodes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def _spawn_restore(self, a: ct.Restore, st: CoordState, gate: Path | None = None,
                       generation: int | None = None) -> subprocess.Popen:
        sp = st.spare(a.target)
        alloc = sp.allocation if sp is not None and sp.how == SpareHow.COMPANION else None
        if generation is None:  # a restore step started with its images: their generation
            parsed = layout.parse_images_dir(a.image, self.job_id, a.rank) if a.image else None
            generation = parsed[1] if parsed is not None else None
        # The token first: the step's plugin takes it at launch, before a gated step waits.
        self.prepare(a.target, "migration", rank=a.rank, generation=generation, alloc=alloc)
        argv = self.restore_argv(a, alloc, gate)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SPANK_", "TORCHPASS_"))
               or k == "SLURM_CONF"}
        # The plugin starts its root restore agent for this step (torchpass.checkpoint.restore_agent).
        env[RESTORE_RANK_ENV], env[RESTORE_JOB_ENV] = str(a.rank), str(self.job_id)
        errf = self.restore_err(a)
        errf.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=open(errf, "ab"), start_new_session=True)
        log.info("restore step launched", rank=a.rank, target=a.target, argv=argv, gated=gate is not None)
        return proc

    def _prelaunch(self, migration: str, rank: int, target: str, st: CoordState, generation: int) -> None:
        """Start ``rank``'s restore step on ``target`` now; it waits at its gate for the images."""
        gates = self.move(migration).gates
        old = gates.get(rank)
        if old is not None:
            if old.target == target and old.proc.poll() is None:
                return  # a re-arm: the step already waits
            self._stop_gate(gates.pop(rank))
        go = self.gate_file(migration, rank)
        go.parent.mkdir(parents=True, exist_ok=True)
        try:
            go.unlink()
        except FileNotFoundError:
            pass
        proc = self._spawn_restore(ct.Restore(migration, rank, target, "", ""), st, gate=go, generation=generation)
        gates[rank] = Gate(target, proc, go, time.monotonic())

    def _stop_gate(self, gate: Gate) -> None:
        """Call off a waiting restore step: it exits 0 at its gate (killed if it does not)."""
        try:
            write_gate(gate.go, "cancel")
        except OSError:
            pass
        proc = gate.proc

        def run() -> None:
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                proc.wait()

        self._thread(run, "gate-cancel")

    def _cancel_gates(self, migration: str) -> None:
        gates = self.move(migration).gates
        while gates:
            self._stop_gate(gates.pop(next(iter(gates))))

    def _do_Restore(self, a: ct.Restore, st: CoordState) -> None:
        unit = self._task(st, a.rank)
        if unit is None:
            return  # its task's lead restores the task and reports for this rank too
        task, ranks = unit
        asked, a = a, replace(a, rank=task)  # from here on: the task, as the restore step knows it
        rec_path = layout.rank_record(self.rank_dir, self.job_id, a.rank)
        errf = self.restore_err(a)
        mv = self.move(a.migration)
        gate = mv.gates.pop(a.rank, None)
        t0 = time.monotonic()
        if gate is not None and gate.target == a.target and gate.proc.poll() is None:
            proc = gate.proc
            write_gate(gate.go, f"restore {a.image}")
            log.info("restore step released at its gate", rank=a.rank, target=a.target,
                     waited_s=round(t0 - gate.started, 3))
        else:
            if gate is not None:
                self._stop_gate(gate)
            proc = self._spawn_restore(a, st)
        err_from = errf.stat().st_size if errf.exists() else 0
        mv.restores[a.rank] = proc

        def run() -> None:
            nonlocal proc, err_from
            tries = 1
            while True:
                try:
                    rec = json.loads(rec_path.read_text())
                except (OSError, ValueError):
                    rec = {}
                if rec.get("restored_from") == a.image:
                    for r in ranks:
                        self.post(ct.RestoreDone(a.migration, r, a.target, {
                            "step_s": round(time.monotonic() - t0, 4),
                            "criu_restore_s": rec.get("restore_s", 0.0)}))
                    return
                rc = proc.poll()
                if rc is not None and rc != 0 and time.monotonic() - t0 < STEP_CREATE_RETRY_S \
                        and STEP_NOT_CREATED in _read_from(errf, err_from):
                    time.sleep(min(2.0, 0.25 * 2 ** (tries - 1)))
                    with self._restores_lock:
                        if mv.restores.get(a.rank) is proc:  # not called off meanwhile
                            err_from = errf.stat().st_size if errf.exists() else 0
                            proc = self._spawn_restore(a, st)
                            mv.restores[a.rank] = proc
                            tries += 1
                            log.info("slurmctld refused the restore step; launched again", rank=a.rank,
                                     target=a.target, attempt=tries)
                            continue
                if rc is not None:
                    # This launch's lines only (the file also has earlier launches' refusals).
                    tail = " | ".join(_read_from(errf, err_from).strip().splitlines()[-4:])
                    again = f" (launched {tries} times)" if tries > 1 else ""
                    self.post(ct.RestoreFailed(asked.migration, asked.rank, a.target,
                                               f"restore step exited {rc} before the rank was restored{again}: {tail}"))
                    return
                # Every rank of the job stands still until this record says restored: poll finely
                # (a record read is ~50 us; at 10 ms the wait added 5 ms on average).
                time.sleep(RESTORE_POLL_S)

        self._thread(run, f"restore-{a.rank}")

    def _do_AbortRestore(self, a: ct.AbortRestore, st: CoordState) -> None:
        self._cancel_gates(a.migration)
        mv = self.move(a.migration)
        for r, lead in self._tasks(st, a.ranks).items():  # r: the task
            with self._restores_lock:
                proc = mv.restores.pop(r, None)
            res = mv.dumps.get(lead) or {}

            def run(proc=proc, r=r, images=res.get("images")) -> None:
                if images:
                    try:
                        self.tpassd.request(a.target, "tpassd.restore",
                                            {"job_id": self.job_id, "rank": r, "op": "abort", "images": images,
                                             "rank_dir": str(self.rank_dir)}, 10.0)
                    except TorchpassError as exc:
                        log.warning("abort of a restored rank failed", rank=r, target=a.target, error=str(exc))
                if proc is not None and proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
                    try:  # srun has ended the step, and the copy with it
                        proc.wait(ABORT_WAIT_S)
                    except subprocess.TimeoutExpired:
                        log.warning("the called-off restore step did not end", rank=r, target=a.target,
                                    waited_s=ABORT_WAIT_S)

            mv.aborts.append(self._thread(run, f"abort-{r}"))

    def _do_KillSource(self, a: ct.KillSource, st: CoordState) -> None:
        dumps = {task: self.move(a.migration).dumps.get(lead) for task, lead in self._tasks(st, a.ranks).items()}
        missing = [r for r, res in dumps.items() if res is None]
        if missing:
            self.post(ct.KillFailed(a.migration, a.node, f"no dump record of rank {missing[0]}"))
            return
        if not dumps:
            self.post(ct.SourceKilled(a.migration, a.node))
            return
        # One request for the node's tasks: its tpassd checks every copy before it kills any (a
        # refusal leaves them all paused, so the rollback resumes the job where it stood) and
        # kills them at once: one round trip while the job stands still, not one per task.
        (first, res), *others = dumps.items()
        body = {"job_id": self.job_id, "rank": first, "op": "kill", "pid": int(res["pid"]),
                "rank_dir": str(self.rank_dir)}
        if others:
            body["tasks"] = [[r, int(o["pid"])] for r, o in others]

        def run() -> None:
            try:
                self.tpassd.request(a.node, "tpassd.snapshot", body, self.policy.kill_timeout_s)
            except TorchpassError as exc:
                self.post(ct.KillFailed(a.migration, a.node, str(exc)))
                return
            self.post(ct.SourceKilled(a.migration, a.node))

        self._thread(run, "kill-source")

    def _do_Resume(self, a: ct.Resume, st: CoordState) -> None:
        # The source copies are dead: the hold files now wake only the restored ranks.
        self._resume_cmd(st.ranks, a.generation, a.master)
        self._release(a.migration)
        self._cancel_gates(a.migration)

    def _do_ResumeInPlace(self, a: ct.ResumeInPlace, st: CoordState) -> None:
        self._cancel_gates(a.migration)
        node = st.migration.node if st.migration is not None else None
        mv = self.move(a.migration)
        aborts = list(mv.aborts)
        if any(t.is_alive() for t in aborts):
            # A restored copy on the target also waits at the rank's hold file (it is
            # the same process image). Releasing the hold and sending the resume before
            # that copy is dead would let it rejoin the rendezvous as the rank alongside
            # the source copy (and then die): the group would hang. So the source copy
            # resumes only once every abort of this migration has finished: a worker
            # waits for them and posts AbortsFinished, on which observe() resumes.
            mv.rollback = (a, tuple(st.ranks), node)

            def wait() -> None:
                for t in aborts:
                    t.join(ABORT_WAIT_S + 15.0)
                self.post(AbortsFinished(a.migration))

            self._thread(wait, f"rollback-{a.migration}")
            return
        self._resume_in_place(a, tuple(st.ranks), node)

    def _resume_in_place(self, a: ct.ResumeInPlace, ranks: tuple[int, ...], node: str | None) -> None:
        mv = self.move(a.migration)
        mv.aborts = []
        self._resume_cmd(ranks, a.generation, a.master)
        if not (node and mv.hold and self.tpassd is not None):
            self._release(a.migration)
            return

        # The hand-off is off: a later death of the source copy is a real failure. Each held task's
        # marker is set (all at once) before its hold file lets it run on. Off the serve thread: the
        # rollback often follows a source tpassd that stopped answering, and 5 s per task here
        # delayed every rank's resume as long.
        def mark(r: int) -> None:
            try:
                self.tpassd.request(node, "tpassd.snapshot", {"job_id": self.job_id, "rank": r, "op": "abort",
                                                              "rank_dir": str(self.rank_dir)}, 5.0)
            except TorchpassError as exc:
                log.warning("could not mark the hand-off aborted", rank=r, node=node, error=str(exc))

        def mark_then_release() -> None:
            for t in [self._thread(lambda r=r: mark(r), f"abort-mark-{r}") for r in mv.hold_tasks]:
                t.join()
            self._release(a.migration)

        self._thread(mark_then_release, f"in-place-{a.migration}")

    def _do_Drain(self, a: ct.Drain, st: CoordState) -> None:
        # Always through the node's own tpassd (root), whoever runs the coordinator: slurmctld
        # refuses a job user's drain, and tpassd drains only a node its own health view finds
        # degraded or failed (root and SlurmUser: any). A refusal is DrainFailed: the migration
        # still completes, with a note (docs/tpassd.md, "Drains").
        def run() -> None:
            try:
                self.tpassd.request(a.node, "tpassd.drain", {"job_id": self.job_id, "reason": a.reason},
                                    DRAIN_TIMEOUT_S)
            except TorchpassError as exc:
                self.post(ct.DrainFailed(a.migration, a.node, str(exc)))
                return
            self.post(ct.Drained(a.migration, a.node))

        self._thread(run, "drain")

    def shrink_blocker(self, node: str) -> str | None:
        """Why ``node`` cannot leave the job now (None: it can)."""
        info = self.slurm.job(self.job_id)
        if info is None or not info.active:
            return f"job {self.job_id} is {'gone' if info is None else info.state}"
        if node not in info.nodes:
            return None
        if node == info.batch_host:
            return f"{node} is the batch host (the batch script and the coordinator run there)"
        if set(info.nodes) <= {node}:
            return f"{node} is the job's last node"
        for step in self.slurm.steps(self.job_id):
            if step.user_step and node in step.nodes:
                # A launch wrapper (rankwrap) of the moved rank is what Slurm tracks
                # for it: it waits for the moved rank's exit code, and Slurm kills a
                # step's tasks on a node removed from the job (srun then exits 137).
                return (f"step {step.step_id} ({step.name}) still has a task on {node} (the moved rank's task "
                        "wrapper, which waits for its exit code); releasing the node would kill it and fail "
                        "the step, so it stays in the job until the step ends")
        return None

    # --- whole-job snapshots (tpassctl snapshot; issue 12) -------------------------------------
    # The pause and the resume are PauseAt (every rank held: a held rank has closed its link, so
    # CRIU finds no socket) and ResumeInPlace with the snapshot's id where a migration's would be.
    def _do_DumpRank(self, a: ct.DumpRank, st: CoordState) -> None:
        body = {"job_id": self.job_id, "rank": a.rank, "generation": a.generation, "op": "snap",
                "snapshot": a.snapshot, "rank_dir": str(self.rank_dir), "keep": a.keep}

        def run() -> None:
            try:
                res = self.tpassd.request(a.node, "tpassd.snapshot", body, self.policy.dump_timeout_s)
                image = ct.SnapImage(a.rank, a.node, str(res["images"]), str(res["checksum"]), int(res["bytes"]))
            except (TorchpassError, KeyError, TypeError, ValueError) as exc:
                self.post(ct.RankDumpFailed(a.snapshot, a.rank, str(exc)))
                return
            durations = {k: res[k] for k in ("criu_dump_s", "total_s") if isinstance(res.get(k), (int, float))}
            durations["image_mb"] = round(image.bytes / 1e6, 1)
            self.post(ct.RankDumped(a.snapshot, image, durations))

        self._thread(run, f"snap-{a.rank}")

    def _do_CommitSnapshot(self, a: ct.CommitSnapshot, st: CoordState) -> None:
        body = {"job_id": self.job_id, "rank": 0, "op": "commit", "snapshot": a.snapshot, "step": a.step,
                "generation": a.generation, "collectives": a.collectives, "keep": a.keep,
                "parts": [{"rank": i.rank, "node": i.node, "images": i.images, "checksum": i.checksum}
                          for i in a.ranks]}

        def run() -> None:
            try:
                res = self.tpassd.request(a.node, "tpassd.snapshot", body, self.policy.dump_timeout_s)
                done = ct.SnapshotCommitted(a.snapshot, str(res["manifest"]), int(res["bytes"]),
                                            tuple(str(r) for r in res.get("removed") or ()))
            except (TorchpassError, KeyError, TypeError, ValueError) as exc:
                self.post(ct.SnapshotCommitFailed(a.snapshot, str(exc)))
                return
            self.post(done)

        self._thread(run, "snap-commit")

    def _do_DiscardSnapshot(self, a: ct.DiscardSnapshot, st: CoordState) -> None:
        def run() -> None:
            for node in a.nodes:
                try:
                    self.tpassd.request(node, "tpassd.snapshot", {"job_id": self.job_id, "rank": 0, "op": "discard",
                                                                  "snapshot": a.snapshot}, 30.0)
                except TorchpassError as exc:
                    log.warning("could not remove a failed snapshot's images", snapshot=a.snapshot, node=node,
                                error=str(exc))

        self._thread(run, "snap-discard")

    def _do_StopJob(self, a: ct.StopJob, st: CoordState) -> None:
        self.save_events()  # the hold ends this coordinator soon after: its events are on disk first

        def run() -> None:
            marker = layout.stopped_file(self.state_dir, self.job_id)
            try:
                step = self.stopped_step(a.nodes)
                write_atomically(marker, stopped_text({
                    "snapshot": a.snapshot, "step": step, "snapshot_step": a.snapshot_step,
                    "generation": a.generation, "world_size": a.world_size, "step_offset": a.step_offset}))
                self.slurm.requeue_hold(self.job_id)
            except (TorchpassError, OSError) as exc:
                marker.unlink(missing_ok=True)
                self.post(ct.JobStopFailed(a.snapshot, str(exc)))
                return
            log.warning("job stopped: requeue-held after its snapshot", job_id=self.job_id, snapshot=a.snapshot,
                        step=step)

        self._thread(run, "stop-job")

    def stopped_step(self, nodes: Collection[str]) -> int:
        """The Slurm step of the ranks (the resumed run restores the step of the same id): the
        job's step on most of their nodes, the first one of those; TorchpassError if none."""
        if self.slurm is None:
            raise TorchpassError("no Slurm client: the job cannot be held")
        want = set(nodes)
        steps = {int(s.step_id.split(".", 1)[1]): len(want & set(s.nodes))
                 for s in self.slurm.steps(self.job_id) if s.user_step and want & set(s.nodes)}
        if not steps:
            raise TorchpassError(f"no step of job {self.job_id} runs on the ranks' nodes {sorted(want)}")
        return max(steps, key=lambda step: (steps[step], -step))

    def _do_ForgetStopped(self, a: ct.ForgetStopped, st: CoordState) -> None:
        layout.stopped_file(self.state_dir, self.job_id).unlink(missing_ok=True)
        log.info("the stopped job resumed; its stop marker is removed", job_id=self.job_id, snapshot=a.snapshot)

    def _do_Shrink(self, a: ct.Shrink, st: CoordState) -> None:
        spares = {n: st.spare(n) for n in a.nodes}

        def run() -> None:
            released: list[str] = []
            why: list[str] = []
            try:
                for node in a.nodes:
                    sp = spares[node]
                    if sp is not None and sp.how == SpareHow.COMPANION and sp.allocation is not None:
                        # A companion's only step was the restore, which ended when the rank moved on
                        # (observe() forgets the allocation when Shrunk arrives).
                        self._cancel(sp.allocation)
                        released.append(node)
                        continue
                    blocker = self.shrink_blocker(node)
                    # A restore step whose rank moved on ends by itself right after the
                    # hand-off (its wrapper exits 0), but Slurm may still list it for a
                    # moment: give it a few seconds before keeping the node.
                    deadline = time.monotonic() + RESTORE_STEP_END_GRACE_S
                    while blocker is not None and RESTORE_STEP_NAME in blocker and time.monotonic() < deadline:
                        time.sleep(0.5)
                        blocker = self.shrink_blocker(node)
                    if blocker is not None:
                        why.append(blocker)
                        continue
                    info = self.slurm.job(self.job_id)
                    if info is not None and node in info.nodes:
                        self.slurm.shrink(self.job_id, [n for n in info.nodes if n != node])
                    released.append(node)
            except TorchpassError as exc:
                why.append(str(exc))
            if why:
                log.info("node kept in the job", nodes=list(a.nodes), why="; ".join(why))
                self.post(ct.ShrinkFailed(a.migration, "; ".join(why)))
            else:
                log.info("node released from the job", nodes=released, job_id=self.job_id)
                self.post(ct.Shrunk(a.migration, tuple(released)))

        self._thread(run, "shrink")

    def _do_HandToSlurm(self, a: ct.HandToSlurm, st: CoordState) -> None:
        # slurmctld marks a node that stops answering DOWN ("Not responding") by itself after
        # SlurmdTimeout, ending the job as a node failure (requeued if requeueable). A node lost
        # outright (slurmctld confirmed it: unreachable) is also drained, with the reason, so that
        # it does not return to service by itself when its slurmd comes back: its own tpassd died
        # with it, so another node of the job witnesses for it. docs/coordinator.md, "A node lost
        # outright".
        log.warning("node handed to Slurm", node=a.node, reason=a.reason)
        drain = self.tpassd is not None and not st.node_health(a.node).reachable
        if not drain and not a.end_job:
            return
        witnesses = sorted((n for n in {*st.rank_nodes(), *(sp.node for sp in st.spares)}
                            if n != a.node and n not in st.handed and st.node_health(n).reachable),
                           key=lambda n: (st.node_health(n).state != State.HEALTHY, n))

        def drain_through_a_witness() -> None:
            tried = []
            for node in witnesses:
                try:
                    res = self.tpassd.request(node, "tpassd.drain", {"job_id": self.job_id, "reason": a.reason,
                                                                     "node": a.node}, DRAIN_TIMEOUT_S)
                except TorchpassError as exc:
                    tried.append(f"{node}: {exc}")
                    if isinstance(exc, RemoteError) and exc.code in ("forbidden", "bad_request", "conflict"):
                        break  # slurmctld's answer, the same through any witness
                    continue
                self.post(LostNodeDrain(a.node, a.reason, node, str(res.get("slurm_state") or ""), None))
                return
            self.post(LostNodeDrain(a.node, a.reason, None, "", "; ".join(tried) or "no other node of the job "
                                                                                  "has a tpassd that answers"))

        def run() -> None:
            # The drain first: the witness's tpassd drains only a node slurmctld says the job still
            # runs on, which a requeue would end.
            if drain:
                drain_through_a_witness()
            if a.end_job:
                self.post(self._end_as_node_failure(a.node))

        self._thread(run, "drain-lost")

    def _end_as_node_failure(self, node: str) -> LostNodeEnded:
        """What slurmctld does to a job without --no-kill when it marks one of its nodes DOWN, done
        now: requeue a requeueable batch job, else end the steps with a task on the node. Without it
        a job run with --no-kill (as torchpass's relaunch needs) that cannot be relaunched would keep
        its other ranks waiting in their collectives (until their timeout: 10 to 30 minutes)."""
        if self.slurm is None:
            return LostNodeEnded(node, "", "no Slurm client")
        try:
            job = self.slurm.job(self.job_id)
            if job is None or job.state != "RUNNING":
                return LostNodeEnded(node, "", f"slurmctld reports the job {job.state if job else 'gone'} already")
            if job.requeue and job.batch:
                recorded = threading.Event()
                self.post(LostNodeRequeuing(node, recorded))
                recorded.wait(REQUEUE_RECORD_WAIT_S)  # on disk first: what the requeue ends may not save it
                self.slurm.requeue(self.job_id)
                return LostNodeEnded(node, "requeued", "")
            why = ("the job is an allocation, not a batch job" if not job.batch
                   else "slurmctld does not say whether the job may be requeued" if job.requeue is None
                   else "the job is not requeueable (--no-requeue, or JobRequeue=0 in slurm.conf)")
            steps = tuple(s.step_id for s in self.slurm.steps(self.job_id) if s.user_step and node in s.nodes)
            for step in steps:
                self.slurm.cancel_step(step)
            if not steps:
                return LostNodeEnded(node, "", f"{why}; no step of the job has a task on {node} any more")
            return LostNodeEnded(node, "steps_ended", why, steps)
        except TorchpassError as exc:
            return LostNodeEnded(node, "", f"slurmctld refused or did not answer ({exc}); slurmctld's own DOWN "
                                           "handling is what remains")

    def _write_relaunch(self, pending: bool, node: str,
                        relaunch: tuple[int, list[str] | None, str] | None = None) -> None:
        """The verdict: with ``relaunch`` (count, the steps it ended (None: not known), the
        snapshot its tasks restore from ("": none, the script starts again)) a relaunch whose
        host file is written; without, the newest relaunch's again, pending or not (a pending
        flag never publishes a relaunch before its worker wrote the host file)."""
        with self._verdict_lock:
            if relaunch is not None:
                self._verdict_steps = relaunch
            count, steps, snapshot = self._verdict_steps
            text = f"count={count}\npending={int(pending)}\nnode={node}\n"
            if steps is not None:  # without it srun's exit hook relaunches any srun that ends
                text += f"steps={','.join(s.split('.', 1)[1] for s in steps)}\n"
            if snapshot:  # srun's exit hook sets TORCHPASS_RESTORE_SNAPSHOT for the relaunched step
                text += f"snapshot={snapshot}\n"
            write_atomically(layout.relaunch_file(self.state_dir, self.job_id), text)

    def _do_Relaunch(self, a: ct.Relaunch, st: CoordState) -> None:
        path = layout.hostfile(self.state_dir, self.job_id)
        swap = dict(a.replaced)
        lines = path.read_text().splitlines()
        log.warning("relaunching the job's training step", job_id=self.job_id, relaunch=a.count,
                    replaced=swap, checkpoint_step=a.checkpoint_step, snapshot=a.snapshot or None)

        def run() -> None:
            # The steps with a task on a lost node are the ones to start again. Slurm ends such a
            # step only once it marks the node DOWN (SlurmdTimeout, 300 s by default); its tasks
            # on the other nodes hang in a collective until then. Ending it now lets its srun exit,
            # and its exit hook start it again, at once: after the host file and the verdict.
            ended: list[str] | None = None
            try:
                ended = [s.step_id for s in self.slurm.steps(self.job_id)
                         if s.user_step and swap.keys() & set(s.nodes)] if self.slurm is not None else None
            except TorchpassError as exc:
                log.warning("cannot list the job's steps; any srun that ends is started again",
                            job_id=self.job_id, error=str(exc))
            hosts = [swap.get(h, h) for h in lines]
            write_atomically(path, "".join(f"{h}\n" for h in hosts))
            if a.snapshot:
                # Each node the relaunched step may use gets its token before the verdict lets the
                # srun start again: without one its tasks fail rather than restore.
                failed = self.prepare_all(set(hosts), "snapshot", snapshot=a.snapshot)
                if failed:
                    log.warning("the relaunch from the snapshot is not set up on every node; the step's tasks "
                                "there fail", snapshot=a.snapshot, failed=failed)
            self._write_relaunch(False, ",".join(swap), (a.count, ended, a.snapshot))
            for step in ended or ():
                try:
                    self.slurm.cancel_step(step)
                    log.info("step on a lost node ended", job_id=self.job_id, step=step)
                except TorchpassError as exc:
                    log.warning("cannot end the step on the lost node; Slurm ends it when it marks the node DOWN",
                                job_id=self.job_id, step=step, error=str(exc))

        self._thread(run, "relaunch")

    def _do_RelaunchPossible(self, a: ct.RelaunchPossible, st: CoordState) -> None:
        self._write_relaunch(a.pending, a.node)
        log.info("relaunch verdict pending" if a.pending else "relaunch verdict no longer pending",
                 job_id=self.job_id, node=a.node)

    def check_silent(self, silent: Collection[str]) -> None:
        """Job nodes whose tpassd fell silent: ask slurmctld (in a worker, at most every
        SILENT_CHECK_S) whether each is still in the job and not answering it either; for
        each that is, post ``NodeHealthChanged(failed, unreachable)``, which decide treats as
        a node lost outright. A silent tpassd alone is ``unknown`` (a tpassd restart, a
        network blip), never a reason to act (docs/tpassd.md)."""
        now = time.monotonic()
        busy = self._silent_check is not None and self._silent_check.is_alive()
        if not silent or self.slurm is None or busy or now < self._next_silent_check:
            return
        self._next_silent_check = now + SILENT_CHECK_S
        nodes = sorted(silent)

        def run() -> None:
            try:
                job = self.slurm.job(self.job_id)
                views = {n.name: n for n in self.slurm.nodes()}
            except TorchpassError as exc:
                log.info("cannot ask slurmctld about silent nodes", nodes=nodes, error=str(exc))
                return
            for node in nodes:
                why = slurm_lost(job, views.get(node))
                if why:
                    log.warning("node lost outright", node=node, why=why)
                    self.post(ct.NodeHealthChanged(node, "failed", (why,), reachable=False))

        self._silent_check = self._thread(run, "silent-nodes")

    def steps(self) -> list[subprocess.Popen]:
        """Every restore step this executor started (at a gate or restoring)."""
        return [p for mv in self.moves.values() for p in [*(g.proc for g in mv.gates.values()),
                                                          *mv.restores.values()]]

    def close(self) -> None:
        self._deferred = []  # nothing new starts at the end
        for mv in self.moves.values():
            for rank, gate in list(mv.gates.items()):
                try:
                    write_gate(gate.go, "cancel")
                except OSError:
                    pass
                mv.restores.setdefault(-1 - rank, gate.proc)  # ended below like the others
            mv.gates = {}
        for proc in self.steps():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        # Companion allocations live only as long as the coordinator (the job).
        companions, self.companions = dict(self.companions), {}
        for alloc, node in companions.items():
            log.info("cancelling companion spare allocation", allocation=alloc, node=node)
            self._cancel(alloc)


# Driver.pump: with nothing new, decide (and read the health view) this often; after progress
# reports only, at most this often (a report changes a rank's pace and stall clock, which are
# read in seconds, not milliseconds).
IDLE_TICK_S = 0.2
PROGRESS_TICK_S = 0.05
HEALTH_POLL_S = 0.1  # the health view is read at most this often (each read copies every node's)


def _ready_marks(st: CoordState) -> tuple[float | None, float | None]:
    return (st.migration.ready_at if st.migration is not None else None,
            st.snapshot.ready_at if st.snapshot is not None else None)


def _routine_ack(before: CoordState, after: CoordState, outcome: Any) -> bool:
    """A rank's acknowledgment that completed nothing: decided on the progress tick, like a progress
    report, not at the end of its batch (issue 13: a pause of 8,192 ranks brings 16,384 of them).
    A refused or unprotected pause, and the acknowledgment that completes the phase, are decided
    on at once."""
    if isinstance(outcome, (mc.Quiesced, mc.Resumed)) or (
            isinstance(outcome, mc.Armed) and outcome.accepted and not outcome.unprotected):
        return _ready_marks(before) == _ready_marks(after)
    return False


class Driver:
    """Owns the decision state; everything here runs in the serve thread."""

    def __init__(self, job: JobState, policy: CoordinatorPolicy, executor: Executor | None = None, *,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 health: Any = None, spares: tuple[str, ...] = (), initial: CoordState | None = None):
        self.job = job
        self.policy = policy
        self.clock = clock
        self.wall = wall
        # initial: a job resumed after `tpassctl snapshot --stop` (decide.resumed_from_stop)
        self.state = initial if initial is not None else CoordState(job_id=job.job_id)
        self.reasons = mc.ReasonLog()
        self.queue: queue.Queue = queue.Queue()
        self.executor = executor
        self.health = health
        self._fed_health: dict[str, tuple] = {}
        self._next_decide = 0.0
        self._owned: dict | None = None  # the ranks dict of a batch (begin_batch), written in place
        self._batch_fed = False  # an outcome was fed during the batch: decide at its end
        self._progress_fed = False  # progress reports applied since the last decision
        self._last_decide = float("-inf")
        self._next_health = 0.0
        self._health_news = False  # health_changed(): a node's state changed since the last poll
        self._snapshots = 0  # snapshots asked of this coordinator (accept_snapshot)
        self._waker: Callable[[], None] | None = None  # the serve loop's wake-up (set_waker)
        for s in spares:
            self.state = mc.apply(self.state, ct.SpareAdded(s, SpareHow.HOT), clock())

    def set_waker(self, waker: Callable[[], None] | None) -> None:
        """What post() and health_changed() call to wake the serve loop (CoordinatorServer.wake)."""
        self._waker = waker

    def _wake(self) -> None:
        waker = self._waker
        if waker is not None:
            waker()

    def post(self, outcome: Any) -> None:
        """Thread-safe: queue an outcome for the serve thread, and wake it."""
        self.queue.put(outcome)
        self._wake()

    def feed(self, outcome: Any) -> None:
        """Apply ``outcome`` and decide now; within a batch (begin_batch) decide once at its end."""
        before = self.state
        self.state = mc.apply(before, outcome, self.clock(), owned=self._owned)
        if self._owned is None:
            self.decide()
        elif isinstance(outcome, mc.RankProgress) or _routine_ack(before, self.state, outcome):
            self._progress_fed = True  # decided on the next progress tick (pump)
        else:
            self._batch_fed = True

    def begin_batch(self) -> None:
        """The server read a batch of messages: their outcomes apply to one private copy of the
        ranks (machine.apply ``owned``), and end_batch() decides once for all of them."""
        if self._owned is None:
            self._own_ranks()
            self._batch_fed = False

    def _own_ranks(self) -> None:
        """A batch begins: its outcomes write into a private copy of the ranks and of the pause's
        or resume's acknowledgment sets (machine.thaw_acks) until _release_ranks()."""
        st = self.state
        self.state = mc.thaw_acks(st.carry_views(replace(st, ranks=dict(st.ranks)), copied_ranks=True))
        self._owned = self.state.ranks

    def _release_ranks(self) -> None:
        self._owned = None
        self.state = mc.freeze_acks(self.state)

    def end_batch(self) -> None:
        """Stop writing into the batch's ranks, then pump (drain, health, decide once)."""
        self._release_ranks()
        fed, self._batch_fed = self._batch_fed, False
        self.pump(force=fed)

    def decide(self) -> None:
        now = self.clock()
        if dc.periodic_snapshot_due(now, self.state, self.policy):
            self._periodic_snapshot()
        d = dc.decide(now, self.state, self.policy)
        self.state = self.state.carry_views(d.state)
        if self.reasons.changed(d.reason):
            log.info("decision", job_id=self.job.job_id, reason=d.reason)
        for a in d.actions:
            if self.executor is not None:
                self.executor.perform(a, self.state)

    def accept_operator(self, node: str, to: str | None) -> str:
        self.state, mid = mc.accept_operator(self.state, node, to, self.clock())
        return mid

    def accept_snapshot(self, wall: float, trigger: str = "operator", stop: bool = False) -> str:
        """Queue a whole-job snapshot (OperatorRejected if refused; ``stop``: then hold the job); its
        id: the UTC time asked, and a count that keeps two ids of one second apart."""
        self._snapshots += 1
        sid = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(wall))}-{self._snapshots}"
        self.state = mc.accept_snapshot(self.state, sid, self.clock(), trigger, stop=stop)
        return sid

    def _periodic_snapshot(self) -> None:
        """The policy's snapshot_every_s has passed (decide.periodic_snapshot_due): queue one."""
        every = self.policy.snapshot_every_s
        try:
            sid = self.accept_snapshot(self.wall(), trigger="periodic")
        except mc.OperatorRejected as exc:  # due() checked the same conditions: not expected
            log.warning("periodic snapshot refused", job_id=self.job.job_id, error=str(exc))
            return
        self.job.record(self.wall(), "snapshot.requested", f"snapshot {sid}: periodic, every {every:g}s of training",
                        snapshot=sid, trigger="periodic", every_s=every)

    def health_changed(self) -> None:
        """Any thread (the health subscriber's on_change): a node's state changed. The next pump
        reads the health view and decides at once, instead of at its next health poll
        (HEALTH_POLL_S, or the idle tick): a fault reaches decide in one pass of the serve loop."""
        self._health_news = True
        self._wake()

    def health_news(self) -> bool:
        """A node's state changed and no decision has read it yet (the server then ends its batch
        of messages early: at 8,192 ranks a batch of 512 takes the serve thread 0.1-0.3 s)."""
        return self._health_news

    def _poll_health(self) -> None:
        if self.health is None:
            return
        silent = []
        for node, (state, reasons, age) in self.health.brief().items():
            reachable = age is not None and age < 10.0
            key = (state, reasons, reachable)
            if self._fed_health.get(node) != key:
                self._fed_health[node] = key
                self.state = mc.apply(self.state, ct.NodeHealthChanged(node, state, reasons, reachable), self.clock())
            if not reachable and state != "failed":
                silent.append(node)
        # A node lost outright (power, kernel) has a silent tpassd: slurmctld confirms it or not.
        if not silent:
            return
        lost = set(silent).intersection(self.state.rank_nodes()).difference(self.state.handed)
        if lost and self.executor is not None:
            self.executor.check_silent(lost)

    def _drain(self) -> bool:
        """Apply every posted outcome (the executor sees each first); True if any but a progress
        report reached the state (progress reports: decided on the progress tick)."""
        fed = False
        while True:
            try:
                outcome = self.queue.get_nowait()
            except queue.Empty:
                return fed
            if self.executor is not None and self.executor.observe(outcome):
                continue
            if isinstance(outcome, AbortsFinished):
                continue  # no executor to act on it
            self.state = mc.apply(self.state, outcome, self.clock(), owned=self._owned)
            if isinstance(outcome, mc.RankProgress):
                self._progress_fed = True
            else:
                fed = True

    def pump(self, force: bool = False) -> None:
        """Drain posted outcomes, follow health, decide on a tick (or when ``force`` or anything
        was drained: once for all of them)."""
        if self._owned is None and self.queue.qsize() > 1:  # one copy of the ranks for all of them
            self._own_ranks()
            try:
                fed = self._drain()
            finally:
                self._release_ranks()
        else:
            fed = self._drain()
        fed = fed or force
        now = self.clock()
        news, self._health_news = self._health_news, False
        # Progress reports are many (every rank every 0.5 s) and urgent to nobody: they are decided
        # on at most every PROGRESS_TICK_S, everything else at once, and nothing new every 0.2 s.
        if self._progress_fed and now >= self._last_decide + PROGRESS_TICK_S:
            fed = True
        if fed or news or now >= self._next_decide:
            if news or now >= self._next_health:  # the health view costs a pass over every node
                self._poll_health()
                self._next_health = now + HEALTH_POLL_S
            self._next_decide = now + IDLE_TICK_S
            self._last_decide = now
            self._progress_fed = False
            self.decide()

    def close(self) -> None:
        """The serve loop ends: record outcomes still queued (a companion granted just now), then
        stop the executor's restore steps and cancel its companion allocations. The serve loop
        ends with the job: a migration that was only releasing its source node is recorded as
        complete (decide.job_ended), not lost with the coordinator."""
        self._drain()
        d = dc.job_ended(self.clock(), self.state, self.policy)
        self.state = self.state.carry_views(d.state)
        if self.executor is not None:
            for a in d.actions:  # events only: nothing new starts at the end
                self.executor.perform(a, self.state)
            self.executor.close()


__all__ = ["AbortsFinished", "Driver", "Executor", "Gate", "LostNodeDrain", "LostNodeEnded", "LostNodeRequeuing",
           "Move", "TpassdClient", "resume_port"]
