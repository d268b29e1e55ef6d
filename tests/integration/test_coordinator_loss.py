"""Never left paused, never silently off: the coordinator killed mid-move, slurmctld away.

Every job is ``sbatch -N4 --torchpass=spares=1,policy=tpcoordloss-c`` of
examples/train_ddp.py (3 gloo DDP ranks on node1..node3, hot spare node4),
submitted as the job user. The policy shortens the paused ranks' own
deadline (``hold_deadline_s``, 3630 s by default) to D = 20 s, and the job
exports ``TORCHPASS_COORDINATOR_LOST_S=10`` (30 s by default).

* ``kill -9`` of the coordinator (the pid in its registration) after the
  dump, after the restore, and during the rebuild of a ``tpassctl migrate``
  of node2's rank 1 to node4. To land at exactly that point the coordinator
  is first stopped (SIGSTOP) when the step begins (the dump's directory
  appears; the restore gate is opened; the hold file is created), the step
  then completes without it (tpassd's dump, the restore step), and the
  coordinator is killed. The ranks go on within D (+ the rebuild), one copy
  of each (the source copy claims the rank), and the job ends COMPLETED 0:0,
  Restarts=0, with the fault-free run's losses: every step once. A rank
  notes ``coordinator.lost``; ``tpassctl status`` and ``events`` show it.
* slurmctld stopped for 3 minutes (its pid, from the devcluster's pid
  file), with a degraded node meanwhile: the job trains on, the coordinator
  stays alive, records ``slurm.unavailable``, moves nothing while slurmctld
  is away, records ``slurm.available`` when it is back, and then moves the
  node.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

import training_jobs as tj
from slurm_helpers import job_id_of, job_python, sbatch, submit_env, tpassctl
from slurm_helpers import until as _until
from torchpass import coordinator_lost, layout
from torchpass.errors import SlurmError
from torchpass.ports import TPASSD_CONTROL_PORT
from torchpass.slurm.cli import CliSlurmClient
from training_jobs import TPASSCTL

pytestmark = pytest.mark.integration

POLICY = "tpcoordloss-c"  # a file name no other test uses (/etc/torchpass/policies is global)
D = 20  # hold_deadline_s
LOST_S = 10  # TORCHPASS_COORDINATOR_LOST_S
STEPS = 150
NODES = ("node1", "node2", "node3", "node4")
MOVED, RANK, SPARE = "node2", 1, "node4"  # not rank 0: docs/coordinator.md, "Never left paused", "Not covered"
OUTAGE_S = int(os.environ.get("TORCHPASS_TEST_OUTAGE_S", "180"))  # the 3 minutes; shorter to debug
FELL_BACK = f"torchpass: no resume from the coordinator in {D} s: resuming in place"


@pytest.fixture(scope="module")
def policy():
    path = Path("/etc/torchpass/policies") / f"{POLICY}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"hold_deadline_s = {D}.0\nrebuild_timeout_s = 60.0\n")
    yield POLICY
    path.unlink(missing_ok=True)


def _submit(job_dir: Path, tag: str, user: str, steps: int = STEPS, sleep: float = 0.05) -> int:
    strict = {k: v for k, v in os.environ.items() if k == "TORCHPASS_STRICT_TRANSITIONS"}
    proc = sbatch(["-N4", "--ntasks-per-node=1", f"--torchpass=spares=1,policy={POLICY}",
                   "-o", str(job_dir / f"{tag}.%j.out")],
                  "#!/bin/bash\n"
                  f"export TORCHPASS_COORDINATOR_LOST_S={LOST_S}\n"
                  f"srun {job_python()} {tj.train_script(job_dir)} --steps {steps} --params 1M --sleep {sleep}\n",
                  cwd=job_dir, user=user, env={**submit_env(user), **strict})
    return job_id_of(proc)


def _last_step(out: Path) -> int:
    lines = tj.steps(out.read_text()) if out.exists() else []
    return int(lines[-1].split()[0].split("=")[1]) if lines else -1


def _coordinator_pid(cluster, job_id: int) -> int:
    path = layout.coordinator_json(cluster.state_dir, job_id)
    _until(path.exists, 60, f"job {job_id}'s coordinator registration", every=0.1)
    return int(json.loads(path.read_text())["pid"])


def _events(cluster, job_id: int) -> list[dict]:
    p = layout.events_json(cluster.state_dir, job_id)
    return json.loads(p.read_text()) if p.exists() else []


def _diag(cluster, job_id: int, out: Path) -> str:
    log = layout.coordinator_log(cluster.state_dir, job_id)
    return ((out.read_text()[-4000:] if out.exists() else "no job output")
            + "\n--- events ---\n" + "\n".join(f"{e['kind']}: {e['message']}" for e in _events(cluster, job_id))
            + "\n--- coordinator.log ---\n" + (log.read_text()[-4000:] if log.exists() else ""))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def reference(cluster, plugin_built, policy, jobs_base, job_user) -> dict:
    """The fault-free run, once for the module."""
    d = jobs_base / "coordloss-ref"
    d.mkdir(mode=0o755)
    os.chown(d, job_user.uid, job_user.gid)
    job_id = _submit(d, "ref", job_user.name)
    final = tj.wait_end(job_id, 240)
    text = (d / f"ref.{job_id}.out").read_text()
    assert final["job_state"][0] == "COMPLETED", text[-3000:]
    lines = tj.steps(text)
    assert len(lines) == 3 * STEPS, text[-3000:]
    return {"per_step": tj.per_step(lines)}


@pytest.fixture
def clean(cluster):
    """No job of ours left, no drill armed, no torchpass drain, every node idle again."""
    jobs: list[int] = []
    yield jobs
    for j in jobs:
        tj.run(["scancel", str(j)])
    for n in NODES:
        tj.run([*TPASSCTL, "inject", "--node", n, "--fault", "clear"])
    end = time.monotonic() + 90
    while time.monotonic() < end:
        states = {n: tj.node(n) for n in NODES}
        for n, st in states.items():
            if "DRAIN" in st["state"] and st.get("reason", "").startswith("torchpass"):
                tj.run(["scontrol", "update", f"NodeName={n}", "State=RESUME"])
        if all(st["state"] == ["IDLE"] for st in states.values()):
            return
        time.sleep(0.5)
    raise AssertionError(f"cluster not clean after the test: {[(n, tj.node(n)['state']) for n in NODES]}")


@pytest.mark.parametrize("stage", ["dump", "restore", "rebuild"])
def test_kill_9_of_the_coordinator_mid_move_the_ranks_go_on(cluster, reference, job_dir, job_user, clean, stage):
    job_id = _submit(job_dir, stage, job_user.name)
    clean.append(job_id)
    out = job_dir / f"{stage}.{job_id}.out"
    pid = _coordinator_pid(cluster, job_id)
    _until(lambda: _last_step(out) >= 5, 120, "step 5", every=0.1)  # every rank registered
    r = tpassctl("migrate", str(job_id), "--node", MOVED, "--to", SPARE, user=job_user.name)
    assert r.returncode == 0, (r.stdout, r.stderr)

    jdir = layout.job_dir(cluster.state_dir, job_id)
    snapshots = layout.snapshot_job_dir(cluster.snapshot_dir, job_id)
    if stage == "dump":  # tpassd began the dump: the coordinator waits for its answer
        _until(snapshots.exists, 60, "the dump")
        os.kill(pid, signal.SIGSTOP)
        _until(lambda: list(snapshots.glob(f"rank{RANK}.gen*/manifest.json")), 60, "the dump's manifest", every=0.05)
    elif stage == "restore":  # the restore gate opened: the restore step restores without the coordinator
        _until(lambda: any(p.read_text().startswith("restore") for p in jdir.glob(f"restore-*-rank{RANK}.go")),
               60, "the restore gate")
        os.kill(pid, signal.SIGSTOP)
        record = layout.rank_record(layout.rank_records_dir(cluster.state_dir, job_id), job_id, RANK)
        _until(lambda: json.loads(record.read_text()).get("restored_from"), 60, "the restored copy's record",
               every=0.05)
    else:  # the source copy is gone, the hold file released the restored copy, resumes are being sent
        _until(lambda: list(jdir.glob(f"hold/*.rank{RANK}")), 60, "the hold file")
        os.kill(pid, signal.SIGSTOP)
    os.kill(pid, signal.SIGKILL)
    killed_at, step_at_kill = time.monotonic(), _last_step(out)
    _until(lambda: not _alive(pid), 10, "the coordinator's end", every=0.05)
    print(f"\nkill -9 of the coordinator (pid {pid}) {stage}: step {step_at_kill}")

    _until(lambda: _last_step(out) > step_at_kill + 1, D + 60, "training after the kill", every=0.1)
    went_on = time.monotonic() - killed_at
    diag = _diag(cluster, job_id, out)
    assert went_on < D + 30, (went_on, diag)
    claims = sorted(jdir.glob(f"hold/*.rank{RANK}.claim"))
    if stage != "rebuild":  # the held source copy claimed the rank (its host first): the restored copy never goes on
        assert [c.read_text().split()[0] for c in claims] == [MOVED], (claims, diag)
    else:  # the hold file was released: the coordinator's decision stands, no claim
        assert claims == [], (claims, diag)
    # A rank noted that the coordinator is gone; tpassctl says so.
    _until(coordinator_lost.path(cluster.state_dir, job_id).exists, LOST_S + 30, "coordinator.lost", every=0.2)
    st = tpassctl("status", str(job_id), user=job_user.name)
    assert "coordinator LOST: the job is unprotected" in st.stdout, (st.stdout, st.stderr)

    final = tj.wait_end(job_id, 240)
    text = out.read_text()
    diag = _diag(cluster, job_id, out)
    assert final["job_state"][0] == "COMPLETED" and final["exit_code"]["return_code"]["number"] == 0, diag
    assert int(final.get("restart_cnt", 0)) == 0, diag
    assert tj.per_step(tj.steps(text)) == reference["per_step"], diag  # bit-identical, every step once
    fell_back = text.count(FELL_BACK)
    assert "did not join" not in text and "two copies" not in text, diag
    if stage != "rebuild":  # nobody had a resume: every rank fell back, once
        assert fell_back == 3, (fell_back, diag)
    else:  # some ranks may have had their resume before the kill
        assert fell_back <= 3, (fell_back, diag)
    assert text.count("torchpass: the coordinator does not answer; the job is unprotected") == 1, diag
    ev = tpassctl("events", str(job_id), user=job_user.name)
    assert "coordinator.lost" in ev.stdout, (ev.stdout, ev.stderr)
    print(f"ranks went on {went_on:.1f} s after the kill ({fell_back} fell back on their own)")


def test_slurmctld_away_for_3_minutes_the_job_trains_and_moves_after(cluster, plugin_built, policy, job_dir,
                                                                     job_user, clean):
    # Long enough to train through the outage and the move after it; cancelled once seen.
    job_id = _submit(job_dir, "outage", job_user.name, steps=5000, sleep=0.1)
    clean.append(job_id)
    out = job_dir / f"outage.{job_id}.out"
    coord = _coordinator_pid(cluster, job_id)
    _until(lambda: _last_step(out) >= 5, 120, "step 5", every=0.1)
    ctld_pidfile = cluster.run_dir / "ctld" / "slurmctld.pid"
    ctld = int(ctld_pidfile.read_text().split()[0])
    os.kill(ctld, signal.SIGTERM)
    _until(lambda: not _alive(ctld), 60, "slurmctld's exit", every=0.1)
    t0, step0 = time.monotonic(), _last_step(out)
    try:
        try:
            _until(lambda: [e for e in _events(cluster, job_id) if e["kind"] == "slurm.unavailable"], 60,
                   "event slurm.unavailable", every=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_diag(cluster, job_id, out)}") from None
        # A node degrades meanwhile (a pending row remap: it stays so until cleared, unlike an ECC
        # storm, which ends with its window): nothing moves while slurmctld is away.
        # (tpassctl finds tpassd's address from slurmctld: named here instead)
        tpassd = f"{MOVED}=tcp://{cluster.node_address(MOVED)}:{TPASSD_CONTROL_PORT}"
        inj = tj.run([*TPASSCTL, "inject", "--node", MOVED, "--fault", "row-remap-pending",
                      "--endpoint", tpassd])
        assert inj.returncode == 0, inj.stderr
        # The coordinator's own question, asked here too: slurmctld away is an error, never "no such
        # job" (scontrol --json answers both alike; most likely why a coordinator exited in CI).
        slurm = CliSlurmClient(environ={**os.environ, **cluster.env()})
        with pytest.raises(SlurmError):
            slurm.job(job_id)
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - t0)))
        step1 = _last_step(out)
        kinds = [e["kind"] for e in _events(cluster, job_id)]
        assert _alive(coord), _diag(cluster, job_id, out)
        assert "migration.started" not in kinds, _diag(cluster, job_id, out)
    finally:
        cluster._start_slurmctld()  # the devcluster's own start: same flags, pid recorded for down()
    assert step1 > step0 + 100, (step0, step1, _diag(cluster, job_id, out))  # trained on throughout
    try:
        _until(lambda: [e for e in _events(cluster, job_id) if e["kind"] == "slurm.available"], 60,
               "event slurm.available", every=0.5)
        _until(lambda: [e for e in _events(cluster, job_id) if e["kind"] == "migration.completed"], 120,
               "the move after slurmctld came back", every=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_diag(cluster, job_id, out)}") from None
    events = _events(cluster, job_id)
    kinds = [e["kind"] for e in events]
    assert kinds.index("slurm.unavailable") < kinds.index("slurm.available") < kinds.index("migration.started"), kinds
    assert slurm.job(job_id) is not None and slurm.job(job_id + 100_000) is None  # slurmctld back: it knows
    unavailable = next(e for e in events if e["kind"] == "slurm.unavailable")
    assert "no migration starts until it answers" in unavailable["message"], unavailable
    done = next(e for e in events if e["kind"] == "migration.completed")
    assert done["data"]["node"] == MOVED and done["data"]["target"] == SPARE, done
    assert _alive(coord)
    step2 = _last_step(out)
    _until(lambda: _last_step(out) > step2 + 5, 60, "training after the move", every=0.2)
    print(f"\nslurmctld away {OUTAGE_S} s: steps {step0} -> {step1}; moved {MOVED} -> {SPARE} after it came back")
