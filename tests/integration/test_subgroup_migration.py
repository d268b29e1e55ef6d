"""A DeviceMesh job moves like a DDP job.

The job: data x tensor parallel on a 2-D CPU DeviceMesh, 6 ranks, 2 per
node: ``init_device_mesh("cpu", (3, 2), mesh_dim_names=("dp", "tp"))``,
gradients averaged over ``dp``, the loss summed over ``tp``, and the global
mean loss (the default group) printed as ``step=N loss=<float.hex>``. The
script knows nothing about torchpass.

The reference is the same script under plain ``sbatch -N3`` (no
``--torchpass``: the runtime is not even loaded). The drilled job runs as
the tests' ordinary job user with ``-N4 --torchpass=spares=1``; an ECC drill
lands on a random training node at a random step: both ranks there are
paused with every group torn down (no socket left: CRIU dumps them), moved
to the spare, and every group, the mesh's included, is rebuilt. The job
keeps its id, ``Restarts=0``, ends COMPLETED 0:0, and every step appears
exactly once per rank with the reference's losses bit for bit.

Randomness: node and step from one seed, printed; ``TORCHPASS_TEST_SEED=N``
replays a run.
"""

from __future__ import annotations

import os
import textwrap
import time

import pytest

from drill import Drill, leave_clean, migrate, reference

pytestmark = pytest.mark.integration

STEPS = 120
# Each step counts 2 (its end and the loss all_reduce): T = max + 64 is ~32 steps
# after the drill; leave the move time to finish before training does.
FAULT_STEPS = (2, 60)
SEED = int(os.environ.get("TORCHPASS_TEST_SEED") or time.time_ns() % 1_000_000)

MESH_SCRIPT = textwrap.dedent(
    r"""
    import os, sys, time, torch, torch.distributed as dist, torch.nn as nn
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_ddp import setup_env  # RANK/WORLD_SIZE/MASTER_* from Slurm
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    setup_env()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
    torch.manual_seed(mesh.get_local_rank("tp"))  # a tensor-parallel shard per tp index
    m = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(mesh.get_local_rank("dp"))  # data per dp index
    for step in range(int(sys.argv[1])):
        part = m(torch.randn(16, 32, generator=g)).pow(2).mean()
        opt.zero_grad(); part.backward()
        for p in m.parameters():
            dist.all_reduce(p.grad, group=dp); p.grad /= dist.get_world_size(dp)
        opt.step()
        loss = part.detach().clone(); dist.all_reduce(loss, group=tp)
        dist.all_reduce(loss)
        print(f"step={step} loss={(loss.item() / world).hex()}", flush=True)
        time.sleep(0.05)
    dist.destroy_process_group()
    os._exit(0)  # plain torch 2.13 may abort at a normal exit (docs/runtime.md, "Unprotected jobs")
    """
)


JOB = Drill("train_mesh", MESH_SCRIPT, (str(STEPS),), STEPS, nodes=3, per_node=2, fault_steps=FAULT_STEPS)


def test_2d_mesh_job_migrates_bit_identical(cluster, plugin_built, job_dir, job_user):
    jobs: list[int] = []
    try:
        ref = reference(JOB, job_dir, job_user.name, jobs)  # every rank prints the same global loss
        migrate(cluster, JOB, job_dir, job_user.name, SEED, jobs, ref)  # both ranks of the node moved
    finally:
        leave_clean(JOB, jobs)
