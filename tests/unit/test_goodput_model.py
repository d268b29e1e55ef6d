"""The closed-form goodput model against hand-worked cases and published figures."""

from __future__ import annotations

import dataclasses
import math

import pytest

from torchpass.errors import ConfigError
from torchpass.goodput import model
from torchpass.goodput.model import GoodputInputs, build_inputs, evaluate
from torchpass.goodput.presets import PRESETS, get_preset

# A small job whose numbers come out round: 100 GPUs at 1,000 GPU-hours MTBF
# fail at lambda = 100 / 1000 = 0.1 per hour (job MTBF 10 h).
ROUND = dict(
    gpus=100,
    gpus_per_node=4,
    gpu_mtbf_hours=1000.0,
    work_hours=9.0,
    usd_per_gpu_hour=3.0,
    spare_policy="pool",
    replacement_wait_s=1800.0,  # 0.5 h for a replacement node
    cr_detect_s=360.0,
    cr_restart_s=1080.0,
    checkpoint_load_s=360.0,  # 0.1 + 0.3 + 0.1 = 0.5 h to restart
    checkpoint_save_s=360.0,  # C = 0.1 h
    checkpoint_interval_s=3240.0,  # tau = 0.9 h, so a segment is a = 1.0 h
    cl_detect_s=180.0,
    cl_recover_s=540.0,  # 0.2 h from peers
    cl_overhead=0.1,
    lm_detect_s=36.0,
    lm_migrate_s=324.0,  # 0.1 h pause
    lm_overhead=0.1,
    soft_fraction=0.5,
)


def round_inputs(**changes) -> GoodputInputs:
    return GoodputInputs(**{**ROUND, **changes})


# --------------------------------------------------------------------------
# Hand-worked strategies
# --------------------------------------------------------------------------


def test_checkpoint_restart_hand_worked():
    r = evaluate(round_inputs()).strategies["checkpoint_restart"]
    # 9 h of work in tau = 0.9 h pieces: 10 segments of a = 0.9 + 0.1 = 1.0 h.
    # Each needs (e^{lambda a} - 1) / lambda = (e^0.1 - 1) / 0.1 = 1.0517092 h exposed.
    exposed = 10 * (math.exp(0.1) - 1) / 0.1  # 10.517092 h
    hard = 0.1 * exposed  # 1.0517092 failures
    # Each failure: 0.5 h restart + 0.5 h waiting for the pool's replacement.
    wall = exposed + hard * 1.0  # 11.568801 h
    assert r.checkpoints == 10
    assert r.failures == pytest.approx(1.0517092, rel=1e-6)
    assert r.wall_hours == pytest.approx(wall, rel=1e-12)
    assert r.wall_hours == pytest.approx(11.568801, rel=1e-6)
    assert r.ettr == pytest.approx(9.0 / 11.568801, rel=1e-6)  # 0.777953
    assert r.goodput == pytest.approx(r.ettr)  # pool: no spares paid
    # Per failure: recompute (exposed - 10 a) / failures + 1.0 h.
    recompute = exposed - 10.0  # 0.517092 h
    assert r.lost_hours_per_failure == pytest.approx((recompute + hard) / hard, rel=1e-9)
    # ... which is the classic "about half a segment" plus restart: 0.4917 + 1.0.
    assert r.lost_hours_per_failure == pytest.approx(0.4917 + 1.0, abs=1e-4)
    # Money: 100 GPUs * 11.568801 h * $3 paid, 100 * 9 h * $3 useful.
    assert r.cost_usd == pytest.approx(100 * 11.568801 * 3.0, rel=1e-6)  # $3,470.64
    assert r.lost_usd == pytest.approx(100 * (11.568801 - 9.0) * 3.0, rel=1e-6)  # $770.64
    per_month = 100 * (11.568801 - 9.0) * 3.0 * 730 / 11.568801  # $48,628.4
    assert r.lost_usd_per_month == pytest.approx(per_month, rel=1e-6)
    b = r.lost_gpu_hours_breakdown
    assert b["checkpoint_saves"] == pytest.approx(100 * 10 * 0.1)  # ten saves of 0.1 h
    assert b["recompute"] == pytest.approx(100 * 0.517092, rel=1e-5)
    assert b["recovery"] == pytest.approx(100 * 1.0517092 * 0.5, rel=1e-6)
    assert b["replacement_wait"] == pytest.approx(100 * 1.0517092 * 0.5, rel=1e-6)
    assert b["spares"] == 0.0
    assert sum(b.values()) == pytest.approx(r.lost_gpu_hours, rel=1e-12)


