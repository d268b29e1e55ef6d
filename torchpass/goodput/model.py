"""Closed-form goodput model: what failures cost a training job under each strategy.

The model is documented, with its derivation and sources, in docs/goodput.md.
In short: failures arrive as a Poisson process with the job's rate
``lambda = gpus / gpu_mtbf_hours`` during the time the job computes or writes
checkpoints ("exposed" time); recoveries themselves are failure-free (Young's
assumption). Under that model every number below is exact, not a first-order
approximation, so the Monte Carlo simulator in ``simulate.py`` must agree with
it up to sampling error.

Three strategies share one evaluator; each is described by a ``StrategyPlan``:

* checkpoint-restart: every failure is "hard": detect, restart, reload the
  last checkpoint and recompute what was lost since it.
* checkpointless: every failure is recovered from peers ("soft" for the
  model: no rollback), paid for by a steady-state overhead.
* live migration: a ``soft_fraction`` of failures is migrated away (pause
  only); the rest are hard and roll back to the newest restore point (whose
  interval is tuned to the lower rate of hard failures). With
  ``lm_hard_failure = relaunch`` and a hot spare a hard failure is one of
  two kinds: a GPU killed under a rank on a node that stays up
  (``gpu_killed_fraction`` of them, ``lm_gpu_killed_s`` each), or a node lost
  outright (``lm_relaunch_s``), except a loss of the job's batch host (1 node
  in ``nodes``), which is still requeued. Its restore points block training
  for ``lm_checkpoint_save_s`` each (torchpass.checkpoint), if given.

``solve_breakeven`` finds, by bisection on the closed form, the recovery time or
restore-point cost at which live migration's goodput ties checkpointless's.

This module needs only the standard library.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from torchpass.errors import ConfigError

SECONDS_PER_HOUR = 3600.0
HOURS_PER_MONTH = 730.0  # 365 * 24 / 12: the usual cloud-billing month
SPARE_POLICIES = ("hot", "pool", "none")
INTERVAL_RULES = ("daly", "young", "exact")
LM_HARD_FAILURE = ("relaunch", "requeue")
STRATEGIES = ("checkpoint_restart", "checkpointless", "live_migration")
STRATEGY_LABELS = {
    "checkpoint_restart": "checkpoint-restart",
    "checkpointless": "checkpointless",
    "live_migration": "live migration",
}
# Beyond this many expected failures per checkpoint segment (lambda * a) the
# job practically never finishes; e^50 attempts per segment is already absurd.
_MAX_FAILURES_EXPONENT = 50.0


# --------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class InputSpec:
    """One input: its type, bounds and help. Drives validation, TOML and flags."""

    name: str
    kind: type  # int, float or str
    help: str
    minimum: float | None = None
    minimum_inclusive: bool = True
    maximum: float | None = None
    choices: tuple[str, ...] | None = None
    optional: bool = False  # None is a valid value (meaning: derived)


INPUT_SPECS: tuple[InputSpec, ...] = (
    InputSpec("gpus", int, "GPUs that train (spares not included).", 1, True, 10_000_000),
    InputSpec("gpus_per_node", int, "GPUs per node.", 1, True, 1024),
    InputSpec(
        "gpu_mtbf_hours", float,
        "Mean time between job-interrupting failures per GPU, in GPU-hours; "
        "the job's MTBF is this divided by gpus.",
        0, False, 1e9,
    ),
    InputSpec(
        "soft_fraction", float,
        "Share of failures that leave the node alive long enough to migrate "
        "its ranks (degradation, correctable errors); the rest are hard.",
        0, True, 1,
    ),
    InputSpec("work_hours", float, "Failure-free length of the training run, in hours.", 0, False, 100_000),
    InputSpec("usd_per_gpu_hour", float, "Price of one GPU-hour, in USD.", 0, True, 1000),
    InputSpec(
        "repair_hours", float,
        "Hours a failed node is out of service (drain, diagnose, fix or swap).",
        0, True, 8760,
    ),
    InputSpec(
        "blast_radius_gpus", int,
        "GPUs taken out of service by one failure (default: one node).",
        1, True, 10_000_000, optional=True,
    ),
    InputSpec(
        "spare_policy", str,
        "hot: idle spare nodes held (and paid) by the job; pool: replacements "
        "come from the cluster after replacement_wait_s; none: the job waits "
        "for the repair.",
        choices=SPARE_POLICIES,
    ),
    InputSpec("spare_nodes", int, "Hot spare nodes held by the job (spare_policy=hot).", 0, True, 100_000),
    InputSpec(
        "replacement_wait_s", float,
        "Seconds to get a replacement node from the cluster (spare_policy=pool).",
        0, True, 30 * 86400,
    ),
    InputSpec(
        "cr_detect_s", float,
        "Checkpoint-restart: seconds from the fault until the job is known "
        "to have failed (crash, or a collective timeout).",
        0, True, 30 * 86400,
    ),
    InputSpec(
        "cr_restart_s", float,
        "Checkpoint-restart: seconds to requeue, reschedule and re-initialise the job.",
        0, True, 30 * 86400,
    ),
    InputSpec(
        "checkpoint_save_s", float,
        "Seconds training is blocked per checkpoint save.",
        0, False, 30 * 86400,
    ),
    InputSpec("checkpoint_load_s", float, "Seconds to load a checkpoint on restart.", 0, True, 30 * 86400),
    InputSpec(
        "checkpoint_interval_s", float,
        "Seconds of training between checkpoints (default: the optimum by interval_rule).",
        0, False, 365 * 86400, optional=True,
    ),
    InputSpec(
        "interval_rule", str,
        "Optimal checkpoint interval: daly (Daly 2006, higher order), young "
        "(Young 1974, sqrt(2*C*M)) or exact (Lambert W optimum of this model).",
        choices=INTERVAL_RULES,
    ),
    InputSpec("cl_detect_s", float, "Checkpointless: seconds to detect a failure.", 0, True, 30 * 86400),
    InputSpec(
        "cl_recover_s", float,
        "Checkpointless: seconds to rebuild the lost state from peers and resume.",
        0, True, 30 * 86400,
    ),
    InputSpec(
        "cl_overhead", float,
        "Checkpointless: steady-state slowdown (fraction of step time) of redundancy and per-step coordination.",
        0, True, 0.99,
    ),
    InputSpec(
        "lm_detect_s", float,
        "Live migration: seconds from the fault signal until the migration starts.",
        0, True, 30 * 86400,
    ),
    InputSpec(
        "lm_migrate_s", float,
        "Live migration: seconds all ranks are paused while one node's ranks move.",
        0, True, 30 * 86400,
    ),
    InputSpec(
        "lm_overhead", float,
        "Live migration: steady-state slowdown (fraction) of the runtime's bookkeeping.",
        0, True, 0.99,
    ),
    InputSpec(
        "lm_hard_failure", str,
        "Live migration: what a node lost outright costs. relaunch: the job's step starts again inside "
        "the allocation from its newest torchpass.checkpoint, with a hot spare in the node's place (sbatch "
        "--no-kill; the batch host's failure is still requeued); requeue: checkpoint-restart's requeue.",
        choices=LM_HARD_FAILURE,
    ),
    InputSpec(
        "lm_relaunch_s", float,
        "Live migration, lm_hard_failure=relaunch: seconds from a node lost outright until training "
        "resumes from the newest checkpoint (detection, the relaunched step, the checkpoint's load).",
        0, True, 30 * 86400,
    ),
    InputSpec(
        "gpu_killed_fraction", float,
        "Live migration: share of the hard failures where a GPU dies under a rank and its node stays up "
        "(Xid 79, uncorrectable ECC, an NCCL abort); the rest lose the node outright.",
        0, True, 1,
    ),
    InputSpec(
        "lm_gpu_killed_s", float,
        "Live migration, lm_hard_failure=relaunch: seconds from a GPU killed under a rank (its node up) "
        "until training resumes from the newest restore point on the surviving nodes plus a spare.",
        0, True, 30 * 86400,
    ),
    InputSpec(
        "lm_checkpoint_save_s", float,
        "Live migration: seconds one checkpoint save blocks training when the job saves with "
        "torchpass.checkpoint (the copy to host memory; the write runs in the background). "
        "Default: checkpoint_save_s.",
        0, False, 30 * 86400, optional=True,
    ),
    InputSpec(
        "weibull_shape", float,
        "Simulator only: Weibull shape of the times between failures "
        "(1 = exponential; below 1 = clustered failures). Default: Poisson.",
        0.05, True, 20, optional=True,
    ),
)
SPECS_BY_NAME = {spec.name: spec for spec in INPUT_SPECS}

# Alternative ways to give the failure rate; each converts to gpu_mtbf_hours.
# At most one of them (or gpu_mtbf_hours) may be given in one source.
FAILURE_RATE_KEYS = ("gpu_mtbf_hours", "node_mtbf_hours", "job_failures_per_day")
FAILURE_RATE_HELP = {
    "node_mtbf_hours": "Mean time between failures per node, in node-hours (converted with gpus_per_node).",
    "job_failures_per_day": "Observed job-interrupting failures per day for this job size (converted with gpus).",
}


@dataclass(frozen=True)
class GoodputInputs:
    """Everything the model and the simulator need. Times in the unit of the name.

    The defaults are assumptions for a 1,024-GPU H100 job, documented with
    their grounds in docs/goodput.md; presets and the user override them.
    """

    gpus: int = 1024
    gpus_per_node: int = 8
    # Llama 3: 419 unexpected interruptions in 54 days on 16,384 GPUs
    # -> 16,384 * 54 * 24 / 419 = 50,677 GPU-hours per interruption.
    gpu_mtbf_hours: float = 50_677.0
    soft_fraction: float = 0.3
    work_hours: float = 720.0
    usd_per_gpu_hour: float = 2.0
    repair_hours: float = 24.0
    blast_radius_gpus: int | None = None
    spare_policy: str = "hot"
    spare_nodes: int = 4
    replacement_wait_s: float = 1800.0
    cr_detect_s: float = 120.0
    cr_restart_s: float = 300.0
    checkpoint_save_s: float = 30.0
    checkpoint_load_s: float = 60.0
    checkpoint_interval_s: float | None = None
    interval_rule: str = "daly"
    cl_detect_s: float = 10.0
    cl_recover_s: float = 120.0
    cl_overhead: float = 0.02
    lm_detect_s: float = 10.0
    lm_migrate_s: float = 120.0
    lm_overhead: float = 0.005
    # tpassd silent 10 s + slurmctld's NOT_RESPONDING (a failed ping: up to SlurmdTimeout/3,
    # 100 s at the default 300) + srun's wait for the dead node's task (KillWait, 30 s) + the
    # relaunched step's start and checkpoint load (60 s): docs/goodput.md.
    lm_hard_failure: str = "relaunch"
    lm_relaunch_s: float = 200.0
    # Llama 3 puts 58.7% of its unexpected interruptions on GPUs. Taking every soft failure (30%)
    # to be one of those leaves 28.7 of the 70 points of hard failures: 0.41, the low end of
    # the share where a GPU dies and its host stays up (docs/goodput.md, "Honest defaults").
    gpu_killed_fraction: float = 0.41
    # Modelled, not measured: lm_relaunch_s's terms less the two that wait for a dead node
    # (NOT_RESPONDING 100 s, KillWait 30 s), i.e. 10 s detection + 60 s restart and load.
    lm_gpu_killed_s: float = 70.0
    lm_checkpoint_save_s: float | None = None
    weibull_shape: float | None = None

    def __post_init__(self) -> None:
        validate(self)

    # Derived quantities, all in hours or counts.
    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    @property
    def blast_radius(self) -> int:
        """GPUs out per failure; one node (or the whole job if smaller) by default."""
        if self.blast_radius_gpus is None:
            return min(self.gpus_per_node, self.gpus)
        return self.blast_radius_gpus

    @property
    def nodes_per_failure(self) -> int:
        return math.ceil(self.blast_radius / self.gpus_per_node)

    @property
    def failure_rate_per_hour(self) -> float:
        """The job's failure rate: every GPU contributes 1/gpu_mtbf_hours."""
        return self.gpus / self.gpu_mtbf_hours

    @property
    def job_mtbf_hours(self) -> float:
        return self.gpu_mtbf_hours / self.gpus

    @property
    def spare_gpus(self) -> int:
        return self.spare_nodes * self.gpus_per_node if self.spare_policy == "hot" else 0

    @property
    def replacement_wait_hours(self) -> float:
        """Time the job waits for hardware after a failure it cannot work around."""
        if self.spare_policy == "hot":
            return 0.0
        if self.spare_policy == "pool":
            return self.replacement_wait_s / SECONDS_PER_HOUR
        return self.repair_hours

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _describe_bound(spec: InputSpec) -> str:
    lo = spec.minimum
    hi = spec.maximum
    parts = []
    if lo is not None:
        parts.append(f"{'>=' if spec.minimum_inclusive else '>'} {lo:g}")
    if hi is not None:
        parts.append(f"<= {hi:g}")
    return " and ".join(parts)


