"""Steady-state cost of ``--torchpass``: the same job with and without it, interleaved A/B pairs.

    .venv/bin/python bench/bench_overhead.py [--pairs 5] [--steps 150] [--params 10M]
                                             [--script examples/train_ddp.py] [--out bench/results/overhead.json]
    .venv/bin/python bench/bench_overhead.py --layout hsdp [--hidden 32768] --out bench/results/overhead_hsdp.json

Each pair runs one training job without torchpass (A: ``sbatch -N3``) and one
with it (B: ``sbatch -N3 --torchpass``: coordinator, rank wrapper and the
runtime around every collective, no spare, nothing moves) on one devcluster,
as the devcluster's job user. The order inside a pair alternates (AB, BA,
AB, ...) so that a drift of the machine (page cache, another process) falls
on both sides alike. ``--layout hsdp``: FSDP2 (examples/train_parallel.py) on
a 3 x 2 (replicate, shard) mesh, 2 ranks per node, instead of DDP.

Step time is read from the job's own output, as bench_migration.py does: the
first arrival of every ``step=N`` line (the output file is tailed every 5 ms).
A run's step time is the median gap between consecutive steps after
``--warmup`` steps (start-up, first-touch of the model and DDP's bucket
rebuild are not steady state). The overhead is the median of B's step times
over the median of A's, and the spread is the lowest and highest per-pair
ratio. Every B run must print the same losses as its A run, bit for bit: a
runtime that changed the results would not be measured, it would be wrong.

``--split``: every group runs a third job, C: ``--torchpass`` with the
runtime switched off (``TORCHPASS_RUNTIME=0`` exported to the job): the
plugin, coordinator, rank wrapper, tpass-init and tpassd as in B, but torch's
own process groups. C against A is the cost of everything but the runtime,
B against C the runtime's own (its wrapper around every collective and its
control link). The order inside a group cycles through ABC, CBA, BCA, ACB,
CAB, BAC, so each side runs in each position alike.

Writes bench/results/overhead.json; docs/benchmarks.md quotes the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

from bench_migration import Tail, as_user, first_arrivals, machine, per_step  # noqa: E402
from torchpass.devcluster import Devcluster, DevclusterSpec  # noqa: E402

SIDES = {"A": ("plain", []), "B": ("torchpass", ["--torchpass"]),
         "C": ("runtime off", ["--torchpass", "--export=ALL,TORCHPASS_RUNTIME=0"])}
SPLIT_ORDERS = ("ABC", "CBA", "BCA", "ACB", "CAB", "BAC")


def log(msg: str) -> None:
    print(f"[bench_overhead {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def devcluster(name: str, subnet: str, nodes: int):
    """A devcluster of ``nodes`` for one benchmark, its exports in os.environ meanwhile (as after
    ``eval "$(tpassctl devcluster env)"``); brought down after, the environment restored."""
    c = Devcluster.up(DevclusterSpec(name=name, subnet=subnet, nodes=nodes))
    saved = dict(os.environ)
    os.environ.update(c.env())
    try:
        yield c
    finally:
        os.environ.clear()
        os.environ.update(saved)
        c.down()


@contextlib.contextmanager
def user_workdir(prefix: str, user: str):
    """A temporary directory the job user owns (the jobs' scripts and outputs), yielded once every
    tpassd of a devcluster just brought up has published its first sample."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        work = Path(tmp)
        pw = pwd.getpwnam(user)
        work.chmod(0o755)
        os.chown(work, pw.pw_uid, pw.pw_gid)
        time.sleep(2.0)
        yield work


def job_state(job_id: int) -> dict:
    p = subprocess.run(["scontrol", "show", "job", str(job_id), "--json"], capture_output=True, text=True,
                       timeout=30)
    return json.loads(p.stdout)["jobs"][0] if p.returncode == 0 else {}


def one_run(c: Devcluster, work: Path, user: str, side: str, tag: str, cmd: str, timeout_s: float,
            sides: dict[str, tuple[str, list[str]]] = SIDES, per_node: int = 1) -> dict:
    """One job of ``sides[side]`` (name, sbatch options) on 3 nodes, ``per_node`` ranks each: its
    step lines as they arrived."""
    name, extra = sides[side]
    script = work / f"{tag}.sbatch"
    script.write_text(f"#!/bin/bash\nsrun {cmd}\n")
    script.chmod(0o755)
    out = work / f"{tag}.out"
    p = as_user(user, ["sbatch", "--parsable", "-N3", f"--ntasks-per-node={per_node}", "-o", str(out), *extra,
                       str(script)], work)
    if p.returncode != 0:
        raise RuntimeError(f"sbatch ({name}): {p.stderr.strip()}")
    job_id = int(p.stdout.strip().split(";")[0])
    tail = Tail(out)
    tail.start()
    t0 = time.monotonic()
    try:
        while True:
            j = job_state(job_id)
            if j and not set(j["job_state"]) & {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING"}:
                break
            if time.monotonic() - t0 > timeout_s:
                subprocess.run(["scancel", str(job_id)], capture_output=True)
                raise RuntimeError(f"{name} job {job_id} did not end within {timeout_s:.0f} s")
            time.sleep(0.25)
    finally:
        time.sleep(0.2)
        tail.stop()
    if j["job_state"][0] != "COMPLETED":
        raise RuntimeError(f"{name} job {job_id} ended {j['job_state']}: {out.read_text()[-1500:]}")
    steps = tail.steps()
    return {"job_id": job_id, "side": name, "steps": steps, "wall_s": round(time.monotonic() - t0, 2)}


def step_time(run: dict, warmup: int) -> float:
    first = first_arrivals(run["steps"])
    gaps = [first[n + 1] - first[n] for n in sorted(first) if n >= warmup and n + 1 in first]
    if len(gaps) < 10:
        raise RuntimeError(f"job {run['job_id']}: only {len(gaps)} steps after the warm-up; raise --steps")
    return statistics.median(gaps)


def split_summary(pairs: list[dict]) -> dict:
    """--split's figures: the runtime-off side (C) against plain, and torchpass against C."""
    med_a = statistics.median(p["plain_step_s"] for p in pairs)
    med_c = statistics.median(p["runtime_off_step_s"] for p in pairs)
    off = [p["runtime_off_ratio"] for p in pairs]
    own = [p["runtime_ratio"] for p in pairs]
    return {"runtime_off_step_s_median": round(med_c, 5),
            "runtime_off_overhead_pct": round((med_c / med_a - 1) * 100, 2),
            "runtime_off_ratio_min": min(off), "runtime_off_ratio_max": max(off),
            "runtime_off_ratio_median": statistics.median(off),
            "runtime_ratio_min": min(own), "runtime_ratio_max": max(own),
            "runtime_ratio_median": statistics.median(own)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=20, help="steps left out at the start of every run")
    ap.add_argument("--params", default="10M")
    ap.add_argument("--script", type=Path, default=REPO / "examples" / "train_ddp.py",
                    help="a training script printing step=N loss=<float.hex> (run as the job's tasks)")
    ap.add_argument("--layout", choices=("hsdp",), default=None,
                    help="instead of --script/--params: examples/train_parallel.py LAYOUT (hsdp: FSDP2 on a "
                         "3 x 2 (replicate, shard) mesh, 2 ranks per node) with --hidden")
    ap.add_argument("--hidden", type=int, default=32768, help="--layout's MLP hidden width (~34 x HIDDEN params)")
    ap.add_argument("--split", action="store_true",
                    help="a third job per group: --torchpass with the runtime off (TORCHPASS_RUNTIME=0), to "
                         "tell the runtime's cost from the rest")
    ap.add_argument("--user", default="tpuser1", help="the job user (made by the devcluster's bring-up)")
    ap.add_argument("--out", type=Path, default=BENCH / "results" / "overhead.json")
    ap.add_argument("--cluster", default=os.environ.get("TORCHPASS_TEST_CLUSTER", "bench"))
    ap.add_argument("--subnet", default=os.environ.get("TORCHPASS_TEST_SUBNET", "10.76.0"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        ap.error("needs root (the devcluster: network namespaces, slurmd)")
    if args.pairs < 1 or args.steps <= args.warmup + 10:
        ap.error("--pairs must be >= 1 and --steps at least --warmup + 10")
    t_all = time.monotonic()
    load0 = os.getloadavg()
    if args.layout:
        args.script = REPO / "examples" / "train_parallel.py"
        script = f"{args.script} {args.layout} --steps {args.steps} --hidden {args.hidden} --sleep 0"
        per_node = 2
    else:
        script = f"{args.script} --steps {args.steps} --params {args.params} --sleep 0"
        per_node = 1
    pairs: list[dict] = []
    with devcluster(args.cluster, args.subnet, nodes=3) as c:
        cmd = f"{c.job_python} {script}"
        with user_workdir("bench-overhead-", args.user) as work:
            for i in range(args.pairs):
                order = SPLIT_ORDERS[i % len(SPLIT_ORDERS)] if args.split else ("AB" if i % 2 == 0 else "BA")
                runs = {s: one_run(c, work, args.user, s, f"{i}{s}", cmd, 600, per_node=per_node) for s in order}
                a, b = runs["A"], runs["B"]
                losses = per_step(ln for _, _, ln in a["steps"])
                for side, run in runs.items():
                    if side != "A" and per_step(ln for _, _, ln in run["steps"]) != losses:
                        raise RuntimeError(f"pair {i + 1}: the {SIDES[side][0]} job {run['job_id']} printed other "
                                           f"losses than the plain job {a['job_id']}: not an overhead, a bug")
                ta, tb = step_time(a, args.warmup), step_time(b, args.warmup)
                row = {"pair": i + 1, "order": order, "plain_job": a["job_id"], "torchpass_job": b["job_id"],
                       "plain_step_s": round(ta, 5), "torchpass_step_s": round(tb, 5),
                       "ratio": round(tb / ta, 4), "plain_wall_s": a["wall_s"], "torchpass_wall_s": b["wall_s"],
                       "bit_identical": True, "load": round(os.getloadavg()[0], 2)}
                msg = f"pair {i + 1} ({order}): plain {ta * 1000:.1f} ms/step, torchpass {tb * 1000:.1f} ms/step"
                if "C" in runs:
                    tc = step_time(runs["C"], args.warmup)
                    row.update(runtime_off_job=runs["C"]["job_id"], runtime_off_step_s=round(tc, 5),
                               runtime_off_ratio=round(tc / ta, 4), runtime_ratio=round(tb / tc, 4))
                    msg += f", runtime off {tc * 1000:.1f} ms/step"
                pairs.append(row)
                log(f"{msg}, ratio {tb / ta:.4f}")
    med_a = statistics.median(p["plain_step_s"] for p in pairs)
    med_b = statistics.median(p["torchpass_step_s"] for p in pairs)
    ratios = [p["ratio"] for p in pairs]
    data = {
        "script": str(args.script.relative_to(REPO)) if args.script.is_relative_to(REPO) else str(args.script),
        "layout": args.layout, "params": f"~{34 * args.hidden}" if args.layout else args.params,
        "steps": args.steps, "warmup": args.warmup, "ranks": 3 * per_node,
        "plain_step_s_median": round(med_a, 5), "torchpass_step_s_median": round(med_b, 5),
        "overhead_pct": round((med_b / med_a - 1) * 100, 2),
        "ratio_min": min(ratios), "ratio_max": max(ratios), "ratio_median": statistics.median(ratios),
        **(split_summary(pairs) if args.split else {}),
        "pairs": pairs, "load_at_start": [round(x, 2) for x in load0], "machine": machine(),
        "bench_seconds": round(time.monotonic() - t_all, 1),
        "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = args.out.with_suffix(".json.tmp")
    tmp_out.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp_out, args.out)
    print(f"{'pair':>4} {'order':>5} | {'plain ms/step':>13} {'torchpass ms/step':>17} {'ratio':>7} | {'load':>5}")
    for p in pairs:
        print(f"{p['pair']:>4} {p['order']:>5} | {p['plain_step_s'] * 1000:>13.2f}"
              f" {p['torchpass_step_s'] * 1000:>17.2f}"
              f" {p['ratio']:>7.4f} | {p['load']:>5}")
    print(f"median: plain {med_a * 1000:.2f} ms/step, torchpass {med_b * 1000:.2f} ms/step: "
          f"{data['overhead_pct']:+.2f} % (per-pair ratio {min(ratios):.4f} .. {max(ratios):.4f}); "
          f"losses bit-identical in every pair")
    if args.split:
        print(f"runtime off (C): median {data['runtime_off_step_s_median'] * 1000:.2f} ms/step, "
              f"{data['runtime_off_overhead_pct']:+.2f} % against plain (per-group C/A "
              f"{data['runtime_off_ratio_min']:.4f} .. {data['runtime_off_ratio_max']:.4f}); the runtime's own share, "
              f"B/C per group: median {data['runtime_ratio_median']:.4f} "
              f"({data['runtime_ratio_min']:.4f} .. {data['runtime_ratio_max']:.4f})")
    print(f"wrote {args.out} in {data['bench_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
