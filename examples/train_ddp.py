"""A plain DDP training script that knows nothing about torchpass.

Reads its place in the job from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, or
from Slurm (SLURM_PROCID, SLURM_NTASKS, the first host of SLURM_NODELIST as
master). Deterministic: one thread, seeded data, so two runs print the same
losses bit for bit. Prints one line per step, ``step=N loss=<float.hex>``.

    python examples/train_ddp.py --steps 50 --params 10M --sleep 0.05
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def first_host(nodelist: str) -> str:
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        return out.stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        m = re.match(r"([^\[,]+)(?:\[(\d+))?", nodelist)
        return m.group(1) + (m.group(2) or "")


def setup_env() -> None:
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
        os.environ.setdefault("MASTER_ADDR", first_host(os.environ["SLURM_NODELIST"]))
        job = int(os.environ.get("SLURM_JOB_ID", "0"))
        os.environ.setdefault("MASTER_PORT", str(20000 + job % 20000))


def parse_params(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)


def build_model(params: int, width_in: int = 64) -> nn.Module:
    # Three linear layers: in -> h -> h -> 1 with about `params` weights.
    h = max(8, int((-(width_in + 2) + ((width_in + 2) ** 2 + 4 * params) ** 0.5) / 2))
    return nn.Sequential(nn.Linear(width_in, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, 1))


def add_args(ap: argparse.ArgumentParser) -> None:
    """The options this script shares with its variants (examples/train_checkpointed.py)."""
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--params", default="100K", help="model size, e.g. 100K, 10M, 100M")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep after each step")
    ap.add_argument("--lr", type=float, default=1e-3)


@dataclass
class Training:
    """One rank's training: the model, DDP, Adam, its data generator."""

    rank: int
    world: int
    model: nn.Module
    ddp: DDP
    opt: torch.optim.Optimizer
    gen: torch.Generator
    w_true: torch.Tensor
    batch: int

    def step(self) -> float:
        """One optimizer step; the global mean loss (the same number on every rank)."""
        x = torch.randn(self.batch, 64, generator=self.gen)
        y = torch.tanh(x @ self.w_true)
        self.opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(self.ddp(x), y)
        loss.backward()
        self.opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        return t.item() / self.world


def start(args: argparse.Namespace) -> Training:
    """The process group and the seeded model, DDP (then Adam: the order the state loads into)."""
    torch.set_num_threads(1)
    setup_env()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_model(parse_params(args.params))
    bucket_mb = getattr(args, "bucket_mb", None)
    ddp = DDP(model, **({} if bucket_mb is None else {"bucket_cap_mb": bucket_mb}))
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1000 + rank)
    w_true = torch.randn(64, 1, generator=torch.Generator().manual_seed(7))
    return Training(rank, world, model, ddp, opt, gen, w_true, args.batch)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    add_args(ap)
    ap.add_argument("--bucket-mb", type=float, default=None, help="DDP bucket_cap_mb")
    args = ap.parse_args(argv)

    job = start(args)
    for step in range(args.steps):
        print(f"step={step} loss={job.step().hex()}", flush=True)
        if args.sleep:
            time.sleep(args.sleep)
    # Plain torch 2.13 (gloo) can abort at interpreter exit, "terminate called without an
    # active exception" (7 of 30 two-rank runs of this script on one host, no torchpass
    # loaded). Freeing the model, DDP's reducer and the last tensors while the group lives
    # avoids it (0 of 30).
    job = None
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