def check_value(spec: InputSpec, value: Any) -> None:
    """Raise ConfigError naming the input if ``value`` is not valid for it."""
    name = spec.name
    if value is None:
        if spec.optional:
            return
        raise ConfigError(f"{name} must be set")
    if spec.kind is str:
        if not isinstance(value, str) or (spec.choices and value not in spec.choices):
            raise ConfigError(f"{name} must be one of {', '.join(spec.choices or ())}, got {value!r}")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if spec.kind is int and not isinstance(value, int):
        raise ConfigError(f"{name} must be a whole number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    lo, hi = spec.minimum, spec.maximum
    too_low = lo is not None and (value < lo if spec.minimum_inclusive else value <= lo)
    too_high = hi is not None and value > hi
    if too_low or too_high:
        raise ConfigError(f"{name} must be {_describe_bound(spec)}, got {value:g}")


def validate(inp: GoodputInputs) -> None:
    """Every field on its own, then the combinations that make no sense."""
    for spec in INPUT_SPECS:
        check_value(spec, getattr(inp, spec.name))
    if inp.blast_radius_gpus is not None and inp.blast_radius_gpus > inp.gpus:
        raise ConfigError(
            f"blast_radius_gpus ({inp.blast_radius_gpus}) exceeds gpus ({inp.gpus}): "
            "a failure cannot take out more of the job than the job has"
        )
    if inp.spare_policy == "hot" and inp.spare_nodes < inp.nodes_per_failure:
        raise ConfigError(
            f"spare_nodes ({inp.spare_nodes}) is too small for spare_policy 'hot': one failure "
            f"takes {inp.nodes_per_failure} node(s) out; set spare_nodes >= {inp.nodes_per_failure} "
            "or spare_policy to 'pool' or 'none'"
        )
    if inp.checkpoint_interval_s is not None and inp.checkpoint_interval_s > inp.work_hours * SECONDS_PER_HOUR:
        raise ConfigError(
            f"checkpoint_interval_s ({inp.checkpoint_interval_s:g}) is longer than the whole run "
            f"(work_hours = {inp.work_hours:g} h)"
        )


# --------------------------------------------------------------------------
# Building inputs from layered sources (preset -> TOML -> measured -> flags)
# --------------------------------------------------------------------------


def _coerce(name: str, value: Any, where: str) -> Any:
    """TOML and flags give ints, floats and strings; check the type per input."""
    spec = SPECS_BY_NAME.get(name)
    kind = spec.kind if spec else float  # the alternative failure-rate keys are floats
    if value is None:
        return None
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: {name} must be a string, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: {name} must be a number, got {value!r}")
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"{where}: {name} must be a whole number, got {value!r}")
        return int(value)
    return float(value)


