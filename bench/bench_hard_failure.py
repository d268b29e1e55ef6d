"""What a node lost outright costs a job: torchpass's relaunch inside the allocation, from
an application checkpoint or from a whole-job snapshot, against checkpoint-restart through Slurm's
requeue, side by side in the same run.

    .venv/bin/python bench/bench_hard_failure.py [--pairs 2] [--crash-at 35] [--every 10]
                                                 [--snapshot-every 2] [--steps 80] [--params 1M]
                                                 [--sides relaunch,snapshot,gpu_killed]
                                                 [--out bench/results/hard_failure.json]

Both sides run examples/train_checkpointed.py (train_ddp.py's 3 gloo ranks, one per node,
``--params`` parameters (1M), a ``torchpass.checkpoint`` save every ``--every`` steps) as the
devcluster's job user, and both crash node2 (``tpassctl devcluster crash``: link down, every
process killed) once the job printed step ``--crash-at`` (the gpu_killed side kills node2's GPU
under its rank instead); the snapshot sides wait for their first complete snapshot too (with
``--snapshot-every 30`` it completes ~30 s into training, after step ``--crash-at``):

* relaunch: ``sbatch --no-kill --torchpass=spares=1`` (4 nodes, node4 the hot spare). The
  coordinator finds the node lost, ends the step and the job's srun starts it again on node1,
  node3 and node4; the script loads its newest complete checkpoint. Never requeued.
* snapshot: ``sbatch --no-kill --torchpass=spares=1,snapshot_every=S`` with no checkpoint saved
  (``--ckpt-every`` past the last step): the coordinator takes a whole-job snapshot every S seconds
  of training, and the relaunched srun restores every rank from the newest one (nothing reloads).
* gpu_killed: ``sbatch --torchpass=spares=1,snapshot_every=S`` as the snapshot side, and at the same step
  ``tpassctl devcluster kill-gpu node2`` (Xid 79, the GPU lost, its rank SIGKILLed; the node stays up).
  The rank's wrapper reports the death, the coordinator matches it to the Xid and relaunches the step
  from the newest snapshot with node4 in node2's place.
* requeue: plain ``sbatch -N3 --open-mode=append``, what the job does without torchpass. Slurm
  requeues it (node failure), the batch script starts again once the requeue hold and the queue let
  it, on the nodes still up, and loads the same kind of checkpoint.

Per run, from the job's output lines as they arrived: ``resumed_s``, from the crash to the first
step line after it (detection, the new step or job, imports, the checkpoint's load); ``lost_s``,
from the crash until the job first prints the step after the last one it printed before the crash,
less one step time (the time the job lost, recomputing included); the checkpoint used (or the
first step the restored ranks printed) and the steps computed again. Every run must print the
same loss lines, step for step, as every other (the relaunch is bit-identical): a difference is a
bug, not a cost. node2 is revived and resumed after
each run. The order inside a pair alternates.

Writes bench/results/hard_failure.json; docs/benchmarks.md quotes the table, and
``tpassctl goodput --measured`` takes ``lm_relaunch_s`` and the requeue side's restart from it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

from bench_migration import Tail, first_arrivals, machine, per_step  # noqa: E402
from bench_overhead import as_user, devcluster, job_state, user_workdir  # noqa: E402
from torchpass.devcluster import Devcluster  # noqa: E402

CRASHED = "node2"
SIDES = {
    "relaunch": ["-N4", "-n4", "--no-kill", "--torchpass=spares=1"],
    "snapshot": ["-N4", "-n4", "--no-kill", "--torchpass=spares=1,snapshot_every={snapshot_every}"],
    # A GPU killed under node2's rank (devcluster kill-gpu): the node stays up; no --no-kill needed.
    "gpu_killed": ["-N4", "-n4", "--torchpass=spares=1,snapshot_every={snapshot_every}"],
    "requeue": ["-N3", "-n3", "--open-mode=append"],
}
# The sides whose fault is a GPU killed under a rank, not a node crashed.
GPU_SIDES = frozenset({"gpu_killed"})
LOADED_RE = re.compile(r"ckpt loaded step=(\d+)")


def log(msg: str) -> None:
    print(f"[bench_hard_failure {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def node_state(node: str) -> list[str]:
    p = subprocess.run(["scontrol", "show", "node", node, "--json"], capture_output=True, text=True, timeout=30)
    return json.loads(p.stdout)["nodes"][0]["state"] if p.returncode == 0 else []


def wait_for(cond, timeout_s: float, what: str, every: float = 0.2):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(every)
    raise RuntimeError(f"{what}: not within {timeout_s:.0f} s")


def revive(c: Devcluster) -> None:
    """node2 back in service: its slurmd registers again, a torchpass drain is resumed."""
    c.revive(CRASHED)
    wait_for(lambda: "DOWN" not in node_state(CRASHED), 90, f"{CRASHED}'s slurmd registered again")
    if "DRAIN" in node_state(CRASHED):
        subprocess.run(["scontrol", "update", f"NodeName={CRASHED}", "State=RESUME"], capture_output=True)
    wait_for(lambda: node_state(CRASHED) == ["IDLE"], 90, f"{CRASHED} idle again")


def gpu_back(c: Devcluster) -> None:
    """After a GPU killed under a rank: the drill cleared, the node resumed from torchpass's drain."""
    tpassctl = str(Path(sys.executable).parent / "tpassctl")
    subprocess.run([tpassctl, "inject", "--node", CRASHED, "--fault", "clear"], capture_output=True,
                   env={**os.environ, **c.env()})
    subprocess.run(["scontrol", "update", f"NodeName={CRASHED}", "State=RESUME"], capture_output=True,
                   env={**os.environ, **c.env()})
    wait_for(lambda: node_state(CRASHED) == ["IDLE"], 120, f"{CRASHED} idle again")