def test_checkpointless_hand_worked():
    r = evaluate(round_inputs()).strategies["checkpointless"]
    # 10% overhead: 9 h of work take 10 h of compute; 0.1 * 10 = 1 failure,
    # each 0.2 h from peers + 0.5 h waiting for the replacement.
    assert r.failures == pytest.approx(1.0)
    assert r.wall_hours == pytest.approx(10.0 + 1.0 * 0.7)  # 10.7 h
    assert r.checkpoints == 0
    assert r.lost_hours_per_failure == pytest.approx(0.7)
    assert r.lost_usd_per_failure == pytest.approx(100 * 0.7 * 3.0)  # $210
    assert r.lost_gpu_hours_breakdown["steady_overhead"] == pytest.approx(100 * 1.0)


def test_live_migration_hand_worked():
    r = evaluate(round_inputs()).strategies["live_migration"]
    # 10% overhead -> 10 h compute; fixed tau 0.9 h -> ceil(10/0.9) = 12 segments:
    # 11 of 1.0 h and a last one of (10 - 9.9) + 0.1 = 0.2 h.
    # Hard failures at (1 - 0.5) * 0.1 = 0.05 per hour roll back:
    exposed = 11 * (math.exp(0.05) - 1) / 0.05 + (math.exp(0.01) - 1) / 0.05  # 11.480645 h
    # Hard ones cost 0.5 + 0.5 h; soft ones (0.05/h) a 0.1 h pause and no wait:
    # the degraded node keeps training while the pool sends its replacement.
    wall = exposed * (1 + 0.05 * 1.0 + 0.05 * 0.1)  # 12.112080 h
    assert r.checkpoints == 12
    assert r.wall_hours == pytest.approx(wall, rel=1e-12)
    assert r.wall_hours == pytest.approx(12.112080, rel=1e-6)
    assert r.hard_failures == pytest.approx(0.05 * exposed)
    assert r.soft_failures == pytest.approx(0.05 * exposed)


def test_hard_failures_are_relaunched_with_a_hot_spare_except_the_batch_hosts():
    """25 nodes, hot spares: a node lost outright costs lm_relaunch_s (no requeue, no wait), but the
    batch host's failure (1 of 25) is still requeued: restart 0.5 h. The rollback is unchanged."""
    hot = dict(spare_policy="hot", spare_nodes=2, lm_relaunch_s=180.0, gpu_killed_fraction=0.0)  # 0.05 h
    relaunch = model.plans(round_inputs(**hot))["live_migration"]
    share = 1 / 25
    assert model.requeued_share(round_inputs(**hot)) == pytest.approx(share)
    assert relaunch.hard_recovery_h == pytest.approx(share * 0.5 + (1 - share) * 0.05)
    assert relaunch.hard_wait_h == 0.0  # hot spares: nothing to wait for either way
    requeue = model.plans(round_inputs(**hot, lm_hard_failure="requeue"))["live_migration"]
    assert requeue.hard_recovery_h == pytest.approx(0.5) and model.requeued_share(
        round_inputs(**hot, lm_hard_failure="requeue")) == 1.0
    # everything else the same: the relaunch only shortens each hard failure
    assert (relaunch.hard_rate, relaunch.interval_h) == (requeue.hard_rate, requeue.interval_h)
    a, b = (evaluate(round_inputs(**hot, lm_hard_failure=x)).strategies["live_migration"]
            for x in ("relaunch", "requeue"))
    assert a.hard_failures == pytest.approx(b.hard_failures)
    assert b.wall_hours - a.wall_hours == pytest.approx(b.hard_failures * (0.5 - relaunch.hard_recovery_h))
    # a pool spare is not in the allocation: every hard failure is requeued and waits for it
    pool = model.plans(round_inputs())["live_migration"]
    assert model.requeued_share(round_inputs()) == 1.0 and (pool.hard_recovery_h, pool.hard_wait_h) == (0.5, 0.5)


