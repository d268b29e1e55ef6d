"""Live migration end to end on the devcluster.

Every job is ``sbatch -N4 --torchpass=spares=1`` of a 3-rank gloo DDP job
(examples/train_ddp.py, unchanged): node1..node3 train, node4 is the hot
spare. One fault-free run of the same job (module fixture) is the reference
every test compares with: per-step losses as float.hex, every step exactly
once per rank.

* a fault drill on a random training node at a random step: the rank there
  is paused, CRIU-dumped, restored on the spare inside a job step of the
  same job, the source copy killed, the group rebuilt; the job keeps its id,
  Restarts=0, COMPLETED 0:0, the reference's losses; the node is drained
  with a torchpass reason, by its own tpassd (its audit line), and the
  events carry the phase durations;
* the restore made to fail on the spare (the ``restore-fail`` drill corrupts
  the verified image, the restore step's BLAKE3 check refuses it): the
  coordinator rolls back, training resumes on the source, the job finishes
  unchanged, the events say why, the node is neither drained nor retried;
* ``tpassctl migrate`` moves a healthy rank on request, and refuses bad
  requests with a clear message; the healthy node is drained only when an
  admin asked (docs/tpassd.md, "Drains").

Randomness: the node and step come from one seed, printed at the start and
in every assertion message; ``TORCHPASS_TEST_SEED=N`` replays a run.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path

import pytest

import training_jobs as tj
from slurm_helpers import tpassctl
from torchpass import layout
from training_jobs import TPASSCTL, drain_audit
from training_jobs import job as _job
from training_jobs import node as _node
from training_jobs import per_step as _per_step
from training_jobs import run as _run
from training_jobs import steps as _steps

pytestmark = pytest.mark.integration

STEPS = 150
TRAINING_NODES = ("node1", "node2", "node3")  # node1 is the batch host (the coordinator runs there)
SPARE = "node4"
# The drill must come early enough for the move to finish before training does:
# detection (~1 tpassd interval) + T = max + 64 collectives (2 per step) ~ 40 steps.
FAULT_STEPS = (2, 80)
SEED = int(os.environ.get("TORCHPASS_TEST_SEED") or time.time_ns() % 1_000_000)


def _rng(name: str) -> random.Random:
    """One generator per test, so a test's draw does not depend on which tests ran before it."""
    return random.Random(f"{SEED}:{name}")


def _submit(job_dir: Path, tag: str, user=None) -> int:
    """As ``user`` (a JobUser: the tests' ordinary job user; root if None)."""
    return tj.submit(job_dir, tag, STEPS, nodes=4, user=user and user.name)


def _wait_end(job_id: int, timeout_s: float = 240) -> dict:
    return tj.wait_end(job_id, timeout_s, context=f"seed={SEED}: ")


def _wait_step(out_path: Path, step: int, timeout_s: float = 120) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if out_path.exists() and f"step={step} " in out_path.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"seed={SEED}: {out_path.name} did not reach step {step}: "
                         + (out_path.read_text()[-3000:] if out_path.exists() else "no output"))


def _events(cluster, job_id: int) -> list[dict]:
    p = layout.events_json(cluster.state_dir, job_id)
    return json.loads(p.read_text()) if p.exists() else []


def _images_left(cluster, job_id: int) -> list[str]:
    """Snapshot directories of the job still in the tpassds' (shared) snapshot_dir (each move discards its own)."""
    return [str(p) for p in layout.snapshot_job_dir(cluster.snapshot_dir, job_id).glob("rank*")]


def _diag(cluster, job_id: int, out_path: Path, what: str) -> str:
    coord_log = layout.coordinator_log(cluster.state_dir, job_id)
    return (f"seed={SEED} ({what}; replay with TORCHPASS_TEST_SEED={SEED})\n"
            + (out_path.read_text()[-3000:] if out_path.exists() else "no job output")
            + "\n--- events ---\n" + "\n".join(f"{e['kind']}: {e['message']}" for e in _events(cluster, job_id))
            + "\n--- coordinator.log ---\n" + (coord_log.read_text()[-6000:] if coord_log.exists() else ""))


