"""A node a rank moved away from leaves the job: it can be repaired, even crashed, and the job goes on.

The job is ``sbatch -N4 --torchpass=spares=1`` of the 3-rank gloo DDP example (examples/train_ddp.py,
unchanged, as the ordinary job user; no ``--no-kill``): node1..node3 train, node4 is the hot spare.
One fault-free run of the same job (module fixture) is the reference: per-step losses as float.hex,
every step exactly once per rank.

A random training node that is not the batch host (node1, where the batch script and the
coordinator run) is moved to the spare with ``tpassctl migrate`` at a random step. Its launch
wrapper leaves the node once the rank runs on the spare (srun collects the rank's exit code), so
the migration's completion event says the source was ``released``: it is no longer in the job's
node list, an admin can take it out of service and give it back to Slurm (drain, resume: IDLE)
without touching the job, and ``tpassctl devcluster crash`` of it (a power cut) leaves the job
alone: it completes COMPLETED 0:0 under its id, Restarts=0, with the reference's losses.

Randomness: the node and step come from one seed, printed at the start and in every assertion
message; ``TORCHPASS_TEST_SEED=N`` replays a run.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from pathlib import Path

import pytest

import drill
import training_jobs as tj
from slurm_helpers import tpassctl
from support.wait import until
from training_jobs import TPASSCTL
from training_jobs import run as _run

pytestmark = pytest.mark.integration

STEPS = 200
BATCH_HOST = "node1"
MOVABLE = ("node2", "node3")  # the training nodes that are not the batch host
SPARE = "node4"
MOVE_AT = (3, 30)  # early enough for the move, the release and the crash to come before training ends
SEED = int(os.environ.get("TORCHPASS_TEST_SEED") or time.time_ns() % 1_000_000)


def _diag(cluster, job_id: int, out_path: Path, what: str) -> str:
    return drill.diagnosis(cluster, job_id, out_path, f"seed={SEED} ({what}; replay with TORCHPASS_TEST_SEED={SEED})")


@pytest.fixture(scope="module")
def reference(cluster, plugin_built, jobs_base, job_user) -> dict:
    print(f"\ntest_source_release seed={SEED} (replay: TORCHPASS_TEST_SEED={SEED})")
    return tj.reference_run(jobs_base, job_user, "test_source_release", STEPS, context=f"seed={SEED}: ")


def test_a_released_source_node_can_be_crashed_and_the_job_completes_unchanged(cluster, reference, job_dir,
                                                                              job_user):
    rng = random.Random(f"{SEED}:release")
    node, at = rng.choice(MOVABLE), rng.randint(*MOVE_AT)
    what = f"tpassctl migrate {node} --to {SPARE} at step {at}, then devcluster crash {node}"
    print(f"\n{what} (seed={SEED})")
    job_id = tj.submit(job_dir, "rel", STEPS, nodes=4, user=job_user.name)
    out_path = job_dir / f"rel.{job_id}.out"
    crashed = False
    try:
        drill.wait_step(cluster, job_id, out_path, at, f"seed={SEED}: {what}")
        assert tj.job(job_id)["batch_host"] == BATCH_HOST, _diag(cluster, job_id, out_path, what)
        r = tpassctl("migrate", str(job_id), "--node", node, "--to", SPARE, "--json", user=job_user.name)
        assert r.returncode == 0, (r.stdout, r.stderr, SEED)
        mid = json.loads(r.stdout)["migration"]

        def completed() -> dict | None:
            done = [e for e in drill.events(cluster, job_id)
                    if e["kind"] == "migration.completed" and e["data"]["migration"] == mid]
            return done[0] if done else None

        t0 = time.monotonic()
        try:
            done = until(completed, f"migration {mid}'s completion", 120, every=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_diag(cluster, job_id, out_path, what)}") from None
        diag = _diag(cluster, job_id, out_path, what)
        print(f"{done['message']} ({time.monotonic() - t0:.1f} s after tpassctl migrate)")
        assert done["data"]["node"] == node and done["data"]["target"] == SPARE, diag
        moved = re.search(r"moved ranks \[(\d+)\]", done["message"])  # one rank per node
        assert moved is not None, diag
        moved = moved.group(1)
        # The events say the source left the job, and Slurm agrees.
        assert done["data"]["source"] == "released", (done["data"], diag)
        assert f"{node} not drained and released" in done["message"], diag
        assert node not in tj.run(["scontrol", "show", "hostnames", tj.job(job_id)["nodes"]]).stdout.split(), diag
        steps = json.loads(_run(["squeue", "--steps", "--json"]).stdout or "{}").get("steps", [])
        print("after the release, slurmctld lists the job's steps as "
              + str([(st.get("id"), st.get("name"), st.get("nodes")) for st in steps
                     if str(st.get("id", "")).startswith(f"{job_id}.")]))
        # The moved rank's launch wrapper said it left (srun collects its exit code).
        assert f"its task leaves {node}" in out_path.read_text(), diag

        # An admin takes it out for repair and gives it back, without touching the job.
        until(lambda: tj.node(node)["state"] == ["IDLE"], f"{node} idle once out of the job", 30, every=0.2)
        for state in ("DRAIN", "RESUME"):
            upd = _run(["scontrol", "update", f"NodeName={node}", f"State={state}"]
                       + (["Reason=repair after a torchpass move"] if state == "DRAIN" else []))
            assert upd.returncode == 0, (upd.stderr, diag)
        until(lambda: tj.node(node)["state"] == ["IDLE"], f"{node} back in service", 30, every=0.2)
        assert tj.job(job_id)["job_state"] == ["RUNNING"], diag

        # A power cut of the released node: the job does not notice.
        crash = _run([*TPASSCTL, "devcluster", "crash", node, "--name", cluster.spec.name])
        crashed = True
        assert crash.returncode == 0, (crash.stdout, crash.stderr, diag)
        last = tj.steps(out_path.read_text())[-1]
        print(f"{node} crashed at {last.split()[0]}")

        final = tj.wait_end(job_id, 300, context=f"seed={SEED}: ")
        diag = _diag(cluster, job_id, out_path, what)
        assert final["job_id"] == job_id, diag
        assert final["job_state"][0] == "COMPLETED", (final["job_state"], final.get("state_reason"), diag)
        assert final["exit_code"]["return_code"]["number"] == 0, diag
        assert int(final.get("restart_cnt", 0)) == 0, diag
        assert tj.per_step(tj.steps(out_path.read_text())) == reference["per_step"], diag
        # srun's exit hook collected the moved rank's exit code (its wrapper on the source had left).
        assert f"moved rank {moved} ended with exit code 0 on {SPARE} (ended)" in out_path.read_text(), diag
        kinds = [e["kind"] for e in drill.events(cluster, job_id)]
        assert "node.lost" not in kinds and "job.requeuing" not in kinds, (kinds, diag)
    finally:
        _run(["scancel", str(job_id)])
        if crashed:
            _run([*TPASSCTL, "devcluster", "revive", node, "--name", cluster.spec.name])
            cluster.refresh()  # the revived node's new slurmd pid, for later modules' exec_on
            until(lambda: "DOWN" not in tj.node(node)["state"], f"{node}'s slurmd registered again", 90,
                  every=0.2)
        if set(tj.node(node)["state"]) & {"DRAIN", "DOWN"}:
            _run(["scontrol", "update", f"NodeName={node}", "State=RESUME"])
        tj.wait_end(job_id, 60)
        until(lambda: all(tj.node(n)["state"] == ["IDLE"] for n in (BATCH_HOST, *MOVABLE, SPARE)),
              "every node idle after the test", 90, every=0.5)
