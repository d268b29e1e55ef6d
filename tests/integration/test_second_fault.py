"""Two faults on two different nodes of one job, handled one after the other.

``sbatch -N3 --torchpass=spares=1`` of a 2-rank gloo DDP job
(examples/train_ddp.py, unchanged): node1 and node2 train, node3 is the hot
spare, node4 is idle in the cluster. A fault drill on node2 moves its rank to
node3 (the hot spare). A second drill on node3 then finds no hot spare left:
the coordinator asks slurmctld for one (job expansion: a step-less donor
allocation ``--dependency=expand:J`` merged into the job; the devcluster sets
``SchedulerParameters=permit_job_expansion``), follows node4's tpassd, and
moves the rank on to node4 with a restore step of the same job there.

The job keeps its id, Restarts=0, COMPLETED 0:0, and its per-step losses
equal a fault-free run of the same job (float.hex, every step exactly once
per rank); both bad nodes are drained with the torchpass reason; no spare
allocation is left behind. Shrink: node2 is released (the training step's
task wrapper there left once the rank ran on node3; srun collects the moved
rank's exit code), and so is node3 (its restore step ended when the rank
moved on).

A second move called off after its restore (``kill-fail`` drill on node3:
its tpassd refuses the kill of the source copy): node4's copy is aborted,
training goes on on node3, the rank record names node3 again and the job
still ends COMPLETED 0:0 with the fault-free losses.

The companion path (a site without job expansion: policy
``spare_strategies = ["hot", "companion"]``): ``sbatch -N2 --torchpass`` with
no hot spare; a drill on rank 1's node gets a one-node companion allocation from
slurmctld, the rank is restored in a step of the companion (its output still
goes to the job's output file), and the companion is cancelled when the job
ends. Both tests compare with one fault-free run (2 ranks in both shapes).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

import training_jobs as tj
from conftest import site_policy
from torchpass import layout
from training_jobs import TPASSCTL, drain_audit
from training_jobs import job as _job
from training_jobs import node as _node
from training_jobs import per_step as _per_step
from training_jobs import run as _run
from training_jobs import steps as _steps
from training_jobs import wait_end as _wait_end

pytestmark = pytest.mark.integration

# Each move pauses at T = max + 64 collectives (2 per step), ~32 steps after
# detection; two moves one after the other need ~90 steps after the first drill.
STEPS = 220
FIRST_FAULT_AT_STEP = 10


COMPANION_POLICY = "tpcompanion-bc"  # a file name no other test uses (/etc/torchpass/policies is global)


def _submit(job_dir: Path, tag: str, user, nodes: int = 3, torchpass: str = "spares=1") -> int:
    """As ``user``, the tests' ordinary job user (a JobUser)."""
    return tj.submit(job_dir, tag, STEPS, nodes=nodes, torchpass=torchpass, user=user.name)


def _events(state_dir: Path, job_id: int) -> list[dict]:
    try:
        return json.loads(layout.events_json(state_dir, job_id).read_text())
    except (OSError, ValueError):
        return []


def _wait(pred, timeout_s: float, what: str, diag) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} not reached in {timeout_s:g}s\n{diag()}")


@pytest.fixture(scope="module")
def reference(cluster, plugin_built, jobs_base, job_user) -> list[str]:
    """The fault-free run: the loss lines of 2 ranks (the same with or without a hot spare)."""
    job_dir = jobs_base / f"test_second_fault-ref-{os.getpid()}"
    job_dir.mkdir(mode=0o755)
    os.chown(job_dir, job_user.uid, job_user.gid)
    ref_id = _submit(job_dir, "ref", job_user)
    ref = _wait_end(ref_id)
    ref_out = (job_dir / f"ref.{ref_id}.out").read_text()
    assert ref["job_state"][0] == "COMPLETED", ref_out[-3000:]
    ref_lines = _steps(ref_out)
    assert len(ref_lines) == 2 * STEPS, ref_out[-3000:]
    return ref_lines


def _plugin_lines(cluster, job_id: int) -> str:
    """What the plugin said of the job's coordinator (started, stopped, killed) in slurmd's logs."""
    lines = []
    for log_file in sorted((cluster.run_dir / "log").glob("slurmd.*.log")):
        lines += [f"{log_file.name}: {line}" for line in log_file.read_text(errors="replace").splitlines()
                  if f"job {job_id}" in line and "coordinator" in line]
    return "\n".join(lines[-20:]) or "(none)"


