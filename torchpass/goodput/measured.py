"""torchpass's own measured detection and migration times, for `--measured`.

The benchmarks write a machine-readable results file (bench/results/*.json);
docs/benchmarks.md may carry the same figures in a fenced block tagged
``json torchpass-measured``. Both use one JSON shape (docs/goodput.md,
"Measured inputs"):

    {
      "detection_latency_s": {"mean": 2.1, "p50": 1.9, "p95": 3.4, "n": 20},
      "migration_pause_s":   {"mean": 6.6, "p50": 6.5, "p95": 7.1, "n": 20},
      "steady_state_overhead": {"mean": 0.004}
    }

Each figure is an object of statistics or a bare number. The model needs
expected values, so ``mean`` is used, else ``p50``. bench_hard_failure adds
``hard_failure_relaunch_s`` (a node lost outright to training resumed from the
newest checkpoint: ``lm_relaunch_s``), bench_app_checkpoint
``checkpoint_blocking_s`` (how long one torchpass.checkpoint save blocks
training: ``lm_checkpoint_save_s``). Any of the keys may be missing; a file
with none of them is not a results file for this purpose.

The pause grows with the model (its image is moved), so bench_migration also
writes the stall of every model it measured, ``"by_model": {"10M": 1.2,
"100M": 7.6}`` inside ``migration_pause_s`` (its ``mean`` is the largest
model's); so does bench_app_checkpoint's ``checkpoint_blocking_s``. With a
model size (``tpassctl goodput --measured --model-size 1B``) each of these
is the one measured for that size, else for the nearest measured size (by
ratio: 1B is nearer 100M than 10B is); a note says which.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchpass.errors import ConfigError

# results key -> goodput input it sets
MEASURED_KEYS = {
    "detection_latency_s": "lm_detect_s",
    "migration_pause_s": "lm_migrate_s",
    "steady_state_overhead": "lm_overhead",
    "hard_failure_relaunch_s": "lm_relaunch_s",
    "checkpoint_blocking_s": "lm_checkpoint_save_s",
}
STATISTICS = ("mean", "p50")
PAUSE_KEY = "migration_pause_s"
# The figures that grow with the model, measured per size ("by_model"), and what each is called in notes.
BY_MODEL_KEYS = {
    PAUSE_KEY: ("migration pause", "the pause grows with the model's memory"),
    "checkpoint_blocking_s": ("torchpass.checkpoint save blocking", "the copy to host memory grows with the state"),
}
RESULTS_GLOB = "bench/results/*.json"
BENCHMARKS_DOC = "docs/benchmarks.md"
_FENCE = re.compile(r"^```json[ \t]+torchpass-measured[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([kmbt]?)", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


@dataclass(frozen=True)
class Measured:
    source: str
    values: dict[str, float]  # goodput input name -> value
    statistics: dict[str, str]  # goodput input name -> "mean" | "p50" | "value"
    # goodput input name -> the file it came from, where figures were merged
    # from several results files (empty: all from ``source``)
    sources: dict[str, str] = field(default_factory=dict)
    # what the user should know about the figures chosen (the model size a pause is from)
    notes: tuple[str, ...] = ()

    def source_of(self, name: str) -> str:
        return self.sources.get(name, self.source)


def _figure(where: str, key: str, raw: Any) -> tuple[float, str]:
    if isinstance(raw, dict):
        for stat in STATISTICS:
            if stat in raw:
                value, used = raw[stat], stat
                break
        else:
            raise ConfigError(f"{where}: {key} has neither 'mean' nor 'p50'")
    else:
        value, used = raw, "value"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{where}: {key} must be a finite number >= 0, got {value!r}")
    if key == "steady_state_overhead" and value >= 1:
        raise ConfigError(f"{where}: {key} is a fraction of step time and must be < 1, got {value!r}")
    return float(value), used


def model_params(size: str) -> float:
    """Parameters in a model size such as ``10M``, ``1.3B``, ``70b`` or ``125000000``."""
    m = _SIZE.fullmatch(str(size).strip())
    value = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()] if m else 0.0
    if value <= 0:
        raise ConfigError(f"model size {size!r} is not a parameter count such as 10M, 1.3B or 70B")
    return value


def nearest_size(wanted: str, measured: list[str]) -> str:
    """The measured size nearest ``wanted`` by ratio (ties: the larger, whose pause is longer)."""
    w = math.log(model_params(wanted))
    return min(measured, key=lambda s: (abs(math.log(model_params(s)) - w), -model_params(s)))


def _for_size(where: str, key: str, raw: Any, model_size: str) -> tuple[float, str, str]:
    """(figure, statistic, note) from ``key``'s ``by_model`` for ``model_size`` (a BY_MODEL_KEYS key)."""
    what, why = BY_MODEL_KEYS[key]
    by_model = raw.get("by_model") if isinstance(raw, dict) else None
    if not isinstance(by_model, dict) or not by_model:
        value, used = _figure(where, key, raw)
        of = raw.get("model") if isinstance(raw, dict) else None
        return value, used, (f"{where} has the {what} of {of} only, not one per model size: "
                             f"{value:g} s used for {model_size}" if of else
                             f"{where} does not say which model its {what} ({value:g} s) is from; "
                             f"used for {model_size}")
    for size in by_model:
        model_params(size)  # a bad key is named, not skipped
    chosen = nearest_size(model_size, list(by_model))
    value, used = _figure(where, f"{key}.by_model.{chosen}", by_model[chosen])
    sizes = ", ".join(sorted(by_model, key=model_params))
    if model_params(chosen) == model_params(model_size):
        return value, used, f"{what} {value:g} s measured with the {chosen} model (measured: {sizes})"
    return value, used, (f"{what} {value:g} s from the {chosen} model, the measured size nearest "
                         f"{model_size} (measured: {sizes}); {why}")


