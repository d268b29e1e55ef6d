"""examples/train_ddp.py plus periodic checkpoints: the checkpoint-restart baseline.

The same model, data and step lines as examples/train_ddp.py (it imports its
pieces), so a fault-free run prints the same losses bit for bit. Every
``--ckpt-every`` steps the job writes a checkpoint with ``torch.save``:
rank 0 the model and the Adam state, every rank its data generator (each
rank draws its own batches), then, after a barrier, rank 0 points
``CKPT_DIR/latest`` at it (written last, atomically, so a job killed while
saving restarts from the previous checkpoint). At start it loads
``latest`` if there is one and goes on from the step after it: what a
requeued job does. Rank 0 prints one ``ckpt saved step=N seconds=S`` /
``ckpt loaded step=N seconds=S`` line per checkpoint (to stderr).

    python bench/train_ckpt.py --steps 60 --params 10M --ckpt-dir DIR --ckpt-every 10
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from train_ddp import add_args, start


def save(ckpt: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator,
         rank: int) -> float:
    t0 = time.monotonic()
    d = ckpt / f"step{step}"
    d.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, d / "state.pt")
    torch.save(gen.get_state(), d / f"gen{rank}.pt")
    dist.barrier()  # every rank's part is on disk before `latest` names it
    if rank == 0:
        tmp = ckpt / "latest.tmp"
        tmp.write_text(f"step{step}\n")
        os.replace(tmp, ckpt / "latest")
    return time.monotonic() - t0


def load(ckpt: Path, model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator, rank: int) -> int:
    try:
        name = (ckpt / "latest").read_text().strip()
    except FileNotFoundError:
        return 0
    d = ckpt / name
    state = torch.load(d / "state.pt", weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    gen.set_state(torch.load(d / f"gen{rank}.pt", weights_only=True))
    return int(state["step"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    add_args(ap)
    ap.add_argument("--ckpt-dir", type=Path, required=True)
    ap.add_argument("--ckpt-every", type=int, default=10)
    args = ap.parse_args(argv)

    job = start(args)
    t0 = time.monotonic()
    first = load(args.ckpt_dir, job.model, job.opt, job.gen, job.rank)
    if first and job.rank == 0:
        print(f"ckpt loaded step={first} seconds={time.monotonic() - t0:.3f}", file=sys.stderr, flush=True)

    for step in range(first, args.steps):
        print(f"step={step} loss={job.step().hex()}", flush=True)
        if (step + 1) % args.ckpt_every == 0 and step + 1 < args.steps:
            s = save(args.ckpt_dir, step + 1, job.model, job.opt, job.gen, job.rank)
            if job.rank == 0:
                print(f"ckpt saved step={step + 1} seconds={s:.3f}", file=sys.stderr, flush=True)
        if args.sleep:
            time.sleep(args.sleep)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
