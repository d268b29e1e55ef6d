"""tpassd.account (tpassd/accounting.py) and the coordinator's side (accounting_actions.py): root
rewrites only the torchpass part of a job it verified, from the job's own event log, read
without following links."""

from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace

import pytest

from torchpass import layout, wire
from torchpass.auth import AuthFailure
from torchpass.coordinator.accounting_actions import JobAccounting as CoordinatorAccounting
from torchpass.errors import RemoteError, SlurmError
from torchpass.slurm.base import JobInfo
from tpassd.accounting import EVENTS_MAX, JobAccounting

ME = os.getuid()
NODE = "n1"


class Slurm:
    def __init__(self, job: JobInfo | None):
        self.job_info, self.updates = job, []

    def job(self, job_id):
        return self.job_info

    def set_job_field(self, job_id, name, value):
        self.updates.append((job_id, name, value))


def running(admin_comment="", user_id=ME, nodes=(NODE, "n2")) -> JobInfo:
    return JobInfo(job_id=7, name="train", user="u", user_id=user_id, state="RUNNING", nodes=nodes,
                   admin_comment=admin_comment)


EVENTS = [{"seq": 1, "time": 0, "kind": "migration.completed", "message": "",
           "data": {"node": "n2", "target": "n9", "outcome": "completed", "phase_durations": {"paused": 0.61}}},
          {"seq": 2, "time": 0, "kind": "snapshot.completed", "message": "", "data": {}}]


@pytest.fixture
def state_dir(tmp_path):
    path = layout.events_json(tmp_path, 7)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(EVENTS))
    return tmp_path


def account(state_dir, slurm, uid=ME, field="AdminComment", admins=()):
    acc = JobAccounting(NODE, state_dir, field, lambda: slurm, lambda u: u in admins)
    msg = wire.Message("tpassd.account", {"job_id": 7})
    return acc.handle(msg, SimpleNamespace(uid=uid, gid=uid))


def test_the_owner_gets_the_part_written_after_the_foreign_one(state_dir):
    slurm = Slurm(running("site: foo"))
    res = account(state_dir, slurm)
    value = "site: foo | torchpass: mig 1 (n2->n9 ok 0.6s); snap 1"
    assert res == {"job_id": 7, "field": "AdminComment", "value": value, "changed": True}
    assert slurm.updates == [(7, "AdminComment", value)]
    slurm.job_info = running(value)
    assert account(state_dir, slurm)["changed"] is False and len(slurm.updates) == 1


def test_another_users_job_is_refused_but_root_and_slurmuser_may(state_dir):
    slurm = Slurm(running(user_id=ME + 1))
    with pytest.raises(AuthFailure, match="does not own"):
        account(state_dir, slurm)
    assert slurm.updates == []
    # The job directory and the log must be the owner's (Slurm's word), whoever asks.
    with pytest.raises(RemoteError, match=r"belongs to uid \d+, not to the job's owner"):
        account(state_dir, slurm, uid=0, admins=(0,))
    os.chown(layout.job_dir(state_dir, 7), ME + 1, -1)
    with pytest.raises(RemoteError, match="not a file of uid"):
        account(state_dir, slurm, uid=0, admins=(0,))


def test_a_job_that_does_not_run_here_or_is_unknown_is_refused(state_dir):
    with pytest.raises(AuthFailure, match="does not run on n1"):
        account(state_dir, Slurm(running(nodes=("n2",))))
    with pytest.raises(RemoteError, match="not known"):
        account(state_dir, Slurm(None))


def test_a_symlinked_or_oversized_event_log_is_refused(state_dir, tmp_path_factory):
    other = tmp_path_factory.mktemp("other") / "events.json"
    other.write_text(json.dumps(EVENTS))
    path = layout.events_json(state_dir, 7)
    path.unlink()
    path.symlink_to(other)
    slurm = Slurm(running())
    with pytest.raises(RemoteError, match="symlink"):
        account(state_dir, slurm)
    path.unlink()
    with open(path, "wb") as f:
        f.truncate(EVENTS_MAX + 1)
    with pytest.raises(RemoteError, match="more than"):
        account(state_dir, slurm)
    assert slurm.updates == []


