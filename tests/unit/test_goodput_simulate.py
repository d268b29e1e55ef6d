"""The Monte Carlo simulator: by hand on scripted failures, then against the closed form."""

from __future__ import annotations

import math

import numpy as np  # a core dependency (pyproject): missing it is an install bug, not a skip
import pytest

from torchpass.errors import ConfigError
from torchpass.goodput import model
from torchpass.goodput.model import GoodputInputs, build_inputs, evaluate
from torchpass.goodput.presets import PRESETS
from torchpass.goodput.simulate import simulate, simulate_plan

# The documented tolerance: the simulated mean wall time within 2% of the closed form.
TOLERANCE = 0.02


class ScriptedRng:
    """Plays back given gaps (hours) and hard/soft draws instead of random ones."""

    def __init__(self, gaps, uniforms):
        self.gaps = list(gaps)
        self.uniforms = list(uniforms)

    def exponential(self, mean, size):
        out, self.gaps = self.gaps[:size], self.gaps[size:]
        return np.array(out, dtype=float)

    def random(self, size):
        out, self.uniforms = self.uniforms[:size], self.uniforms[size:]
        return np.array(out, dtype=float)


def one_hour_segments(**changes) -> GoodputInputs:
    # 100 GPUs, lambda = 0.1/h; tau 0.9 h + C 0.1 h = 1 h segments; 2.7 h of work
    # -> 3 segments, 3.0 h of exposed schedule; a hard failure costs 0.5 h.
    values = dict(
        gpus=100, gpu_mtbf_hours=1000.0, work_hours=2.7, spare_policy="pool", replacement_wait_s=0.0,
        cr_detect_s=600.0, cr_restart_s=600.0, checkpoint_load_s=600.0, checkpoint_save_s=360.0,
        checkpoint_interval_s=3240.0, lm_overhead=0.0, lm_detect_s=0.0, lm_migrate_s=720.0, soft_fraction=0.5,
    )
    values.update(changes)
    return GoodputInputs(**values)


def test_scripted_hard_failure_rolls_back_to_the_last_checkpoint():
    inp = one_hour_segments()
    plan = model.plans(inp)["checkpoint_restart"]
    # Failure 1.5 h in (segment 2 of 3): back to 1.0 h, pay 0.5 h. Then the next
    # gap of 2.5 h reaches 3.5 h >= 3.0 h: the run ends after 2.0 more hours.
    rng = ScriptedRng(gaps=[1.5, 2.5], uniforms=[0.0])
    wall, failures = simulate_plan(inp, plan, runs=1, rng=rng)
    assert wall[0] == pytest.approx(1.5 + 0.5 + 2.0)
    assert failures[0] == 1


def test_scripted_soft_failure_keeps_progress():
    inp = one_hour_segments()
    plan = model.plans(inp)["live_migration"]  # hard share 0.5
    # 1.5 h in, a soft failure (uniform 0.9 >= 0.5): pause 0.2 h, keep 1.5 h of
    # progress; then a hard one 0.8 h later at 2.3 h: back to 2.0 h, pay 0.5 h;
    # then 1.0 h to the end.
    rng = ScriptedRng(gaps=[1.5, 0.8, 5.0], uniforms=[0.9, 0.1])
    wall, failures = simulate_plan(inp, plan, runs=1, rng=rng)
    assert wall[0] == pytest.approx(1.5 + 0.2 + 0.8 + 0.5 + 1.0)
    assert failures[0] == 2


def test_scripted_runs_are_vectorised_independently():
    inp = one_hour_segments()
    plan = model.plans(inp)["checkpoint_restart"]
    # Run 0 gets gap 5.0 (no failure); run 1 gets 0.5 (fail in segment 1, back
    # to 0) and then 4.0 (finish): 0.5 + 0.5 + 3.0 h.
    rng = ScriptedRng(gaps=[5.0, 0.5, 4.0], uniforms=[0.0])
    wall, failures = simulate_plan(inp, plan, runs=2, rng=rng)
    assert wall.tolist() == pytest.approx([3.0, 4.0])
    assert failures.tolist() == [0, 1]


