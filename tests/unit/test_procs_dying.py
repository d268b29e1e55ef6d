"""procs.dying: when a killed process can run none of its own code any more (tpassd's op=kill)."""

import os
import signal
import subprocess
import time

from torchpass.checkpoint import procs

RUNNING_FLAGS = 0x400000  # PF_RANDOMIZE and the like, without PF_EXITING


def _stat(pid: int, state: str, flags: int, start: int) -> str:
    # pid (comm) state ppid pgrp session tty tpgid flags ... starttime is field 22
    rest = [state, "1", "1", "1", "0", "-1", str(flags)] + ["0"] * 12 + [str(start)]
    return f"{pid} (python (x)) " + " ".join(rest) + "\n"


def _fake(proc, pid: int, start: int, threads: dict[int, tuple[str, int, int]]) -> None:
    """threads: tid -> (state, flags, SigPnd mask)."""
    d = proc / str(pid)
    (d / "task").mkdir(parents=True)
    (d / "stat").write_text(_stat(pid, threads[pid][0], threads[pid][1], start))
    for tid, (state, flags, pending) in threads.items():
        t = d / "task" / str(tid)
        t.mkdir()
        (t / "stat").write_text(_stat(tid, state, flags, start))
        (t / "status").write_text(f"Name:\tpython\nSigPnd:\t{pending:016x}\nShdPnd:\t0000000000000000\n")


KILL = 1 << (signal.SIGKILL - 1)


def test_a_running_process_is_not_dying(tmp_path):
    _fake(tmp_path, 10, 555, {10: ("S", RUNNING_FLAGS, 0), 11: ("R", RUNNING_FLAGS, 0)})
    assert not procs.dying(10, 555, str(tmp_path))


def test_one_thread_without_the_kill_keeps_the_process_alive(tmp_path):
    _fake(tmp_path, 10, 555, {10: ("S", RUNNING_FLAGS, KILL), 11: ("R", RUNNING_FLAGS, 0)})
    assert not procs.dying(10, 555, str(tmp_path))


def test_every_thread_exiting_or_holding_sigkill_is_dying(tmp_path):
    _fake(tmp_path, 10, 555, {10: ("S", RUNNING_FLAGS, KILL), 11: ("R", RUNNING_FLAGS | procs.PF_EXITING, 0),
                              12: ("Z", 0, 0)})
    assert procs.dying(10, 555, str(tmp_path))


def test_another_signal_pending_is_not_the_kill(tmp_path):
    _fake(tmp_path, 10, 555, {10: ("S", RUNNING_FLAGS, 1 << (signal.SIGTERM - 1))})
    assert not procs.dying(10, 555, str(tmp_path))


def test_a_pid_now_naming_a_later_process_or_nothing_is_dying(tmp_path):
    _fake(tmp_path, 10, 999, {10: ("S", RUNNING_FLAGS, 0)})
    assert procs.dying(10, 555, str(tmp_path))  # started at 999: not the process that was killed
    assert not procs.dying(10, None, str(tmp_path))  # whatever has the pid now: running
    assert procs.dying(11, 555, str(tmp_path))  # no such pid


def test_real_processes_alive_then_a_zombie():
    child = subprocess.Popen(["sleep", "30"])
    try:
        start = procs.read_stat(child.pid).start
        assert not procs.dying(child.pid, start)
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not procs.dying(child.pid, start):  # SIGKILL pending, exiting, then a zombie until reaped
            assert time.monotonic() < deadline, "a killed child never counted as dying"
            time.sleep(0.001)
        while procs.read_stat(child.pid).state != "Z":
            assert procs.dying(child.pid, start) and time.monotonic() < deadline
            time.sleep(0.001)
        assert procs.dying(child.pid, start)
    finally:
        child.kill()
        child.wait()
    assert procs.dying(child.pid, start)  # reaped: gone
