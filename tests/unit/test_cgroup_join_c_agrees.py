"""The cgroup join's twins agree: tpass-init's (slurm_spank/cgroup_join.c) and the restore agent's
(torchpass.checkpoint.cgroup_join) run on the same /proc (a fixture tree: the task's and our
cgroups, the mounts) and must join the same cgroup.procs files. Where Python refuses (a cgroup no
mount reaches) C leaves the cgroup alone: tpass-init is best effort, the agent is not."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from test_cgroup_join import _fake
from torchpass.checkpoint.cgroup_join import join_cgroups_of
from torchpass.errors import CheckpointError

SPANK_DIR = Path(__file__).resolve().parents[2] / "slurm_spank"


@pytest.fixture(scope="module")
def probe() -> Path:
    subprocess.run(["make", "-s", "-C", str(SPANK_DIR), "cgroup_join_probe"], check=True, timeout=120,
                   capture_output=True)
    return SPANK_DIR / "cgroup_join_probe"


def _procs_files(root: Path) -> list[Path]:
    return sorted(root.rglob("cgroup.procs"))


def _written(root: Path) -> set[str]:
    """The cgroup.procs files someone wrote a pid into; emptied again for the next twin."""
    out = set()
    for f in _procs_files(root):
        if f.read_text():
            out.add(str(f.relative_to(root)))
            f.write_text("")
    return out


def both(probe: Path, proc: str, root: Path) -> tuple[set[str] | str, set[str]]:
    """What the Python twin joined (or its refusal), then what the C twin joined."""
    try:
        join_cgroups_of(77, proc=proc)
        py: set[str] | str = _written(root)
    except CheckpointError as exc:
        _written(root)
        py = f"refused: {exc}"
    out = subprocess.run([str(probe), proc, "77"], capture_output=True, text=True, timeout=30, check=True)
    c = _written(root)
    assert int(out.stdout) == len(c)
    return py, c


def _dirs(root: Path, *dirs: str) -> None:
    for d in dirs:
        (root / d).mkdir(parents=True, exist_ok=True)
        (root / d / "cgroup.procs").write_text("")


def test_both_join_where_the_cgroups_differ_and_only_there(tmp_path, probe):
    task = "6:freezer:/slurm_n/uid_1/job_5/step_1\n3:cpu,cpuacct:/\n4:memory:/outer/job_5/step_1/task_0\n0::/t\n"
    ours = "6:freezer:/slurm_n/uid_1/job_5\n3:cpu,cpuacct:/\n4:memory:/outer/job_5/step_1\n0::/x\n"
    proc, root = _fake(tmp_path, task, ours)
    _dirs(root, "freezer/slurm_n/uid_1/job_5/step_1", "memory/job_5/step_1/task_0", "cpu,cpuacct", "unified/t")
    py, c = both(probe, proc, root)
    assert py == c == {"freezer/slurm_n/uid_1/job_5/step_1/cgroup.procs",
                       "memory/job_5/step_1/task_0/cgroup.procs", "unified/t/cgroup.procs"}


def test_both_take_the_last_mount_of_a_hierarchy(tmp_path, probe):
    proc, root = _fake(tmp_path, "6:freezer:/slurm_n/job_5/step_1\n", "6:freezer:/slurm_n/job_5\n")
    (Path(proc) / "self" / "mountinfo").write_text(
        f"30 25 0:27 / {root}/first rw - cgroup cgroup rw,freezer\n"
        f"31 25 0:27 /.. {root}/hidden rw - cgroup cgroup rw,freezer\n"
        f"74 73 0:27 / {root}/freezer rw - cgroup cgroup rw,freezer\n")
    _dirs(root, "first/slurm_n/job_5/step_1", "freezer/slurm_n/job_5/step_1")
    py, c = both(probe, proc, root)
    assert py == c == {"freezer/slurm_n/job_5/step_1/cgroup.procs"}


def test_both_leave_a_hierarchy_that_is_not_mounted(tmp_path, probe):
    proc, root = _fake(tmp_path, "7:blkio:/job_5/step_1\n6:freezer:/job_5/step_1\n",
                       "7:blkio:/job_5\n6:freezer:/job_5\n")
    _dirs(root, "freezer/job_5/step_1", "blkio/job_5/step_1")
    py, c = both(probe, proc, root)
    assert py == c == {"freezer/job_5/step_1/cgroup.procs"}


def test_a_cgroup_no_mount_reaches_is_refused_by_python_and_left_alone_by_c(tmp_path, probe):
    proc, root = _fake(tmp_path, "4:memory:/elsewhere/job_5\n6:freezer:/job_5/../x\n",
                       "4:memory:/outer/job_5\n6:freezer:/job_5\n")
    _dirs(root, "memory", "freezer/x")
    py, c = both(probe, proc, root)
    assert isinstance(py, str) and "lies outside every mount" in py
    assert c == set()

