"""After each migration, snapshot, reroute or relaunch, ask tpassd to put the job's
``torchpass: ...`` part into its Slurm record (AdminComment; tpassd/accounting.py builds the text
from the saved event log: the request carries only the job id).

The coordinator runs as the job's user, who may not set AdminComment: the batch host's tpassd
(root) does, for a job slurmctld says the user owns and runs there. One worker thread sends the
requests, one at a time; events that come while one is in flight cost one more request, not one
each, and a failure is logged, never retried: the next event's request writes the whole part.
"""

from __future__ import annotations

import os
import socket
import threading

import structlog

from torchpass.accounting import ACCOUNTED_KINDS
from torchpass.coordinator.executor_ports import ExecutorPorts

log = structlog.get_logger("torchpass.coordinator.accounting")

# tpassd asks slurmctld twice (the job, then scontrol update), each with a 15 s timeout.
ACCOUNT_TIMEOUT_S = 35.0


def own_node() -> str:
    """This node's Slurm name: SLURMD_NODENAME in a job's environment, else the short hostname
    (tpassd's default node name)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


class JobAccounting:
    def __init__(self, ports: ExecutorPorts, node: str | None = None):
        self.ports = ports
        self.node = node or own_node()
        self._wanted = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.sent = 0  # requests answered ok (tests)

    def event_recorded(self, kind: str) -> None:
        """Called after each event is saved: an accounted kind asks for the part to be rewritten."""
        if kind not in ACCOUNTED_KINDS or self.ports.tpassd is None or self._stop.is_set():
            return
        self._wanted.set()
        if self._thread is None:
            self._thread = self.ports.thread(self._run, "coordinator-accounting")

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._wanted.wait(timeout=1.0):
                continue
            self._wanted.clear()
            try:
                res = self.ports.tpassd.request(self.node, "tpassd.account", {"job_id": self.ports.job_id},
                                                ACCOUNT_TIMEOUT_S)
                self.sent += 1
                log.info("job accounted in Slurm", node=self.node, field=res.get("field"), value=res.get("value"))
            except Exception as exc:  # noqa: BLE001 - accounting never stops the job; the next event retries
                log.warning("cannot account for the job in Slurm", node=self.node, error=str(exc))

    def close(self) -> None:
        self._stop.set()
        self._wanted.set()


__all__ = ["ACCOUNT_TIMEOUT_S", "JobAccounting", "own_node"]