def test_a_log_swapped_for_a_link_to_a_root_file_while_tpassd_reads_never_counts_that_file(state_dir, tmp_path_factory):
    """The owner races tpassd: a thread swaps events.json, by rename, between their own log and a
    symlink to a root-only log of 7 migrations, while tpassd answers 300 requests. Every answer
    counts the owner's log (1 migration) or refuses; none counts the root file."""
    owner = ME + 12345  # an ordinary user's uid: no file of root's is theirs
    secret = tmp_path_factory.mktemp("root-only") / "events.json"
    secret.write_text(json.dumps([{**EVENTS[0], "seq": i} for i in range(1, 8)]))
    secret.chmod(0o600)
    jdir = layout.job_dir(state_dir, 7)
    os.chown(jdir, owner, -1)
    log_path = layout.events_json(state_dir, 7)
    os.chown(log_path, owner, -1)
    real, link = jdir / "real.tmp", jdir / "link.tmp"
    stop = threading.Event()

    def swap():
        while not stop.is_set():
            os.link(log_path, real)  # keep the owner's log under a second name...
            os.unlink(log_path)
            link.symlink_to(secret)
            os.rename(link, log_path)  # ...put the link in its place...
            os.rename(real, log_path)  # ...and the log back (one link again)

    slurm = Slurm(running(user_id=owner))
    answers = {"mig 1": 0, "refused": 0}
    racer = threading.Thread(target=swap, daemon=True)
    racer.start()
    try:
        for _ in range(300):
            try:
                value = account(state_dir, slurm, uid=owner)["value"]
            except RemoteError as exc:
                assert "event log" in str(exc), exc
                answers["refused"] += 1
                continue
            assert value.startswith("torchpass: mig 1 "), value  # never "mig 7"
            answers["mig 1"] += 1
    finally:
        stop.set()
        racer.join(5)
    print(f"answers while racing: {answers}")
    assert all(answers.values()), answers  # both states of the file were met


def test_the_comment_field_and_off(state_dir):
    slurm = Slurm(running())
    assert account(state_dir, slurm, field="Comment")["value"].startswith("torchpass: mig 1")
    assert slurm.updates[0][1] == "Comment"
    with pytest.raises(RemoteError, match="accounting is off"):
        account(state_dir, slurm, field="")


def test_a_failed_scontrol_is_a_failed_reply(state_dir):
    slurm = Slurm(running())

    def refuse(*_a):
        raise SlurmError("Access/permission denied")
    slurm.set_job_field = refuse
    with pytest.raises(RemoteError, match="could not set AdminComment"):
        account(state_dir, slurm)


class Tpassd:
    def __init__(self, delay_s=0.0):
        self.requests, self.delay_s = [], delay_s

    def request(self, node, type_, body, timeout_s):
        time.sleep(self.delay_s)
        self.requests.append((node, type_, body))
        return {"field": "AdminComment", "value": "torchpass: snap 1"}


def ports(tpassd):
    def thread(fn, name):
        import threading
        t = threading.Thread(target=fn, name=name, daemon=True)
        t.start()
        return t
    return SimpleNamespace(tpassd=tpassd, job_id=7, thread=thread)


def wait_for(cond, timeout_s=10.0):
    end = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


def test_the_coordinator_asks_its_own_nodes_tpassd_after_accounted_events_only():
    tpassd = Tpassd()
    acc = CoordinatorAccounting(ports(tpassd), node="n1")
    try:
        acc.event_recorded("rank.registered")
        acc.event_recorded("migration.started")
        time.sleep(0.2)
        assert tpassd.requests == []
        acc.event_recorded("migration.completed")
        assert wait_for(lambda: tpassd.requests == [("n1", "tpassd.account", {"job_id": 7})])
    finally:
        acc.close()


def test_events_during_a_request_cost_one_more_request_not_one_each():
    tpassd = Tpassd(delay_s=0.5)
    acc = CoordinatorAccounting(ports(tpassd), node="n1")
    try:
        acc.event_recorded("snapshot.completed")
        time.sleep(0.1)
        for _ in range(5):
            acc.event_recorded("snapshot.completed")
        assert wait_for(lambda: len(tpassd.requests) == 2)
        time.sleep(0.8)
        assert len(tpassd.requests) == 2
    finally:
        acc.close()
