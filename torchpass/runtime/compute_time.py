"""Each rank's compute time per optimizer step: what the coordinator's fail-slow rule compares.

Synchronous training gives every rank the same step time: the fastest ranks wait in the
collectives for the slowest. So the step time says nothing about which rank is slow; the time a
rank spends outside its collectives does. ``ComputeMeter`` measures, per step, the wall time
during which the rank had no collective in flight (issued and not completed): its forward and
backward passes, its optimizer step, its data loading and whatever else its script does between
collectives. A rank that waits for a slow peer has a collective in flight while it waits, so the
wait is not counted; the slow rank's collectives complete as soon as it joins them, so nearly its
whole step counts.

How, and what it costs: one monotonic clock read when a collective is issued, and one in a
completion callback on the collective's future (run by the backend's thread when the
collective completes: ``Future.add_done_callback``), plus one at each step end: no system call
but the clock's (vDSO). Measured on the 2-core development VM under a load average of ~8: 19 us
more per collective (a 16-float gloo all-reduce on one rank, 42.9 against 23.6 us, medians of
ten interleaved runs of 2,000), a few collectives per DDP step of tens of milliseconds. Compute that
overlaps a collective in flight (DDP's backward pass while an earlier gradient bucket is
all-reduced) is not counted, the same way on every rank. A step during which the rank paused
(a migration, a whole-job snapshot) is not measured: the pause is neither compute nor a
collective; its figure is NOT_MEASURED (-1), which keeps the figures in step with the step count.
The first step has no figure (it includes the model's and DDP's set-up).

The values go to the coordinator in ``rank.progress`` (``compute_s``, ``compute_step``; wire.py):
the per-step figures of the steps ended since the last report that was answered, at most
REPORT_MAX of them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

# Per-step figures kept for the next report: at 0.5 s between reports, 64 steps is 128 steps a
# second, faster than any step of a job worth protecting; older ones are dropped.
REPORT_MAX = 64
# Figures are sent to 0.1 ms: the rule compares steps of milliseconds at the least.
DIGITS = 4
# The figure of a step that paused: it keeps the figures in step with the step count.
NOT_MEASURED = -1.0


class ComputeMeter:
    """Compute time per step of one rank (see the module docstring). The training thread calls
    ``issued`` and ``step_ended``; the backend's threads call the completion callbacks; the
    control thread calls ``pending`` and ``sent``. One lock, held for a few assignments."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight = 0
        # A step end forgets collectives still in flight (a backend's Work that never reports
        # completion, gloo's reduce_scatter_tensor): their late callbacks belong to an older epoch.
        self._epoch = 0
        self._idle_since: float | None = None  # no collective in flight since then (None: one is)
        self._compute = 0.0  # this step's time with no collective in flight, so far
        self._step_started: float | None = None  # the previous step's end (None: none measured yet)
        self._skip = False  # this step paused: not measured
        self.steps = 0  # step ends seen
        self._figures: deque[tuple[int, float]] = deque(maxlen=REPORT_MAX)  # (step, compute_s)

    def issued(self, work) -> None:
        """A collective was issued and returned ``work`` (a torch Work)."""
        now = self._clock()
        with self._lock:
            if self._in_flight == 0 and self._idle_since is not None:
                self._compute += now - self._idle_since
            self._idle_since = None
            self._in_flight += 1
            epoch = self._epoch
        try:
            work.get_future().add_done_callback(lambda _f, e=epoch: self._completed(e))
        except Exception:  # noqa: BLE001 - a Work without a future: count it done at once
            self._completed(epoch)

    def _completed(self, epoch: int) -> None:
        now = self._clock()
        with self._lock:
            if epoch != self._epoch or self._in_flight <= 0:
                return
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle_since = now

    def paused(self) -> None:
        """The rank paused in this step (a migration or a snapshot): the step is not measured."""
        with self._lock:
            self._skip = True

    def step_ended(self) -> None:
        """An optimizer step ended: its compute time is recorded (unless it is not measured)."""
        now = self._clock()
        with self._lock:
            if self._in_flight == 0 and self._idle_since is not None:
                self._compute += now - self._idle_since
            self.steps += 1
            if self._step_started is not None:
                self._figures.append((self.steps, NOT_MEASURED if self._skip else round(self._compute, DIGITS)))
            self._step_started = now
            self._compute, self._skip = 0.0, False
            self._idle_since = now
            if self._in_flight:
                self._in_flight, self._epoch = 0, self._epoch + 1

    def pending(self) -> dict:
        """The fields for the next rank.progress: ``compute_s`` (the per-step figures not yet sent,
        oldest first) and ``compute_step`` (the step count at the last of them); {} when none."""
        with self._lock:
            if not self._figures:
                return {}
            return {"compute_s": [c for _, c in self._figures], "compute_step": self._figures[-1][0]}

    def sent(self, step: int) -> None:
        """The coordinator answered a report carrying the figures up to ``step``: drop them."""
        with self._lock:
            while self._figures and self._figures[0][0] <= step:
                self._figures.popleft()