def parse(data: Any, where: str, model_size: str | None = None) -> Measured | None:
    """The figures in one results object; None if it has none of the keys.

    ``model_size``: take the migration pause measured for that model size, or the nearest one.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
    present = [k for k in MEASURED_KEYS if k in data]
    if not present:
        return None
    values: dict[str, float] = {}
    stats: dict[str, str] = {}
    notes: list[str] = []
    for key in present:
        if key in BY_MODEL_KEYS and model_size is not None:
            value, used, note = _for_size(where, key, data[key], model_size)
            notes.append(note)
        else:
            value, used = _figure(where, key, data[key])
            by_model = data[key].get("by_model") if key in BY_MODEL_KEYS and isinstance(data[key], dict) else None
            if isinstance(by_model, dict) and len(by_model) > 1:
                notes.append(f"{BY_MODEL_KEYS[key][0]} {value:g} s is {where}'s headline figure"
                             + (f" (the {data[key]['model']} model)" if data[key].get("model") else "")
                             + f"; --model-size picks the one measured for your model "
                             f"(measured: {', '.join(map(str, by_model))})")
        values[MEASURED_KEYS[key]] = value
        stats[MEASURED_KEYS[key]] = used
    return Measured(source=where, values=values, statistics=stats, notes=tuple(notes))


def load_file(path: Path, model_size: str | None = None) -> Measured:
    """A results file the user named: missing keys are an error here."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read measured results {path}: {exc.strerror or exc}") from None
    if path.suffix == ".md":
        found = _from_markdown(text, str(path), model_size)
        if found is None:
            raise ConfigError(f"{path}: no ```json torchpass-measured block with measured figures")
        return found
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    found = parse(data, str(path), model_size)
    if found is None:
        raise ConfigError(f"{path} has none of the keys {', '.join(MEASURED_KEYS)}")
    return found


def _from_markdown(text: str, where: str, model_size: str | None = None) -> Measured | None:
    for block in _FENCE.findall(text):
        try:
            data = json.loads(block)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: the torchpass-measured block is not valid JSON: {exc}") from None
        found = parse(data, where, model_size)
        if found is not None:
            return found
    return None


def discover(root: Path, model_size: str | None = None) -> tuple[Measured | None, list[str]]:
    """The newest figure of each key under ``root``'s results, else docs/benchmarks.md; and where it looked.

    Each benchmark writes its own results file (bench_tpassd the detection
    latency, bench_migration the pause and the end-to-end detection), so each
    key is taken from the newest results file that has it: re-running one
    benchmark does not hide another's figures. Results files without the keys
    (other benchmarks) are skipped, not errors.
    """
    looked = [str(root / RESULTS_GLOB), str(root / BENCHMARKS_DOC)]
    files = sorted(root.glob(RESULTS_GLOB), key=lambda p: (p.stat().st_mtime, p.name), reverse=True)
    values: dict[str, float] = {}
    stats: dict[str, str] = {}
    sources: dict[str, str] = {}
    notes: dict[str, tuple[str, ...]] = {}  # source -> its notes
    for path in files:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict):
            found = parse(data, str(path), model_size if "lm_migrate_s" not in values else None)
            if found is None:
                continue
            for name, value in found.values.items():
                if name not in values:
                    values[name], stats[name], sources[name] = value, found.statistics[name], found.source
            if found.notes and sources.get("lm_migrate_s") == found.source:
                notes[found.source] = found.notes
    if values:
        used = list(dict.fromkeys(sources.values()))  # newest first
        return Measured(source=", ".join(used), values=values, statistics=stats,
                        sources=sources if len(used) > 1 else {},
                        notes=tuple(n for s in used for n in notes.get(s, ()))), looked
    doc = root / BENCHMARKS_DOC
    if doc.is_file():
        found = _from_markdown(doc.read_text(), str(doc), model_size)
        if found is not None:
            return found, looked
    return None, looked