def known_keys() -> tuple[str, ...]:
    return tuple(spec.name for spec in INPUT_SPECS) + FAILURE_RATE_KEYS[1:]


def build_inputs(
    layers: Sequence[tuple[str, Mapping[str, Any]]],
) -> tuple[GoodputInputs, dict[str, str]]:
    """Apply ``(source, values)`` layers in order, later ones winning.

    Returns the inputs and, per input, the source that set it ("default" if
    none did). Unknown keys are an error naming them. The failure rate may be
    given as gpu_mtbf_hours, node_mtbf_hours or job_failures_per_day; a layer
    that gives one replaces whatever rate an earlier layer gave, and the
    conversion uses the final gpus and gpus_per_node.
    """
    allowed = set(known_keys())
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    rate: tuple[str, float, str] | None = None
    for where, values in layers:
        unknown = sorted(set(values) - allowed)
        if unknown:
            raise ConfigError(
                f"{where}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(allowed))}"
            )
        rate_keys = [k for k in FAILURE_RATE_KEYS if values.get(k) is not None]
        if len(rate_keys) > 1:
            raise ConfigError(
                f"{where}: give the failure rate once, as one of {', '.join(FAILURE_RATE_KEYS)}; "
                f"got {', '.join(rate_keys)}"
            )
        for key, value in values.items():
            if value is None:
                continue
            value = _coerce(key, value, where)
            if key in FAILURE_RATE_KEYS:
                rate = (key, value, where)
            else:
                merged[key] = value
                sources[key] = where
    gpus = merged.get("gpus", GoodputInputs.gpus)
    gpus_per_node = merged.get("gpus_per_node", GoodputInputs.gpus_per_node)
    if rate is not None:
        key, value, where = rate
        if not (isinstance(value, float) and math.isfinite(value) and value > 0):
            raise ConfigError(f"{where}: {key} must be a finite number > 0, got {value!r}")
        if key == "gpu_mtbf_hours":
            merged["gpu_mtbf_hours"] = value
        elif key == "node_mtbf_hours":
            merged["gpu_mtbf_hours"] = value * gpus_per_node
        else:  # job_failures_per_day: the job's rate is gpus / gpu_mtbf_hours
            merged["gpu_mtbf_hours"] = gpus * 24.0 / value
        sources["gpu_mtbf_hours"] = f"{where} ({key})" if key != "gpu_mtbf_hours" else where
    try:
        inputs = GoodputInputs(**merged)
    except ConfigError as exc:
        # Validation messages start with the input's name; say who set it.
        name = str(exc).split(" ", 1)[0]
        where = sources.get(name, "default")
        raise ConfigError(f"{where}: {exc}") from None
    for spec in INPUT_SPECS:
        sources.setdefault(spec.name, "default")
    return inputs, sources


