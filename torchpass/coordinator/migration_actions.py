"""A migration's actions: pause the ranks (PauseAt), dump the moving ranks (MigrationDump) on the
source's tpassd, verify the images on the target (Transfer), restore them there (Restore), end
the source copies (KillSource), resume (Resume), or call the move off (AbortRestore,
ResumeInPlace), and drain the source (Drain). docs/coordinator.md, "Migration end to end".

``moves`` (migration -> ``Move``) is this part's bookkeeping: held ranks, dump results, restore
steps waiting at their gates or restoring, aborts of restored copies, a pending rollback.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog

from torchpass import layout, wire
from torchpass.checkpoint.restore_gate import write_gate
from torchpass.coordinator import contract as ct
from torchpass.coordinator.decide_common import in_place_master
from torchpass.coordinator.executor_ports import DRAIN_TIMEOUT_S, ExecutorPorts
from torchpass.coordinator.model import CoordState
from torchpass.coordinator.rank_commands import RankCommands, hold_deadline_s
from torchpass.coordinator.restore_steps import Gate, RestoreSteps
from torchpass.errors import RemoteError, TorchpassError
from torchpass.slurm.gres import PlacementRefused, check_same_driver

log = structlog.get_logger("torchpass.coordinator.executor")

# How long a rollback waits for a called-off restore step (srun ending it, with the copy)
ABORT_WAIT_S = 15.0
# How often a restore's waiter reads the rank record for "restored" while the job stands still.
RESTORE_POLL_S = 0.002
# srun's line when slurmctld refused the step itself (no task ran). Right after slurmctld restarts it
# refuses steps ("Memory required by task is not available") until the job's nodes have registered
# again, a few seconds: the restore step is launched again for up to this long, with backoff.
STEP_NOT_CREATED = "Unable to create step for job"
STEP_CREATE_RETRY_S = 30.0

# tpassd answers tpassd.health from memory (its last sample): milliseconds. Asked while the job
# stands still, so a node that does not answer in this long is not waited for.
DRIVER_QUERY_TIMEOUT_S = 2.0

def _read_from(path: Path, offset: int) -> str:
    """What was appended to ``path`` since ``offset`` ("" when it is not there)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


@dataclass
class Move:
    """What the executor keeps about one migration (``Executor.moves[migration]``)."""

    hold: tuple[int, ...] = ()  # ranks told to hold after quiescing (PauseAt.hold_ranks)
    hold_tasks: tuple[int, ...] = ()  # their tasks (what tpassd knows; see task_unit)
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


