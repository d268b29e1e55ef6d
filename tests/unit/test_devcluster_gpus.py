"""The devcluster's fake GPUs as Slurm GRES (torchpass/devcluster/gpus.py): the counts, the major,
the UUIDs, the device files, and the Slurm and tpassd configuration that names them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from test_devcluster_cgroups import _configured
from torchpass.devcluster import DevclusterSpec, gpus
from torchpass.devcluster.tpassd_node import start_args
from torchpass.errors import DevclusterError
from tpassctl.cli import cli
from tpassd.config import load_config
from tpassd.nvml_provider import FakeNvmlProvider

PROC_DEVICES = """Character devices:
  1 mem
120 taken
121 taken-too
195 nvidia
254 ndctl

Block devices:
  7 loop
122 blk
"""


def test_one_count_for_every_node_or_one_per_node():
    assert gpus.parse_gpus("2", 4) == (2, 2, 2, 2)
    assert gpus.parse_gpus("2,2,2,1", 4) == (2, 2, 2, 1)
    for bad in ("2,2", "two", "2,-1,2,2", ""):
        with pytest.raises(DevclusterError):
            gpus.parse_gpus(bad, 4)


def test_the_major_is_the_first_experimental_one_no_driver_registered_as_a_char_device():
    assert gpus.unused_char_major(PROC_DEVICES) == 122  # 122 is a block major only
    full = "Character devices:\n" + "".join(f"{m} x\n" for m in gpus.EXPERIMENTAL_MAJORS)
    with pytest.raises(DevclusterError, match="no major is free"):
        gpus.unused_char_major(full)


def test_uuids_are_nvml_shaped_stable_and_differ_across_nodes():
    from torchpass.checkpoint.cuda import uuid_bytes

    a = gpus.fake_uuid("c", "node1", 0)
    assert a == gpus.fake_uuid("c", "node1", 0)
    others = (gpus.fake_uuid("c", "node4", 0), gpus.fake_uuid("c", "node1", 1), gpus.fake_uuid("d", "node1", 0))
    assert len({a, *others}) == 4
    assert len(uuid_bytes(a)) == 16  # what the CUDA restore's gpuPairs takes


def test_gpus_need_the_cgroup_mode_and_one_count_per_node():
    with pytest.raises(DevclusterError, match="--cgroups"):
        DevclusterSpec(name="u", nodes=2, gpus=(1, 1)).validate()
    with pytest.raises(DevclusterError, match="one per node"):
        DevclusterSpec(name="u", nodes=2, gpus=(1,), cgroups=True).validate()
    DevclusterSpec(name="u", nodes=2, gpus=(1, 0), cgroups=True).validate()


def test_slurm_gets_gres_types_a_gres_per_node_gres_conf_files_and_constrain_devices(tmp_path):
    etc = _configured(tmp_path / "a", nodes=4, cgroups=True, gpus=(2, 2, 2, 1))
    conf = (etc / "slurm.conf").read_text().splitlines()
    assert "GresTypes=gpu" in conf
    node_lines = [line for line in conf if line.startswith("NodeName=")]
    assert [line.split()[0] for line in node_lines] == ["NodeName=node1", "NodeName=node2", "NodeName=node3",
                                                        "NodeName=node4"]
    assert [line.split("Gres=")[1].split()[0] for line in node_lines] == ["gpu:2", "gpu:2", "gpu:2", "gpu:1"]
    dev = tmp_path / "a" / "u" / "dev"
    assert (etc / "gres.conf").read_text().splitlines()[1:] == [
        f"NodeName=node{i} Name=gpu File={dev}/gpu[0-1]" for i in (1, 2, 3)] + [
        f"NodeName=node4 Name=gpu File={dev}/gpu0"]
    assert "ConstrainDevices=yes" in (etc / "cgroup.conf").read_text().splitlines()
    plain = _configured(tmp_path / "b", nodes=4, cgroups=True)
    assert "GresTypes=gpu" not in (plain / "slurm.conf").read_text()
    assert not (plain / "gres.conf").exists() and "ConstrainDevices" not in (plain / "cgroup.conf").read_text()


def test_a_nodes_device_files_are_char_devices_of_the_major_on_its_own_tmpfs(tmp_path):
    inv = gpus.inventory("c", "node2", 2, 123, tmp_path / "dev")
    cmds = gpus.node_dev_commands(2, 123, tmp_path / "dev", gpus.inventory_json(inv))
    assert cmds[0].startswith("mount -t tmpfs") and cmds[0].endswith(str(tmp_path / "dev"))
    assert cmds[1:3] == [f"mknod -m 666 {tmp_path}/dev/gpu0 c 123 0", f"mknod -m 666 {tmp_path}/dev/gpu1 c 123 1"]
    # the inventory is written as given (the shell quoting survives a real shell)
    (tmp_path / "dev").mkdir()
    subprocess.run(["sh", "-c", cmds[-1]], check=True)
    assert (tmp_path / "dev" / "gpus.json").read_text() == gpus.inventory_json(inv)
    assert [g["uuid"] for g in inv["gpus"]] == [gpus.fake_uuid("c", "node2", i) for i in range(2)]


def test_the_nodes_tpassd_reports_the_same_gpus_as_its_inventory(tmp_path, monkeypatch):
    uuids = tuple(gpus.fake_uuid("c", "node4", i) for i in range(2))
    monkeypatch.setattr("torchpass.devcluster.tpassd_node.tpassd_program", lambda: "/bin/true")
    argv = start_args("node4", "10.0.0.14", tmp_path, tmp_path / "munge.sock", fake_gpu_uuids=uuids)
    cfg = load_config(Path(argv[argv.index("--config") + 1]), environ={})
    assert cfg.fake_gpus == 2 and cfg.fake_gpu_uuids == uuids
    fake = FakeNvmlProvider(cfg.fake_gpus, uuids=cfg.fake_gpu_uuids)
    fake.init()
    assert [fake.uuid(i) for i in range(fake.device_count())] == list(uuids)


def test_cli_up_offers_gpus():
    out = CliRunner().invoke(cli, ["devcluster", "up", "--help"])
    assert out.exit_code == 0 and "--gpus" in out.output
    bad = CliRunner().invoke(cli, ["devcluster", "up", "--nodes", "4", "--gpus", "2,2"])
    assert bad.exit_code == 2 and "one per node" in bad.output