# --------------------------------------------------------------------------
# Checkpoint interval rules
# --------------------------------------------------------------------------


def young_interval(save_h: float, mtbf_h: float) -> float:
    """Young (1974): compute time between checkpoints, sqrt(2 C M)."""
    return math.sqrt(2.0 * save_h * mtbf_h)


def daly_interval(save_h: float, mtbf_h: float) -> float:
    """Daly (2006) higher-order optimum, eq. for delta < 2M; M itself beyond."""
    if save_h >= 2.0 * mtbf_h:
        return mtbf_h
    ratio = save_h / (2.0 * mtbf_h)
    return math.sqrt(2.0 * save_h * mtbf_h) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - save_h


def _lambert_w0(x: float) -> float:
    """Principal branch of Lambert W for x in [-1/e, 0), by Halley's iteration."""
    if not -1.0 / math.e <= x < 0.0:
        raise ValueError(f"lambert_w0 defined here for -1/e <= x < 0, got {x}")
    # Start from the branch-point series (good near -1/e) or W ~ x (near 0).
    p = math.sqrt(max(0.0, 2.0 * (math.e * x + 1.0)))
    w = -1.0 + p - p * p / 3.0 if x < -0.25 else x
    for _ in range(50):
        ew = math.exp(w)
        f = w * ew - x
        if f == 0.0:
            break
        denom = ew * (w + 1.0) - (w + 2.0) * f / (2.0 * w + 2.0)
        step = f / denom
        w -= step
        if abs(step) <= 1e-15 * max(1.0, abs(w)):
            break
    return w


def exact_interval(save_h: float, mtbf_h: float) -> float:
    """The interval minimising this model's expected time per unit of work.

    Per unit of compute the expected exposed time is (e^{(tau+C)/M} - 1) M / tau
    (times a factor that does not depend on tau), whose minimum solves
    (1 - x) e^{x + c} = 1 with x = tau/M, c = C/M: x = 1 + W0(-e^{-(1+c)}).
    """
    c = save_h / mtbf_h
    if c > 700:  # e^{-(1+c)} underflows; W0(-tiny) ~ -tiny, so x ~ 0
        return mtbf_h * math.exp(-(1.0 + c))
    return mtbf_h * (1.0 + _lambert_w0(-math.exp(-(1.0 + c))))


INTERVAL_FUNCTIONS = {"daly": daly_interval, "young": young_interval, "exact": exact_interval}


