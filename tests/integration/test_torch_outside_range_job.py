"""A torch outside the runtime's tested range (torch 2.11, stood in for by
TORCHPASS_TEST_TORCH_VERSION: one torch is installed here): a 2-rank --torchpass job trains to
its end unprotected, each rank says so in one line, and the coordinator records job.unprotected
with the reason."""

from __future__ import annotations

import pytest

import training_jobs as tj
from drill import events
from torchpass import envnames

pytestmark = pytest.mark.integration

STEPS = 80
LINE = ("torchpass: torch 2.11.0 is outside the tested range (2.13); the runtime patches nothing; "
        "training runs unprotected")


def test_a_torch_outside_the_range_trains_to_the_end_unprotected(cluster, plugin_built, job_dir, job_user):
    job_id = tj.submit(job_dir, "torch211", STEPS, nodes=2, torchpass="spares=0", user=job_user.name,
                       sbatch_extra=(f"--export=ALL,{envnames.TEST_TORCH_VERSION}=2.11.0",))
    final = tj.wait_end(job_id, 240)
    text = (job_dir / f"torch211.{job_id}.out").read_text()
    assert final["job_state"] == ["COMPLETED"], tj.excerpt(text)
    per_step = tj.per_step(tj.steps(text))
    assert sorted(per_step) == list(range(STEPS)), tj.excerpt(text)
    assert all(sum(c.values()) == 2 for c in per_step.values()), "each step printed by both ranks"
    said = [ln for ln in text.splitlines() if ln.startswith("torchpass:")]
    assert said == [LINE, LINE], tj.excerpt(text)  # one line per rank, and nothing else from torchpass
    evs = events(cluster, job_id)
    unprotected = [e for e in evs if e["kind"] == "job.unprotected"]
    assert len(unprotected) == 1, evs
    assert "torch 2.11.0 is outside the tested range (2.13)" in unprotected[0]["message"], unprotected
