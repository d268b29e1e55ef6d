"""`tpassctl goodput`: what each fault-tolerance strategy costs a training job.

Inputs come in layers, later ones winning:
    built-in defaults -> --preset -> --config FILE.toml -> --measured -> flags
The model and its sources are in docs/goodput.md, with the --json schema.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

import click

from torchpass.config import read_toml
from torchpass.errors import ConfigError, TorchpassError
from torchpass.goodput import measured as measured_mod
from torchpass.goodput import model
from torchpass.goodput.model import FAILURE_RATE_HELP, INPUT_SPECS, GoodputInputs, InputSpec
from torchpass.goodput.plot import draw
from torchpass.goodput.presets import PRESETS, get_preset
from torchpass.goodput.simulate import simulate as run_simulation

JSON_SCHEMA = "torchpass.goodput/1"
DEFAULT_RUNS = 2000


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _click_type(spec: InputSpec) -> click.ParamType:
    if spec.choices:
        return click.Choice(spec.choices)
    if spec.kind is int:
        return click.IntRange(
            None if spec.minimum is None else int(spec.minimum),
            None if spec.maximum is None else int(spec.maximum),
        )
    return click.FloatRange(spec.minimum, spec.maximum, min_open=not spec.minimum_inclusive)


def _input_options(func: Callable) -> Callable:
    """One flag per input, named after it (gpus_per_node -> --gpus-per-node)."""
    defaults = GoodputInputs()
    for rate_key in reversed(model.FAILURE_RATE_KEYS[1:]):
        func = click.option(
            _flag(rate_key), rate_key, type=click.FloatRange(0, None, min_open=True), default=None,
            help=FAILURE_RATE_HELP[rate_key] + " Instead of --gpu-mtbf-hours.",
        )(func)
    for spec in reversed(INPUT_SPECS):
        default = getattr(defaults, spec.name)
        shown = "derived" if default is None else f"{default:g}" if isinstance(default, float) else default
        func = click.option(
            _flag(spec.name), spec.name, type=_click_type(spec), default=None,
            help=f"{spec.help} [default: {shown}]",
        )(func)
    return func


def _numpy_available() -> bool:
    return importlib.util.find_spec("numpy") is not None


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def _document(
    result: model.ModelResult,
    simulation: dict[str, Any] | None,
    sources: dict[str, str],
    preset: str | None,
    measured_source: str | None,
    plot_path: Path | None,
    warnings: list[str],
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The --json document; its schema is documented in docs/goodput.md."""
    inp = result.inputs
    strategies: dict[str, Any] = {}
    for name, s in result.strategies.items():
        entry = {
            "label": s.label,
            "goodput": s.goodput,
            "ettr": s.ettr,
            "wall_hours": s.wall_hours,
            "checkpoint_interval_s": s.checkpoint_interval_s,
            "interval_rule": s.interval_rule,
            "checkpoints": s.checkpoints,
            "failures": s.failures,
            "hard_failures": s.hard_failures,
            # the share of the hard failures that cost a requeue (the rest are relaunched)
            "hard_failures_requeued_share": model.requeued_share(inp) if name == "live_migration" else 1.0,
            # the share of the hard failures that are a GPU killed on a live node (recovered in place)
            "hard_failures_gpu_killed_share": model.gpu_killed_share(inp) if name == "live_migration" else 0.0,
            "soft_failures": s.soft_failures,
            "failures_per_month": s.failures_per_month,
            "lost_hours_per_failure": s.lost_hours_per_failure,
            "lost_usd_per_failure": s.lost_usd_per_failure,
            "paid_gpu_hours": s.paid_gpu_hours,
            "cost_usd": s.cost_usd,
            "lost_gpu_hours": s.lost_gpu_hours,
            "lost_usd": s.lost_usd,
            "lost_usd_per_month": s.lost_usd_per_month,
            "savings_vs_checkpoint_restart_usd_per_month": s.savings_vs_checkpoint_restart_usd_per_month,
            "lost_gpu_hours_breakdown": dict(s.lost_gpu_hours_breakdown),
            "simulation": None,
        }
        if simulation is not None:
            sim = simulation[name]
            entry["simulation"] = {
                "runs": sim.runs,
                "seed": sim.seed,
                "failure_process": sim.failure_process,
                "wall_hours": sim.wall_hours.as_dict(),
                "goodput": sim.goodput.as_dict(),
                "ettr": sim.ettr.as_dict(),
                "cost_usd": sim.cost_usd.as_dict(),
                "failures": sim.failures.as_dict(),
                "wall_hours_std_error": sim.wall_hours_std_error,
                "wall_hours_rel_diff_vs_model": sim.wall_hours_rel_diff_vs_model,
                "goodput_rel_diff_vs_model": sim.goodput_rel_diff_vs_model,
            }
        strategies[name] = entry
    return {
        "schema": JSON_SCHEMA,
        "preset": preset,
        "inputs": inp.as_dict(),
        "input_sources": dict(sorted(sources.items())),
        "measured_source": measured_source,
        "derived": {
            "nodes": result.nodes,
            "job_mtbf_hours": result.job_mtbf_hours,
            "failures_per_day": result.failures_per_day,
            "blast_radius_gpus": inp.blast_radius,
            "spare_gpus": result.spare_gpus,
            "spare_exhaustion_probability": result.spare_exhaustion_probability,
            "hours_per_month": model.HOURS_PER_MONTH,
        },
        "strategies": strategies,
        "plot": None if plot_path is None else str(plot_path),
        "warnings": warnings,
        **(extra or {}),
    }