def test_torchpass_checkpoint_save_cost_is_live_migrations_own():
    """lm_checkpoint_save_s (torchpass.checkpoint's blocking time) is what live migration's saves
    cost, and moves its optimal interval; checkpoint-restart keeps checkpoint_save_s. Unset: the
    same save cost for both."""
    free = dict(checkpoint_interval_s=None, interval_rule="young")
    same = model.plans(round_inputs(**free))
    own = model.plans(round_inputs(**free, lm_checkpoint_save_s=36.0))  # 0.01 h against 0.1 h
    assert same["live_migration"].save_h == same["checkpoint_restart"].save_h == pytest.approx(0.1)
    assert own["live_migration"].save_h == pytest.approx(0.01)
    assert own["checkpoint_restart"] == same["checkpoint_restart"]
    hard_mtbf = 1.0 / own["live_migration"].hard_rate
    assert own["live_migration"].interval_h == pytest.approx(math.sqrt(2 * 0.01 * hard_mtbf))
    assert own["live_migration"].interval_h < same["live_migration"].interval_h
    # cheaper saves, more often: less time lost in all for the same failures
    a = evaluate(round_inputs(**free)).strategies["live_migration"]
    b = evaluate(round_inputs(**free, lm_checkpoint_save_s=36.0)).strategies["live_migration"]
    assert b.wall_hours < a.wall_hours and b.checkpoints > a.checkpoints


def test_savings_are_differences_of_monthly_loss():
    s = evaluate(round_inputs()).strategies
    assert s["checkpoint_restart"].savings_vs_checkpoint_restart_usd_per_month == 0.0
    for name in ("checkpointless", "live_migration"):
        expected = s["checkpoint_restart"].lost_usd_per_month - s[name].lost_usd_per_month
        assert s[name].savings_vs_checkpoint_restart_usd_per_month == pytest.approx(expected)


def test_hot_spares_are_paid_and_cut_the_wait():
    inp = round_inputs(spare_policy="hot", spare_nodes=2)  # 2 nodes * 4 GPUs
    r = evaluate(inp).strategies["checkpoint_restart"]
    exposed = 10 * (math.exp(0.1) - 1) / 0.1
    wall = exposed + 0.1 * exposed * 0.5  # no wait: restart only, 11.042947 h
    assert r.wall_hours == pytest.approx(wall)
    assert r.paid_gpu_hours == pytest.approx(108 * wall)
    assert r.goodput == pytest.approx(100 * 9.0 / (108 * wall))  # 0.754691
    assert r.lost_gpu_hours_breakdown["spares"] == pytest.approx(8 * wall)


def test_no_spares_wait_for_repair_and_disable_migration():
    inp = round_inputs(spare_policy="none", repair_hours=2.0, lm_overhead=0.0)
    result = evaluate(inp)
    cr = result.strategies["checkpoint_restart"]
    lm = result.strategies["live_migration"]
    exposed = 10 * (math.exp(0.1) - 1) / 0.1
    assert cr.wall_hours == pytest.approx(exposed + 0.1 * exposed * (0.5 + 2.0))
    # Nowhere to migrate to: live migration is checkpoint-restart (same interval).
    assert lm.soft_failures == 0.0
    assert lm.wall_hours == pytest.approx(cr.wall_hours)
    assert any("no target" in w for w in result.warnings)


def test_all_soft_live_migration_needs_no_periodic_checkpoint():
    inp = round_inputs(soft_fraction=1.0, checkpoint_interval_s=None, lm_overhead=0.0)
    lm = evaluate(inp).strategies["live_migration"]
    # No hard failures: one segment, the run's final save only. 9 h + 0.1 h,
    # and 0.1/h * 9.1 h = 0.91 failures of a 0.1 h pause each.
    assert lm.checkpoint_interval_s is None
    assert lm.checkpoints == 1
    assert lm.wall_hours == pytest.approx(9.1 * (1 + 0.1 * 0.1))  # 9.191 h


