"""What every part of the executor acts through, and nothing else: the job record, its state
directory, the clients of tpassd and slurmctld, the policy, the outcome queue (``post``,
thread-safe) and worker threads.

The parts (``rank_commands``, ``restore_steps``, ``migration_actions``, ``spare_actions``,
``lost_node_actions``, ``job_snapshot_actions``) share one ``ExecutorPorts``: a test that swaps
the Slurm client or tpassd's (``Executor.slurm = ...``) swaps it for every part at once.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from torchpass import auth, layout, zmqio
from torchpass.coordinator.job_record import JobState, encode_events
from torchpass.coordinator.policy import CoordinatorPolicy
from torchpass.ports import TPASSD_CONTROL_PORT
from torchpass.slurm.base import SlurmClient

log = structlog.get_logger("torchpass.coordinator.executor")

# tpassd.drain: tpassd's own scontrol call has a 15 s timeout.
DRAIN_TIMEOUT_S = 20.0


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` (a reader, such as the SPANK plugin, never sees half of it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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


class ExecutorPorts:
    """The job and the clients every executor part uses (one object, shared by all of them)."""

    def __init__(self, job: JobState, *, state_dir: str | os.PathLike, post: Callable[[Any], None],
                 policy: CoordinatorPolicy, tpassd: TpassdClient | None, slurm: SlurmClient | None,
                 address_of: Callable[[str], str], wall: Callable[[], float], python: str, srun: str):
        self.job = job
        self.state_dir = Path(state_dir)
        self.post = post
        self.policy = policy
        self.tpassd = tpassd
        self.slurm = slurm
        self.address_of = address_of
        self.wall = wall
        self.python = python
        self.srun = srun

    @property
    def job_id(self) -> int:
        return self.job.job_id

    @property
    def rank_dir(self) -> Path:
        """Where the rank wrappers keep the job's rank records (shared by every node of the job)."""
        return layout.rank_records_dir(self.state_dir, self.job_id)

    def thread(self, fn: Callable[[], None], name: str) -> threading.Thread:
        """Start a worker: it only posts outcomes, never writes the executor's bookkeeping."""
        t = threading.Thread(target=fn, name=name, daemon=True)
        t.start()
        return t

    def save_events(self) -> None:
        """STATE_DIR/jobs/J/events.json: the event log outlives the coordinator (tpassctl, tests)."""
        try:
            write_atomically(layout.events_json(self.state_dir, self.job_id), encode_events(self.job.events))
        except OSError as exc:
            log.warning("cannot save the event log", error=str(exc))
