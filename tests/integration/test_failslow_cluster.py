"""Fail-slow end to end on the devcluster: a node that only slows down moves to the spare.

Every job is ``sbatch -N4 --torchpass=spares=1`` of the 3-rank gloo DDP example
(examples/train_ddp.py, unchanged, as the ordinary job user): node1..node3 train, node4 is the
hot spare. One fault-free run of the same job (module fixture) is the reference: per-step
losses as float.hex, every step exactly once per rank. The policy is the default one.

* ``tpassctl devcluster slow NODE --cpu 10`` on a random training node (not the batch host,
  where the coordinator runs) at a random step: first the ranks' own reported figures
  (job.status's compute per node) show its ranks computing at least 1.5x their peers' median; then the
  coordinator records ``failslow.detected`` and moves the node's rank to the spare; the job
  completes COMPLETED 0:0, Restarts=0, with the reference's losses.
* a slowdown of every training node for longer than the rule's sustain time, then a slowdown
  of one node ``--for 5``: nothing moves, and the job completes with the reference's losses.

Randomness: the node and step come from one seed, printed at the start and in every assertion
message; ``TORCHPASS_TEST_SEED=N`` replays a run.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from pathlib import Path

import pytest

import drill
import training_jobs as tj
from torchpass import auth, zmqio
from torchpass.coordinator.policy import CoordinatorPolicy
from tpassctl.status_cmd import job_registration
from training_jobs import TPASSCTL
from training_jobs import run as _run

pytestmark = pytest.mark.integration

# Long enough for the slowest plan: a random start, a whole-job slowdown of 23 s (steps about
# twice as long), a short one, and the rule's 30 steps after it.
STEPS = 250
TRAINING_NODES = ("node1", "node2", "node3")  # node1 is the batch host (the coordinator runs there)
SLOWABLE = ("node2", "node3")
SPARE = "node4"
CPU_PCT = 10
SLOW_AT = (5, 30)
POLICY = CoordinatorPolicy()
SEED = int(os.environ.get("TORCHPASS_TEST_SEED") or time.time_ns() % 1_000_000)


def _rng(name: str) -> random.Random:
    return random.Random(f"{SEED}:{name}")


def _diag(cluster, job_id: int, out_path: Path, what: str) -> str:
    return drill.diagnosis(cluster, job_id, out_path, f"seed={SEED} ({what}; replay with TORCHPASS_TEST_SEED={SEED})")


def _last_step(out_path: Path) -> int:
    lines = tj.steps(out_path.read_text()) if out_path.exists() else []
    return int(lines[-1].split()[0].split("=")[1]) if lines else -1


def _slow(cluster, node: str, cpu: str, *extra: str) -> None:
    r = _run([*TPASSCTL, "devcluster", "slow", node, "--cpu", cpu, "--name", cluster.spec.name, *extra])
    assert r.returncode == 0, (SEED, r.stdout, r.stderr)


def _assert_finished_unchanged(cluster, job_id: int, out_path: Path, reference: dict, what: str) -> str:
    final = tj.wait_end(job_id, 300, context=f"seed={SEED}: ")
    diag = _diag(cluster, job_id, out_path, what)
    assert final["job_state"][0] == "COMPLETED", diag
    assert final["exit_code"]["return_code"]["number"] == 0, diag
    assert int(final.get("restart_cnt", 0)) == 0, diag
    assert tj.per_step(tj.steps(out_path.read_text())) == reference["per_step"], diag
    return diag


def _job_status(cluster, job_id: int) -> dict:
    """The coordinator's job.status, asked as tpassctl status asks it (root, munge)."""
    info = job_registration(cluster.state_dir, job_id)
    return zmqio.request(info["endpoint"], "job.status", {}, timeout_s=2.0, retries=1,
                         auth=auth.optional_credential_for("job.status", {}, auth.job_target(job_id)))


def _compute_ratio(cluster, job_id: int, node: str) -> tuple[float, float, float] | None:
    """(ratio, the node's compute per step, the other nodes' median) from the figures the ranks
    reported (job.status: per node, its slowest rank's median over its newest steps); None until
    every training node has figures."""
    try:
        per_node = _job_status(cluster, job_id).get("compute_per_node_s") or {}
    except Exception:  # noqa: BLE001 - not registered yet, or a slow answer: ask again
        return None
    peers = [s for n, s in per_node.items() if n != node]
    if node not in per_node or len(peers) < len(TRAINING_NODES) - 1:
        return None
    base = statistics.median(peers)
    return (per_node[node] / base if base > 0 else float("inf")), per_node[node], base


@pytest.fixture(scope="module")
def reference(cluster, plugin_built, jobs_base, job_user) -> dict:
    print(f"\ntest_failslow seed={SEED} (replay: TORCHPASS_TEST_SEED={SEED})")
    return tj.reference_run(jobs_base, job_user, "test_failslow", STEPS, context=f"seed={SEED}: ")


