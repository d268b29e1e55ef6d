"""A job's summary for Prometheus: the coordinator's fold of its event log, the report's checks
(torchpass/job_metrics.py), tpassd's store (caps, stale jobs) and its rendering with and without
job_id, and the coordinator's pusher. The end-to-end path (a real tpassd, munge, promtool) is
test_prometheus.py."""

import threading
import time

import pytest
from structlog.testing import capture_logs

from support.wait import until
from torchpass.coordinator.job_metrics import (
    FINAL_JOIN_S,
    FINAL_SEND_TIMEOUT_S,
    SEND_TIMEOUT_S,
    JobMetrics,
    MetricsPusher,
    batch_host,
)
from torchpass.coordinator.job_record import JobState
from torchpass.coordinator.model import CoordState, RankView
from torchpass.coordinator.phases import Result
from torchpass.coordinator.snapshot_phases import SnapResult
from torchpass.errors import RemoteError
from torchpass.job_metrics import (
    MAX_BODY_BYTES,
    MIGRATION_OUTCOMES,
    PAUSE_BUCKETS_S,
    SNAPSHOT_OUTCOMES,
    JobReport,
    Pauses,
    ReportError,
    parse,
)
from tpassd.job_reports import JobReports
from tpassd.metrics import render_jobs


def events() -> JobState:
    job = JobState(job_id=7)
    job.record(0, "migration.started", "m1", migration="m1", node="n3")
    job.record(1, "migration.completed", "", migration="m1", outcome=Result.COMPLETED,
               phase_durations={"paused": 0.6})
    job.record(2, "spare.unavailable", "", migration="m2", outcome=Result.NO_SPARE, phase_durations={"total": 1})
    job.record(3, "job.stuck", "", migration="m3", outcome=Result.STUCK, phase_durations={"paused": 400.0})
    job.record(4, "migration.rolled_back", "", migration="m4", node="n5", recovered=True)  # a restart settled it
    job.record(5, "snapshot.completed", "", snapshot="s1", step=3, pause_s=0.4)
    job.record(6, "snapshot.failed", "", snapshot="s2", why="a migration runs")  # not taken
    job.record(7, "snapshot.failed", "", snapshot="s3", step=9, pause_s=1.2, why="dump failed")
    job.record(8, "snapshot.failed", "", snapshot="s4", why="bug", outcome=SnapResult.ABORTED)
    job.record(9, "link.rerouted", "", snapshot="r1", pause_s=0.3)
    job.record(10, "rank.registered", "", rank=0)
    return job


def test_the_fold_counts_each_end_event_once_by_outcome_with_its_pause():
    job = events()
    m = JobMetrics()
    m.observe(job.events)
    m.observe(job.events)  # again: nothing new
    assert m.migrations == {"completed": 1, "no_spare": 1, "stuck": 1, "rolled_back": 1}
    assert m.snapshots == {"completed": 1, "not_taken": 1, "failed": 1, "aborted": 1}
    assert m.pauses["migration"].count == 2 and m.pauses["migration"].sum_s == 400.6
    assert m.pauses["migration"].buckets == (0, 0, 1, 1, 1, 1, 1, 1, 1)  # 0.6 s <= 1 s; 400 s over every bound
    assert m.pauses["snapshot"].count == 2 and m.pauses["reroute"].count == 1
    job.record(11, "migration.completed", "", migration="m5", outcome="completed", phase_durations={"paused": 1.0})
    m.observe(job.events)
    assert m.migrations["completed"] == 2


def test_the_report_says_ranks_the_oldest_report_and_protection():
    ranks = {r: RankView(rank=r, node="n1", last_report=100.0 - 10 * r) for r in range(3)}
    st = CoordState(job_id=7, world_size=4, ranks=ranks, job_unprotected="rank 1 unprotected: subgroup")
    r = JobMetrics().report(7, st, 100.0, 15.0)
    assert (r.ranks_registered, r.ranks_expected, r.oldest_report_age_s, r.unprotected) == (3, 4, 20.0, True)
    assert JobMetrics().report(7, CoordState(job_id=7), 100.0, 15.0).oldest_report_age_s == 0.0


def test_the_outcome_tables_are_the_coordinators():
    assert MIGRATION_OUTCOMES == tuple(r.value for r in Result)
    assert set(SNAPSHOT_OUTCOMES) <= {r.value for r in SnapResult}


def report(job_id=7, **over) -> dict:
    m = JobMetrics()
    m.observe(events().events)
    body = m.report(job_id, CoordState(job_id=job_id, world_size=2), 0.0, 15.0).to_body()
    body.update(over)
    return body


