"""The devcluster's cgroup mode (torchpass/devcluster/cgroups.py): each node's cgroup
subtree and namespace, Slurm's configuration for it, and its removal. The pure parts run
against trees under tmp_path; one test makes a node's subtree in this machine's real cgroup v1
hierarchies (root) and checks what a slurmd started by it would see, and that it is removed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from torchpass.devcluster import Devcluster, DevclusterSpec, cgroups
from torchpass.devcluster.cluster import _State
from torchpass.errors import DevclusterError
from tpassctl.cli import cli

PROC_CGROUP = """12:pids:/
6:freezer:/
4:memory:/sess/abc
3:cpuset:/
2:cpu,cpuacct:/
1:devices:/d
0::/
"""


def _fake_root(tmp_path: Path) -> tuple[Path, Path]:
    root, proc = tmp_path / "cg", tmp_path / "self-cgroup"
    proc.write_text(PROC_CGROUP)
    for c, own in (("freezer", ""), ("cpuset", ""), ("memory", "sess/abc"), ("devices", "d"), ("cpuacct", "")):
        (root / c / own).mkdir(parents=True, exist_ok=True)
        (root / c / "cgroup.procs").write_text("")
    (root / "cpuset" / "cpuset.cpus").write_text("0-1\n")
    (root / "cpuset" / "cpuset.mems").write_text("0\n")
    return root, proc


def test_each_node_gets_a_subtree_under_this_processes_own_cgroup_in_every_controller(tmp_path):
    root, proc = _fake_root(tmp_path)
    assert cgroups.own_cgroup("memory", proc) == "/sess/abc"
    assert cgroups.own_cgroup("cpuacct", proc) == "/"  # a co-mounted hierarchy ("cpu,cpuacct")
    dirs = cgroups.node_dirs("g", "node2", root, proc)
    assert dirs == [root / "freezer" / "tp-g-node2", root / "cpuset" / "tp-g-node2",
                    root / "memory" / "sess" / "abc" / "tp-g-node2", root / "devices" / "d" / "tp-g-node2",
                    root / "cpuacct" / "tp-g-node2"]
    with pytest.raises(DevclusterError, match=r"no cgroup v1 blkio hierarchy in .*run it without --cgroups"):
        cgroups.own_cgroup("blkio", proc)
    (root / "devices" / "cgroup.procs").unlink()  # not a mounted hierarchy
    with pytest.raises(DevclusterError, match=r"devices is not a mounted cgroup v1 hierarchy"):
        cgroups.node_dirs("g", "node2", root, proc)


def test_a_new_cpuset_gets_its_parents_cpus_and_a_revived_node_keeps_its_subtree(tmp_path):
    root, proc = _fake_root(tmp_path)
    dirs = cgroups.node_dirs("g", "node1", root, proc)
    cpuset = root / "cpuset" / "tp-g-node1"
    cpuset.mkdir()  # the kernel makes a cpuset's files, empty
    (cpuset / "cpuset.cpus").write_text("")
    (cpuset / "cpuset.mems").write_text("")
    cgroups.make(dirs)
    assert all(d.is_dir() for d in dirs)
    assert (cpuset / "cpuset.cpus").read_text() == "0-1\n" and (cpuset / "cpuset.mems").read_text() == "0\n"
    cgroups.make(dirs)  # again (revive): kept as they are
    assert (cpuset / "cpuset.cpus").read_text() == "0-1\n"


def test_remove_takes_a_subtree_deepest_first_and_says_what_it_could_not(tmp_path):
    d = tmp_path / "tp-g-node1"
    (d / "slurm_node1" / "uid_1001" / "job_7" / "step_0" / "task_0").mkdir(parents=True)
    (d / "slurm_node1" / "uid_1001" / "job_8").mkdir(parents=True)
    assert cgroups.remove([d]) == [] and not d.exists()
    busy = tmp_path / "busy"
    (busy / "sub").mkdir(parents=True)
    (busy / "sub" / "cgroup.procs").write_text("1\n")  # a plain file: rmdir fails as on a busy cgroup
    assert cgroups.remove([busy], timeout_s=0.2) == [busy]
    assert cgroups.procs(busy) == [1]


def _configured(tmp_path: Path, **kw) -> Path:
    c = Devcluster(DevclusterSpec(name="u", base_dir=tmp_path, plugin=tmp_path / "none.so", **kw))
    c._state = _State(spec={}, job_python="/usr/bin/python3")
    c._runtime_dir = tmp_path
    (c.run_dir / "etc").mkdir(parents=True)
    c._write_configs()
    return c.run_dir / "etc"


def test_the_cgroup_mode_configures_slurm_as_production_clusters_run_it(tmp_path):
    etc = _configured(tmp_path / "a", cgroups=True)
    conf = (etc / "slurm.conf").read_text().splitlines()
    for line in ("ProctrackType=proctrack/cgroup", "TaskPlugin=task/cgroup,task/affinity",
                 "SelectTypeParameters=CR_Core_Memory", "DefMemPerCPU=1000"):
        assert line in conf
    assert "ProctrackType=proctrack/linuxproc" not in conf
    cg = (etc / "cgroup.conf").read_text().splitlines()
    for line in ("CgroupPlugin=cgroup/v1", "ConstrainCores=yes", "ConstrainRAMSpace=yes"):
        assert line in cg
    plain = _configured(tmp_path / "b")
    conf = (plain / "slurm.conf").read_text().splitlines()
    assert "ProctrackType=proctrack/linuxproc" in conf and "TaskPlugin=task/none" in conf
    assert "SelectTypeParameters=CR_Core" in conf and not (plain / "cgroup.conf").exists()


def test_cli_up_offers_the_cgroup_mode():
    out = CliRunner().invoke(cli, ["devcluster", "up", "--help"])
    assert out.exit_code == 0 and "--cgroups" in out.output and "proctrack/cgroup" in " ".join(out.output.split())


def _v1_available() -> str:
    if os.geteuid() != 0:
        return "making cgroups and mounts needs root"
    missing = [c for c in cgroups.CONTROLLERS if not (cgroups.CGROUP_ROOT / c / "cgroup.procs").exists()]
    return f"no cgroup v1 hierarchy for {', '.join(missing)} on this machine" if missing else ""


@pytest.mark.skipif(bool(_v1_available()), reason=_v1_available() or "-")
def test_a_node_slurmd_sees_its_subtree_as_the_whole_hierarchy_and_down_removes_it():
    """What _start_slurmd runs, with ``cat /proc/self/cgroup`` and a listing in place of slurmd."""
    name = f"u{os.getpid() % 100000}"
    dirs = cgroups.node_dirs(name, "node1")
    before = sorted(os.listdir(cgroups.CGROUP_ROOT))
    try:
        cgroups.make(dirs)
        probe = "sh -c 'cat /proc/self/cgroup; ls /sys/fs/cgroup'"
        out = subprocess.run(["unshare", "--mount", "--propagation", "slave", "--", "sh", "-c",
                              cgroups.slurmd_command(dirs, probe)],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        seen = {}
        for line in out.stdout.splitlines():
            if line.count(":") >= 2:
                _, names, path = line.split(":", 2)
                for n in names.split(","):
                    seen[n] = path
        # Inside its cgroup namespace the node's subtree is "/" in every controller Slurm uses.
        assert all(seen[c] == "/" for c in cgroups.CONTROLLERS), out.stdout
        assert set(cgroups.CONTROLLERS) <= set(out.stdout.split()), out.stdout  # its own mounts
        # Ours are untouched (the probe's mounts were in its own mount namespace).
        assert sorted(os.listdir(cgroups.CGROUP_ROOT)) == before
        assert all(d.is_dir() for d in dirs)
    finally:
        assert cgroups.remove(dirs) == []
    assert not any(d.exists() for d in dirs)
