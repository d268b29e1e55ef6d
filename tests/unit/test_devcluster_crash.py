"""The devcluster's crash drill (`tpassctl devcluster crash/revive`), without a cluster:
the power cut itself on real processes, and the refusals that need no root."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
from click.testing import CliRunner

from torchpass.devcluster import Devcluster, DevclusterSpec
from torchpass.devcluster.cluster import pid_alive, power_cut
from torchpass.errors import DevclusterError
from tpassctl.cli import cli

# A parent that records its child's death the moment it sees it: what a slurmstepd does when
# its task dies (it reports the task's end). A power cut must leave it no chance to.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
child.wait()
open(sys.argv[1], "w").write("saw my child die")
time.sleep(120)
"""


def _reap(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    proc.wait(timeout=timeout_s)


def test_a_power_cut_kills_every_process_before_any_sees_another_die(tmp_path):
    witness = tmp_path / "witness"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(witness)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        # The child first: killed one by one in this order, the parent would see it die.
        sent: list[tuple[int, int]] = []

        def send(pid: int, sig: int) -> None:
            sent.append((pid, sig))
            os.kill(pid, sig)

        killed = power_cut(lambda: [p for p in (child, parent.pid) if pid_alive(p)], send=send)
        assert sorted(killed) == sorted([child, parent.pid])
        # Every process is stopped before the first one dies.
        assert [sig for _, sig in sent] == [signal.SIGSTOP] * 2 + [signal.SIGKILL] * 2, sent
        assert {pid for pid, _ in sent} == {child, parent.pid}
        _reap(parent)
        assert parent.returncode == -9
        deadline = time.monotonic() + 10
        while pid_alive(child) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not pid_alive(child)
        assert not witness.exists(), "the parent ran after its child died: not a power cut"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_a_process_that_appears_during_the_cut_is_killed_too():
    first = subprocess.Popen(["sleep", "120"])
    late: list[subprocess.Popen] = []

    def pids() -> list[int]:
        if not late:  # something forked after the first listing
            late.append(subprocess.Popen(["sleep", "120"]))
        return [p.pid for p in (first, *late) if pid_alive(p.pid)]

    try:
        killed = power_cut(pids)
        assert sorted(killed) == sorted([first.pid, late[0].pid])
        for p in (first, *late):
            _reap(p)
            assert p.returncode == -9
    finally:
        for p in (first, *late):
            if p.poll() is None:
                p.kill()
                p.wait()


def _recorded_cluster(tmp_path: Path, crashed: list[str]) -> Devcluster:
    """A handle on a cluster that is only its record (cluster.json), as attach() reads it."""
    spec = DevclusterSpec(name="rec", nodes=2, subnet="10.74.0", base_dir=tmp_path, tpassd=False)
    spec.run_dir.mkdir(parents=True)
    (spec.run_dir / "cluster.json").write_text(json.dumps({
        "spec": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(spec).items()},
        "pids": {"slurmd.node1": 999999999, "slurmd.node2": 999999998}, "up": True, "crashed": crashed}))
    return Devcluster.attach("rec", tmp_path)


def test_crash_and_revive_refuse_what_makes_no_sense_in_one_line(tmp_path):
    c = _recorded_cluster(tmp_path, crashed=["node2"])
    with pytest.raises(DevclusterError, match=r"no node 'node9' in devcluster 'rec'; nodes: node1, node2"):
        c.crash("node9")
    with pytest.raises(DevclusterError, match=r"node2 is already crashed; bring it back with 'tpassctl devcluster "
                                              r"revive node2 --name rec'"):
        c.crash("node2")
    with pytest.raises(DevclusterError, match=r"node1 is not crashed"):
        c.revive("node1")
    # Nothing runs in a crashed node: commands there are refused, not run in the host's namespaces.
    with pytest.raises(DevclusterError, match=r"node2 is crashed \(a drill\)"):
        c.exec_on("node2", ["true"])


def test_cli_crash_and_revive_say_what_they_do(tmp_path):
    runner = CliRunner()
    crash = runner.invoke(cli, ["devcluster", "crash", "--help"])
    assert crash.exit_code == 0
    text = " ".join(crash.output.split())
    assert "A power cut of NODE" in text and "SIGKILL at once" in text and "'revive NODE'" in text
    revive = runner.invoke(cli, ["devcluster", "revive", "--help"])
    assert revive.exit_code == 0 and "ReturnToService=2" in revive.output
    _recorded_cluster(tmp_path, crashed=[])
    bad = runner.invoke(cli, ["devcluster", "crash", "node7", "--name", "rec", "--base-dir", str(tmp_path)])
    assert bad.exit_code != 0 and "no node 'node7'" in bad.output
    assert os.path.exists(tmp_path / "rec" / "cluster.json")