def _diag(cluster, job_id: int, out_path: Path):
    coord_log = layout.coordinator_log(cluster.state_dir, job_id)

    def diag() -> str:
        text = out_path.read_text()[-2500:] if out_path.exists() else "no output"
        kinds = [(e["kind"], e["message"]) for e in _events(cluster.state_dir, job_id)]
        steps = _run(["squeue", "--steps", "--noheader", "--jobs", str(job_id), "--format", "%i %j %N %M"]).stdout
        rank_dir = layout.rank_records_dir(cluster.state_dir, job_id)
        records = "\n".join(f"{p.name}: {p.read_text()[:400]}" for p in sorted(rank_dir.rglob("*"))
                            if p.is_file()) if rank_dir.is_dir() else "(none)"
        return (f"{text}\n--- events ---\n" + "\n".join(f"{k}: {m}" for k, m in kinds)
                + f"\n--- steps ---\n{steps}--- rank records ---\n{records}"
                + "\n--- coordinator.log ---\n" + (coord_log.read_text()[-8000:] if coord_log.exists() else "")
                + "\n--- the plugin on the coordinator (slurmd logs) ---\n" + _plugin_lines(cluster, job_id))

    return diag


def test_second_fault_moves_the_rank_on_to_a_spare_from_slurmctld(cluster, reference, job_dir, job_user):
    t_start = time.monotonic()
    ref_lines = reference
    job_id = _submit(job_dir, "two", job_user)
    out_path = job_dir / f"two.{job_id}.out"
    diag = _diag(cluster, job_id, out_path)

    def completed(n: int) -> bool:
        return len([e for e in _events(cluster.state_dir, job_id) if e["kind"] == "migration.completed"]) >= n

    try:
        _wait(lambda: out_path.exists() and f"step={FIRST_FAULT_AT_STEP} " in out_path.read_text(), 120,
              f"step {FIRST_FAULT_AT_STEP}", diag)
        assert _run([*TPASSCTL, "inject", "--node", "node2", "--fault", "ecc-sbe-storm"]).returncode == 0
        _wait(lambda: completed(1), 90, "the first migration (node2 -> node3)", diag)
        step_at_second = max((int(ln.split()[0][5:]) for ln in _steps(out_path.read_text())), default=-1)
        assert step_at_second < STEPS - 60, f"training nearly done before the second fault\n{diag()}"
        assert _run([*TPASSCTL, "inject", "--node", "node3", "--fault", "ecc-sbe-storm"]).returncode == 0
        final = _wait_end(job_id, diag=diag)
        text = out_path.read_text()
        assert final["job_id"] == job_id
        assert final["job_state"][0] == "COMPLETED", diag()
        assert final["exit_code"]["return_code"]["number"] == 0, diag()
        assert int(final.get("restart_cnt", 0)) == 0, diag()
        # Same losses, every step, exactly once per rank: no gap, no duplicate.
        assert _per_step(_steps(text)) == _per_step(ref_lines), diag()

        events = _events(cluster.state_dir, job_id)
        done = [e for e in events if e["kind"] == "migration.completed"]
        assert [(e["data"]["node"], e["data"]["target"]) for e in done] == [("node2", "node3"), ("node3", "node4")], \
            diag()
        chosen = {e["data"]["migration"]: e["data"] for e in events if e["kind"] == "spare.chosen"}
        m1, m2 = done[0]["data"]["migration"], done[1]["data"]["migration"]
        assert chosen[m1]["how"] == "hot"
        assert chosen[m2]["how"] == "expand" and isinstance(chosen[m2].get("allocation"), int), chosen
        assert [e["data"]["strategy"] for e in events if e["kind"] == "spare.requested"] == ["expand"]
        # Shrink: node2's training-step task wrapper left once the rank ran on node3, and node3
        # ran only the restore step: both released.
        for e in done:
            assert e["data"]["source"] == "released" and "shrink failed" not in e["message"], e["message"]
        left_in_job = _run(["scontrol", "show", "hostnames", final["nodes"]]).stdout.split()
        assert not {"node2", "node3"} & set(left_in_job), final["nodes"]

        for node in ("node2", "node3"):
            n = _node(node)
            assert "DRAIN" in n["state"], (node, n["state"])
            assert n["reason"].startswith("torchpass: "), (node, n["reason"])
            # drained by the node's own tpassd, which found it degraded (docs/tpassd.md, "Drains")
            audit = drain_audit(cluster, node, job_id)
            assert [(a["outcome"], a["health"]) for a in audit] == [("ok", "degraded")], (node, audit)
        # No spare allocation is left (the donor merged into the job and ended).
        left = _run(["squeue", "--noheader", "--name", f"torchpass-spare-{job_id}", "--format", "%i %T"]).stdout
        assert left.strip() == "", left
        for e in done:
            print(f"\n{e['data']['migration']} {e['data']['node']} -> {e['data']['target']}: "
                  f"phases {e['data']['phase_durations']}")
        print(f"spare from slurmctld: {chosen[m2]}; test took {time.monotonic() - t_start:.1f}s")
    finally:
        _run(["scancel", str(job_id)])
        _run(["scancel", "--name", f"torchpass-spare-{job_id}"])
        for node in ("node2", "node3"):
            _run([*TPASSCTL, "inject", "--node", node, "--fault", "clear"])
            _run(["scontrol", "update", f"NodeName={node}", "State=RESUME"])


