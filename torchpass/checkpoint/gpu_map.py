"""Which GPUs a rank used on the source, which its restore step holds, and the pairs between them.

The CUDA checkpoint image names the source's GPUs by UUID; the restore remaps each onto the
GPU allocated to the restore step (``cuda.gpu_pair_table``: the n-th onto the n-th). Both
lists are read by root from the kernel and the driver, never from the rank's environment
(which the user controls, and which the restored process keeps from its source anyway):

* the source: the NVIDIA device files (``/dev/nvidiaN``, character major 195, minor N)
  that the processes holding GPU state map (``/proc/PID/maps``, the same reading that
  finds them, ``node_settings.maps_nvidia_device``). A rank that holds no GPU state (gloo
  on a GPU allocation) maps none: its GPUs are those its task's devices cgroup lets it open
  (``allowed_in_cgroup_of``), recorded all the same, so that the move still pairs them, still
  refuses a restore step with fewer, and the event still shows the table;
* the target: the GPUs the restore step's devices cgroup allows (``target_gpu_minors``),
  which slurmstepd writes as root under ``ConstrainDevices=yes``.

A node's GPUs (``GpuInventory``: the device files' major, each minor's file and UUID) come
from NVML (``nvml_inventory``: major 195, ``/dev/nvidiaN``, ``nvmlDeviceGetMinorNumber``,
``nvmlDeviceGetUUID``), or from an inventory file that root names (``file_inventory``: the
devcluster's fake GPUs, plugstack.conf ``gpu_inventory=``, tpassd.toml ``gpu_inventory``).

Reading a cgroup v1 devices cgroup: Slurm (24.11, measured on the devcluster) writes
``devices.allow`` for the step's GPUs and ``devices.deny`` for the node's others under the
default-allow rule the cgroup inherits, and the kernel lists exceptions only under a
default-deny rule: ``devices.list`` reads ``a *:* rwm`` and names no GPU. So the GPUs are found
by asking the kernel from inside that cgroup: ``access(2)`` on each GPU's device file runs the
devices cgroup's check (EPERM when denied) without opening the device (no driver call). A
``devices.list`` that is a whitelist (a site's default-deny setup) is read as it is.

Local order is ascending minor on both sides. CUDA orders the devices it sees fastest
first, then by PCI bus id, and Slurm's GRES indices follow gres.conf's ``File=`` order
(``/dev/nvidia[0-7]``): on a node of identical GPUs all three agree with the minor
numbers, which the driver assigns in PCI bus order.

Under cgroup v2 Slurm confines devices with an eBPF program, which cannot be read back:
a GPU rank's restore step there is refused with one line (``target_gpu_minors``) rather
than restored onto GPUs root has not verified.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from torchpass.checkpoint import safeio
from torchpass.checkpoint.cgroup_join import _reach, cgroup_lines, cgroup_mounts
from torchpass.errors import CheckpointError, DependencyError

NVIDIA_MAJOR = 195
# /dev/nvidiactl is minor 255 and /dev/nvidia-modeset 254: control devices, not GPUs.
NVIDIA_CONTROL_MINORS = frozenset({254, 255})
_MAPPED = re.compile(r"\s/dev/nvidia(\d+)$")
_ALLOWED = re.compile(r"^([cab]) (\d+|\*):(\d+|\*) \S+$")

UuidsByMinor = Callable[[], dict[int, str]]
# An inventory file is a few hundred bytes per GPU.
_INVENTORY_CAP = 1 << 16


@dataclass(frozen=True)
class GpuInventory:
    """A node's GPUs: their device files' character major, and per minor its UUID and file."""

    major: int
    uuids: dict[int, str]
    paths: dict[int, str]


def nvml_inventory() -> GpuInventory:
    """The node's NVIDIA GPUs: major 195, ``/dev/nvidiaN``, UUIDs from NVML."""
    by_minor = nvml_uuids_by_minor()
    return GpuInventory(NVIDIA_MAJOR, by_minor, {m: f"/dev/nvidia{m}" for m in by_minor})