def _assert_agrees(inp: GoodputInputs, runs: int, seed: int = 1, jensen_gap_ok: bool = False):
    closed = evaluate(inp)
    sims = simulate(inp, runs=runs, seed=seed, closed_form=closed)
    for name, sim in sims.items():
        expected = closed.strategies[name].wall_hours
        diff = sim.wall_hours.mean - expected
        # Exact model: the difference is sampling noise, so within 4 standard errors...
        assert abs(diff) <= 4 * sim.wall_hours_std_error + 1e-9 * expected, (name, diff, sim.wall_hours_std_error)
        # ... and within the documented tolerance.
        assert abs(sim.wall_hours_rel_diff_vs_model) < TOLERANCE
        if jensen_gap_ok:
            # The mean of per-run goodput W/T exceeds W/E[T] (Jensen: 1/T is
            # convex) by about var(T)/E[T]^2, which is not small when a run
            # has few, costly failures.
            # Sample by sample (AM-HM): mean(W/T) >= W / mean(T).
            pooled = inp.gpus * inp.work_hours / ((inp.gpus + inp.spare_gpus) * sim.wall_hours.mean)
            assert sim.goodput.mean >= pooled * (1 - 1e-12)
            assert abs(sim.goodput_rel_diff_vs_model) < 0.05
        else:
            assert abs(sim.goodput_rel_diff_vs_model) < TOLERANCE
        assert sim.wall_hours.p5 <= sim.wall_hours.mean <= sim.wall_hours.p95
        assert sim.goodput.p5 <= sim.goodput.mean <= sim.goodput.p95
        assert sim.failures.mean == pytest.approx(closed.strategies[name].failures, rel=0.05, abs=0.05)
    return sims


def test_simulator_matches_closed_form_hand_case():
    _assert_agrees(one_hour_segments(work_hours=90.0), runs=4000)


def test_simulator_matches_closed_form_when_failures_are_frequent():
    # lambda * a ~ 2: two failures per segment on average, far from the first-order
    # regime; the closed form is exact there too.
    inp = one_hour_segments(gpu_mtbf_hours=50.0, work_hours=30.0, checkpoint_interval_s=None)
    inp = GoodputInputs(**{**inp.as_dict(), "checkpoint_interval_s": 3240.0})
    assert evaluate(inp).strategies["checkpoint_restart"].failures > 50
    _assert_agrees(inp, runs=3000, jensen_gap_ok=True)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_simulator_within_two_percent_for_every_preset(name):
    inp, _ = build_inputs([(name, PRESETS[name].values)])
    _assert_agrees(inp, runs=2000, seed=0)


def test_seed_makes_runs_reproducible():
    inp = one_hour_segments(work_hours=90.0)
    a = simulate(inp, runs=200, seed=7)
    b = simulate(inp, runs=200, seed=7)
    c = simulate(inp, runs=200, seed=8)
    assert a["checkpoint_restart"].wall_hours == b["checkpoint_restart"].wall_hours
    assert a["checkpoint_restart"].wall_hours != c["checkpoint_restart"].wall_hours


def test_weibull_gaps_keep_the_mean_rate():
    from torchpass.goodput.simulate import _gap_sampler

    rng = np.random.default_rng(0)
    for shape in (0.5, 0.7, 1.0, 2.0):
        gaps = _gap_sampler(np, rng, rate=0.25, weibull_shape=shape)(400_000)
        # Mean 1 / 0.25 = 4 h whatever the shape; the sample mean's error is
        # ~ sd / sqrt(n) < 0.3% even for the heavy shape 0.5 (sd = 2.24 * mean).
        assert gaps.mean() == pytest.approx(4.0, rel=0.015)