def test_optimal_interval_is_used_when_none_is_given():
    inp = round_inputs(checkpoint_interval_s=None, interval_rule="young")
    cr = evaluate(inp).strategies["checkpoint_restart"]
    # Young: sqrt(2 * 0.1 h * 10 h) = sqrt(2) h = 5091.2 s.
    assert cr.checkpoint_interval_s == pytest.approx(math.sqrt(2) * 3600)
    lm = evaluate(inp).strategies["live_migration"]
    # Live migration only restarts on hard failures (0.05/h, M = 20 h): sqrt(2*0.1*20) = 2 h.
    assert lm.checkpoint_interval_s == pytest.approx(2 * 3600)


# --------------------------------------------------------------------------
# Interval rules against published figures
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mtbf_min, published_min",
    [
        # Daly 2006, figs. 3-5: delta = 5 min; M = 24 h, 6 h, 15 min.
        (24 * 60, 117),
        (6 * 60, 57),
        (15, 9.1),
    ],
)
def test_daly_reproduces_his_published_optima(mtbf_min, published_min):
    tau = model.daly_interval(5 / 60, mtbf_min / 60) * 60
    # The paper rounds to the minute (0.1 min for the last): within half of that.
    assert tau == pytest.approx(published_min, abs=0.5 if published_min > 10 else 0.05)


def test_young_interval():
    # sqrt(2 * 5 min * 1440 min) = sqrt(14400) = 120 min.
    assert model.young_interval(5 / 60, 24) * 60 == pytest.approx(120.0)


def test_daly_beyond_two_mtbf_is_mtbf():
    assert model.daly_interval(3.0, 1.0) == 1.0


@pytest.mark.parametrize("c_over_m", [1e-6, 1e-3, 0.05, 0.5, 3.0])
def test_exact_interval_is_the_minimum(c_over_m):
    m = 10.0
    c = c_over_m * m
    tau = model.exact_interval(c, m)

    def per_work(t):  # expected exposed time per hour of compute
        return math.expm1((t + c) / m) / t

    # The first-order condition (1 - x) e^{x + c/M} = 1 holds ...
    x = tau / m
    assert (1 - x) * math.exp(x + c_over_m) == pytest.approx(1.0, rel=1e-9)
    # ... and it is a minimum.
    assert per_work(tau) < per_work(tau * 1.01)
    assert per_work(tau) < per_work(tau * 0.99)


def test_daly_is_close_to_the_exact_optimum_for_cheap_checkpoints():
    # Daly's expansion is accurate while C << M: within 1% for C/M <= 0.1.
    for c_over_m in (1e-4, 1e-3, 1e-2, 0.1):
        assert model.daly_interval(c_over_m, 1.0) == pytest.approx(model.exact_interval(c_over_m, 1.0), rel=0.01)


def test_lambert_w0_known_values():
    # W0(-1/e) = -1; W0(-e^{-2} * 2)... use w e^w = x directly.
    assert model._lambert_w0(-1 / math.e) == pytest.approx(-1.0, abs=1e-6)
    for w in (-0.9, -0.5, -0.1, -1e-5):
        assert model._lambert_w0(w * math.exp(w)) == pytest.approx(w, rel=1e-10)


# --------------------------------------------------------------------------
# Published failure figures
# --------------------------------------------------------------------------


def test_llama3_rate():
    # Dubey et al. 2024: 419 unexpected interruptions in 54 days on 16,384 GPUs.
    inp, _ = build_inputs([("preset", get_preset("llama3-16k").values)])
    # Job MTBF: 54 * 24 / 419 = 3.093 h ("one failure every three hours").
    assert inp.job_mtbf_hours == pytest.approx(3.093, abs=0.001)
    assert evaluate(inp).failures_per_day == pytest.approx(419 / 54)  # 7.76
    # Per GPU 50,677 h: Epoch AI's round "once every 50,000 hours" within 2%.
    assert inp.gpu_mtbf_hours == pytest.approx(50_000, rel=0.02)


def test_epoch_scaling_figures():
    # Epoch AI 2024: at 50,000 h per GPU, 100,000 GPUs fail every 30 minutes
    # and a million GPUs every 3 minutes.
    for gpus, minutes in ((100_000, 30), (1_000_000, 3)):
        inp = GoodputInputs(gpus=gpus, gpu_mtbf_hours=50_000.0, spare_nodes=1000)
        assert inp.job_mtbf_hours * 60 == pytest.approx(minutes)


