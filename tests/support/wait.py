"""One poll-until for every test that waits on another thread, process or cluster."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def until(cond: Callable[[], T], what: str, timeout_s: float = 10.0, *, every: float = 0.01,
          diag: Callable[[], str] | None = None) -> T:
    """``cond()``'s first truthy value, asked every ``every`` s. After ``timeout_s`` an
    AssertionError names ``what`` and, when given, what ``diag()`` says of the state then."""
    end = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() >= end:
            break
        time.sleep(every)
    message = f"{what}: not within {timeout_s:g} s"
    if diag is not None:
        message += f"\n{diag()}"
    raise AssertionError(message)
