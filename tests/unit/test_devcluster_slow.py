"""`devcluster slow`'s CPU quota, against cgroup trees under tmp_path (v2 cpu.max, v1 cfs quota)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from torchpass.devcluster import cpu_quota
from torchpass.errors import DevclusterError
from tpassctl.cli import cli as main


def v1_tree(root):
    (root / "cpu").mkdir(parents=True)
    (root / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    return root


def v2_tree(root):
    (root / "unified").mkdir(parents=True)
    (root / "unified" / "cgroup.controllers").write_text("cpu io memory\n")
    (root / "unified" / "cgroup.subtree_control").write_text("")
    return root


def test_v2_is_preferred_and_gets_cpu_max(tmp_path):
    root = v2_tree(v1_tree(tmp_path))
    h = cpu_quota.find_hierarchy(root)
    assert h == cpu_quota.CpuHierarchy(root / "unified", 2)
    group = cpu_quota.slow(h, "ci", "node2", [], 25)
    assert group == root / "unified" / "tp-ci-slow-node2"
    assert (group / "cpu.max").read_text() == "5000 20000"
    assert (root / "unified" / "cgroup.subtree_control").read_text() == "+cpu"
    cpu_quota.slow(h, "ci", "node2", [], 100)
    assert (group / "cpu.max").read_text() == "max 20000"


def test_v1_gets_a_cfs_quota_and_every_pid(tmp_path):
    h = cpu_quota.find_hierarchy(v1_tree(tmp_path))
    assert h.version == 1
    group = cpu_quota.slow(h, "ci", "node3", [101, 102], 2)
    assert (group / "cpu.cfs_period_us").read_text() == "20000"
    assert (group / "cpu.cfs_quota_us").read_text() == "1000"  # the kernel's least: 1 ms
    # a plain file stands in for cgroup.procs here: the last pid written is what it holds
    assert (group / "cgroup.procs").read_text() == "102"
    assert cpu_quota.group_name("ci", "node3") == group.name


def test_no_cpu_controller_is_an_error(tmp_path):
    with pytest.raises(DevclusterError, match="no cpu controller"):
        cpu_quota.find_hierarchy(tmp_path)


def test_the_cpu_option_is_checked():
    r = CliRunner().invoke(main, ["devcluster", "slow", "node2", "--cpu", "0", "--name", "nosuch"])
    assert r.exit_code == 2 and "not a percentage" in r.output
    r = CliRunner().invoke(main, ["devcluster", "slow", "node2", "--cpu", "50", "--for", "-1"])
    assert r.exit_code == 2
