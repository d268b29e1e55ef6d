"""The coordinator's driver: owns the decision state (``model.CoordState``), applies every input
and executor outcome with ``machine.apply``, calls ``decide`` and hands the actions
(``contract``) to the ``Executor``. Everything here runs in the coordinator's serve thread:
handlers call ``Driver.feed``; the executor's workers only ``post`` outcomes to a queue, which
the serve loop drains (``Driver.pump``). The serve thread lets the executor record what an
outcome tells it (``Executor.observe``) before ``machine.apply`` sees it, so handlers, workers
and the decision loop never race.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import structlog

from torchpass.coordinator import contract as ct
from torchpass.coordinator import decide as dc
from torchpass.coordinator import machine as mc
from torchpass.coordinator.decide_snapshot import periodic_snapshot_due
from torchpass.coordinator.executor import Executor
from torchpass.coordinator.job_record import JobState
from torchpass.coordinator.migration_actions import AbortsFinished
from torchpass.coordinator.model import CoordState, SpareHow
from torchpass.coordinator.policy import CoordinatorPolicy

log = structlog.get_logger("torchpass.coordinator.executor")


# Driver.pump: with nothing new, decide (and read the health view) this often; after progress
# reports only, at most this often (a report changes a rank's pace and stall clock, which are
# read in seconds, not milliseconds).
IDLE_TICK_S = 0.2
PROGRESS_TICK_S = 0.05
HEALTH_POLL_S = 0.1  # the health view is read at most this often (each read copies every node's)


def _ready_marks(st: CoordState) -> tuple[float | None, float | None]:
    return (st.migration.ready_at if st.migration is not None else None,
            st.snapshot.ready_at if st.snapshot is not None else None)


def _routine_ack(before: CoordState, after: CoordState, outcome: Any) -> bool:
    """A rank's acknowledgment that completed nothing: decided on the progress tick, like a progress
    report, not at the end of its batch (a pause of 8,192 ranks brings 16,384 of them).
    A refused or unprotected pause, and the acknowledgment that completes the phase, are decided
    on at once."""
    if isinstance(outcome, (mc.Quiesced, mc.Resumed)) or (
            isinstance(outcome, mc.Armed) and outcome.accepted and not outcome.unprotected):
        return _ready_marks(before) == _ready_marks(after)
    return False


class Driver:
    """Owns the decision state; everything here runs in the serve thread."""

    def __init__(self, job: JobState, policy: CoordinatorPolicy, executor: Executor | None = None, *,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 health: Any = None, spares: tuple[str, ...] = (), initial: CoordState | None = None):
        self.job = job
        self.policy = policy
        self.clock = clock
        self.wall = wall
        # initial: a job resumed after `tpassctl snapshot --stop` (decide.resumed_from_stop)
        self.state = initial if initial is not None else CoordState(job_id=job.job_id)
        self.reasons = mc.ReasonLog()
        self.queue: queue.Queue = queue.Queue()
        self.executor = executor
        self.health = health
        self._fed_health: dict[str, tuple] = {}
        self._next_decide = 0.0
        self._owned: dict | None = None  # the ranks dict of a batch (begin_batch), written in place
        self._batch_fed = False  # an outcome was fed during the batch: decide at its end
        self._progress_fed = False  # progress reports applied since the last decision
        self._last_decide = float("-inf")
        self._next_health = 0.0
        self._health_news = False  # health_changed(): a node's state changed since the last poll
        self._snapshots = 0  # snapshots asked of this coordinator (accept_snapshot)
        # recovery.InFlightWriter: what is paused goes to disk before the actions that pause it run,
        # so that a coordinator restarted after this one died can settle it (None: not kept).
        self.in_flight: Any = None
        self._waker: Callable[[], None] | None = None  # the serve loop's wake-up (set_waker)
        for s in spares:
            self.state = mc.apply(self.state, ct.SpareAdded(s, SpareHow.HOT), clock())

    def set_waker(self, waker: Callable[[], None] | None) -> None:
        """What post() and health_changed() call to wake the serve loop (CoordinatorServer.wake)."""
        self._waker = waker

    def _wake(self) -> None:
        waker = self._waker
        if waker is not None:
            waker()

    def post(self, outcome: Any) -> None:
        """Thread-safe: queue an outcome for the serve thread, and wake it."""
        self.queue.put(outcome)
        self._wake()

    def feed(self, outcome: Any) -> None:
        """Apply ``outcome`` and decide now; within a batch (begin_batch) decide once at its end."""
        before = self.state
        self.state = mc.apply(before, outcome, self.clock(), owned=self._owned)
        if self._owned is None:
            self.decide()
        elif isinstance(outcome, mc.RankProgress) or _routine_ack(before, self.state, outcome):
            self._progress_fed = True  # decided on the next progress tick (pump)
        else:
            self._batch_fed = True

    def begin_batch(self) -> None:
        """The server read a batch of messages: their outcomes apply to one private copy of the
        ranks (machine.apply ``owned``), and end_batch() decides once for all of them."""
        if self._owned is None:
            self._own_ranks()
            self._batch_fed = False

    def _own_ranks(self) -> None:
        """A batch begins: its outcomes write into a private copy of the ranks and of the pause's
        or resume's acknowledgment sets (machine.thaw_acks) until _release_ranks()."""
        st = self.state
        self.state = mc.thaw_acks(st.carry_views(replace(st, ranks=dict(st.ranks)), copied_ranks=True))
        self._owned = self.state.ranks

    def _release_ranks(self) -> None:
        self._owned = None
        self.state = mc.freeze_acks(self.state)

    def end_batch(self) -> None:
        """Stop writing into the batch's ranks, then pump (drain, health, decide once)."""
        self._release_ranks()
        fed, self._batch_fed = self._batch_fed, False
        self.pump(force=fed)

    def decide(self) -> None:
        now = self.clock()
        if periodic_snapshot_due(now, self.state, self.policy):
            self._periodic_snapshot()
        d = dc.decide(now, self.state, self.policy)
        self.state = self.state.carry_views(d.state)
        if self.reasons.changed(d.reason):
            log.info("decision", job_id=self.job.job_id, reason=d.reason)
        if self.in_flight is not None:
            try:
                self.in_flight.note(self.state)
            except OSError as exc:
                log.warning("cannot save the in-flight record", error=str(exc))
        for a in d.actions:
            if self.executor is not None:
                self.executor.perform(a, self.state)

    def accept_operator(self, node: str, to: str | None) -> str:
        self.state, mid = mc.accept_operator(self.state, node, to, self.clock())
        return mid

    def accept_snapshot(self, wall: float, trigger: str = "operator", stop: bool = False) -> str:
        """Queue a whole-job snapshot (OperatorRejected if refused; ``stop``: then hold the job); its
        id: the UTC time asked, and a count that keeps two ids of one second apart."""
        self._snapshots += 1
        sid = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(wall))}-{self._snapshots}"
        self.state = mc.accept_snapshot(self.state, sid, self.clock(), trigger, stop=stop)
        return sid

    def _periodic_snapshot(self) -> None:
        """The policy's snapshot_every_s has passed (decide.periodic_snapshot_due): queue one."""
        every = self.policy.snapshot_every_s
        try:
            sid = self.accept_snapshot(self.wall(), trigger="periodic")
        except mc.OperatorRejected as exc:  # due() checked the same conditions: not expected
            log.warning("periodic snapshot refused", job_id=self.job.job_id, error=str(exc))
            return
        self.job.record(self.wall(), "snapshot.requested", f"snapshot {sid}: periodic, every {every:g}s of training",
                        snapshot=sid, trigger="periodic", every_s=every)

    def health_changed(self) -> None:
        """Any thread (the health subscriber's on_change): a node's state changed. The next pump
        reads the health view and decides at once, instead of at its next health poll
        (HEALTH_POLL_S, or the idle tick): a fault reaches decide in one pass of the serve loop."""
        self._health_news = True
        self._wake()

    def health_news(self) -> bool:
        """A node's state changed and no decision has read it yet (the server then ends its batch
        of messages early: at 8,192 ranks a batch of 512 takes the serve thread 0.1-0.3 s)."""
        return self._health_news

    def _poll_health(self) -> None:
        if self.health is None:
            return
        silent = []
        # Rail states only for a job with data rails (decide_reroute): others are fed as before.
        rails = self.health.rails_brief() if self.state.job_rails else {}
        for node, (state, reasons, age) in self.health.brief().items():
            reachable = age is not None and age < 10.0
            key = (state, reasons, reachable, rails.get(node, ()))
            if self._fed_health.get(node) != key:
                self._fed_health[node] = key
                self.state = mc.apply(self.state, ct.NodeHealthChanged(node, state, reasons, reachable,
                                                                      rails.get(node, ())), self.clock())
            if not reachable and state != "failed":
                silent.append(node)
        # A node lost outright (power, kernel) has a silent tpassd: slurmctld confirms it or not.
        if not silent:
            return
        lost = set(silent).intersection(self.state.rank_nodes()).difference(self.state.handed)
        if lost and self.executor is not None:
            self.executor.check_silent(lost)

    def _drain(self) -> bool:
        """Apply every posted outcome (the executor sees each first); True if any but a progress
        report reached the state (progress reports: decided on the progress tick)."""
        fed = False
        while True:
            try:
                outcome = self.queue.get_nowait()
            except queue.Empty:
                return fed
            if self.executor is not None and self.executor.observe(outcome):
                continue
            if isinstance(outcome, AbortsFinished):
                continue  # no executor to act on it
            self.state = mc.apply(self.state, outcome, self.clock(), owned=self._owned)
            if isinstance(outcome, mc.RankProgress):
                self._progress_fed = True
            else:
                fed = True

    def pump(self, force: bool = False) -> None:
        """Drain posted outcomes, follow health, decide on a tick (or when ``force`` or anything
        was drained: once for all of them)."""
        if self._owned is None and self.queue.qsize() > 1:  # one copy of the ranks for all of them
            self._own_ranks()
            try:
                fed = self._drain()
            finally:
                self._release_ranks()
        else:
            fed = self._drain()
        fed = fed or force
        now = self.clock()
        news, self._health_news = self._health_news, False
        # Progress reports are many (every rank every 0.5 s) and urgent to nobody: they are decided
        # on at most every PROGRESS_TICK_S, everything else at once, and nothing new every 0.2 s.
        if self._progress_fed and now >= self._last_decide + PROGRESS_TICK_S:
            fed = True
        if fed or news or now >= self._next_decide:
            if news or now >= self._next_health:  # the health view costs a pass over every node
                self._poll_health()
                self._next_health = now + HEALTH_POLL_S
            self._next_decide = now + IDLE_TICK_S
            self._last_decide = now
            self._progress_fed = False
            self.decide()

    def close(self) -> None:
        """The serve loop ends: record outcomes still queued (a companion granted just now), then
        stop the executor's restore steps and cancel its companion allocations. The serve loop
        ends with the job: a migration that was only releasing its source node is recorded as
        complete (decide.job_ended), not lost with the coordinator."""
        self._drain()
        d = dc.job_ended(self.clock(), self.state, self.policy)
        self.state = self.state.carry_views(d.state)
        if self.executor is not None:
            for a in d.actions:  # events only: nothing new starts at the end
                self.executor.perform(a, self.state)
            self.executor.close()
