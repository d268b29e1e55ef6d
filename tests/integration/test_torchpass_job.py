"""Issue 2 end to end: sbatch --torchpass of a 3-node gloo DDP job on the devcluster.

The training script is examples/train_ddp.py, which knows nothing about
torchpass; the SPANK plugin starts the coordinator and loads the runtime.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from slurm_helpers import job_id_of, sbatch, wait_job, wait_running

from torchpass import layout
from torchpass.devcluster.cluster import REPO_ROOT

TPASSCTL = str(Path(sys.executable).parent / "tpassctl")


def coordinator_pids(job_id: int) -> list[int]:
    """Processes anywhere on this machine running the coordinator for job_id."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            continue
        text = [a.decode(errors="replace") for a in argv]
        if any(a.endswith("tpass-coordinator") for a in text[:2]) and "--job-id" in text \
                and text[text.index("--job-id") + 1] == str(job_id):
            pids.append(int(d))
    return pids


def status_json(job_id: int) -> dict:
    out = subprocess.run([TPASSCTL, "status", str(job_id), "--json"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["jobs"][0]


def test_three_node_ddp_job_registers_ranks_and_reports_progress(cluster, plugin_built, job_dir):
    env_script = (
        f"#!/bin/bash\n#SBATCH -N3 --ntasks-per-node=1\n"
        f"export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1) MASTER_PORT=29511\n"
        f"srun --kill-on-bad-exit=1 {sys.executable} {REPO_ROOT}/examples/train_ddp.py --steps 60 --sleep 0.1\n"
    )
    job_id = job_id_of(sbatch(["--torchpass", "-o", str(job_dir / "out.txt")], env_script, cwd=job_dir))
    wait_running(job_id)

    # Wait until all three ranks have registered and report steps.
    deadline = time.monotonic() + 60
    st = {}
    while time.monotonic() < deadline:
        try:
            st = status_json(job_id)
        except AssertionError:
            st = {}
        if st.get("registered_ranks") == 3 and (st.get("min_step") or -1) >= 0:
            break
        time.sleep(0.3)
    assert st.get("registered_ranks") == 3, f"status never showed 3 ranks: {st}"
    assert st["world_size"] == 3
    assert sorted(r["node"] for r in st["ranks"]) == ["node1", "node2", "node3"]
    assert all(r["last_report_age_s"] < 5 for r in st["ranks"])

    # Progress advances between two looks, and exactly one coordinator runs.
    first = st["max_step"]
    time.sleep(1.5)
    second = status_json(job_id)
    assert second["max_step"] > first, (first, second["max_step"])
    pids = coordinator_pids(job_id)
    assert len(pids) == 1, f"expected exactly one coordinator for job {job_id}, found {pids}"
    assert st["coordinator"]["pid"] == pids[0]

    job = wait_job(job_id, timeout_s=120)
    assert (job.state, job.exit_code, job.restarts) == ("COMPLETED", 0, 0), (job_dir / "out.txt").read_text()[-2000:]
    lines = [l for l in (job_dir / "out.txt").read_text().splitlines() if l.startswith("step=")]
    assert lines[-1].startswith("step=59 "), lines[-3:]

    # The coordinator goes with the job.
    deadline = time.monotonic() + 15
    while coordinator_pids(job_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert coordinator_pids(job_id) == []


def test_job_without_torchpass_gets_no_coordinator_and_no_env(cluster, plugin_built, job_dir):
    script = "#!/bin/bash\n#SBATCH -N2\nsrun -l sh -c 'env | grep ^TORCHPASS_ | wc -l; echo pythonpath=${PYTHONPATH:-}'\n"
    job_id = job_id_of(sbatch(["-o", str(job_dir / "plain.txt")], script, cwd=job_dir))
    job = wait_job(job_id, timeout_s=60)
    assert job.state == "COMPLETED"
    out = (job_dir / "plain.txt").read_text().split()
    assert sorted(out) == sorted(["0:", "0", "1:", "0", "0:", "pythonpath=", "1:", "pythonpath="]), out
    assert not layout.job_dir(cluster.state_dir, job_id).exists()
