"""A job that ends during a move leaves no image, hold file or process (scancel during a
migration leaves no process, image or hold file behind; tpassd/sweep.py).

The move is stood in for: tpassd dumps a rank of an ordinary user's running
--torchpass job (left running, as the first phase of a move leaves it), the user's coordinator
would have written a hold file, and the user also planted a symlink among the hold files. Then the
job is cancelled, and either the node's Epilog helper (``tpassd --sweep-job``) runs inside the
node, or the node's tpassd sweeps on its own (at its start; then every sweep_interval_s).
Without tpassd/sweep.py the images and the hold files stay."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from slurm_helpers import as_user, job_id_of, sbatch, scancel, wait_job, wait_running
from torchpass import layout
from torchpass.ports import TPASSD_CONTROL_PORT
from tpassd.testing import call, wait_for

pytestmark = pytest.mark.integration

NODE = "node3"


def _job_pids(cluster, job_id: int) -> list[int]:
    """Live processes of this cluster's job anywhere on this machine (the nodes share its PID
    namespace; other devclusters have jobs with the same ids, told apart by their ClusterName)."""
    want = {"SLURM_JOB_ID": str(job_id), "SLURM_CLUSTER_NAME": f"tp{cluster.spec.name}"}
    found = []
    for p in psutil.process_iter():
        try:
            env = p.environ()
            if all(env.get(k) == v for k, v in want.items()) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except psutil.Error:
            continue
    return found


@pytest.mark.parametrize("sweeper", ["epilog", "tpassd"])
def test_scancel_after_a_dump_leaves_no_image_hold_file_or_process(cluster, plugin_built, job_dir, job_user,
                                                                   jobs_base, sweeper):
    owner = job_user.name
    job_id = job_id_of(sbatch(["-N1", "-w", NODE, "--torchpass", "-o", str(job_dir / "out.%j")],
                              "#!/bin/sh\nsrun sleep 300\n", cwd=job_dir, user=owner))
    victim = jobs_base / f"victim-{job_id}"
    victim.write_text("root's, not the job's\n")
    try:
        wait_running(job_id)
        rank_dir = layout.rank_records_dir(cluster.state_dir, job_id)
        wait_for(lambda: layout.rank_record(rank_dir, job_id, 0).exists(), 60, "rank 0's record", poll_s=0.2)
        ep = f"tcp://{cluster.node_address(NODE)}:{TPASSD_CONTROL_PORT}"
        dumped = call(ep, NODE, "tpassd.snapshot", {"job_id": job_id, "rank": 0, "op": "dump", "generation": 1},
                      str(cluster.munge_socket), timeout_s=120.0, retries=0)
        images = Path(dumped["images"])
        assert images.is_dir() and any(images.iterdir()), dumped
        # What the job user's coordinator writes when it holds rank 0, and a link the user plants.
        hold = layout.hold_file(cluster.state_dir, job_id, "m1", 0)
        made = subprocess.run(as_user(["sh", "-c", f'mkdir -p "{hold.parent}" && echo hold > "{hold}" '
                                                   f'&& ln -s "{victim}" "{hold.parent}/evil"'], owner),
                              capture_output=True, text=True, timeout=30)
        assert made.returncode == 0, made.stderr
        assert _job_pids(cluster, job_id), "the job's processes are not found: the check below would prove nothing"
    finally:
        scancel(job_id, user=owner)
    assert wait_job(job_id, timeout_s=60).state == "CANCELLED"
    assert images.is_dir(), "the images went before the sweep: this test would prove nothing"

    if sweeper == "epilog":  # the node's Epilog helper, as slurmd would run it there (root, its namespaces)
        conf = cluster.run_dir / NODE / "tpassd" / "tpassd.toml"
        tpassd = str(Path(sys.executable).with_name("tpassd"))
        swept = cluster.exec_on(NODE, [tpassd, "--config", str(conf), "--sweep-job", str(job_id)],
                                capture_output=True, text=True, timeout=120, env={**os.environ, **cluster.env()})
        assert swept.returncode == 0, swept.stderr
    else:  # the node's tpassd, which asks slurmctld which jobs still exist
        cluster.tpassd_restart(NODE)
        wait_for(lambda: not images.exists() and not os.path.lexists(hold.parent), 30, "tpassd's sweep",
                 poll_s=0.2)

    assert not images.exists() and not layout.snapshot_job_dir(images.parents[1], job_id).exists()
    assert not os.path.lexists(hold.parent)
    assert victim.read_text() == "root's, not the job's\n"  # the planted link was not followed
    assert layout.events_json(cluster.state_dir, job_id).parent.is_dir()  # the job's event log stays
    wait_for(lambda: _job_pids(cluster, job_id) == [], 30, f"every process of job {job_id} gone", poll_s=0.2)
    criu = subprocess.run(["pgrep", "-f", "--", f"-D {images.parent}/"], capture_output=True, text=True)
    assert criu.stdout.strip() == "", criu.stdout
