"""The coordinator's event log keeps the job's history when per-rank events fill it."""

from torchpass.coordinator import job_record as state
from torchpass.coordinator.job_record import JobState


def _register_wave(job: JobState, world: int, t: float) -> None:
    for r in range(world):
        job.record(t, "rank.registered", f"rank {r} on node{r // 8 + 1}", rank=r)


def test_a_second_registration_wave_pushes_out_old_registrations_not_the_migration_before_it():
    job = JobState(job_id=7)
    job.record(1.0, "coordinator.started", "coordinator for job 7")
    _register_wave(job, 8192, 2.0)
    job.record(3.0, "migration.completed", "node5 moved to node9")
    job.record(4.0, "job.requeuing", "node3 lost: left to Slurm")
    _register_wave(job, 8192, 5.0)  # the relaunch registers every rank again

    assert len(job.events) == state.EVENTS_KEPT
    job_events = [(e.seq, e.kind) for e in job.events if e.kind not in state.PER_RANK_KINDS]
    assert job_events == [(1, "coordinator.started"), (8194, "migration.completed"), (8195, "job.requeuing")]
    # the registrations dropped are the oldest: the first wave's ranks 0..6386
    first_wave = [e.data["rank"] for e in job.events if e.kind == "rank.registered" and e.seq < 8194]
    assert first_wave == list(range(8192 - (state.EVENTS_KEPT - 3 - 8192), 8192))
    assert job.events[-1].data == {"rank": 8191} and job.events[-1].seq == 16387


def test_with_no_per_rank_events_left_the_oldest_event_goes():
    job = JobState(job_id=7)
    for i in range(state.EVENTS_KEPT + 5):
        job.record(float(i), "snapshot.requested", f"snapshot {i}")
    assert len(job.events) == state.EVENTS_KEPT
    assert job.events[0].seq == 6 and job.events[-1].seq == state.EVENTS_KEPT + 5


def test_an_earlier_runs_log_is_carried_with_the_same_limit():
    job = JobState(job_id=7)
    earlier = [{"seq": i, "time": 0.0, "kind": "snapshot.requested", "message": "", "data": {}}
               for i in range(1, state.EVENTS_KEPT + 11)]
    job.carry_on(earlier)
    assert len(job.events) == state.EVENTS_KEPT and job.events[0].seq == 11
    assert job.record(1.0, "job.resuming", "resumed").seq == state.EVENTS_KEPT + 11
