"""`tpassctl status` against a real coordinator on loopback (Slurm not reachable)."""

import json
import os
import threading

import pytest
from click.testing import CliRunner

from support.fake_slurm import FakeSlurm
from torchpass import zmqio
from torchpass.coordinator.job_record import JobState
from torchpass.coordinator.server import CoordinatorServer, write_registration
from tpassctl import status_cmd
from tpassctl.cli import cli


@pytest.fixture
def coordinator(tmp_path):
    server = CoordinatorServer(JobState(job_id=9), bind_address="127.0.0.1")
    t = threading.Thread(target=server.serve, daemon=True)
    t.start()
    ep = f"tcp://127.0.0.1:{server.port}"
    write_registration(tmp_path, 9, {"job_id": 9, "endpoint": ep, "pid": os.getpid(), "host": "h", "uid": os.getuid()})
    yield ep
    server.stop()
    t.join(5)


@pytest.fixture
def no_slurm(monkeypatch, tmp_path):
    # Point the Slurm commands at a config that does not exist: they fail fast.
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "missing-slurm.conf"))


def test_status_json_lists_ranks_of_a_registered_job(tmp_path, coordinator, no_slurm):
    for rank in (0, 1):
        zmqio.request(coordinator, "rank.register",
                      {"job_id": 9, "rank": rank, "world_size": 2, "node": f"node{rank + 1}", "pid": 10 + rank})
    zmqio.request(coordinator, "rank.progress", {"job_id": 9, "rank": 0, "step": 4, "collectives": 9})
    res = CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "status", "--json"])
    assert res.exit_code == 0, res.output
    jobs = json.loads(res.output)["jobs"]
    assert [j["job_id"] for j in jobs] == [9]
    job = jobs[0]
    assert job["reachable"] and job["registered_ranks"] == 2
    assert [(r["rank"], r["node"], r["step"]) for r in job["ranks"]] == [(0, "node1", 4), (1, "node2", -1)]
    assert "slurm_error" in job  # Slurm was unreachable and the output says so


def test_registration_claiming_another_uid_is_ignored(tmp_path, no_slurm):
    write_registration(tmp_path, 5, {"job_id": 5, "endpoint": "tcp://127.0.0.1:9", "pid": 1, "host": "h",
                                     "uid": os.getuid() + 1})
    res = CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "status", "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["jobs"] == []


def test_unknown_job_and_missing_state_dir_give_one_line_errors(tmp_path, no_slurm):
    res = CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "status", "77"])
    assert res.exit_code == 4  # not found
    assert res.output == (f"Error: job 77: no torchpass job of yours with this id in {tmp_path} (only its owner "
                          "or an admin can see a job; check the id and --state-dir)\n")
    (tmp_path / "jobs" / "77").mkdir(parents=True)  # a job of ours whose coordinator has gone
    res = CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "status", "77"])
    assert res.exit_code == 0 and res.output.splitlines()[1].split()[:2] == ["77", "finished"], res.output
    res = CliRunner().invoke(cli, ["--state-dir", str(tmp_path / "nope"), "status"])
    assert res.exit_code == 2 and "no torchpass state directory at" in res.output


def test_unreachable_coordinator_is_reported_not_fatal(tmp_path, no_slurm):
    write_registration(tmp_path, 6, {"job_id": 6, "endpoint": "tcp://127.0.0.1:9", "pid": 1, "host": "h",
                                     "uid": os.getuid()})
    res = CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "status", "6", "--timeout", "0.1"])
    assert res.exit_code == 3  # a peer did not answer (Slurm cannot say whether the job runs)
    assert "UNREACHABLE: no reply from tcp://127.0.0.1:9" in res.output


def test_an_unprotected_job_shows_why_in_text_and_json(tmp_path, coordinator, no_slurm):
    why = "process group 'tp' (DeviceMesh) cannot be moved yet"
    zmqio.request(coordinator, "rank.register", {"job_id": 9, "rank": 0, "world_size": 1, "node": "node1", "pid": 10})
    job = json.loads(CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "status", "--json"]).output)["jobs"][0]
    assert job["protected"] is True and job["unprotected"] is None
    zmqio.request(coordinator, "rank.progress", {"job_id": 9, "rank": 0, "step": 1, "collectives": 3,
                                                 "unprotected": why})
    job = json.loads(CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "status", "--json"]).output)["jobs"][0]
    assert job["protected"] is False and job["unprotected"] == f"rank 0 unprotected: {why}"
    res = CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "status", "9"])
    assert res.exit_code == 0 and f"UNPROTECTED: rank 0 unprotected: {why}" in res.output


