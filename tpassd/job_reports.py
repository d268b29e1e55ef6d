"""The job summaries this tpassd serves on /metrics: what each job's coordinator sent in its last
``tpassd.job_metrics`` request (torchpass/job_metrics.py), in memory only.

The control handler (a worker thread) puts, the metrics thread reads: one lock. A job is dropped
once its coordinator has been silent for STALE_AFTER_PUSHES of its own intervals (the job ended,
or its coordinator died); at most MAX_JOBS jobs are kept, and a new job beyond that is refused
(``unavailable``) rather than pushing out one that still reports.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from torchpass.errors import RemoteError
from torchpass.job_metrics import MAX_JOBS, STALE_AFTER_PUSHES, JobReport


class JobReports:
    def __init__(self, max_jobs: int = MAX_JOBS, clock: Callable[[], float] = time.monotonic):
        self.max_jobs = max_jobs
        self._clock = clock
        self._lock = threading.Lock()
        self._jobs: dict[int, tuple[float, JobReport]] = {}  # job -> (received at, report)

    def _expire(self, now: float) -> None:
        for job, (at, r) in list(self._jobs.items()):
            if now - at > STALE_AFTER_PUSHES * r.every_s:
                del self._jobs[job]

    def put(self, report: JobReport) -> int:
        """Keep ``report`` as its job's newest; the number of jobs kept."""
        with self._lock:
            now = self._clock()
            self._expire(now)
            if report.job_id not in self._jobs and len(self._jobs) >= self.max_jobs:
                raise RemoteError("unavailable", f"this tpassd serves metrics of {self.max_jobs} jobs already; "
                                                 f"job {report.job_id}'s are not kept")
            self._jobs[report.job_id] = (now, report)
            return len(self._jobs)

    def current(self) -> list[tuple[float, JobReport]]:
        """(seconds since it was received, report) of every job still reporting, by job id."""
        with self._lock:
            now = self._clock()
            self._expire(now)
            return [(max(0.0, now - at), r) for _, (at, r) in sorted(self._jobs.items())]
