"""`tpassctl events` and `tpassctl migrate` against the real CoordinatorServer on loopback.

The server has a decision driver (no executor: the migration it starts goes no further than
its first decision) with 4 ranks on node1 and node2 and hot spares node3 and node4. Credentials
come from a private munged, so job.migrate's owner check runs for real.
"""

from __future__ import annotations

import json
import os
import threading

import pytest
from click.testing import CliRunner

from torchpass import layout, zmqio
from torchpass.coordinator import contract as ct
from torchpass.coordinator.driver import Driver
from torchpass.coordinator.job_record import JobState
from torchpass.coordinator.policy import CoordinatorPolicy
from torchpass.coordinator.server import CoordinatorServer, write_registration
from torchpass.health_state import State
from tpassctl.cli import cli
from tpassctl.events_cmd import events
from tpassctl.migrate_cmd import migrate

for _cmd in (events, migrate):
    if _cmd.name not in cli.commands:
        cli.add_command(_cmd)


@pytest.fixture
def served(tmp_path, munge, monkeypatch):
    monkeypatch.setenv("MUNGE_SOCKET", munge.socket)
    monkeypatch.delenv("TORCHPASS_MUNGE_SOCKET", raising=False)
    job = JobState(job_id=12, spares=2)
    driver = Driver(job, CoordinatorPolicy(), spares=("node3", "node4"), wall=lambda: 1_700_000_000.0)
    for n in ("node1", "node2", "node3", "node4"):
        driver.feed(ct.NodeHealthChanged(n, State.HEALTHY))
    server = CoordinatorServer(job, bind_address="127.0.0.1", wall=lambda: 1_700_000_000.0, driver=driver,
                               munge_socket=munge.socket)
    t = threading.Thread(target=server.serve, daemon=True)
    t.start()
    ep = f"tcp://127.0.0.1:{server.port}"
    for rank, node in enumerate(("node1", "node1", "node2", "node2")):
        zmqio.request(ep, "rank.register", {"job_id": 12, "rank": rank, "world_size": 4, "node": node,
                                            "pid": 100 + rank}, timeout_s=2, retries=0)
    write_registration(tmp_path, 12, {"job_id": 12, "endpoint": ep, "pid": os.getpid(), "host": "h",
                                      "uid": os.getuid()})
    yield server, tmp_path
    server.stop()
    t.join(5)
    assert not t.is_alive()


def _asked(server) -> tuple[str | None, list[tuple]]:
    """The migration the driver started (its id) and the operator requests queued behind it."""
    st = server.driver.state
    return (st.migration.id if st.migration else None), [(r.id, r.node, r.to) for r in st.operator_requests]


def run(state_dir, *args):
    return CliRunner().invoke(cli, ["--state-dir", str(state_dir), *args])


def last_line(res) -> str:
    # The server runs in this process, so its own log lines land in the captured output too.
    return res.output.strip().splitlines()[-1]


def test_migrate_queues_and_prints_the_migration_id(served):
    server, sd = served
    res = run(sd, "migrate", "12", "--node", "node2")
    assert res.exit_code == 0, res.output
    assert res.output.strip() == "migration m1 of node2 accepted for job 12; follow it: tpassctl events 12"
    res = run(sd, "migrate", "12", "--node", "node1", "--to", "node4", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output) == {"job_id": 12, "migration": "m2", "node": "node1", "to": "node4",
                                      "queued_behind": ["m1"]}
    # The first request started at once (the driver decides after each); the second waits behind it.
    assert _asked(server) == ("m1", [("m2", "node1", "node4")])
    assert server.driver.state.migration.node == "node2"
    assert [e.kind for e in server.job.events if e.kind == "migration.requested"] == ["migration.requested"] * 2


@pytest.mark.parametrize("args,expected,code", [
    (["--node", "node9"], "job 12: node node9 runs no rank of job 12 (its nodes: node1, node2)", 4),
    (["--node", "node1", "--to", "node7"], "job 12: node node7 is not a spare of job 12 (spares: node3, node4)", 4),
    (["--node", "node1", "--to", "node1"], "job 12: --to node1 is the node being migrated", 1),
])
def test_migrate_errors_are_one_line(served, args, expected, code):
    _, sd = served
    res = run(sd, "migrate", "12", *args)
    assert res.exit_code == code
    assert last_line(res) == f"Error: {expected}"