def file_inventory(path: str | os.PathLike) -> GpuInventory:
    """The GPUs an inventory file names (JSON: ``{"major": M, "gpus": [{"minor", "uuid", "path"}]}``);
    root's file alone (a user who could write it would choose root's pairs). One-line
    CheckpointError when it is missing, not root's or malformed."""
    try:
        raw = safeio.read_regular(path, _INVENTORY_CAP, owner=0)
        data = json.loads(raw)
        inv = GpuInventory(int(data["major"]), {int(g["minor"]): str(g["uuid"]) for g in data["gpus"]},
                           {int(g["minor"]): str(g["path"]) for g in data["gpus"]})
    except OSError as exc:
        raise CheckpointError(f"cannot read the GPU inventory {path} ({exc.strerror or exc})") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"the GPU inventory {path} is malformed ({exc!r})") from None
    if not all(os.path.isabs(p) for p in inv.paths.values()):
        raise CheckpointError(f"the GPU inventory {path} names a device file by a relative path")
    return inv


def inventory_loader(path: str | os.PathLike | None) -> Callable[[], GpuInventory]:
    """The node's inventory: the file ``path`` names, or NVML's when there is none."""
    return (lambda: file_inventory(path)) if path else nvml_inventory


def accessible_gpu_minors(inv: GpuInventory) -> list[int]:
    """The minors of ``inv`` that this process's devices cgroup lets it open, ascending. Each
    file is checked to be the character device of its minor (a file that is not is left out),
    then ``access(R_OK|W_OK)``: the devices cgroup answers EPERM for a denied device; the device
    itself is never opened."""
    return [m for m, p in sorted(inv.paths.items()) if _is_device(p, inv.major, m) and os.access(p, os.R_OK | os.W_OK)]


# The probe that allowed_in_cgroup_of runs: it joins the cgroup it is given, then answers which
# of the files it is given it may open and write (access(2), as accessible_gpu_minors).
_PROBE = """
import json, os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
os.write(fd, str(os.getpid()).encode()); os.close(fd)
print(json.dumps([os.access(p, os.R_OK | os.W_OK) for p in sys.argv[2:]]))
"""


def allowed_in_cgroup_of(pid: int, inv: GpuInventory, proc: str = "/proc") -> list[int]:
    """The minors of ``inv`` that ``pid``'s devices cgroup lets it open, asked from inside that
    cgroup by a short-lived process of ours (``access(2)``, as ``accessible_gpu_minors``): the
    reading of a rank that maps no GPU. A one-line CheckpointError when it cannot be asked."""
    path = cgroup_lines(pid, proc).get("devices")
    reach = None if path is None or "/.." in path + "/" else _reach(path, frozenset({"devices"}),
                                                                     cgroup_mounts(proc))
    if reach is None:
        raise CheckpointError(f"process {pid} has no devices cgroup this node mounts (cgroup v2, or no "
                              "ConstrainDevices): its GPUs cannot be read")
    minors = [m for m, p in sorted(inv.paths.items()) if _is_device(p, inv.major, m)]
    if not minors:
        return []
    try:
        res = subprocess.run([sys.executable, "-I", "-S", "-c", _PROBE, str(Path(reach[0] + reach[1]) / "cgroup.procs"),
                              *(inv.paths[m] for m in minors)], capture_output=True, text=True, timeout=10)
        answers = json.loads(res.stdout) if res.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        answers = None
    if not isinstance(answers, list) or len(answers) != len(minors):
        raise CheckpointError(f"cannot ask process {pid}'s devices cgroup which GPUs it allows")
    return [m for m, ok in zip(minors, answers, strict=True) if ok is True]


def _is_device(path: str, major: int, minor: int) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (major, minor)


def mapped_gpu_minors(pids: Iterable[int], proc: str = "/proc") -> list[int]:
    """The minors of the GPU device files that any of ``pids`` maps, ascending."""
    found: set[int] = set()
    for pid in pids:
        try:
            with open(f"{proc}/{pid}/maps") as f:
                for line in f:
                    if m := _MAPPED.search(line.rstrip("\n")):
                        found.add(int(m.group(1)))
        except OSError as exc:
            raise CheckpointError(f"cannot read the GPU devices process {pid} maps ({exc.strerror})") from None
    return sorted(found - NVIDIA_CONTROL_MINORS)


