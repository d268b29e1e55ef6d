"""The job's summary for Prometheus (torchpass/job_metrics.py), built from the coordinator's own
record and sent to the batch host's tpassd every ``every_s`` seconds.

``JobMetrics`` folds the event log, each event once (by seq), into counts: the migrations and
whole-job snapshots by how they ended, and the pauses' lengths, from the same end events that
``tpassctl events`` shows; so a restarted coordinator, which carries the saved events on, counts
the job's earlier ones too. ``report`` adds what the decision state says now (ranks, the oldest
report, protection). Both run in the serve thread, which alone touches the job and the state.

``MetricsPusher`` is the thread that sends it: it asks the serve thread for a report
(``server.later``), then makes one ``tpassd.job_metrics`` request, munge-authenticated, over the
same tpassd control channel the executor uses. A failed send is logged once (and once when it
works again); the next interval sends a fresh report, never a backlog. The coordinator sends a
last one as it stops, so the job's last migration is counted.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import structlog

from torchpass.coordinator.job_record import Event
from torchpass.coordinator.model import CoordState
from torchpass.job_metrics import (
    MIGRATION_OUTCOMES,
    PUSH_EVERY_S,
    SNAPSHOT_OUTCOMES,
    JobReport,
    Pauses,
)

log = structlog.get_logger("torchpass.coordinator.job_metrics")

# A rerouted job's end events (decide_reroute.reroute_ended): each carries the pause's length.
REROUTE_ENDS = frozenset({"link.rerouted", "link.restored", "link.reroute_failed"})
SEND_TIMEOUT_S = 5.0
# The last report, sent as the coordinator stops: the plugin kills it stop_timeout (5 s by default)
# after asking it to stop, and the event log and the companion cancellations come first.
FINAL_SEND_TIMEOUT_S = 1.0
FINAL_JOIN_S = 0.5


class JobMetrics:
    def __init__(self) -> None:
        self.seen_seq = 0
        self.migrations: dict[str, int] = {}
        self.snapshots: dict[str, int] = {}
        self.pauses: dict[str, Pauses] = {}

    def observe(self, events: list[Event]) -> None:
        """Count the events newer than the last seen (the log is in seq order; only its new tail
        is read)."""
        new = []
        for e in reversed(events):
            if e.seq <= self.seen_seq:
                break
            new.append(e)
        for e in reversed(new):
            self._count(e.kind, e.data)
            self.seen_seq = e.seq

    def _count(self, kind: str, data: dict[str, Any]) -> None:
        if "migration" in data and ("phase_durations" in data or data.get("recovered")):
            # A migration's end: decide_migration._finish's event (its kind varies: job.stuck,
            # node.lost, spare.unavailable, migration.*), or a restarted coordinator's settling
            # of one (recovery_actions: migration.completed / migration.rolled_back, no outcome).
            outcome = data.get("outcome")
            if outcome is None and kind in ("migration.completed", "migration.rolled_back"):
                outcome = kind.split(".", 1)[1]
            if outcome in MIGRATION_OUTCOMES:
                outcome = str(outcome)
                self.migrations[outcome] = self.migrations.get(outcome, 0) + 1
                paused = (data.get("phase_durations") or {}).get("paused")
                if _seconds(paused) is not None:
                    self._pause("migration", paused)
        elif kind in ("snapshot.completed", "snapshot.failed"):
            outcome = "completed" if kind == "snapshot.completed" else data.get("outcome") or "failed"
            if outcome == "failed" and "pause_s" not in data and "step" not in data:
                outcome = "not_taken"  # refused when it was to start: nothing paused
            if outcome in SNAPSHOT_OUTCOMES:
                outcome = str(outcome)
                self.snapshots[outcome] = self.snapshots.get(outcome, 0) + 1
            if _seconds(data.get("pause_s")) is not None:
                self._pause("snapshot", data["pause_s"])
        elif kind in REROUTE_ENDS and _seconds(data.get("pause_s")) is not None:
            self._pause("reroute", data["pause_s"])

    def _pause(self, kind: str, seconds: float) -> None:
        self.pauses[kind] = self.pauses.get(kind, Pauses()).add(float(seconds))

    def report(self, job_id: int, state: CoordState, now: float, every_s: float) -> JobReport:
        """The summary now (``now``: the clock of the ranks' last_report)."""
        ages = [now - rv.last_report for rv in state.ranks.values()]
        return JobReport(job_id=job_id, every_s=every_s, ranks_registered=len(state.ranks),
                         ranks_expected=state.world_size or 0,
                         oldest_report_age_s=round(max(0.0, *ages), 3) if ages else 0.0,
                         unprotected=state.job_unprotected is not None, migrations=dict(self.migrations),
                         snapshots=dict(self.snapshots), pauses=dict(self.pauses))


def _seconds(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 else None


class MetricsPusher:
    """Every ``every_s``: a report from the serve thread (``build`` run through ``later``), sent
    with ``send(body)``. ``close()`` stops it."""

    def __init__(self, build: Callable[[], JobReport], later: Callable[[Callable[[], None]], None],
                 send: Callable[[dict[str, Any], float], Any], every_s: float = PUSH_EVERY_S):
        self._build, self._later, self._send = build, later, send
        self.every_s = every_s
        self.sent = 0
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="job-metrics", daemon=True)

    def start(self) -> MetricsPusher:
        self._thread.start()
        return self

    def push_once(self, timeout_s: float = SEND_TIMEOUT_S) -> bool:
        box: queue.Queue[JobReport | BaseException] = queue.Queue(1)

        def build() -> None:
            try:
                box.put(self._build())
            except Exception as exc:  # noqa: BLE001 - handed to the pusher, which logs it
                box.put(exc)

        self._later(build)
        try:
            got = box.get(timeout=self.every_s)
        except queue.Empty:
            return self._failed("the serve thread did not build a report within an interval")
        if isinstance(got, BaseException):
            return self._failed(f"building the report failed: {got}")
        try:
            self._send(got.to_body(), timeout_s)
        except Exception as exc:  # noqa: BLE001 - the node's tpassd may be down or refuse: said once
            return self._failed(str(exc))
        self.sent += 1
        if self.last_error is not None:
            log.info("job metrics reach tpassd again", after=self.last_error)
            self.last_error = None
        return True

    def _failed(self, why: str) -> bool:
        if why != self.last_error:
            log.warning("job metrics not sent to tpassd; Prometheus sees none for this job until they are",
                        error=why)
        self.last_error = why
        return False

    def _run(self) -> None:
        while True:  # the first at once: a scrape soon after the job starts sees it
            self.push_once()
            if self._stop.wait(self.every_s):
                return

    def close(self, final: bool = False) -> None:
        """Stop. ``final``: then send one last report, built here (the serve loop has ended, so
        nothing else touches the job): what the job did in its last interval, which tpassd serves
        until it drops the job, STALE_AFTER_PUSHES intervals later. None when a send is still in
        flight after FINAL_JOIN_S: that one is the last (the whole close stays well inside the
        plugin's 5 s)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=FINAL_JOIN_S)
        if final and not self._thread.is_alive():  # a send still in flight: that one is the last
            self._later = lambda fn: fn()
            self.push_once(FINAL_SEND_TIMEOUT_S)


def batch_host(env: dict[str, str], slurm_job: Callable[[], Any]) -> str | None:
    """The node the coordinator runs on, as Slurm names it: SLURMD_NODENAME, else the job's
    batch host as slurmctld says (None: neither)."""
    node = env.get("SLURMD_NODENAME")
    if node:
        return node
    try:
        info = slurm_job()
    except Exception:  # noqa: BLE001 - no Slurm answer: no metrics, said by the caller
        return None
    return (info.batch_host or None) if info is not None else None
