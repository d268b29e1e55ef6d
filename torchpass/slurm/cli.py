"""Slurm client backend on the Slurm commands' ``--json`` output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

from torchpass.errors import DependencyError, SlurmError
from torchpass.slurm.base import JobInfo, NodeInfo, SlurmClient


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

    def _run(self, argv: list[str]) -> str:
        conf = self.environ.get("SLURM_CONF")
        if conf and not os.path.exists(conf):
            # Slurm's commands would retry for 60 s before saying so.
            raise SlurmError(f"SLURM_CONF={conf} does not exist; fix SLURM_CONF or unset it")
        if shutil.which(argv[0], path=self.environ.get("PATH")) is None:
            raise DependencyError(f"{argv[0]} not found on PATH; install the Slurm client (slurm-client)")
        try:
            proc = subprocess.run(
                argv, capture_output=True, text=True, env=self.environ, timeout=self.timeout_s
            )
        except subprocess.TimeoutExpired:
            raise SlurmError(f"'{' '.join(argv)}' did not finish in {self.timeout_s:g} s; is slurmctld up?") from None
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
            extra={"raw_nodes": nodes},
        )

    def job(self, job_id: int) -> JobInfo | None:
        try:
            data = self._json(["scontrol", "show", "job", str(int(job_id)), "--json"])
        except SlurmError as exc:
            if "Invalid job id" in str(exc):
                return None
            raise
        jobs = data.get("jobs", [])
        return self._job_from(jobs[0]) if jobs else None

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
