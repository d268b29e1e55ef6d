"""The rank side of "Never left paused" (docs/coordinator.md) and coordinator.lost.

The control link is driven by hand (no thread, no coordinator) with an
injected wall clock: the pause command as the executor sends it, the
training thread's on_quiesced, then the deadline.
"""

from __future__ import annotations

import datetime
import json
import os
import threading

import pytest
import torch.distributed as dist

from torchpass import coordinator_lost, layout
from torchpass.runtime import control, pause_fallback
from torchpass.runtime.link_state import LinkState
from torchpass.runtime.pg import Rendezvous

D = 30.0
FALLBACK = {"command": "resume", "generation": 3, "master_addr": "127.0.0.1", "master_port": 1}


class FakePG:
    """What the link reads of a ReconfigurablePG, and the resumes it hands it."""

    unprotected = None
    paused = False
    steps = collectives = 0
    generation = 2
    rails: tuple[str, ...] = ()  # no data rails: the register names none

    def __init__(self, size: int = 3, rank: int = 1):
        self._size, self._rank = size, rank
        self.resumes: list[tuple[int, Rendezvous]] = []
        self.arms: list[tuple[int, int]] = []

    def rank(self):
        return self._rank

    def size(self):
        return self._size

    def arm(self, at, gen):
        self.arms.append((at, gen))
        return True

    def resume(self, gen, rv):
        self.resumes.append((gen, rv))
        return "resume"


class Exited(SystemExit):
    pass


class Link(control.ControlLink):
    """A link whose copy is the source (moved=False) or a restored copy (moved=True)."""

    copy_moved = False

    @property
    def moved(self):
        return self.copy_moved


def make(tmp_path, *, moved=False, rank=1, size=3, **kw):
    now = [1000.0]
    exits: list[int] = []

    def exit_(code):
        exits.append(code)
        if threading.current_thread() is threading.main_thread():
            raise Exited(code)  # the control thread stops there; the join watcher just ends

    link = Link(FakePG(size, rank), endpoint="tcp://127.0.0.1:1", job_id=7, rank=rank, node="node2",
                request_timeout_s=0.05, state_dir=str(tmp_path), rank_dir=str(tmp_path / "ranks"),
                wall=lambda: now[0], exit=exit_, **kw)
    link.copy_moved = moved
    return link, now, exits


def hold_at(tmp_path, migration: str, rank: int = 1):
    """Rank ``rank``'s hold file of ``migration`` where the layout puts it (make()'s state_dir)."""
    hold = layout.hold_file(tmp_path, 7, migration, rank)
    hold.parent.mkdir(parents=True, exist_ok=True)
    return hold


def pause(link, hold_file=None, deadline_s=D, join_s=5.0, fallback=FALLBACK):
    cmd = {"command": "pause", "at": 50, "generation": 3, "deadline_s": deadline_s, "fallback": fallback,
           "join_s": join_s}
    if hold_file:
        cmd["hold_file"] = str(hold_file)
    link._handle({"command": cmd})
    link.on_quiesced(link.pg, {"next_generation": 3, "sockets": 0, "drain_s": 0.0})


def settle(link):
    """The rebuild completed (the training thread's on_resumed): the join watcher ends."""
    link.on_resumed(link.pg, {"rebuild_s": 0.0})


def test_a_quiesced_rank_resumes_in_place_once_after_the_deadline(tmp_path, capfd):
    link, now, exits = make(tmp_path)
    pause(link)
    assert link.deadline() == 1000.0 + D
    now[0] += D - 0.1
    assert not link._expired()
    now[0] += 0.1
    assert link._expired()
    link._expire()
    settle(link)
    assert link.pg.resumes == [(3, Rendezvous("127.0.0.1", 1))]  # exactly the pause's fallback
    err = capfd.readouterr().err
    assert err.count("torchpass: no resume from the coordinator in 30 s: resuming in place "
                     "(the job is unprotected from now on)\n") == 1
    now[0] += 1000
    assert not link._expired() and link.deadline() is None  # once
    # Unprotected from now on: a later pause is refused and every report says why.
    link._outbox.clear()
    link._handle({"command": {"command": "pause", "at": 90, "generation": 4, "deadline_s": D, "fallback": FALLBACK}})
    (_, armed), = link._outbox
    assert armed["accepted"] is False and "without the coordinator" in armed["unprotected"]
    assert link.pg.arms == [(50, 3)] and exits == []


def test_a_resume_from_the_coordinator_ends_the_deadline(tmp_path):
    link, now, _ = make(tmp_path)
    pause(link)
    link._handle({"command": {"command": "resume", "generation": 3, "master_addr": "10.0.0.1", "master_port": 2}})
    now[0] += 10 * D
    assert not link._expired() and link.fell_back is None
    assert link.pg.resumes == [(3, Rendezvous("10.0.0.1", 2))]


