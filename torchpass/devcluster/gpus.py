"""Fake GPUs as Slurm GRES (``DevclusterSpec(gpus=...)``, ``devcluster up --gpus 2`` or ``--gpus 2,2,2,1``).

Each node gets its GPUs the way a real GPU node does, minus the driver:

- Device files: character devices ``gpu0..gpuN-1`` (minors 0..N-1) of one major that no
  driver of this machine has registered (``unused_char_major``: the first of LANANA's
  local/experimental majors 120-127 absent from /proc/devices). They are made with mknod on a
  tmpfs of the node's own, mounted at ``RUN_DIR/dev`` inside the node's mount namespace: every
  node has its own set at the same path, as every GPU node has its own ``/dev/nvidia0``, and the
  host sees none of them. With no driver behind the major, opening one that the devices cgroup
  allows fails with ENXIO; one the cgroup denies fails with EPERM first.
- Slurm: ``GresTypes=gpu``, ``Gres=gpu:N`` on the node's line, a ``gres.conf`` line per node
  (``File=RUN_DIR/dev/gpu[0-N-1]``), and ``ConstrainDevices=yes`` under task/cgroup (cgroup v1;
  the devcluster's cgroup mode). slurmd reads each file's major and minor at start, slurmstepd
  writes ``devices.allow`` for a step's GPUs and ``devices.deny`` for the node's others, and
  the gres/gpu plugin sets ``CUDA_VISIBLE_DEVICES`` to the step's local GPU indices.
- NVML: the node's tpassd runs its fake provider with the node's count and these UUIDs
  (``fake_gpu_uuids`` in its tpassd.toml), and the node's GPU inventory (``inventory``: the
  major, each minor's file and UUID) says the same to the restore agent and the dump, which
  otherwise ask NVML for ``/dev/nvidiaN``.

Pure: values in, text out; cluster.py runs what these return.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from pathlib import Path

from torchpass.errors import DevclusterError

# LANANA's devices.txt reserves char majors 60-63, 120-127 and 240-254 for local/experimental
# use. The kernel hands out dynamic majors from 254 down (here: 245-254 are taken), so the
# fake GPUs take the lower block, which no driver gets without asking for it by number.
EXPERIMENTAL_MAJORS = tuple(range(120, 128))
MAX_GPUS_PER_NODE = 8
DEVICE_PREFIX = "gpu"
INVENTORY_NAME = "gpus.json"


def parse_gpus(text: str, nodes: int) -> tuple[int, ...]:
    """``--gpus 2`` (every node) or ``--gpus 2,2,2,1`` (one count per node) -> a count per node."""
    parts = [p.strip() for p in str(text).split(",")]
    if not all(p.isdigit() for p in parts):
        raise DevclusterError(f"--gpus {text!r} must be a count (2) or one count per node (2,2,2,1)")
    counts = [int(p) for p in parts]
    if len(counts) == 1:
        counts *= nodes
    if len(counts) != nodes:
        raise DevclusterError(f"--gpus {text!r} gives {len(counts)} counts for {nodes} nodes; "
                              "give one count, or one per node")
    return tuple(counts)


def check_counts(gpus: tuple[int, ...], nodes: int) -> None:
    if gpus and len(gpus) != nodes:
        raise DevclusterError(f"{len(gpus)} GPU counts for {nodes} nodes; give one per node")
    if any(not 0 <= g <= MAX_GPUS_PER_NODE for g in gpus):
        raise DevclusterError(f"GPU counts {gpus} must be 0..{MAX_GPUS_PER_NODE} per node")


def unused_char_major(proc_devices: str) -> int:
    """The first local/experimental character major that /proc/devices does not list."""
    used: set[int] = set()
    section = ""
    for line in proc_devices.splitlines():
        if line.endswith(":"):
            section = line
            continue
        m = re.match(r"^\s*(\d+)\s", line)
        if m and section.startswith("Character"):
            used.add(int(m.group(1)))
    for major in EXPERIMENTAL_MAJORS:
        if major not in used:
            return major
    raise DevclusterError(f"every local/experimental character major {EXPERIMENTAL_MAJORS[0]}-"
                          f"{EXPERIMENTAL_MAJORS[-1]} is registered on this machine (/proc/devices): "
                          "no major is free for fake GPUs")


def fake_uuid(cluster: str, node: str, index: int) -> str:
    """A GPU UUID as NVML prints it ("GPU-" and 32 hex digits, 8-4-4-4-12), one per cluster, node
    and index: the same on every bring-up, different across nodes (a move changes UUIDs)."""
    h = hashlib.sha256(f"torchpass-devcluster/{cluster}/{node}/{index}".encode()).hexdigest()[:32]
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def device_path(dev_dir: Path, index: int) -> Path:
    return Path(dev_dir) / f"{DEVICE_PREFIX}{index}"


def inventory(cluster: str, node: str, count: int, major: int, dev_dir: Path) -> dict:
    """The node's GPUs as the restore agent and the dump read them (gpu_map.GpuInventory)."""
    return {"major": major, "gpus": [{"minor": i, "uuid": fake_uuid(cluster, node, i),
                                      "path": str(device_path(dev_dir, i))} for i in range(count)]}


def node_dev_commands(count: int, major: int, dev_dir: Path, inventory_text: str) -> list[str]:
    """Shell commands, run in the node's fresh mount namespace before slurmd starts, that mount
    the node's own tmpfs at ``dev_dir`` and make its GPU device files and inventory there.
    mode 0666, as the NVIDIA driver makes /dev/nvidiaN: only the devices cgroup confines them."""
    d = shlex.quote(str(dev_dir))
    cmds = [f"mount -t tmpfs -o mode=755,size=64k tp-gpudev {d}"]
    cmds += [f"mknod -m 666 {shlex.quote(str(device_path(dev_dir, i)))} c {major} {i}" for i in range(count)]
    cmds.append(f"printf %s {shlex.quote(inventory_text)} > {shlex.quote(str(Path(dev_dir) / INVENTORY_NAME))}")
    return cmds


def gres_conf(nodes: list[str], gpus: tuple[int, ...], dev_dir: Path) -> str:
    """gres.conf (beside slurm.conf): a line per node with GPUs."""
    lines = ["# Generated by torchpass devcluster (fake GPUs, torchpass/devcluster/gpus.py)."]
    for node, count in zip(nodes, gpus, strict=True):
        if count:
            files = f"{device_path(dev_dir, 0)}" if count == 1 else f"{Path(dev_dir) / DEVICE_PREFIX}[0-{count - 1}]"
            lines.append(f"NodeName={node} Name=gpu File={files}")
    return "\n".join(lines) + "\n"


def inventory_json(inv: dict) -> str:
    return json.dumps(inv, sort_keys=True)


__all__ = ["parse_gpus", "check_counts", "unused_char_major", "fake_uuid", "inventory", "node_dev_commands",
           "gres_conf", "inventory_json", "EXPERIMENTAL_MAJORS"]
