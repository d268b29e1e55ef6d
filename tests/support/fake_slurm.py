"""An in-memory slurmctld behind the whole ``SlurmClient`` interface.

Tests set up its tables (jobs, nodes, steps), script a failure or an answer for a call where
they need one, and read back every call it was asked, in order. Its answers follow its tables
the way slurmctld's follow its state: a drained node lists DRAIN, a requeued job pends with one
restart more, a merged donor's node joins the job."""

from __future__ import annotations

import re
import threading
from collections import deque
from dataclasses import replace

from torchpass.errors import SlurmError
from torchpass.slurm.base import JobInfo, NodeInfo, SlurmClient, SpareRequest, StepInfo

_NOT_SCRIPTED = object()
_RANGE = re.compile(r"^([^\[,]*)\[([^\]]+)\](.*)$")


class FakeSlurm(SlurmClient):
    name = "fake"

    def __init__(self, *, jobs: tuple[JobInfo, ...] | list[JobInfo] = (),
                 nodes: tuple[NodeInfo, ...] | list[NodeInfo] = (),
                 steps: dict[int, list[StepInfo]] | None = None,
                 grant: tuple[int, str] | None = None):
        self.job_table: dict[int, JobInfo] = {j.job_id: j for j in jobs}
        self.node_table: dict[str, NodeInfo] = {n.name: n for n in nodes}
        self.step_table: dict[int, list[StepInfo]] = {j: list(s) for j, s in (steps or {}).items()}
        self.grant = grant  # allocate's answer: (donor job id, node); None: no node is free
        self.calls: list[tuple] = []  # (method, *args) of every call, in order
        self._scripted: dict[str, deque] = {}
        self._refused: dict[str, Exception] = {}
        self._lock = threading.Lock()  # tpassd and the coordinator ask from several threads

    # --- what a test sets up and reads back ---------------------------------------------------
    def run_job(self, job_id: int, *, user: str = "u", uid: int = 1001, nodes: tuple[str, ...] = ("n1",),
                state: str = "RUNNING", name: str = "train", **fields) -> JobInfo:
        """Add (or replace) a job; ``fields`` are JobInfo's other fields."""
        job = JobInfo(job_id, name, user, uid, state, tuple(nodes), **fields)
        self.job_table[job_id] = job
        return job

    def set_node(self, name: str, *state: str, address: str | None = None, reason: str = "") -> NodeInfo:
        node = NodeInfo(name, address or name, tuple(state) or ("IDLE",), reason)
        self.node_table[name] = node
        return node

    def script(self, method: str, *answers) -> None:
        """The next calls of ``method`` answer these, one each, before the tables answer again:
        an exception is raised, anything else returned."""
        self._scripted.setdefault(method, deque()).extend(answers)

    def refuse(self, method: str, error: Exception | str | None) -> None:
        """Every call of ``method`` raises ``error`` (a str: SlurmError) until refused with None."""
        if error is None:
            self._refused.pop(method, None)
        else:
            self._refused[method] = SlurmError(error) if isinstance(error, str) else error

    def calls_of(self, method: str) -> list[tuple]:
        """The arguments of each call of ``method``, in order."""
        with self._lock:
            return [c[1:] for c in self.calls if c[0] == method]

    def count(self, method: str) -> int:
        return len(self.calls_of(method))

    @property
    def drained(self) -> list[tuple[str, str]]:
        """(node, reason) of every drain asked."""
        return self.calls_of("drain")

    def _call(self, method: str, *args):
        with self._lock:
            self.calls.append((method, *args))
            if method in self._refused:
                raise self._refused[method]
            queue = self._scripted.get(method)
            if queue:
                answer = queue.popleft()
                if isinstance(answer, BaseException):
                    raise answer
                return answer
        return _NOT_SCRIPTED

    # --- SlurmClient --------------------------------------------------------------------------
    def nodes(self) -> list[NodeInfo]:
        got = self._call("nodes")
        return list(self.node_table.values()) if got is _NOT_SCRIPTED else got

    def job(self, job_id: int) -> JobInfo | None:
        got = self._call("job", job_id)
        return self.job_table.get(job_id) if got is _NOT_SCRIPTED else got

    def jobs(self, *, user: str | None = None, states: tuple[str, ...] = ("RUNNING",)) -> list[JobInfo]:
        got = self._call("jobs", user, tuple(states))
        if got is not _NOT_SCRIPTED:
            return got
        return [j for j in self.job_table.values()
                if (user is None or j.user == user) and (not states or j.state in states)]

    def expand_nodelist(self, nodelist: str) -> list[str]:
        got = self._call("expand_nodelist", nodelist)
        if got is not _NOT_SCRIPTED:
            return got
        names: list[str] = []
        for part in re.split(r",(?![^\[]*\])", nodelist):
            m = _RANGE.match(part)
            if not m:
                names += [part] if part else []
                continue
            prefix, ranges, suffix = m.groups()
            for r in ranges.split(","):
                lo, _, hi = r.partition("-")
                width = len(lo)
                for i in range(int(lo), int(hi or lo) + 1):
                    names.append(f"{prefix}{i:0{width}d}{suffix}")
        return names

    def drain(self, node: str, reason: str) -> None:
        if self._call("drain", node, reason) is _NOT_SCRIPTED and node in self.node_table:
            n = self.node_table[node]
            self.node_table[node] = replace(n, state=tuple(s for s in n.state if s != "DRAIN") + ("DRAIN",),
                                            reason=reason)

    def resume(self, node: str) -> None:
        if self._call("resume", node) is _NOT_SCRIPTED and node in self.node_table:
            n = self.node_table[node]
            self.node_table[node] = replace(n, state=tuple(s for s in n.state if s not in ("DRAIN", "DRAINED"))
                                            or ("IDLE",), reason="")

    def shrink(self, job_id: int, keep_nodes: list[str]) -> None:
        if self._call("shrink", job_id, tuple(keep_nodes)) is _NOT_SCRIPTED and job_id in self.job_table:
            self.job_table[job_id] = replace(self.job_table[job_id], nodes=tuple(keep_nodes))

    def steps(self, job_id: int) -> list[StepInfo]:
        got = self._call("steps", job_id)
        return list(self.step_table.get(job_id, ())) if got is _NOT_SCRIPTED else got

    def allocate(self, req: SpareRequest) -> tuple[int, str]:
        got = self._call("allocate", req)
        if got is not _NOT_SCRIPTED:
            return got
        if self.grant is None:
            raise SlurmError(f"salloc of a spare for job {req.job_id} failed: Immediate execution impossible")
        donor, node = self.grant
        self.run_job(donor, name=req.name, nodes=(node,), comment=req.comment)
        return donor, node

    def merge_into(self, donor_id: int, job_id: int) -> None:
        if self._call("merge_into", donor_id, job_id) is not _NOT_SCRIPTED:
            return
        donor, job = self.job_table.get(donor_id), self.job_table.get(job_id)
        if job is not None and donor is not None:
            self.job_table[job_id] = replace(job, nodes=job.nodes + donor.nodes)
            self.job_table[donor_id] = replace(donor, state="COMPLETED", nodes=())

    def cancel(self, job_id: int) -> None:
        if self._call("cancel", job_id) is _NOT_SCRIPTED and job_id in self.job_table:
            self.job_table[job_id] = replace(self.job_table[job_id], state="CANCELLED")

    def cancel_step(self, step_id: str) -> None:
        if self._call("cancel_step", step_id) is _NOT_SCRIPTED:
            job_id = int(step_id.split(".")[0])
            self.step_table[job_id] = [s for s in self.step_table.get(job_id, ()) if s.step_id != step_id]

    def requeue(self, job_id: int) -> None:
        if self._call("requeue", job_id) is _NOT_SCRIPTED and job_id in self.job_table:
            job = self.job_table[job_id]
            self.job_table[job_id] = replace(job, state="PENDING", restarts=job.restarts + 1)

    def requeue_hold(self, job_id: int) -> None:
        if self._call("requeue_hold", job_id) is _NOT_SCRIPTED and job_id in self.job_table:
            job = self.job_table[job_id]
            self.job_table[job_id] = replace(job, state="PENDING", restarts=job.restarts + 1,
                                             reason="job_requeued_in_held_state")

    def release(self, job_id: int) -> None:
        if self._call("release", job_id) is _NOT_SCRIPTED and job_id in self.job_table:
            self.job_table[job_id] = replace(self.job_table[job_id], reason="")
