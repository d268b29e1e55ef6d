"""Two devclusters on one machine: slurmctld's port and the job-id block come from the whole
subnet, and ``up`` refuses a cluster that would share either with one already recorded."""

from __future__ import annotations

import json

from torchpass.devcluster.cluster import CTLD_PORT_SLOTS, DevclusterSpec, cluster_conflicts


def test_clusters_of_one_second_octet_get_different_ports_and_job_ids():
    specs = [DevclusterSpec(name=f"w{y}", subnet=f"10.78.{y}") for y in range(16)]
    specs += [DevclusterSpec(name="demo", subnet="10.77.0")]
    assert len({s.ctld_port for s in specs}) == len(specs)
    assert len({s.first_job_id for s in specs}) == len(specs)


def test_every_port_lies_below_the_ephemeral_range_and_every_job_id_below_slurms_max():
    for x in (0, 77, 78, 255):
        for y in (0, 1, 255):
            spec = DevclusterSpec(subnet=f"10.{x}.{y}")
            assert 7000 <= spec.ctld_port < 32768
            assert 1 <= spec.first_job_id and spec.first_job_id + 10000 <= 67_043_328


def _record(base, name, subnet):
    (base / name).mkdir()
    (base / name / "cluster.json").write_text(json.dumps({"spec": {"name": name, "subnet": subnet}}))


def test_up_refuses_a_subnet_whose_port_another_cluster_holds(tmp_path):
    _record(tmp_path, "t", "10.78.0")
    clash = f"10.{(78 * 256 + CTLD_PORT_SLOTS) // 256}.{(78 * 256 + CTLD_PORT_SLOTS) % 256}"
    mine = DevclusterSpec(name="u", subnet=clash, base_dir=tmp_path)
    assert mine.ctld_port == DevclusterSpec(subnet="10.78.0").ctld_port
    [line] = cluster_conflicts(mine)
    assert "'t' (10.78.0)" in line and f"slurmctld port {mine.ctld_port}" in line
    assert cluster_conflicts(DevclusterSpec(name="u", subnet="10.78.1", base_dir=tmp_path)) == []
    assert "subnet" in cluster_conflicts(DevclusterSpec(name="u", subnet="10.78.0", base_dir=tmp_path))[0]
    # Its own record (a leftover of the same name, torn down first) is no conflict.
    assert cluster_conflicts(DevclusterSpec(name="t", subnet="10.78.0", base_dir=tmp_path)) == []