def test_llama3_effective_training_time_is_consistent_with_the_paper():
    # Llama 3 reports > 90% effective training time with (fast) checkpoint-restart.
    # With this preset's assumed restart figures (docs/goodput.md) the model gives
    # ETTR 89.0%; the stated tolerance for this consistency check is 3 points.
    inp, _ = build_inputs([("preset", get_preset("llama3-16k").values)])
    ettr = evaluate(inp).strategies["checkpoint_restart"].ettr
    assert 0.87 <= ettr <= 0.93


# --------------------------------------------------------------------------
# Spares
# --------------------------------------------------------------------------


def test_poisson_tail_hand_worked():
    # P(X >= 2), X ~ Poisson(0.5): 1 - e^-0.5 (1 + 0.5) = 0.090204.
    assert model.poisson_tail(0.5, 2) == pytest.approx(0.090204, abs=1e-6)
    assert model.poisson_tail(0.5, 0) == 1.0
    assert model.poisson_tail(0.0, 1) == 0.0
    # Far in the tail of a large mean it stays finite and tiny.
    assert 0.0 <= model.poisson_tail(500.0, 700) < 1e-15


def test_spare_exhaustion_probability():
    # 0.1 failures/h * 5 h repair = 0.5 in repair on average. Two spare nodes,
    # one node per failure: spares are out when 2 or more are in repair.
    inp = round_inputs(spare_policy="hot", spare_nodes=2, repair_hours=5.0)
    assert model.spare_exhaustion_probability(inp) == pytest.approx(0.090204, abs=1e-6)
    assert any("spares run out on 9.0%" in w for w in evaluate(inp).warnings)
    # A blast radius of 8 GPUs is 2 nodes: the 2 spares cover one failure at a time.
    wide = dataclasses.replace(inp, blast_radius_gpus=8)
    # P(X >= 1) = 1 - e^-0.5 = 0.393469.
    assert model.spare_exhaustion_probability(wide) == pytest.approx(0.393469, abs=1e-6)
    assert model.spare_exhaustion_probability(round_inputs()) is None  # pool


# --------------------------------------------------------------------------
# Building inputs from layers
# --------------------------------------------------------------------------


def test_layers_later_wins_and_sources_are_recorded():
    inp, sources = build_inputs(
        [
            ("preset p", {"gpus": 1024, "gpus_per_node": 8}),
            ("config c.toml", {"gpus": 2048, "soft_fraction": 0.5}),
            ("flags", {"gpus": 4096}),
        ]
    )
    assert (inp.gpus, inp.gpus_per_node, inp.soft_fraction) == (4096, 8, 0.5)
    assert sources["gpus"] == "flags"
    assert sources["gpus_per_node"] == "preset p"
    assert sources["soft_fraction"] == "config c.toml"
    assert sources["repair_hours"] == "default"


def test_failure_rate_alternatives_convert():
    # 800 node-hours per failure, 8 GPUs a node: 6,400 GPU-hours.
    inp, sources = build_inputs([("flags", {"node_mtbf_hours": 800, "gpus_per_node": 8})])
    assert inp.gpu_mtbf_hours == pytest.approx(6400)
    assert sources["gpu_mtbf_hours"] == "flags (node_mtbf_hours)"
    # 2.4 failures a day on 100 GPUs: 0.1 per hour, so 100 / 0.1 = 1,000 GPU-hours.
    inp, _ = build_inputs([("flags", {"job_failures_per_day": 2.4, "gpus": 100, "spare_nodes": 4})])
    assert inp.gpu_mtbf_hours == pytest.approx(1000)
    # A later layer's rate replaces an earlier one, whatever its form.
    inp, _ = build_inputs([("preset", {"gpu_mtbf_hours": 5.0}), ("flags", {"node_mtbf_hours": 100})])
    assert inp.gpu_mtbf_hours == pytest.approx(800)


