"""A moved rank's exit code, collected by srun instead of a wrapper left waiting on the source node.

Slurm kills a step's tasks on a node removed from the job (on 24.11: ``srun: error: node2: task 1:
Killed``, the step is force-terminated, srun exits 137), and the moved rank's task on its source
node is its launch wrapper (rankwrap), which used to wait there for the rank's exit code. So the
node could not leave the job until the step ended.

With ``--on-handoff release`` (the SPANK plugin starts every --torchpass rank so) the launch
wrapper leaves instead, as soon as the rank record names the copy that took the rank over
(``leave_source``): it writes ``rankR.released`` (``write_released``: step, node, wrapper pid and
the code the source copy ended with) and exits 0. Its task is then over, and removing its node
leaves the step running (24.11: the step then ends with 0). The coordinator sees the record
and releases the node (torchpass.coordinator.source_release).

srun's exit hook (slurm_spank/local.c) then runs ``tpass-rankwrap --collect-moved STEP --status
S`` (``collect``): for every rank of its step whose wrapper left, it waits for the exit code the
rank's current copy writes (``rankR.exit``, rankwrap's restore mode) and exits with the largest of
S and those codes, which srun then exits with: the largest task exit code, as srun reports it.

Everything here runs as the job's user, on files in the job's rank directory that the user's own
processes write: it decides only the user's own srun exit code.
"""

from __future__ import annotations

import enum
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from torchpass import layout

# The coordinator has been gone this long: the moved rank's copy can no longer be followed.
COORDINATOR_GONE_S = 30.0
POLL_S = 0.2


@dataclass(frozen=True)
class Released:
    """What a launch wrapper left behind when it left its node (``rankR.released``)."""

    rank: str
    step: str  # SLURM_STEP_ID of the step it was a task of
    node: str
    wrapper_pid: int
    code: int  # shell-style: how the copy on the source ended (the dump's kill, as a rule)

    def as_json(self) -> dict:
        return {"rank": self.rank, "step": self.step, "node": self.node, "wrapper_pid": self.wrapper_pid,
                "code": self.code}

    @classmethod
    def parse(cls, obj: object) -> Released | None:
        if not isinstance(obj, dict):
            return None
        try:
            got = cls(str(obj["rank"]), str(obj["step"]), str(obj["node"]), obj["wrapper_pid"], obj["code"])
        except KeyError:
            return None
        ints = (got.wrapper_pid, got.code)
        return got if all(isinstance(i, int) and not isinstance(i, bool) for i in ints) else None


def read_released(path: Path) -> Released | None:
    try:
        return Released.parse(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def released_records(rank_job_dir: Path) -> list[Released]:
    """Every ``rankR.released`` in RANK_DIR/jobJ."""
    out = []
    try:
        names = sorted(os.listdir(rank_job_dir))
    except OSError:
        return []
    for name in names:
        if name.endswith(layout.RELEASED_SUFFIX):
            got = read_released(Path(rank_job_dir) / name)
            if got is not None:
                out.append(got)
    return out


def leave_source(record: dict, wrapper_pid: int, node: str) -> bool:
    """Whether the launch wrapper (``wrapper_pid`` on ``node``) whose copy of the rank ended in a
    hand-off may leave: the rank record names another copy, one a restore took over with
    (``restored_from``), and no rollback gave the rank back (``aborted``). Until then the move
    may still be called off, and the wrapper must report the rank's end itself."""
    if record.get("aborted") or not record.get("restored_from"):
        return False
    return (record.get("wrapper_pid"), record.get("node")) != (wrapper_pid, node)


class Outcome(enum.Enum):
    WAIT = "wait"  # the rank runs on elsewhere
    ENDED = "ended"  # its current copy wrote its exit code
    # The move was called off after the source copy ended: the record names that copy again, or
    # (no record to put back) is marked aborted. No copy runs: the rank ended as the source copy did.
    ROLLED_BACK = "rolled back"
    LOST = "lost"  # nothing is left to tell (the coordinator is gone)


def moved_rank_end(released: Released, record: dict, exit_: object, coordinator_alive: bool
                   ) -> tuple[Outcome, int | None]:
    """Where a released rank stands, from its record, its exit file's contents and whether the
    coordinator still runs: (outcome, shell-style code or None while it runs)."""
    if (isinstance(exit_, dict) and isinstance(exit_.get("code"), int) and not record.get("aborted")
            and all(exit_.get(k) == record.get(k) for k in ("wrapper_pid", "node", "restored_from"))):
        return Outcome.ENDED, exit_["code"]
    if record.get("aborted") or (record.get("wrapper_pid"), record.get("node")) == (released.wrapper_pid,
                                                                                    released.node):
        return Outcome.ROLLED_BACK, released.code
    if not coordinator_alive:
        return Outcome.LOST, 1
    return Outcome.WAIT, None


def srun_code(status: int, moved: list[int]) -> int:
    """srun's exit code with the moved ranks' codes: the largest task exit code, as srun reports it."""
    return max([status, *moved])


def write_released(path: Path, rank: str, step: str, code: int) -> None:
    """``rankR.released`` of this (the launch) wrapper, written whole before it exits: the coordinator
    and srun's exit hook read it."""
    got = Released(rank, step, socket.gethostname(), os.getpid(), code)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(got.as_json()))
    os.replace(tmp, path)