def test_a_report_round_trips_and_anything_unknown_or_out_of_range_is_refused():
    assert parse(report()).to_body() == report()
    bad = [
        ({**report(), "node": "n1"}, "unknown ['node']"),
        ({k: v for k, v in report().items() if k != "pauses"}, "missing ['pauses']"),
        (report(migrations={"completed": 1, "teleported": 1}), "teleported"),
        (report(snapshots={"completed": -1}), "snapshots.completed"),
        (report(pauses={"nap": {"buckets": [0] * len(PAUSE_BUCKETS_S), "count": 0, "sum_s": 0}}), "nap"),
        (report(pauses={"migration": {"buckets": [2] + [1] * (len(PAUSE_BUCKETS_S) - 1), "count": 2,
                                        "sum_s": 1}}), "must not decrease"),
        (report(pauses={"migration": {"buckets": [0] * len(PAUSE_BUCKETS_S), "count": 0, "sum_s": 0,
                                        "ranks": {}}}), "buckets, count and sum_s"),
        (report(ranks_registered=True), "ranks_registered"),
        (report(every_s=0.01), "every_s"),
        (report(oldest_report_age_s=float("nan")), "oldest_report_age_s"),
        (report(unprotected=1), "unprotected"),
        (report(migrations={"completed": 1, **{f"x{i}": 1 for i in range(600)}}), f"at most {MAX_BODY_BYTES}"),
    ]
    for body, why in bad:
        with pytest.raises(ReportError) as ei:
            parse(body)
        assert why in str(ei.value), (why, str(ei.value))


def test_tpassd_keeps_at_most_its_cap_and_forgets_a_job_whose_coordinator_fell_silent():
    now = [0.0]
    store = JobReports(max_jobs=2, clock=lambda: now[0])
    store.put(parse(report(1)))
    store.put(parse(report(2)))
    with pytest.raises(RemoteError) as ei:
        store.put(parse(report(3)))
    assert ei.value.code == "unavailable"
    assert store.put(parse(report(2))) == 2  # a job already kept still reports
    now[0] = 59.0  # 4 intervals of 15 s: job 1 is still kept
    assert [r.job_id for _, r in store.current()] == [1, 2]
    now[0] = 61.0
    assert store.current() == []  # both silent for over 60 s
    assert store.put(parse(report(3))) == 1


def test_without_job_labels_the_jobs_are_summed_and_the_oldest_age_is_the_largest():
    a = JobReport(1, 15.0, 4, 8, 2.0, False, {"completed": 1}, {}, {"migration": Pauses().add(0.6)})
    b = JobReport(2, 15.0, 2, 2, 5.0, True, {"completed": 2}, {"failed": 1}, {"migration": Pauses().add(40.0)})
    fams = {f.name: f for f in render_jobs([(1.0, a), (0.0, b)], job_labels=False)}
    value = {f: [(s.name, s.labels, s.value) for s in fams[f].samples] for f in fams}
    assert value["tpassd_job_ranks_registered"] == [("tpassd_job_ranks_registered", {}, 6)]
    assert value["tpassd_job_oldest_report_age_seconds"][0][2] == 5.0
    assert value["tpassd_job_unprotected"][0][2] == 1
    assert ("tpassd_job_migrations_total", {"outcome": "completed"}, 3) in value["tpassd_job_migrations"]
    assert ("tpassd_job_pause_seconds_count", {"kind": "migration"}, 2.0) in value["tpassd_job_pause_seconds"]
    labelled = {f.name: f for f in render_jobs([(1.0, a), (0.0, b)], job_labels=True)}
    ages = {s.labels["job_id"]: s.value for s in labelled["tpassd_job_oldest_report_age_seconds"].samples}
    assert ages == {"1": 3.0, "2": 5.0}  # the coordinator's age plus the time since it was sent


def test_the_pusher_sends_a_report_built_in_the_serve_thread_and_says_a_failure_once():
    sent, fail = [], [True]

    def send(body, timeout_s):
        if fail[0]:
            raise RemoteError("unavailable", "tpassd is down")
        sent.append(body)

    p = MetricsPusher(lambda: JobReport(7, 15.0, 1, 1, 0.0, False), later=lambda fn: fn(), send=send, every_s=15.0)
    with capture_logs() as logs:
        assert not p.push_once() and not p.push_once()
        fail[0] = False
        assert p.push_once()
    assert [x["event"] for x in logs] == [
        "job metrics not sent to tpassd; Prometheus sees none for this job until they are",
        "job metrics reach tpassd again"]
    assert sent == [JobReport(7, 15.0, 1, 1, 0.0, False).to_body()] and p.sent == 1


def test_closing_sends_a_last_report_quickly_and_none_while_one_is_in_flight():
    # The plugin kills the coordinator stop_timeout (5 s) after asking it to stop: closing the
    # pusher must cost well under a second, whatever tpassd does.
    timeouts, release = [], threading.Event()

    def send(body, timeout_s):
        timeouts.append(timeout_s)
        if len(timeouts) == 1 and hung[0]:
            release.wait(30)

    for in_flight in (False, True):
        timeouts.clear()
        hung = [in_flight]
        p = MetricsPusher(lambda: JobReport(7, 15.0, 1, 1, 0.0, False), later=lambda fn: fn(), send=send,
                          every_s=60.0).start()
        until(lambda: timeouts, "the first push", 5.0)
        started = time.monotonic()
        p.close(final=True)
        took = time.monotonic() - started
        assert took < FINAL_JOIN_S + 0.5, took
        assert timeouts == ([SEND_TIMEOUT_S] if in_flight else [SEND_TIMEOUT_S, FINAL_SEND_TIMEOUT_S]), timeouts
    release.set()


def test_the_batch_host_is_slurmds_name_else_slurmctlds_word():
    class Info:
        batch_host = "n9"

    assert batch_host({"SLURMD_NODENAME": "n1"}, lambda: Info()) == "n1"
    assert batch_host({}, lambda: Info()) == "n9"
    assert batch_host({}, lambda: None) is None