# tpassd, the rank wrapper and the restore step know a Slurm task (its rank record's key), not
# a rank. Under srun a task holds one rank (its own number); under torchrun a task is the agent
# with all its workers. The decision core still speaks of ranks: for a task of several ranks,
# its lowest rank (its leader) does the task's work and reports the outcome for every rank of
# the task; the others' actions do nothing.
def _gpu_pairs(rec: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """The restored rank's GPU remap as its record gives it (the root agent's result, relayed by the
    restore wrapper): pairs of strings only, anything else reads as none. It is shown, not acted on."""
    pairs = rec.get("gpu_pairs")
    if not isinstance(pairs, list):
        return ()
    ok = [p for p in pairs if isinstance(p, list) and len(p) == 2 and all(isinstance(u, str) for u in p)]
    return tuple((p[0], p[1]) for p in ok) if len(ok) == len(pairs) else ()


def task_unit(st: CoordState, rank: int) -> tuple[int, tuple[int, ...]] | None:
    """(task, the ranks in it) when ``rank`` leads its task; None for the task's other ranks."""
    task = st.task_of(rank)
    rv = st.ranks.get(rank)
    if rv is None:
        return task, (rank,)
    ranks = tuple(r for r in st.rank_nodes().get(rv.node, ()) if st.task_of(r) == task)
    return (task, ranks) if ranks and ranks[0] == rank else None


def tasks_of(st: CoordState, ranks) -> dict[int, int]:
    """Each task of ``ranks`` with its lead (lowest) rank."""
    out: dict[int, int] = {}
    for r in sorted(ranks):
        out.setdefault(st.task_of(r), r)
    return out


class MigrationActions:
    """Performs a migration's actions; ``moves``: migration -> ``Move``."""

    def __init__(self, ports: ExecutorPorts, rank_commands: RankCommands, restore_steps: RestoreSteps, *,
                 prelaunch_restore: bool, defer: Callable[[Callable[[], None]], None]):
        self.ports = ports
        self.rank_commands = rank_commands
        self.restore_steps = restore_steps
        # Start a move's restore steps at its PauseAt (behind their gates), through ``defer``: now,
        # or once the pause's replies are sent (Executor.defer_prelaunch).
        self.prelaunch_restore = prelaunch_restore
        self._defer = defer
        self.moves: dict[str, Move] = {}
        self._restores_lock = threading.Lock()  # Move.restores: a relaunch must not revive a called-off step

    def move(self, migration: str) -> Move:
        return self.moves.setdefault(migration, Move())


    def hold_file(self, migration: str, rank: int) -> Path:
        return layout.hold_file(self.ports.state_dir, self.ports.job_id, migration, rank)

    def release(self, migration: str) -> None:
        for r in self.move(migration).hold:
            p = self.hold_file(migration, r)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.touch()

    def prelaunch(self, migration: str, rank: int, target: str, st: CoordState, generation: int) -> None:
        """Start ``rank``'s restore step on ``target`` now; it waits at its gate for the images."""
        gates = self.move(migration).gates
        old = gates.get(rank)
        if old is not None:
            if old.target == target and old.proc.poll() is None:
                return  # a re-arm: the step already waits
            self.restore_steps.stop_gate(gates.pop(rank))
        go = self.restore_steps.gate_file(migration, rank)
        go.parent.mkdir(parents=True, exist_ok=True)
        try:
            go.unlink()
        except FileNotFoundError:
            pass
        proc = self.restore_steps.spawn(ct.Restore(migration, rank, target, "", ""), st, gate=go, generation=generation)
        gates[rank] = Gate(target, proc, go, time.monotonic())

    def cancel_gates(self, migration: str) -> None:
        gates = self.move(migration).gates
        while gates:
            self.restore_steps.stop_gate(gates.pop(next(iter(gates))))

    def pause_at(self, a: ct.PauseAt, st: CoordState) -> None:
        self.move(a.migration).hold = tuple(a.hold_ranks)
        self.move(a.migration).hold_tasks = tuple(tasks_of(st, a.hold_ranks))
        self.rank_commands.urgent = tuple(a.hold_ranks)
        # What a rank does if no resume comes within deadline_s (the coordinator died): the
        # rollback's own resume in place (docs/coordinator.md, "Never left paused").
        fallback = self.rank_commands.resume_command(a.generation, in_place_master(st))
        # One command object for every rank that is not held (never modified; the server encodes
        # it once for all of them: a pause to 8,192 ranks is one batch of replies).
        cmd = {"command": wire.COMMAND_PAUSE, "at": a.at, "generation": a.generation,
               "deadline_s": hold_deadline_s(self.ports.policy), "fallback": fallback,
               "join_s": self.ports.policy.rebuild_timeout_s}  # the fallback's ranks wait this long for each other
        held = set(a.hold_ranks)
        for r in st.ranks:
            if r in held:
                p = self.hold_file(a.migration, r)
                p.parent.mkdir(parents=True, exist_ok=True)
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass
                self.rank_commands.commands[r] = {**cmd, "hold_file": str(p)}
            else:
                self.rank_commands.commands[r] = cmd
        m = st.migration
        if self.prelaunch_restore and m is not None and m.id == a.migration and m.target:
            tasks, target = tuple(tasks_of(st, a.hold_ranks)), m.target

            def prelaunch() -> None:
                for task in tasks:
                    self.prelaunch(a.migration, task, target, st, a.generation)

            self._defer(prelaunch)

    def dump(self, a: ct.MigrationDump, st: CoordState) -> None:
        gen = st.migration.generation if st.migration else st.generation + 1
        unit = task_unit(st, a.rank)
        if unit is None:
            return  # its task's lead dumps the task and reports for this rank too
        task, ranks = unit
        body = {"job_id": self.ports.job_id, "rank": task, "generation": gen, "op": "dump",
                "rank_dir": str(self.ports.rank_dir)}

        def run() -> None:
            try:
                res = self.ports.tpassd.request(a.node, "tpassd.snapshot", body, self.ports.policy.dump_timeout_s)
            except TorchpassError as exc:
                self.ports.post(ct.MigrationDumpFailed(a.migration, a.rank, str(exc)))
                return
            durations = {k: res[k] for k in ("criu_dump_s", "total_s") if isinstance(res.get(k), (int, float))}
            durations["image_mb"] = round(res.get("bytes", 0) / 1e6, 1)
            for r in ranks:
                self.ports.post(ct.MigrationDumpDone(a.migration, r, res["images"], res["checksum"], durations,
                                                     result=res))

        self.ports.thread(run, f"snapshot-{task}")

    def transfer(self, a: ct.Transfer, st: CoordState) -> None:
        unit = task_unit(st, a.rank)
        if unit is None:
            return  # its task's lead verifies the task's images and reports for this rank too
        task, ranks = unit
        body = {"job_id": self.ports.job_id, "rank": task, "op": "verify", "images": a.image, "checksum": a.checksum}

        def run() -> None:
            t0 = time.monotonic()
            try:
                if self.may_hold_gpus():
                    self.same_gpu_driver(a.source, a.target)
            except PlacementRefused as exc:
                self.ports.post(ct.TransferFailed(a.migration, a.rank, a.target, str(exc)))
                return
            try:
                self.ports.tpassd.request(a.target, "tpassd.restore", body, self.ports.policy.transfer_timeout_s)
            except RemoteError as exc:
                self.ports.post(ct.TransferFailed(a.migration, a.rank, a.target, str(exc)))
                return
            except TorchpassError as exc:  # the target's tpassd does not answer: the target is lost
                self.ports.post(ct.TransferFailed(a.migration, a.rank, a.target, str(exc), target_lost=True))
                return
            for r in ranks:
                self.ports.post(ct.TransferDone(a.migration, r, a.target, a.image, a.checksum,
                                          {"verify_s": round(time.monotonic() - t0, 4)}))

        self.ports.thread(run, f"transfer-{task}")

    def gpu_driver(self, node: str) -> str | None:
        """``node``'s NVIDIA driver version as its tpassd reads it through NVML; None without GPUs,
        without NVML, or when its tpassd does not answer (a lost source: nothing to compare)."""
        try:
            health = self.ports.tpassd.request(node, "tpassd.health", {}, DRIVER_QUERY_TIMEOUT_S)
        except TorchpassError:
            return None
        driver = health.get("gpu_driver") if isinstance(health, dict) else None
        return driver if isinstance(driver, str) and driver else None

    def may_hold_gpus(self) -> bool:
        """False when Slurm's record of the training step gives its tasks no GPU (gres/gpu in its
        TRES): then no rank holds CUDA state, and no tpassd is asked for its driver. True when it
        does, or when the record cannot be read (the drivers are compared then, as for a GPU job)."""
        share = self.restore_steps.task_share()
        return share is None or share.gpus > 0

    def same_gpu_driver(self, source: str, target: str) -> None:
        """PlacementRefused (one line) when the target's NVIDIA driver is not the source's: a CUDA
        checkpoint is restored by the same driver only. Asked before the images are verified on
        the target, so the move rolls back before any restore step starts. A target without GPUs
        is not compared here: its restore step refuses a GPU rank (too few GPUs)."""
        target_driver = self.gpu_driver(target)
        if target_driver is None:
            return
        source_driver = self.gpu_driver(source)
        if source_driver is not None:
            check_same_driver(source_driver, target_driver)

    def restore(self, a: ct.Restore, st: CoordState) -> None:
        unit = task_unit(st, a.rank)
        if unit is None:
            return  # its task's lead restores the task and reports for this rank too
        task, ranks = unit
        asked, a = a, replace(a, rank=task)  # from here on: the task, as the restore step knows it
        rec_path = layout.rank_record(self.ports.rank_dir, self.ports.job_id, a.rank)
        errf = self.restore_steps.restore_err(a)
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
                self.restore_steps.stop_gate(gate)
            proc = self.restore_steps.spawn(a, st)
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
                        self.ports.post(ct.RestoreDone(a.migration, r, a.target, {
                            "step_s": round(time.monotonic() - t0, 4),
                            "criu_restore_s": rec.get("restore_s", 0.0)}, _gpu_pairs(rec)))
                    return
                rc = proc.poll()
                if rc is not None and rc != 0 and time.monotonic() - t0 < STEP_CREATE_RETRY_S \
                        and STEP_NOT_CREATED in _read_from(errf, err_from):
                    time.sleep(min(2.0, 0.25 * 2 ** (tries - 1)))
                    with self._restores_lock:
                        if mv.restores.get(a.rank) is proc:  # not called off meanwhile
                            err_from = errf.stat().st_size if errf.exists() else 0
                            proc = self.restore_steps.spawn(a, st)
                            mv.restores[a.rank] = proc
                            tries += 1
                            log.info("slurmctld refused the restore step; launched again", rank=a.rank,
                                     target=a.target, attempt=tries)
                            continue
                if rc is not None:
                    # This launch's lines only (the file also has earlier launches' refusals).
                    tail = " | ".join(_read_from(errf, err_from).strip().splitlines()[-4:])
                    again = f" (launched {tries} times)" if tries > 1 else ""
                    self.ports.post(ct.RestoreFailed(asked.migration, asked.rank, a.target,
                                               f"restore step exited {rc} before the rank was restored{again}: {tail}"))
                    return
                # Every rank of the job stands still until this record says restored: poll finely
                # (a record read is ~50 us; at 10 ms the wait added 5 ms on average).
                time.sleep(RESTORE_POLL_S)

        self.ports.thread(run, f"restore-{a.rank}")

    def abort_restore(self, a: ct.AbortRestore, st: CoordState) -> None:
        self.cancel_gates(a.migration)
        mv = self.move(a.migration)
        for r, lead in tasks_of(st, a.ranks).items():  # r: the task
            with self._restores_lock:
                proc = mv.restores.pop(r, None)
            res = mv.dumps.get(lead) or {}

            def run(proc=proc, r=r, images=res.get("images")) -> None:
                if images:
                    try:
                        self.ports.tpassd.request(a.target, "tpassd.restore",
                                            {"job_id": self.ports.job_id, "rank": r, "op": "abort", "images": images,
                                             "rank_dir": str(self.ports.rank_dir)}, 10.0)
                    except TorchpassError as exc:
                        log.warning("abort of a restored rank failed", rank=r, target=a.target, error=str(exc))
                        self.give_record_back(r, a.target, images)
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

            mv.aborts.append(self.ports.thread(run, f"abort-{r}"))

    def give_record_back(self, task: int, target: str, images: str) -> None:
        """The target's tpassd did not abort the restored copy (it did not answer, or refused):
        its rank record still names that copy, which srun's end of the step kills now. Left so,
        the copy the move started from would write no exit code when the rank ends (the record
        names another copy) and the killed one none either: the rank's first task wrapper, which
        Slurm tracks, would wait for an exit code for ever and the job would never end. So the
        record goes back to the copy the move started from here, as tpassd's abort does (the
        record is the job's own file, written by its wrappers as the job's user; root acts on
        none of it without checking the pids itself)."""
        path = layout.rank_record(self.ports.rank_dir, self.ports.job_id, task)
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        if not isinstance(rec, dict) or rec.get("restored_from") != images or rec.get("node") != target:
            return  # it names another copy already
        prev = rec.get("previous")
        back = prev if isinstance(prev, dict) and prev.get("wrapper_pid") else {**rec, "aborted": True}
        tmp = path.with_name(f".{path.name}.coordinator")
        try:
            tmp.write_text(json.dumps(back))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("could not give the rank record back to the copy the move started from", rank=task,
                        target=target, error=str(exc))
            return
        log.info("rank record given back to the copy the move started from", rank=task, target=target,
                 record_now="previous" if back is prev else "aborted")

    def kill_source(self, a: ct.KillSource, st: CoordState) -> None:
        dumps = {task: self.move(a.migration).dumps.get(lead) for task, lead in tasks_of(st, a.ranks).items()}
        missing = [r for r, res in dumps.items() if res is None]
        if missing:
            self.ports.post(ct.KillFailed(a.migration, a.node, f"no dump record of rank {missing[0]}"))
            return
        if not dumps:
            self.ports.post(ct.SourceKilled(a.migration, a.node))
            return
        # One request for the node's tasks: its tpassd checks every copy before it kills any (a
        # refusal leaves them all paused, so the rollback resumes the job where it stood) and
        # kills them at once: one round trip while the job stands still, not one per task.
        (first, res), *others = dumps.items()
        body = {"job_id": self.ports.job_id, "rank": first, "op": "kill", "pid": int(res["pid"]),
                "rank_dir": str(self.ports.rank_dir)}
        if others:
            body["tasks"] = [[r, int(o["pid"])] for r, o in others]

        def run() -> None:
            try:
                self.ports.tpassd.request(a.node, "tpassd.snapshot", body, self.ports.policy.kill_timeout_s)
            except TorchpassError as exc:
                self.ports.post(ct.KillFailed(a.migration, a.node, str(exc)))
                return
            self.ports.post(ct.SourceKilled(a.migration, a.node))

        self.ports.thread(run, "kill-source")

    def resume(self, a: ct.Resume, st: CoordState) -> None:
        # The source copies are dead: the hold files now wake only the restored ranks.
        self.rank_commands.send_resume(st.ranks, a.generation, a.master)
        self.release(a.migration)
        self.cancel_gates(a.migration)

    def resume_in_place(self, a: ct.ResumeInPlace, st: CoordState) -> None:
        self.cancel_gates(a.migration)
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
                self.ports.post(AbortsFinished(a.migration))

            self.ports.thread(wait, f"rollback-{a.migration}")
            return
        self.finish_resume_in_place(a, tuple(st.ranks), node)

    def finish_resume_in_place(self, a: ct.ResumeInPlace, ranks: tuple[int, ...], node: str | None) -> None:
        mv = self.move(a.migration)
        mv.aborts = []
        self.rank_commands.send_resume(ranks, a.generation, a.master, a.rails)
        if not (node and mv.hold and self.ports.tpassd is not None):
            self.release(a.migration)
            return

        # The hand-off is off: a later death of the source copy is a real failure. Each held task's
        # marker is set (all at once) before its hold file lets it run on. Off the serve thread: the
        # rollback often follows a source tpassd that stopped answering, and 5 s per task here
        # delayed every rank's resume as long.
        def mark(r: int) -> None:
            try:
                self.ports.tpassd.request(
                    node,
                    "tpassd.snapshot",
                    {"job_id": self.ports.job_id, "rank": r, "op": "abort", "rank_dir": str(self.ports.rank_dir)},
                    5.0,
                )
            except TorchpassError as exc:
                log.warning("could not mark the hand-off aborted", rank=r, node=node, error=str(exc))

        def mark_then_release() -> None:
            for t in [self.ports.thread(lambda r=r: mark(r), f"abort-mark-{r}") for r in mv.hold_tasks]:
                t.join()
            self.release(a.migration)

        self.ports.thread(mark_then_release, f"in-place-{a.migration}")

    def drain(self, a: ct.Drain, st: CoordState) -> None:
        # Always through the node's own tpassd (root), whoever runs the coordinator: slurmctld
        # refuses a job user's drain, and tpassd drains only a node its own health view finds
        # degraded or failed (root and SlurmUser: any). A refusal is DrainFailed: the migration
        # still completes, with a note (docs/tpassd.md, "Drains").
        def run() -> None:
            try:
                self.ports.tpassd.request(a.node, "tpassd.drain", {"job_id": self.ports.job_id, "reason": a.reason},
                                    DRAIN_TIMEOUT_S)
            except TorchpassError as exc:
                self.ports.post(ct.DrainFailed(a.migration, a.node, str(exc)))
                return
            self.ports.post(ct.Drained(a.migration, a.node))

        self.ports.thread(run, "drain")

    def observe_dump(self, outcome: ct.MigrationDumpDone) -> None:
        """Keep tpassd's dump result (pid, images): KillSource and AbortRestore need it."""
        if outcome.result:
            self.move(outcome.migration).dumps[outcome.rank] = dict(outcome.result)

    def observe_aborts_finished(self, outcome: AbortsFinished) -> None:
        """Every abort of the move's restored copies ended: its pending rollback resumes now."""
        mv = self.moves.get(outcome.migration)
        if mv is not None and mv.rollback is not None:
            a, ranks, node = mv.rollback
            mv.rollback = None
            self.finish_resume_in_place(a, ranks, node)

    def steps(self) -> list[subprocess.Popen]:
        """Every restore step started (at a gate or restoring)."""
        return [p for mv in self.moves.values() for p in [*(g.proc for g in mv.gates.values()),
                                                          *mv.restores.values()]]

    def close(self) -> None:
        """Call off every gated step and end every restore step still running."""
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
