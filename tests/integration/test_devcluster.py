"""The devcluster itself: real daemons, real namespaces, real jobs; clean teardown."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from torchpass.devcluster import Devcluster, DevclusterSpec
from torchpass.slurm import client

from slurm_helpers import job_id_of, sbatch, wait_job


def test_nodes_idle_with_own_names_and_addresses(cluster):
    nodes = {n.name: n for n in client().nodes()}
    assert sorted(nodes) == ["node1", "node2", "node3", "node4"]
    for name in cluster.node_names:
        out = cluster.exec_on(name, ["sh", "-c", "hostname; ip -4 -o addr show eth0"], capture_output=True,
                              text=True, check=True).stdout
        assert out.splitlines()[0] == name
        assert f"inet {cluster.node_address(name)}/24" in out


def test_sbatch_across_three_nodes_completes(cluster, job_dir):
    proc = sbatch(["-N3", "-o", str(job_dir / "out.txt")], "#!/bin/sh\nsrun hostname | sort\n", cwd=job_dir)
    job = wait_job(job_id_of(proc), timeout_s=60)
    assert job.state == "COMPLETED" and job.exit_code == 0
    assert (job_dir / "out.txt").read_text().split() == ["node1", "node2", "node3"]


def test_env_command_points_plain_slurm_commands_at_the_cluster(cluster):
    out = subprocess.run([os.path.join(os.path.dirname(os.sys.executable), "tpassctl"), "devcluster", "env",
                          "--name", cluster.spec.name, "--json"], capture_output=True, text=True, check=True).stdout
    env = json.loads(out)
    assert env["SLURM_CONF"] == str(cluster.slurm_conf)
    sinfo = subprocess.run(["sinfo", "-h", "-o", "%D %t"], capture_output=True, text=True, check=True,
                           env={**os.environ, **env}).stdout.split()
    assert sinfo == ["4", "idle"]


def test_up_after_a_crashed_run_and_down_leave_nothing():
    """A cluster whose daemons were SIGKILLed and whose record is gone still comes down and back up."""
    spec = DevclusterSpec(name="crash", nodes=2, subnet="10.76.0", tpassd=False)
    c = Devcluster.up(spec)
    ctld = json.loads((spec.run_dir / "cluster.json").read_text())["pids"]["slurmctld"]
    os.kill(ctld, signal.SIGKILL)
    (spec.run_dir / "cluster.json").unlink()  # as if the machine crashed mid-write
    c2 = Devcluster.up(spec)
    try:
        env = {**os.environ, **c2.env()}
        out = subprocess.run(["sinfo", "-h", "-o", "%D %t"], capture_output=True, text=True, env=env, check=True)
        assert out.stdout.split() == ["2", "idle"]
        pids = list(json.loads((spec.run_dir / "cluster.json").read_text())["pids"].values())
    finally:
        c2.down()
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "tp-crash-" not in namespaces
    assert not os.path.exists("/sys/class/net/tp-crash")
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z"
    assert not spec.run_dir.exists()


def test_bad_spec_is_refused_with_a_clear_message():
    from torchpass.errors import DevclusterError

    with pytest.raises(DevclusterError, match="cluster name"):
        DevclusterSpec(name="Bad Name").validate()
    with pytest.raises(DevclusterError, match="--nodes 40 is out of range"):
        DevclusterSpec(nodes=40).validate()
