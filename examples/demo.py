"""`make demo`: a local cluster, a 3-node DDP job under sbatch --torchpass, its status live.

Brings up (or replaces) the devcluster "dev" on 10.77.0.0/24, submits
examples/train.sbatch with --torchpass, prints `tpassctl status` while the
job runs and the job's outcome at the end. The cluster stays up afterwards
so you can keep using it; `tpassctl devcluster down` removes it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def sh(argv, **kw):
    return subprocess.run(argv, check=True, text=True, **kw)


def main() -> int:
    from torchpass.devcluster import Devcluster, DevclusterSpec
    from torchpass.slurm import client

    t0 = time.monotonic()
    print("== bringing up the devcluster 'dev' (4 nodes, 10.77.0.0/24)", flush=True)
    cluster = Devcluster.up(DevclusterSpec(name="dev"))
    os.environ.update(cluster.env())
    sh(["sinfo"])

    work = Path("/tmp/torchpass-demo")
    work.mkdir(exist_ok=True)
    work.chmod(0o777)
    out = work / "job-%j.out"
    env = {**os.environ, "PYTHON": sys.executable, "TRAIN_PY": str(HERE / "train_ddp.py"), "STEPS": "40",
           "TRAIN_ARGS": "--sleep 0.15"}
    print("\n== sbatch --torchpass examples/train.sbatch (3 nodes, unmodified DDP script)", flush=True)
    job_id = int(sh(["sbatch", "--parsable", "-o", str(out), "-D", str(work), str(HERE / "train.sbatch")],
                    capture_output=True, env=env).stdout.strip().split(";")[0])
    print(f"submitted job {job_id}", flush=True)

    slurm = client()
    shown = 0
    while True:
        job = slurm.job(job_id)
        if job is None or job.state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            break
        if job.state == "RUNNING" and time.monotonic() - shown > 3:
            print(f"\n$ tpassctl status {job_id}", flush=True)
            subprocess.run([str(BIN / "tpassctl"), "status", str(job_id)], text=True)
            shown = time.monotonic()
        time.sleep(0.5)
    job = slurm.job(job_id)
    log = Path(str(out).replace("%j", str(job_id)))
    lines = log.read_text().splitlines() if log.exists() else []
    print(f"\n== job {job_id}: {job.state if job else 'unknown'}, exit code {job.exit_code if job else '?'},"
          f" restarts {job.restarts if job else '?'}", flush=True)
    print("last lines of its output:")
    for line in lines[-5:]:
        print("  " + line)
    print(f"\n(demo took {time.monotonic() - t0:.0f} s; the cluster is still up)")
    print('use it:     eval "$(.venv/bin/tpassctl devcluster env)"; sinfo; .venv/bin/tpassctl nodes')
    print("remove it:  .venv/bin/tpassctl devcluster down")
    return 0 if job is not None and job.state == "COMPLETED" else 1


if __name__ == "__main__":
    sys.exit(main())
