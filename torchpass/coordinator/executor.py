"""The coordinator's executor: decide's actions in, real actions out, outcomes posted back.

``Executor`` performs each action through one explicit table, ``handlers`` (action type ->
handler), over parts with one job each:

* ``rank_commands.RankCommands``: the command each rank gets in its replies until acknowledged;
* ``restore_steps.RestoreSteps``: restore steps, their tokens and their gates;
* ``migration_actions.MigrationActions``: a migration's actions, and ``moves`` (migration ->
  ``Move``: held ranks, dump results, restore steps, gates, aborts, a pending rollback);
* ``spare_actions.SpareActions``: spares from slurmctld and giving nodes back (``companions``);
* ``lost_node_actions.LostNodeActions``: a node lost outright, the relaunch verdict;
* ``job_snapshot_actions.JobSnapshotActions``: whole-job snapshots and stopping a job.

They share one ``executor_ports.ExecutorPorts`` (the job, tpassd's and slurmctld's clients, the
outcome queue). Actions that take time (a CRIU dump through tpassd, the restore job step) run in
worker threads that only ``post`` outcomes; the serve thread (``driver.Driver``) lets the
executor record what an outcome tells it (``observe``: a dump's pid, a companion allocation)
before ``machine.apply`` sees it, and work that must wait for workers (a rollback waiting for
the aborts of restored copies) waits for an outcome of its own (``AbortsFinished``).

How each action is performed (docs/coordinator.md, "Migration end to end"):

* PauseAt / Resume / ResumeInPlace: a command per rank, sent in the reply to
  the rank's next ``rank.*`` request until acknowledged (rank.armed /
  rank.resumed). Held ranks wait for a hold file in the job's state dir,
  created by the coordinator only once the source copy is dead (Resume) or
  the move is off (ResumeInPlace).
* MigrationDump / KillSource: ``tpassd.snapshot`` (op dump / kill) to the source
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

import os
import socket
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import structlog

from torchpass.coordinator import contract as ct
from torchpass.coordinator.accounting_actions import JobAccounting
from torchpass.coordinator.executor_ports import ExecutorPorts, TpassdClient
from torchpass.coordinator.job_record import JobState
from torchpass.coordinator.job_snapshot_actions import JobSnapshotActions
from torchpass.coordinator.lost_node_actions import LostNodeActions, LostNodeDrain, LostNodeEnded, LostNodeRequeuing
from torchpass.coordinator.migration_actions import AbortsFinished, MigrationActions, Move
from torchpass.coordinator.model import CoordState
from torchpass.coordinator.policy import CoordinatorPolicy
from torchpass.coordinator.rank_commands import RankCommands
from torchpass.coordinator.restore_steps import RestoreSteps
from torchpass.coordinator.spare_actions import SpareActions
from torchpass.slurm.base import SlurmClient

log = structlog.get_logger("torchpass.coordinator.executor")

# The outcome an action that crashed posts in its stead (an action absent here posts nothing).
FAILURE_OF: dict[type, Callable[[Any, str], Any]] = {
    ct.MigrationDump: lambda a, why: ct.MigrationDumpFailed(a.migration, a.rank, why),
    ct.Transfer: lambda a, why: ct.TransferFailed(a.migration, a.rank, a.target, why),
    ct.Restore: lambda a, why: ct.RestoreFailed(a.migration, a.rank, a.target, why),
    ct.KillSource: lambda a, why: ct.KillFailed(a.migration, a.node, why),
    ct.Drain: lambda a, why: ct.DrainFailed(a.migration, a.node, why),
    ct.Shrink: lambda a, why: ct.ShrinkFailed(a.migration, why),
    ct.RequestSpare: lambda a, why: ct.SpareUnavailable(a.migration, a.strategy, why),
    ct.DumpRank: lambda a, why: ct.RankDumpFailed(a.snapshot, a.rank, why),
    ct.CommitSnapshot: lambda a, why: ct.SnapshotCommitFailed(a.snapshot, why),
}

# The executor's own outcomes: observe() records them; machine.apply never sees them.
OWN_OUTCOMES = (AbortsFinished, LostNodeDrain, LostNodeRequeuing, LostNodeEnded)


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
        self.ports = ExecutorPorts(job, state_dir=state_dir, post=post, policy=policy, tpassd=tpassd, slurm=slurm,
                                   address_of=address_of, wall=wall, python=python, srun=srun)
        self.job = job
        self.job_id = job.job_id
        # A pause's restore steps (prelaunch_restore) start after the pause's replies are sent, when
        # the caller says it will call run_deferred() then (the coordinator's server does). Each is
        # an srun forked from this process: at 8,192 ranks, started before the replies, the 8 of a
        # node held the pause back 0.1-0.26 s. They have seconds until the dump is done.
        self.defer_prelaunch = False
        self._deferred: list[Callable[[], None]] = []
        self.rank_commands = RankCommands(self.ports)
        self.restore_steps = RestoreSteps(self.ports, output)
        self.migrations = MigrationActions(self.ports, self.rank_commands, self.restore_steps,
                                           prelaunch_restore=prelaunch_restore, defer=self._defer)
        self.spares = SpareActions(self.ports, follow)
        self.lost_nodes = LostNodeActions(self.ports, self.restore_steps)
        self.job_snapshots = JobSnapshotActions(self.ports)
        self.accounting = JobAccounting(self.ports)
        m, sp, ln, js = self.migrations, self.spares, self.lost_nodes, self.job_snapshots
        # Every action type of contract.Action has its handler here (a unit test checks it).
        self.handlers: dict[type, Callable[[Any, CoordState], None]] = {
            ct.RequestSpare: sp.request_spare,
            ct.PauseAt: m.pause_at,
            ct.MigrationDump: m.dump,
            ct.Transfer: m.transfer,
            ct.Restore: m.restore,
            ct.AbortRestore: m.abort_restore,
            ct.KillSource: m.kill_source,
            ct.Resume: m.resume,
            ct.ResumeInPlace: m.resume_in_place,
            ct.Drain: m.drain,
            ct.Shrink: sp.shrink,
            ct.HandToSlurm: ln.hand_to_slurm,
            ct.Relaunch: ln.relaunch,
            ct.RelaunchPossible: ln.relaunch_possible,
            ct.Event: self.record_event,
            ct.DumpRank: js.dump_rank,
            ct.CommitSnapshot: js.commit,
            ct.DiscardSnapshot: js.discard,
            ct.StopJob: js.stop_job,
            ct.ForgetStopped: js.forget_stopped,
        }
        # What the serve thread records of an outcome before machine.apply (observe).
        self.observers: dict[type, Callable[[Any], None]] = {
            ct.MigrationDumpDone: m.observe_dump,
            ct.SpareGranted: sp.observe_granted,
            ct.Shrunk: sp.observe_shrunk,
            AbortsFinished: m.observe_aborts_finished,
            LostNodeDrain: ln.observe_drain,
            LostNodeRequeuing: ln.observe_requeuing,
            LostNodeEnded: ln.observe_ended,
        }

    # --- the clients and settings every part shares (a test may swap one) -----------------------
    policy = property(lambda self: self.ports.policy)
    state_dir = property(lambda self: self.ports.state_dir)
    rank_dir = property(lambda self: self.ports.rank_dir)
    tpassd = property(lambda self: self.ports.tpassd, lambda self, v: setattr(self.ports, "tpassd", v))
    slurm = property(lambda self: self.ports.slurm, lambda self, v: setattr(self.ports, "slurm", v))
    srun = property(lambda self: self.ports.srun, lambda self, v: setattr(self.ports, "srun", v))

    # --- the parts' state, as the server and tests read it --------------------------------------
    commands = property(lambda self: self.rank_commands.commands)
    urgent = property(lambda self: self.rank_commands.urgent,
                      lambda self, v: setattr(self.rank_commands, "urgent", v))
    moves = property(lambda self: self.migrations.moves)
    companions = property(lambda self: self.spares.companions)

    def move(self, migration: str) -> Move:
        return self.migrations.move(migration)

    def command_for(self, rank: int) -> dict[str, Any] | None:
        return self.rank_commands.command_for(rank)

    def acknowledge(self, rank: int, kind: str, generation: int, at: int | None = None) -> None:
        self.rank_commands.acknowledge(rank, kind, generation, at)

    def restore_argv(self, a: ct.Restore, jobid: int | None = None, gate: Path | None = None) -> list[str]:
        return self.restore_steps.restore_argv(a, jobid, gate)

    def gate_file(self, migration: str, rank: int) -> Path:
        return self.restore_steps.gate_file(migration, rank)

    def prepare_all(self, nodes: Collection[str], kind: str, **fields: Any) -> dict[str, str]:
        return self.restore_steps.prepare_all(nodes, kind, **fields)

    def check_silent(self, silent: Collection[str]) -> None:
        self.lost_nodes.check_silent(silent)

    def save_events(self) -> None:
        self.ports.save_events()

    def steps(self):
        """Every restore step this executor started (at a gate or restoring)."""
        return self.migrations.steps()

    # --- outcomes, seen in the serve thread ----------------------------------------------------
    def observe(self, outcome: Any) -> bool:
        """Record what a worker's outcome tells the executor (serve thread, before machine.apply).
        True: the outcome was the executor's own (``OWN_OUTCOMES``), not one for machine.apply."""
        fn = self.observers.get(type(outcome))
        if fn is not None:
            fn(outcome)
        return isinstance(outcome, OWN_OUTCOMES)

    # --- dispatch ----------------------------------------------------------------------------
    def _defer(self, fn: Callable[[], None]) -> None:
        if self.defer_prelaunch:
            self._deferred.append(fn)
        else:
            fn()

    def run_deferred(self) -> None:
        """Start what waited for the replies (see defer_prelaunch)."""
        todo, self._deferred = self._deferred, []
        for fn in todo:
            try:
                fn()
            except Exception:
                log.exception("deferred action failed")

    def perform(self, action: Any, state: CoordState) -> None:
        name = type(action).__name__
        if self._deferred and not isinstance(action, ct.PauseAt):
            self.run_deferred()  # any later action sees the restore steps started, as before
        try:
            self.handlers[type(action)](action, state)
        except Exception as exc:
            log.exception("action failed", action=name)
            failed = FAILURE_OF.get(type(action))
            if failed is not None:
                self.ports.post(failed(action, f"{type(exc).__name__}: {exc}"))

    def record_event(self, a: ct.Event, st: CoordState) -> None:
        self.job.record(self.ports.wall(), a.kind, a.message, **a.data)
        log.info("event", kind=a.kind, message=a.message)
        self.save_events()
        self.accounting.event_recorded(a.kind)  # after the save: tpassd reads the saved log

    def close(self) -> None:
        self._deferred = []  # nothing new starts at the end
        self.migrations.close()
        self.spares.close()
        self.accounting.close()


__all__ = ["FAILURE_OF", "OWN_OUTCOMES", "Executor"]
