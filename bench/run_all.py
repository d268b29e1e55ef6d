"""Run every benchmark in bench/ (what `make bench` does).

    .venv/bin/python bench/run_all.py [--full] [--only tpassd,migration]

Each benchmark writes its own bench/results/<name>.json; docs/benchmarks.md
describes them. By default the tpassd benchmark runs with fewer drills and a
shorter CPU window than its own defaults, and the migration benchmark with
the 10M model only (3 migrations, checkpoint-restart with Slurm's requeue
hold and with it lifted), so that the whole run stays around 10 minutes on
the 2-core development VM; ``--full`` runs every benchmark with its own
defaults (10M and 100M: the figures in docs/benchmarks.md, ~20 minutes). The migration benchmark brings
up its own devcluster (TORCHPASS_TEST_CLUSTER / TORCHPASS_TEST_SUBNET name
it; default "bench" on 10.76.0) and needs root.

``coordinator`` (bench_coordinator.py: the real coordinator against simulated
ranks at 64 to 8,192 ranks, ~15 minutes on this VM) is opt-in: it runs only
when named in ``--only``; ``--full`` runs all four sizes, otherwise 64 and 512.
``hard_failure`` (bench_hard_failure.py: a node crashed under a checkpointed
job, relaunched by torchpass against requeued by Slurm, ~4 minutes a pair) is
opt-in too: one pair, or two with ``--full``. ``fanout`` (bench_fanout.py: the
coordinator's serve thread sending a pause to every parked poll, against each
reply encoded by itself, ~20 s) always runs. ``zmq_memory`` (bench_zmq_memory.py:
libzmq's memory per connection, 8,192 connections against 1,024, ~1 minute) is opt-in, and so is
``failslow`` (bench_failslow.py: a node slowed under a job, the time to the coordinator's
migration.started, ~1.5 minutes a run; one run, three with ``--full``), and so is
``fleet_audit`` (bench_fleet_audit.py: a slowed node and a rate-limited rail, how often the audit
names exactly them, ~40 s an audit; one run of each case, five with ``--full``).

bench_tpassd runs first: ``tpassctl goodput --measured`` takes each figure
from the newest results file that has it, and bench_migration's end-to-end
detection latency (drill to migration start) is the one a migration sees.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent

# name -> (script, quick arguments, full arguments)
BENCHES = {
    "tpassd": ("bench_tpassd.py", ["--drills", "10", "--fast-drills", "8", "--cpu-seconds", "30"], []),
    "migration": ("bench_migration.py", ["--sizes", "10M"], []),
    "coordinator": ("bench_coordinator.py", ["--sizes", "64,512"], []),
    "hard_failure": ("bench_hard_failure.py", ["--pairs", "1"], []),
    "fanout": ("bench_fanout.py", [], []),
    "zmq_memory": ("bench_zmq_memory.py", [], []),
    "failslow": ("bench_failslow.py", ["--runs", "1"], []),
    "fleet_audit": ("bench_fleet_audit.py", ["--runs", "1"], []),
}
OPT_IN = {"coordinator", "hard_failure", "zmq_memory", "failslow", "fleet_audit"}  # run only when named in --only


def main() -> int:
    ap = argparse.ArgumentParser(description="Run every torchpass benchmark.")
    ap.add_argument("--full", action="store_true", help="each benchmark with its own default (longer) settings")
    ap.add_argument("--only", default=",".join(n for n in BENCHES if n not in OPT_IN),
                    help=f"comma-separated subset of {', '.join(BENCHES)} (default: all but {', '.join(OPT_IN)})")
    args = ap.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        ap.error(f"unknown benchmark {', '.join(unknown)}; known: {', '.join(BENCHES)}")
    failed: list[str] = []
    t0 = time.monotonic()
    for name in names:
        script, quick, full = BENCHES[name]
        argv = [sys.executable, str(BENCH / script), *(full if args.full else quick)]
        print(f"=== {name}: {' '.join(argv[1:])}", flush=True)
        t = time.monotonic()
        rc = subprocess.call(argv)
        print(f"=== {name}: exit {rc} after {time.monotonic() - t:.0f} s", flush=True)
        if rc != 0:
            failed.append(name)
    print(f"=== all benchmarks: {time.monotonic() - t0:.0f} s"
          + (f"; FAILED: {', '.join(failed)}" if failed else "; results in bench/results/"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
