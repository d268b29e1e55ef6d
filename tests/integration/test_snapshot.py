"""Whole-job snapshots, leave-running, of a 3-node job, as the ordinary job user.

`tpassctl snapshot` at a random step: every rank pauses at one collective and is dumped by its node's
tpassd, then resumes in place; the job ends COMPLETED 0:0, never requeued, with the losses of the same
script under plain sbatch bit for bit (float.hex). `tpassctl snapshots` lists the snapshot with the
event's step and size; the images are root's alone; another user can neither take nor list one; the
owner deletes it. The seed is printed (replay: TORCHPASS_TEST_SEED).

`--torchpass=snapshot_every=S`: the coordinator takes one every S seconds of training by itself,
each a short pause reported in its event, keeping the policy's newest `snapshot_keep`; the losses
are again the plain run's. Both tests share one plain reference run (the periodic job only sleeps
longer per step, which changes no loss)."""

from __future__ import annotations

import json
import os
import random
import stat
import time
from pathlib import Path

import pytest

import training_jobs as tj
from conftest import make_job_dir
from drill import Drill, diagnosis, events, leave_clean, reference, submit, wait_step
from slurm_helpers import job_id_of, sbatch, tpassctl
from support.wait import until
from torchpass import layout

NODES = ("node1", "node2", "node3", "node4")

pytestmark = pytest.mark.integration

SEED = int(os.environ.get("TORCHPASS_TEST_SEED") or time.time_ns() % 1_000_000)
STEPS = 80
JOB = Drill("snapshot", "", ("--steps", str(STEPS), "--params", "1M", "--sleep", "0.05"), STEPS, nodes=3,
            fault_steps=(5, 30))
# The same training at 0.25 s a step (>= 20 s): room for several periodic snapshots 2 s apart.
PERIODIC = Drill("snapshot", "", ("--steps", str(STEPS), "--params", "1M", "--sleep", "0.25"), STEPS, nodes=3)
EVERY_S = 2  # the devcluster's plugstack.conf allows snapshot_every_min_s=1


@pytest.fixture(scope="module")
def ref(cluster, plugin_built, jobs_base, job_user) -> dict:
    """The plain sbatch run's loss per step, once for the module."""
    jobs: list[int] = []
    try:
        return reference(JOB, make_job_dir(jobs_base, "snapshot-ref", job_user), job_user.name, jobs)
    finally:
        leave_clean(JOB, jobs)


def test_snapshot_leaves_the_job_running_bit_identical(cluster, ref, job_dir, job_user, other_user):
    jobs: list[int] = []
    at = random.Random(f"{SEED}:snapshot").randint(*JOB.fault_steps)
    what = f"seed={SEED} (replay with TORCHPASS_TEST_SEED={SEED}): snapshot at step {at}"
    print(f"\n{what}")
    try:
        job_id = submit(JOB, job_dir, "snap", "spares=1", job_user.name)
        jobs.append(job_id)
        out_path = job_dir / f"snap.{job_id}.out"
        wait_step(cluster, job_id, out_path, at, what)

        other = tpassctl("snapshot", str(job_id), user=other_user.name)
        assert other.returncode == 4 and "only its owner or an admin" in other.stderr, (other.stdout, other.stderr)
        r = tpassctl("snapshot", str(job_id), "--wait", "90", "--json", user=job_user.name, timeout=120)
        assert r.returncode == 0, diagnosis(cluster, job_id, out_path, f"{what}: {r.stdout} {r.stderr}")
        lines = [json.loads(ln) for ln in r.stdout.splitlines()]  # JSON lines: started, each phase, the outcome
        seen = [ln["phase"] for ln in lines if "phase" in ln]  # polled: a phase shorter than a poll may not show
        assert seen and set(seen) <= {"queued", "pause", "dump", "resume"}, lines
        taken = lines[-1]
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
        # another user's job: not found, as for a job that does not exist (nothing of it is listed)
        assert theirs.returncode == 4 and "snapshots" not in json.loads(theirs.stdout), theirs.stdout

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


def test_periodic_snapshots_every_few_seconds_keep_the_newest(cluster, ref, job_dir, job_user):
    jobs: list[int] = []
    try:
        job_id = submit(PERIODIC, job_dir, "every", f"spares=1,snapshot_every={EVERY_S}", job_user.name)
        jobs.append(job_id)
        out_path = job_dir / f"every.{job_id}.out"
        final = tj.wait_end(job_id, 300, context="periodic snapshots: ")
        diag = diagnosis(cluster, job_id, out_path, f"snapshot_every={EVERY_S}")
        assert final["job_state"][0] == "COMPLETED", diag
        assert final["exit_code"]["return_code"]["number"] == 0 and int(final.get("restart_cnt", 0)) == 0, diag
        assert tj.per_step(tj.steps(out_path.read_text())) == ref, diag

        evs = events(cluster, job_id)
        asked = [e["data"] for e in evs if e["kind"] == "snapshot.requested"]
        done = [e["data"] for e in evs if e["kind"] == "snapshot.completed"]
        assert not [e for e in evs if e["kind"] == "snapshot.failed"], diag
        assert len(done) >= 2, diag  # >= 20 s of training, one every 2 s of it
        assert all(a["trigger"] == "periodic" and a["every_s"] == EVERY_S for a in asked), asked
        assert [d["snapshot"] for d in done] == [a["snapshot"] for a in asked][:len(done)], (asked, done)
        assert all(d["trigger"] == "periodic" and d["pause_s"] > 0 and d["ranks"] == PERIODIC.ranks for d in done)
        steps = [d["step"] for d in done]
        assert steps == sorted(set(steps)), steps  # each later in training than the one before
        # training ran at least EVERY_S between one snapshot's end and the next one's request
        ends = [e["time"] for e in evs if e["kind"] == "snapshot.completed"]
        starts = [e["time"] for e in evs if e["kind"] == "snapshot.requested"]
        assert all(b - a >= EVERY_S - 0.05 for a, b in zip(ends, starts[1:])), (ends, starts)
        print(f"{len(done)} periodic snapshots: steps {steps}, training stood still "
              f"{[d['pause_s'] for d in done]} s, {[round(d['bytes'] / 1e6, 1) for d in done]} MB")

        listed = tpassctl("snapshots", str(job_id), "--json", user=job_user.name)
        assert listed.returncode == 0, listed.stderr
        kept = [row["snapshot"] for row in json.loads(listed.stdout)["snapshots"]]
        assert sorted(kept) == sorted(d["snapshot"] for d in done[-2:]), (kept, done)  # snapshot_keep = 2
        for sid in kept:
            gone = tpassctl("snapshots", str(job_id), "--delete", sid, user=job_user.name, timeout=60)
            assert gone.returncode == 0, gone.stderr
    finally:
        leave_clean(PERIODIC, jobs)