def test_migrate_twice_is_a_conflict(served):
    _, sd = served
    assert run(sd, "migrate", "12", "--node", "node2").exit_code == 0
    res = run(sd, "migrate", "12", "--node", "node2")
    assert res.exit_code == 1 and "a migration of node2 is already in flight or queued" in res.output


def test_migrate_unknown_job_and_unreachable_coordinator(served, tmp_path):
    _, sd = served
    res = run(sd, "migrate", "99", "--node", "node1")
    assert res.exit_code == 4 and "job 99: no torchpass job of yours with this id in" in res.output
    write_registration(sd, 13, {"job_id": 13, "endpoint": "tcp://127.0.0.1:9", "pid": 1, "host": "h",
                                "uid": os.getuid()})
    res = run(sd, "migrate", "13", "--node", "node1", "--timeout", "0.2")
    assert res.exit_code == 3
    assert res.output.strip() == ("Error: job 13: coordinator at tcp://127.0.0.1:9 did not answer within 0.2s; "
                                  "is the job still running? (tpassctl status 13)")


def test_migrate_without_munge_says_so(served, monkeypatch, tmp_path):
    server, sd = served
    monkeypatch.setenv("MUNGE_SOCKET", str(tmp_path / "no-munged.socket"))
    res = run(sd, "migrate", "12", "--node", "node2")
    assert res.exit_code == 1 and "job 12: cannot authenticate to the coordinator:" in res.output
    assert _asked(server) == (None, [])


def test_migrate_against_a_coordinator_without_the_handler(served):
    server, sd = served
    del server.handlers["job.migrate"]
    res = run(sd, "migrate", "12", "--node", "node2")
    assert res.exit_code == 1 and "does not support migrate" in res.output


def test_events_table_and_json_show_phase_durations(served):
    server, sd = served
    registered = len(server.job.events)  # rank.registered, one per rank
    assert registered == 4
    assert run(sd, "migrate", "12", "--node", "node2").exit_code == 0
    server.job.record(1_700_000_100.0, "migration.completed",
                      "m1: moved ranks [2, 3] from node2 to node3; node2 drained and released",
                      migration="m1", node="node2", target="node3", outcome="completed",
                      phase_durations={"total": 3.0, "pause": 0.5, "detect": 0.0, "dump": 0.3, "paused": 1.21})
    res = run(sd, "events", "12")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].endswith("rank.registered      rank 0 on node1 (pid 100)")
    lines = lines[registered:]
    assert len(lines) == 3
    assert lines[0].endswith("migration.requested  m1: operator (uid %d) asked to move node2" % os.getuid())
    assert "migration.completed  m1: moved ranks [2, 3] from node2 to node3" in lines[1]
    assert lines[2].strip() == "phases: detect 0.00s  pause 0.50s  dump 0.30s  paused 1.21s  total 3.00s"
    res = run(sd, "events", "12", "--json")
    jobs = json.loads(res.output)["jobs"]
    assert [e["kind"] for e in jobs[0]["events"]] == ["rank.registered"] * 4 + ["migration.requested",
                                                                                 "migration.completed"]
    assert jobs[0]["events"][-1]["data"]["phase_durations"]["pause"] == 0.5
    res = run(sd, "events", "12", "--since", str(registered + 1), "--json")
    assert [e["seq"] for e in json.loads(res.output)["jobs"][0]["events"]] == [registered + 2]


