"""torchpass.checkpoint in an ordinary user's --torchpass job, through a live migration.

examples/train_checkpointed.py (train_ddp.py plus ``Checkpointer``, a save every 5 steps) runs
as tpuser1 under plain sbatch (the reference) and under ``--torchpass=spares=1`` with an ECC
drill on a random training node at a random step (seed printed; ``TORCHPASS_TEST_SEED=N``
replays it). The job keeps its id, Restarts=0, COMPLETED 0:0, every step once per rank with the
reference's losses bit for bit (drill.migrate); besides:

- every save of the migrated job completed and the coordinator heard of each one
  (``checkpoint.completed``, reported by rank 0 over its signed link, before and after the move);
- the checkpoint directory holds the newest ``keep`` complete checkpoints, each loadable: DCP's
  ``.metadata`` and torchpass.json, no results file left;
- the checkpoints of the torchpass run and of the plain run hold the same bytes, step by step.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from drill import Drill, events, leave_clean, migrate, reference

pytestmark = pytest.mark.integration

SEED = int(os.environ.get("TORCHPASS_TEST_SEED") or time.time_ns() % 1_000_000)
REPO = Path(__file__).resolve().parents[2]
STEPS = 80
EVERY = 5
# The checkpoint directory per job ($SLURM_JOB_ID expands in the batch script), relative to the job
# dir, the ranks' working directory on every node.
JOB = Drill("train_checkpointed", (REPO / "examples" / "train_checkpointed.py").read_text(),
            ("--steps", str(STEPS), "--params", "1M", "--sleep", "0.05", "--ckpt-every", str(EVERY),
             "--ckpt-dir", "ckpt.$SLURM_JOB_ID"),
            STEPS, nodes=2, fault_steps=(2, 50))


def data_bytes(step_dir: Path) -> bytes:
    """The checkpoint's tensor data (every rank's .distcp file, in rank order)."""
    return b"".join(p.read_bytes() for p in sorted(step_dir.glob("__*_0.distcp")))


def test_application_checkpoints_of_a_user_job_survive_a_live_migration(cluster, plugin_built, job_dir, job_user):
    jobs: list[int] = []
    try:
        ref = reference(JOB, job_dir, job_user.name, jobs)
        migrate(cluster, JOB, job_dir, job_user.name, SEED, jobs, ref)
    finally:
        leave_clean(JOB, jobs)
    ref_job, mig_job = jobs
    saves = list(range(EVERY, STEPS, EVERY))
    told = [e for e in events(cluster, mig_job) if e["kind"] == "checkpoint.completed"]
    assert [e["data"]["step"] for e in told] == saves, [e["message"] for e in told]
    assert not [e for e in events(cluster, mig_job) if e["kind"] == "checkpoint.failed"]
    for job in (ref_job, mig_job):
        root = job_dir / f"ckpt.{job}"
        kept = sorted(p.name for p in root.iterdir())
        assert kept == [f"step-{s:09d}" for s in saves[-2:]], kept  # keep=2, nothing unfinished left
        for name in kept:
            record = json.loads((root / name / "torchpass.json").read_text())
            assert record["world_size"] == JOB.ranks and (root / name / ".metadata").is_file()
            assert not (root / name / ".torchpass-results").exists()
            assert (root / name).stat().st_uid == job_user.uid  # written by the job's user, not root
    for name in kept:
        assert data_bytes(job_dir / f"ckpt.{ref_job}" / name) == data_bytes(job_dir / f"ckpt.{mig_job}" / name)
    last = told[-1]["data"]
    print(f"checkpoints: {len(told)} completed; the last one {last['bytes'] / 1e6:.1f} MB, "
          f"training blocked {last['blocking_s']:.3f} s, written in {last['write_s']:.2f} s")