def snapshot_completed(c: Devcluster, job_id: int) -> bool:
    """Whether the job's events show a complete whole-job snapshot."""
    from torchpass import layout

    try:
        evs = json.loads(layout.events_json(c.state_dir, job_id).read_text())
    except (OSError, ValueError):
        return False
    return any(e.get("kind") == "snapshot.completed" for e in evs)


def relaunch_phases(c: Devcluster, job_id: int) -> dict:
    """The relaunch's own figures from the job's events: the decision to every rank resumed (the
    coordinator's clock), and the time from the death's report to the decision."""
    from torchpass import layout

    try:
        evs = json.loads(layout.events_json(c.state_dir, job_id).read_text())
    except (OSError, ValueError):
        return {}
    back = [e for e in evs if e.get("kind") == "job.relaunched"]
    return {"decision_to_resumed_s": back[0]["data"].get("decision_to_resumed_s")} if back else {}


def one_run(c: Devcluster, work: Path, user: str, side: str, tag: str, args: argparse.Namespace) -> dict:
    # the snapshot sides save no checkpoint: their restore point is the newest whole-job snapshot
    every = args.steps + 1 if side in ("snapshot", "gpu_killed") else args.every
    cmd = (f"{c.job_python} {REPO / 'examples' / 'train_checkpointed.py'} --steps {args.steps} "
           f"--params {args.params} "
           f"--sleep 0.05 --ckpt-every {every} --ckpt-dir {work}/ckpt.$SLURM_JOB_ID")
    sbatch_args = [a.format(snapshot_every=args.snapshot_every) for a in SIDES[side]]
    script = work / f"{tag}.sbatch"
    script.write_text(f"#!/bin/bash\nsrun {cmd}\n")
    script.chmod(0o755)
    out = work / f"{tag}.out"
    p = as_user(user, ["sbatch", "--parsable", *sbatch_args, "-o", str(out), str(script)], work)
    if p.returncode != 0:
        raise RuntimeError(f"sbatch ({side}): {p.stderr.strip()}")
    job_id = int(p.stdout.strip().split(";")[0])
    tail = Tail(out)
    tail.start()
    crashed_at = None
    try:
        wait_for(lambda: any(n >= args.crash_at for _, n, _ in tail.steps()), 240, f"job {job_id} at step "
                 f"{args.crash_at}", every=0.02)
        if side in ("snapshot", "gpu_killed"):  # its restore point: the first complete snapshot
            wait_for(lambda: snapshot_completed(c, job_id), 120 + 2 * args.snapshot_every,
                     f"job {job_id}'s first complete snapshot", every=0.05)
        nodes = job_state(job_id).get("nodes", "")
        crashed_at = time.monotonic()
        if side in GPU_SIDES:
            killed = c.kill_gpu(CRASHED, 0)["killed"]
            log(f"{side}: job {job_id} ({nodes}): GPU 0 of {CRASHED} killed under {killed} after step {args.crash_at}")
        else:
            c.crash(CRASHED)
            log(f"{side}: job {job_id} ({nodes}) crashed {CRASHED} after step {args.crash_at}")
        final = wait_for(lambda: (lambda j: j if j and not set(j["job_state"]) & {
            "PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED"} else None)(job_state(job_id)),
            900, f"{side} job {job_id}'s end", every=0.5)
    finally:
        time.sleep(0.3)
        tail.stop()
        subprocess.run(["scancel", str(job_id)], capture_output=True)
        if crashed_at is not None and side in GPU_SIDES:
            gpu_back(c)
        elif crashed_at is not None:
            revive(c)
    if final["job_state"][0] != "COMPLETED":
        raise RuntimeError(f"{side} job {job_id} ended {final['job_state']}: {out.read_text()[-1500:]}")
    steps = tail.steps()
    before = [(t, n) for t, n, _ in steps if t < crashed_at]
    after = [(t, n) for t, n, _ in steps if t >= crashed_at]
    last = max(n for _, n in before)
    first = first_arrivals([(t, n, ln) for t, n, ln in steps if t < crashed_at])
    gaps = [first[n + 1] - first[n] for n in sorted(first) if n + 1 in first and n >= 5]
    step_s = statistics.median(gaps)
    back = min(t for t, n in after if n == last + 1)
    loaded = [int(m.group(1)) for m in LOADED_RE.finditer(out.read_text())]
    # from a snapshot: the first step the restored ranks printed (the snapshot's, or the one before
    # it when the ranks paused before printing it)
    went_on = loaded[-1] if loaded else min(n for _, n in after)
    extra = relaunch_phases(c, job_id) if side in GPU_SIDES else {}
    return {"side": side, "job_id": job_id, "restarts": int(final.get("restart_cnt", 0)), **extra,
            "last_step_before": last, "checkpoint_loaded": loaded[-1] if loaded else None,
            "went_on_from": went_on, "recomputed_steps": last + 1 - went_on,
            "resumed_s": round(min(t for t, _ in after) - crashed_at, 2),
            "lost_s": round(back - crashed_at - step_s, 2), "step_s": round(step_s, 4),
            "lines": [ln for _, _, ln in steps]}


