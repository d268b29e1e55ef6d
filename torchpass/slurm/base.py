"""The Slurm client interface and its value types."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass(frozen=True)
class NodeInfo:
    name: str
    address: str
    state: tuple[str, ...]  # e.g. ("IDLE",), ("MIXED", "DRAIN")
    reason: str = ""

    @property
    def drained(self) -> bool:
        return "DRAIN" in self.state or "DRAINED" in self.state


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
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def active(self) -> bool:
        return self.state in ("RUNNING", "PENDING", "CONFIGURING", "COMPLETING", "SUSPENDED")


class SlurmClient(ABC):
    name: str = "abstract"

    @abstractmethod
    def nodes(self) -> list[NodeInfo]: ...

    @abstractmethod
    def job(self, job_id: int) -> JobInfo | None:
        """The job, or None when slurmctld no longer knows it."""

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
