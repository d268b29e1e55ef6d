"""tpass-init, PID 1 of a rank's PID namespace, with the real rank wrapper.

What the SPANK plugin's task_init_privileged does, done here by a small
root script: unshare(CLONE_NEWPID), fork, exec slurm_spank/tpass-init UID
GID TASK; then the task execs the rank wrapper, which finds tpass-init as
its child and double-forks the rank under it. tpass-init runs as the job's
uid with CAP_SYS_ADMIN as its only capability; the rank's exit code, or the
signal that ended it, is what the wrapper ends with.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.wait import until
from test_privilege_boundary import RANK_ENV
from test_rankwrap_transparent import _record
from torchpass.checkpoint.procs import read_stat

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534
CAP_SYS_ADMIN = 21
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="tpass-init is started by root (the SPANK plugin)")


@pytest.fixture(scope="module")
def init_program() -> Path:
    subprocess.run(["make", "-s", "-C", str(REPO / "slurm_spank"), "tpass-init"], check=True, timeout=120)
    return REPO / "slurm_spank" / "tpass-init"


PLUGIN = """
import os, sys
from torchpass.checkpoint import rankwrap as rw
rw.unshare(rw.CLONE_NEWPID)
task = os.getpid()
if os.fork() == 0:
    os.execv(sys.argv[1], [sys.argv[1], sys.argv[2], sys.argv[2], str(task)])
sys.exit(rw.exit_like(rw.launch(sys.argv[4:], sys.argv[3], "wait", False)))
"""


def _task(init: Path, state: Path, script: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PLUGIN, str(init), str(NOBODY), str(state), "sh", "-c", script],
                            env={**os.environ, **RANK_ENV},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _status(pid: int) -> dict[str, list[str]]:
    text = Path(f"/proc/{pid}/status").read_text()
    return {k: v.split() for k, _, v in (ln.partition(":") for ln in text.splitlines())}


def test_the_rank_runs_under_tpass_init_which_holds_only_cap_sys_admin(tmp_path, init_program):
    p = _task(init_program, tmp_path, "echo pid $$; sleep 1; exit 3")
    rec = _record(tmp_path, p)
    init, rank = rec["pid"], rec["rank_pid"]
    assert init != rank and read_stat(rank).ppid == init and read_stat(init).ppid == p.pid
    # tpass-init drops its privileges right after it starts, but the rank's record can come first
    # (seen in CI under load: uid 0 read before the drop); a tpass-init that never drops them fails here
    st = until(lambda: (s := _status(init))["Uid"] == [str(NOBODY)] * 4 and s, "tpass-init runs as nobody", 10.0,
               diag=lambda: str(_status(init)["Uid"]))
    assert st["Uid"] == [str(NOBODY)] * 4 and st["Gid"] == [str(NOBODY)] * 4
    assert int(st["CapEff"][0], 16) == 1 << CAP_SYS_ADMIN and int(st["CapInh"][0], 16) == 0
    assert st["NSpid"][-1] == "1" and Path(f"/proc/{init}/comm").read_text().strip() == "tpass-init"
    out, err = p.communicate(timeout=30)
    # the rank is PID 2 or more of the namespace, its exit code the task's
    assert p.returncode == 3 and out.startswith(b"pid ") and out != b"pid 1\n", err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_rank_ended_by_a_signal_ends_the_task_by_that_signal(tmp_path, init_program, sig):
    """tpass-init cannot die by the rank's signal (a namespace init ignores its own); it names it
    in its comm and the wrapper ends by it (Slurm's ExitCode 0:S, as without torchpass)."""
    p = _task(init_program, tmp_path, "sleep 30")
    rec = _record(tmp_path, p)
    os.kill(rec["rank_pid"], sig)
    p.communicate(timeout=30)
    assert p.returncode == -sig


def test_killing_tpass_init_ends_the_rank(tmp_path, init_program):
    """What the move's kill of the source copy does: the namespace goes, the rank with it."""
    p = _task(init_program, tmp_path, "sleep 30")
    rec = _record(tmp_path, p)
    work = os.readlink(f"/proc/{rec['pid']}/cwd")  # its own directory, which a SIGKILL leaves behind
    os.kill(rec["pid"], signal.SIGKILL)
    p.communicate(timeout=30)
    os.rmdir(work)
    assert p.returncode == -signal.SIGKILL and not Path(f"/proc/{rec['rank_pid']}").exists()


@pytest.mark.parametrize("argv", [[], ["x", "1", "2"], ["1", "1"], ["1", "1", "0"], ["-1", "1", "2"]])
def test_tpass_init_refuses_bad_arguments(init_program, argv):
    assert subprocess.run([str(init_program), *argv], timeout=10).returncode == 120


# As under Slurm's proctrack/cgroup: the plugin forks tpass-init (fd 3: the read end of a pipe
# the task holds close-on-exec) before slurmstepd places the task in the step's cgroup; the task
# is placed, then execs; tpass-init must follow it there, or listpids misses the tree's root.
PLACED_PLUGIN = """
import os, sys
from torchpass.checkpoint import rankwrap as rw
init, uid, state, step = sys.argv[1:5]
rw.unshare(rw.CLONE_NEWPID)
task = os.getpid()
r, w = os.pipe2(os.O_CLOEXEC)
if os.fork() == 0:
    if r == 3:
        os.set_inheritable(3, True)
    else:
        os.dup2(r, 3)
    os.closerange(4, 1024)
    os.execv(init, [init, uid, uid, str(task)])
os.close(r)
with open(step + "/cgroup.procs", "w") as f:  # slurmstepd's proctrack_g_add of the task
    f.write(str(task))
launch = "import sys; from torchpass.checkpoint import rankwrap as rw; " \\
         "sys.exit(rw.exit_like(rw.launch(sys.argv[2:], sys.argv[1], 'wait', False)))"
os.execv(sys.executable, [sys.executable, "-c", launch, state, *sys.argv[5:]])
"""


@pytest.mark.skipif(not Path("/sys/fs/cgroup/freezer/cgroup.procs").exists(),
                    reason="needs a cgroup v1 freezer hierarchy (Slurm's proctrack/cgroup uses it)")
def test_tpass_init_joins_the_cgroup_its_task_was_placed_in_after_the_task_execs(tmp_path, init_program):
    step = Path("/sys/fs/cgroup/freezer") / f"tp-init-test-{os.getpid()}" / "step_0"
    step.mkdir(parents=True)
    try:
        p = subprocess.Popen([sys.executable, "-c", PLACED_PLUGIN, str(init_program), str(NOBODY), str(tmp_path),
                              str(step), "sh", "-c", "sleep 1; exit 4"],
                             env={**os.environ, **RANK_ENV}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        rec = _record(tmp_path, p)
        wanted = f":freezer:/{step.parent.name}/step_0"
        cgroups = {pid: Path(f"/proc/{pid}/cgroup").read_text() for pid in (rec["pid"], rec["rank_pid"])}
        assert all(wanted in text for text in cgroups.values()), cgroups
        assert str(rec["pid"]) in (step / "cgroup.procs").read_text().split()
        out, err = p.communicate(timeout=30)
        assert p.returncode == 4, err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        end = time.monotonic() + 10
        while True:  # the tree's last exits may still be on their way out of the cgroup
            try:
                step.rmdir()
                break
            except OSError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.05)
        step.parent.rmdir()