def _assert_finished_unchanged(cluster, job_id: int, out_path: Path, reference: dict, what: str) -> str:
    """COMPLETED 0:0, never requeued, the reference's losses: every step exactly once per rank."""
    final = _wait_end(job_id)
    diag = _diag(cluster, job_id, out_path, what)
    assert final["job_id"] == job_id, diag
    assert final["job_state"][0] == "COMPLETED", diag
    assert final["exit_code"]["return_code"]["number"] == 0, diag
    assert int(final.get("restart_cnt", 0)) == 0, diag
    assert _per_step(_steps(out_path.read_text())) == reference["per_step"], diag
    return diag


@pytest.fixture(scope="module")
def reference(cluster, plugin_built, jobs_base, job_user) -> dict:
    """The fault-free run of the job (as the job user), once per process for every module of
    train_ddp.py on 4 nodes (training_jobs.reference_run; test_full_disk imports this fixture)."""
    print(f"\ntest_migration seed={SEED} (replay: TORCHPASS_TEST_SEED={SEED})")
    return tj.reference_run(jobs_base, job_user, "test_migration", STEPS, context=f"seed={SEED}: ")


@pytest.fixture
def clean(cluster):
    """Leaves the cluster as the next test expects it: no job of ours, no drill
    armed, no torchpass drain, every tpassd healthy, every node idle."""
    jobs: list[int] = []
    yield jobs
    for j in jobs:
        _run(["scancel", str(j)])
    for n in (*TRAINING_NODES, SPARE):
        _run([*TPASSCTL, "inject", "--node", n, "--fault", "clear"])
        st = _node(n)
        if "DRAIN" in st["state"] and st.get("reason", "").startswith("torchpass"):
            _run(["scontrol", "update", f"NodeName={n}", "State=RESUME"])
    end = time.monotonic() + 60
    while time.monotonic() < end:
        health = json.loads(_run([*TPASSCTL, "nodes", "--json"]).stdout or "{}").get("nodes", [])
        idle = all(_node(n)["state"] == ["IDLE"] for n in (*TRAINING_NODES, SPARE))
        if idle and health and all(r["state"] == "healthy" for r in health):
            return
        time.sleep(0.5)
    raise AssertionError("cluster not clean after the test: "
                         f"{[(n, _node(n)['state']) for n in (*TRAINING_NODES, SPARE)]}"
                         f" health {health}")


@pytest.mark.parametrize("as_root", [False, True], ids=["job-user", "root-job"])
def test_fault_drill_on_random_node_at_random_step_migrates_bit_identical(cluster, reference, job_dir, clean,
                                                                          job_user, as_root):
    """An ordinary user's job, and (the suite's one root job that migrates) root's."""
    rng = _rng("drill" if not as_root else "drill-root")
    node, at = rng.choice(TRAINING_NODES), rng.randint(*FAULT_STEPS)
    what = f"ecc-sbe-storm on {node} at step {at}" + (" (root's job)" if as_root else "")
    print(f"\n{what} (seed={SEED})")
    job_id = _submit(job_dir, "mig", None if as_root else job_user)
    clean.append(job_id)
    out_path = job_dir / f"mig.{job_id}.out"
    _wait_step(out_path, at)
    inj = _run([*TPASSCTL, "inject", "--node", node, "--fault", "ecc-sbe-storm"])
    assert inj.returncode == 0, (SEED, inj.stderr)

    diag = _assert_finished_unchanged(cluster, job_id, out_path, reference, what)
    # The node was drained with the torchpass reason, by its own tpassd, which saw it degraded.
    n = _node(node)
    assert "DRAIN" in n["state"], (n["state"], diag)
    assert n["reason"].startswith("torchpass: "), (n["reason"], diag)
    audit = drain_audit(cluster, node, job_id)
    assert [(a["outcome"], a["health"], a["reason"]) for a in audit] == [("ok", "degraded", n["reason"])], (audit, diag)
    # The events name the phases and their durations.
    events = _events(cluster, job_id)
    done = [e for e in events if e["kind"] == "migration.completed"]
    assert len(done) == 1, diag
    assert done[0]["data"]["node"] == node and done[0]["data"]["target"] == SPARE, diag
    assert _images_left(cluster, job_id) == [], diag
    pd = done[0]["data"]["phase_durations"]
    for ph in ("detect", "pause", "dump", "transfer", "restore", "kill_source", "rebuild", "paused", "total"):
        assert ph in pd, (pd, diag)
    print(f"migration {node} -> {SPARE} (drill at step {at}): phases {pd}"
          f" tools {done[0]['data'].get('tool_durations')}")
    # The coordinator's summary reached the batch host's tpassd (its last one as it stopped) and
    # is on its /metrics, without job_id: the devcluster's slurm.conf has PrivateData=jobs.
    text = _batch_host_metrics(cluster, 'tpassd_job_migrations_total{outcome="completed"}')
    assert "job_id=" not in text, diag
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr


