"""Discrete-event Monte Carlo of a training run under a failure process.

It simulates the same stochastic process the closed form in ``model.py``
describes, event by event, so its mean must match the closed form up to
sampling error (docs/goodput.md states the tolerance), and it adds what a
closed form cannot give: the spread (p5/p95) of wall time, goodput and cost,
and non-Poisson failures (Weibull times between failures, for which the
closed form is only an approximation).

A run walks a failure-free schedule of exposed time (compute, and for
checkpointing strategies a save at the end of every segment). Each failure is
hard with probability hard_rate / rate: the run rolls back to the start of
its segment (the last completed checkpoint) and pays the hard loss; otherwise
it pays the soft loss and keeps its progress. A hard failure's cost is that of
its kind (a GPU killed on a live node, a node lost outright, a requeue), drawn
by the kinds' shares. Runs are vectorised: one numpy
step handles the next failure of every unfinished run at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torchpass.errors import ConfigError, DependencyError
from torchpass.goodput import model
from torchpass.goodput.model import GoodputInputs, StrategyPlan

# Refuse runs whose expected failure count would take too long to walk.
MAX_EXPECTED_FAILURES_PER_RUN = 200_000
MAX_RUNS = 1_000_000


def _numpy():
    try:
        import numpy
    except ImportError:
        raise DependencyError("the goodput simulator needs numpy: pip install numpy") from None
    return numpy


@dataclass(frozen=True)
class Distribution:
    mean: float
    p5: float
    p95: float

    def as_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "p5": self.p5, "p95": self.p95}


@dataclass(frozen=True)
class SimulationResult:
    name: str
    runs: int
    seed: int
    failure_process: str
    wall_hours: Distribution
    goodput: Distribution
    ettr: Distribution
    cost_usd: Distribution
    failures: Distribution
    wall_hours_std_error: float  # of the mean
    wall_hours_rel_diff_vs_model: float  # (simulated mean - closed form) / closed form
    goodput_rel_diff_vs_model: float


def _gap_sampler(np, rng, rate: float, weibull_shape: float | None):
    """Times between failures with mean 1/rate, in exposed hours."""
    mean = 1.0 / rate
    if weibull_shape is None or weibull_shape == 1.0:
        return lambda size: rng.exponential(mean, size)
    # Weibull(k) with scale s has mean s * Gamma(1 + 1/k): pick s for the same mean.
    scale = mean / math.gamma(1.0 + 1.0 / weibull_shape)
    return lambda size: scale * rng.weibull(weibull_shape, size)


def simulate_plan(
    inp: GoodputInputs,
    plan: StrategyPlan,
    *,
    runs: int,
    rng: Any,
) -> tuple[Any, Any]:
    """Wall hours and failure counts of ``runs`` independent runs of one plan."""
    np = _numpy()
    sched = model.schedule(inp, plan)
    total = sched.total_h
    # Every segment but the last has the same length, so the segment holding
    # position q starts at floor(q / a) * a (the last one starts at (n-1) a).
    segment = sched.segment_h
    hard_share = plan.hard_rate / plan.rate
    # Where hard failures come in kinds of different cost, each one draws its kind; with one
    # kind its cost is the plan's (and no extra draw changes the random stream).
    kinds = plan.hard_kinds if len(plan.hard_kinds) > 1 else ()
    kind_edges = np.cumsum([k.share for k in kinds])[:-1] if kinds else None
    kind_losses = np.array([k.loss_h for k in kinds]) if kinds else None
    draw_gap = _gap_sampler(np, rng, plan.rate, inp.weibull_shape)

    position = np.zeros(runs)
    wall = np.zeros(runs)
    failures = np.zeros(runs, dtype=np.int64)
    active = np.arange(runs)
    while active.size:
        gap = draw_gap(active.size)
        reached = position[active] + gap
        done = reached >= total
        finished = active[done]
        wall[finished] += total - position[finished]
        active = active[~done]
        reached = reached[~done]
        gap = gap[~done]
        hard = rng.random(active.size) < hard_share
        if kinds:
            hard_loss = kind_losses[np.searchsorted(kind_edges, rng.random(active.size), side="right")]
        else:
            hard_loss = plan.hard_loss_h
        wall[active] += gap + np.where(hard, hard_loss, plan.soft_loss_h)
        if plan.checkpointing and hard_share > 0.0:
            reached = np.where(hard, np.floor(reached / segment) * segment, reached)
        position[active] = reached
        failures[active] += 1
    return wall, failures


def simulate(
    inp: GoodputInputs,
    *,
    runs: int = 2000,
    seed: int = 0,
    closed_form: model.ModelResult | None = None,
) -> dict[str, SimulationResult]:
    """Simulate every strategy; compare the means with the closed form."""
    if not isinstance(runs, int) or isinstance(runs, bool) or not 1 <= runs <= MAX_RUNS:
        raise ConfigError(f"runs must be a whole number from 1 to {MAX_RUNS}, got {runs!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"seed must be a whole number >= 0, got {seed!r}")
    np = _numpy()
    closed_form = closed_form or model.evaluate(inp)
    paid_gpus = inp.gpus + inp.spare_gpus
    process = "poisson" if inp.weibull_shape in (None, 1.0) else f"weibull(shape={inp.weibull_shape:g})"
    out: dict[str, SimulationResult] = {}
    for index, (name, plan) in enumerate(model.plans(inp).items()):
        expected = closed_form.strategies[name]
        if expected.failures > MAX_EXPECTED_FAILURES_PER_RUN:
            raise ConfigError(
                f"{expected.failures:.3g} expected failures per run under {expected.label} is too many to "
                f"simulate (limit {MAX_EXPECTED_FAILURES_PER_RUN}); use --no-simulate or raise gpu_mtbf_hours"
            )
        # One stream per (seed, strategy): adding a strategy keeps the others' numbers.
        rng = np.random.default_rng([seed, index])
        wall, failures = simulate_plan(inp, plan, runs=runs, rng=rng)
        goodput = inp.gpus * inp.work_hours / (paid_gpus * wall)
        ettr = inp.work_hours / wall
        cost = paid_gpus * wall * inp.usd_per_gpu_hour

        def dist(values) -> Distribution:
            p5, p95 = np.percentile(values, [5, 95])
            return Distribution(float(np.mean(values)), float(p5), float(p95))

        wall_mean = float(np.mean(wall))
        out[name] = SimulationResult(
            name=name,
            runs=runs,
            seed=seed,
            failure_process=process,
            wall_hours=dist(wall),
            goodput=dist(goodput),
            ettr=dist(ettr),
            cost_usd=dist(cost),
            failures=dist(failures),
            wall_hours_std_error=float(np.std(wall, ddof=1) / math.sqrt(runs)) if runs > 1 else float("nan"),
            wall_hours_rel_diff_vs_model=(wall_mean - expected.wall_hours) / expected.wall_hours,
            goodput_rel_diff_vs_model=(float(np.mean(goodput)) - expected.goodput) / expected.goodput,
        )
    return out
