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
expected values, so ``mean`` is used, else ``p50``. Any of the three keys may
be missing; a file with none of them is not a results file for this purpose.
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
}
STATISTICS = ("mean", "p50")
RESULTS_GLOB = "bench/results/*.json"
BENCHMARKS_DOC = "docs/benchmarks.md"
_FENCE = re.compile(r"^```json[ \t]+torchpass-measured[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Measured:
    source: str
    values: dict[str, float]  # goodput input name -> value
    statistics: dict[str, str]  # goodput input name -> "mean" | "p50" | "value"
    # goodput input name -> the file it came from, where figures were merged
    # from several results files (empty: all from ``source``)
    sources: dict[str, str] = field(default_factory=dict)

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


def parse(data: Any, where: str) -> Measured | None:
    """The figures in one results object; None if it has none of the keys."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
    present = [k for k in MEASURED_KEYS if k in data]
    if not present:
        return None
    values: dict[str, float] = {}
    stats: dict[str, str] = {}
    for key in present:
        value, used = _figure(where, key, data[key])
        values[MEASURED_KEYS[key]] = value
        stats[MEASURED_KEYS[key]] = used
    return Measured(source=where, values=values, statistics=stats)


def load_file(path: Path) -> Measured:
    """A results file the user named: missing keys are an error here."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read measured results {path}: {exc.strerror or exc}") from None
    if path.suffix == ".md":
        found = _from_markdown(text, str(path))
        if found is None:
            raise ConfigError(f"{path}: no ```json torchpass-measured block with measured figures")
        return found
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    found = parse(data, str(path))
    if found is None:
        raise ConfigError(f"{path} has none of the keys {', '.join(MEASURED_KEYS)}")
    return found


def _from_markdown(text: str, where: str) -> Measured | None:
    for block in _FENCE.findall(text):
        try:
            data = json.loads(block)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: the torchpass-measured block is not valid JSON: {exc}") from None
        found = parse(data, where)
        if found is not None:
            return found
    return None


def discover(root: Path) -> tuple[Measured | None, list[str]]:
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
    for path in files:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict):
            found = parse(data, str(path))
            if found is None:
                continue
            for name, value in found.values.items():
                if name not in values:
                    values[name], stats[name], sources[name] = value, found.statistics[name], found.source
    if values:
        used = list(dict.fromkeys(sources.values()))  # newest first
        return Measured(source=", ".join(used), values=values, statistics=stats,
                        sources=sources if len(used) > 1 else {}), looked
    doc = root / BENCHMARKS_DOC
    if doc.is_file():
        found = _from_markdown(doc.read_text(), str(doc))
        if found is not None:
            return found, looked
    return None, looked
