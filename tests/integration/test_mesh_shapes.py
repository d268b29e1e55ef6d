"""Real training shapes move on the devcluster.

examples/train_parallel.py, a script that knows nothing about torchpass and
makes its own process groups from its first lines, in three layouts:

- ``mesh3d``: a 3-D DeviceMesh (dp, cp, tp) = (2, 2, 2), 8 ranks, 4 per
  node on 2 training nodes (``--overcommit``: devcluster nodes have 2 CPUs);
- ``hsdp``: FSDP2 ``fully_shard`` on a (replicate, shard) = (3, 2) mesh,
  6 ranks, 2 per node on 3 training nodes;
- ``pipeline``: 2 stages x 3 data-parallel ranks, 2 per node on 3 nodes,
  ``new_group`` per pipeline pair and per stage; activations and their
  gradients cross between stages (and nodes) by ``send``/``recv``;
- ``p2p``: 2 stages over the default group, 1 rank per node on 2 nodes,
  which carries only ``send``/``recv`` (no collective: the runtime counts
  its step ends, else no pause point is ever reached).

Each is run once under plain sbatch (no ``--torchpass``: the runtime is not
loaded; the reference) and once as the tests' ordinary job user with
``--torchpass=spares=1`` and one more node, the spare. An ECC drill lands on
a random training node at a random step (tests/integration/drill.py): every
rank of that node is paused with every group torn down (sends and receives
drained: no socket left, CRIU dumps it), moved to the spare, and every group
is rebuilt with its identity. The job keeps its id, ``Restarts=0``, ends
COMPLETED 0:0, and every step appears exactly once per rank with the
reference's losses bit for bit (float.hex).

Randomness: node and step from one seed, printed; ``TORCHPASS_TEST_SEED=N``
replays a run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from drill import Drill, leave_clean, migrate, reference

pytestmark = pytest.mark.integration

SEED = int(os.environ.get("TORCHPASS_TEST_SEED") or time.time_ns() % 1_000_000)
SCRIPT = (Path(__file__).resolve().parents[2] / "examples" / "train_parallel.py").read_text()
STEPS = 100
# Each step counts 2 (its end and the default group's loss all_reduce): T = max + 64 is
# ~32 steps after the drill; leave the move time to end before training does.
FAULT_STEPS = (2, 40)


def drill(layout: str, nodes: int, per_node: int, *extra: str, steps: int = STEPS) -> Drill:
    return Drill(layout, SCRIPT, (layout, "--steps", str(steps), "--sleep", "0.05"), steps,
                 nodes=nodes, per_node=per_node, fault_steps=FAULT_STEPS, sbatch_extra=extra)


JOBS = [
    drill("mesh3d", 2, 4, "--overcommit"),
    drill("hsdp", 3, 2),
    drill("pipeline", 3, 2),
    drill("p2p", 2, 1, steps=160),  # each step counts 1 (its end): T lies twice as many steps ahead
]


@pytest.fixture(params=JOBS, ids=[j.name for j in JOBS])
def job(request) -> Drill:
    return request.param


@pytest.fixture
def jobs(job):
    """The test's job ids; at its end none is left, no drill armed, no torchpass drain."""
    ids: list[int] = []
    yield ids
    leave_clean(job, ids)


def test_training_shape_migrates_bit_identical(cluster, plugin_built, job_dir, job_user, job, jobs):
    ref = reference(job, job_dir, job_user.name, jobs)  # every rank prints the same global loss
    migrate(cluster, job, job_dir, job_user.name, SEED, jobs, ref)  # every rank of the node moved