def test_two_failure_rates_in_one_layer_is_an_error():
    with pytest.raises(ConfigError, match="flags: give the failure rate once.*gpu_mtbf_hours, node_mtbf_hours"):
        build_inputs([("flags", {"gpu_mtbf_hours": 10.0, "node_mtbf_hours": 80.0})])


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"config x.toml: unknown key\(s\) gpu_count, sofft"):
        build_inputs([("config x.toml", {"gpu_count": 4, "sofft": 1, "gpus": 8})])


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match="config x.toml: gpus must be a number, got 'many'"):
        build_inputs([("config x.toml", {"gpus": "many"})])
    with pytest.raises(ConfigError, match="gpus must be a whole number"):
        build_inputs([("config x.toml", {"gpus": 10.5})])
    with pytest.raises(ConfigError, match="spare_policy must be a string"):
        build_inputs([("config x.toml", {"spare_policy": 3})])


def test_invalid_value_names_input_and_source():
    with pytest.raises(ConfigError, match=r"config x.toml: soft_fraction must be >= 0 and <= 1, got 1.5"):
        build_inputs([("config x.toml", {"soft_fraction": 1.5})])
    with pytest.raises(ConfigError, match="flags \\(node_mtbf_hours\\)|node_mtbf_hours must be"):
        build_inputs([("flags", {"node_mtbf_hours": -3.0})])


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("gpus", 0, "gpus must be >= 1 and <= 1e\\+07, got 0"),
        ("gpus", -5, "gpus must be >= 1"),
        ("gpus", 10**9, "gpus must be >= 1 and <= 1e\\+07, got 1e\\+09"),
        ("gpus", 8.0, "gpus must be a whole number"),
        ("gpus", True, "gpus must be a number"),
        ("gpu_mtbf_hours", 0.0, "gpu_mtbf_hours must be > 0"),
        ("gpu_mtbf_hours", -1.0, "gpu_mtbf_hours must be > 0"),
        ("gpu_mtbf_hours", float("inf"), "gpu_mtbf_hours must be a finite number"),
        ("gpu_mtbf_hours", float("nan"), "gpu_mtbf_hours must be a finite number"),
        ("soft_fraction", 1.5, "soft_fraction must be >= 0 and <= 1"),
        ("soft_fraction", -0.1, "soft_fraction must be >= 0"),
        ("work_hours", 0.0, "work_hours must be > 0"),
        ("usd_per_gpu_hour", -2.0, "usd_per_gpu_hour must be >= 0"),
        ("usd_per_gpu_hour", 5000.0, "usd_per_gpu_hour must be .*<= 1000"),
        ("checkpoint_save_s", 0.0, "checkpoint_save_s must be > 0"),
        ("checkpoint_interval_s", 0.0, "checkpoint_interval_s must be > 0"),
        ("cr_restart_s", -1.0, "cr_restart_s must be >= 0"),
        ("cl_overhead", 1.0, "cl_overhead must be >= 0 and <= 0.99"),
        ("lm_migrate_s", "fast", "lm_migrate_s must be a number"),
        ("spare_policy", "lukewarm", "spare_policy must be one of hot, pool, none"),
        ("interval_rule", "guess", "interval_rule must be one of daly, young, exact"),
        ("weibull_shape", 0.0, "weibull_shape must be >= 0.05"),
        ("blast_radius_gpus", 0, "blast_radius_gpus must be >= 1"),
    ],
)
def test_invalid_inputs_name_the_input(field, value, message):
    with pytest.raises(ConfigError, match=message):
        GoodputInputs(**{field: value})


def test_cross_field_checks():
    with pytest.raises(ConfigError, match=r"blast_radius_gpus \(72\) exceeds gpus \(64\)"):
        GoodputInputs(gpus=64, blast_radius_gpus=72)
    with pytest.raises(ConfigError, match=r"spare_nodes \(0\) is too small for spare_policy 'hot'"):
        GoodputInputs(spare_nodes=0)
    # A 72-GPU blast radius on 4-GPU nodes takes 18 nodes: 17 hot spares are not enough.
    with pytest.raises(ConfigError, match="set spare_nodes >= 18"):
        GoodputInputs(gpus=1024, gpus_per_node=4, blast_radius_gpus=72, spare_nodes=17)
    with pytest.raises(ConfigError, match="checkpoint_interval_s .* is longer than the whole run"):
        GoodputInputs(work_hours=1.0, checkpoint_interval_s=7200.0)
    GoodputInputs(spare_nodes=0, spare_policy="pool")  # no spares needed with a pool