def test_a_pause_without_a_deadline_waits_as_before(tmp_path):
    """An older coordinator's pause (no deadline_s, no fallback): nothing changes."""
    link, now, _ = make(tmp_path)
    link._handle({"command": {"command": "pause", "at": 50, "generation": 3}})
    link.on_quiesced(link.pg, {"next_generation": 3, "sockets": 0, "drain_s": 0.0})
    now[0] += 1e6
    assert link.deadline() is None and not link._expired()


def test_the_source_copy_claims_first_and_the_restored_copy_exits_untouched(tmp_path, capfd):
    hold = hold_at(tmp_path, "m1")
    # The dump marked the hand-off "moved" and the restored copy took the rank record (as rankwrap does).
    record, marker = layout.rank_record(tmp_path / "ranks", 7, 1), layout.handoff(tmp_path / "ranks", 7, 1)
    record.parent.mkdir(parents=True)
    launched = {"job": 7, "rank": 1, "wrapper_pid": 4242, "node": "node2"}
    record.write_text(json.dumps({"job": 7, "rank": 1, "wrapper_pid": 99, "node": "node4",
                                  "restored_from": "/snap/job7/rank1.gen3", "previous": launched}))
    marker.write_text("moved\n")
    source, now_s, exits_s = make(tmp_path)
    restored, now_r, exits_r = make(tmp_path, moved=True)
    pause(source, hold)
    pause(restored, hold)  # the restored copy is the source's memory: same pause, same quiesce time
    assert source.deadline() == 1000.0 + D
    assert restored.deadline() == 1000.0 + D + control.RESTORED_CLAIM_DELAY_S
    now_s[0] = now_r[0] = 1000.0 + D
    assert source._expired() and not restored._expired()
    source._hold()  # leaves the wait at the deadline, still holding
    source._expire()
    settle(source)
    assert source.pg.resumes == [(3, Rendezvous("127.0.0.1", 1))]
    assert (hold.parent / "m1.rank1.claim").read_text().split()[1] == str(os.getpid())
    # The move is called off as a rollback's tpassd would: this copy's task wrapper reports its exit code.
    assert marker.read_text() == "abort\n" and json.loads(record.read_text()) == launched
    now_r[0] += control.RESTORED_CLAIM_DELAY_S
    assert restored._expired()
    with pytest.raises(Exited):
        restored._expire()
    assert exits_r == [0] and restored.pg.resumes == [] and exits_s == []
    assert "rank 1: another copy of this rank went on" in capfd.readouterr().err


def test_the_restored_copy_goes_on_when_the_source_copy_is_gone(tmp_path):
    hold = hold_at(tmp_path, "m1")
    restored, now, exits = make(tmp_path, moved=True)
    pause(restored, hold)
    now[0] += D + control.RESTORED_CLAIM_DELAY_S
    restored._hold()
    restored._expire()
    settle(restored)
    assert restored.pg.resumes == [(3, Rendezvous("127.0.0.1", 1))] and exits == []
    assert (hold.parent / "m1.rank1.claim").exists()


def test_no_claim_once_the_coordinator_released_the_hold_file(tmp_path):
    hold = hold_at(tmp_path, "m1")
    link, now, _ = make(tmp_path)
    pause(link, hold)
    hold.touch()  # the coordinator released it (after the kill of the source, or a rollback)
    link._hold()
    assert link._hold_file is None
    now[0] += D  # ... and then died before the resume: resume in place, no claim
    link._expire()
    settle(link)
    assert link.pg.resumes and not (hold.parent / "m1.rank1.claim").exists()


def test_a_planted_claim_link_is_not_followed(tmp_path):
    hold = hold_at(tmp_path, "m1")
    target = tmp_path / "target"
    target.write_text("keep")
    (hold.parent / "m1.rank1.claim").symlink_to(target)
    link, now, exits = make(tmp_path)
    pause(link, hold)
    now[0] += D
    with pytest.raises(Exited):
        link._expire()  # the link counts as the other copy's claim: this copy does not go on
    assert exits == [0] and target.read_text() == "keep" and link.pg.resumes == []


def _store_master(size):
    return dist.TCPStore("127.0.0.1", 0, size, True, datetime.timedelta(seconds=5), wait_for_workers=False)


