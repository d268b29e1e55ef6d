"""A restored tree stays in its restorer's cgroup (the restore step's), not the one it was dumped from.

CRIU's default (--manage-cgroups=soft) moves a restored process back into the
cgroup path it was dumped from, making it if missing: on a cluster with
proctrack/cgroup and task/cgroup the restored rank would leave its restore
step for a cgroup Slurm neither tracks nor limits. torchpass.checkpoint.criu
dumps and restores with --manage-cgroups=ignore. Real CRIU, two sibling
cgroups (cgroup v2, or the v1 pids hierarchy on this machine).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from torchpass.checkpoint import criu

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="makes cgroups and restores with CRIU: needs root")


def _hierarchy() -> tuple[Path, str] | None:
    """A writable cgroup hierarchy and how /proc/PID/cgroup names it (v2 "0::", v1 "N:pids:")."""
    for root, tag in ((Path("/sys/fs/cgroup"), ""), (Path("/sys/fs/cgroup/pids"), "pids")):
        if (root / "cgroup.procs").exists() and os.access(root, os.W_OK) and \
                (tag or (root / "cgroup.controllers").exists()):
            return root, tag
    return None


def _cgroup_of(pid: int, tag: str) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _n, ctrl, path = line.split(":", 2)
        if ctrl == tag:
            return path
    raise AssertionError(f"pid {pid} has no {tag or 'v2'} cgroup")


RESTORE = """
import ctypes, sys
from torchpass.checkpoint import criu
open(sys.argv[1] + "/cgroup.procs", "w").write("0")  # the restorer (the restore step's agent) lives here
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: the restored root must be our child
pid, _s = criu.restore(criu.find_criu(), sys.argv[2])
print(pid)
"""


def test_the_restored_tree_lands_in_the_restorers_cgroup(tmp_path):
    found = _hierarchy()
    if found is None:
        pytest.skip("no writable cgroup hierarchy here (neither a cgroup v2 root nor a v1 pids one)")
    root, tag = found
    name = f"tpass-test-{uuid.uuid4().hex[:8]}"
    src, dst = root / f"{name}-src", root / f"{name}-dst"
    src.mkdir()
    dst.mkdir()
    restored = None
    sleeper = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, cwd=tmp_path,
                               preexec_fn=lambda: (os.setsid(), (src / "cgroup.procs").write_text("0")))
    try:
        assert _cgroup_of(sleeper.pid, tag) == f"/{src.name}"
        criu.dump(criu.find_criu(), sleeper.pid, tmp_path / "images")
        sleeper.kill()
        sleeper.wait()
        out = subprocess.run([sys.executable, "-c", RESTORE, str(dst), str(tmp_path / "images")],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        restored = int(out.stdout.split()[-1])
        # before: /<name>-src again (CRIU put it back where it was dumped from)
        assert _cgroup_of(restored, tag) == f"/{dst.name}"
    finally:
        for pid in (sleeper.pid, restored):
            if pid is not None:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
        sleeper.wait()
        deadline = time.monotonic() + 10
        for cg in (src, dst):
            while True:
                try:
                    cg.rmdir()
                    break
                except OSError:  # the killed processes leave it a moment later
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
