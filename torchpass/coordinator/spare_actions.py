"""Spare nodes from slurmctld (RequestSpare: expand the job or hold a companion allocation) and
giving a node back (Shrink). Keeps the companion allocations, cancelled when the coordinator
exits."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Collection
from pathlib import Path

import structlog

from torchpass import layout
from torchpass.checkpoint import moved_exit
from torchpass.coordinator import contract as ct
from torchpass.coordinator.executor_ports import ExecutorPorts
from torchpass.coordinator.model import CoordState, SpareHow
from torchpass.coordinator.source_release import Blocked, Hold, release_blocker
from torchpass.errors import SlurmError, TorchpassError
from torchpass.slurm.base import SpareRequest
from torchpass.slurm.gres import parse_job_allocations, spare_options

log = structlog.get_logger("torchpass.coordinator.executor")

# A restore step whose rank moved on may still be listed by Slurm this long after it ended.
RESTORE_STEP_END_GRACE_S = 10.0
# A launch wrapper exits right after it writes its released record; its task counts as gone
# once the record is this old (the node is removed from the job after that).
RELEASE_SETTLE_S = 2.0


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def _rank_records(job_dir: Path) -> dict[str, dict]:
    """RANK_DIR/jobJ's rank records by file name (``rankR.json``)."""
    out = {}
    try:
        names = os.listdir(job_dir)
    except OSError:
        return {}
    for name in names:
        if name.startswith("rank") and name.endswith(layout.RECORD_SUFFIX):
            try:
                rec = json.loads((job_dir / name).read_text())
            except (OSError, ValueError):
                continue
            if isinstance(rec, dict):
                out[name] = rec
    return out