def test_a_fallback_whose_moved_rank_has_no_copy_fails_fast_naming_it(tmp_path, capfd):
    master = _store_master(3)  # rank 0's store: ranks 0 and 1 come back, rank 2 (the moved one) never does
    fb = {**FALLBACK, "master_port": master.port}
    master.set(pause_fallback.FALLBACK_KEY.format(gen=3) + "/rank0", "node1")
    link, now, exits = make(tmp_path)
    pause(link, join_s=1.5, fallback=fb)
    now[0] += D
    link._expire()
    t0 = link.clock()
    while not exits and link.clock() - t0 < 10:
        threading.Event().wait(0.05)
    assert exits == [1] and link.clock() - t0 < 5
    assert ("torchpass: rank 1: resume in place without the coordinator failed: rank(s) 2 did not join "
            "within 1.5 s (the moved rank has no live copy); the job cannot go on\n") in capfd.readouterr().err


def test_a_fallback_without_rank_0s_store_names_rank_0(tmp_path, capfd):
    link, now, exits = make(tmp_path)
    pause(link, join_s=1.0)  # nothing listens on 127.0.0.1:1
    now[0] += D
    link._expire()
    t0 = link.clock()
    while not exits and link.clock() - t0 < 10:
        threading.Event().wait(0.05)
    assert exits == [1]
    assert "rank(s) 0 did not join within 1 s" in capfd.readouterr().err


def test_the_first_rank_without_answers_notes_coordinator_lost_once(tmp_path, capfd):
    (tmp_path / "jobs" / "7").mkdir(parents=True)
    t = [0.0]
    a, _, _ = make(tmp_path, rank=0, lost_after_s=30.0, clock=lambda: t[0])
    b, _, _ = make(tmp_path, rank=1, lost_after_s=30.0, clock=lambda: t[0])
    for _ in range(3):
        assert a._request("rank.progress", {"job_id": 7, "rank": 0, "step": 0, "collectives": 0}) is None
        t[0] += 14.0
    assert not coordinator_lost.path(tmp_path, 7).exists()  # 28 s: not yet
    t[0] += 2.0
    a._request("rank.progress", {"job_id": 7, "rank": 0, "step": 0, "collectives": 0})
    note = json.loads(coordinator_lost.path(tmp_path, 7).read_text())
    assert note["rank"] == 0 and note["node"] == "node2" and note["time"] == 1000.0 and "no reply" in note["error"]
    for _ in range(2):
        b._request("rank.progress", {"job_id": 7, "rank": 1, "step": 0, "collectives": 0})
        t[0] += 40.0
    a._request("rank.progress", {"job_id": 7, "rank": 0, "step": 0, "collectives": 0})
    assert json.loads(coordinator_lost.path(tmp_path, 7).read_text())["rank"] == 0  # the first one's
    assert capfd.readouterr().err.count("torchpass: the coordinator does not answer; the job is unprotected\n") == 1
    assert coordinator_lost.read(tmp_path, 7) == note


def test_coordinator_lost_never_follows_a_planted_link(tmp_path):
    (tmp_path / "jobs" / "7").mkdir(parents=True)
    target = tmp_path / "target"
    target.write_text("keep")
    coordinator_lost.path(tmp_path, 7).symlink_to(target)
    assert coordinator_lost.create(tmp_path, 7, {"rank": 0}) is False
    assert target.read_text() == "keep"
    assert coordinator_lost.read(tmp_path, 7) is None  # and a link is not read either


def test_a_copy_restored_from_a_snapshot_registers_again_and_counts_its_deadline_from_its_wake(tmp_path):
    """The snapshot's own resume released the hold long ago. The relaunched step's rank wrapper
    removed the hold file, restored this copy and wrote it again saying "restored ID": the copy
    registers again naming the snapshot, and its deadline runs from the wake, not from the
    quiesce that happened before the snapshot was taken (else it would fall back at once)."""
    hold = hold_at(tmp_path, "snap-7")
    link, now, _ = make(tmp_path)
    link._enter(LinkState.REPORTING)  # registered
    pause(link, hold)
    now[0] += 3600.0  # the copy runs again an hour later
    hold.write_text(f"{layout.RESTORED_WAKE} snap-7\n")
    link._hold()
    assert link.registered is False and link.restored == "snap-7"
    assert link.deadline() == now[0] + D and not link._expired()
    sent = []
    link._request = lambda type_, body, **kw: sent.append((type_, body)) or {}
    link._register()
    (type_, body), = sent
    assert type_ == "rank.register" and body["restored"] == "snap-7" and body["rank"] == 1 and link.registered


def test_a_plainly_released_hold_changes_nothing_about_registration(tmp_path):
    hold = hold_at(tmp_path, "m1")
    link, now, _ = make(tmp_path)
    link._enter(LinkState.REPORTING)  # registered
    pause(link, hold)
    hold.touch()
    link._hold()
    assert link.registered is True and link.restored is None and link.deadline() == 1000.0 + D