def _batch_host_metrics(cluster, sample: str, timeout_s: float = 30.0) -> str:
    """node1's (the batch host's) /metrics once ``sample`` is at least 1 there."""
    import urllib.request

    url = f"http://{cluster.node_address('node1')}:{cluster.spec.tpassd_ports[2]}/metrics"
    end = time.monotonic() + timeout_s
    while True:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        got = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(sample + " ")]
        if (got and got[0] >= 1) or time.monotonic() > end:
            assert got and got[0] >= 1, f"{sample} not >= 1 on node1's /metrics within {timeout_s:g} s: {got}"
            return text
        time.sleep(1)


def test_restore_failure_on_spare_rolls_back_to_source(cluster, reference, job_dir, clean, job_user):
    rng = _rng("rollback")
    node, at = rng.choice(TRAINING_NODES), rng.randint(*FAULT_STEPS)
    what = f"restore-fail armed on {SPARE}, ecc-sbe-storm on {node} at step {at}"
    print(f"\n{what} (seed={SEED})")
    job_id = _submit(job_dir, "rb", job_user)
    clean.append(job_id)
    out_path = job_dir / f"rb.{job_id}.out"
    arm = _run([*TPASSCTL, "inject", "--node", SPARE, "--fault", "restore-fail"])
    assert arm.returncode == 0, (SEED, arm.stderr)
    _wait_step(out_path, at)
    inj = _run([*TPASSCTL, "inject", "--node", node, "--fault", "ecc-sbe-storm"])
    assert inj.returncode == 0, (SEED, inj.stderr)

    diag = _assert_finished_unchanged(cluster, job_id, out_path, reference, what)
    events = _events(cluster, job_id)
    kinds = [e["kind"] for e in events]
    rolled = [e for e in events if e["kind"] == "migration.rolled_back"]
    assert len(rolled) == 1 and "migration.completed" not in kinds, diag
    # The event says why: the restore on the spare failed, because the image is corrupt.
    msg = rolled[0]["message"]
    assert f"restore on {SPARE} failed" in msg and "fails its BLAKE3 check" in msg, diag
    assert rolled[0]["data"]["node"] == node and "paused" in rolled[0]["data"]["phase_durations"], diag
    # No retry storm: the node is backed off (retry_backoff_s), so one attempt in this job.
    assert kinds.count("migration.started") == 1, diag
    assert _images_left(cluster, job_id) == [], diag  # the refused image went with the rollback
    # A rolled-back node is not drained by torchpass (docs/coordinator.md, "After a rollback").
    n = _node(node)
    assert "DRAIN" not in n["state"], (n["state"], n.get("reason"), diag)
    print(f"rolled back: {msg}; phases {rolled[0]['data']['phase_durations']}")