def test_stop_frees_the_nodes_and_resume_goes_on_at_the_same_step(cluster, ref, jobs_base, job_dir, job_user,
                                                                  other_user):
    """`tpassctl snapshot --stop` at a random step (seed printed): the job is held under its id and its
    nodes are free: another user's job runs on all four of them meanwhile. Neither that user nor
    anyone but the owner may resume it. `tpassctl resume`: the batch script runs again from the top,
    its srun restores every rank from the snapshot, and the job ends COMPLETED 0:0 under the same
    id, every step printed exactly once per rank with the plain run's losses bit for bit: the steps
    before the stop kept in the output file, the ones after it printed by the restored ranks."""
    jobs: list[int] = []
    at = random.Random(f"{SEED}:stop").randint(*JOB.fault_steps)
    what = f"seed={SEED} (replay with TORCHPASS_TEST_SEED={SEED}): snapshot --stop at step {at}"
    print(f"\n{what}")
    try:
        job_id = submit(JOB, job_dir, "stop", "spares=1", job_user.name)
        jobs.append(job_id)
        out_path = job_dir / f"stop.{job_id}.out"
        wait_step(cluster, job_id, out_path, at, what)
        r = tpassctl("snapshot", str(job_id), "--stop", "--wait", "90", "--json", user=job_user.name, timeout=120)
        assert r.returncode == 0, diagnosis(cluster, job_id, out_path, f"{what}: {r.stdout} {r.stderr}")
        stopping = json.loads(r.stdout.splitlines()[-1])["event"]
        sid, step = stopping["data"]["snapshot"], stopping["data"]["step"]
        t_stop = time.monotonic()

        def held():
            j = tj.job(job_id)
            return j if "PENDING" in j["job_state"] and j.get("hold") else None

        j = until(held, "the job requeued and held", 60, every=0.5)
        print(f"job {job_id} stopped with snapshot {sid} at step {step}: {j['job_state']} ({j['state_reason']}), "
              f"{time.monotonic() - t_stop:.1f} s after the stop was complete")
        assert at < step <= STEPS, stopping

        # its nodes are free: another user's job runs on all four of them
        theirs_dir = make_job_dir(jobs_base, "stop-other", other_user)
        other = job_id_of(sbatch(["-N4", "-o", str(theirs_dir / "other.%j.out")], "#!/bin/bash\nsrun hostname\n",
                                 cwd=theirs_dir, user=other_user.name))
        jobs.append(other)
        done = tj.wait_end(other, 120, context="the other user's job on the freed nodes: ")
        assert done["job_state"][0] == "COMPLETED" and tj.job(job_id)["job_state"] == ["PENDING"], done
        assert sorted(set((theirs_dir / f"other.{other}.out").read_text().split())) == list(NODES)

        theirs = tpassctl("resume", str(job_id), user=other_user.name)
        assert theirs.returncode == 4 and "only its owner or an admin" in theirs.stderr, theirs.stderr
        # --wait: until every rank is restored from the snapshot and resumed (exit 0)
        t_resume = time.monotonic()
        mine = tpassctl("resume", str(job_id), "--wait", "240", user=job_user.name, timeout=300)
        assert mine.returncode == 0 and sid in mine.stdout, (mine.stdout, mine.stderr)
        assert f"{sid}: starting" in mine.stdout and "resumed" in mine.stdout.splitlines()[-1], mine.stdout
        print(f"resume --wait: exit 0 after {time.monotonic() - t_resume:.1f} s")
        final = tj.wait_end(job_id, 300, context=f"{what}: resumed: ")
        diag = diagnosis(cluster, job_id, out_path, what)
        assert final["job_id"] == job_id and final["job_state"][0] == "COMPLETED", diag
        assert final["exit_code"]["return_code"]["number"] == 0, diag
        # every step exactly once per rank, bit for bit the plain run's: the ones before the stop are
        # still in the output file, the rest the restored ranks printed
        assert tj.per_step(tj.steps(out_path.read_text())) == ref, diag
        kinds = [e["kind"] for e in events(cluster, job_id)]
        for kind in ("job.stopping", "job.resuming", "job.restored", "job.resumed"):
            assert kind in kinds, (kind, diag)
        (resumed,) = [e for e in events(cluster, job_id) if e["kind"] == "job.resumed"]
        assert resumed["data"]["snapshot"] == sid and resumed["data"]["snapshot_step"] == step, diag
        print(f"resumed: every rank back {resumed['data']['decision_to_resumed_s']} s after the coordinator started; "
              f"Restarts={final.get('restart_cnt')}")
        assert not layout.stopped_file(cluster.state_dir, job_id).exists()  # a later requeue starts afresh
    finally:
        leave_clean(JOB, jobs)
