"""`make demo`: a local cluster, a DDP job under sbatch --torchpass, a fault, a live migration.

1. Brings up (or replaces) the devcluster "dev" on 10.77.0.0/24 (4 nodes).
   Jobs are submitted by the ordinary user tpuser1 (--user), as on a real
   cluster, and run the devcluster's job Python (`make jobvenv`); the fault
   drill and the node's resume afterwards are an admin's (root) commands.
2. Runs examples/train.sbatch (an unmodified DDP script, 3 training nodes
   plus node4 as a hot spare) once without a fault: the reference losses.
3. Runs the same job again, shows `tpassctl status` while it trains, and at
   a random step injects an ECC error storm on a random training node with
   `tpassctl inject`. torchpass pauses every rank at the same collective,
   moves that node's rank to the spare with CRIU and resumes.
4. Prints the job's outcome (same job id, no restart), the migration
   timeline from `tpassctl events`, and checks that every step's loss equals
   the reference bit for bit.
5. Second act: the job again with periodic snapshots
   (--torchpass=spares=1,snapshot_every=2). Once a snapshot is complete, a
   GPU is killed under a rank: `tpassctl devcluster kill-gpu NODE` (Xid 79,
   the GPU lost, the rank SIGKILLed, as the hardware does it). torchpass
   drains the node and relaunches the job's step from the snapshot with the
   spare in its place; the job goes on and completes under its id, with the
   reference's losses.

The cluster stays up afterwards (the faulty node is resumed, the drill
cleared) so you can keep using it; `tpassctl devcluster down` removes it.
Options: --no-fault (only the plain job), --seed N (replay a run), --user NAME.
"""

from __future__ import annotations

import argparse
import os
import pwd
import random
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
TPASSCTL = str(BIN / "tpassctl")
STEPS = 150
TRAIN_ARGS = "--params 1M --sleep 0.05"
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")


def sh(argv, **kw):
    return subprocess.run(argv, check=True, text=True, **kw)


class User:
    """The demo's job user: runs sbatch and watches its job with the job Python's tpassctl."""

    def __init__(self, name: str, job_python: Path):
        self.pw = pwd.getpwnam(name)
        self.job_python = job_python
        self.tpassctl = str(job_python.parent / "tpassctl")

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "HOME": self.pw.pw_dir, "USER": self.pw.pw_name, "LOGNAME": self.pw.pw_name,
                "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", **extra}

    def run(self, argv: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["runuser", "-u", self.pw.pw_name, "--", *argv], text=True, env=self.env(),
                              cwd="/", **kw)


def prepare_work(work: Path, user: User) -> None:
    """The user's own copies of the job script and training script (this checkout may be unreadable to them)."""
    work.mkdir(exist_ok=True)
    os.chown(work, user.pw.pw_uid, user.pw.pw_gid)
    work.chmod(0o755)
    for name in ("train.sbatch", "train_ddp.py"):
        shutil.copyfile(HERE / name, work / name)
        os.chown(work / name, user.pw.pw_uid, user.pw.pw_gid)


def submit(work: Path, tag: str, user: User, torchpass: str = "spares=1") -> tuple[int, Path]:
    env = user.env(PYTHON=str(user.job_python), TRAIN_PY=str(work / "train_ddp.py"),
                   STEPS=str(STEPS), TRAIN_ARGS=TRAIN_ARGS)
    argv = ["sbatch", "--parsable", "-N4", f"--torchpass={torchpass}", "-o", str(work / f"{tag}-%j.out"),
            "-D", str(work), str(work / "train.sbatch")]
    print(f"{user.pw.pw_name}$ " + " ".join(argv[:1] + argv[2:4]) + " examples/train.sbatch", flush=True)
    proc = sh(["runuser", "-u", user.pw.pw_name, "--", *argv], capture_output=True, env=env, cwd=work)
    job_id = int(proc.stdout.strip().split(";")[0])
    return job_id, work / f"{tag}-{job_id}.out"


