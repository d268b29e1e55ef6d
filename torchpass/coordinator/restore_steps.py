"""Restore steps: the job step that restores a moved rank on its target (``srun --overlap ...
python -m torchpass.checkpoint.rankwrap --restore IMAGES``), its restore token first (tpassd's
``tpassd.restore`` op=prepare), and the gate a step started early waits at for its images
(torchpass.checkpoint.restore_gate)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Collection
from pathlib import Path
from typing import Any, NamedTuple

import structlog

from torchpass import envnames, layout
from torchpass.checkpoint.rankwrap import RESTORE_JOB_ENV, RESTORE_RANK_ENV
from torchpass.checkpoint.restore_gate import write_gate
from torchpass.coordinator import contract as ct
from torchpass.coordinator.executor_ports import ExecutorPorts
from torchpass.coordinator.model import CoordState, SpareHow
from torchpass.errors import TorchpassError
from torchpass.slurm.base import overlap_step_argv
from torchpass.slurm.gres import TaskShare, parse_step_share, restore_step_options

log = structlog.get_logger("torchpass.coordinator.executor")

RESTORE_STEP_NAME = "torchpass-restore-"  # job name of restore steps (-J torchpass-restore-RANK)
# The programs a restore step runs (python -m ...): the restore wrapper, and the gate in front of it.
RANKWRAP_MODULE = "torchpass.checkpoint.rankwrap"
RESTORE_GATE_MODULE = "torchpass.checkpoint.restore_gate"
# A restore's prepare (tpassd.restore op=prepare: a token written on the target) is one request
# that checks the job's owner with slurmctld; a tpassd that does not answer in this time fails
# the restore (its step then fails at launch with the plugin's line why).
PREPARE_TIMEOUT_S = 5.0
# RestoreSteps.share before Slurm was asked (None is an answer: the share cannot be known).
_UNREAD = object()


class Gate(NamedTuple):
    """A restore step started at PauseAt, waiting at its gate for the image."""

    target: str
    proc: subprocess.Popen
    go: Path  # the gate file (layout.restore_go_file)
    started: float  # time.monotonic() at launch


class RestoreSteps:
    """Launches, gates and calls off restore steps; sets up each restore on its node first."""

    def __init__(self, ports: ExecutorPorts, output: str = ""):
        self.ports = ports
        # The job's stdout file (cached). Given at the start (main.py has Slurm's record then), so
        # the first restore step, launched in the serve thread at a pause, asks slurmctld nothing.
        self.output: str | None = output or None
        self.share: TaskShare | None | object = _UNREAD  # task_share(), once read


    def job_output(self) -> str:
        """The job's stdout file (where the restored rank's lines go)."""
        if self.output is None:
            path = ""
            if self.ports.slurm is not None:
                try:
                    info = self.ports.slurm.job(self.ports.job_id)
                    path = info.output if info is not None else ""
                except (OSError, TorchpassError) as exc:
                    log.warning("cannot read the job's output file from Slurm", error=str(exc))
            self.output = path or str(layout.restored_ranks_out(self.ports.state_dir, self.ports.job_id))
        return self.output

    def task_share(self) -> TaskShare | None:
        """What one task of the job's training step had (Slurm's ``scontrol show step -d``, read
        once); None when it cannot be known (no training step found, or its record unreadable:
        logged)."""
        if self.share is _UNREAD:
            self.share = None
            slurm = self.ports.slurm
            if slurm is not None:
                try:
                    steps = [s for s in slurm.steps(self.ports.job_id)
                             if s.user_step and not s.name.startswith(RESTORE_STEP_NAME)]
                    if steps:
                        self.share = parse_step_share(slurm.step_detail(steps[0].step_id))
                except (OSError, TorchpassError) as exc:
                    log.warning("cannot read the training step's share from Slurm; restore steps ask for "
                                "one task's default", error=str(exc))
        return self.share  # type: ignore[return-value]

    def task_resources(self) -> tuple[str, ...]:
        """srun options for what one task of the job's training step had, when it had GPUs. A
        CPU-only job's restore step asks for nothing more than before, and so does one whose
        share cannot be read."""
        share = self.task_share()
        return tuple(restore_step_options(share)) if share is not None and share.gpus else ()

    def restore_err(self, a: ct.Restore) -> Path:
        """srun's stderr plus the restore wrapper's reason for failing: the rollback event quotes its
        tail (the wrapper's own stderr goes to the job's output with the restored rank's)."""
        return layout.restore_error_file(self.ports.state_dir, self.ports.job_id, a.migration, a.rank)

    def restore_argv(self, a: ct.Restore, jobid: int | None = None, gate: Path | None = None) -> list[str]:
        """The restore step: in the job itself, or in the companion allocation that holds the target.
        With ``gate``: the step waits for the image path in that file (restore_gate)."""
        if gate is None:
            prog = ["-m", RANKWRAP_MODULE, "--restore", a.image]
        else:
            p = self.ports.policy
            wait = (p.pause_timeout_s * (1 + p.max_pause_rearms) + p.dump_timeout_s
                    + p.transfer_timeout_s * p.max_spare_attempts + 60.0)
            prog = ["-m", RESTORE_GATE_MODULE, str(gate), f"{wait:g}", "--"]
        step = overlap_step_argv(self.ports.srun, jobid or self.ports.job_id, a.target,
                                 name=f"{RESTORE_STEP_NAME}{a.rank}", output=self.job_output(),
                                 resources=self.task_resources())
        return [*step, self.ports.python, *prog, "--state-dir", str(self.ports.rank_dir),
                "--error-file", str(self.restore_err(a))]

    def gate_file(self, migration: str, rank: int) -> Path:
        return layout.restore_go_file(self.ports.state_dir, self.ports.job_id, migration, rank)

    def prepare(self, node: str, kind: str, *, rank: int = 0, timeout_s: float = PREPARE_TIMEOUT_S,
                **fields: Any) -> str | None:
        """Ask ``node``'s tpassd to set up one restore (``tpassd.restore`` op=prepare: it checks the
        request and writes the restore token the SPANK plugin needs before it starts its root restore
        agent). None when done, else why not (logged; the step then fails with the plugin's line)."""
        if self.ports.tpassd is None:
            return "no tpassd client"
        body = {"job_id": self.ports.job_id, "rank": rank, "op": "prepare", "kind": kind,
                **{k: v for k, v in fields.items() if v is not None}}
        try:
            self.ports.tpassd.request(node, "tpassd.restore", body, timeout_s)
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

    def spawn(self, a: ct.Restore, st: CoordState, gate: Path | None = None,
                       generation: int | None = None) -> subprocess.Popen:
        sp = st.spare(a.target)
        alloc = sp.allocation if sp is not None and sp.how == SpareHow.COMPANION else None
        if generation is None:  # a restore step started with its images: their generation
            parsed = layout.parse_images_dir(a.image, self.ports.job_id, a.rank) if a.image else None
            generation = parsed[1] if parsed is not None else None
        # The token first: the step's plugin takes it at launch, before a gated step waits.
        self.prepare(a.target, "migration", rank=a.rank, generation=generation, alloc=alloc)
        argv = self.restore_argv(a, alloc, gate)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SPANK_", envnames.PREFIX))
               or k == "SLURM_CONF"}
        # The plugin starts its root restore agent for this step (torchpass.checkpoint.restore_agent).
        env[RESTORE_RANK_ENV], env[RESTORE_JOB_ENV] = str(a.rank), str(self.ports.job_id)
        errf = self.restore_err(a)
        errf.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=open(errf, "ab"), start_new_session=True)
        log.info("restore step launched", rank=a.rank, target=a.target, argv=argv, gated=gate is not None)
        return proc

    def stop_gate(self, gate: Gate) -> None:
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

        self.ports.thread(run, "gate-cancel")