def test_weibull_without_rollback_agrees_with_renewal_theory():
    # No rollbacks (checkpointless): failures in U hours of a renewal process
    # average U / mean (+ O(1)), so the closed form still holds within 2%
    # for long runs, while the spread widens for clustered failures.
    base = one_hour_segments(work_hours=500.0, cl_overhead=0.0)
    poisson = simulate(base, runs=1000, seed=3)["checkpointless"]
    clustered_inp = GoodputInputs(**{**base.as_dict(), "weibull_shape": 0.5})
    clustered = simulate(clustered_inp, runs=1000, seed=3)["checkpointless"]
    assert clustered.failure_process == "weibull(shape=0.5)"
    assert abs(clustered.wall_hours_rel_diff_vs_model) < TOLERANCE
    assert (clustered.wall_hours.p95 - clustered.wall_hours.p5) > (poisson.wall_hours.p95 - poisson.wall_hours.p5)


def test_no_failures_gives_the_schedule_exactly():
    # One GPU at 1e9 h MTBF: practically never fails; the wall time is the
    # schedule: 2.7 h of work + 3 saves of 0.1 h.
    inp = one_hour_segments(gpus=1, gpu_mtbf_hours=1e9, gpus_per_node=1)
    sims = simulate(inp, runs=10, seed=0)
    assert sims["checkpoint_restart"].wall_hours.mean == pytest.approx(3.0)
    assert sims["checkpointless"].wall_hours.mean == pytest.approx(2.7 / (1 - 0.02))


def test_bad_arguments_are_errors():
    inp = one_hour_segments()
    with pytest.raises(ConfigError, match="runs must be"):
        simulate(inp, runs=0)
    with pytest.raises(ConfigError, match="seed must be"):
        simulate(inp, runs=10, seed=-1)
    crowded = GoodputInputs(gpus=100_000, gpu_mtbf_hours=1000.0, work_hours=5000.0, spare_nodes=10_000)
    with pytest.raises(ConfigError, match="too many to simulate"):
        simulate(crowded, runs=10)


def test_costs_follow_wall_time():
    inp = one_hour_segments(work_hours=20.0, usd_per_gpu_hour=2.5)
    sim = simulate(inp, runs=500, seed=0)["checkpoint_restart"]
    # cost = 100 GPUs * wall * $2.5 run by run, so the means follow too.
    assert sim.cost_usd.mean == pytest.approx(100 * 2.5 * sim.wall_hours.mean)
    assert math.isfinite(sim.wall_hours_std_error)


def gpu_killed_case(**changes) -> GoodputInputs:
    # 10 nodes with a hot spare: half the hard failures a GPU killed (0.01 h), the rest nodes lost
    # outright (1 h to relaunch; the batch host's 1 in 10 of those requeued, 0.5 h).
    values = dict(gpus_per_node=10, spare_policy="hot", spare_nodes=1, gpu_killed_fraction=0.5,
                  lm_gpu_killed_s=36.0, lm_relaunch_s=3600.0)
    values.update(changes)
    return one_hour_segments(**values)


@pytest.mark.parametrize("kind_draw, loss", [(0.2, 0.01), (0.7, 1.0), (0.99, 0.5)])
def test_scripted_hard_failure_pays_its_kinds_recovery(kind_draw, loss):
    inp = gpu_killed_case()
    plan = model.plans(inp)["live_migration"]
    assert [k.share for k in plan.hard_kinds] == pytest.approx([0.5, 0.45, 0.05])
    # 1.5 h in: hard (0.0 < 0.5), of the kind kind_draw picks; back to 1.0 h, then 2.0 h to the end
    rng = ScriptedRng(gaps=[1.5, 2.5], uniforms=[0.0, kind_draw])
    wall, failures = simulate_plan(inp, plan, runs=1, rng=rng)
    assert wall[0] == pytest.approx(1.5 + loss + 2.0)
    assert failures[0] == 1


def test_simulator_matches_closed_form_with_gpu_killed_failures():
    _assert_agrees(gpu_killed_case(work_hours=90.0), runs=4000)
    # and at scale, with the defaults' split
    inp, _ = build_inputs([("llama3-16k", PRESETS["llama3-16k"].values), ("t", {"gpu_killed_fraction": 0.41})])
    assert len(model.plans(inp)["live_migration"].hard_kinds) == 3
    _assert_agrees(inp, runs=1000, seed=3)