def _money(value: float) -> str:
    sign = "-" if value < 0 else ""
    value = abs(value)
    if value >= 1e6:
        return f"{sign}${value / 1e6:,.2f}M"
    if value >= 1e4:
        return f"{sign}${value / 1e3:,.1f}k"
    return f"{sign}${value:,.0f}"


def _hard_failure_text(inp: model.GoodputInputs) -> str:
    """How live migration's hard failures are recovered: a GPU killed on a live node, a node lost
    outright relaunched inside the allocation, or (the batch host's, or all without a hot spare) requeued."""
    if not model.recovers_in_allocation(inp):
        why = ("lm_hard_failure=requeue" if inp.lm_hard_failure != "relaunch"
               else f"a relaunch needs a hot spare (spare_policy={inp.spare_policy})")
        return f"every one is requeued, as under checkpoint-restart ({why})"
    killed = model.gpu_killed_share(inp)
    parts = []
    if killed > 0.0:
        parts.append(f"{killed:.0%} a GPU killed on a live node, resumed from the newest restore point in "
                     f"{inp.lm_gpu_killed_s:g} s")
    parts.append(f"{1.0 - killed:.0%} a node lost outright, relaunched from the newest checkpoint in "
                 f"{inp.lm_relaunch_s:g} s with a hot spare, no requeue")
    return "; ".join(parts) + (f"; the batch host's ({model.requeued_share(inp):.2%} of them) are still requeued")


def _breakeven_json(solved: dict[str, model.Breakeven], result: model.ModelResult) -> dict[str, Any]:
    s = result.strategies
    return {
        "against": "checkpointless",
        "goodput_gap": s["live_migration"].goodput - s["checkpointless"].goodput,
        "solutions": {name: {"state": b.state, "value_s": b.value_s} for name, b in solved.items()},
    }


def _breakeven_text(solved: dict[str, model.Breakeven], result: model.ModelResult) -> str:
    s = result.strategies
    lm, cl = s["live_migration"].goodput, s["checkpointless"].goodput
    lines = [f"breakeven against checkpointless (closed form; live migration {lm:.2%}, checkpointless {cl:.2%}, "
             f"{(lm - cl) * 100:+.2f} points), each with the other inputs as above:"]
    for name, b in solved.items():
        if b.state == model.BREAKEVEN_TIES_AT:
            said = f"ahead below {b.value_s:,.2f} s, behind above it"
        elif b.state == model.BREAKEVEN_BEHIND_AT_ZERO:
            said = "behind even at 0 s: no value of it alone puts live migration ahead"
        elif b.state == model.BREAKEVEN_AHEAD_AT_ANY:
            said = "ahead at any value"
        else:
            said = "does not apply with these inputs"
        lines.append(f"  {model.BREAKEVEN_VARIED[name]} [{name}]: {said}")
    return "\n".join(lines)