@pytest.fixture(scope="module")
def companion_policy():
    with site_policy(COMPANION_POLICY, 'spare_strategies = ["hot", "companion"]\n') as name:
        yield name


def test_companion_spare_when_the_job_cannot_grow(cluster, reference, job_dir, job_user, companion_policy):
    t_start = time.monotonic()
    job_id = _submit(job_dir, "comp", job_user, nodes=2, torchpass=f"spares=0,policy={COMPANION_POLICY}")
    out_path = job_dir / f"comp.{job_id}.out"
    diag = _diag(cluster, job_id, out_path)
    # The drill goes to rank 1's node, whichever the job got: an earlier test may leave
    # node2 drained or still completing for a while (then the job runs elsewhere, and a
    # drill on node2 would hit no node of this job).
    bad = ""
    try:
        _wait(lambda: out_path.exists() and f"step={FIRST_FAULT_AT_STEP} " in out_path.read_text(), 120,
              f"step {FIRST_FAULT_AT_STEP}", diag)
        nodes = _run(["scontrol", "show", "hostnames", _job(job_id)["nodes"]]).stdout.split()
        assert len(nodes) == 2, nodes
        bad = nodes[1]
        assert _run([*TPASSCTL, "inject", "--node", bad, "--fault", "ecc-sbe-storm"]).returncode == 0
        final = _wait_end(job_id, diag=diag)
        text = out_path.read_text()
        assert final["job_state"][0] == "COMPLETED", diag()
        assert final["exit_code"]["return_code"]["number"] == 0, diag()
        assert int(final.get("restart_cnt", 0)) == 0, diag()
        # The moved rank's lines, printed from the companion's step, are in the job's output.
        assert _per_step(_steps(text)) == _per_step(reference), diag()
        events = _events(cluster.state_dir, job_id)
        (done,) = [e for e in events if e["kind"] == "migration.completed"]
        (chosen,) = [e["data"] for e in events if e["kind"] == "spare.chosen"]
        assert chosen["how"] == "companion" and done["data"]["target"] == chosen["target"], diag()
        assert [e["data"]["strategy"] for e in events if e["kind"] == "spare.requested"] == ["companion"]
        companion = chosen["allocation"]
        comp = _job(companion)
        assert comp["name"] == f"torchpass-spare-{job_id}" and f"job {job_id}" in comp["comment"], comp
        # The coordinator cancels the companion once the job has ended (it polls every few seconds).
        _wait(lambda: not set(_job(companion)["job_state"]) & {"RUNNING", "PENDING", "CONFIGURING"}, 30,
              f"companion {companion} ended", diag)
        assert _job(companion)["job_state"][0] == "CANCELLED", _job(companion)["job_state"]
        assert done["data"]["node"] == bad, done
        n = _node(bad)
        assert "DRAIN" in n["state"] and n["reason"].startswith("torchpass: "), n
        print(f"\ncompanion {companion} on {chosen['target']}: phases {done['data']['phase_durations']}; "
              f"test took {time.monotonic() - t_start:.1f}s")
    finally:
        _run(["scancel", str(job_id)])
        _run(["scancel", "--name", f"torchpass-spare-{job_id}"])
        if bad:
            _run([*TPASSCTL, "inject", "--node", bad, "--fault", "clear"])
            _run(["scontrol", "update", f"NodeName={bad}", "State=RESUME"])


