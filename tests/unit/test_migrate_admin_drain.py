"""An admin's `tpassctl migrate` of another user's job drains the (healthy) node through its
tpassd; the owner's own request does not (drains by root). A real tpassd on loopback
(munge-authenticated, Slurm faked for the job's owner and the drain itself) and a stub
coordinator that accepts the move. Without the drain request tpassctl leaves the node in service."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import zmq
from click.testing import CliRunner

from support.fake_slurm import FakeSlurm
from torchpass import layout, zmqio
from torchpass.coordinator.server import write_registration
from tpassctl.cli import cli
from tpassctl.migrate_cmd import admin_moves_others_job, migrate
from tpassd.daemon import Tpassd
from tpassd.testing import fake_node_config

if migrate.name not in cli.commands:
    cli.add_command(migrate)

USER = 1001  # tpuser1 (docs: a second unprivileged user exists on this machine)
JOB = 12


@pytest.fixture
def world(tmp_path, munge, monkeypatch):
    monkeypatch.setenv("MUNGE_SOCKET", munge.socket)
    monkeypatch.delenv("TORCHPASS_MUNGE_SOCKET", raising=False)
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "no-slurm.conf"))  # admins: root alone
    slurm = FakeSlurm()
    slurm.run_job(JOB, user="tpuser1", uid=USER, nodes=("node1", "node2"))
    node = Tpassd(fake_node_config(tmp_path, "node1", munge.socket, interval_s=0.2, collector_timeout_s=0.15),
                  slurm_client=slurm, admin_uids=lambda: frozenset({0})).start()
    ctx = zmq.Context()
    sock, port = zmqio.bind_router(ctx, "127.0.0.1", 0)
    stop = threading.Event()

    def coordinator():  # accepts every move, as the real one does for a valid request
        while not stop.is_set():
            if sock.poll(50):
                zmqio.serve_one(sock, {"job.migrate": lambda m: {"migration": "m1", "node": m.body["node"],
                                                                   "to": None, "queued_behind": []}})

    t = threading.Thread(target=coordinator, daemon=True)
    t.start()
    state = tmp_path / "shared"
    reg = write_registration(state, JOB, {"job_id": JOB, "endpoint": f"tcp://127.0.0.1:{port}", "uid": USER})
    os.chown(reg.parent, USER, USER)  # jobs/J: the plugin (root) gave it to the job's owner
    os.chown(reg, USER, USER)  # the coordinator runs as the job's owner and wrote it
    yield state, node, slurm, f"node1=tcp://127.0.0.1:{node.ports()['control_port']}"
    stop.set()
    t.join(5)
    sock.close(linger=0)
    ctx.term()
    node.stop()


def run(state, *args):
    return CliRunner().invoke(cli, ["--state-dir", str(state), "migrate", str(JOB), "--node", "node1", *args])


def test_root_migrating_another_users_job_drains_the_healthy_node(world):
    state, node, slurm, ep = world
    # The node is healthy before the move (its first sample is in: under load a collector of the
    # first sample can miss its 0.15 s and leave the node unknown; seen once in a full unit run).
    end = time.monotonic() + 10
    while (node.last_sample is None or node.last_sample["state"] != "healthy") and time.monotonic() < end:
        time.sleep(0.05)
    assert node.last_sample is not None and node.last_sample["state"] == "healthy", node.last_sample
    res = run(state, "--endpoint", ep, "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output[res.output.index("{"):])
    assert out["migration"] == "m1" and out["drain"]["node"] == "node1", out
    assert slurm.drained == [("node1", "torchpass: operator request (admin uid 0)")]
    assert out["drain"]["health"] == "healthy"


def test_no_drain_leaves_it_in_service(world):
    state, _, slurm, ep = world
    res = run(state, "--endpoint", ep, "--no-drain")
    assert res.exit_code == 0 and "drained" not in res.output, res.output
    assert slurm.drained == []


def test_the_owners_own_request_does_not_drain(world):
    state, _, slurm, ep = world
    reg = layout.coordinator_json(state, JOB)
    os.chown(reg.parent, 0, 0)  # root's own job: jobs/J is root's, and so is its registration;
    write_registration(state, JOB, {**json.loads(reg.read_text()), "uid": 0})  # its coordinator drains as today
    res = run(state, "--endpoint", ep)
    assert res.exit_code == 0 and "drained" not in res.output, res.output
    assert slurm.drained == []
    assert not admin_moves_others_job({"uid": 0}, uid=USER)  # an ordinary user is never an admin
    assert admin_moves_others_job({"uid": USER}, uid=0)


def test_a_drain_that_cannot_be_asked_is_a_warning_not_a_failure(world):
    state, _, slurm, _ = world
    res = run(state, "--endpoint", "node2=tcp://127.0.0.1:1")
    assert res.exit_code == 0, res.output
    assert "warning: node1 not drained: unknown node(s) node1" in res.output
    assert slurm.drained == []
