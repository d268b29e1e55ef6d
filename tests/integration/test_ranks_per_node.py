"""Several ranks per node move together, in parallel (issue 11, deliver 4).

examples/train_ddp.py (unchanged, gloo DDP, 100K parameters) as 8 ranks, 4 on
each of two training nodes (``--overcommit``: devcluster nodes have 2 CPUs),
submitted by the tests' ordinary job user. An ECC drill lands on a random
training node at a random step: all 4 ranks there are paused, dumped and
restored on the spare (the coordinator asks each rank's dump and restore at
once: one tpassd request and one restore step per rank, tpassd serves them
on its worker pool), the group is rebuilt. Same job id, Restarts=0,
COMPLETED 0:0, every step exactly once per rank with the losses of the same
job under plain sbatch, bit for bit. The stall is printed (bench:
bench/bench_ranks_per_node.py, docs/benchmarks.md).

Randomness: node and step from one seed, printed; ``TORCHPASS_TEST_SEED=N``
replays a run.
"""

from __future__ import annotations

import os
import time

import pytest
from drill import Drill, leave_clean, migrate, reference

pytestmark = pytest.mark.integration

SEED = int(os.environ.get("TORCHPASS_TEST_SEED") or time.time_ns() % 1_000_000)
STEPS = 100
# T = max + 64 collectives (2 per step) ~ 32 steps after the drill: leave the move time to end.
JOB = Drill("ranks4", "", ("--steps", str(STEPS), "--params", "100K", "--sleep", "0.05"), STEPS,
            nodes=2, per_node=4, fault_steps=(2, 40), sbatch_extra=("--overcommit",))


def test_four_ranks_per_node_move_together_bit_identical(cluster, plugin_built, job_dir, job_user):
    jobs: list[int] = []
    try:
        ref = reference(JOB, job_dir, job_user.name, jobs)
        migrate(cluster, JOB, job_dir, job_user.name, SEED, jobs, ref)  # all 4 ranks of the node moved
    finally:
        leave_clean(JOB, jobs)
