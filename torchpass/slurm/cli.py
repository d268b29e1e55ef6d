"""Slurm client backend on the Slurm commands' ``--json`` output."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

from torchpass import envnames
from torchpass.errors import DependencyError, SlurmError
from torchpass.slurm.base import JobInfo, NodeInfo, SlurmClient, SpareRequest, StepInfo


def _number(v) -> int | None:
    # Slurm's JSON wraps numbers as {"set": bool, "infinite": bool, "number": n}.
    if isinstance(v, dict):
        return int(v["number"]) if v.get("set") and not v.get("infinite") else None
    return int(v) if isinstance(v, int) else None


class CliSlurmClient(SlurmClient):
    name = "cli"

    def __init__(self, environ: dict[str, str] | None = None, timeout_s: float = 15.0):
        self.environ = dict(os.environ if environ is None else environ)
        self.timeout_s = timeout_s

    def _run(self, argv: list[str], timeout_s: float | None = None) -> str:
        conf = self.environ.get("SLURM_CONF")
        if conf and not os.path.exists(conf):
            # Slurm's commands would retry for 60 s before saying so.
            raise SlurmError(f"SLURM_CONF={conf} does not exist; fix SLURM_CONF or unset it")
        if shutil.which(argv[0], path=self.environ.get("PATH")) is None:
            raise DependencyError(f"{argv[0]} not found on PATH; install the Slurm client (slurm-client)")
        try:
            proc = subprocess.run(
                argv, capture_output=True, text=True, env=self.environ, timeout=timeout_s or self.timeout_s
            )
        except subprocess.TimeoutExpired:
            raise SlurmError(f"'{' '.join(argv)}' did not finish in {timeout_s or self.timeout_s:g} s; "
                             "is slurmctld up?") from None
        if proc.returncode != 0:
            err = " ".join((proc.stderr or proc.stdout).split())[:300]
            raise SlurmError(f"'{' '.join(argv[:3])}' failed: {err}")
        return proc.stdout

    def _json(self, argv: list[str]) -> dict:
        out = self._run(argv)
        try:
            return json.loads(out)
        except json.JSONDecodeError:
            raise SlurmError(f"'{' '.join(argv[:3])}' did not print JSON") from None

    def nodes(self) -> list[NodeInfo]:
        data = self._json(["scontrol", "show", "nodes", "--json"])
        out = []
        for n in data.get("nodes", []):
            out.append(
                NodeInfo(
                    name=n["name"],
                    address=n.get("address") or n["name"],
                    state=tuple(n.get("state", [])),
                    reason=n.get("reason", "") or "",
                )
            )
        return out

    def _job_from(self, j: dict) -> JobInfo:
        state = j.get("job_state", ["UNKNOWN"])
        state = state[0] if isinstance(state, list) and state else str(state)
        nodes = j.get("nodes") or ""
        exit_code = j.get("exit_code")
        rc = None
        if isinstance(exit_code, dict):
            rc = _number(exit_code.get("return_code"))
        return JobInfo(
            job_id=int(j["job_id"]),
            name=j.get("name", ""),
            user=j.get("user_name", ""),
            user_id=int(j.get("user_id", -1)),
            state=state,
            nodes=tuple(self.expand_nodelist(nodes)) if nodes else (),
            batch_host=j.get("batch_host", "") or "",
            exit_code=rc,
            restarts=int(j.get("restart_cnt", 0) or 0),
            comment=j.get("comment", "") or "",
            admin_comment=j.get("admin_comment", "") or "",
            partition=j.get("partition", "") or "",
            account=j.get("account", "") or "",
            qos=j.get("qos", "") or "",
            end_time=_number(j.get("end_time")),
            output=j.get("standard_output", "") or "",
            error=j.get("standard_error", "") or "",
            reason=j.get("state_reason", "") or "",
            requeue=bool(j["requeue"]) if isinstance(j.get("requeue"), bool) else None,
            batch=bool(j.get("batch_flag", True)),
            extra={"raw_nodes": nodes},
        )

    def job(self, job_id: int) -> JobInfo | None:
        try:
            jobs = self._json(["scontrol", "show", "job", str(int(job_id)), "--json"]).get("jobs", [])
            if jobs:
                return self._job_from(jobs[0])
            # scontrol 24.11 with --json prints the same empty answer, exit status 0, for a job
            # slurmctld does not know and for a slurmctld it could not reach: a coordinator took
            # the second for its job's end and exited. squeue tells them apart: "Invalid job id
            # specified" for the first, "Unable to contact slurm controller" for the second.
            self._run(["squeue", "--json", "--jobs", str(int(job_id))])
        except SlurmError as exc:
            if "Invalid job id" in str(exc):
                return None
            raise
        return None

    def jobs(self, *, user: str | None = None, states: tuple[str, ...] = ("RUNNING",)) -> list[JobInfo]:
        argv = ["squeue", "--json"]
        if user:
            argv += ["--user", user]
        if states:
            argv += ["--states", ",".join(states)]
        data = self._json(argv)
        return [self._job_from(j) for j in data.get("jobs", [])]

    def expand_nodelist(self, nodelist: str) -> list[str]:
        if not nodelist:
            return []
        return self._run(["scontrol", "show", "hostnames", nodelist]).split()

    def drain(self, node: str, reason: str) -> None:
        self._run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"])

    def resume(self, node: str) -> None:
        self._run(["scontrol", "update", f"NodeName={node}", "State=RESUME"])

    def shrink(self, job_id: int, keep_nodes: list[str]) -> None:
        if not keep_nodes:
            raise SlurmError("shrink would leave the job without nodes")
        self._run(["scontrol", "update", f"JobId={int(job_id)}", f"NodeList={','.join(keep_nodes)}"])

    def set_job_field(self, job_id: int, name: str, value: str) -> None:
        if name not in ("AdminComment", "Comment") or "\n" in value:
            raise SlurmError(f"not a job text field or not one line: {name}")
        self._run(["scontrol", "update", f"JobId={int(job_id)}", f"{name}={value}"])

    def steps(self, job_id: int) -> list[StepInfo]:
        # squeue 24.11 ignores --jobs with --json (it prints every step): filter here.
        data = self._json(["squeue", "--steps", "--jobs", str(int(job_id)), "--json"])
        out = []
        for st in data.get("steps", []):
            sid = str(st.get("id") or "")
            if not sid.startswith(f"{int(job_id)}."):
                continue
            state = st.get("state") or ["UNKNOWN"]
            nodes = st.get("nodes") or ""
            out.append(StepInfo(step_id=sid, name=st.get("name", "") or "",
                                nodes=tuple(self.expand_nodelist(nodes)) if nodes else (),
                                state=state[0] if isinstance(state, list) and state else str(state)))
        return out

    def job_detail(self, job_id: int) -> str:
        return self._run(["scontrol", "show", "job", "-d", str(int(job_id))])

    def step_detail(self, step_id: str) -> str:
        if not re.fullmatch(r"\d+\.\d+", step_id):
            raise SlurmError(f"not a job step: {step_id!r}")
        return self._run(["scontrol", "show", "step", "-d", step_id])

    def allocate(self, req: SpareRequest) -> tuple[int, str]:
        argv = ["salloc", "--no-shell", "-N1", "-n1", "--exclusive", f"--immediate={max(1, int(req.immediate_s))}",
                "-J", req.name, f"--comment={req.comment}"]
        if req.exclude:
            argv.append(f"--exclude={','.join(req.exclude)}")
        for flag, value in (("--partition", req.partition), ("--account", req.account), ("--qos", req.qos)):
            if value:
                argv.append(f"{flag}={value}")
        if req.time_limit_min is not None:
            argv.append(f"--time={max(1, int(req.time_limit_min))}")
        if req.expand:
            argv.append(f"--dependency=expand:{int(req.job_id)}")
        argv.extend(req.resources)
        conf = self.environ.get("SLURM_CONF")
        if conf and not os.path.exists(conf):
            raise SlurmError(f"SLURM_CONF={conf} does not exist; fix SLURM_CONF or unset it")
        if shutil.which("salloc", path=self.environ.get("PATH")) is None:
            raise DependencyError("salloc not found on PATH; install the Slurm client (slurm-client)")
        # Called from inside the job: its SLURM_*/SPANK_*/TORCHPASS_* variables
        # would make salloc a nested allocation of the job (and the plugin a
        # torchpass one); the spare is an allocation of its own.
        env = {k: v for k, v in self.environ.items()
               if not k.startswith(("SLURM_", "SPANK_", envnames.PREFIX, "SALLOC_", "SBATCH_")) or k == "SLURM_CONF"}
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL,
                                  timeout=req.immediate_s + self.timeout_s)
            out = (proc.stderr or "") + (proc.stdout or "")
        except subprocess.TimeoutExpired as exc:
            proc = None
            out = (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        m = re.search(r"Granted job allocation (\d+)", out)
        if proc is None or proc.returncode != 0 or m is None:
            if m is not None:  # granted, then something failed: never leave it behind
                try:
                    self.cancel(int(m.group(1)))
                except SlurmError:
                    pass
            why = " ".join(out.split())[:300] or "no output"
            # what a GPU job's spare asked for, so that a refusal says it (a spare with too few GPUs)
            asked = f" ({' '.join(req.resources)})" if req.resources else ""
            raise SlurmError(f"salloc of a spare{asked} for job {req.job_id} failed: {why}")
        alloc = int(m.group(1))
        info = self.job(alloc)
        if info is None or len(info.nodes) != 1:
            self.cancel(alloc)
            raise SlurmError(f"spare allocation {alloc} has nodes {info.nodes if info else '?'}, expected one")
        return alloc, info.nodes[0]

    def merge_into(self, donor_id: int, job_id: int) -> None:
        donor = self.job(donor_id)
        if donor is None or not donor.nodes:
            raise SlurmError(f"donor job {donor_id} is gone or has no nodes")
        want = set(donor.nodes)
        # Slurm's FAQ flow: the donor gives its nodes up (NumNodes=0), the job
        # takes them (NumNodes=ALL). Slurm 24.11 moves them at the first step.
        self._run(["scontrol", "update", f"JobId={int(donor_id)}", "NumNodes=0"])
        job = self.job(job_id)
        if job is None or not want <= set(job.nodes):
            self._run(["scontrol", "update", f"JobId={int(job_id)}", "NumNodes=ALL"])
            job = self.job(job_id)
        if job is None or not want <= set(job.nodes):
            raise SlurmError(f"job {job_id} did not take the nodes of donor {donor_id} "
                             f"({', '.join(sorted(want))}); is SchedulerParameters=permit_job_expansion set?")

    def cancel(self, job_id: int) -> None:
        self._run(["scancel", str(int(job_id))])

    def cancel_step(self, step_id: str) -> None:
        job, _, step = step_id.partition(".")
        self._run(["scancel", f"{int(job)}.{int(step)}"])

    def requeue(self, job_id: int) -> None:
        self._run(["scontrol", "requeue", str(int(job_id))])

    def requeue_hold(self, job_id: int) -> None:
        self._run(["scontrol", "requeuehold", str(int(job_id))])

    def release(self, job_id: int) -> None:
        # A requeued job also waits for a begin time (about 2 min on 24.11): the owner may move it
        # to now (tried), so that a resumed job starts as soon as nodes are free.
        self._run(["scontrol", "update", f"JobId={int(job_id)}", "StartTime=now"])
        self._run(["scontrol", "release", str(int(job_id))])
