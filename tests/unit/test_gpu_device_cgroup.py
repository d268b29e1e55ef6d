"""Which GPUs a devices cgroup lets its processes open, asked of the kernel: this machine's cgroup
v1 devices hierarchy and character devices of a major no driver has (gpu_map). What Slurm
24.11 does under ConstrainDevices is done here by hand: a cgroup under the default-allow rule
with a ``devices.deny`` for one GPU, which its ``devices.list`` does not show."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchpass.checkpoint import gpu_map
from torchpass.devcluster import gpus

DEVICES = Path("/sys/fs/cgroup/devices")


def _why_not() -> str:
    if os.geteuid() != 0:
        return "mknod and cgroups need root"
    if not (DEVICES / "cgroup.procs").exists():
        return "no cgroup v1 devices hierarchy on this machine"
    return ""


pytestmark = pytest.mark.skipif(bool(_why_not()), reason=_why_not() or "-")


@pytest.fixture
def step(tmp_path):
    """A devices cgroup that allows fake GPU 1 and denies GPU 0 (Slurm's writes), with a sleeping
    process in it; the inventory of the two fake GPUs."""
    major = gpus.unused_char_major(Path("/proc/devices").read_text())
    dev = tmp_path / "dev"
    dev.mkdir()
    for m in (0, 1):
        os.mknod(dev / f"gpu{m}", 0o20666, os.makedev(major, m))
    own = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
               if "devices" in line.split(":")[1].split(","))
    cg = DEVICES / own.lstrip("/") / f"tp-test-gpu-{os.getpid()}"
    cg.mkdir()
    (cg / "devices.allow").write_text(f"c {major}:1 rwm")
    (cg / "devices.deny").write_text(f"c {major}:0 rwm")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (cg / "cgroup.procs").write_text(str(proc.pid))
        inv = gpu_map.GpuInventory(major, {0: "GPU-a", 1: "GPU-b"}, {m: str(dev / f"gpu{m}") for m in (0, 1)})
        yield cg, proc, inv
    finally:
        proc.kill()
        proc.wait()
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_the_cgroup_is_asked_from_inside_because_its_devices_list_names_no_gpu(step):
    cg, proc, inv = step
    assert (cg / "devices.list").read_text().split("\n")[0] == "a *:* rwm"  # the deny is not listed
    assert gpu_map.allowed_gpu_minors((cg / "devices.list").read_text(), inv.major) is None
    assert gpu_map.allowed_in_cgroup_of(proc.pid, inv) == [1]
    assert gpu_map.accessible_gpu_minors(inv) == [0, 1]  # this process is not in that cgroup


def test_a_process_in_the_cgroup_gets_enxio_on_its_gpu_and_eperm_on_the_other(step):
    cg, _proc, inv = step
    probe = ("import os, sys\n"
             "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
             "for p in sys.argv[2:]:\n"
             "    try:\n"
             "        os.close(os.open(p, os.O_RDWR)); print('opened')\n"
             "    except OSError as e: print(e.errno)\n")
    out = subprocess.run([sys.executable, "-c", probe, str(cg / "cgroup.procs"), inv.paths[0], inv.paths[1]],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(errno.EPERM), str(errno.ENXIO)]