# --------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class HardKind:
    """One kind of hard failure: its share of the hard failures and what it costs, in hours."""

    name: str
    share: float
    recovery_h: float
    wait_h: float

    @property
    def loss_h(self) -> float:
        return self.recovery_h + self.wait_h


@dataclass(frozen=True)
class StrategyPlan:
    """How one strategy meets failures, in hours; shared with the simulator.

    Failures arrive at ``hard_rate + soft_rate`` per exposed hour. A hard
    failure costs ``hard_recovery_h + hard_wait_h`` and rolls back to the last
    checkpoint; a soft one costs ``soft_recovery_h + soft_wait_h`` and loses no
    work. ``interval_h`` is the compute between checkpoints (None: no periodic
    checkpoints; the run still ends with one save when checkpointing).
    """

    name: str
    overhead: float
    hard_rate: float
    soft_rate: float
    hard_recovery_h: float
    hard_wait_h: float
    soft_recovery_h: float
    soft_wait_h: float
    checkpointing: bool
    save_h: float
    interval_h: float | None
    interval_rule: str | None
    hard_kinds: tuple[HardKind, ...] = ()

    @property
    def rate(self) -> float:
        return self.hard_rate + self.soft_rate

    @property
    def hard_loss_h(self) -> float:
        return self.hard_recovery_h + self.hard_wait_h

    @property
    def soft_loss_h(self) -> float:
        return self.soft_recovery_h + self.soft_wait_h


@dataclass(frozen=True)
class Schedule:
    """The failure-free exposed timeline: n segments of compute + save."""

    compute_h: float  # exposed compute, work / (1 - overhead)
    segments: int
    segment_h: float  # every segment but the last
    last_segment_h: float

    @property
    def total_h(self) -> float:
        return (self.segments - 1) * self.segment_h + self.last_segment_h


def _interval(inp: GoodputInputs, save_h: float, hard_rate: float) -> tuple[float | None, str | None]:
    if inp.checkpoint_interval_s is not None:
        return inp.checkpoint_interval_s / SECONDS_PER_HOUR, "fixed"
    if hard_rate == 0.0:
        return None, None  # nothing ever rolls back: no periodic checkpoint pays off
    return INTERVAL_FUNCTIONS[inp.interval_rule](save_h, 1.0 / hard_rate), inp.interval_rule


def recovers_in_allocation(inp: GoodputInputs) -> bool:
    """Whether live migration's hard failures are recovered inside the allocation (a relaunch with
    a hot spare ready); otherwise every one of them costs checkpoint-restart's requeue."""
    return inp.lm_hard_failure == "relaunch" and inp.spare_policy == "hot" and inp.spare_nodes >= inp.nodes_per_failure


def gpu_killed_share(inp: GoodputInputs) -> float:
    """The share of live migration's hard failures recovered as a GPU killed on a live node."""
    return inp.gpu_killed_fraction if recovers_in_allocation(inp) else 0.0


def requeued_share(inp: GoodputInputs) -> float:
    """The share of live migration's hard failures that still cost a requeue: all of them without a
    relaunch inside the allocation; with one, the nodes lost outright that were the batch host."""
    if not recovers_in_allocation(inp):
        return 1.0
    return (1.0 - inp.gpu_killed_fraction) * min(1.0, inp.nodes_per_failure / inp.nodes)


def plans(inp: GoodputInputs) -> dict[str, StrategyPlan]:
    lam = inp.failure_rate_per_hour
    save_h = inp.checkpoint_save_s / SECONDS_PER_HOUR
    restart_h = (inp.cr_detect_s + inp.cr_restart_s + inp.checkpoint_load_s) / SECONDS_PER_HOUR
    wait_h = inp.replacement_wait_hours

    cr_interval, cr_rule = _interval(inp, save_h, lam)
    checkpoint_restart = StrategyPlan(
        name="checkpoint_restart", overhead=0.0, hard_rate=lam, soft_rate=0.0,
        hard_recovery_h=restart_h, hard_wait_h=wait_h, soft_recovery_h=0.0, soft_wait_h=0.0,
        checkpointing=True, save_h=save_h, interval_h=cr_interval, interval_rule=cr_rule,
    )
    checkpointless = StrategyPlan(
        name="checkpointless", overhead=inp.cl_overhead, hard_rate=0.0, soft_rate=lam,
        hard_recovery_h=0.0, hard_wait_h=0.0,
        soft_recovery_h=(inp.cl_detect_s + inp.cl_recover_s) / SECONDS_PER_HOUR, soft_wait_h=wait_h,
        checkpointing=False, save_h=0.0, interval_h=None, interval_rule=None,
    )
    # Without a spare there is nowhere to migrate to: every failure is hard.
    # With a pool, the degraded node keeps training while the replacement is
    # fetched, so the wait costs nothing (the risk that it dies meanwhile is
    # in soft_fraction: such a fault is a hard one).
    soft = inp.soft_fraction if inp.spare_policy != "none" else 0.0
    lm_hard = lam * (1.0 - soft)
    # torchpass.checkpoint blocks only for its copy to host memory; its own, shorter, save
    # cost moves live migration's optimal interval too.
    lm_save_h = save_h if inp.lm_checkpoint_save_s is None else inp.lm_checkpoint_save_s / SECONDS_PER_HOUR
    lm_interval, lm_rule = _interval(inp, lm_save_h, lm_hard)
    # A relaunch replaces the lost node with a hot spare inside the allocation; the batch host's
    # loss takes the coordinator with it and is requeued (its share: one node in ``nodes``). A GPU
    # killed on a live node leaves the coordinator and the node's Slurm daemon up.
    gpu_killed = gpu_killed_share(inp)
    requeued = requeued_share(inp)
    relaunched = 1.0 - gpu_killed - requeued
    kinds = tuple(k for k in (
        HardKind("gpu_killed", gpu_killed, inp.lm_gpu_killed_s / SECONDS_PER_HOUR, 0.0),
        HardKind("node_lost_relaunched", relaunched, inp.lm_relaunch_s / SECONDS_PER_HOUR, 0.0),
        HardKind("requeued", requeued, restart_h, wait_h),
    ) if k.share > 0.0)
    lm_hard_recovery_h = sum(k.share * k.recovery_h for k in kinds)
    lm_hard_wait_h = sum(k.share * k.wait_h for k in kinds)
    live_migration = StrategyPlan(
        name="live_migration", overhead=inp.lm_overhead, hard_rate=lm_hard, soft_rate=lam * soft,
        hard_recovery_h=lm_hard_recovery_h, hard_wait_h=lm_hard_wait_h,
        soft_recovery_h=(inp.lm_detect_s + inp.lm_migrate_s) / SECONDS_PER_HOUR, soft_wait_h=0.0,
        checkpointing=True, save_h=lm_save_h, interval_h=lm_interval, interval_rule=lm_rule,
        hard_kinds=kinds,
    )
    return {p.name: p for p in (checkpoint_restart, checkpointless, live_migration)}


