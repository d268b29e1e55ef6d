"""Node health states: pure types shared by tpassd, the coordinator and tpassctl.

Four states, never a bool. ``UNKNOWN`` means "no data, or the check itself
failed": an NVML error is not a sick GPU, a missing sysfs file is not a
healthy link, and a silent publisher is not a failed node.

This module imports nothing but the standard library, so the coordinator's
decision core can use it without loading zmq or structlog; the subscriber
that follows tpassd publishers lives in torchpass.health.
"""

from __future__ import annotations

import enum


class State(str, enum.Enum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    FAILED = "failed"
    UNKNOWN = "unknown"

    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.value


HEALTHY, DEGRADED, FAILED, UNKNOWN = State.HEALTHY, State.DEGRADED, State.FAILED, State.UNKNOWN

# Order used to fold component states into a node state: the worst wins, and
# "we do not know" ranks above "healthy" but below a known problem.
_SEVERITY = {State.HEALTHY: 0, State.UNKNOWN: 1, State.DEGRADED: 2, State.FAILED: 3}


def worst(states) -> State:
    states = [State(s) for s in states]
    if not states:
        return State.UNKNOWN
    return max(states, key=_SEVERITY.__getitem__)


def severity(state: State | str) -> int:
    return _SEVERITY[State(state)]

__all__ = ["State", "HEALTHY", "DEGRADED", "FAILED", "UNKNOWN", "worst", "severity"]
