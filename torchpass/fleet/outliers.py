"""Which node, or which node's link on which rail, stands out from the fleet: pure, no clock.

Robust statistics (Iglewicz and Hoaglin): the modified z-score of a value x among values X is
0.6745 * (x - median(X)) / MAD(X), MAD the median absolute deviation, here of the logarithms of
positive values: times and bandwidths vary by ratios. On linear values, one healthy node whose
best pair ran at 3-5 Gbit/s beside others at 10 widened the MAD of 4 nodes so much that a rail
limited to 0.1 Gbit/s scored under 3.5 (2 of 5 bench runs missed it); in logarithms a
hundredfold fault stays far out. A value is an outlier when
its score passes ``z_threshold`` (3.5) in the bad direction AND it is at least ``min_rel``
away from the median, relative to it: four nodes within 2 % of each other have a MAD so small
that noise alone scores far above 3.5, and on a shared machine timings move by tens of percent.

Attribution: a node whose compute check is an outlier, or whose every rail is, is a node fault
(a slow node slows its traffic on every rail); a link outlier is named only on a node where some
rail is still normal.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from statistics import median

# 0.6745 = the normal distribution's 75th percentile: it scales the MAD to a standard deviation.
MAD_SCALE = 0.6745


class Better(Enum):
    """Which direction is good for a measure (a lower time, a higher bandwidth)."""

    LOWER = "lower"
    HIGHER = "higher"


@dataclass(frozen=True)
class Rule:
    z_threshold: float = 3.5
    min_rel: float = 0.5  # at least 50 % worse than the fleet's median


# Defaults per measure. Compute: 1.5x the median. Bandwidth: under a third of it (two quiet rails
# of the devcluster measured 5.1 and 9.8 Gbit/s in one audit; a rate-limited one 0.1). Latency is
# the noisiest on a shared host (a scheduler tick is 4 ms): three times the median.
RULES: dict[str, Rule] = {
    "compute_s": Rule(3.5, 0.5),
    "bandwidth_bps": Rule(3.5, 0.67),
    "latency_s": Rule(3.5, 2.0),
}
BETTER: dict[str, Better] = {"compute_s": Better.LOWER, "bandwidth_bps": Better.HIGHER, "latency_s": Better.LOWER}


@dataclass(frozen=True)
class Outlier:
    key: str  # the node, or "NODE/RAIL"
    measure: str
    value: float
    median: float
    z: float  # the modified z-score, signed so that positive is worse; inf when the MAD is 0
    rel: float  # how much worse than the median, relative to it (0.5 = 50 %)

    def as_dict(self) -> dict:
        """JSON-safe: a score that is infinite (a MAD of 0, a check that failed) is None."""
        return {"key": self.key, "measure": self.measure, "value": _finite(self.value, 6),
                "median": _finite(self.median, 6), "z": _finite(self.z, 2), "rel": _finite(self.rel, 3)}


def _finite(x: float, digits: int) -> float | None:
    return round(x, digits) if math.isfinite(x) else None


def modified_z(values: Mapping[str, float], better: Better) -> dict[str, tuple[float, float, float]]:
    """Per key: (modified z-score, positive = worse, of the logarithms when every value is positive;
    relative deviation from the median, positive = worse; the median)."""
    if not values:
        return {}
    med = median(values.values())
    positive = all(v > 0 for v in values.values())
    scaled = {k: math.log(v) if positive else v for k, v in values.items()}
    smed = median(scaled.values())
    mad = median(abs(v - smed) for v in scaled.values())
    sign = 1.0 if better is Better.LOWER else -1.0
    out = {}
    for k, v in values.items():
        sdev = sign * (scaled[k] - smed)
        if mad > 0:
            z = MAD_SCALE * sdev / mad
        else:
            z = float("inf") if sdev > 0 else 0.0
        dev = sign * (v - med)
        rel = dev / abs(med) if med else (float("inf") if dev > 0 else 0.0)
        out[k] = (z, rel, med)
    return out


def outliers(values: Mapping[str, float], measure: str, rule: Rule | None = None) -> list[Outlier]:
    """The keys whose ``measure`` is worse than the rest by both the score and the relative rule.
    Fewer than three values have no distribution to stand out of: none."""
    if len(values) < 3:
        return []
    rule = rule or RULES[measure]
    found = []
    for k, (z, rel, med) in sorted(modified_z(values, BETTER[measure]).items()):
        if z > rule.z_threshold and rel >= rule.min_rel:
            found.append(Outlier(k, measure, values[k], med, z, rel))
    return found


@dataclass(frozen=True)
class Verdict:
    """What an audit names: faulty nodes (with the outliers that name them) and faulty links."""

    nodes: dict[str, list[Outlier]]
    links: dict[tuple[str, str], list[Outlier]]  # (node, rail) -> outliers

    def as_dict(self) -> dict:
        return {"nodes": {n: [o.as_dict() for o in os_] for n, os_ in sorted(self.nodes.items())},
                "links": [{"node": n, "rail": r, "outliers": [o.as_dict() for o in os_]}
                          for (n, r), os_ in sorted(self.links.items())]}


def judge(compute_s: Mapping[str, float], links: Mapping[str, Mapping[str, Mapping[str, float]]],
          failed: Mapping[str, str] | None = None) -> Verdict:
    """The audit's verdict from its measures.

    ``compute_s``: node -> the compute check's time. ``links``: rail -> measure ("bandwidth_bps",
    "latency_s") -> node -> the median over that node's pairs on the rail. ``failed``: node ->
    why a check failed outright (a wrong checksum, a probe that died): always named."""
    nodes: dict[str, list[Outlier]] = {}
    for o in outliers(compute_s, "compute_s"):
        nodes.setdefault(o.key, []).append(o)
    per_link: dict[tuple[str, str], list[Outlier]] = {}
    for rail, measures in sorted(links.items()):
        for measure, by_node in sorted(measures.items()):
            for o in outliers(by_node, measure):
                per_link.setdefault((o.key, rail), []).append(o)
    rails = set(links)
    for node in {n for n, _ in per_link}:
        bad = {r for n, r in per_link if n == node}
        if node in nodes or (len(rails) > 1 and bad == rails):
            # a node fault: every rail (or its compute) is slow, so the links say nothing of their own
            for r in bad:
                nodes.setdefault(node, []).extend(per_link.pop((node, r)))
    for node, why in (failed or {}).items():
        nodes.setdefault(node, []).append(Outlier(node, f"failed: {why}", float("nan"), float("nan"),
                                                  float("inf"), float("inf")))
    return Verdict(nodes, per_link)
