"""A DDP job whose DataLoader has 2 worker processes: unprotected, no harm.

The script (knows nothing about torchpass): gloo DDP, 2 ranks, one per
training node; its batches come from ``DataLoader(num_workers=2,
persistent_workers=True)`` over a deterministic map-style dataset, so the 2
workers are children of the rank for the whole run, inside the process
tree that CRIU dumps. The workers hand their batches to the rank over Unix
sockets (torch shares tensors by passing fds: multiprocessing's
resource_sharer), which the move cannot take: the dump refuses any socket
(docs/runtime.md, "What is covered"). So at the pause a rank finds the
sockets of its children and says it is unprotected in one line (an event
records it; the first refusal cancels the pause for all), the coordinator
rolls the move back and training goes on: the job keeps its id, Restarts=0,
ends COMPLETED 0:0, and every step appears exactly once per rank with the
losses of the same script under plain sbatch, bit for bit. (Without the socket check the
ranks pause, the dump fails on the sockets after the pause, and the job
never says it is unprotected.)

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

SEED = int(os.environ.get("TORCHPASS_TEST_SEED") or time.time_ns() % 1_000_000)
STEPS = 100

SCRIPT = textwrap.dedent(
    r"""
    import os, sys, time, torch, torch.distributed as dist, torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, Dataset
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_ddp import setup_env  # RANK/WORLD_SIZE/MASTER_* from Slurm

    class Points(Dataset):  # item i is the same tensor in every run and in every worker
        def __init__(self, rank): self.rank = rank
        def __len__(self): return 1 << 20
        def __getitem__(self, i):
            x = torch.randn(32, generator=torch.Generator().manual_seed(self.rank * 7919 + i))
            return x, torch.tanh(x.sum(0, keepdim=True))

    torch.set_num_threads(1)
    setup_env()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(Points(rank), batch_size=16, num_workers=2, persistent_workers=True)
    batches = iter(loader)
    for step in range(int(sys.argv[1])):
        x, y = next(batches)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        t = loss.detach().clone(); dist.all_reduce(t)
        print(f"step={step} loss={(t.item() / world).hex()}", flush=True)
        time.sleep(0.05)
    del batches, loader
    dist.destroy_process_group()
    os._exit(0)  # plain torch 2.13 may abort at a normal exit (docs/runtime.md, "Unprotected jobs")
    """
)
JOB = Drill("dataloader", SCRIPT, (str(STEPS),), STEPS, nodes=2, per_node=1, fault_steps=(2, 40))


def test_ddp_job_with_dataloader_workers_is_unprotected_and_unharmed(cluster, plugin_built, job_dir, job_user):
    jobs: list[int] = []
    try:
        ref = reference(JOB, job_dir, job_user.name, jobs)
        migrate(cluster, JOB, job_dir, job_user.name, SEED, jobs, ref, unprotected="its child process(es)")
    finally:
        leave_clean(JOB, jobs)
