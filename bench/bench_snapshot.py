"""The cost of periodic whole-job snapshots: the same job with and without
``snapshot_every``, interleaved A/B pairs, per model size.

    .venv/bin/python bench/bench_snapshot.py [--sizes 10M,100M] [--pairs 2] [--every 10]
                                             [--steps 300] [--out bench/results/snapshot.json]

Each pair runs examples/train_ddp.py on 3 ranks (one per node) as the
devcluster's job user twice: A with ``sbatch --torchpass`` (the runtime, no
snapshot) and B with ``--torchpass=snapshot_every=S`` (the coordinator
pauses every rank every S seconds of training for a leave-running dump of
all three into the shared snapshot directory, keeping the newest
``snapshot_keep``). The order inside a pair alternates.

Per B run, from the coordinator's ``snapshot.completed`` events: how many
snapshots, ``pause_s`` (training stood still: the last rank at the pause
point to the last rank resumed), the bytes written and the dump phase. Side
by side: the training time of A and B (first to last step line, as each
arrived in the output) and what B lost over A per snapshot, which should be
the pause and nothing else. Every B run must print A's losses bit for bit.

Writes bench/results/snapshot.json; docs/benchmarks.md quotes the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

from bench_migration import first_arrivals, machine, per_step  # noqa: E402
from bench_overhead import devcluster, one_run, user_workdir  # noqa: E402
from torchpass import layout  # noqa: E402
from torchpass.devcluster import Devcluster  # noqa: E402


def log(msg: str) -> None:
    print(f"[bench_snapshot {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def training_s(run: dict) -> float:
    first = first_arrivals(run["steps"])
    return max(first.values()) - min(first.values())


def snapshot_events(c: Devcluster, job_id: int) -> tuple[list[dict], list[dict]]:
    p = layout.events_json(c.state_dir, job_id)
    evs = json.loads(p.read_text()) if p.exists() else []
    return ([e["data"] for e in evs if e["kind"] == "snapshot.completed"],
            [e["data"] for e in evs if e["kind"] == "snapshot.failed"])


def delete_snapshots(job_id: int) -> None:
    """As root (an admin): every snapshot of the job still kept."""
    tpassctl = str(Path(sys.executable).parent / "tpassctl")
    listed = subprocess.run([tpassctl, "snapshots", str(job_id), "--json"], capture_output=True, text=True,
                            timeout=60)
    for row in json.loads(listed.stdout)["snapshots"] if listed.returncode == 0 else []:
        subprocess.run([tpassctl, "snapshots", str(job_id), "--delete", row["snapshot"]], capture_output=True,
                       timeout=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10M,100M")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--every", type=int, default=10, help="snapshot_every of the B runs, seconds")
    ap.add_argument("--steps", default="300,60", help="steps per size (one value, or one per size)")
    ap.add_argument("--user", default="tpuser1", help="the job user (made by the devcluster's bring-up)")
    ap.add_argument("--out", type=Path, default=BENCH / "results" / "snapshot.json")
    ap.add_argument("--cluster", default=os.environ.get("TORCHPASS_TEST_CLUSTER", "bench"))
    ap.add_argument("--subnet", default=os.environ.get("TORCHPASS_TEST_SUBNET", "10.76.0"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        ap.error("needs root (the devcluster: network namespaces, slurmd, CRIU)")
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    steps = [int(s) for s in args.steps.split(",")]
    steps = steps * len(sizes) if len(steps) == 1 else steps
    if len(steps) != len(sizes) or args.pairs < 1 or args.every < 1:
        ap.error("--steps: one value or one per size; --pairs and --every at least 1")
    sides = {"A": ("torchpass", ["--torchpass"]),
             "B": (f"snapshot_every={args.every}", [f"--torchpass=snapshot_every={args.every}"])}
    t_all = time.monotonic()
    load0 = os.getloadavg()
    rows: list[dict] = []
    with devcluster(args.cluster, args.subnet, nodes=3) as c:
        with user_workdir("bench-snapshot-", args.user) as work:
            for size, n in zip(sizes, steps):
                cmd = f"{c.job_python} {REPO / 'examples' / 'train_ddp.py'} --steps {n} --params {size} --sleep 0"
                for i in range(args.pairs):
                    order = "AB" if i % 2 == 0 else "BA"
                    runs = {s: one_run(c, work, args.user, s, f"{size}-{i}{s}", cmd, 900, sides) for s in order}
                    a, b = runs["A"], runs["B"]
                    if per_step(ln for _, _, ln in a["steps"]) != per_step(ln for _, _, ln in b["steps"]):
                        raise RuntimeError(f"{size} pair {i + 1}: job {b['job_id']} (snapshots) printed other "
                                           f"losses than job {a['job_id']}: a bug, not a cost")
                    done, failed = snapshot_events(c, b["job_id"])
                    ta, tb = training_s(a), training_s(b)
                    pauses = [d["pause_s"] for d in done]
                    dumps = [d["phase_durations"].get("dump", 0.0) for d in done]
                    mb = [d["bytes"] / 1e6 for d in done]
                    row = {"params": size, "steps": n, "pair": i + 1, "order": order,
                           "plain_job": a["job_id"], "snapshot_job": b["job_id"],
                           "training_s_without": round(ta, 2), "training_s_with": round(tb, 2),
                           "snapshots": len(done), "failed": len(failed),
                           "pause_s_median": round(statistics.median(pauses), 3) if pauses else None,
                           "pause_s_max": max(pauses) if pauses else None,
                           "dump_s_median": round(statistics.median(dumps), 3) if dumps else None,
                           "mb_per_snapshot": round(statistics.median(mb), 1) if mb else None,
                           "lost_s_per_snapshot": round((tb - ta) / len(done), 3) if done else None,
                           "bit_identical": True, "load": round(os.getloadavg()[0], 2)}
                    rows.append(row)
                    log(f"{size} pair {i + 1} ({order}): {len(done)} snapshots, pause median "
                        f"{row['pause_s_median']} s; training {ta:.1f} s without, {tb:.1f} s with")
                    delete_snapshots(b["job_id"])  # leave the disk as found
    data = {"every_s": args.every, "ranks": 3, "rows": rows, "load_at_start": [round(x, 2) for x in load0],
            "machine": machine(), "bench_seconds": round(time.monotonic() - t_all, 1),
            "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = args.out.with_suffix(".json.tmp")
    tmp_out.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp_out, args.out)
    cols = ("params", "pair", "order", "training_s_without", "training_s_with", "snapshots", "failed",
            "pause_s_median", "pause_s_max", "dump_s_median", "mb_per_snapshot", "lost_s_per_snapshot", "load")
    print(f"| {' | '.join(cols)} |")
    print(f"|{'---|' * len(cols)}")
    for r in rows:
        print(f"| {' | '.join(str(r[k]) for k in cols)} |")
    print(f"snapshot_every={args.every} s; losses bit-identical in every pair; wrote {args.out} in "
          f"{data['bench_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
