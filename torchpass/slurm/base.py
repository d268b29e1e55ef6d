"""The Slurm client interface and its value types."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from torchpass.errors import SlurmError


@dataclass(frozen=True)
class NodeInfo:
    name: str
    address: str
    state: tuple[str, ...]  # e.g. ("IDLE",), ("MIXED", "DRAIN")
    reason: str = ""

    @property
    def drained(self) -> bool:
        return "DRAIN" in self.state or "DRAINED" in self.state

    @property
    def not_answering(self) -> bool:
        """slurmctld no longer hears the node's slurmd (a node lost outright looks like this)."""
        return bool(set(self.state) & set(NOT_ANSWERING))


# Node states in which slurmctld no longer hears a node's slurmd.
NOT_ANSWERING = ("NOT_RESPONDING", "DOWN")


@dataclass(frozen=True)
class JobInfo:
    job_id: int
    name: str
    user: str
    user_id: int
    state: str  # RUNNING, PENDING, COMPLETED, ...
    nodes: tuple[str, ...]
    batch_host: str = ""
    exit_code: int | None = None
    restarts: int = 0
    comment: str = ""
    admin_comment: str = ""  # only root, SlurmUser and Slurm administrators may set it
    partition: str = ""
    account: str = ""
    qos: str = ""
    end_time: int | None = None  # epoch seconds the job's time limit ends (None: unlimited/unknown)
    output: str = ""  # the batch script's stdout file ("": not known)
    error: str = ""  # its stderr file (the same as output unless -e gave another; "": not known)
    reason: str = ""  # why it pends (Slurm's state_reason, e.g. job_requeued_in_held_state)
    # Slurm may requeue it (a batch job submitted with --requeue or under JobRequeue=1); None: not known
    requeue: bool | None = None
    batch: bool = True  # a batch job (sbatch), not an salloc allocation
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def active(self) -> bool:
        return self.state in ("RUNNING", "PENDING", "CONFIGURING", "COMPLETING", "SUSPENDED")


@dataclass(frozen=True)
class StepInfo:
    step_id: str  # "J.0", "J.batch", "J.extern"
    name: str
    nodes: tuple[str, ...]
    state: str

    @property
    def user_step(self) -> bool:
        """A step the job launched (not the batch script's or the extern step)."""
        return not self.step_id.endswith((".batch", ".extern", ".interactive"))


@dataclass(frozen=True)
class SpareRequest:
    """One node from slurmctld for a running job's torchpass coordinator.

    ``expand``: allocate it as a donor for ``--dependency=expand:JOB`` (then
    ``merge_into`` the job); otherwise a companion allocation of its own.
    The allocation is made with ``salloc --no-shell`` (step-less: a donor
    must be, and a companion runs only the restore step), ``--exclusive``
    (a spare shares nothing with other jobs), on the job's partition,
    account and QOS, excluding ``exclude`` (the job's own nodes), and gives
    up after ``immediate_s`` when no node is free."""

    job_id: int
    name: str
    comment: str
    exclude: tuple[str, ...] = ()
    partition: str = ""
    account: str = ""
    qos: str = ""
    time_limit_min: int | None = None
    immediate_s: int = 30
    expand: bool = False
    # What the node it replaces holds for the job (torchpass.slurm.gres.spare_options): GPUs,
    # CPUs and memory; empty for a CPU-only job, which asks for a whole node as before.
    resources: tuple[str, ...] = ()


def overlap_step_argv(srun: str, job_id: int, node: str, *, name: str, output: str,
                      resources: tuple[str, ...] | list[str] = ()) -> list[str]:
    """``srun`` options of a one-task step of a running job (or allocation) on ``node``, beside its
    other steps, without torchpass's own plugin, appending to ``output``; the program follows.
    ``resources``: what the task it replaces had (torchpass.slurm.gres.restore_step_options). A
    step that asks for GPUs is started without ``--overlap`` and with ``--exact``: an overlapping
    step shares the GRES of the steps beside it, so two restore steps could be given one GPU;
    a step of its own gets GPUs no other step holds, and Slurm confines its devices to them.

    Steps are started with ``srun`` itself (a subprocess whose end is the step's end), so
    this is the one place that spells that command line."""
    sharing = ["--exact"] if any(r.startswith("--gres=") for r in resources) else ["--overlap"]
    return [srun, f"--jobid={int(job_id)}", *sharing, "-w", node, "-N1", "-n1", *resources, "--torchpass=off",
            "-o", output, "--open-mode=append", "-J", name]


class SlurmClient(ABC):
    name: str = "abstract"

    @abstractmethod
    def nodes(self) -> list[NodeInfo]: ...

    @abstractmethod
    def job(self, job_id: int) -> JobInfo | None:
        """The job, or None when slurmctld says it does not know it; SlurmError when slurmctld
        cannot be asked (never None then: a coordinator takes None for its job's end)."""

    @abstractmethod
    def jobs(self, *, user: str | None = None, states: tuple[str, ...] = ("RUNNING",)) -> list[JobInfo]: ...

    @abstractmethod
    def expand_nodelist(self, nodelist: str) -> list[str]: ...

    @abstractmethod
    def drain(self, node: str, reason: str) -> None: ...

    @abstractmethod
    def resume(self, node: str) -> None: ...

    @abstractmethod
    def shrink(self, job_id: int, keep_nodes: list[str]) -> None:
        """Release every node of the job but ``keep_nodes`` (their tasks die)."""

    @abstractmethod
    def steps(self, job_id: int) -> list[StepInfo]:
        """The job's running steps (batch and extern included)."""

    @abstractmethod
    def allocate(self, req: SpareRequest) -> tuple[int, str]:
        """A one-node allocation for ``req``: (its job id, its node). SlurmError if none."""

    @abstractmethod
    def merge_into(self, donor_id: int, job_id: int) -> None:
        """Job expansion: hand the donor's nodes to ``job_id`` (the donor ends)."""

    @abstractmethod
    def cancel(self, job_id: int) -> None: ...

    @abstractmethod
    def cancel_step(self, step_id: str) -> None:
        """End one step of a job ("J.S"), its tasks killed; the job runs on."""

    @abstractmethod
    def requeue(self, job_id: int) -> None:
        """Requeue a running batch job (``scontrol requeue``; its owner may): its processes end
        and it pends again under the same job id, its restart count one higher."""

    @abstractmethod
    def requeue_hold(self, job_id: int) -> None:
        """Requeue a running batch job and hold it (``scontrol requeuehold``; its owner may): its
        processes end, its nodes are free, and it pends held until released."""

    def job_detail(self, job_id: int) -> str:
        """``scontrol show job -d JOB``: per node, the CPU ids, memory and GRES indices the job
        holds (torchpass.slurm.gres reads it). A client that cannot tell raises SlurmError."""
        raise SlurmError(f"the {self.name} Slurm client cannot read job {job_id}'s per-node allocation")

    def step_detail(self, step_id: str) -> str:
        """``scontrol show step -d J.S``: the step's TRES and task count (torchpass.slurm.gres)."""
        raise SlurmError(f"the {self.name} Slurm client cannot read step {step_id}'s allocation")

    def set_job_field(self, job_id: int, name: str, value: str) -> None:
        """``scontrol update JobId=J NAME=VALUE`` for a free-text field (AdminComment, Comment);
        a client that cannot raises SlurmError."""
        raise SlurmError(f"the {self.name} Slurm client cannot set {name} of job {job_id}")

    @abstractmethod
    def release(self, job_id: int) -> None:
        """Let a held job start as soon as nodes are free (``scontrol release``; its owner may a
        hold of its own), without the begin time a requeue sets."""