def allowed_gpu_minors(devices_list: str, major: int = NVIDIA_MAJOR) -> list[int] | None:
    """The GPU minors a cgroup v1 ``devices.list`` allows, ascending; None when it allows every
    device of the major (``a *:* rwm``, ``c 195:* rw``: no confinement, nothing to verify)."""
    out: set[int] = set()
    for line in devices_list.splitlines():
        m = _ALLOWED.match(line.strip())
        if not m:
            continue
        kind, maj, minor = m.groups()
        if kind == "a" or (kind == "c" and maj in ("*", str(major)) and minor == "*"):
            return None
        if kind == "c" and maj == str(major) and int(minor) not in NVIDIA_CONTROL_MINORS:
            out.add(int(minor))
    return sorted(out)


def target_gpu_minors(task: int, proc: str = "/proc", major: int = NVIDIA_MAJOR,
                      inv: GpuInventory | None = None) -> list[int]:
    """The GPU minors the restore step's devices cgroup (the task's, as the kernel names it)
    allows; a CheckpointError (one line) when it cannot be read or confines nothing.

    A ``devices.list`` that reads ``a *:* rwm`` (Slurm's deny exceptions, unlisted) is asked
    from inside: this process must be in the task's devices cgroup (the restore agent joined
    it), and ``inv`` names the node's GPUs. Every GPU of the node allowed, when the node has
    more than one: ConstrainDevices is off, or the step holds them all; the caller tells."""
    major = inv.major if inv is not None else major
    path = cgroup_lines(task, proc).get("devices")
    reach = None if path is None or "/.." in path + "/" else _reach(path, frozenset({"devices"}),
                                                                     cgroup_mounts(proc))
    if reach is None:
        raise CheckpointError("the restore step has no devices cgroup this node mounts (cgroup v2, or no "
                              "ConstrainDevices): its GPUs cannot be verified, and a GPU rank is not restored "
                              "onto GPUs root has not verified")
    try:
        text = (Path(reach[0] + reach[1]) / "devices.list").read_text()
    except OSError as exc:
        raise CheckpointError(f"cannot read the restore step's devices cgroup ({exc.strerror})") from None
    minors = allowed_gpu_minors(text, major)
    if minors is not None:
        return minors
    if inv is None or cgroup_lines("self", proc).get("devices") != path:
        raise CheckpointError("the restore step's devices cgroup allows every GPU (ConstrainDevices is off): its "
                              "GPUs cannot be told apart, and a GPU rank is not restored onto unverified GPUs")
    return accessible_gpu_minors(inv)


def nvml_uuids_by_minor() -> dict[int, str]:
    """Every GPU's device minor -> UUID, from NVML (the NVIDIA driver's library)."""
    try:
        import pynvml  # the nvidia-ml-py package: installed where GPU jobs run
    except ImportError:
        raise DependencyError("pynvml (nvidia-ml-py) is not installed: the GPUs' UUIDs cannot be read") from None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - pynvml's NVMLError subclasses; one line
        raise DependencyError(f"NVML did not start ({exc}): the GPUs' UUIDs cannot be read") from None
    try:
        out = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            u = pynvml.nvmlDeviceGetUUID(h)
            out[int(pynvml.nvmlDeviceGetMinorNumber(h))] = u.decode() if isinstance(u, bytes) else str(u)
        return out
    finally:
        pynvml.nvmlShutdown()


def uuids_of(minors: list[int], by_minor: dict[int, str]) -> list[str]:
    """The UUIDs of ``minors``, in their order; a one-line CheckpointError for a minor NVML does not know."""
    unknown = [m for m in minors if m not in by_minor]
    if unknown:
        raise CheckpointError(f"NVML knows no GPU with device minor {', '.join(map(str, unknown))} "
                              f"(/dev/nvidia{unknown[0]})")
    return [by_minor[m] for m in minors]


__all__ = ["NVIDIA_MAJOR", "GpuInventory", "mapped_gpu_minors", "allowed_gpu_minors", "target_gpu_minors",
           "nvml_uuids_by_minor", "nvml_inventory", "file_inventory", "inventory_loader", "accessible_gpu_minors",
           "allowed_in_cgroup_of", "uuids_of"]