def _table(result: model.ModelResult, simulation: dict[str, Any] | None, preset: str | None) -> str:
    inp = result.inputs
    names = list(model.STRATEGIES)
    s = result.strategies
    lines: list[str] = []
    title = f"preset {preset}: {PRESETS[preset].summary}" if preset else "built-in defaults and overrides"
    lines.append(f"torchpass goodput ({title})")
    lines.append(
        f"job: {inp.gpus:,} GPUs on {result.nodes:,} nodes ({inp.gpus_per_node}/node), "
        f"job MTBF {result.job_mtbf_hours:.3g} h ({result.failures_per_day:.3g} failures/day), "
        f"{inp.work_hours:,.0f} h of failure-free work, ${inp.usd_per_gpu_hour:,.2f}/GPU-h"
    )
    if inp.spare_policy == "hot":
        spares = (
            f"{inp.spare_nodes} hot spare nodes ({result.spare_gpus:,} GPUs, "
            f"out of spares on {result.spare_exhaustion_probability:.2%} of failures)"
        )
    elif inp.spare_policy == "pool":
        spares = f"replacements from the pool after {inp.replacement_wait_s:g} s"
    else:
        spares = f"no spares: the job waits {inp.repair_hours:g} h for each repair"
    lines.append(f"spares: {spares}; soft (migratable) failures: {inp.soft_fraction:.0%}")
    lines.append(f"hard failures under live migration: {_hard_failure_text(inp)}")
    lines.append("")

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"{label:<36}" + "".join(f"{c:>26}" for c in cells))

    def interval(x: model.StrategyResult) -> str:
        if x.checkpoint_interval_s is None:
            return "-" if x.checkpoints == 0 else "end only"
        return f"{x.checkpoint_interval_s / 60:.1f} min ({x.interval_rule})"

    row("", [model.STRATEGY_LABELS[n] for n in names])
    row("goodput (useful / paid GPU-h)", [f"{s[n].goodput:.2%}" for n in names])
    row("effective training time (ETTR)", [f"{s[n].ettr:.2%}" for n in names])
    row("wall time (h)", [f"{s[n].wall_hours:,.1f}" for n in names])
    row("failures in the run", [f"{s[n].failures:,.1f}" for n in names])
    row("checkpoint every", [interval(s[n]) for n in names])
    row("job time lost per failure (min)", [f"{s[n].lost_hours_per_failure * 60:,.1f}" for n in names])
    row("USD lost per failure", [_money(s[n].lost_usd_per_failure) for n in names])
    row("USD lost per month", [_money(s[n].lost_usd_per_month) for n in names])
    row(
        "USD saved per month vs ckpt-restart",
        ["-"] + [_money(s[n].savings_vs_checkpoint_restart_usd_per_month) for n in names[1:]],
    )
    row("run cost", [_money(s[n].cost_usd) for n in names])
    lines.append("GPU-h lost per month, by cause:")
    for cause in s[names[0]].lost_gpu_hours_breakdown:
        row(
            f"  {cause.replace('_', ' ')}",
            [f"{s[n].lost_gpu_hours_breakdown[cause] * model.HOURS_PER_MONTH / s[n].wall_hours:,.0f}" for n in names],
        )
    if simulation is not None:
        first = simulation[names[0]]
        lines.append(
            f"simulated: {first.runs:,} runs, {first.failure_process} failures, seed {first.seed}; "
            "mean (p5-p95)"
        )
        row("  goodput", [
            f"{simulation[n].goodput.mean:.2%} ({simulation[n].goodput.p5:.1%}-{simulation[n].goodput.p95:.1%})"
            for n in names
        ])
        row("  wall time (h)", [
            f"{simulation[n].wall_hours.mean:,.0f} ({simulation[n].wall_hours.p5:,.0f}-"
            f"{simulation[n].wall_hours.p95:,.0f})"
            for n in names
        ])
        row("  run cost", [
            f"{_money(simulation[n].cost_usd.mean)} ({_money(simulation[n].cost_usd.p5)}-"
            f"{_money(simulation[n].cost_usd.p95)})"
            for n in names
        ])
        row("  mean wall time vs closed form", [f"{simulation[n].wall_hours_rel_diff_vs_model:+.2%}" for n in names])
    return "\n".join(lines)


