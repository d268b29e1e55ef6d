"""The coordinator's driver and executor: decisions in, real actions out.

``Driver`` keeps the decision state (``decide.CoordState``), applies every
input and executor outcome with ``machine.apply``, calls ``decide`` and hands
the actions to ``Executor``. Everything runs in the coordinator's serve
thread: handlers call ``Driver.feed``; actions that take time (a CRIU dump
through tpassd, the restore job step) run in worker threads that only
``post`` outcomes to a queue, which the serve loop drains (``Driver.pump``).
So handlers and the decision loop never race.

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
* Restore: ``srun --jobid=J --overlap -w TARGET -N1 -n1 --torchpass=off -o
  <job output> --open-mode=append <python> -m tpassd.checkpoint.rankwrap
  --restore IMAGES``, from the batch host; done when the restore wrapper has
  recorded the restored rank. The step is started already at PauseAt (the
  target is known then) behind torchpass.coordinator.restore_gate, which
  waits for the image path: the step launch overlaps the ranks' way to T and
  the dump instead of adding to the standstill. A move called off (or sent
  to another target) cancels the gate.
* RequestSpare: one node from slurmctld (``salloc --no-shell --exclusive``
  on the job's partition/account/QOS, the job's nodes excluded). "expand":
  allocated with ``--dependency=expand:J`` and merged into the job
  (``scontrol update JobId=DONOR NumNodes=0``); "companion": kept as a
  one-node job of its own, named ``torchpass-spare-J``, whose only step is
  the restore; cancelled when the coordinator exits. The new node's tpassd is
  followed from then on.
* Drain: torchpass.slurm client. Shrink: ``scontrol update JobId=J
  NodeList=<the rest>`` only when no step of the job still runs on the node
  (the source's task wrapper waits for the moved rank's exit code: releasing
  its node would kill it and fail the step); a companion node is released by
  cancelling its allocation.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from torchpass import auth, zmqio
from torchpass.coordinator import decide as dc
from torchpass.coordinator import machine as mc
from torchpass.coordinator.policy import CoordinatorPolicy
from torchpass.coordinator.restore_gate import write_gate
from torchpass.coordinator.state import JobState
from torchpass.errors import RemoteError, SlurmError, TorchpassError

log = structlog.get_logger("torchpass.coordinator.executor")

TPASSD_CONTROL_PORT = 7718
TPASSD_PUB_PORT = 7717
RESTORE_STEP_NAME = "torchpass-restore-"  # job name of restore steps (-J torchpass-restore-RANK)
RESTORE_STEP_END_GRACE_S = 10.0
# How long a rollback waits for a called-off restore step (srun ending it, with the copy)
ABORT_WAIT_S = 15.0


def rank_state_dir(state_dir: str | os.PathLike, job_id: int) -> Path:
    """Where rankwrap keeps the job's rank records (shared by every node of the job)."""
    return Path(state_dir) / "jobs" / str(job_id) / "ranks"


