"""The breakeven solver: the input value at which live migration ties checkpointless.

The run is a whole number of checkpoint segments, so goodput steps by ~1e-6 where the count
changes: a tie is a tie to 1e-5.
"""

from __future__ import annotations

import dataclasses

import pytest

from torchpass.goodput import model
from torchpass.goodput.model import GoodputInputs, build_inputs
from torchpass.goodput.presets import PRESETS


def llama3() -> GoodputInputs:
    inp, _ = build_inputs([("llama3-16k", PRESETS["llama3-16k"].values)])
    return inp


def test_a_tie_is_a_tie_and_the_side_of_it_is_right():
    inp = llama3()
    b = model.solve_breakeven_one(inp, "lm_checkpoint_save_s")
    assert b.state == model.BREAKEVEN_TIES_AT and 0 < b.value_s < inp.checkpoint_save_s
    at = dataclasses.replace(inp, lm_checkpoint_save_s=b.value_s)
    assert model.goodput_gap(at) == pytest.approx(0.0, abs=1e-5)
    assert model.goodput_gap(dataclasses.replace(inp, lm_checkpoint_save_s=b.value_s * 0.9)) > 0
    assert model.goodput_gap(dataclasses.replace(inp, lm_checkpoint_save_s=b.value_s * 1.1)) < 0


def test_behind_at_zero_when_saves_and_recompute_alone_cost_more_than_checkpointless():
    """llama3-16k with 30 s blocking saves: even a free recovery leaves saves and recompute behind."""
    inp = llama3()
    for varied in ("lm_hard_recovery_s", "lm_gpu_killed_s"):
        b = model.solve_breakeven_one(inp, varied)
        assert (b.state, b.value_s) == (model.BREAKEVEN_BEHIND_AT_ZERO, None)
    free = dataclasses.replace(inp, lm_relaunch_s=0.0, lm_gpu_killed_s=0.0)
    assert model.evaluate(free).strategies["live_migration"].goodput < \
        model.evaluate(free).strategies["checkpointless"].goodput


def test_recovery_time_ties_where_the_restore_point_is_cheap():
    inp = dataclasses.replace(llama3(), lm_checkpoint_save_s=0.5)
    solved = model.solve_breakeven(inp)
    hard, killed = solved["lm_hard_recovery_s"], solved["lm_gpu_killed_s"]
    assert hard.state == model.BREAKEVEN_TIES_AT
    assert model.goodput_gap(dataclasses.replace(inp, lm_relaunch_s=hard.value_s, lm_gpu_killed_s=hard.value_s)) \
        == pytest.approx(0.0, abs=1e-5)
    # only part of the hard failures move with lm_gpu_killed_s: it may be larger, or unbounded
    assert killed.state in (model.BREAKEVEN_TIES_AT, model.BREAKEVEN_AHEAD_AT_ANY, model.BREAKEVEN_BEHIND_AT_ZERO)
    if killed.state == model.BREAKEVEN_TIES_AT:
        assert model.goodput_gap(dataclasses.replace(inp, lm_gpu_killed_s=killed.value_s)) == \
            pytest.approx(0.0, abs=1e-5)


def test_inputs_that_do_not_enter_the_model_are_said_so():
    inp = dataclasses.replace(llama3(), lm_hard_failure="requeue")
    assert model.solve_breakeven_one(inp, "lm_hard_recovery_s").state == model.BREAKEVEN_NOT_APPLICABLE
    assert model.solve_breakeven_one(inp, "lm_gpu_killed_s").state == model.BREAKEVEN_NOT_APPLICABLE
    assert model.solve_breakeven_one(dataclasses.replace(llama3(), gpu_killed_fraction=0.0),
                               "lm_gpu_killed_s").state == model.BREAKEVEN_NOT_APPLICABLE