def coordinator_alive(state_dir: str, job: str, proc: str = "/proc") -> bool:
    """The job's coordinator still runs: its pid file's process, with the same start time, when it
    is on this node (srun runs on the batch host, as the coordinator does); another node's: assume so."""
    try:
        pid, start, node = layout.coordinator_pid(state_dir, job).read_text().split()[:3]
    except (OSError, ValueError):
        return False
    if node != socket.gethostname():
        return True
    try:
        stat = Path(f"{proc}/{int(pid)}/stat").read_text()
    except (OSError, ValueError):
        return False
    return stat.rsplit(")", 1)[-1].split()[19] == start


def collect(step: str, status: int, rank_dir: str, state_dir: str, job: str,
            now=time.monotonic, sleep=time.sleep) -> int:
    """``tpass-rankwrap --collect-moved``: srun's exit code, ``status`` with the codes of the ranks of
    step ``step`` whose launch wrapper left their source node."""
    job_dir = layout.rank_job_dir(rank_dir, job)
    pending = {r.rank: r for r in released_records(job_dir) if r.step == step}
    codes: list[int] = []
    gone_since: float | None = None
    said = False
    while pending:
        alive = coordinator_alive(state_dir, job)
        gone_since = None if alive else (gone_since if gone_since is not None else now())
        lost = gone_since is not None and now() - gone_since >= COORDINATOR_GONE_S
        for rank, rel in list(pending.items()):
            record = _read_json(layout.rank_record(rank_dir, job, rank))
            outcome, code = moved_rank_end(rel, record, _read_json(layout.exit_file(rank_dir, job, rank)), not lost)
            if outcome is Outcome.WAIT:
                continue
            if outcome is Outcome.LOST:
                _say(f"rank {rank} left {rel.node} and its copy on {record.get('node', '?')} can no longer be "
                     f"followed (the coordinator is gone); srun counts it as exit 1")
            del pending[rank]
            codes.append(code if code is not None else 1)
            if outcome is not Outcome.LOST:
                where = rel.node if outcome is Outcome.ROLLED_BACK else record.get("node", "?")
                _say(f"moved rank {rank} ended with exit code {codes[-1]} on {where} ({outcome.value}); srun "
                     "counts it as its task's")
        if pending:
            if not said:
                _say(f"waiting for moved ranks {sorted(pending, key=int)} (their launch wrappers left their "
                     "nodes) before srun exits")
                said = True
            sleep(POLL_S)
    return srun_code(status, codes)


def _read_json(path: Path) -> dict:
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def _say(msg: str) -> None:
    try:
        sys.stderr.write(f"torchpass: {msg}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