def hold_file(state_dir: str | os.PathLike, job_id: int, migration: str, rank: int) -> Path:
    return Path(state_dir) / "jobs" / str(job_id) / "hold" / f"{migration}.rank{rank}"


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
        slurm: Any = None,
        address_of: Callable[[str], str] = socket.gethostbyname,
        wall: Callable[[], float] = time.time,
        python: str = sys.executable,
        srun: str = "srun",
        follow: Callable[[str], None] | None = None,
        prelaunch_restore: bool = True,
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
        self.commands: dict[int, dict[str, Any]] = {}  # rank -> command repeated until acknowledged
        self.hold_ranks: dict[str, tuple[int, ...]] = {}  # migration -> ranks told to hold
        self.source_pids: dict[tuple[str, int], dict[str, Any]] = {}  # (migration, rank) -> dump result
        self.restores: dict[tuple[str, int], subprocess.Popen] = {}
        # Restore steps started at PauseAt, waiting at their gate: (migration, rank) ->
        # (target, process, gate file, started at)
        self.prelaunch_restore = prelaunch_restore
        self.gates: dict[tuple[str, int], tuple[str, subprocess.Popen, Path, float]] = {}
        self._output: str | None = None
        self.follow = follow  # (node) -> None: follow a new spare's tpassd
        self.companions: dict[int, str] = {}  # companion allocation -> node (cancelled at close)
        self.aborting: dict[str, list[threading.Thread]] = {}  # migration -> abort threads of restored copies
        self._lock = threading.Lock()

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

    def _hold(self, migration: str, rank: int) -> Path:
        return hold_file(self.state_dir, self.job_id, migration, rank)

    def _release(self, migration: str) -> None:
        for r in self.hold_ranks.get(migration, ()):
            p = self._hold(migration, r)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.touch()

    def _resume_cmd(self, ranks, generation: int, master: str) -> None:
        addr = self.address_of(master) if master else "127.0.0.1"
        cmd = {"command": "resume", "generation": generation, "master_addr": addr,
               "master_port": resume_port(self.job_id, generation, self.policy.rendezvous_port_range())}
        for r in ranks:
            self.commands[r] = dict(cmd)

    # --- dispatch ----------------------------------------------------------------------------
    def perform(self, action: Any, state: dc.CoordState) -> None:
        name = type(action).__name__
        try:
            getattr(self, f"_do_{name}")(action, state)
        except Exception as exc:  # noqa: BLE001 - an action that crashed is a failed action
            log.exception("action failed", action=name)
            self._fail(action, f"{type(exc).__name__}: {exc}")

    def _fail(self, a: Any, why: str) -> None:
        fails = {
            dc.Snapshot: lambda: mc.SnapshotFailed(a.migration, a.rank, why),
            dc.Transfer: lambda: mc.TransferFailed(a.migration, a.rank, a.target, why),
            dc.Restore: lambda: mc.RestoreFailed(a.migration, a.rank, a.target, why),
            dc.KillSource: lambda: mc.KillFailed(a.migration, a.node, why),
            dc.Drain: lambda: mc.DrainFailed(a.migration, a.node, why),
            dc.Shrink: lambda: mc.ShrinkFailed(a.migration, why),
            dc.RequestSpare: lambda: mc.SpareUnavailable(a.migration, a.strategy, why),
        }
        f = fails.get(type(a))
        if f is not None:
            self.post(f())

    def _thread(self, fn: Callable[[], None], name: str) -> threading.Thread:
        t = threading.Thread(target=fn, name=name, daemon=True)
        t.start()
        return t

    # --- actions -------------------------------------------------------------------------------
    def _do_Event(self, a: dc.Event, st: dc.CoordState) -> None:
        self.job.record(self.wall(), a.kind, a.message, **a.data)
        log.info("event", kind=a.kind, message=a.message)
        self.save_events()

    def save_events(self) -> None:
        """STATE_DIR/jobs/J/events.json: the event log outlives the coordinator (tpassctl, tests)."""
        d = self.state_dir / "jobs" / str(self.job_id)
        try:
            tmp = d / f".events.json.{os.getpid()}"
            tmp.write_text(json.dumps([e.as_dict() for e in self.job.events]))
            os.replace(tmp, d / "events.json")
        except OSError as exc:
            log.warning("cannot save the event log", error=str(exc))

    def spare_request(self, a: dc.RequestSpare, st: dc.CoordState) -> Any:
        """The salloc request for a spare: same partition/account/QOS as the job, none of its nodes."""
        from torchpass.slurm import SpareRequest

        info = self.slurm.job(self.job_id)
        if info is None or not info.active:
            raise SlurmError(f"job {self.job_id} is {'gone' if info is None else info.state}")
        with self._lock:
            companions = set(self.companions.values())
        exclude = sorted(set(info.nodes) | {s.node for s in st.spares} | companions)
        limit = None
        if info.end_time is not None:
            limit = max(1, int((info.end_time - self.wall()) // 60) + 1)  # never outlive the job
        return SpareRequest(
            job_id=self.job_id, name=f"torchpass-spare-{self.job_id}",
            comment=f"torchpass: {a.strategy} spare for job {self.job_id} ({a.migration}, replacing {a.for_node})",
            exclude=tuple(exclude), partition=info.partition, account=info.account, qos=info.qos,
            time_limit_min=limit, immediate_s=max(1, int(min(self.policy.spare_timeout_s, 60.0))),
            expand=a.strategy == "expand",
        )

    def _do_RequestSpare(self, a: dc.RequestSpare, st: dc.CoordState) -> None:
        if a.strategy not in ("expand", "companion"):
            self.post(mc.SpareUnavailable(a.migration, a.strategy, f"unknown spare strategy {a.strategy!r}"))
            return
        if self.slurm is None:
            self.post(mc.SpareUnavailable(a.migration, a.strategy, "no Slurm client"))
            return

        def run() -> None:
            t0 = time.monotonic()
            try:
                req = self.spare_request(a, st)
                alloc, node = self.slurm.allocate(req)
                if a.strategy == "expand":
                    try:
                        self.slurm.merge_into(alloc, self.job_id)
                    except TorchpassError:
                        self._cancel(alloc)
                        raise
                else:
                    with self._lock:
                        self.companions[alloc] = node
            except TorchpassError as exc:
                log.warning("no spare from slurmctld", strategy=a.strategy, migration=a.migration, error=str(exc))
                self.post(mc.SpareUnavailable(a.migration, a.strategy, str(exc)))
                return
            log.info("spare obtained from slurmctld", strategy=a.strategy, node=node, allocation=alloc,
                     job_id=self.job_id, seconds=round(time.monotonic() - t0, 3))
            if self.follow is not None:
                try:
                    self.follow(node)
                except (OSError, TorchpassError) as exc:
                    log.warning("cannot follow the new spare's health", node=node, error=str(exc))
            self.post(mc.SpareGranted(a.migration, node, a.strategy, allocation=alloc))

        self._thread(run, f"spare-{a.strategy}")

    def _cancel(self, alloc: int) -> None:
        try:
            self.slurm.cancel(alloc)
        except TorchpassError as exc:
            log.warning("could not cancel a spare allocation", allocation=alloc, error=str(exc))

    def _do_PauseAt(self, a: dc.PauseAt, st: dc.CoordState) -> None:
        self.hold_ranks[a.migration] = tuple(a.hold_ranks)
        for r in st.ranks:
            cmd = {"command": "pause", "at": a.at, "generation": a.generation}
            if r in a.hold_ranks:
                p = self._hold(a.migration, r)
                p.parent.mkdir(parents=True, exist_ok=True)
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass
                cmd["hold_file"] = str(p)
            self.commands[r] = cmd
        m = st.migration
        if self.prelaunch_restore and m is not None and m.id == a.migration and m.target:
            for r in a.hold_ranks:
                self._prelaunch(a.migration, r, m.target, st)

    def _do_Snapshot(self, a: dc.Snapshot, st: dc.CoordState) -> None:
        gen = st.migration.generation if st.migration else st.generation + 1
        body = {"job_id": self.job_id, "rank": a.rank, "generation": gen, "op": "dump",
                "rank_dir": str(rank_state_dir(self.state_dir, self.job_id))}

        def run() -> None:
            try:
                res = self.tpassd.request(a.node, "tpassd.snapshot", body, self.policy.dump_timeout_s)
            except TorchpassError as exc:
                self.post(mc.SnapshotFailed(a.migration, a.rank, str(exc)))
                return
            self.source_pids[(a.migration, a.rank)] = res
            durations = {k: res[k] for k in ("criu_dump_s", "total_s") if isinstance(res.get(k), (int, float))}
            durations["image_mb"] = round(res.get("bytes", 0) / 1e6, 1)
            self.post(mc.SnapshotDone(a.migration, a.rank, res["images"], res["checksum"], durations))

        self._thread(run, f"snapshot-{a.rank}")

    def _do_Transfer(self, a: dc.Transfer, st: dc.CoordState) -> None:
        body = {"job_id": self.job_id, "rank": a.rank, "op": "verify", "images": a.image, "checksum": a.checksum}

        def run() -> None:
            t0 = time.monotonic()
            try:
                self.tpassd.request(a.target, "tpassd.restore", body, self.policy.transfer_timeout_s)
            except RemoteError as exc:
                self.post(mc.TransferFailed(a.migration, a.rank, a.target, str(exc)))
                return
            except TorchpassError as exc:  # the target's tpassd does not answer: the target is lost
                self.post(mc.TransferFailed(a.migration, a.rank, a.target, str(exc), target_lost=True))
                return
            self.post(mc.TransferDone(a.migration, a.rank, a.target, a.image, a.checksum,
                                      {"verify_s": round(time.monotonic() - t0, 4)}))

        self._thread(run, f"transfer-{a.rank}")

    def job_output(self) -> str:
        """The job's stdout file (where the restored rank's lines go)."""
        if self._output is None:
            path = ""
            try:
                out = subprocess.run(["scontrol", "show", "job", str(self.job_id), "--json"], capture_output=True,
                                     text=True, timeout=15)
                jobs = json.loads(out.stdout or "{}").get("jobs", [])
                path = jobs[0].get("standard_output", "") if jobs else ""
            except (OSError, ValueError, subprocess.SubprocessError):
                path = ""
            self._output = path or str(self.state_dir / "jobs" / str(self.job_id) / "restored-ranks.out")
        return self._output

    def restore_err(self, a: dc.Restore) -> Path:
        """srun's stderr plus the restore wrapper's reason for failing: the rollback event quotes its
        tail (the wrapper's own stderr goes to the job's output with the restored rank's)."""
        return self.state_dir / "jobs" / str(self.job_id) / f"restore-{a.migration}-rank{a.rank}.err"

    def restore_argv(self, a: dc.Restore, jobid: int | None = None, gate: Path | None = None) -> list[str]:
        """The restore step: in the job itself, or in the companion allocation that holds the target.
        With ``gate``: the step waits for the image path in that file (restore_gate)."""
        if gate is None:
            prog = ["-m", "tpassd.checkpoint.rankwrap", "--restore", a.image]
        else:
            p = self.policy
            wait = (p.pause_timeout_s * (1 + p.max_pause_rearms) + p.dump_timeout_s
                    + p.transfer_timeout_s * p.max_spare_attempts + 60.0)
            prog = ["-m", "torchpass.coordinator.restore_gate", str(gate), f"{wait:g}", "--"]
        return [self.srun, f"--jobid={jobid or self.job_id}", "--overlap", "-w", a.target, "-N1", "-n1",
                "--torchpass=off", "-o", self.job_output(), "--open-mode=append", "-J", f"{RESTORE_STEP_NAME}{a.rank}",
                self.python, *prog,
                "--state-dir", str(rank_state_dir(self.state_dir, self.job_id)),
                "--error-file", str(self.restore_err(a))]

    def gate_file(self, migration: str, rank: int) -> Path:
        return self.state_dir / "jobs" / str(self.job_id) / f"restore-{migration}-rank{rank}.go"

    def _spawn_restore(self, a: dc.Restore, st: dc.CoordState, gate: Path | None = None) -> subprocess.Popen:
        sp = st.spare(a.target)
        argv = self.restore_argv(a, sp.allocation if sp is not None and sp.how == "companion" else None, gate)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SPANK_", "TORCHPASS_"))
               or k == "SLURM_CONF"}
        errf = self.restore_err(a)
        errf.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=open(errf, "ab"), start_new_session=True)
        log.info("restore step launched", rank=a.rank, target=a.target, argv=argv, gated=gate is not None)
        return proc

    def _prelaunch(self, migration: str, rank: int, target: str, st: dc.CoordState) -> None:
        """Start ``rank``'s restore step on ``target`` now; it waits at its gate for the images."""
        old = self.gates.get((migration, rank))
        if old is not None:
            if old[0] == target and old[1].poll() is None:
                return  # a re-arm: the step already waits
            self._stop_gate(self.gates.pop((migration, rank)))
        go = self.gate_file(migration, rank)
        go.parent.mkdir(parents=True, exist_ok=True)
        try:
            go.unlink()
        except FileNotFoundError:
            pass
        proc = self._spawn_restore(dc.Restore(migration, rank, target, "", ""), st, gate=go)
        self.gates[(migration, rank)] = (target, proc, go, time.monotonic())

    def _stop_gate(self, gate: tuple[str, subprocess.Popen, Path, float]) -> None:
        """Call off a waiting restore step: it exits 0 at its gate (killed if it does not)."""
        _target, proc, go, _t = gate
        try:
            write_gate(go, "cancel")
        except OSError:
            pass

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

    def _cancel_gates(self, migration: str | None = None) -> None:
        for key in [k for k in self.gates if migration is None or k[0] == migration]:
            self._stop_gate(self.gates.pop(key))

    def _do_Restore(self, a: dc.Restore, st: dc.CoordState) -> None:
        rec_path = rank_state_dir(self.state_dir, self.job_id) / f"job{self.job_id}" / f"rank{a.rank}.json"
        errf = self.restore_err(a)
        gate = self.gates.pop((a.migration, a.rank), None)
        t0 = time.monotonic()
        if gate is not None and gate[0] == a.target and gate[1].poll() is None:
            proc = gate[1]
            write_gate(gate[2], f"restore {a.image}")
            log.info("restore step released at its gate", rank=a.rank, target=a.target,
                     waited_s=round(t0 - gate[3], 3))
        else:
            if gate is not None:
                self._stop_gate(gate)
            proc = self._spawn_restore(a, st)
        self.restores[(a.migration, a.rank)] = proc

        def run() -> None:
            while True:
                try:
                    rec = json.loads(rec_path.read_text())
                except (OSError, ValueError):
                    rec = {}
                if rec.get("restored_from") == a.image:
                    self.post(mc.RestoreDone(a.migration, a.rank, a.target, {
                        "step_s": round(time.monotonic() - t0, 4), "criu_restore_s": rec.get("restore_s", 0.0)}))
                    return
                rc = proc.poll()
                if rc is not None:
                    tail = " | ".join(errf.read_text(errors="replace").strip().splitlines()[-4:]) if errf.exists() else ""
                    self.post(mc.RestoreFailed(a.migration, a.rank, a.target,
                                               f"restore step exited {rc} before the rank was restored: {tail}"))
                    return
                time.sleep(0.01)

        self._thread(run, f"restore-{a.rank}")

    def _do_AbortRestore(self, a: dc.AbortRestore, st: dc.CoordState) -> None:
        self._cancel_gates(a.migration)
        aborts = self.aborting.setdefault(a.migration, [])
        for r in a.ranks:
            proc = self.restores.pop((a.migration, r), None)
            res = self.source_pids.get((a.migration, r)) or {}

            def run(proc=proc, r=r, images=res.get("images")) -> None:
                if images:
                    try:
                        self.tpassd.request(a.target, "tpassd.restore",
                                            {"job_id": self.job_id, "rank": r, "op": "abort", "images": images,
                                             "rank_dir": str(rank_state_dir(self.state_dir, self.job_id))}, 10.0)
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

            aborts.append(self._thread(run, f"abort-{r}"))

    def _do_KillSource(self, a: dc.KillSource, st: dc.CoordState) -> None:
        def run() -> None:
            for r in a.ranks:
                res = self.source_pids.get((a.migration, r))
                if res is None:
                    self.post(mc.KillFailed(a.migration, a.node, f"no dump record of rank {r}"))
                    return
                body = {"job_id": self.job_id, "rank": r, "op": "kill", "pid": int(res["pid"]),
                        "rank_dir": str(rank_state_dir(self.state_dir, self.job_id))}
                try:
                    self.tpassd.request(a.node, "tpassd.snapshot", body, self.policy.kill_timeout_s)
                except TorchpassError as exc:
                    self.post(mc.KillFailed(a.migration, a.node, str(exc)))
                    return
            self.post(mc.SourceKilled(a.migration, a.node))

        self._thread(run, "kill-source")

    def _do_Resume(self, a: dc.Resume, st: dc.CoordState) -> None:
        # The source copies are dead: the hold files now wake only the restored ranks.
        self._resume_cmd(st.ranks, a.generation, a.master)
        self._release(a.migration)
        self._cancel_gates(a.migration)

    def _do_ResumeInPlace(self, a: dc.ResumeInPlace, st: dc.CoordState) -> None:
        self._cancel_gates(a.migration)
        node = st.migration.node if st.migration is not None else None
        aborts = self.aborting.get(a.migration, [])
        if any(t.is_alive() for t in aborts):
            # A restored copy on the target also waits at the rank's hold file (it is
            # the same process image). Releasing the hold and sending the resume before
            # that copy is dead would let it rejoin the rendezvous as the rank alongside
            # the source copy (and then die): the group would hang. So the source copy
            # resumes only once every abort of this migration has finished.
            def later() -> None:
                for t in aborts:
                    t.join(ABORT_WAIT_S + 15.0)
                self._resume_in_place(a, st, node)

            self._thread(later, f"rollback-{a.migration}")
            return
        self._resume_in_place(a, st, node)

    def _resume_in_place(self, a: dc.ResumeInPlace, st: dc.CoordState, node: str | None) -> None:
        self.aborting.pop(a.migration, None)
        self._resume_cmd(st.ranks, a.generation, a.master)
        held = self.hold_ranks.get(a.migration, ())
        if node and held and self.tpassd is not None:
            for r in held:  # the hand-off is off: a later death of the source copy is a real failure
                try:
                    self.tpassd.request(node, "tpassd.snapshot",
                                        {"job_id": self.job_id, "rank": r, "op": "abort",
                                         "rank_dir": str(rank_state_dir(self.state_dir, self.job_id))}, 5.0)
                except TorchpassError as exc:
                    log.warning("could not mark the hand-off aborted", rank=r, node=node, error=str(exc))
        self._release(a.migration)

    def _do_Drain(self, a: dc.Drain, st: dc.CoordState) -> None:
        def run() -> None:
            try:
                self.slurm.drain(a.node, a.reason)
            except TorchpassError as exc:
                self.post(mc.DrainFailed(a.migration, a.node, str(exc)))
                return
            self.post(mc.Drained(a.migration, a.node))

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

    def _do_Shrink(self, a: dc.Shrink, st: dc.CoordState) -> None:
        spares = {n: st.spare(n) for n in a.nodes}

        def run() -> None:
            released: list[str] = []
            why: list[str] = []
            try:
                for node in a.nodes:
                    sp = spares[node]
                    if sp is not None and sp.how == "companion" and sp.allocation is not None:
                        # A companion's only step was the restore, which ended when the rank moved on.
                        self._cancel(sp.allocation)
                        with self._lock:
                            self.companions.pop(sp.allocation, None)
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
                self.post(mc.ShrinkFailed(a.migration, "; ".join(why)))
            else:
                log.info("node released from the job", nodes=released, job_id=self.job_id)
                self.post(mc.Shrunk(a.migration, tuple(released)))

        self._thread(run, "shrink")

    def _do_HandToSlurm(self, a: dc.HandToSlurm, st: dc.CoordState) -> None:
        log.warning("node handed to Slurm", node=a.node, reason=a.reason)

    def close(self) -> None:
        for _target, proc, go, _t in self.gates.values():
            try:
                write_gate(go, "cancel")
            except OSError:
                pass
            self.restores.setdefault(("gate", proc.pid), proc)
        self.gates = {}
        for proc in self.restores.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        # Companion allocations live only as long as the coordinator (the job).
        with self._lock:
            companions, self.companions = dict(self.companions), {}
        for alloc, node in companions.items():
            log.info("cancelling companion spare allocation", allocation=alloc, node=node)
            self._cancel(alloc)


