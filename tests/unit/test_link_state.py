"""The control link's state: one table of legal moves (link_state.TRANSITIONS), checked on every
move, and the link's life walked through it: registered, paused, held, released, resumed, and
fallen back without the coordinator."""

from __future__ import annotations

import pytest

from test_never_left_paused import D, hold_at, make, pause
from torchpass.runtime import link_state
from torchpass.runtime.link_state import TRANSITIONS, IllegalLinkTransition, LinkState

S = LinkState


def test_the_table_names_every_state_and_nothing_leaves_stopped():
    assert set(TRANSITIONS) == set(LinkState)
    assert all(new in LinkState for targets in TRANSITIONS.values() for new in targets)
    assert TRANSITIONS[S.STOPPED] == frozenset()
    assert all(S.STOPPED in targets for state, targets in TRANSITIONS.items() if state is not S.STOPPED)


def test_an_illegal_move_raises_in_strict_mode_and_is_said_in_production(monkeypatch):
    assert link_state.strict()  # tests/conftest.py
    with pytest.raises(IllegalLinkTransition):
        link_state.check_transition(S.FELL_BACK, S.QUIESCED)
    with pytest.raises(IllegalLinkTransition):
        link_state.check_transition(S.REGISTERING, S.HOLDING)
    monkeypatch.setenv("TORCHPASS_STRICT_TRANSITIONS", "0")
    assert "fell_back -> quiesced" in link_state.check_transition(S.FELL_BACK, S.QUIESCED)
    assert link_state.check_transition(S.REPORTING, S.QUIESCED) is None


def test_a_link_that_fell_back_refuses_to_be_moved_back(tmp_path):
    link, _now, _ = make(tmp_path)
    link._enter(S.REPORTING)
    link._enter(S.QUIESCED)
    link._enter(S.FELL_BACK)
    with pytest.raises(IllegalLinkTransition):
        link._enter(S.QUIESCED)
    assert link.state is S.FELL_BACK


def test_a_pause_held_released_and_resumed_walks_the_table(tmp_path):
    hold = hold_at(tmp_path, "m1")
    link, _now, _ = make(tmp_path)
    assert link.state is S.REGISTERING and not link.registered
    link._enter(S.REPORTING)  # registered
    pause(link, hold)
    assert link.state is S.QUIESCED
    hold.touch()
    link._hold()
    assert link.state is S.QUIESCED  # released: still paused, its deadline runs
    link._handle({"command": {"command": "resume", "generation": 3, "master_addr": "10.0.0.1", "master_port": 2}})
    assert link.state is S.REPORTING and link.deadline() is None
    link.stop()
    assert link.state is S.STOPPED and link.registered


def test_no_resume_by_the_deadline_falls_back_for_good(tmp_path):
    link, now, _ = make(tmp_path)
    link._enter(S.REPORTING)
    pause(link, join_s=0.2)
    now[0] += D
    link._expire()
    assert link.state is S.FELL_BACK and link.fell_back
    link._enter(S.STOPPED)
    assert link.state is S.STOPPED
