"""Root's in-process restore of a snapshot whose tree is rooted at tpass-init (``init`` in the manifest).

The task is made as test_tpass_init.py makes it (what the SPANK plugin's
task_init_privileged does: a PID namespace, tpass-init as its PID 1, the
rank wrapper double-forking the rank under it), for a root job. Real CRIU
dumps the tree from tpass-init down; the rank wrapper's ``--restore`` (root,
no restore agent: the in-process path) restores it, records the restored tpass-init
as the tree's root and the rank under it as the rank (what a second move
dumps and checks), relays the rank's output and exit code, and the first
wrapper ends with that code too.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest

from test_privilege_boundary import RANK_ENV
from test_rankwrap_transparent import _record
from test_tpass_init import PLUGIN, init_program  # noqa: F401
from torchpass import layout
from torchpass.checkpoint import criu
from torchpass.checkpoint import rankwrap as rw
from torchpass.checkpoint.procs import read_stat

JOB, RANK = RANK_ENV["TORCHPASS_JOB_ID"], RANK_ENV["RANK"]
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="tpass-init is started by root, and root restores here")

TASK = """
import os, sys, time
print("before", os.getpid(), os.getppid(), flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
print("after", os.getpid(), os.getppid(), flush=True)
sys.exit(3)
"""


def test_root_restores_a_tree_rooted_at_tpass_init_and_relays_the_ranks_exit(tmp_path, init_program):  # noqa: F811
    c = criu.find_criu(None)
    go, wake, images = tmp_path / "go", tmp_path / "wake", tmp_path / "images"
    p = subprocess.Popen([sys.executable, "-c", PLUGIN, str(init_program), "0", str(tmp_path),
                          sys.executable, "-c", TASK, str(go)], env={**os.environ, **RANK_ENV},
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    restored = None
    roots: list[int] = []  # pidfds of the trees' roots (tpass-init), for the clean-up
    try:
        rec = _record(tmp_path, p)
        init, rank = rec["pid"], rec["rank_pid"]
        roots.append(os.pidfd_open(init))
        assert init != rank and read_stat(rank).ppid == init
        before = p.stdout.readline().split()
        assert before[0] == b"before" and before[1] != b"1" and before[2] == b"1"  # the rank is tpass-init's child
        res = criu.dump(c, init, images, fds_of=rank, meta={"init": True})
        assert criu.pipe_key(res.manifest["meta"]["fd1"])  # the rank's stdout: its wrapper's pipe
        layout.handoff(tmp_path, JOB, RANK).write_text("moved\n")
        os.kill(init, signal.SIGKILL)  # the source copy: tpass-init and, with it, its namespace
        restored = subprocess.Popen([sys.executable, "-m", "torchpass.checkpoint.rankwrap", "--restore", str(images),
                                     "--state-dir", str(tmp_path), "--wake-file", str(wake)],
                                    env={**os.environ, **RANK_ENV}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE)
        paths = rw.Paths(str(tmp_path), JOB, RANK)
        end = time.monotonic() + 60
        while paths.read_record().get("restored_from") != str(images):
            assert time.monotonic() < end and restored.poll() is None, restored.communicate()
            time.sleep(0.02)
        now = paths.read_record()
        roots.append(os.pidfd_open(now["pid"]))
        # the record names the restored tree as the source's did: tpass-init its root, the rank its child
        assert now["pid"] not in (init, rank) and read_stat(now["rank_pid"]).ppid == now["pid"]
        assert open(f"/proc/{now['pid']}/comm").read().strip() == "tpass-init"
        go.touch()
        out, err = restored.communicate(timeout=120)
        # the same rank (its pid in the namespace, under PID 1), its output relayed by the restoring wrapper
        assert out.split() == [b"after", before[1], b"1"], err
        assert restored.returncode == 3, err
        assert p.wait(timeout=30) == 3, p.stderr.read()
    finally:
        # After a failure half way, killing the wrappers alone left tpass-init and the rank (waiting
        # for go) running for ever: the rank is let go, and a root still there after 10 s is
        # killed, which takes its namespace with it.
        go.touch()
        for fd in roots:
            if not select.select([fd], [], [], 10)[0]:  # a pidfd is readable once its process ended
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            os.close(fd)
        for q in (p, restored):
            if q is not None and q.poll() is None:
                q.kill()
                q.wait()
