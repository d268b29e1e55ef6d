"""The commands the coordinator gives ranks (pause, resume): each rank's is repeated in the
reply to its every ``rank.*`` request until the rank acknowledges it (rank.armed /
rank.resumed)."""

from __future__ import annotations

from typing import Any

from torchpass import wire
from torchpass.coordinator.executor_ports import ExecutorPorts
from torchpass.coordinator.policy import CoordinatorPolicy

# A paused rank waits at most policy.max_pause_s() + this for its resume (the coordinator ends every
# pause well before; docs/coordinator.md, "Never left paused"): the pause command's deadline_s.
HOLD_MARGIN_S = 60.0


def hold_deadline_s(policy: CoordinatorPolicy) -> float:
    """How long a paused rank may wait for its resume: 3630 s with the default policy."""
    return policy.hold_deadline_s or policy.max_pause_s() + HOLD_MARGIN_S


def resume_port(job_id: int, generation: int, ports: tuple[int, int]) -> int:
    """The rendezvous port of a generation, within ``ports`` (policy ``rendezvous_ports``):
    spread by job and generation, so that jobs sharing rank 0's node rarely pick the same."""
    lo, hi = ports
    return lo + (job_id * 131 + generation * 977) % (hi - lo + 1)


class RankCommands:
    """rank -> the command repeated in its replies until acknowledged."""

    def __init__(self, ports: ExecutorPorts):
        self.ports = ports
        self.commands: dict[int, dict[str, Any]] = {}
        # The ranks of the newest pause that are held (the moving node's): the server sends them
        # their command first. The move waits on them (they quiesce, then are dumped); the others
        # only stand at T. At 8,192 ranks the pause's replies take the serve thread 0.25-0.6 s.
        self.urgent: tuple[int, ...] = ()


    def command_for(self, rank: int) -> dict[str, Any] | None:
        return self.commands.get(rank)

    def acknowledge(self, rank: int, kind: str, generation: int, at: int | None = None) -> None:
        cmd = self.commands.get(rank)
        if cmd is None or cmd["command"] != kind or cmd["generation"] != generation:
            return
        if kind == wire.COMMAND_PAUSE and cmd["at"] != at:
            return
        del self.commands[rank]

    def resume_command(self, generation: int, master: str, rails: tuple[str, ...] = ()) -> dict[str, Any]:
        """The resume (wire.py); ``rails``: a reroute, every rank rebuilds on these data rails."""
        addr = self.ports.address_of(master) if master else "127.0.0.1"
        return {"command": wire.COMMAND_RESUME, "generation": generation, "master_addr": addr,
                "master_port": resume_port(self.ports.job_id, generation, self.ports.policy.rendezvous_port_range()),
                **({"rails": list(rails)} if rails else {})}

    def send_resume(self, ranks, generation: int, master: str, rails: tuple[str, ...] = ()) -> None:
        cmd = self.resume_command(generation, master, rails)
        for r in ranks:
            self.commands[r] = cmd  # one object for all (never modified: see MigrationActions.pause_at)
