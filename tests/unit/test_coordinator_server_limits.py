"""The coordinator's open-file limit: raised to the hard limit at start, with one line when even
that is below what the job's ranks need (a kept connection per rank)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from torchpass.coordinator.main import FDS_PER_NODE, FDS_PER_RANK, FDS_SLACK, job_size

# In a child process (the limits are the process's own): set them, call raise_open_files as main
# does, print its log lines and the limits after.
CHILD = r"""
import json, resource, sys
soft, hard, ranks, nodes = json.loads(sys.argv[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
from torchpass import logs
logs.configure("info", json=True, stream=sys.stdout)
from torchpass.coordinator.main import raise_open_files
got = raise_open_files(ranks, nodes, logs.get_logger("torchpass.coordinator"))
print(json.dumps({"got": got, "limits": resource.getrlimit(resource.RLIMIT_NOFILE)}))
"""


def run_child(soft: int, hard: int, ranks: int | None, nodes: int | None) -> tuple[dict, list[dict]]:
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps([soft, hard, ranks, nodes])],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    *logs, last = [json.loads(line) for line in out.stdout.splitlines()]
    return last, logs


def hard_limit() -> int:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return 1 << 20 if hard == resource.RLIM_INFINITY else hard


def test_the_soft_limit_is_raised_to_the_hard_one_quietly_when_that_is_enough():
    hard = hard_limit()
    ranks = (hard - FDS_SLACK - 100 * FDS_PER_NODE) // FDS_PER_RANK // 2
    if ranks < 64:
        pytest.fail(f"this machine's hard open-file limit ({hard}) is too low for the test")
    res, logs = run_child(64, hard, ranks, 100)
    assert res["got"] == hard and res["limits"] == [hard, hard]
    assert logs == []


def test_a_hard_limit_below_the_jobs_need_is_said_in_one_line():
    hard = 1024  # what Slurm gives by default; 8,192 ranks need ~17,000
    res, logs = run_child(256, hard, 8192, 1024)
    assert res["limits"] == [hard, hard]  # still raised as far as it goes
    (line,) = logs
    assert line["level"] == "warning" and line["event"].startswith("open-file limit below what this job needs")
    assert line["limit"] == hard and line["ranks"] == 8192
    assert line["needed"] == FDS_PER_RANK * 8192 + FDS_PER_NODE * 1024 + FDS_SLACK


@pytest.mark.parametrize("env, size", [
    ({"SLURM_NTASKS": "8192", "SLURM_JOB_NUM_NODES": "1024"}, (8192, 1024)),
    ({"SLURM_TASKS_PER_NODE": "8(x1023),4", "SLURM_NNODES": "1024"}, (8188, 1024)),
    ({"SLURM_NPROCS": "3", "SLURM_TASKS_PER_NODE": "2,1"}, (3, None)),
    ({"SLURM_TASKS_PER_NODE": "8(xbad)"}, (None, None)),  # not Slurm's form: unknown, never a guess
    ({}, (None, None)),
])
def test_the_jobs_size_comes_from_slurms_environment(env, size):
    assert job_size(env) == size