def test_a_job_that_cannot_finish_is_an_error():
    # One GPU-hour MTBF on 1,000 GPUs (3.6 s job MTBF) and 10-minute saves.
    inp = GoodputInputs(gpus=1000, gpu_mtbf_hours=1.0, checkpoint_save_s=600.0, spare_nodes=1000)
    with pytest.raises(ConfigError, match="cannot finish under checkpoint-restart"):
        evaluate(inp)


def test_every_preset_evaluates_and_orders_sensibly():
    for name, preset in PRESETS.items():
        inp, _ = build_inputs([(name, preset.values)])
        result = evaluate(inp)
        assert set(result.strategies) == set(model.STRATEGIES)
        for s in result.strategies.values():
            assert 0 < s.goodput <= s.ettr <= 1
        assert result.warnings == [], name  # the presets hold enough spares


def test_with_job_size_keeps_the_per_gpu_rate_and_scales_spares():
    inp = GoodputInputs(gpus=1024, spare_nodes=4)
    big = model.with_job_size(inp, 16_384)
    assert big.gpu_mtbf_hours == inp.gpu_mtbf_hours
    assert big.spare_nodes == 64  # 4 * 16
    small = model.with_job_size(inp, 64)
    assert small.spare_nodes == 1  # ceil(4 / 16) = 1, enough for one node
    capped = model.with_job_size(GoodputInputs(gpus=1024, blast_radius_gpus=72, spare_nodes=9), 64)
    assert capped.blast_radius_gpus == 64


def test_a_gpu_killed_on_a_live_node_is_its_own_kind_of_hard_failure():
    """25 nodes, hot spares, 40% of the hard failures a GPU killed on a live node (0.01 h each), the
    rest nodes lost outright: relaunched (0.05 h), or requeued (0.5 h) when the batch host is lost.
    A GPU killed on the batch host leaves the coordinator up, so only node losses are requeued."""
    hot = dict(spare_policy="hot", spare_nodes=2, lm_relaunch_s=180.0, lm_gpu_killed_s=36.0, gpu_killed_fraction=0.4)
    inp = round_inputs(**hot)
    plan = model.plans(inp)["live_migration"]
    requeued = 0.6 / 25
    assert model.gpu_killed_share(inp) == 0.4
    assert model.requeued_share(inp) == pytest.approx(requeued)
    assert [(k.name, k.share) for k in plan.hard_kinds] == [
        ("gpu_killed", 0.4), ("node_lost_relaunched", pytest.approx(0.6 - requeued)),
        ("requeued", pytest.approx(requeued))]
    assert plan.hard_recovery_h == pytest.approx(0.4 * 0.01 + (0.6 - requeued) * 0.05 + requeued * 0.5)
    # the kinds change only what a hard failure costs: same rate, same restore-point interval
    none_killed = round_inputs(**{**hot, "gpu_killed_fraction": 0.0})
    base = model.plans(none_killed)["live_migration"]
    assert (plan.hard_rate, plan.interval_h) == (base.hard_rate, base.interval_h)
    a, b = evaluate(inp).strategies["live_migration"], evaluate(none_killed).strategies["live_migration"]
    assert b.wall_hours - a.wall_hours == pytest.approx(a.hard_failures * (base.hard_recovery_h - plan.hard_recovery_h))
    # without a relaunch inside the allocation a GPU killed is requeued like any hard failure
    for outside in (round_inputs(gpu_killed_fraction=0.4), round_inputs(**hot, lm_hard_failure="requeue")):
        assert model.gpu_killed_share(outside) == 0.0 and model.requeued_share(outside) == 1.0
        assert [k.name for k in model.plans(outside)["live_migration"].hard_kinds] == ["requeued"]
    # checkpoint-restart and checkpointless are untouched by it
    for name in ("checkpoint_restart", "checkpointless"):
        assert evaluate(inp).strategies[name] == evaluate(none_killed).strategies[name]