def test_a_torch_version_the_site_allowed_shows_in_text_and_json(tmp_path, coordinator, no_slurm):
    why = "torch 2.11.0 is outside the tested range 2.13; allowed by TORCHPASS_ALLOW_TORCH=2.11"
    zmqio.request(coordinator, "rank.register", {"job_id": 9, "rank": 0, "world_size": 1, "node": "node1", "pid": 10,
                                                 "torch_override": why})
    job = json.loads(CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "status", "--json"]).output)["jobs"][0]
    assert job["torch_override"] == why
    res = CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "status", "9"])
    assert res.exit_code == 0 and f"torch outside the tested range, allowed by the site: {why}" in res.output


def _slurm(state) -> FakeSlurm:
    """Slurm's view only: it runs job 9 (state as given)."""
    slurm = FakeSlurm()
    slurm.run_job(9, uid=os.getuid(), nodes=("node1",), state=state)
    return slurm


@pytest.mark.parametrize("slurm_state", ["RUNNING", "COMPLETING"])
def test_a_dead_coordinator_of_a_running_job_shows_as_lost(tmp_path, monkeypatch, slurm_state):
    server = CoordinatorServer(JobState(job_id=9), bind_address="127.0.0.1")
    t = threading.Thread(target=server.serve, daemon=True)
    t.start()
    ep = f"tcp://127.0.0.1:{server.port}"
    write_registration(tmp_path, 9, {"job_id": 9, "endpoint": ep, "pid": os.getpid(), "host": "h", "uid": os.getuid()})
    assert zmqio.request(ep, "job.status", {}, timeout_s=2)["job_id"] == 9
    server.stop()  # the coordinator dies: nothing listens on its endpoint any more
    t.join(5)
    monkeypatch.setattr(status_cmd, "client", lambda: _slurm(slurm_state))
    res = CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "status", "--timeout", "0.1"])
    as_json = CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "status", "--json", "--timeout", "0.1"])
    job = json.loads(as_json.output)["jobs"][0]
    if slurm_state == "RUNNING":
        assert res.exit_code == 3 and as_json.exit_code == 3, res.output  # the coordinator did not answer
        assert "coordinator LOST: the job is unprotected (no migrations)" in res.output
        assert "UNREACHABLE" not in res.output
        assert job["protected"] is False and job["coordinator_lost"] is True and job["state"] == "lost"
        assert json.loads(as_json.output)["error"]["code"] == "unreachable"
    else:  # the job is ending: its coordinator exiting is no loss
        assert res.exit_code == 0 and as_json.exit_code == 0, res.output
        assert "finished" in res.output and "UNREACHABLE" not in res.output and "LOST" not in res.output
        assert job["protected"] is None and job["coordinator_lost"] is False and job["state"] == "finished"


def _note_lost(state_dir, job_id, uid=None):
    from torchpass import coordinator_lost

    coordinator_lost.create(state_dir, job_id, {"time": 1_700_000_000.0, "rank": 2, "node": "node3",
                                               "error": "no reply from tcp://10.0.0.1:4000 within 2 s"})
    if uid is not None:
        os.chown(coordinator_lost.path(state_dir, job_id), uid, -1)


def test_a_rank_s_coordinator_lost_note_shows_even_while_the_coordinator_answers_us(tmp_path, coordinator, no_slurm):
    """The ranks could not reach it for 30 s (torchpass.runtime.control): nothing protects the job."""
    _note_lost(tmp_path, 9)
    res = CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "status", "9"])
    assert res.exit_code == 0, res.output
    assert ("coordinator LOST: the job is unprotected (no migrations): rank 2 on node3: the coordinator does not "
            "answer (no reply from tcp://10.0.0.1:4000 within 2 s); the job is unprotected") in res.output
    job = json.loads(CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "status", "--json"]).output)["jobs"][0]
    assert job["coordinator_lost"] is True and job["protected"] is False and job["lost"]["rank"] == 2


def test_a_coordinator_lost_note_of_another_user_is_ignored(tmp_path, coordinator, no_slurm):
    _note_lost(tmp_path, 9, uid=os.getuid() + 4242)  # not the owner of jobs/9: anyone could have dropped it
    job = json.loads(CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "status", "--json"]).output)["jobs"][0]
    assert job["protected"] is True and "coordinator_lost" not in job


@pytest.mark.parametrize("command", ["status", "events"])
@pytest.mark.parametrize("as_json", [False, True])
def test_a_refused_question_about_one_job_exits_1_but_a_listing_does_not(tmp_path, no_slurm, monkeypatch,
                                                                          command, as_json):
    from torchpass.errors import RemoteError

    def refuse(*_a, **_k):
        raise RemoteError("forbidden", "uid 1002 does not own job 6")

    monkeypatch.setattr(zmqio, "request", refuse)
    write_registration(tmp_path, 6, {"job_id": 6, "endpoint": "tcp://127.0.0.1:9", "pid": 1, "host": "h",
                                     "uid": os.getuid()})
    extra = ["--json"] if as_json else []
    one = CliRunner().invoke(cli, ["--state-dir", str(tmp_path), command, "6", *extra])
    assert one.exit_code == 1, one.output
    assert "job 6: uid 1002 does not own job 6 (forbidden); only the job's owner or an admin can see it" in one.output
    listing = CliRunner().invoke(cli, ["--state-dir", str(tmp_path), command, *extra])
    assert listing.exit_code == 0 and "(forbidden)" in listing.output, listing.output


