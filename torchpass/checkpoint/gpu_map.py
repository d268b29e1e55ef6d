"""Which GPUs a rank used on the source, which its restore step holds, and the pairs between them.

The CUDA checkpoint image names the source's GPUs by UUID; the restore remaps each onto the
GPU allocated to the restore step (``cuda.gpu_pair_table``: the n-th onto the n-th). Both
lists are read by root from the kernel and the driver, never from the rank's environment
(which the user controls, and which the restored process keeps from its source anyway):

* the source: the NVIDIA device files (``/dev/nvidiaN``, character major 195, minor N)
  that the processes holding GPU state map (``/proc/PID/maps``, the same reading that
  finds them, ``node_settings.maps_nvidia_device``);
* the target: the NVIDIA device minors that the restore step's devices cgroup allows
  (cgroup v1 ``devices.list``, which slurmstepd writes as root under
  ``ConstrainDevices=yes``); read from the task's cgroup as the kernel names it.

Local order is ascending minor on both sides. CUDA orders the devices it sees fastest
first, then by PCI bus id, and Slurm's GRES indices follow gres.conf's ``File=`` order
(``/dev/nvidia[0-7]``): on a node of identical GPUs all three agree with the minor
numbers, which the driver assigns in PCI bus order. Minor -> UUID comes from NVML
(``nvmlDeviceGetMinorNumber``, ``nvmlDeviceGetUUID``).

Under cgroup v2 Slurm confines devices with an eBPF program, which cannot be read back:
a GPU rank's restore step there is refused with one line (``target_gpu_minors``) rather
than restored onto GPUs root has not verified.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path

from torchpass.checkpoint.cgroup_join import _reach, cgroup_lines, cgroup_mounts
from torchpass.errors import CheckpointError, DependencyError

NVIDIA_MAJOR = 195
# /dev/nvidiactl is minor 255 and /dev/nvidia-modeset 254: control devices, not GPUs.
NVIDIA_CONTROL_MINORS = frozenset({254, 255})
_MAPPED = re.compile(r"\s/dev/nvidia(\d+)$")
_ALLOWED = re.compile(r"^([cab]) (\d+|\*):(\d+|\*) \S+$")

UuidsByMinor = Callable[[], dict[int, str]]


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


def target_gpu_minors(task: int, proc: str = "/proc", major: int = NVIDIA_MAJOR) -> list[int]:
    """The GPU minors the restore step's devices cgroup (the task's, as the kernel names it)
    allows; a CheckpointError (one line) when it cannot be read or confines nothing."""
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
    if minors is None:
        raise CheckpointError("the restore step's devices cgroup allows every GPU (ConstrainDevices is off): its "
                              "GPUs cannot be told apart, and a GPU rank is not restored onto unverified GPUs")
    return minors


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


__all__ = ["NVIDIA_MAJOR", "mapped_gpu_minors", "allowed_gpu_minors", "target_gpu_minors",
           "nvml_uuids_by_minor", "uuids_of"]