# --------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------


def _layers(
    preset: str | None, config: Path | None, measured: measured_mod.Measured | None, flags: dict[str, Any]
) -> list[tuple[str, dict[str, Any]]]:
    layers: list[tuple[str, dict[str, Any]]] = []
    if preset:
        layers.append((f"preset {preset}", dict(get_preset(preset).values)))
    if config is not None:
        layers.append((f"config {config}", read_toml(config)))
    if measured is not None:
        by_source: dict[str, dict[str, Any]] = {}  # merged results: name each input's own file
        for name, value in measured.values.items():
            by_source.setdefault(measured.source_of(name), {})[name] = value
        for source, values in by_source.items():
            layers.append((f"measured {source}", values))
    layers.append(("flags", {k: v for k, v in flags.items() if v is not None}))
    return layers


def _flag_sources(sources: dict[str, str]) -> dict[str, str]:
    """Name the flag, not the layer, where a flag set the input."""
    return {k: (_flag(k) if v == "flags" else v) for k, v in sources.items()}


@click.command("goodput", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--preset", type=click.Choice(sorted(PRESETS)), help="Start from a named scenario (see --list-presets).")
@click.option("--list-presets", is_flag=True, help="List the presets and exit.")
@click.option(
    "--config", type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="TOML file of inputs (top-level keys named like the flags, with underscores); "
    "applied over the preset, under the flags. Unknown keys are an error.",
)
@click.option(
    "--measured", is_flag=False, flag_value="auto", default=None, metavar="[FILE]",
    help="Use torchpass's measured detection/migration times for live migration: from FILE "
    "(results JSON, or a .md with a torchpass-measured block), or with no FILE the newest "
    "bench/results/*.json, else docs/benchmarks.md, under the current directory. Applied over "
    "--config, under the flags.",
)
@click.option(
    "--model-size", metavar="SIZE",
    help="With --measured: the model's parameter count (10M, 1.3B, 70B; default: the preset's model, "
    "if it names one). The measured figures that grow with the model (migration pause, save blocking, "
    "relaunch, GPU-killed recovery) apply only inside the sizes they were measured at, each the one "
    "measured for that size or the nearest.",
)
@_input_options
@click.option(
    "--simulate/--no-simulate", default=None,
    help="Also run the Monte Carlo simulator (default: when numpy is installed).",
)
@click.option("--runs", type=click.IntRange(1, 1_000_000), default=DEFAULT_RUNS, show_default=True,
              help="Simulated runs per strategy.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Simulator seed.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True, path_type=Path),
              help="Also draw the chosen metric against job size for each strategy into this PNG "
              "(needs matplotlib: pip install 'torchpass[plot]').")
@click.option("--plot-metric", type=click.Choice(["goodput", "usd-lost-per-month"]), default="goodput",
              show_default=True)
@click.option("--solve-breakeven", is_flag=True,
              help="Also solve, on the closed form, for the recovery time per hard failure, per GPU-killed "
              "failure and the restore point's blocking time at which live migration ties checkpointless.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (schema in docs/goodput.md).")
def goodput(
    preset: str | None,
    list_presets: bool,
    config: Path | None,
    measured: str | None,
    model_size: str | None,
    simulate: bool | None,
    runs: int,
    seed: int,
    plot_path: Path | None,
    plot_metric: str,
    solve_breakeven: bool,
    as_json: bool,
    **flags: Any,
) -> None:
    """Goodput and money lost to failures under checkpoint-restart, checkpointless
    recovery and live migration.

    Inputs apply in this order, later ones winning: built-in defaults, --preset,
    --config FILE.toml, --measured, then the flags. The model, its sources and
    the --json schema are in docs/goodput.md.
    """
    if list_presets:
        if as_json:
            click.echo(json.dumps(
                {name: {"summary": p.summary, "values": p.values, "sources": list(p.sources)}
                 for name, p in sorted(PRESETS.items())}, indent=2))
        else:
            for name, p in sorted(PRESETS.items()):
                click.echo(f"{name:<16}{p.summary}")
        return
    if model_size is not None and measured is None:
        raise click.UsageError("--model-size selects among measured migration pauses: use it with --measured")
    try:
        _run(preset, config, measured, simulate, runs, seed, plot_path, plot_metric, as_json, flags,
             model_size=model_size, solve_breakeven=solve_breakeven)
    except TorchpassError as exc:
        raise click.ClickException(str(exc)) from None


def _run(
    preset: str | None,
    config: Path | None,
    measured: str | None,
    simulate: bool | None,
    runs: int,
    seed: int,
    plot_path: Path | None,
    plot_metric: str,
    as_json: bool,
    flags: dict[str, Any],
    model_size: str | None = None,
    solve_breakeven: bool = False,
) -> None:
    notes: list[str] = []
    found: measured_mod.Measured | None = None
    size_from = None
    if model_size is not None:
        measured_mod.model_params(model_size)  # a bad size is refused even where nothing is found
        size_from = "--model-size"
    elif preset and get_preset(preset).model_size:
        model_size, size_from = get_preset(preset).model_size, f"preset {preset}"
    if measured is None:
        model_size = size_from = None  # the model size serves --measured only
    if measured == "auto":
        found, looked = measured_mod.discover(Path.cwd(), model_size)
        if found is None:
            notes.append(
                f"--measured: no measured results in {' or '.join(looked)}; "
                "live migration uses the preset/config/default times"
            )
    elif measured is not None:
        found = measured_mod.load_file(Path(measured), model_size)
    if found is not None:
        notes.extend(f"--measured: {n}" for n in found.notes)
        refused = measured_mod.not_applied_line(found, model_size, size_from)
        if refused:
            notes.append(f"--measured: {refused}")

    layers = _layers(preset, config, found, flags)
    try:
        inputs, sources = model.build_inputs(layers)
    except ConfigError as exc:
        raise click.ClickException(_name_the_flag(str(exc), flags)) from None
    sources = _flag_sources(sources)
    result = model.evaluate(inputs)

    if simulate is None:
        simulate = _numpy_available()
        if not simulate:
            notes.append("simulation skipped: numpy is not installed (pip install numpy)")
    simulation = None
    if simulate:
        simulation = run_simulation(inputs, runs=runs, seed=seed, closed_form=result)

    if plot_path is not None:
        draw(inputs, plot_path, plot_metric, title=f"torchpass goodput: {preset or 'custom job'}")
        notes.append(f"plot written to {plot_path}")

    solved = model.solve_breakeven(inputs) if solve_breakeven else None
    warnings = result.warnings
    if as_json:
        extra = {
            "model_size": model_size,
            "model_size_source": size_from,
            "measured_not_applied": dict(found.not_applied) if found else {},
            "breakeven": None if solved is None else _breakeven_json(solved, result),
        }
        doc = _document(result, simulation, sources, preset, found.source if found else None, plot_path,
                        warnings + notes, extra)
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(_table(result, simulation, preset))
        if solved is not None:
            click.echo(_breakeven_text(solved, result))
        for warning in warnings:
            click.echo(f"warning: {warning}", err=True)
    for note in notes:
        if not as_json:
            click.echo(note, err=True)


def _name_the_flag(message: str, flags: dict[str, Any]) -> str:
    """Where flags carried the bad value, say it with flag names.

    "flags: gpus must be..." -> "--gpus: gpus must be...", and input names
    elsewhere in the message become their flags.
    """
    if not message.startswith("flags: "):
        return message
    rest = message[len("flags: "):]
    first = rest.split(" ", 1)[0]
    names = sorted(model.known_keys(), key=len, reverse=True)
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    if first in flags:
        return f"{_flag(first)}: {rest}"
    return pattern.sub(lambda m: _flag(m.group(1)), rest)


if __name__ == "__main__":  # python -m tpassctl.goodput_cmd
    goodput(prog_name="tpassctl goodput", args=sys.argv[1:])
