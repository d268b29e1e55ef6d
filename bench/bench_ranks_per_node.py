"""The stall of a migration at 1, 2 and 4 ranks per node, on the devcluster.

    .venv/bin/python bench/bench_ranks_per_node.py [--per-node 1,2,4] [--steps 100] [--params 100K]

Per setting: examples/train_ddp.py (gloo DDP, one thread per rank) as
``sbatch -N3 --ntasks-per-node=K --overcommit --torchpass=spares=1`` (2
training nodes, 1 hot spare; devcluster nodes have 2 CPUs, so 4 ranks per
node need ``--overcommit``), as the devcluster's job user, and an ECC drill
on a random training node at a random step: every rank of that node is
paused, dumped, restored on the spare, the group rebuilt. The same drill as
tests/integration/test_mesh_shapes.py uses (tests/integration/drill.py),
without the plain reference run (the tests check the losses: at 4 ranks per
node, the 3-D mesh job). From the
coordinator's ``migration.completed`` event: the phases (pause, dump,
transfer, restore, ...) and ``paused``, the time training stood still.
Prints a table; ``--json`` writes the rows too. The seed is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "integration"))

from drill import Drill, leave_clean, migrate  # noqa: E402
from torchpass.devcluster import Devcluster, DevclusterSpec  # noqa: E402

PHASES = ("pause", "dump", "transfer", "restore", "kill_source", "paused", "total")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-node", default="1,2,4")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--params", default="100K")
    ap.add_argument("--user", default="tpuser1", help="the job user (made by the devcluster's bring-up)")
    ap.add_argument("--cluster", default=os.environ.get("TORCHPASS_TEST_CLUSTER", "bench"))
    ap.add_argument("--subnet", default=os.environ.get("TORCHPASS_TEST_SUBNET", "10.76.0"))
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    if os.geteuid() != 0:
        ap.error("needs root (the devcluster: network namespaces, slurmd, CRIU)")
    seed = int(os.environ.get("TORCHPASS_TEST_SEED") or time.time_ns() % 1_000_000)
    print(f"seed={seed}; load average at start {os.getloadavg()}", flush=True)
    c = Devcluster.up(DevclusterSpec(name=args.cluster, subnet=args.subnet, nodes=4))
    saved = dict(os.environ)
    os.environ.update(c.env())
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-ranks-per-node-") as tmp:
            Path(tmp).chmod(0o755)  # the job user reaches their job dirs under it
            for k in (int(x) for x in args.per_node.split(",")):
                d = Drill(f"ranks{k}", "", ("--steps", str(args.steps), "--params", args.params, "--sleep", "0.05"),
                          args.steps, nodes=2, per_node=k, fault_steps=(2, 30),
                          sbatch_extra=("--overcommit",) if k > 2 else ())
                job_dir = Path(tmp) / d.name
                job_dir.mkdir()
                os.chown(job_dir, *_ids(args.user))
                jobs: list[int] = []
                try:
                    data = migrate(c, d, job_dir, args.user, seed, jobs, None)
                finally:
                    leave_clean(d, jobs)
                    _wait_idle(d)
                ph, tools = data.get("phase_durations", {}), data.get("tool_durations", {})
                # the slowest rank's own dump (tpassd) and restore (CRIU): a dump phase close to
                # it, not to K times it, means the node's ranks were dumped in parallel
                rows.append({"ranks_per_node": k, **{p: ph.get(p) for p in PHASES},
                             "slowest_rank_dump": tools.get("dump.total_s"),
                             "slowest_rank_restore": tools.get("restore.criu_restore_s"),
                             "load": round(os.getloadavg()[0], 2)})
    finally:
        os.environ.clear()
        os.environ.update(saved)
        c.down()
    cols = (*PHASES, "slowest_rank_dump", "slowest_rank_restore", "load")
    print(f"\n| ranks per node | {' | '.join(cols)} |")
    print(f"|---|{'---|' * len(cols)}")
    for r in rows:
        print(f"| {r['ranks_per_node']} | {' | '.join(str(r[c]) for c in cols)} |")
    if args.json:
        args.json.write_text(json.dumps({"seed": seed, "rows": rows}, indent=2))
    return 0


def _wait_idle(d: Drill, timeout_s: float = 90) -> None:
    """Every node idle again (the drained one resumed, the job's nodes released): the next
    setting's job must get node1.. as training nodes, where its drill lands."""
    import training_jobs as tj

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        states = [tj.node(n)["state"] for n in (*d.training_nodes, d.spare)]
        if all(st == ["IDLE"] for st in states):
            return
        time.sleep(0.5)
    raise SystemExit(f"nodes not idle after {timeout_s:g}s: {states}")


def _ids(user: str) -> tuple[int, int]:
    import pwd

    pw = pwd.getpwnam(user)
    return pw.pw_uid, pw.pw_gid


if __name__ == "__main__":
    sys.exit(main())