def test_events_of_every_job_and_errors(served):
    _, sd = served
    quiet = CoordinatorServer(JobState(job_id=15), bind_address="127.0.0.1")  # no rank yet: no events
    t = threading.Thread(target=quiet.serve, daemon=True)
    t.start()
    write_registration(sd, 15, {"job_id": 15, "endpoint": f"tcp://127.0.0.1:{quiet.port}", "pid": os.getpid(),
                                "host": "h", "uid": os.getuid()})
    write_registration(sd, 13, {"job_id": 13, "endpoint": "tcp://127.0.0.1:9", "pid": 1, "host": "h",
                                "uid": os.getuid()})
    res = run(sd, "events", "--timeout", "0.1")
    assert res.exit_code == 0, res.output
    assert "job 12  coordinator tcp://127.0.0.1:" in res.output and "rank.registered  rank 3 on node2" in res.output
    assert "job 13  coordinator tcp://127.0.0.1:9\n  ERROR: coordinator unreachable: no reply" in res.output
    assert f"job 15  coordinator tcp://127.0.0.1:{quiet.port}\n  no events" in res.output
    quiet.stop()
    t.join(5)
    res = run(sd, "events", "13", "--timeout", "0.1")
    assert res.exit_code == 3 and res.output.startswith("Error: job 13: coordinator unreachable: no reply from")
    res = run(sd, "events", "14")
    assert res.exit_code == 4 and "job 14: no torchpass job of yours with this id in" in res.output


def test_events_of_a_finished_job_come_from_its_saved_log(tmp_path):
    # The coordinator is gone (no registration); it left jobs/21/events.json behind.
    events = layout.events_json(tmp_path, 21)
    events.parent.mkdir(parents=True)
    saved = [
        {"seq": 1, "time": 1_700_000_000.0, "kind": "migration.started", "message": "m1: node2 -> node4", "data": {}},
        {"seq": 2, "time": 1_700_000_004.0, "kind": "migration.completed", "message": "m1 done",
         "data": {"phase_durations": {"pause": 0.25, "dump": 0.4, "total": 4.2}}},
    ]
    events.write_text(json.dumps(saved))
    res = run(tmp_path, "events", "21")
    assert res.exit_code == 0, res.output
    assert f"job 21 (coordinator gone; saved log {events})" in res.output
    assert "migration.completed" in res.output and "pause 0.25s  dump 0.40s  total 4.20s" in res.output
    res = run(tmp_path, "events", "21", "--json", "--since", "1")
    assert [e["seq"] for e in json.loads(res.output)["jobs"][0]["events"]] == [2]
    # A log that is not JSON is not shown as if it were events.
    events.write_text("{not json")
    res = run(tmp_path, "events", "21")
    assert res.exit_code == 4 and "job 21 has no torchpass coordinator registered" in res.output


def test_events_list_a_rank_s_coordinator_lost_note(tmp_path):
    """The coordinator died (kill -9: it saved nothing, its registration is left): the note is the event."""
    from torchpass import coordinator_lost

    write_registration(tmp_path, 23, {"job_id": 23, "endpoint": "tcp://127.0.0.1:9", "pid": 1, "host": "h",
                                      "uid": os.getuid()})
    res = run(tmp_path, "events", "23", "--timeout", "0.1")
    assert res.exit_code == 3 and "coordinator unreachable" in res.output  # no note yet: as before
    coordinator_lost.create(tmp_path, 23, {"time": 1_700_000_000.0, "rank": 0, "node": "node1", "error": "no reply"})
    res = run(tmp_path, "events", "23", "--timeout", "0.1")
    assert res.exit_code == 0, res.output
    assert "ERROR: coordinator unreachable" in res.output
    assert ("coordinator.lost  rank 0 on node1: the coordinator does not answer (no reply); the job is "
            "unprotected") in res.output
    # Beside a saved log, after its last event.
    layout.events_json(tmp_path, 23).write_text(json.dumps(
        [{"seq": 5, "time": 1_699_999_999.0, "kind": "migration.started", "message": "m1", "data": {}}]))
    got = json.loads(run(tmp_path, "events", "23", "--json", "--timeout", "0.1").output)["jobs"][0]["events"]
    assert [(e["seq"], e["kind"]) for e in got] == [(5, "migration.started"), (6, "coordinator.lost")]
    got = json.loads(run(tmp_path, "events", "23", "--json", "--since", "5", "--timeout", "0.1").output)
    assert [e["kind"] for e in got["jobs"][0]["events"]] == ["coordinator.lost"]
