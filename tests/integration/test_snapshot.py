"""Whole-job snapshot, leave-running (issue 12): `tpassctl snapshot` of a 3-node job at a random step.

As the ordinary job user: every rank pauses at one collective and is dumped by its node's tpassd,
then resumes in place; the job ends COMPLETED 0:0, never requeued, with the losses of the same
script under plain sbatch bit for bit (float.hex). `tpassctl snapshots` lists the snapshot with the
event's step and size; the images are root's alone; another user can neither take nor list one; the
owner deletes it. The seed is printed (replay: TORCHPASS_TEST_SEED)."""

from __future__ import annotations

import json
import os
import random
import stat
import time
from pathlib import Path

import pytest
import training_jobs as tj
from drill import Drill, diagnosis, events, leave_clean, reference, submit, wait_step

from slurm_helpers import tpassctl

pytestmark = pytest.mark.integration

SEED = int(os.environ.get("TORCHPASS_TEST_SEED") or time.time_ns() % 1_000_000)
STEPS = 80
JOB = Drill("snapshot", "", ("--steps", str(STEPS), "--params", "1M", "--sleep", "0.05"), STEPS, nodes=3,
            fault_steps=(5, 30))


def test_snapshot_leaves_the_job_running_bit_identical(cluster, plugin_built, job_dir, job_user, other_user):
    jobs: list[int] = []
    at = random.Random(f"{SEED}:snapshot").randint(*JOB.fault_steps)
    what = f"seed={SEED} (replay with TORCHPASS_TEST_SEED={SEED}): snapshot at step {at}"
    print(f"\n{what}")
    try:
        ref = reference(JOB, job_dir, job_user.name, jobs)
        job_id = submit(JOB, job_dir, "snap", "spares=1", job_user.name)
        jobs.append(job_id)
        out_path = job_dir / f"snap.{job_id}.out"
        wait_step(cluster, job_id, out_path, at, what)

        other = tpassctl("snapshot", str(job_id), user=other_user.name)
        assert other.returncode == 1 and "only its owner or an admin" in other.stderr, (other.stdout, other.stderr)
        r = tpassctl("snapshot", str(job_id), "--wait", "90", "--json", user=job_user.name, timeout=120)
        assert r.returncode == 0, diagnosis(cluster, job_id, out_path, f"{what}: {r.stdout} {r.stderr}")
        taken = json.loads(r.stdout)
        done = taken["event"]["data"]
        sid = taken["snapshot"]
        assert done["snapshot"] == sid and done["bytes"] > 0 and done["ranks"] == JOB.ranks, done

        final = tj.wait_end(job_id, 300, context=f"{what}: ")
        diag = diagnosis(cluster, job_id, out_path, what)
        assert final["job_state"][0] == "COMPLETED", diag
        assert final["exit_code"]["return_code"]["number"] == 0 and int(final.get("restart_cnt", 0)) == 0, diag
        assert tj.per_step(tj.steps(out_path.read_text())) == ref, diag
        assert at < done["step"] <= STEPS, diag  # optimizer steps done at T; step=at was printed before
        print(f"snapshot {sid} at step {done['step']} (asked at {at}): training stood still {done['pause_s']}s, "
              f"{done['bytes'] / 1e6:.1f} MB, phases {done['phase_durations']}")

        mine = tpassctl("snapshots", str(job_id), "--json", user=job_user.name)
        assert mine.returncode == 0, mine.stderr
        (row,) = json.loads(mine.stdout)["snapshots"]
        assert (row["snapshot"], row["step"], row["bytes"], row["ranks"]) == (sid, done["step"], done["bytes"], 3)
        theirs = tpassctl("snapshots", str(job_id), "--json", user=other_user.name)
        assert theirs.returncode == 0 and json.loads(theirs.stdout)["snapshots"] == [], theirs.stdout

        manifest = json.loads(Path(row["manifest"]).read_text())  # as root
        for part in manifest["ranks"]:
            images = Path(part["images"])
            for d in (images, images.parent):
                st = d.stat()
                assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700, (d, oct(st.st_mode))
        assert sorted(p["node"] for p in manifest["ranks"]) == list(JOB.training_nodes)

        gone = tpassctl("snapshots", str(job_id), "--delete", sid, user=job_user.name, timeout=60)
        assert gone.returncode == 0, gone.stderr
        assert not any(Path(p["images"]).exists() for p in manifest["ranks"])
        assert not Path(row["manifest"]).exists()
        assert [e for e in events(cluster, job_id) if e["kind"] == "snapshot.completed"], diag
    finally:
        leave_clean(JOB, jobs)