def last_per_step(lines: list[str]) -> dict[int, str]:
    return {n: next(iter(c)) for n, c in per_step(lines).items() if len(c) == 1}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    ap.add_argument("--params", default="1M", help="the model's size (train_ddp.py --params: 1M, 10M, 100M)")
    ap.add_argument("--snapshot-every", type=int, default=2, help="the snapshot side: a snapshot every S s")
    ap.add_argument("--crash-at", type=int, default=35, help="crash node2 once this step was printed")
    ap.add_argument("--sides", default=",".join(SIDES),
                    help=f"comma-separated sides to run (of {', '.join(SIDES)}); requeue is always run")
    ap.add_argument("--user", default="tpuser1", help="the job user (made by the devcluster's bring-up)")
    ap.add_argument("--out", type=Path, default=BENCH / "results" / "hard_failure.json")
    ap.add_argument("--cluster", default=os.environ.get("TORCHPASS_TEST_CLUSTER", "bench"))
    ap.add_argument("--subnet", default=os.environ.get("TORCHPASS_TEST_SUBNET", "10.76.0"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        ap.error("needs root (the devcluster: network namespaces, slurmd, node crashes)")
    if not 0 < args.every < args.crash_at < args.steps - 10 or args.pairs < 1:
        ap.error("need 0 < --every < --crash-at < --steps - 10 and --pairs >= 1")
    sides = tuple(s for s in SIDES if s in {*args.sides.split(","), "requeue"})
    if set(args.sides.split(",")) - set(SIDES):
        ap.error(f"--sides: unknown side(s) {sorted(set(args.sides.split(',')) - set(SIDES))}")
    t_all = time.monotonic()
    load0 = os.getloadavg()
    runs: list[dict] = []
    with devcluster(args.cluster, args.subnet, nodes=4) as c:
        with user_workdir("bench-hard-failure-", args.user) as work:
            for i in range(args.pairs):
                order = sides if i % 2 == 0 else tuple(reversed(sides))
                for side in order:
                    r = one_run(c, work, args.user, side, f"{i}-{side}", args)
                    r["pair"] = i + 1
                    runs.append(r)
                    log(f"{side}: resumed {r['resumed_s']} s after the crash, lost {r['lost_s']} s; went on from "
                        f"step {r['went_on_from']}, {r['recomputed_steps']} steps again, restarts {r['restarts']}")
    reference = last_per_step(runs[0]["lines"])
    for r in runs:
        if last_per_step(r.pop("lines")) != reference:
            raise RuntimeError(f"job {r['job_id']} ({r['side']}) printed other losses than job {runs[0]['job_id']}: "
                               "a bug, not a cost")
    summary = {}
    for side in sides:
        mine = [r for r in runs if r["side"] == side]
        summary[side] = {k: round(statistics.median(r[k] for r in mine), 2) for k in ("resumed_s", "lost_s")}
    for side, key in (("relaunch", "lost_ratio"), ("snapshot", "snapshot_lost_ratio"),
                      ("gpu_killed", "gpu_killed_lost_ratio")):
        if side in summary:
            summary[key] = round(summary["requeue"]["lost_s"] / summary[side]["lost_s"], 2)
    resumed = [r["resumed_s"] for r in runs if r["side"] == "relaunch"]
    data = {"crashed": CRASHED, "crash_at_step": args.crash_at, "checkpoint_every": args.every,
            "snapshot_every_s": args.snapshot_every, "ranks": 3,
            "params": args.params, "runs": runs, "summary": summary,
            "load_at_start": [round(x, 2) for x in load0],
            # tpassctl goodput --measured: lm_gpu_killed_s (summary.gpu_killed.resumed_s) when that side ran
            "machine": machine(), "bench_seconds": round(time.monotonic() - t_all, 1),
            "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    # tpassctl goodput --measured: lm_relaunch_s (this devcluster's SlurmdTimeout is 20 s); without
    # the relaunch side (--sides) there is no figure: a missing key, not a null one
    if resumed:
        data["hard_failure_relaunch_s"] = {"mean": round(statistics.mean(resumed), 2),
                                           "p50": round(statistics.median(resumed), 2), "n": len(resumed)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = args.out.with_suffix(".json.tmp")
    tmp_out.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp_out, args.out)
    cols = ("pair", "side", "job_id", "restarts", "last_step_before", "went_on_from", "recomputed_steps",
            "resumed_s", "lost_s")
    print(f"| {' | '.join(cols)} |")
    print(f"|{'---|' * len(cols)}")
    for r in runs:
        print(f"| {' | '.join(str(r[k]) for k in cols)} |")
    lost = ", ".join(f"{side} {summary[side]['lost_s']} s" for side in sides)
    print(f"median lost: {lost}; requeue over the others: "
          + ", ".join(f"{k} {v}x" for k, v in summary.items() if k.endswith("ratio"))
          + f"; every run printed the same losses; wrote {args.out} in {data['bench_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
