"""The fail-slow decision time: from a node's slowdown to the coordinator's migration.started.

    .venv/bin/python bench/bench_failslow.py [--runs 3] [--cpu 10] [--slow-at 20] [--steps 300]
                                             [--out bench/results/failslow.json]

Each run is ``sbatch -N4 --torchpass=spares=1`` of examples/train_ddp.py (3 gloo ranks, one per
node, 1M parameters, ``--sleep 0.05``; node4 the hot spare) as the devcluster's job user, with
the default policy. Once the job printed step ``--slow-at``, node2 is slowed with ``tpassctl
devcluster slow node2 --cpu PCT`` (its job processes under PCT % of one CPU). Per run, from the
job's event log: ``decision_s``, the wall time from the slow command's return to the
``migration.started`` event (the rule's windows, its sustain time, one report interval and its
once-a-second evaluation); what ``failslow.detected`` measured (the ratio, the node's and the
peers' compute per step); and the job's outcome (COMPLETED, its rank on the spare). The quota is
lifted after each run.

Writes bench/results/failslow.json; docs/benchmarks.md quotes it. The goal: slowdown to
decision in at most 60 s.
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

from bench_migration import machine  # noqa: E402
from bench_overhead import as_user, devcluster, job_state, user_workdir  # noqa: E402
from torchpass import layout  # noqa: E402
from torchpass.coordinator.policy import CoordinatorPolicy  # noqa: E402
from torchpass.devcluster import Devcluster  # noqa: E402

SLOWED, SPARE = "node2", "node4"
TPASSCTL = str(Path(sys.executable).parent / "tpassctl")


def log(msg: str) -> None:
    print(f"[bench_failslow {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def slow(c: Devcluster, cpu: str) -> None:
    p = subprocess.run([TPASSCTL, "devcluster", "slow", SLOWED, "--cpu", cpu, "--name", c.spec.name],
                       capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise RuntimeError(f"devcluster slow: {p.stderr.strip()}")


def events(c: Devcluster, job_id: int) -> list[dict]:
    p = layout.events_json(c.state_dir, job_id)
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return []


def one_run(c: Devcluster, work: Path, user: str, tag: str, args) -> dict:
    script = work / f"{tag}.sbatch"
    script.write_text(f"#!/bin/bash\nsrun {c.job_python} {REPO / 'examples' / 'train_ddp.py'} --steps {args.steps} "
                      "--params 1M --sleep 0.05\n")
    script.chmod(0o755)
    out = work / f"{tag}.out"
    p = as_user(user, ["sbatch", "--parsable", "-N4", "--ntasks-per-node=1", "--torchpass=spares=1",
                       "-o", str(out), str(script)], work)
    if p.returncode != 0:
        raise RuntimeError(f"sbatch: {p.stderr.strip()}")
    job_id = int(p.stdout.strip().split(";")[0])
    end = time.monotonic() + 300
    while f"step={args.slow_at} " not in (out.read_text() if out.exists() else ""):
        if time.monotonic() > end:
            raise RuntimeError(f"job {job_id} never reached step {args.slow_at}")
        time.sleep(0.1)
    try:
        slow(c, str(args.cpu))
        slowed = time.time()
        started = None
        while started is None and time.time() - slowed < 180:
            started = next((e for e in events(c, job_id) if e["kind"] == "migration.started"), None)
            time.sleep(0.2)
    finally:
        slow(c, "clear")
    while job_state(job_id).get("job_state", ["?"])[0] in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
        if time.monotonic() > end + 300:
            raise RuntimeError(f"job {job_id} did not end")
        time.sleep(1.0)
    final = job_state(job_id)
    evs = events(c, job_id)
    detected = next((e["data"] for e in evs if e["kind"] == "failslow.detected"), {})
    completed = next((e["data"] for e in evs if e["kind"] == "migration.completed"), {})
    return {"job_id": job_id, "state": final.get("job_state", ["?"])[0],
            "decision_s": round(started["time"] - slowed, 2) if started else None,
            "trigger": started["data"].get("trigger") if started else None,
            "ratio": detected.get("ratio"), "node_compute_s": detected.get("node_compute_s"),
            "peers_median_s": detected.get("peers_median_s"), "slow_for_s": detected.get("slow_for_s"),
            "moved_to": completed.get("target")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--cpu", type=int, default=10, help="node2's CPU quota, percent of one CPU")
    ap.add_argument("--slow-at", type=int, default=20, help="slow node2 once this step was printed")
    ap.add_argument("--user", default="tpuser1", help="the job user (made by the devcluster's bring-up)")
    ap.add_argument("--out", type=Path, default=BENCH / "results" / "failslow.json")
    ap.add_argument("--cluster", default=os.environ.get("TORCHPASS_TEST_CLUSTER", "bench"))
    ap.add_argument("--subnet", default=os.environ.get("TORCHPASS_TEST_SUBNET", "10.76.0"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        ap.error("needs root (the devcluster: network namespaces, slurmd, cgroups)")
    t_all = time.monotonic()
    load0 = os.getloadavg()
    runs = []
    with devcluster(args.cluster, args.subnet, nodes=4) as c:
        with user_workdir("bench-failslow-", args.user) as work:
            for i in range(args.runs):
                r = one_run(c, work, args.user, f"run{i}", args)
                runs.append(r)
                log(f"run {i + 1}: job {r['job_id']} {r['state']}, migration.started {r['decision_s']} s after the "
                    f"slowdown ({r['trigger']}, {r['ratio']}x), moved to {r['moved_to']}")
    decided = [r["decision_s"] for r in runs if r["decision_s"] is not None and r["trigger"] == "failslow"]
    p = CoordinatorPolicy()
    data = {"slowed": SLOWED, "cpu_pct": args.cpu, "slow_at_step": args.slow_at, "steps": args.steps, "ranks": 3,
            "params": "1M",
            "policy": {k: getattr(p, k) for k in ("failslow_ratio", "failslow_window_steps", "failslow_windows",
                                                   "failslow_min_excess_s", "failslow_sustain_s")},
            "runs": runs,
            "decision_s": {"p50": round(statistics.median(decided), 2) if decided else None,
                           "max": max(decided) if decided else None, "n": len(decided), "of": len(runs)},
            "load_at_start": [round(x, 2) for x in load0],
            "machine": machine(), "bench_seconds": round(time.monotonic() - t_all, 1),
            "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, args.out)
    cols = ("job_id", "state", "decision_s", "trigger", "ratio", "node_compute_s", "peers_median_s", "moved_to")
    print(f"| {' | '.join(cols)} |")
    print(f"|{'---|' * len(cols)}")
    for r in runs:
        print(f"| {' | '.join(str(r[k]) for k in cols)} |")
    print(f"decision: median {data['decision_s']['p50']} s, max {data['decision_s']['max']} s "
          f"({len(decided)} of {len(runs)} runs decided by fail-slow); wrote {args.out} in {data['bench_seconds']} s")
    return 0 if len(decided) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
