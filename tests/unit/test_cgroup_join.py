"""The restore agent joins its task's cgroups before criu restores into them:
torchpass.checkpoint.cgroup_join, on a fake /proc and on the machine's own cgroup v1 freezer."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchpass.checkpoint.cgroup_join import join_cgroups_of
from torchpass.errors import CheckpointError

MOUNTINFO = """25 1 0:23 / /sys/fs/cgroup rw - tmpfs tmpfs rw
30 25 0:27 / {root}/freezer rw,nosuid - cgroup cgroup rw,freezer
31 25 0:28 / {root}/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct
32 25 0:29 /outer {root}/memory rw,nosuid - cgroup cgroup rw,memory
33 25 0:30 / {root}/unified rw - cgroup2 cgroup2 rw
"""


def _fake(tmp_path: Path, task: str, ours: str) -> tuple[str, Path]:
    proc, root = tmp_path / "proc", tmp_path / "cg"
    for d in ("self", "77"):
        (proc / d).mkdir(parents=True)
    (proc / "self" / "mountinfo").write_text(MOUNTINFO.format(root=root))
    (proc / "77" / "cgroup").write_text(task)
    (proc / "self" / "cgroup").write_text(ours)
    return str(proc), root


def test_the_agent_moves_itself_where_the_task_is_and_nowhere_else(tmp_path):
    task = "6:freezer:/slurm_n/uid_1/job_5/step_1\n3:cpu,cpuacct:/\n4:memory:/outer/job_5/step_1/task_0\n0::/x\n"
    ours = "6:freezer:/slurm_n/uid_1/job_5\n3:cpu,cpuacct:/\n4:memory:/outer/job_5/step_1\n0::/x\n"
    proc, root = _fake(tmp_path, task, ours)
    for d in ("freezer/slurm_n/uid_1/job_5/step_1", "memory/job_5/step_1/task_0", "cpu,cpuacct"):
        (root / d).mkdir(parents=True)
        (root / d / "cgroup.procs").write_text("")
    done = join_cgroups_of(77, proc=proc)
    assert sorted(done) == sorted([str(root / "freezer/slurm_n/uid_1/job_5/step_1/cgroup.procs"),
                                   str(root / "memory/job_5/step_1/task_0/cgroup.procs")])
    assert all(Path(p).read_text() == str(os.getpid()) for p in done)
    assert (root / "cpu,cpuacct" / "cgroup.procs").read_text() == ""  # the same there: not written


def test_the_last_mount_of_a_hierarchy_wins_where_an_earlier_one_is_hidden(tmp_path):
    """The devcluster's node mounts its own cgroup tree over the host's (same mount points);
    inside its cgroup namespace the hidden host mount's root reads "/..": never that one."""
    proc, root = _fake(tmp_path, "6:freezer:/slurm_n/job_5/step_1\n", "6:freezer:/slurm_n/job_5\n")
    (Path(proc) / "self" / "mountinfo").write_text(
        f"30 25 0:27 /.. {root}/hidden rw - cgroup cgroup rw,freezer\n"
        f"74 73 0:27 / {root}/freezer rw - cgroup cgroup rw,freezer\n")
    (root / "freezer/slurm_n/job_5/step_1").mkdir(parents=True)
    (root / "freezer/slurm_n/job_5/step_1/cgroup.procs").write_text("")
    assert join_cgroups_of(77, proc=proc) == [str(root / "freezer/slurm_n/job_5/step_1/cgroup.procs")]


def test_a_task_cgroup_outside_the_mount_is_refused(tmp_path):
    proc, root = _fake(tmp_path, "4:memory:/elsewhere/job_5\n", "4:memory:/outer/job_5\n")
    (root / "memory").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"lies outside every mount"):
        join_cgroups_of(77, proc=proc)


def test_a_cgroup_the_agent_cannot_join_refuses_the_restore_in_one_line(tmp_path):
    proc, root = _fake(tmp_path, "6:freezer:/job_5/step_1\n", "6:freezer:/job_5\n")
    with pytest.raises(CheckpointError, match=r"cannot join the restore step's cgroup .*job_5/step_1/cgroup.procs"):
        join_cgroups_of(77, proc=proc)


CHILD = """import sys
from torchpass.checkpoint.cgroup_join import join_cgroups_of
join_cgroups_of(int(sys.argv[1]))
print(open('/proc/self/cgroup').read())
"""


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/sys/fs/cgroup/freezer/cgroup.procs").exists(),
                    reason="needs root and a cgroup v1 freezer hierarchy")
def test_on_real_cgroups_the_agent_lands_in_its_tasks_freezer_cgroup():
    base = Path("/sys/fs/cgroup/freezer") / f"tp-join-{os.getpid()}"
    step = base / "step_1"
    step.mkdir(parents=True)
    task = subprocess.Popen(["sh", "-c", f"echo $$ > {step}/cgroup.procs && exec sleep 60"])
    try:
        # The shell joins on its own schedule; on a loaded machine that can take a while, and a
        # task still in the root cgroup would make the assertion below test nothing.
        deadline = time.monotonic() + 10
        while str(task.pid) not in (step / "cgroup.procs").read_text().split():
            assert time.monotonic() < deadline, "the task never joined its step cgroup"
            time.sleep(0.01)
        out = subprocess.run([sys.executable, "-c", CHILD, str(task.pid)], capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 0, out.stderr
        assert f":freezer:/{base.name}/step_1" in out.stdout, out.stdout
    finally:
        task.kill()
        task.wait()
        step.rmdir()
        base.rmdir()


def test_a_task_that_exited_by_the_time_its_cgroups_were_read_is_refused(tmp_path):
    """/proc/TASK/cgroup is read by number: once the task has exited, the number may be another
    process's, in another cgroup. The task's pidfd, checked live after the read, refuses it and
    nothing is joined."""
    task = "6:freezer:/slurm_n/uid_1/job_5/step_1\n"
    proc, root = _fake(tmp_path, task, "6:freezer:/slurm_n/uid_1/job_5\n")
    (root / "freezer/slurm_n/uid_1/job_5/step_1").mkdir(parents=True)
    (root / "freezer/slurm_n/uid_1/job_5/step_1/cgroup.procs").write_text("")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    pidfd = os.pidfd_open(gone.pid)
    gone.wait()
    try:
        with pytest.raises(CheckpointError, match="exited before the restore"):
            join_cgroups_of(77, proc=proc, pidfd=pidfd)
    finally:
        os.close(pidfd)
    assert (root / "freezer/slurm_n/uid_1/job_5/step_1/cgroup.procs").read_text() == ""
    live = os.pidfd_open(os.getpid())
    try:
        assert join_cgroups_of(77, proc=proc, pidfd=live)  # a live task: joined as before
    finally:
        os.close(live)