def schedule(inp: GoodputInputs, plan: StrategyPlan) -> Schedule:
    compute_h = inp.work_hours / (1.0 - plan.overhead)
    if not plan.checkpointing:
        return Schedule(compute_h, 1, compute_h, compute_h)
    interval = compute_h if plan.interval_h is None else min(plan.interval_h, compute_h)
    # The tolerance keeps 720 h / 0.5 h from becoming 1441 segments by rounding.
    segments = max(1, math.ceil(compute_h / interval - 1e-9))
    last_compute = compute_h - (segments - 1) * interval
    return Schedule(compute_h, segments, interval + plan.save_h, last_compute + plan.save_h)


def expected_exposed_h(segment_h: float, hard_rate: float) -> float:
    """Expected exposed time to get one segment through without a hard failure.

    Each attempt runs until the segment ends or a hard failure restarts it:
    E = (e^{lambda a} - 1) / lambda, the standard restart-on-failure result
    (Daly 2006 derives it with a restart term added). With no hard failures
    it is the segment itself.
    """
    if hard_rate == 0.0:
        return segment_h
    return math.expm1(hard_rate * segment_h) / hard_rate


# --------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class StrategyResult:
    """Expected outcome of one strategy for the whole run (hours, GPU-hours, USD)."""

    name: str
    label: str
    checkpoint_interval_s: float | None
    interval_rule: str | None
    checkpoints: int
    wall_hours: float
    ettr: float  # useful time / wall time (Meta's effective training time ratio)
    goodput: float  # useful GPU-hours / paid GPU-hours (spares included)
    failures: float
    hard_failures: float
    soft_failures: float
    failures_per_month: float
    lost_hours_per_failure: float
    lost_usd_per_failure: float
    paid_gpu_hours: float
    cost_usd: float
    lost_gpu_hours: float
    lost_usd: float
    lost_usd_per_month: float
    savings_vs_checkpoint_restart_usd_per_month: float
    lost_gpu_hours_breakdown: dict[str, float]


@dataclass(frozen=True)
class ModelResult:
    inputs: GoodputInputs
    job_mtbf_hours: float
    failures_per_day: float
    nodes: int
    spare_gpus: int
    spare_exhaustion_probability: float | None
    strategies: dict[str, StrategyResult]
    warnings: list[str]


def evaluate_plan(inp: GoodputInputs, plan: StrategyPlan) -> dict[str, Any]:
    """The expected timeline of one plan; see docs/goodput.md, "Closed form"."""
    sched = schedule(inp, plan)
    for seg in (sched.segment_h, sched.last_segment_h):
        if plan.hard_rate * seg > _MAX_FAILURES_EXPONENT:
            raise ConfigError(
                f"the job cannot finish under {STRATEGY_LABELS[plan.name]}: a checkpoint segment of "
                f"{seg:.3g} h (checkpoint_interval_s + checkpoint_save_s) is "
                f"{plan.hard_rate * seg:.0f}x the job MTBF of {1 / plan.hard_rate:.3g} h; "
                "lower checkpoint_save_s or raise gpu_mtbf_hours"
            )
    exposed = (sched.segments - 1) * expected_exposed_h(sched.segment_h, plan.hard_rate) + expected_exposed_h(
        sched.last_segment_h, plan.hard_rate
    )
    hard = plan.hard_rate * exposed
    soft = plan.soft_rate * exposed
    wall = exposed + hard * plan.hard_loss_h + soft * plan.soft_loss_h
    saves_h = sched.segments * plan.save_h
    return {
        "schedule": sched,
        "exposed_h": exposed,
        "wall_h": wall,
        "hard": hard,
        "soft": soft,
        "overhead_h": sched.compute_h - inp.work_hours,
        "saves_h": saves_h,
        "recompute_h": exposed - sched.total_h,
        "recovery_h": hard * plan.hard_recovery_h + soft * plan.soft_recovery_h,
        "wait_h": hard * plan.hard_wait_h + soft * plan.soft_wait_h,
    }


