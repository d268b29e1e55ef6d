"""The task wrapper does not change what a task sees.

Real wrappers (``python -m torchpass.checkpoint.rankwrap``) around real tasks,
as root (the wrapper makes the rank's PID namespace) and as an ordinary user
in a namespace root prepared (what the SPANK plugin does). stdin as Slurm
gives it, an inherited fd 5, the task's exit code, death by a signal (the
wrapper dies by the same signal: Slurm's ExitCode 0:S), orphans, and a moved
rank's signal death relayed through the exit file. CRIU's side (what a dump
does with that stdin and fd) is in docs/migration-internals.md.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_privilege_boundary import RANK_ENV, _as_user_wrapper, shared_tmp, user, user_pythonpath  # noqa: F401
from torchpass import layout
from torchpass.checkpoint import rankwrap as rw
from torchpass.checkpoint.criu import tree_pids

JOB, RANK = RANK_ENV["TORCHPASS_JOB_ID"], RANK_ENV["RANK"]
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the wrapper's PID namespace needs root")


def _wrapper(state: Path, task: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torchpass.checkpoint.rankwrap", "--state-dir", str(state), "--",
                             "sh", "-c", task], env={**os.environ, **RANK_ENV}, **kw)


def _record(state: Path, p: subprocess.Popen) -> dict:
    paths = rw.Paths(str(state), JOB, RANK)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        rec = paths.read_record()
        if rec.get("wrapper_pid") == p.pid:
            return rec
        assert p.poll() is None, p.communicate()
        time.sleep(0.02)
    raise AssertionError("no rank record")


def _stdin_and_fd5(start) -> None:
    """stdin data reaches the task, fd 5 is still open in it; exit code 3 passes through."""
    r, w = os.pipe()
    # fd 5 of this process may be pytest's: the pipe becomes fd 5 in the child only
    assert w != 5
    p = start("read line; echo \"got $line\" >&5; echo pid $$; exit 3", stdin=subprocess.PIPE,
              stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(5,), preexec_fn=lambda: os.dup2(w, 5))
    os.close(w)
    out, err = p.communicate(b"hello\n", timeout=60)
    with os.fdopen(r) as f:
        said = f.read()
    assert said == "got hello\n", err
    assert p.returncode == 3 and out == b"pid 1\n" and b"unprotected" not in err, err


@root_only
def test_stdin_inherited_fds_and_exit_code_reach_the_rank(tmp_path):
    _stdin_and_fd5(lambda task, **kw: _wrapper(tmp_path, task, **kw))


def test_same_as_an_ordinary_user_in_a_namespace_root_prepared(user, user_pythonpath, shared_tmp):  # noqa: F811
    state = shared_tmp / "ranks"
    state.mkdir()
    os.chown(state, user.pw_uid, user.pw_gid)
    _stdin_and_fd5(lambda task, **kw: _as_user_wrapper(user, user_pythonpath, state, task, prefix=("unshare", "--pid"),
                                                       **kw))
    # SIGTERM to the wrapper, as slurmstepd sends it: the user's wrapper dies by it too
    p = _as_user_wrapper(user, user_pythonpath, state, "echo ready; exec sleep 300", prefix=("unshare", "--pid"),
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"ready\n"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == -signal.SIGTERM, p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


@root_only
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGUSR1])
def test_a_rank_killed_by_a_signal_ends_the_wrapper_by_that_signal(tmp_path, sig):
    """SIGKILL to the rank itself; SIGTERM/SIGUSR1 to the wrapper, as slurmstepd sends them
    (the rank has no handler, so the wrapper kills it: reported as the signal sent)."""
    p = _wrapper(tmp_path, "echo ready; exec sleep 300", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        rec = _record(tmp_path, p)
        assert p.stdout.readline() == b"ready\n"
        os.kill(rec["pid"] if sig == signal.SIGKILL else p.pid, sig)
        assert p.wait(timeout=30) == -sig, p.stderr.read()
        assert not os.path.exists(f"/proc/{rec['pid']}")
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


def _wakeups(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return sum(int(ln.split()[1]) for ln in status.splitlines()
               if ln.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")))


@root_only
def test_the_wrapper_sleeps_while_its_rank_runs_and_still_forwards_a_signal_at_once(tmp_path):
    """No polling beside the rank (a wake-up can delay a rank in a collective every rank waits
    for): over 2 s of a quiet rank the wrapper is woken at most a few times, and a SIGTERM from
    slurmstepd reaches the rank right away, not at the next poll."""
    p = _wrapper(tmp_path, "echo ready; exec sleep 300", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _record(tmp_path, p)
        assert p.stdout.readline() == b"ready\n"
        time.sleep(0.3)  # the relay settled into its wait
        before = _wakeups(p.pid)
        time.sleep(2.0)
        woken = _wakeups(p.pid) - before
        assert woken <= 3, f"the wrapper woke {woken} times in 2 s (it polled every 50 ms before: ~40)"
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == -signal.SIGTERM, p.stderr.read()
        assert time.monotonic() - t0 < 1.0
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


@root_only
def test_the_self_kill_dumps_no_core(tmp_path):
    """exit_like with the core limit up: the wrapper's own death by SIGABRT leaves no core
    (the rank made its own, if any), and it still ends by the signal."""
    code = ("import os, resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))\n"
            "from torchpass.checkpoint import rankwrap as rw\n"
            "sys.exit(rw.exit_like(-6))\n")
    hard = resource.getrlimit(resource.RLIMIT_CORE)[1]
    if hard != resource.RLIM_INFINITY:
        pytest.skip(f"the core limit's hard cap is {hard}: the test raises it to infinity")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, timeout=60)
    assert p.returncode == -signal.SIGABRT, p.stderr
    assert not any(f.name.startswith("core") for f in tmp_path.iterdir())
    assert rw.exit_like(0) == 0 and rw.exit_like(4) == 4


@root_only
def test_orphans_of_the_rank_are_reaped_with_it(tmp_path):
    """A process the task leaves behind (double fork) does not outlive the step as a zombie
    or a stray: the namespace's end takes it, and it is reaped."""
    p = _wrapper(tmp_path, "(sleep 300 &); echo ready; read x; exit 0", stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        rec = _record(tmp_path, p)
        assert p.stdout.readline() == b"ready\n"
        orphans = [q for q in tree_pids(rec["pid"]) if q != rec["pid"]]
        assert orphans, "the task's orphan is in its namespace"
        p.stdin.close()  # the task ends
        assert p.wait(timeout=30) == 0
        end = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{q}") for q in orphans) and time.monotonic() < end:
            time.sleep(0.05)
        assert not any(os.path.exists(f"/proc/{q}") for q in orphans)
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


# A moved rank's restore wrapper: take over the record, wait for the rank (here a plain
# child that ends by SIGTERM, or exits 3), report through the exit file.
RESTORED = """
import subprocess, sys
from torchpass.checkpoint import rankwrap as rw
state_dir, images, task = sys.argv[1:4]
paths = rw.Paths(state_dir, "{job}", "{rank}")
rank = subprocess.Popen(["sh", "-c", task])
rw.take_over(paths, "{job}", "{rank}", rank.pid, images, {{}}, 0.1)
sys.exit(rw.finish_restored(paths, images, rw.Relay({{}}).wait(rank.pid)))
""".format(job=JOB, rank=RANK)


@root_only
@pytest.mark.parametrize("task, expect", [("kill -TERM $$", -signal.SIGTERM), ("exit 3", 3)])
def test_a_moved_rank_ends_the_first_wrapper_the_same_way(tmp_path, task, expect):
    p = _wrapper(tmp_path, "exec sleep 300", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        rec = _record(tmp_path, p)
        layout.handoff(tmp_path, JOB, RANK).write_text("moved\n")  # what the dump sets
        os.kill(rec["pid"], signal.SIGKILL)  # what the move's kill does
        copy = subprocess.run([sys.executable, "-c", RESTORED, str(tmp_path), "/images/gen1", task],
                              capture_output=True, text=True, timeout=60)
        assert copy.returncode == rw.shell_code(expect), copy.stderr  # the restore step: shell-style
        assert p.wait(timeout=30) == expect, p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


# The rank for a real move: reads a line of stdin, waits for GO, then says what it sees.
MOVED_TASK = """
import os, sys, time
print("got", sys.stdin.readline().strip(), flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
print("after", repr(sys.stdin.readline()), "fd5", os.path.exists("/proc/self/fd/5"), "pid", os.getpid(), flush=True)
sys.exit(3)
"""


@root_only
def test_criu_moves_a_rank_that_kept_its_stdin_pipe_and_fd5(tmp_path):
    """What the kept stdin and fd 5 (pipes whose other ends stay behind) do to a real CRIU
    dump and restore: no obstacle; after the move stdin reads end of file, fd 5 is still
    open (its peer is gone), and the rank's exit code comes back to the first wrapper."""
    from torchpass.checkpoint import criu

    c = criu.find_criu(None)
    go, images = tmp_path / "go", tmp_path / "images"
    r, w = os.pipe()
    p = subprocess.Popen([sys.executable, "-m", "torchpass.checkpoint.rankwrap", "--state-dir", str(tmp_path), "--",
                          sys.executable, "-c", MOVED_TASK, str(go)], env={**os.environ, **RANK_ENV},
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(5,),
                         preexec_fn=lambda: os.dup2(w, 5))
    restored = None
    try:
        os.close(w)
        rec = _record(tmp_path, p)
        p.stdin.write(b"hello\n")
        p.stdin.flush()
        assert p.stdout.readline() == b"got hello\n"
        result = criu.dump(c, rec["pid"], images)
        assert criu.pipe_key(result.manifest["meta"]["fd0"])  # stdin was the test's pipe
        layout.handoff(tmp_path, JOB, RANK).write_text("moved\n")
        os.kill(rec["pid"], signal.SIGKILL)
        restored = subprocess.Popen([sys.executable, "-m", "torchpass.checkpoint.rankwrap", "--restore", str(images),
                                     "--state-dir", str(tmp_path), "--wake-file", str(go)],
                                    env={**os.environ, **RANK_ENV}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE)
        out, err = restored.communicate(timeout=120)
        assert out == b"after '' fd5 True pid 1\n", err
        assert restored.returncode == 3, err
        assert p.wait(timeout=30) == 3, p.stderr.read()
    finally:
        os.close(r)
        for q in (p, restored):
            if q is not None and q.poll() is None:
                q.kill()
                q.wait()


@root_only
def test_an_inherited_socket_stays_open_and_the_dump_is_refused_in_one_line(tmp_path):
    """A PMI-style socket at fd 5 stays the rank's; CRIU cannot dump it, so the move is
    refused before CRIU runs (the rank goes on) and says which fd holds it."""
    import socket

    from torchpass.checkpoint import criu
    from torchpass.errors import CheckpointError

    mine, theirs = socket.socketpair()
    w = theirs.fileno()
    p = _wrapper(tmp_path, "echo ready; read x; exit 0", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                 pass_fds=(5,), preexec_fn=lambda: os.dup2(w, 5))
    try:
        theirs.close()
        rec = _record(tmp_path, p)
        assert p.stdout.readline() == b"ready\n"
        assert os.readlink(f"/proc/{rec['pid']}/fd/5").startswith("socket:")
        with pytest.raises(CheckpointError, match=rf"{rec['pid']}:5\b.*not dumping"):
            criu.dump(criu.find_criu(None), rec["pid"], tmp_path / "images", wait_no_sockets_s=0.1)
        p.stdin.close()
        assert p.wait(timeout=30) == 0
    finally:
        mine.close()
        if p.poll() is None:
            p.kill()
        p.wait()