def test_tpassctl_migrate_moves_a_healthy_rank_and_refuses_bad_requests(cluster, reference, job_dir, clean, job_user,
                                                                        other_user):
    rng = _rng("migrate")
    node, at = rng.choice(TRAINING_NODES), rng.randint(*FAULT_STEPS)
    what = f"tpassctl migrate {node} --to {SPARE} at step {at}"
    print(f"\n{what} (seed={SEED})")

    # Not a torchpass job: no coordinator to ask.
    plain = _run(["sbatch", "--parsable", "-N1", "-w", "node1", "-o", "/dev/null", "--wrap", "sleep 30"])
    assert plain.returncode == 0, plain.stderr
    plain_id = int(plain.stdout.strip().split(";")[0])
    clean.append(plain_id)
    r = _run([*TPASSCTL, "migrate", str(plain_id), "--node", "node1"])
    _run(["scancel", str(plain_id)])
    # the one line (and exit 4: not found) for any job the caller cannot see as a torchpass job of theirs
    assert r.returncode == 4 and "no torchpass job of yours with this id" in r.stderr, (r.stdout, r.stderr)

    job_id = _submit(job_dir, "op", job_user)
    clean.append(job_id)
    out_path = job_dir / f"op.{job_id}.out"
    _wait_step(out_path, 1)  # every rank registered before its first step

    def migrate(*args: str, as_other: bool = False) -> subprocess.CompletedProcess:
        """As the job's owner (who asks for the move: the node is not drained), or as another user
        (with the job Python's tpassctl: root's venv may be unreadable to users)."""
        return tpassctl("migrate", str(job_id), *args, user=(other_user if as_other else job_user).name)

    for args, want, code in ((("--node", "node9"), "node node9 runs no rank of job", 4),
                             (("--node", SPARE), f"node {SPARE} runs no rank of job", 4),
                             (("--node", node, "--to", "node9"), "node node9 is not a spare of job", 4),
                             (("--node", node, "--to", node), f"--to {node} is the node being migrated", 1)):
        r = migrate(*args)
        assert r.returncode == code and want in r.stderr, (args, r.stdout, r.stderr, SEED)
    r = migrate("--node", node, as_other=True)
    # another user's job: the same line as for a job that does not exist, so nothing is told of it
    assert r.returncode == 4 and "no torchpass job of yours with this id" in r.stderr, (r.stdout, r.stderr)

    _wait_step(out_path, at)
    r = migrate("--node", node, "--to", SPARE, "--json")
    assert r.returncode == 0, (r.stdout, r.stderr, SEED)
    mid = json.loads(r.stdout)["migration"]

    diag = _assert_finished_unchanged(cluster, job_id, out_path, reference, what)
    events = _events(cluster, job_id)
    done = [e for e in events if e["kind"] == "migration.completed"]
    assert len(done) == 1 and done[0]["data"]["migration"] == mid, diag
    assert done[0]["data"]["node"] == node and done[0]["data"]["target"] == SPARE, diag
    started = [e for e in events if e["kind"] == "migration.started"]
    assert [e["data"].get("trigger") for e in started] == ["operator"], diag
    # Who drains a healthy node after a requested move (docs/tpassd.md, "Drains"): tpassd, for an
    # admin (root, SlurmUser) only; the owner's request leaves it in service. The coordinator asks
    # as the job's owner: this job's owner also asked for the move.
    n, owner = _node(node), _job(job_id)["user_id"]
    # (a refused drain's audit line names no health: tpassd refused before it recorded one)
    audit = [(a["requester_uid"], a.get("health"), a["outcome"]) for a in drain_audit(cluster, node, job_id)]
    if owner == 0:
        assert "DRAIN" in n["state"] and n["reason"] == "torchpass: operator request", (
            n["state"], n.get("reason"), diag)
        assert audit == [(0, "healthy", "ok")], (audit, diag)
    else:
        assert "DRAIN" not in n["state"], (n["state"], n.get("reason"), diag)
        assert [(uid, outcome) for uid, _h, outcome in audit] == [(owner, "conflict")], (audit, diag)
        assert f"drain of {node} failed" in done[0]["message"], diag
    print(f"operator migration {mid} {node} -> {SPARE}: phases {done[0]['data']['phase_durations']}")
