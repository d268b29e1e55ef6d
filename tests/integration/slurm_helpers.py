"""Small helpers for driving real Slurm from integration tests."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

from torchpass.slurm import client
from torchpass.slurm.base import JobInfo


def sbatch(args: list[str], script: str, *, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    path = cwd / f"job-{time.monotonic_ns()}.sbatch"
    path.write_text(script)
    path.chmod(0o755)
    # The test process carries the devcluster's TORCHPASS_* exports; a
    # submitting user would not, and they must not leak into the job.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPASS_")}
    proc = subprocess.run(["sbatch", "--parsable", *args, str(path)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=30)
    if check and proc.returncode != 0:
        raise AssertionError(f"sbatch failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def job_id_of(proc: subprocess.CompletedProcess) -> int:
    m = re.match(r"^(\d+)", proc.stdout.strip())
    assert m, f"sbatch printed no job id: {proc.stdout!r} {proc.stderr!r}"
    return int(m.group(1))


def wait_job(job_id: int, *, timeout_s: float = 120.0, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                             "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")) -> JobInfo:
    c = client()
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = c.job(job_id)
        if last is not None and last.state in states:
            return last
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not finish in {timeout_s:g} s; last state {last and last.state}")


def wait_running(job_id: int, *, timeout_s: float = 60.0) -> JobInfo:
    c = client()
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = c.job(job_id)
        if last is not None and last.state == "RUNNING":
            return last
        if last is not None and last.state not in ("PENDING", "CONFIGURING"):
            raise AssertionError(f"job {job_id} is {last.state}, never ran")
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not start in {timeout_s:g} s; last state {last and last.state}")
