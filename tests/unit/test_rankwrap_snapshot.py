"""The rank wrapper's --restore-snapshot (a step relaunched from a whole-job snapshot):
which images it asks the root agent for, and the one line it says when it cannot."""

from __future__ import annotations

import json

from torchpass import layout
from torchpass.checkpoint import rankwrap


def _manifest(state_dir, job=7, snap="snap-7", ranks=(0, 1, 2)):
    path = layout.snapshot_manifest(state_dir, job, snap)
    path.parent.mkdir(parents=True)
    parts = [{"rank": r, "node": f"node{r + 1}", "images": f"/snap/snapshots/job{job}/{snap}/rank{r}"} for r in ranks]
    path.write_text(json.dumps({"job_id": job, "snapshot": snap, "ranks": parts}))


def test_the_ranks_images_come_from_the_job_manifest(tmp_path):
    _manifest(tmp_path)
    assert rankwrap.snapshot_images(str(tmp_path), "7", "snap-7", "1") == "/snap/snapshots/job7/snap-7/rank1"


def _env(tmp_path, rank="1"):
    return {"TORCHPASS_JOB_ID": "7", "SLURM_PROCID": rank, "TORCHPASS_STATE_DIR": str(tmp_path)}


def test_a_missing_snapshot_or_rank_fails_the_task_with_one_line(tmp_path, capfd):
    assert rankwrap.restore_snapshot("snap-9", str(tmp_path / "ranks"), _env(tmp_path)) == 1
    err = capfd.readouterr().err
    assert err.startswith("torchpass: rank 1: snapshot snap-9 of job 7 has no manifest") and err.count("\n") == 1
    _manifest(tmp_path, ranks=(0, 2))
    assert rankwrap.restore_snapshot("snap-7", str(tmp_path / "ranks"), _env(tmp_path)) == 1
    assert "snapshot snap-7 of job 7 has no rank 1" in capfd.readouterr().err


def test_a_bad_snapshot_id_is_refused_before_any_path_is_made_of_it(tmp_path, capfd):
    assert rankwrap.restore_snapshot("../../etc", str(tmp_path / "ranks"), _env(tmp_path)) == 1
    assert "cannot restore from snapshot '../../etc'" in capfd.readouterr().err


def test_without_the_plugins_root_agent_nothing_is_restored(tmp_path, capfd):
    """No agent child (the plugin did not start one): one line, exit 1, and the hold file (the
    snapshot's resume had released it) is removed so that no copy could run on unwoken."""
    _manifest(tmp_path)
    hold = layout.hold_file(tmp_path, 7, "snap-7", 1)
    hold.parent.mkdir(parents=True)
    hold.touch()
    env = _env(tmp_path)
    assert rankwrap.restore_snapshot("snap-7", str(tmp_path / "ranks"), env) == 1
    assert "expected the plugin's root restore agent" in capfd.readouterr().err
    assert not hold.exists() and env[rankwrap.RESTORE_RANK_ENV] == "1"
