"""The devcluster itself: real daemons, real namespaces, real jobs; clean teardown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from slurm_helpers import job_id_of, sbatch, wait_job
from torchpass.devcluster import Devcluster, DevclusterSpec
from torchpass.devcluster.cluster import REPO_ROOT
from torchpass.errors import DevclusterError
from torchpass.slurm import client


def test_nodes_idle_with_own_names_and_addresses(cluster):
    nodes = {n.name: n for n in client().nodes()}
    assert sorted(nodes) == ["node1", "node2", "node3", "node4"]
    for name in cluster.node_names:
        out = cluster.exec_on(name, ["sh", "-c", "hostname; ip -4 -o addr show eth0"], capture_output=True,
                              text=True, check=True).stdout
        assert out.splitlines()[0] == name
        assert f"inet {cluster.node_address(name)}/24" in out


def test_sbatch_across_three_nodes_completes(cluster, job_dir, job_user):
    proc = sbatch(["-N3", "-o", str(job_dir / "out.txt")], "#!/bin/sh\nsrun sh -c 'echo $(hostname) $(id -u)' | sort\n",
                  cwd=job_dir, user=job_user.name)
    job = wait_job(job_id_of(proc), timeout_s=60)
    assert job.state == "COMPLETED" and job.exit_code == 0
    uid = str(job_user.uid)
    assert (job_dir / "out.txt").read_text().split() == ["node1", uid, "node2", uid, "node3", uid]


def test_job_users_exist_and_run_the_job_python(cluster, job_user, other_user):
    """Bring-up made (or found) two ordinary users; plugstack.conf names the job Python's
    programs and runtime, which both users can run, never root's interpreter or this checkout."""
    assert cluster.job_users == ("tpuser1", "tpuser2")
    assert 0 < job_user.uid != other_user.uid > 0
    plug = (cluster.run_dir / "etc" / "plugstack.conf").read_text()
    bindir = cluster.job_python.parent
    assert (f"coordinator={bindir / 'tpass-coordinator'} " in plug
            and f"rank_wrapper={bindir / 'tpass-rankwrap'}" in plug)
    assert str(REPO_ROOT) not in plug, plug  # the plugin too is a copy in the run dir
    assert plug.startswith(f"optional {cluster.run_dir / 'lib' / 'torchpass.so'} ")
    for user in (job_user, other_user):
        out = subprocess.run(["runuser", "-u", user.name, "--", str(cluster.job_python), "-c",
                              "import os, torchpass; print(os.getuid(), torchpass.__file__)"],
                             capture_output=True, text=True, timeout=60, cwd="/")
        assert out.returncode == 0, out.stderr
        uid, where = out.stdout.split()
        assert int(uid) == user.uid and not where.startswith(str(REPO_ROOT) + "/"), out.stdout


def test_a_job_python_the_users_cannot_run_fails_bring_up_in_one_line(tmp_path):
    """tmp_path is root's 0700 directory: a Python in it is what a pyenv under /root is to a job user."""
    hidden = tmp_path / "python"
    hidden.symlink_to("/usr/bin/python3")
    spec = DevclusterSpec(name="nopy", nodes=1, subnet="10.75.0", tpassd=False, job_python=hidden)
    with pytest.raises(DevclusterError) as exc:
        Devcluster.up(spec)
    msg = str(exc.value)
    assert "\n" not in msg and "tpuser1 cannot use the job Python" in msg and "make jobvenv" in msg, msg
    assert not spec.run_dir.exists()


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
    Devcluster.up(spec)
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
    with pytest.raises(DevclusterError, match="cluster name"):
        DevclusterSpec(name="Bad Name").validate()
    with pytest.raises(DevclusterError, match="--nodes 40 is out of range"):
        DevclusterSpec(nodes=40).validate()
    with pytest.raises(DevclusterError, match="ordinary user name"):
        DevclusterSpec(job_users=("root",)).validate()


def test_crash_kills_every_process_of_a_node_revive_brings_it_back_and_down_cleans_a_crashed_node():
    """`tpassctl devcluster crash/revive` on a cluster of its own: a running job's processes die with
    the node's daemons; slurmctld takes the node back once revived; down() after a crash leaves nothing."""
    spec = DevclusterSpec(name="pcut", nodes=2, subnet="10.72.0", tpassd=False)
    c = Devcluster.up(spec)
    tpassctl = [os.path.join(os.path.dirname(os.sys.executable), "tpassctl"), "devcluster"]
    try:
        env = {**os.environ, **c.env()}
        ns = spec.netns(2)
        job = subprocess.run(["runuser", "-u", spec.job_users[0], "--", "sbatch", "--parsable", "-w", "node2", "-o",
                              "/dev/null", "--wrap", "sleep 300"], capture_output=True, text=True, env=env,
                             cwd="/tmp", check=True).stdout.strip()
        # slurmd, slurmstepd, the job; the job can take a while to start beside two loaded devclusters
        deadline = time.monotonic() + 90
        while len(c._netns_pids(ns)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        before = c._netns_pids(ns)
        assert len(before) >= 3, (before, subprocess.run(["squeue", "--noheader"], capture_output=True, text=True,
                                                         env=env).stdout)
        out = subprocess.run([*tpassctl, "crash", "node2", "--name", "pcut", "--json"], capture_output=True,
                             text=True, check=True).stdout
        assert set(before) <= set(json.loads(out)["killed"]) and c._netns_pids(ns) == []
        st = json.loads(subprocess.run([*tpassctl, "status", "--name", "pcut", "--json"], capture_output=True,
                                       text=True, check=True).stdout)
        assert st["crashed"] == ["node2"] and not st["processes"]["slurmd.node2"]["alive"]
        assert st["processes"]["slurmd.node1"]["alive"]
        # The job first (slurmctld then waits for the node to end it), then the node.
        subprocess.run(["scancel", job], env=env, check=True)

        def slurmd_started() -> int:
            out = subprocess.run(["scontrol", "show", "node", "node2", "--json"], capture_output=True, text=True,
                                 env=env, check=True).stdout
            return json.loads(out)["nodes"][0]["slurmd_start_time"]["number"]

        started = slurmd_started()
        subprocess.run([*tpassctl, "revive", "node2", "--name", "pcut"], check=True, capture_output=True)
        deadline = time.monotonic() + 60
        while slurmd_started() == started and time.monotonic() < deadline:  # a new slurmd registered
            time.sleep(0.5)
        assert slurmd_started() > started
        back = Devcluster.attach("pcut")  # its record names the new slurmd
        assert back.exec_on("node2", ["hostname"], capture_output=True, text=True).stdout.strip() == "node2"
        assert Devcluster.attach("pcut").status()["crashed"] == []
        subprocess.run([*tpassctl, "crash", "node1", "--name", "pcut"], check=True, capture_output=True)
    finally:
        c.down()
    assert "tp-pcut-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not os.path.exists("/sys/class/net/tp-pcut") and not spec.run_dir.exists()