def test_a_migration_in_flight_and_the_last_one_show_in_status(tmp_path, no_slurm):
    # What the coordinator is doing to the job: job.status carries the migration (phase and for how
    # long), and tpassctl status prints it; after it ended, how it ended.
    from dataclasses import replace

    from torchpass.coordinator import machine as mc
    from torchpass.coordinator.model import Migration, MigrationRecord
    from torchpass.coordinator.phases import Phase, Result
    from torchpass.coordinator.server import Facts

    now = [100.0]
    facts = Facts(9, lambda: now[0])
    facts.feed(mc.RankRegistered(0, "node1", 1, pid=10))
    server = CoordinatorServer(JobState(job_id=9), bind_address="127.0.0.1", clock=lambda: now[0])
    server._facts = facts
    m = Migration(id="m3", node="node1", reason="r", trigger="health", ranks=(0,), detected=90.0, started=95.0,
                  phase=Phase.DUMP, phase_started=98.0, deadline=200.0, generation=2, target="node4")
    facts.state = replace(facts.state, migration=m)
    t = threading.Thread(target=server.serve, daemon=True)
    t.start()
    try:
        ep = f"tcp://127.0.0.1:{server.port}"
        write_registration(tmp_path, 9, {"job_id": 9, "endpoint": ep, "pid": os.getpid(), "host": "h",
                                         "uid": os.getuid()})
        res = CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "status", "--json"])
        job = json.loads(res.output)["jobs"][0]
        assert job["migration"] == {"id": "m3", "node": "node1", "target": "node4", "phase": "dump",
                                    "phase_age_s": 2.0, "age_s": 5.0}
        assert job["snapshot"] is None and job["last_migration"] is None
        res = CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "status"])
        assert "migrating node1 -> node4 (m3): dump for 2.0s, 5.0s in all" in res.output, res.output
        rec = MigrationRecord("m3", "node1", "node4", Result.COMPLETED, "r", {"total": 6.0})
        server.later(lambda: setattr(facts, "state", replace(facts.state, migration=None, history=(rec,))))
        import time

        time.sleep(0.3)
        res = CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "status"])
        assert "last migration m3: node1 -> node4 completed" in res.output, res.output
        assert "migrating" not in res.output
    finally:
        server.stop()
        t.join(5)


@pytest.mark.parametrize("slurm_state,state", [("PENDING", "starting"), ("RUNNING", "starting"),
                                               ("COMPLETED", "finished")])
def test_a_job_without_a_coordinator_yet_is_starting_not_an_error(tmp_path, monkeypatch, slurm_state, state):
    """Slurm runs the job and its coordinator has not registered yet: "starting", exit 0 (a script
    polls until "running"); once Slurm says it ended: "finished"."""
    (tmp_path / "jobs" / "9").mkdir(parents=True)
    monkeypatch.setattr(status_cmd, "client", lambda: _slurm(slurm_state))
    res = CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "status", "9"])
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[0].split() == ["JOBID", "STATE", "SLURM", "USER", "RANKS", "STEP", "COORDINATOR"]
    assert res.output.splitlines()[1].split()[:2] == ["9", state], res.output
    job = json.loads(CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "status", "9", "--json"]).output)
    assert job["jobs"][0]["state"] == state and "error" not in job


@pytest.mark.parametrize("owner", ["caller", "another user"])
def test_events_follow_of_a_pending_job_waits_for_its_directory_only_for_its_owner(tmp_path, monkeypatch, owner):
    """`events --follow` just after sbatch: the plugin makes STATE_DIR/jobs/J when the batch step
    starts. The owner's follow waits for it; anyone else gets the one not-found line at once."""
    from torchpass import layout
    from tpassctl import events_cmd

    slurm = FakeSlurm()
    uid = os.getuid() if owner == "caller" else os.getuid() + 4242
    slurm.run_job(9, uid=uid, nodes=("node1",), state="PENDING")
    monkeypatch.setattr(status_cmd, "client", lambda: slurm)
    monkeypatch.setattr(status_cmd, "job_privacy", lambda: (False, set()))  # the caller is no admin here
    followed = []
    monkeypatch.setattr(events_cmd, "follow", lambda *a: followed.append(a))
    made = threading.Timer(0.5, lambda: layout.job_dir(tmp_path, 9).mkdir(parents=True))
    made.start()
    try:
        res = CliRunner().invoke(cli, ["--state-dir", str(tmp_path), "events", "9", "--follow", "--json"])
    finally:
        made.join()
    if owner == "caller":
        assert res.exit_code == 0 and len(followed) == 1, res.output
    else:
        assert res.exit_code == 4 and followed == [], res.output
        assert json.loads(res.output)["error"]["code"] == "not_found"
