"""``child_sockets``: the sockets a rank's descendants hold, which make its tree undumpable
(DataLoader workers). Real processes: a child and a grandchild."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from torchpass.runtime.pg import child_sockets

HOLDER = "import socket, sys, time; s = socket.socket(); print('ready', flush=True); time.sleep(30)"


def _wait_ready(proc: subprocess.Popen) -> None:
    assert proc.stdout.readline().strip() == "ready"


def test_a_child_without_sockets_is_not_reported():
    p = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(30)"],
                         stdout=subprocess.PIPE, text=True)
    try:
        _wait_ready(p)
        assert [pid for pid, _ in child_sockets()] == []
    finally:
        p.kill()
        p.wait()


def test_sockets_of_a_child_and_of_a_grandchild_are_found():
    own = socket.socket()  # our own sockets do not count: only the descendants'
    child = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    # the grandchild: a shell whose child holds a socket (the shell itself holds none)
    shell = subprocess.Popen(["sh", "-c", f'{sys.executable} -c "{HOLDER}"'], stdout=subprocess.PIPE, text=True)
    found: dict[int, int] = {}
    try:
        _wait_ready(child)
        _wait_ready(shell)
        time.sleep(0.1)
        found = dict(child_sockets())
        assert found.get(child.pid) == 1, found
        assert shell.pid not in found and len(found) == 2, found
        assert os.getpid() not in found
    finally:
        own.close()
        for pid in set(found) - {child.pid}:  # the grandchild: the shell's kill would orphan it
            os.kill(pid, 9)
        for p in (child, shell):
            p.kill()
            p.wait()
