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

How each action is performed, step by step, is in docs/coordinator.md: "Migration end to end"
(PauseAt to Resume, MigrationDump, Transfer, Restore, KillSource, Drain), "Spares (for admins)"
(RequestSpare: hot, expand, companion; Shrink) and "A node lost outright" (HandToSlurm, the
relaunch: host file, relaunch verdict, steps cancelled). What a reader of this file needs besides:

* a rank command is sent in the reply to the rank's next ``rank.*`` request, until acknowledged;
* every call to tpassd is munge-authenticated and every Slurm query or update goes through the
  ``torchpass.slurm`` client;
* the restore step is launched at PauseAt behind ``torchpass.checkpoint.restore_gate`` and let go
  at Restore, so that its launch overlaps the ranks' way to T and the dump;
* a lost node's events that may end this coordinator (``job.requeuing``) are saved before the
  call that may end it.
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