def poisson_tail(mean: float, k: int) -> float:
    """P(X >= k) for X ~ Poisson(mean), each term in log space to stay finite.

    Above the mean the upper tail is summed directly: 1 - (lower sum) would
    cancel to rounding noise (~1e-13) where the tail is far smaller.
    """
    if k <= 0:
        return 1.0
    if mean == 0.0:
        return 0.0
    log_mean = math.log(mean)

    def pmf(i: int) -> float:
        return math.exp(-mean + i * log_mean - math.lgamma(i + 1))

    if k > mean:
        total, i = 0.0, k
        while True:
            term = pmf(i)
            total += term
            if term <= 1e-17 * total or term == 0.0:
                return total
            i += 1
    return max(0.0, 1.0 - sum(pmf(i) for i in range(k)))


def spare_exhaustion_probability(inp: GoodputInputs) -> float | None:
    """Share of failures that find every hot spare still under repair.

    Nodes in repair form an M/G/infinity queue: the number of failures under
    repair at a failure's arrival is Poisson(lambda * repair_hours) (PASTA).
    Each failure takes nodes_per_failure nodes, so spares run out when
    floor(spare_nodes / nodes_per_failure) failures are already in repair.
    The model itself assumes a spare is always ready; this says how often not.
    """
    if inp.spare_policy != "hot":
        return None
    capacity = inp.spare_nodes // inp.nodes_per_failure
    return poisson_tail(inp.failure_rate_per_hour * inp.repair_hours, capacity)


def evaluate(inp: GoodputInputs) -> ModelResult:
    """Closed-form expected outcome of every strategy."""
    n = inp.gpus
    paid_gpus = n + inp.spare_gpus
    price = inp.usd_per_gpu_hour
    raw: dict[str, tuple[StrategyPlan, dict[str, Any]]] = {
        name: (plan, evaluate_plan(inp, plan)) for name, plan in plans(inp).items()
    }
    results: dict[str, StrategyResult] = {}
    lost_per_month: dict[str, float] = {}
    for name, (plan, t) in raw.items():
        wall = t["wall_h"]
        failures = t["hard"] + t["soft"]
        paid = paid_gpus * wall
        lost = paid - n * inp.work_hours
        stall = t["recompute_h"] + t["recovery_h"] + t["wait_h"]
        lost_per_month[name] = lost * price * HOURS_PER_MONTH / wall
        breakdown = {
            "steady_overhead": n * t["overhead_h"],
            "checkpoint_saves": n * t["saves_h"],
            "recompute": n * t["recompute_h"],
            "recovery": n * t["recovery_h"],
            "replacement_wait": n * t["wait_h"],
            "spares": inp.spare_gpus * wall,
        }
        results[name] = StrategyResult(
            name=name,
            label=STRATEGY_LABELS[name],
            checkpoint_interval_s=None if plan.interval_h is None else plan.interval_h * SECONDS_PER_HOUR,
            interval_rule=plan.interval_rule,
            checkpoints=t["schedule"].segments if plan.checkpointing else 0,
            wall_hours=wall,
            ettr=inp.work_hours / wall,
            goodput=n * inp.work_hours / paid,
            failures=failures,
            hard_failures=t["hard"],
            soft_failures=t["soft"],
            failures_per_month=failures * HOURS_PER_MONTH / wall,
            lost_hours_per_failure=stall / failures if failures else 0.0,
            lost_usd_per_failure=n * stall * price / failures if failures else 0.0,
            paid_gpu_hours=paid,
            cost_usd=paid * price,
            lost_gpu_hours=lost,
            lost_usd=lost * price,
            lost_usd_per_month=lost_per_month[name],
            savings_vs_checkpoint_restart_usd_per_month=0.0,
            lost_gpu_hours_breakdown=breakdown,
        )
    baseline = lost_per_month["checkpoint_restart"]
    for name in results:
        results[name] = dataclasses.replace(
            results[name], savings_vs_checkpoint_restart_usd_per_month=baseline - lost_per_month[name]
        )
    warnings: list[str] = []
    exhaustion = spare_exhaustion_probability(inp)
    if exhaustion is not None and exhaustion > 0.01:
        warnings.append(
            f"hot spares run out on {exhaustion:.1%} of failures ({inp.spare_nodes} spare nodes, "
            f"{inp.failure_rate_per_hour * inp.repair_hours:.2f} failures in repair on average); the model "
            "assumes a spare is always ready: add spare_nodes or shorten repair_hours"
        )
    if inp.spare_policy == "none" and inp.soft_fraction > 0:
        warnings.append("spare_policy 'none': live migration has no target, so every failure falls back to restart")
    return ModelResult(
        inputs=inp,
        job_mtbf_hours=inp.job_mtbf_hours,
        failures_per_day=24.0 * inp.failure_rate_per_hour,
        nodes=inp.nodes,
        spare_gpus=inp.spare_gpus,
        spare_exhaustion_probability=exhaustion,
        strategies=results,
        warnings=warnings,
    )


