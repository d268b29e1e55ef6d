"""examples/train_ddp.py with torchpass application checkpoints (``torchpass.checkpoint``).

The same model, data and step lines as examples/train_ddp.py, so a fault-free
run prints the same losses bit for bit. Every ``--ckpt-every`` steps it saves
the model, the Adam state and each rank's data generator with
``torchpass.checkpoint.Checkpointer`` (training waits only for the copy to host
memory; the files are written in the background). At start it loads the newest
complete checkpoint, if any, and goes on from the step after it: what a job
relaunched after a failure does (with one zero-loss backward pass first, so that
DDP's gradient buckets are the ones the job had: ``ddp_warm_up``). Rank 0 prints ``ckpt loaded step=N`` and, per
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torchpass.checkpoint as tpc
from train_ddp import add_args, start


class RankGenerator:
    """Each rank's data generator, saved under its own key (every rank draws its own batches)."""

    def __init__(self, gen: torch.Generator, rank: int):
        self.gen, self.key = gen, f"rank{rank}"

    def state_dict(self) -> dict:
        return {self.key: self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state[self.key])


def ddp_warm_up(ddp: torch.nn.Module, width_in: int = 64) -> None:
    """One backward pass of a zero loss, no optimizer step: the state stays as loaded.

    DDP rebuilds its gradient buckets in the order gradients became ready, after its first
    iteration. A fresh DDP (a relaunch) would run its first iteration on the initial order, and
    with 3 or more ranks a different bucket layout sums some gradient elements in another order
    (the last bits differ). This pass makes the relaunched job's buckets the ones the job had."""
    ddp(torch.zeros(1, width_in)).sum().mul(0).backward()
    for p in ddp.parameters():
        p.grad = None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    add_args(ap)
    ap.add_argument("--ckpt-dir", type=Path, required=True)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--keep", type=int, default=2)
    args = ap.parse_args(argv)

    job = start(args)
    ckpt = tpc.Checkpointer(args.ckpt_dir, keep=args.keep)
    state = {"train": tpc.ModelState(job.ddp, job.opt), "data": RankGenerator(job.gen, job.rank)}
    first = ckpt.load(state) or 0
    if first:
        ddp_warm_up(job.ddp)
        if job.rank == 0:
            print(f"ckpt loaded step={first}", file=sys.stderr, flush=True)

    for step in range(first, args.steps):
        print(f"step={step} loss={job.step().hex()}", flush=True)
        if (step + 1) % args.ckpt_every == 0 and step + 1 < args.steps:
            ckpt.save(step + 1, state)  # steps done: a restart goes on from here
            if job.rank == 0:
                print(f"ckpt saved step={step + 1} blocking_s={ckpt.last['blocking_s']:.4f}",
                      file=sys.stderr, flush=True)
        if args.sleep:
            time.sleep(args.sleep)
    ckpt.close()
    # As in train_ddp.py: free what holds the group before destroying it (plain torch 2.13 can
    # abort at exit otherwise), and leave without the interpreter's own teardown.
    job = state = None
    gc.collect()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