@pytest.fixture
def unslowed(cluster):
    """Every node's quota lifted and every job of the test cancelled, whatever happened."""
    jobs: list[int] = []
    yield jobs
    for n in (*TRAINING_NODES, SPARE):
        _run([*TPASSCTL, "devcluster", "slow", n, "--cpu", "clear", "--name", cluster.spec.name])
    for j in jobs:
        _run(["scancel", str(j)])
    end = time.monotonic() + 60
    while time.monotonic() < end and any(tj.node(n)["state"] != ["IDLE"] for n in (*TRAINING_NODES, SPARE)):
        time.sleep(0.5)
    for n in (*TRAINING_NODES, SPARE):
        st = tj.node(n)
        if "DRAIN" in st["state"] and st.get("reason", "").startswith("torchpass"):
            _run(["scontrol", "update", f"NodeName={n}", "State=RESUME"])


def test_a_slowed_node_moves_to_the_spare_bit_identical(cluster, reference, job_dir, unslowed, job_user):
    rng = _rng("slow")
    node, at = rng.choice(SLOWABLE), rng.randint(*SLOW_AT)
    what = f"{node} slowed to {CPU_PCT} % of a CPU at step {at}"
    print(f"\n{what} (seed={SEED})")
    job_id = tj.submit(job_dir, "slow", STEPS, nodes=4, user=job_user.name)
    unslowed.append(job_id)
    out_path = job_dir / f"slow.{job_id}.out"
    drill.wait_step(cluster, job_id, out_path, at, f"seed={SEED}: {what}")
    slowed_wall = time.time()
    _slow(cluster, node, str(CPU_PCT))

    # First: the ranks' own figures say the node computes at least 1.5x its peers (before the move).
    measured, got, end = None, None, time.monotonic() + 60
    while time.monotonic() < end:
        got = _compute_ratio(cluster, job_id, node)
        if got is not None and got[0] >= 1.5:
            measured = got
            break
        time.sleep(0.5)
    assert measured is not None, _diag(cluster, job_id, out_path, what + f": never 1.5x (last {got})")
    print(f"measured: {node} {measured[1] * 1000:.1f} ms per step against its peers' "
          f"{measured[2] * 1000:.1f} ms ({measured[0]:.2f}x)")

    diag = _assert_finished_unchanged(cluster, job_id, out_path, reference, what)
    events = drill.events(cluster, job_id)
    detected = [e for e in events if e["kind"] == "failslow.detected"]
    assert len(detected) == 1 and detected[0]["data"]["node"] == node, diag
    d = detected[0]["data"]
    assert d["ratio"] >= POLICY.failslow_ratio and d["peers_median_s"] > 0, diag
    started = [e for e in events if e["kind"] == "migration.started"]
    assert [(e["data"]["node"], e["data"]["trigger"]) for e in started] == [(node, "failslow")], diag
    completed = [e["data"] for e in events if e["kind"] == "migration.completed"]
    assert [(c["node"], c["target"]) for c in completed] == [(node, SPARE)], diag
    print(f"decision: {started[0]['time'] - slowed_wall:.1f} s from the slowdown to migration.started "
          f"({d['ratio']}x, {d['node_compute_s'] * 1000:.1f} ms against {d['peers_median_s'] * 1000:.1f} ms)")


def test_a_job_wide_or_short_slowdown_moves_nothing(cluster, reference, job_dir, unslowed, job_user):
    rng = _rng("noslow")
    node, at = rng.choice(SLOWABLE), rng.randint(*SLOW_AT)
    whole_s = POLICY.failslow_sustain_s + 8  # past the sustain time and the windows' steps
    what = f"every training node slowed for {whole_s:g} s at step {at}, then {node} --for 5"
    print(f"\n{what} (seed={SEED})")
    job_id = tj.submit(job_dir, "noslow", STEPS, nodes=4, user=job_user.name)
    unslowed.append(job_id)
    out_path = job_dir / f"noslow.{job_id}.out"
    drill.wait_step(cluster, job_id, out_path, at, f"seed={SEED}: {what}")
    for n in TRAINING_NODES:
        _slow(cluster, n, str(CPU_PCT))
    time.sleep(whole_s)
    for n in TRAINING_NODES:
        _slow(cluster, n, "clear")
    _slow(cluster, node, str(CPU_PCT), "--for", "5")
    time.sleep(5)
    # The job trains on after the plan, for at least the rule's windows of steps (the slow
    # figures leave them): a job that had ended would prove nothing.
    after = _last_step(out_path)
    windows = POLICY.failslow_window_steps * POLICY.failslow_windows
    assert after < STEPS - windows, _diag(cluster, job_id, out_path, what + f": at step {after} after the plan")

    diag = _assert_finished_unchanged(cluster, job_id, out_path, reference, what)
    kinds = [e["kind"] for e in drill.events(cluster, job_id)]
    assert "failslow.detected" not in kinds and "migration.started" not in kinds, diag
    print(f"the plan ended at step {after} of {STEPS}")
