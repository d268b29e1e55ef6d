"""tpassd dumps an ordinary user's rank tree rooted at the plugin's tpass-init.

The rank record names the tree's root (``pid``: tpass-init, the wrapper's
child) and the rank (``rank_pid``: tpass-init's child). tpassd checks both
against Slurm's and the kernel's view, and runs criu as the job's owner with
a minimal capability list as ambient capabilities (criu.dump_caps(): no
DAC_OVERRIDE, no FOWNER) and ``--unprivileged``.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from test_privilege_boundary import _dump, _record, _refused, _service, _stop, shared_tmp, user  # noqa: F401
from torchpass.checkpoint import criu as criu_mod
from torchpass.checkpoint.rankwrap import children

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="tpassd runs as root")


def _tree(uid: int | None = None) -> tuple[subprocess.Popen, int, int]:
    """wrapper -> init -> rank, as ``uid``: (wrapper, init pid, rank pid)."""
    gid = {"group": uid, "extra_groups": [uid]} if uid is not None else {}  # a job's groups (initgroups)
    w = subprocess.Popen(["sh", "-c", "sh -c 'sleep 60; :' & wait"], user=uid, stdin=subprocess.DEVNULL, **gid)
    end = time.monotonic() + 10
    while time.monotonic() < end:
        init = children(w.pid)
        rank = children(init[0]) if init else []
        if rank:
            return w, init[0], rank[0]
        time.sleep(0.01)
    _stop(w)
    raise AssertionError("no process tree")


def _recording_criu(d) -> tuple[str, object]:
    calls = d / "criu.calls"
    calls.touch(mode=0o666)
    os.chmod(calls, 0o666)
    p = d / "criu"
    p.write_text(f"#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'Version: 4.1.1'; exit 0; fi\n"
                 f"echo \"$(id -u) $(grep CapAmb /proc/self/status) $*\" >> {calls}\nexit 1\n")
    p.chmod(0o755)
    return str(p), calls


def test_a_rank_pid_that_is_not_the_inits_child_is_refused(tmp_path):
    w, init, _ = _tree()
    other = subprocess.Popen(["sleep", "60"])
    criu, calls = _recording_criu(tmp_path)
    try:
        _record(tmp_path, {"pid": init, "rank_pid": other.pid, "wrapper_pid": w.pid})
        svc = _service(tmp_path, lambda: {w.pid, init, other.pid}, criu_binary=criu)
        _refused(lambda: _dump(svc), f"pid {other.pid}'s parent is {os.getpid()}, not .* {init}")
        assert calls.read_text() == "" and other.poll() is None
    finally:
        _stop(w, other)


def test_a_users_tree_is_dumped_by_criu_as_the_user_with_the_minimal_capability_list(
        tmp_path, shared_tmp, user):  # noqa: F811
    w, init, rank = _tree(user.pw_uid)
    criu, calls = _recording_criu(shared_tmp)
    try:
        _record(tmp_path, {"pid": init, "rank_pid": rank, "wrapper_pid": w.pid})
        svc = _service(tmp_path, lambda: {w.pid, init, rank}, owner=user.pw_uid, criu_binary=criu)
        with pytest.raises(Exception, match="criu dump of pid"):
            _dump(svc)
        line = calls.read_text().split()
        assert line[0] == str(user.pw_uid) and int(line[2], 16) == _minimal(criu_mod.dump_caps()), line
        assert "--unprivileged" in line and line[line.index("-t") + 1] == str(init), line
    finally:
        _stop(w)


def _minimal(caps) -> int:
    """``caps`` and CAP_SYS_RESOURCE where this process's bounding set has it, as a mask."""
    bnd = int(next(ln for ln in open("/proc/self/status") if ln.startswith("CapBnd:")).split()[1], 16)
    res = 1 << criu_mod.CAP_NAMES.index("sys_resource")
    return sum(1 << criu_mod.CAP_NAMES.index(c) for c in caps) | (bnd & res)


def test_owner_creds_names_the_minimal_list_never_dac_override_or_fowner(tmp_path):
    creds = criu_mod.owner_creds(os.getpid())
    assert creds.uid == os.getuid() and sum(1 << criu_mod.CAP_NAMES.index(c) for c in creds.caps) == \
        _minimal(criu_mod.dump_caps())
    assert not {"dac_override", "fowner", "setuid"} & set(creds.caps)
    argv = criu_mod.as_creds_argv(9, creds)
    assert argv[0] == "/proc/self/fd/9" and argv[-1] == "--"