class Driver:
    """Owns the decision state; everything here runs in the serve thread."""

    def __init__(self, job: JobState, policy: CoordinatorPolicy, executor: Executor | None = None, *,
                 clock: Callable[[], float] = time.monotonic, health: Any = None, spares: tuple[str, ...] = ()):
        self.job = job
        self.policy = policy
        self.clock = clock
        self.state = dc.CoordState(job_id=job.job_id)
        self.reasons = mc.ReasonLog()
        self.queue: queue.Queue = queue.Queue()
        self.executor = executor
        self.health = health
        self._fed_health: dict[str, tuple] = {}
        self._next_decide = 0.0
        for s in spares:
            self.state = mc.apply(self.state, mc.SpareAdded(s, "hot"), clock())

    def post(self, outcome: Any) -> None:
        """Thread-safe: queue an outcome for the serve thread."""
        self.queue.put(outcome)

    def feed(self, outcome: Any) -> None:
        self.state = mc.apply(self.state, outcome, self.clock())
        self.decide()

    def decide(self) -> None:
        d = dc.decide(self.clock(), self.state, self.policy)
        self.state = d.state
        if self.reasons.changed(d.reason):
            log.info("decision", job_id=self.job.job_id, reason=d.reason)
        for a in d.actions:
            if self.executor is not None:
                self.executor.perform(a, self.state)

    def accept_operator(self, node: str, to: str | None) -> str:
        self.state, mid = mc.accept_operator(self.state, node, to, self.clock())
        return mid

    def _poll_health(self) -> None:
        if self.health is None:
            return
        now = time.monotonic()
        for node, v in self.health.nodes().items():
            age = v.get("last_heartbeat_age_s")
            reachable = age is not None and age < 10.0
            key = (v["state"], tuple(v["reasons"]), reachable)
            if self._fed_health.get(node) != key:
                self._fed_health[node] = key
                self.state = mc.apply(self.state, mc.NodeHealthChanged(node, v["state"], tuple(v["reasons"]),
                                                                       reachable), self.clock())
        del now

    def pump(self) -> None:
        """Drain posted outcomes, follow health, decide on a tick."""
        fed = False
        while True:
            try:
                outcome = self.queue.get_nowait()
            except queue.Empty:
                break
            self.state = mc.apply(self.state, outcome, self.clock())
            fed = True
        now = self.clock()
        if fed or now >= self._next_decide:
            self._poll_health()
            self._next_decide = now + 0.2
            self.decide()

    def events_data(self) -> dict[str, Any]:
        m = self.state.migration
        return {"migration": None if m is None else {"id": m.id, "node": m.node, "target": m.target,
                                                     "phase": m.phase.value}}


def checksum_of(images: str | os.PathLike) -> str:
    """SHA-256 of a snapshot's manifest (which holds every image file's SHA-256)."""
    return hashlib.sha256((Path(images) / "manifest.json").read_bytes()).hexdigest()


__all__ = ["Driver", "Executor", "TpassdClient", "hold_file", "rank_state_dir", "resume_port", "checksum_of"]
