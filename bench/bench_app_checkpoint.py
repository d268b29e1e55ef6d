"""How long training stands still for one application checkpoint.

    .venv/bin/python bench/bench_app_checkpoint.py [--sizes 10M,100M] [--reps 3] [--world 2]

``--world`` gloo ranks on 127.0.0.1 train examples/train_ddp.py's model (DDP + Adam, a few
steps first so that Adam has its state), then save the same state, in turn, in rotating
order, ``--reps`` times each:

- ``torch.save``: rank 0 writes the model and the optimizer state with ``torch.save``, then a
  barrier (bench/train_ckpt.py, the checkpoint-restart baseline): training waits for all of it;
- ``dcp.save``: ``torch.distributed.checkpoint.save`` of the same state (DCP format, every rank
  writes its share), synchronous;
- ``torchpass``: ``torchpass.checkpoint.Checkpointer.save``: training waits for the copy to host
  memory and the plan; the files are written in the background. Its first save (which allocates
  the kept host copy) is reported apart from the later ones.

Per save it prints the seconds training stood still (the slowest rank's), and for torchpass
also the time to the complete checkpoint and the mean step time of the ``--steps-after`` steps
run while the background write goes on, against steps with nothing in flight (the write
shares the machine's cores with training). Writes bench/results/app_checkpoint.json, with
``checkpoint_blocking_s`` (per model size) for ``tpassctl goodput --measured``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torchpass.goodput.measured import model_params

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
METHODS = ("torch.save", "dcp.save", "torchpass")


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    sys.path.insert(0, str(REPO / "examples"))
    import torchpass.checkpoint as tpc
    from train_ddp import start

    job = start(argparse.Namespace(params=args.size, lr=1e-3, batch=16))
    rank, model, ddp, opt = job.rank, job.model, job.ddp, job.opt

    def steps(n: int) -> float:
        t0 = time.monotonic()
        for _ in range(n):
            job.step()
        return (time.monotonic() - t0) / n

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    root = Path(args.dir)
    state = {"train": tpc.ModelState(ddp, opt)}
    ckpt = tpc.Checkpointer(root / "torchpass", keep=1)
    steps(3)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # weights + Adam's two moments
    for rep in range(args.reps):
        for i in range(len(METHODS)):
            method = METHODS[(rep + i) % len(METHODS)]
            quiet_step_s = steps(args.steps_after)
            dist.barrier()
            target = root / f"{method}-{rep}"
            t0 = time.monotonic()
            row = {"rep": rep, "method": method}
            if method == "torch.save":
                if rank == 0:
                    target.mkdir(parents=True, exist_ok=True)
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, target / "state.pt")
                    os.sync()  # as durable as dcp.save's and torchpass's fsynced files
                dist.barrier()
            elif method == "dcp.save":
                dcp.save(state, checkpoint_id=target)
            else:
                row["first"] = ckpt._host_copy is None
                ckpt.save(rep + 1, state)
            row["blocking_s"] = slowest(time.monotonic() - t0)
            if method == "torchpass":
                row["steps_during_write_s"] = slowest(steps(args.steps_after))
                ckpt.wait()
                dist.barrier()
                if rank == 0:
                    record = json.loads((tpc.complete_checkpoints(root / "torchpass")[-1].path
                                         / "torchpass.json").read_text())
                    row["complete_s"] = record["write_s"] + row["blocking_s"]
                    row["bytes"] = record["bytes"]
            row["quiet_step_s"] = slowest(quiet_step_s)
            if rank == 0:
                if method != "torchpass":
                    row["bytes"] = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
                print(json.dumps({**row, "state_bytes": nbytes}), flush=True)
                shutil.rmtree(target, ignore_errors=True)
            dist.barrier()
    ckpt.close()
    ddp = model = opt = state = None
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def run_size(size: str, args) -> list[dict]:
    from torchpass.runtime.testing import free_port

    tmp = Path(tempfile.mkdtemp(prefix=f"bench-appckpt-{size}-", dir=args.dir))
    port = free_port()
    procs = []
    for r in range(args.world):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHPASS_", "SLURM_"))}
        env.update(RANK=str(r), WORLD_SIZE=str(args.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--worker", "--size", size, "--reps", str(args.reps),
             "--steps-after", str(args.steps_after), "--dir", str(tmp)],
            env=env, stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, text=True))
    rows = [json.loads(line) for line in procs[0].stdout]
    rcs = [p.wait() for p in procs]
    shutil.rmtree(tmp, ignore_errors=True)
    if any(rcs):
        raise SystemExit(f"bench_app_checkpoint: {size}: ranks exited {rcs}")
    for row in rows:
        row["size"] = size
    return rows


def summary(rows: list[dict]) -> list[dict]:
    out = []
    for size in dict.fromkeys(r["size"] for r in rows):
        base = [r for r in rows if r["size"] == size]
        for method in METHODS:
            for first in ((True, False) if method == "torchpass" else (None,)):
                sel = [r for r in base if r["method"] == method and r.get("first") == first]
                if not sel:
                    continue
                label = method + (" (first save)" if first else "") if first is not None else method
                s = {"size": size, "method": label, "saves": len(sel),
                     "blocking_s_median": round(statistics.median(r["blocking_s"] for r in sel), 3),
                     "blocking_s_max": round(max(r["blocking_s"] for r in sel), 3),
                     "mb": round(statistics.median(r["bytes"] for r in sel) / 1e6, 1)}
                if method == "torchpass":
                    s["complete_s_median"] = round(statistics.median(r["complete_s"] for r in sel), 3)
                    s["step_s_during_write"] = round(statistics.median(r["steps_during_write_s"] for r in sel), 4)
                    s["step_s_quiet"] = round(statistics.median(r["quiet_step_s"] for r in sel), 4)
                out.append(s)
        ref = next(s for s in out if s["size"] == size and s["method"] == "torch.save")
        for s in out:
            if s["size"] == size:
                s["blocking_vs_torch_save"] = round(s["blocking_s_median"] / ref["blocking_s_median"], 3)
    return out


def blocking_figure(table: list[dict]) -> dict | None:
    """``checkpoint_blocking_s`` for ``tpassctl goodput --measured`` (lm_checkpoint_save_s): the
    median blocking time of torchpass's later saves (the steady state; the first one allocates the
    kept host copy), per model size, the largest size's as the headline figure, and torch.save's
    of the same state beside it."""
    mine = {s["size"]: s["blocking_s_median"] for s in table if s["method"] == "torchpass"}
    if not mine:
        return None
    big = max(mine, key=model_params)
    return {"p50": mine[big], "model": big, "by_model": mine,
            "torch_save_by_model": {s["size"]: s["blocking_s_median"] for s in table if s["method"] == "torch.save"},
            "what": "seconds one torchpass.checkpoint save blocks training (median of the saves after the first)"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10M,100M")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps-after", type=int, default=5, help="steps timed with and without a write in flight")
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    ap.add_argument("--out", type=Path, default=BENCH / "results" / "app_checkpoint.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--size", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rows = []
    for size in args.sizes.split(","):
        rows += run_size(size.strip(), args)
    table = summary(rows)
    print(f"{'size':>5} {'method':<24} {'saves':>5} {'blocks s (med/max)':>19} {'x torch.save':>12} "
          f"{'MB':>7} {'complete s':>10} {'step s: writing / quiet':>24}")
    for s in table:
        extra = (f"{s['complete_s_median']:>10.3f} {s['step_s_during_write']:>11.4f} / {s['step_s_quiet']:.4f}"
                 if "complete_s_median" in s else "")
        print(f"{s['size']:>5} {s['method']:<24} {s['saves']:>5} {s['blocking_s_median']:>9.3f} / "
              f"{s['blocking_s_max']:<7.3f} {s['blocking_vs_torch_save']:>12.3f} {s['mb']:>7.1f} {extra}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "app_checkpoint", "started": started,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {"cpus": os.cpu_count(), "load_1min_at_end": round(os.getloadavg()[0], 2)},
        "world": args.world, "reps": args.reps, "steps_after": args.steps_after,
        "summary": table, "saves": rows,
        **({"checkpoint_blocking_s": fig} if (fig := blocking_figure(table)) else {})}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
