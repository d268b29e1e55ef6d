"""Small helpers for driving real Slurm from integration tests."""

from __future__ import annotations

import os
import pwd
import re
import subprocess
import sys
import time
from pathlib import Path

from torchpass.slurm import client
from torchpass.slurm.base import JobInfo


def as_user(argv: list[str], user: str | None) -> list[str]:
    """``argv`` run as ``user`` (a login-less runuser: what the user typing it would run), or as root."""
    return ["runuser", "-u", user, "--", *argv] if user else list(argv)


def submit_env(user: str | None = None) -> dict[str, str]:
    """The environment a submitting user has: the cluster's SLURM_CONF, none of the
    test process's TORCHPASS_* exports (they must not leak into the job), and for an
    ordinary user no PATH entry into root's home (they could not run it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPASS_")}
    if user:
        pw = pwd.getpwnam(user)
        env.update(HOME=pw.pw_dir, USER=user, LOGNAME=user,
                   PATH="/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin")
    return env


def user_run(argv: list[str], *, user: str | None, env: dict | None = None, timeout: float = 30,
             **kw) -> subprocess.CompletedProcess:
    """Run a client command (sbatch, scancel, squeue, tpassctl) as ``user``."""
    return subprocess.run(as_user(argv, user), capture_output=True, text=True, timeout=timeout,
                          env=env if env is not None else submit_env(user), **kw)


def sbatch(args: list[str], script: str, *, cwd: Path, check: bool = True, user: str | None = None,
           env: dict | None = None) -> subprocess.CompletedProcess:
    """Submit ``script`` from ``cwd`` as ``user`` (root if None); the script file is theirs."""
    path = cwd / f"job-{time.monotonic_ns()}.sbatch"
    path.write_text(script)
    path.chmod(0o755)
    if user:
        pw = pwd.getpwnam(user)
        os.chown(path, pw.pw_uid, pw.pw_gid)
    proc = user_run(["sbatch", "--parsable", *args, str(path)], user=user, env=env, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"sbatch{' as ' + user if user else ''} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def job_python() -> str:
    """The interpreter job scripts run: the devcluster's job Python (every job user can run it;
    root's own Python may not be). Set by the ``cluster`` fixture."""
    return os.environ["TORCHPASS_JOB_PYTHON"]


def tpassctl(*args: str, user: str | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    """``tpassctl ARGS`` as ``user`` (the job Python's, which they can run) with the cluster's
    exports, as after ``eval "$(tpassctl devcluster env)"``; as root, root's own."""
    prog = str(Path(job_python()).parent / "tpassctl") if user else str(Path(sys.executable).parent / "tpassctl")
    env = {**submit_env(user), **{k: v for k, v in os.environ.items() if k.startswith("TORCHPASS_")}}
    return user_run([prog, *args], user=user, env=env, timeout=timeout, cwd="/")


def scancel(job_id: int, *args: str, user: str | None = None) -> subprocess.CompletedProcess:
    return user_run(["scancel", *args, str(job_id)], user=user)


def squeue(*args: str, user: str | None = None) -> subprocess.CompletedProcess:
    return user_run(["squeue", *args], user=user)


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
