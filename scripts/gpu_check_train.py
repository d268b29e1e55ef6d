"""A small deterministic CUDA training process for the GPU check (scripts/gpu_check.py).

Trains STEPS steps of a fixed MLP on fixed data, appending each step's loss (float.hex, so a
comparison is bit for bit) to LOSSES. With --pause-at K it stops after step K: writes READY and
polls for GO, holding no NCCL communicator (the harness CUDA-checkpoints, CRIU-dumps, kills and
restores it meanwhile). With --nccl it all-reduces each loss in a one-rank NCCL group, destroyed
before the pause and rebuilt after it (a fresh FileStore), as torchpass's runtime does. At the end
it appends "params HEX" (a SHA-256 of every parameter's bytes).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch


def nccl_group(store_path: str):
    import torch.distributed as dist

    store = dist.FileStore(store_path, 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    return dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("losses")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--pause-at", type=int, default=-1)
    ap.add_argument("--ready", default="")
    ap.add_argument("--go", default="")
    ap.add_argument("--nccl", default="", help="FileStore path prefix: a one-rank NCCL group")
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    dev = torch.device("cuda", 0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(512, 64, device=dev)
    y = torch.randn(512, 1, device=dev)
    dist = nccl_group(a.nccl + ".0") if a.nccl else None
    out = open(a.losses, "a", buffering=1)
    for step in range(a.steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        value = loss.detach()
        if dist is not None:
            dist.all_reduce(value)
        out.write(f"{step} {float(value.item()).hex()}\n")
        if step == a.pause_at:
            if dist is not None:
                dist.destroy_process_group()  # no communicator across the checkpoint
            torch.cuda.synchronize()
            open(a.ready, "w").close()
            while not os.path.exists(a.go):
                time.sleep(0.01)
            if dist is not None:
                dist = nccl_group(a.nccl + ".1")
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    out.write(f"params {h.hexdigest()}\n")
    out.close()
    if dist is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
