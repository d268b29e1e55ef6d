"""How the CLI backend reads what Slurm 24.11's commands print.

The answers below were recorded from the devcluster's Slurm 24.11 (2026-12-06): with ``--json``,
``scontrol show job J`` prints the same empty answer, exit status 0, for a job slurmctld does not
know and for a slurmctld it cannot reach. The real commands are exercised in
tests/integration/test_slurmctld_outage.py (slurmctld stopped for minutes).
"""

from __future__ import annotations

import json

import pytest

from torchpass.errors import SlurmError
from torchpass.slurm.cli import CliSlurmClient

EMPTY = json.dumps({"jobs": [], "last_backfill": {"set": True, "infinite": False, "number": 0},
                    "last_update": {"set": True, "infinite": False, "number": 0}, "errors": [], "warnings": []})
UNREACHABLE = ("'squeue --json --jobs' failed: slurm_load_jobs error: Unable to contact slurm controller "
               "(connect failure)")
UNKNOWN = "'squeue --json --jobs' failed: slurm_load_jobs error: Invalid job id specified"


class Recorded(CliSlurmClient):
    """The CLI backend with each command's recorded answer (a string printed, or the error raised)."""

    def __init__(self, answers: dict[str, str | SlurmError]):
        super().__init__(environ={})
        self.answers = answers
        self.asked: list[str] = []

    def _run(self, argv, timeout_s=None):
        self.asked.append(argv[0])
        got = self.answers[argv[0]]
        if isinstance(got, SlurmError):
            raise got
        return got


def test_an_empty_answer_from_an_unreachable_slurmctld_is_an_error_not_a_gone_job():
    client = Recorded({"scontrol": EMPTY, "squeue": SlurmError(UNREACHABLE)})
    with pytest.raises(SlurmError, match="Unable to contact slurm controller"):
        client.job(8)
    assert client.asked == ["scontrol", "squeue"]


def test_a_job_slurmctld_does_not_know_is_none():
    client = Recorded({"scontrol": EMPTY, "squeue": SlurmError(UNKNOWN)})
    assert client.job(100_008) is None


def test_a_known_job_is_read_from_scontrol_alone():
    job = {"job_id": 8, "name": "outage", "user_name": "tpuser1", "user_id": 1001, "job_state": ["RUNNING"],
           "nodes": "", "batch_host": "node1"}
    client = Recorded({"scontrol": json.dumps({"jobs": [job]})})
    info = client.job(8)
    assert info is not None and info.job_id == 8 and info.user_id == 1001 and client.asked == ["scontrol"]
