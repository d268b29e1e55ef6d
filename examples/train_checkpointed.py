"""examples/train_ddp.py with torchpass application checkpoints (``torchpass.checkpoint``).

The same model, data and step lines as examples/train_ddp.py, so a fault-free
run prints the same losses bit for bit. Every ``--ckpt-every`` steps it saves
the model, the Adam state and each rank's data generator with
``torchpass.checkpoint.Checkpointer`` (training waits only for the copy to host
memory; the files are written in the background). At start it loads the newest
complete checkpoint, if any, and goes on from the step after it: what a job
relaunched after a failure does. Rank 0 prints ``ckpt loaded step=N`` and, per
save, ``ckpt saved step=N blocking_s=S`` to stderr.

    python examples/train_checkpointed.py --steps 60 --params 10M --ckpt-dir /shared/ckpt/run1 --ckpt-every 10
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_ddp import build_model, parse_params, setup_env  # noqa: E402

import torchpass.checkpoint as tpc  # noqa: E402


class RankGenerator:
    """Each rank's data generator, saved under its own key (every rank draws its own batches)."""

    def __init__(self, gen: torch.Generator, rank: int):
        self.gen, self.key = gen, f"rank{rank}"

    def state_dict(self) -> dict:
        return {self.key: self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state[self.key])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--params", default="100K")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ckpt-dir", type=Path, required=True)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--keep", type=int, default=2)
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    setup_env()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = build_model(parse_params(args.params))
    ddp = DDP(model)  # the same construction order as train_ddp.py
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1000 + rank)
    w_true = torch.randn(64, 1, generator=torch.Generator().manual_seed(7))

    ckpt = tpc.Checkpointer(args.ckpt_dir, keep=args.keep)
    state = {"train": tpc.ModelState(ddp, opt), "data": RankGenerator(gen, rank)}
    start = ckpt.load(state) or 0
    if start and rank == 0:
        print(f"ckpt loaded step={start}", file=sys.stderr, flush=True)

    for step in range(start, args.steps):
        x = torch.randn(args.batch, 64, generator=gen)
        y = torch.tanh(x @ w_true)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        print(f"step={step} loss={(t.item() / world).hex()}", flush=True)
        if (step + 1) % args.ckpt_every == 0 and step + 1 < args.steps:
            ckpt.save(step + 1, state)  # steps done: a restart goes on from here
            if rank == 0:
                print(f"ckpt saved step={step + 1} blocking_s={ckpt.last['blocking_s']:.4f}",
                      file=sys.stderr, flush=True)
        if args.sleep:
            time.sleep(args.sleep)
    ckpt.close()
    # As in train_ddp.py: free what holds the group before destroying it (plain torch 2.13 can
    # abort at exit otherwise), and leave without the interpreter's own teardown.
    ddp = model = opt = loss = t = state = None
    gc.collect()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