def test_second_move_rolled_back_after_its_restore_keeps_the_rank_on_its_first_spare(cluster, reference, job_dir,
                                                                                     job_user):
    """The rank moved node2 -> node3, then node3 -> node4 is called off *after* node4's restore
    succeeded: the root-only drill ``kill-fail`` on node3 makes its tpassd refuse the kill of
    the source copy, so the coordinator aborts node4's copy and resumes on node3. node4's
    killed copy must not decide the rank's exit (srun's exit hook collects it, the training
    step's task wrapper having left node2: its 137 would fail the job), and the rank record must
    name node3 again."""
    t_start = time.monotonic()
    job_id = _submit(job_dir, "kf", job_user)
    out_path = job_dir / f"kf.{job_id}.out"
    diag = _diag(cluster, job_id, out_path)
    rank_dir = layout.rank_records_dir(cluster.state_dir, job_id)

    def events(kind: str) -> list[dict]:
        return [e for e in _events(cluster.state_dir, job_id) if e["kind"] == kind]

    # The job's nodes in order (rank 0, rank 1, the hot spare); usually node1-3, but an earlier
    # test may leave a node drained for a while.
    nodes: list[str] = []
    try:
        _wait(lambda: out_path.exists() and f"step={FIRST_FAULT_AT_STEP} " in out_path.read_text(), 120,
              f"step {FIRST_FAULT_AT_STEP}", diag)
        nodes = _run(["scontrol", "show", "hostnames", _job(job_id)["nodes"]]).stdout.split()
        assert len(nodes) == 3, nodes
        first, second = nodes[1], nodes[2]  # rank 1's node, then the hot spare it moves to
        assert _run([*TPASSCTL, "inject", "--node", first, "--fault", "ecc-sbe-storm"]).returncode == 0
        _wait(lambda: len(events("migration.completed")) >= 1, 90, f"the first migration ({first} -> {second})", diag)
        step_at_second = max((int(ln.split()[0][5:]) for ln in _steps(out_path.read_text())), default=-1)
        assert step_at_second < STEPS - 60, f"training nearly done before the second fault\n{diag()}"
        armed = _run([*TPASSCTL, "inject", "--node", second, "--fault", "kill-fail"])
        assert armed.returncode == 0, armed.stderr
        assert _run([*TPASSCTL, "inject", "--node", second, "--fault", "ecc-sbe-storm"]).returncode == 0
        _wait(lambda: events("migration.rollback"), 120, "the second move's rollback", diag)
        final = _wait_end(job_id, diag=diag)
        text = out_path.read_text()
        assert final["job_id"] == job_id
        assert final["job_state"][0] == "COMPLETED", diag()
        assert final["exit_code"]["return_code"]["number"] == 0, diag()
        assert int(final.get("restart_cnt", 0)) == 0, diag()
        assert _per_step(_steps(text)) == _per_step(reference), diag()

        done = events("migration.completed")
        assert [(e["data"]["node"], e["data"]["target"]) for e in done] == [(first, second)], diag()
        (rb,) = events("migration.rollback")
        assert rb["data"]["node"] == second and "kill-fail" in rb["message"], rb
        # The restore on node4 had succeeded: the move failed at the kill of the source.
        assert rb["data"]["phase"] == "kill_source", rb
        m2 = rb["data"]["migration"]
        # The rank ended on node3: the record names it, and the exit code came from it.
        rec = json.loads(layout.rank_record(rank_dir, job_id, 1).read_text())
        assert rec["node"] == second and rec["restored_from"].endswith("rank1.gen1"), rec
        ex = json.loads(layout.exit_file(rank_dir, job_id, 1).read_text())
        assert ex["code"] == 0 and ex["node"] == second, ex
        # node4's restore wrapper either said why it reports nothing or was killed with its step
        # before it could (srun's forced termination; a race): never did it report the 137.
        errf = layout.restore_error_file(cluster.state_dir, job_id, m2, 1)
        said = errf.read_text() if errf.exists() else ""
        print("\nthe called-off restore step:", " | ".join(ln for ln in said.splitlines() if "torchpass" in ln
                                                     or "srun" in ln) or "(nothing)")
        # Rolled back: the first spare keeps the rank and is not drained; the first bad node is.
        n3 = _node(second)
        assert "DRAIN" not in n3["state"], n3["state"]
        n2 = _node(first)
        assert "DRAIN" in n2["state"] and n2["reason"].startswith("torchpass: "), n2
        left = _run(["squeue", "--noheader", "--name", f"torchpass-spare-{job_id}", "--format", "%i %T"]).stdout
        assert left.strip() == "", left
        print(f"\nrollback of {m2}: {rb['message']}; test took {time.monotonic() - t_start:.1f}s")
    finally:
        _run(["scancel", str(job_id)])
        _run(["scancel", "--name", f"torchpass-spare-{job_id}"])
        for node in nodes[1:]:
            _run([*TPASSCTL, "inject", "--node", node, "--fault", "clear"])
            _run(["scontrol", "update", f"NodeName={node}", "State=RESUME"])
