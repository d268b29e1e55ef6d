"""How the devcluster starts a real tpassd on each node: fake NVML (8 GPUs,
drills on) and a fixture InfiniBand tree (4 ports), bound to the node's
address on the default ports, authenticated with the cluster's munged."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from tpassd.config import DEFAULT_CONTROL_PORT, DEFAULT_METRICS_PORT, DEFAULT_PUB_PORT
from tpassd.drills import write_fixture_tree


def _toml_str(v: object) -> str:
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def start_args(node_name: str, address: str, node_dir: Path, munge_socket: Path,
               interval_s: float = 1.0) -> list[str]:
    """Write the node's config, policy and fixture tree under ``node_dir``; return tpassd's argv.

    The fixture tree is rebuilt on every start (as a fresh fake GPU set is),
    so a restarted tpassd begins healthy.
    """
    node_dir = Path(node_dir)
    node_dir.mkdir(parents=True, exist_ok=True)
    sysfs = node_dir / "sys"
    if sysfs.exists():
        shutil.rmtree(sysfs)
    write_fixture_tree(sysfs)
    for d in ("state", "snapshots"):
        (node_dir / d).mkdir(exist_ok=True)
    policy = node_dir / "policy.toml"
    # The devcluster shares one disk among many nodes: a small free-space floor.
    policy.write_text("[host]\ndisk_free_gb_degraded = 1.0\n")
    cfg = node_dir / "tpassd.toml"
    cfg.write_text("\n".join([
        f"node_name = {_toml_str(node_name)}",
        f"bind_address = {_toml_str(address)}",
        f"pub_port = {DEFAULT_PUB_PORT}",
        f"control_port = {DEFAULT_CONTROL_PORT}",
        f"metrics_port = {DEFAULT_METRICS_PORT}",
        f"interval_s = {float(interval_s)}",
        'nvml_provider = "fake"',
        "fake_gpus = 8",
        "fake_nvlinks = 4",
        f"sysfs_root = {_toml_str(sysfs)}",
        "ib_expected_ports = 4",
        f"state_dir = {_toml_str(node_dir / 'state')}",
        f"snapshot_dir = {_toml_str(node_dir / 'snapshots')}",
        f"policy = {_toml_str(policy)}",
        f"munge_socket = {_toml_str(munge_socket)}",
        "drills = true",
        f"ports_file = {_toml_str(node_dir / 'ports.json')}",
        'log_level = "info"',
        "",
    ]))
    return [sys.executable, "-m", "tpassd.main", "--config", str(cfg)]
