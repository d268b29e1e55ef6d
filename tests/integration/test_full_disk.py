"""A full image disk on the devcluster rolls the move back with a clear event.

The bad node's snapshot_dir is a small tmpfs, mounted over
the devcluster's shared snapshot_dir for this test in that node's mount namespace only
(its slurmd's, which its tpassd and ranks share); its tpassd may flag the
nearly full disk as a host fault and start the move itself, before the drill.
A training rank's image (a few hundred MB) does not fit: the dump is refused
before the rank is touched, the coordinator rolls back, training goes on in
place and finishes unchanged (the same job, Restarts=0, COMPLETED 0:0, the
reference's losses), the rollback event quotes tpassd's one line, and no
image is left on that disk. The ENOSPC-while-CRIU-writes path and the CUDA
order are covered at unit level (tests/unit/test_checkpoint_full_disk.py).
"""

from __future__ import annotations

import re
import subprocess

import pytest

from test_migration import (  # noqa: F401 - fixtures: the module's reference run, the cleanup
    FAULT_STEPS,
    TRAINING_NODES,
    _assert_finished_unchanged,
    _events,
    _images_left,
    _rng,
    _submit,
    _wait_step,
    clean,
    reference,
)
from training_jobs import TPASSCTL
from training_jobs import node as _node
from training_jobs import run as _run

pytestmark = pytest.mark.integration

DISK_MB = 32


def test_a_full_image_disk_rolls_the_move_back_with_the_reason_in_its_event(
        cluster, reference, job_dir, clean, job_user):  # noqa: F811 - test_migration's fixtures, used by name
    rng = _rng("full-disk")
    node, at = rng.choice(TRAINING_NODES), rng.randint(*FAULT_STEPS)
    what = f"{DISK_MB} MB snapshot_dir on {node}, ecc-sbe-storm there at step {at}"
    print(f"\n{what}")
    snap = cluster.snapshot_dir  # mounted over in the node's own mount namespace: the other nodes keep theirs
    in_node = cluster.ns_argv(node)
    subprocess.run([*in_node, "mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m,mode=0700", "tmpfs", str(snap)],
                   check=True, timeout=30)
    try:
        job_id = _submit(job_dir, "full", job_user)
        clean.append(job_id)
        out_path = job_dir / f"full.{job_id}.out"
        _wait_step(out_path, at)
        assert _run([*TPASSCTL, "inject", "--node", node, "--fault", "ecc-sbe-storm"]).returncode == 0, what

        diag = _assert_finished_unchanged(cluster, job_id, out_path, reference, what)
        by_kind: dict[str, list[dict]] = {}
        for e in _events(cluster, job_id):
            by_kind.setdefault(e["kind"], []).append(e)
        rolled = by_kind.get("migration.rolled_back", [])
        assert rolled and not by_kind.get("migration.completed"), diag
        line = re.compile(rf"dump failed: rank \d+: no space for rank \d+'s image on {re.escape(str(snap))}: "
                          rf"need ~(\d+) MB, (\d+) MB free; free space there or set snapshot_dir to a larger disk")
        for e in rolled:
            m = line.search(e["message"])
            assert m and int(m.group(1)) > (DISK_MB << 20) / 1e6 >= int(m.group(2)), diag  # MB of 10**6 bytes
        assert _images_left(cluster, job_id) == [], diag
        left = subprocess.run([*in_node, "find", str(snap), "-name", "rank*"], capture_output=True, text=True,
                              timeout=30)
        assert left.returncode == 0 and left.stdout == "", (left, diag)  # nothing partial on that disk
        n = _node(node)
        assert "DRAIN" not in n["state"], (n["state"], n.get("reason"), diag)  # rolled back: not drained
        print(f"rolled back: {rolled[0]['message']}")
    finally:
        subprocess.run([*in_node, "umount", "-l", str(snap)], check=False, timeout=30)
