"""The collector interface (after node_exporter's collector/collector.go).

A collector reads one health source and returns one ComponentReading per
component it knows (``gpu0``, ``ib:mlx5_0/1``, ``host``). It reports the
outcome of each of its checks explicitly: ``None`` = the check ran, a string
= why it could not run. ``run_collector`` times the call and records whether
it succeeded; an exception becomes a failed CollectorResult, never a crash
and never "healthy".
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger("tpassd.collectors")

UNSUPPORTED = "unsupported"  # a check result: the hardware does not have it (not a failure)


@dataclass
class ComponentReading:
    kind: str  # "gpu" | "ib" | "host"
    metrics: dict[str, Any] = field(default_factory=dict)
    # check name -> None (ran), UNSUPPORTED, or the error text (check failed)
    checks: dict[str, str | None] = field(default_factory=dict)
    lost: bool = False  # the device is gone (NVML_ERROR_GPU_IS_LOST)
    # asynchronous events seen since the previous sample: {"kind", "t", "xid"?}
    events: list[dict[str, Any]] = field(default_factory=list)

    def failed_checks(self) -> dict[str, str]:
        return {k: v for k, v in self.checks.items() if v is not None and v != UNSUPPORTED}


@dataclass
class CollectorResult:
    name: str
    ok: bool
    duration_s: float
    error: str | None
    components: dict[str, ComponentReading]


class Collector(abc.ABC):
    """One health source. ``collect`` may raise; run_collector deals with it."""

    name: str = "?"
    kind: str = "?"

    @abc.abstractmethod
    def collect(self, now: float) -> dict[str, ComponentReading]: ...

    def start(self, wake: Callable[[], None]) -> None:  # noqa: B027 - optional hook
        """Start background work (e.g. an event thread); ``wake`` asks for a sample now."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop background work and release the source."""


def run_collector(
    collector: Collector, now: float, perf: Callable[[], float] = time.perf_counter
) -> CollectorResult:
    t0 = perf()
    try:
        comps = collector.collect(now)
    except Exception as exc:  # noqa: BLE001 - any failure of a check is "unknown"
        dt = perf() - t0
        log.warning("collector failed", collector=collector.name, error=f"{type(exc).__name__}: {exc}")
        return CollectorResult(collector.name, False, dt, f"{type(exc).__name__}: {exc}", {})
    return CollectorResult(collector.name, True, perf() - t0, None, comps)