def wait_end(slurm, job_id: int, timeout_s: float = 300, on_tick=None):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        job = slurm.job(job_id)
        if job is None or job.state not in ACTIVE:
            return job
        if on_tick:
            on_tick(job)
        time.sleep(0.2)
    raise SystemExit(f"demo: job {job_id} did not end within {timeout_s:.0f} s; see `squeue` and its output file")


def step_lines(path: Path) -> list[str]:
    text = path.read_text() if path.exists() else ""
    return [ln for ln in text.splitlines() if re.fullmatch(r"step=\d+ loss=\S+", ln)]


def per_step(lines: list[str]) -> dict[int, Counter]:
    out: dict[int, Counter] = {}
    for ln in lines:
        out.setdefault(int(ln.split()[0].split("=")[1]), Counter())[ln] += 1
    return out


def last_step(path: Path) -> int:
    lines = step_lines(path)
    return int(lines[-1].split()[0].split("=")[1]) if lines else -1


def gpu_killed_act(rng: random.Random, seed: int, work: Path, user: User, slurm, cluster, ref_lines: list[str]
                   ) -> bool:
    """Act two: a GPU killed under a rank, and the job going on (relaunched from its newest snapshot)."""
    import json

    from torchpass import layout

    node = rng.choice(["node2", "node3"])
    print(f"\n== act two: the same job with a snapshot every 2 s; a GPU of {node} dies under its rank "
          f"(seed {seed})", flush=True)
    job_id, out = submit(work, "gpu-killed", user, "spares=1,snapshot_every=2")
    print(f"submitted job {job_id}", flush=True)
    events = layout.events_json(cluster.state_dir, job_id)
    killed = False

    def tick(job) -> None:
        nonlocal killed
        if killed or job.state != "RUNNING" or not events.exists():
            return
        if not any(e["kind"] == "snapshot.completed" for e in json.loads(events.read_text() or "[]")):
            return
        print(f"\nroot$ tpassctl devcluster kill-gpu {node} --gpu 0   (training is at step {last_step(out)}, "
              "a snapshot is complete)", flush=True)
        subprocess.run([TPASSCTL, "devcluster", "kill-gpu", node, "--gpu", "0"], text=True)
        killed = True

    try:
        job = wait_end(slurm, job_id, on_tick=tick)
    finally:
        subprocess.run([TPASSCTL, "inject", "--node", node, "--fault", "clear"], capture_output=True)
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True)
    print(f"\n== job {job_id}: {job.state if job else 'unknown'}, exit code {job.exit_code if job else '?'},"
          f" restarts {job.restarts if job else '?'} (same job id throughout)", flush=True)
    print(f"\n{user.pw.pw_name}$ tpassctl events {job_id}", flush=True)
    user.run([user.tpassctl, "events", str(job_id)])
    # Steps from the snapshot on are computed again after the relaunch: each line must be the reference's.
    ref = per_step(ref_lines)
    lines = step_lines(out)
    same = bool(lines) and sorted(per_step(lines)) == sorted(ref) and all(
        ln in ref[int(ln.split()[0].split("=")[1])] for ln in lines)
    print(f"\n== losses: every step present, each line the reference's bit for bit: {'yes' if same else 'NO'}",
          flush=True)
    return killed and job is not None and job.state == "COMPLETED" and same


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-fault", action="store_true", help="run the job once, without a fault drill")
    ap.add_argument("--seed", type=int, default=None, help="seed choosing the faulty node and step")
    ap.add_argument("--user", default="tpuser1", help="the ordinary user that submits the jobs (made if missing)")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else int(time.time())
    rng = random.Random(seed)

    from torchpass.devcluster import Devcluster, DevclusterSpec
    from torchpass.slurm import client

    t0 = time.monotonic()
    print("== bringing up the devcluster 'dev' (4 nodes, 10.77.0.0/24)", flush=True)
    users = (args.user,) + tuple(u for u in DevclusterSpec().job_users if u != args.user)
    cluster = Devcluster.up(DevclusterSpec(name="dev", job_users=users))
    os.environ.update(cluster.env())
    sh(["sinfo"])
    slurm = client()
    user = User(args.user, cluster.job_python)
    work = Path("/tmp/torchpass-demo")
    prepare_work(work, user)

    ref_lines: list[str] = []
    if not args.no_fault:
        print(f"\n== reference run without a fault ({STEPS} steps, 3 ranks, 1M parameters, Adam)", flush=True)
        ref_id, ref_out = submit(work, "reference", user)
        ref = wait_end(slurm, ref_id)
        ref_lines = step_lines(ref_out)
        print(f"job {ref_id}: {ref.state if ref else 'unknown'}, {len(ref_lines)} step lines", flush=True)
        if ref is None or ref.state != "COMPLETED" or len(ref_lines) != 3 * STEPS:
            print(f"demo: the reference job failed; see {ref_out}", file=sys.stderr)
            return 1

    # node1 is the batch host, where the job script and the coordinator run.
    node = rng.choice(["node2", "node3"])
    fault_step = rng.randrange(10, 40)
    print("\n== the same job" + ("" if args.no_fault else
          f"; at step {fault_step} an ECC error storm on {node} (seed {seed})"), flush=True)
    job_id, out = submit(work, "faulted" if not args.no_fault else "job", user)
    print(f"submitted job {job_id}", flush=True)

    injected = args.no_fault
    shown = 0.0

    def tick(job) -> None:
        nonlocal injected, shown
        if job.state != "RUNNING":
            return
        if not injected and last_step(out) >= fault_step:
            print(f"\nroot$ tpassctl inject --node {node} --fault ecc-sbe-storm"
                  f"   (training is at step {last_step(out)})",
                  flush=True)
            subprocess.run([TPASSCTL, "inject", "--node", node, "--fault", "ecc-sbe-storm"], text=True)
            injected = True
            time.sleep(0.5)
            print(f"{user.pw.pw_name}$ tpassctl nodes", flush=True)
            user.run([user.tpassctl, "nodes"])
            shown = 0.0
        elif time.monotonic() - shown > 4:
            print(f"\n{user.pw.pw_name}$ tpassctl status {job_id}", flush=True)
            user.run([user.tpassctl, "status", str(job_id)])
            shown = time.monotonic()

    try:
        job = wait_end(slurm, job_id, on_tick=tick)
    finally:
        if not args.no_fault:
            subprocess.run([TPASSCTL, "inject", "--node", node, "--fault", "clear"], capture_output=True)
            subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True)

    lines = step_lines(out)
    print(f"\n== job {job_id}: {job.state if job else 'unknown'}, exit code {job.exit_code if job else '?'},"
          f" restarts {job.restarts if job else '?'} (same job id throughout)", flush=True)
    ok = job is not None and job.state == "COMPLETED"
    if not args.no_fault:
        print(f"\n{user.pw.pw_name}$ tpassctl events {job_id}", flush=True)
        user.run([user.tpassctl, "events", str(job_id)])
        same = per_step(lines) == per_step(ref_lines)
        print(f"\n== losses: {len(lines)} step lines vs {len(ref_lines)} in the reference; "
              + ("every step bit-identical (float.hex), no step lost or repeated" if same else
                 "DIFFERENT from the reference"), flush=True)
        ok = ok and same
        ok = gpu_killed_act(rng, seed, work, user, slurm, cluster, ref_lines) and ok
    else:
        print("last lines of its output:")
        for line in lines[-3:]:
            print("  " + line)
    print(f"\n(demo took {time.monotonic() - t0:.0f} s; output in {work}; the cluster is still up)")
    print('use it:     eval "$(.venv/bin/tpassctl devcluster env)"; sinfo; .venv/bin/tpassctl nodes')
    print("remove it:  .venv/bin/tpassctl devcluster down")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