def with_job_size(inp: GoodputInputs, gpus: int) -> GoodputInputs:
    """The same cluster and job shape at another size, for sweeps and plots.

    The per-GPU failure rate stays; hot spares scale with the node count (at
    least enough for one failure); the blast radius is capped by the job.
    """
    blast_gpus = min(inp.blast_radius_gpus, gpus) if inp.blast_radius_gpus is not None else None
    spares = inp.spare_nodes
    if inp.spare_policy == "hot":
        blast = blast_gpus if blast_gpus is not None else min(inp.gpus_per_node, gpus)
        needed = math.ceil(blast / inp.gpus_per_node)
        spares = max(needed, math.ceil(inp.spare_nodes * gpus / inp.gpus))
    return dataclasses.replace(inp, gpus=gpus, blast_radius_gpus=blast_gpus, spare_nodes=spares)


# --------------------------------------------------------------------------
# Breakeven: where live migration's goodput meets checkpointless's
# --------------------------------------------------------------------------
# Goodput falls as any recovery time or the restore point's blocking save grows (each adds wall
# time and nothing useful), so the tie is found by bisection on one input with the others held.
# It answers "what would a hard failure have to cost for torchpass to come out ahead?" with the
# same model, inputs and assumptions as the table it accompanies.

# Explicit outcomes of one solve, never a bare None.
BREAKEVEN_TIES_AT = "ties_at"  # live migration is ahead below ``value_s``, behind above it
BREAKEVEN_BEHIND_AT_ZERO = "behind_at_zero"  # behind even when this costs nothing: no value puts it ahead
BREAKEVEN_AHEAD_AT_ANY = "ahead_at_any"  # ahead even at the input's largest allowed value
BREAKEVEN_NOT_APPLICABLE = "not_applicable"  # the input does not enter the model with these inputs
BREAKEVEN_STATES = (BREAKEVEN_TIES_AT, BREAKEVEN_BEHIND_AT_ZERO, BREAKEVEN_AHEAD_AT_ANY, BREAKEVEN_NOT_APPLICABLE)

# What is varied, in the order the output lists them; each sets one or two inputs to x seconds.
BREAKEVEN_VARIED = {
    "lm_hard_recovery_s": "recovery time per hard failure (GPU killed and node lost alike)",
    "lm_gpu_killed_s": "recovery time per GPU-killed failure (node losses as given)",
    "lm_checkpoint_save_s": "blocking time per restore point (recovery times as given)",
}
_BREAKEVEN_UPPER_S = 30 * 86400.0  # the inputs' own upper bound
_BREAKEVEN_LOWER_SAVE_S = 1e-6  # lm_checkpoint_save_s must be > 0


@dataclass(frozen=True)
class Breakeven:
    varied: str
    state: str
    value_s: float | None  # the tie, for BREAKEVEN_TIES_AT; else None


def goodput_gap(inp: GoodputInputs) -> float:
    """Live migration's goodput minus checkpointless's; -inf where the run cannot finish."""
    try:
        s = evaluate(inp).strategies
    except ConfigError:
        return float("-inf")
    return s["live_migration"].goodput - s["checkpointless"].goodput


def _breakeven_setter(inp: GoodputInputs, varied: str) -> Callable[[float], GoodputInputs]:
    if varied == "lm_hard_recovery_s":
        return lambda x: dataclasses.replace(inp, lm_relaunch_s=x, lm_gpu_killed_s=x)
    return lambda x: dataclasses.replace(inp, **{varied: x})


def _breakeven_applies(inp: GoodputInputs, varied: str) -> bool:
    if varied == "lm_hard_recovery_s":
        return recovers_in_allocation(inp) and inp.soft_fraction < 1.0
    if varied == "lm_gpu_killed_s":
        return gpu_killed_share(inp) > 0.0 and inp.soft_fraction < 1.0
    return inp.soft_fraction < 1.0 or inp.checkpoint_interval_s is not None


def solve_breakeven_one(inp: GoodputInputs, varied: str, tolerance_s: float = 1e-3) -> Breakeven:
    if varied not in BREAKEVEN_VARIED:
        raise ConfigError(f"cannot solve for {varied!r}; one of {', '.join(BREAKEVEN_VARIED)}")
    if not _breakeven_applies(inp, varied):
        return Breakeven(varied, BREAKEVEN_NOT_APPLICABLE, None)
    at = _breakeven_setter(inp, varied)
    lo = _BREAKEVEN_LOWER_SAVE_S if varied == "lm_checkpoint_save_s" else 0.0
    hi = _BREAKEVEN_UPPER_S
    if goodput_gap(at(lo)) < 0.0:
        return Breakeven(varied, BREAKEVEN_BEHIND_AT_ZERO, None)
    if goodput_gap(at(hi)) >= 0.0:
        return Breakeven(varied, BREAKEVEN_AHEAD_AT_ANY, None)
    while hi - lo > tolerance_s:
        mid = (lo + hi) / 2.0
        if goodput_gap(at(mid)) >= 0.0:
            lo = mid
        else:
            hi = mid
    return Breakeven(varied, BREAKEVEN_TIES_AT, lo)


def solve_breakeven(inp: GoodputInputs) -> dict[str, Breakeven]:
    """The tie for each input in BREAKEVEN_VARIED, the others held at ``inp``."""
    return {varied: solve_breakeven_one(inp, varied) for varied in BREAKEVEN_VARIED}