class SpareActions:
    """RequestSpare and Shrink; ``companions``: companion allocation -> node."""

    def __init__(self, ports: ExecutorPorts, follow: Callable[[str], None] | None = None):
        self.ports = ports
        self.follow = follow  # (node) -> None: follow a new spare's tpassd
        self.companions: dict[int, str] = {}  # companion allocation -> node (cancelled at close)
        self.settle_grace_s = RESTORE_STEP_END_GRACE_S  # how long tasks leaving a node are waited for


    def spare_request(self, a: ct.RequestSpare, st: CoordState, companions: Collection[str] = ()
                      ) -> SpareRequest:
        """The salloc request for a spare: same partition/account/QOS as the job, none of its nodes
        (nor the spares and companion nodes it has)."""
        info = self.ports.slurm.job(self.ports.job_id)
        if info is None or not info.active:
            raise SlurmError(f"job {self.ports.job_id} is {'gone' if info is None else info.state}")
        exclude = sorted(set(info.nodes) | {s.node for s in st.spares} | set(companions))
        limit = None
        if info.end_time is not None:
            limit = max(1, int((info.end_time - self.ports.wall()) // 60) + 1)  # never outlive the job
        return SpareRequest(
            job_id=self.ports.job_id, name=f"torchpass-spare-{self.ports.job_id}",
            comment=(f"torchpass: {a.strategy} spare for job {self.ports.job_id} "
                     f"({a.migration}, replacing {a.for_node})"),
            exclude=tuple(exclude), partition=info.partition, account=info.account, qos=info.qos,
            time_limit_min=limit, immediate_s=max(1, int(min(self.ports.policy.spare_timeout_s, 60.0))),
            expand=a.strategy == SpareHow.EXPAND, resources=self.spare_resources(a.for_node),
        )

    def spare_resources(self, for_node: str) -> tuple[str, ...]:
        """salloc options for a node shaped like the job's share of ``for_node`` when that share has
        GPUs (``scontrol show job -d``); a CPU-only job's spare is a whole node, as before."""
        slurm = self.ports.slurm
        try:
            allocs = parse_job_allocations(slurm.job_detail(self.ports.job_id), slurm.expand_nodelist)
        except (OSError, TorchpassError) as exc:
            log.warning("cannot read the job's per-node allocation from Slurm; the spare asks for a whole node",
                        error=str(exc))
            return ()
        alloc = allocs.get(for_node)
        return tuple(spare_options(alloc)) if alloc is not None and alloc.gpus else ()

    def request_spare(self, a: ct.RequestSpare, st: CoordState) -> None:
        if a.strategy not in (SpareHow.EXPAND, SpareHow.COMPANION):
            self.ports.post(ct.SpareUnavailable(a.migration, a.strategy, f"unknown spare strategy {a.strategy!r}"))
            return
        if self.ports.slurm is None:
            self.ports.post(ct.SpareUnavailable(a.migration, a.strategy, "no Slurm client"))
            return
        companions = set(self.companions.values())

        def run() -> None:
            t0 = time.monotonic()
            try:
                req = self.spare_request(a, st, companions)
                alloc, node = self.ports.slurm.allocate(req)
                if a.strategy == SpareHow.EXPAND:
                    try:
                        self.ports.slurm.merge_into(alloc, self.ports.job_id)
                    except TorchpassError:
                        self.cancel(alloc)
                        raise
            except TorchpassError as exc:
                log.warning("no spare from slurmctld", strategy=a.strategy, migration=a.migration, error=str(exc))
                self.ports.post(ct.SpareUnavailable(a.migration, a.strategy, str(exc)))
                return
            log.info("spare obtained from slurmctld", strategy=a.strategy, node=node, allocation=alloc,
                     job_id=self.ports.job_id, seconds=round(time.monotonic() - t0, 3))
            self.ports.post(ct.SpareGranted(a.migration, node, a.strategy, allocation=alloc))

        self.ports.thread(run, f"spare-{a.strategy}")

    def cancel(self, alloc: int) -> None:
        try:
            self.ports.slurm.cancel(alloc)
        except TorchpassError as exc:
            log.warning("could not cancel a spare allocation", allocation=alloc, error=str(exc))

    def shrink(self, a: ct.Shrink, st: CoordState) -> None:
        spares = {n: st.spare(n) for n in a.nodes}

        def run() -> None:
            released: list[str] = []
            why: list[str] = []
            try:
                for node in a.nodes:
                    sp = spares[node]
                    if sp is not None and sp.how == SpareHow.COMPANION and sp.allocation is not None:
                        # A companion's only step was the restore, which ended when the rank moved on
                        # (observe() forgets the allocation when Shrunk arrives).
                        self.cancel(sp.allocation)
                        released.append(node)
                        continue
                    blocker = self.shrink_blocker(node)
                    # Tasks leaving the node (a launch wrapper that handed its rank's exit code to
                    # srun, a restore step whose rank moved on) are gone within moments, but Slurm
                    # may still list them: give them a few seconds before keeping the node.
                    deadline = time.monotonic() + self.settle_grace_s
                    while blocker is not None and blocker.hold == Hold.SETTLING and time.monotonic() < deadline:
                        time.sleep(0.5)
                        blocker = self.shrink_blocker(node)
                    if blocker is not None:
                        why.append(blocker.why)
                        continue
                    info = self.ports.slurm.job(self.ports.job_id)
                    if info is not None and node in info.nodes:
                        self.ports.slurm.shrink(self.ports.job_id, [n for n in info.nodes if n != node])
                    released.append(node)
            except TorchpassError as exc:
                why.append(str(exc))
            if why:
                log.info("node kept in the job", nodes=list(a.nodes), why="; ".join(why))
                self.ports.post(ct.ShrinkFailed(a.migration, "; ".join(why)))
            else:
                log.info("node released from the job", nodes=released, job_id=self.ports.job_id)
                self.ports.post(ct.Shrunk(a.migration, tuple(released)))

        self.ports.thread(run, "shrink")

    def shrink_blocker(self, node: str) -> Blocked | None:
        """Why ``node`` cannot leave the job now (None: it can): source_release decides from Slurm's
        view and the job's rank directory."""
        info = self.ports.slurm.job(self.ports.job_id)
        steps = self.ports.slurm.steps(self.ports.job_id) if info is not None and node in info.nodes else []
        job_dir = layout.rank_job_dir(self.ports.rank_dir, self.ports.job_id)
        released = moved_exit.released_records(job_dir)
        settled = [r.rank for r in released
                   if _age_s(layout.released_file(self.ports.rank_dir, self.ports.job_id, r.rank)) >= RELEASE_SETTLE_S]
        records = {name.removeprefix("rank").removesuffix(layout.RECORD_SUFFIX): rec
                   for name, rec in _rank_records(job_dir).items()}
        return release_blocker(node, self.ports.job_id, info, steps, released, records, settled)

    def observe_granted(self, outcome: ct.SpareGranted) -> None:
        if outcome.how == SpareHow.COMPANION and outcome.allocation is not None:
            self.companions[outcome.allocation] = outcome.node
        if self.follow is not None:
            try:
                self.follow(outcome.node)
            except (OSError, TorchpassError) as exc:
                log.warning("cannot follow the new spare's health", node=outcome.node, error=str(exc))

    def observe_shrunk(self, outcome: ct.Shrunk) -> None:
        for alloc in [a for a, n in self.companions.items() if n in outcome.nodes]:
            del self.companions[alloc]

    def close(self) -> None:
        """Companion allocations live only as long as the coordinator (the job)."""
        companions, self.companions = dict(self.companions), {}
        for alloc, node in companions.items():
            log.info("cancelling companion spare allocation", allocation=alloc, node=node)
            self.cancel(alloc)
