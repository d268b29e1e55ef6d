"""The coordinator over real ZeroMQ sockets on loopback, with an injected clock."""

import functools
import threading
import time

import pytest
import zmq

from support.fake_slurm import FakeSlurm
from support.wait import until
from torchpass import auth, jobauth, wire, zmqio
from torchpass.coordinator import contract as ct
from torchpass.coordinator import server as srv
from torchpass.coordinator.driver import Driver
from torchpass.coordinator.job_record import JobState
from torchpass.coordinator.phases import Phase
from torchpass.coordinator.policy import CoordinatorPolicy
from torchpass.coordinator.server import CoordinatorServer, Facts, job_liveness_check
from torchpass.errors import RemoteError, SlurmError, UnreachableError
from torchpass.health_state import State
from torchpass.slurm.base import JobInfo


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.fixture
def served():
    clock = Clock()
    server = CoordinatorServer(JobState(job_id=42, spares=1), bind_address="127.0.0.1", clock=clock, wall=lambda: 1e9)
    t = threading.Thread(target=server.serve, daemon=True)
    t.start()
    yield server, f"tcp://127.0.0.1:{server.port}", clock
    server.stop()
    t.join(5)
    assert not t.is_alive()


def req(ep, type_, body=None):
    return zmqio.request(ep, type_, body or {}, timeout_s=2, retries=0)


def test_ranks_register_report_and_show_in_status(served):
    server, ep, clock = served
    for rank in range(3):
        req(ep, "rank.register",
            {"job_id": 42, "rank": rank, "world_size": 3, "node": f"node{rank + 1}", "pid": 100 + rank})
    req(ep, "rank.progress", {"job_id": 42, "rank": 1, "step": 7, "collectives": 30})
    clock.t += 2.5
    st = req(ep, "job.status")
    assert st["registered_ranks"] == 3 and st["world_size"] == 3
    assert (st["min_step"], st["max_step"]) == (-1, 7)
    r1 = st["ranks"][1]
    assert (r1["node"], r1["pid"], r1["step"], r1["collectives"]) == ("node2", 101, 7, 30)
    assert r1["last_report_age_s"] == 2.5
    events = req(ep, "job.events")["events"]
    assert [e["kind"] for e in events] == ["rank.registered"] * 3


def test_inconsistent_or_foreign_requests_get_error_replies(served):
    _, ep, _ = served
    with pytest.raises(RemoteError) as exc:
        req(ep, "rank.register", {"job_id": 41, "rank": 0, "world_size": 2, "node": "n", "pid": 1})
    assert exc.value.code == "not_found"
    with pytest.raises(RemoteError) as exc:
        req(ep, "rank.register", {"job_id": 42, "rank": 5, "world_size": 2, "node": "n", "pid": 1})
    assert exc.value.code == "bad_request"
    with pytest.raises(RemoteError) as exc:
        req(ep, "rank.progress", {"job_id": 42, "rank": 0, "step": 1, "collectives": 1})
    assert exc.value.code == "not_found"


def test_garbage_gets_an_error_reply_and_the_server_keeps_serving(served):
    server, ep, _ = served
    ctx = zmq.Context.instance()
    for junk in [b"\x00\x01garbage", b'{"v":7,"id":"x"}', b"[]", b"x" * (wire.MAX_FRAME_BYTES + 10)]:
        s = ctx.socket(zmq.REQ)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(ep)
        s.send(junk)
        reply = wire.decode_reply(s.recv())
        assert not reply.ok and reply.code in ("bad_request", "unsupported_version")
        s.close()
    # Far over the socket's MAXMSGSIZE ZeroMQ drops the connection: no reply, nothing breaks.
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(ep)
    s.send(b"y" * (3 * wire.MAX_FRAME_BYTES))
    assert s.poll(300) == 0
    s.close()
    assert req(ep, "job.status")["job_id"] == 42
    assert server.counters["malformed"] == 4


def test_unreachable_endpoint_times_out_with_a_clear_error():
    with pytest.raises(UnreachableError, match="no reply from tcp://127.0.0.1:9 to job.status after 2 tries"):
        zmqio.request("tcp://127.0.0.1:9", "job.status", {}, timeout_s=0.1, retries=1)


def _answering(answers) -> FakeSlurm:
    """Only the job() query the liveness tick makes; answers are scripted."""
    slurm = FakeSlurm()
    slurm.script("job", *answers)
    return slurm


def _job(state):
    return JobInfo(job_id=42, name="j", user="u", user_id=0, state=state, nodes=("node1",))


def test_liveness_tick_ends_the_coordinator_only_when_the_job_ends():
    tick = job_liveness_check(_answering([_job("RUNNING"), SlurmError("ctld down"), _job("RUNNING"),
                                         _job("COMPLETED")]), 42)
    assert [tick(), tick(), tick(), tick()] == [True, True, True, False]
    assert job_liveness_check(_answering([None]), 42)() is False


def test_slurmctld_down_for_long_never_ends_the_coordinator_and_says_so_once_each_way():
    clock = Clock()
    changes = []
    slurm = _answering([SlurmError("Unable to contact slurm controller")] * 60 + [_job("RUNNING"), _job("COMPLETED")])
    tick = job_liveness_check(slurm, 42, clock=clock, on_change=lambda ok, why: changes.append((ok, why)),
                              unavailable_after_s=15.0)
    alive = []
    for _ in range(60):  # 60 failed polls 5 s apart: 300 s, twice what used to end the coordinator
        alive.append(tick())
        clock.t += 5.0
    assert all(alive)
    assert len(changes) == 1 and changes[0][0] is False
    assert "no answer for 15 s" in changes[0][1] and "Unable to contact slurm controller" in changes[0][1]
    assert tick() is True and changes[-1] == (True, "")
    assert tick() is False and len(changes) == 2  # the job ended: now the coordinator exits


def test_a_slow_liveness_check_runs_beside_the_serve_loop_and_its_news_lands_in_the_serve_thread(served):
    """slurmctld queries can take seconds: requests are answered meanwhile; the outage event and
    the end of the job reach the server through later() and stop()."""
    import time as _time

    server, ep, _ = served
    release, calls = threading.Event(), []

    def check():
        calls.append(1)
        if len(calls) == 1:
            release.wait(5)  # a slow query
            server.later(lambda: server.note_slurm(False, "no answer for 15 s: down"))
            return True
        return False  # then the job has ended

    server.watch(check, 0.01)
    assert req(ep, "job.status")["job_id"] == 42  # answered while the check hangs
    release.set()
    deadline = _time.monotonic() + 5
    while not server._stop.is_set() and _time.monotonic() < deadline:
        _time.sleep(0.01)
    assert server._stop.is_set() and len(calls) == 2
    deadline = _time.monotonic() + 5
    while not server.job.events and _time.monotonic() < deadline:
        _time.sleep(0.01)
    assert [e.kind for e in server.job.events] == ["slurm.unavailable"]


def test_slurmctld_outage_counts_from_the_first_query_that_hung():
    clock = Clock()
    changes = []

    class Hanging:
        def job(self, job_id):
            clock.t += 10.0  # the query times out after 10 s
            raise SlurmError("scontrol did not finish in 10 s")

    tick = job_liveness_check(Hanging(), 42, clock=clock, on_change=lambda ok, why: changes.append(ok),
                              unavailable_after_s=15.0)
    assert tick() is True and changes == []  # 10 s without an answer
    clock.t += 1.0
    assert tick() is True and changes == [False]  # 21 s since the first query was sent (11 since it failed)


# ============================================================================
# An unprotected job ("do no harm"): the rank runtime says so in `unprotected`
# ============================================================================
@pytest.fixture
def driven(munge):
    """A coordinator with a decision driver (no executor): 3 ranks on node1..3, hot spare node4."""
    clock = Clock()
    job = JobState(job_id=42, spares=1)
    driver = Driver(job, CoordinatorPolicy(), clock=clock, spares=("node4",))
    for n in ("node1", "node2", "node3", "node4"):
        driver.feed(ct.NodeHealthChanged(n, State.HEALTHY))
    server = CoordinatorServer(job, bind_address="127.0.0.1", clock=clock, wall=lambda: 1e9, driver=driver,
                               munge_socket=munge.socket)
    t = threading.Thread(target=server.serve, daemon=True)
    t.start()
    ep = f"tcp://127.0.0.1:{server.port}"
    for rank in range(3):
        req(ep, "rank.register", {"job_id": 42, "rank": rank, "world_size": 3, "node": f"node{rank + 1}",
                                  "pid": 100 + rank})
    yield server, ep, munge
    server.stop()
    t.join(5)
    assert not t.is_alive()


WHY = "process group 'tp' (DeviceMesh) cannot be moved yet"


@pytest.mark.host  # a private munged
def test_a_rank_saying_unprotected_makes_the_job_unprotected_once_and_migrate_a_conflict(driven):
    server, ep, munge = driven
    assert req(ep, "job.status")["unprotected"] is None
    req(ep, "rank.progress", {"job_id": 42, "rank": 1, "step": 3, "collectives": 9})
    assert req(ep, "job.status")["unprotected"] is None
    req(ep, "rank.progress", {"job_id": 42, "rank": 1, "step": 4, "collectives": 12, "unprotected": WHY})
    req(ep, "rank.progress", {"job_id": 42, "rank": 1, "step": 5, "collectives": 15, "unprotected": WHY})
    req(ep, "rank.register", {"job_id": 42, "rank": 2, "world_size": 3, "node": "node3", "pid": 102,
                              "unprotected": "another reason"})
    st = req(ep, "job.status")
    assert st["unprotected"] == f"rank 1 unprotected: {WHY}"
    events = req(ep, "job.events")["events"]
    assert [e["kind"] for e in events] == ["rank.registered"] * 3 + ["job.unprotected"]
    assert events[-1]["message"] == f"rank 1 unprotected: {WHY}" and events[-1]["data"]["rank"] == 1
    body = {"node": "node2"}
    with pytest.raises(RemoteError) as exc:
        zmqio.request(ep, "job.migrate", body, timeout_s=2, retries=0,
                      auth=auth.credential_for("job.migrate", body, auth.job_target(42), munge.socket))
    assert exc.value.code == "conflict"
    assert f"job is unprotected: rank 1 unprotected: {WHY}" in str(exc.value)
    assert server.driver.state.migration is None and server.driver.state.operator_requests == ()


@pytest.mark.host  # a private munged
def test_a_site_allowed_torch_is_shown_in_status_and_the_job_stays_protected(driven):
    """A torch outside the runtime's tested range that the site allowed: the first rank's line is
    job.status's torch_override; the job is protected (the runtime patched it)."""
    _, ep, _ = driven
    assert req(ep, "job.status")["torch_override"] == ""
    why = "torch 2.11.0 is outside the tested range (2.13); patched because TORCHPASS_ALLOW_TORCH=2.11"
    req(ep, "rank.register", {"job_id": 42, "rank": 0, "world_size": 3, "node": "node1", "pid": 100,
                              "torch_override": why})
    req(ep, "rank.register", {"job_id": 42, "rank": 1, "world_size": 3, "node": "node2", "pid": 101,
                              "torch_override": "another"})
    st = req(ep, "job.status")
    assert st["torch_override"] == why and st["unprotected"] is None


@pytest.mark.host  # a private munged
def test_an_armed_refusal_saying_unprotected_rolls_the_pause_back_at_once(driven):
    server, ep, _ = driven
    done = threading.Event()
    # The driver is the serve thread's: the node degrades there (as the health subscriber's news would).
    server.later(lambda: (server.driver.feed(ct.NodeHealthChanged("node2", State.DEGRADED, ("gpu0: Xid 63",))),
                          done.set()))
    assert done.wait(5)
    m = server.driver.state.migration
    assert m is not None and m.phase == Phase.PAUSE
    req(ep, "rank.armed", {"job_id": 42, "rank": 0, "at": m.pause_at, "generation": m.generation,
                           "collectives": 5, "accepted": False, "unprotected": WHY})
    m = server.driver.state.migration
    assert m.phase == Phase.ROLLBACK and m.rollback_reason == f"the job is unprotected (rank 0 unprotected: {WHY})"
    assert m.rearms == 0
    assert req(ep, "job.status")["unprotected"] == f"rank 0 unprotected: {WHY}"


def test_replies_to_ranks_carry_backpressure_hints_that_grow_with_the_job_and_the_load(served):
    from torchpass.coordinator import server as srv

    server, ep, clock = served
    res = req(ep, "rank.register", {"job_id": 42, "rank": 0, "world_size": 3000, "node": "n1", "pid": 1})
    assert res["report_every_s"] == pytest.approx(3000 / srv.PROGRESS_BUDGET_PER_S, abs=1e-3)
    assert res["paused_every_s"] == pytest.approx(3000 / srv.PAUSED_BUDGET_PER_S, abs=1e-3)
    assert res["wait_max_s"] == pytest.approx(3000 / srv.PARKED_BUDGET_PER_S, abs=1e-3)  # long polls: longer waits
    # A fan-in of 3,000 acknowledgments: the last is answered after 3000 / FAN_IN_PER_S; a rank waits that too.
    assert res["reply_within_s"] == pytest.approx(wire.REPLY_WITHIN_MIN_S + 3000 / wire.FAN_IN_PER_S, abs=1e-3)
    assert "report_every_s" not in req(ep, "job.status")  # only rank.* replies

    t = [0.0]
    pace = srv.Pace(lambda: t[0])
    for _ in range(20):  # serving takes 90 % of the time: the intervals grow, up to the cap
        t[0] += 1.0
        pace.busy(0.9)
    assert pace.factor == srv.PACE_FACTOR_MAX
    assert pace.hint(1500)["report_every_s"] == pytest.approx(srv.PACE_FACTOR_MAX)
    assert pace.hint(100_000)["wait_max_s"] == srv.PARK_MAX_S  # bounded: the rank's time-out grows with it
    assert pace.hint(100_000)["reply_within_s"] == wire.REPLY_WITHIN_MAX_S
    for _ in range(20):  # idle again: back to the job's own size
        t[0] += 1.0
        pace.busy(0.05)
    assert pace.factor == 1.0
    assert pace.hint(None) == {}


def test_the_rank_side_honours_the_hints_within_bounds():
    from torchpass.runtime import control

    class PG:
        paused = False

    link = control.ControlLink(PG(), endpoint="tcp://127.0.0.1:1", job_id=1, rank=0, interval_s=0.5,
                               paused_interval_s=0.02)
    assert (link.every_s(), link.paused_every_s()) == (0.5, 0.02)
    link._handle({"report_every_s": 2.0, "paused_every_s": 0.3})
    assert (link.every_s(), link.paused_every_s()) == (2.0, 0.3)
    link._handle({"report_every_s": 0.1, "paused_every_s": 0.0})  # never more often than its own setting
    assert (link.every_s(), link.paused_every_s()) == (0.5, 0.02)
    link._handle({"report_every_s": 1e6, "paused_every_s": 1e6, "command": None})  # bounded
    assert link.every_s() == control.MAX_HINT_S and link.paused_every_s() == control.MAX_HINT_S
    link._handle({"report_every_s": "x"})  # not a number: ignored
    assert link.every_s() == control.MAX_HINT_S


# ============================================================================
# Long polls: a paused rank's poll waits at the coordinator for its command
# ============================================================================
class Commands:
    """What the serve loop reads of an executor: rank -> the command repeated until acknowledged."""

    def __init__(self):
        self.commands: dict[int, dict] = {}
        self.saves = 0  # save_events() calls: once when the last rank registered

    def command_for(self, rank):
        return self.commands.get(rank)

    def save_events(self):
        self.saves += 1

    def acknowledge(self, *a):
        pass


class CommandsDriver(Facts):
    """A driver that decides nothing: the test sets the commands (in the serve thread, by later())."""

    def __init__(self, job_id, clock):
        super().__init__(job_id, clock)
        self.executor = Commands()

    def begin_batch(self):
        pass

    def end_batch(self):
        pass

    def pump(self, force=False):
        pass

    def decide(self):
        pass

    def close(self):
        pass


RESUME = {"command": "resume", "generation": 3, "master_addr": "127.0.0.1", "master_port": 29500}


@pytest.fixture
def parking():
    """A coordinator serving ranks 0..3 of job 42 (world 4), whose commands the test sets."""
    clock = Clock()
    driver = CommandsDriver(42, clock)
    server = CoordinatorServer(JobState(job_id=42, spares=1), bind_address="127.0.0.1", clock=clock,
                               wall=lambda: 1e9, driver=driver)
    t = threading.Thread(target=server.serve, daemon=True)
    t.start()
    ep = f"tcp://127.0.0.1:{server.port}"
    for rank in range(4):
        res = req(ep, "rank.register", {"job_id": 42, "rank": rank, "world_size": 4, "node": "n1", "pid": rank})
        assert res["wait_max_s"] == srv.PARK_MIN_S  # it says it parks long polls (4 ranks: the shortest wait)
    socks: list[zmq.Socket] = []

    def dealer() -> zmq.Socket:
        socks.append(zmqio.dealer_socket(zmq.Context.instance(), ep))
        return socks[-1]

    yield server, ep, clock, dealer
    server.stop()
    t.join(5)
    assert not t.is_alive()
    for s in socks:
        s.close(linger=0)


def poll(sock, rank, wait_s=2.0) -> str:
    """Send rank's long poll on a DEALER socket; its request id."""
    id_ = wire.new_id()
    body = {"job_id": 42, "rank": rank, "step": 1, "collectives": 10}
    if wait_s is not None:
        body["wait_s"] = wait_s
    zmqio.send_request(sock, wire.encode("rank.progress", body, id=id_))
    return id_


def answer(sock, id_, timeout_s) -> dict | None:
    """The result of the reply to id_ within timeout_s, or None (no reply yet)."""
    end = time.monotonic() + timeout_s
    while (left := end - time.monotonic()) > 0:
        if sock.poll(int(left * 1000) + 1, zmq.POLLIN):
            reply = zmqio.recv_reply(sock, id_)
            if reply is not None:
                return reply.unwrap()
    return None


def in_serve_thread(server, fn) -> None:
    done = threading.Event()
    server.later(lambda: (fn(), done.set()))
    assert done.wait(5)


def test_a_parked_poll_gets_its_command_the_moment_it_is_set(parking):
    server, _, _, dealer = parking
    s = dealer()
    id_ = poll(s, 1)
    assert answer(s, id_, 0.3) is None  # no command: parked (the old coordinator answered at once)
    assert set(server._parked) == {1}
    set_at = time.monotonic()
    server.later(lambda: server.driver.executor.commands.__setitem__(1, dict(RESUME)))
    res = answer(s, id_, 1.5)  # wait_s is 2 s and the fake clock never moves: only the command answers
    took = time.monotonic() - set_at
    assert res is not None and res["command"] == RESUME, res
    assert took < 1.0, f"the command reached the parked poll {took:.3f} s after it was set"
    assert server._parked == {}


def test_a_poll_with_no_command_is_answered_after_its_wait(parking):
    server, _, clock, dealer = parking
    s = dealer()
    id_ = poll(s, 2, wait_s=1.0)
    assert answer(s, id_, 0.3) is None
    clock.t += 0.9
    assert answer(s, id_, 0.3) is None  # not yet due
    clock.t += 0.2
    res = answer(s, id_, 2.0)
    assert res is not None and "command" not in res and res["wait_max_s"] == srv.PARK_MIN_S
    assert server._parked == {}
    # A wait above the coordinator's wait_max_s is cut to it.
    id_ = poll(s, 2, wait_s=60.0)
    assert answer(s, id_, 0.3) is None
    clock.t += srv.PARK_MAX_S + 0.01
    assert answer(s, id_, 2.0) is not None


def test_a_newer_poll_of_the_same_rank_replaces_the_parked_one(parking):
    server, _, _, dealer = parking
    old, new = dealer(), dealer()  # the rank gave up and polls again (after a time-out: a new connection)
    id_old = poll(old, 3)
    assert answer(old, id_old, 0.3) is None
    id_new = poll(new, 3)
    res = answer(old, id_old, 1.0)  # answered at once, without a command: never two parked per rank
    assert res is not None and "command" not in res
    assert answer(new, id_new, 0.3) is None
    assert len(server._parked) == 1
    server.later(lambda: server.driver.executor.commands.__setitem__(3, dict(RESUME)))
    assert answer(new, id_new, 1.5)["command"] == RESUME
    assert answer(old, id_old, 0.3) is None  # nothing more for the given-up poll
    # Any other message of the rank (its client sends one request at a time) answers its parked poll.
    in_serve_thread(server, lambda: server.driver.executor.commands.clear())
    id_poll = poll(new, 3)
    assert answer(new, id_poll, 0.3) is None
    req_ = zmqio.Client(parking[1], timeout_s=2, retries=0)
    req_.request("rank.progress", {"job_id": 42, "rank": 3, "step": 2, "collectives": 11})
    req_.close()
    assert answer(new, id_poll, 1.0) is not None and server._parked == {}


def test_parked_polls_never_delay_the_other_requests(parking):
    server, ep, _, dealer = parking
    socks = [dealer() for _ in range(3)]
    ids = [poll(s, r) for r, s in enumerate(socks)]
    assert answer(socks[0], ids[0], 0.3) is None
    t0 = time.monotonic()
    assert req(ep, "job.status")["registered_ranks"] == 4
    res = req(ep, "rank.progress", {"job_id": 42, "rank": 3, "step": 5, "collectives": 20})  # no wait_s
    assert "command" not in res
    took = time.monotonic() - t0
    assert took < 1.5, f"two requests took {took:.3f} s beside 3 parked polls"
    assert set(server._parked) == {0, 1, 2}
    # One decision gives every parked rank its command: one batch of replies.
    in_serve_thread(server, lambda: server.driver.executor.commands.update({r: dict(RESUME) for r in range(3)}))
    assert [answer(s, i, 1.5)["command"] for s, i in zip(socks, ids)] == [RESUME] * 3


def signed_poll(sock, secret, rank) -> str:
    id_ = wire.new_id()
    body = {"job_id": 42, "rank": rank, "step": 1, "collectives": 10, "wait_s": 2.0}
    env = jobauth.JobSigner(secret).envelope("rank.progress", id_, body)
    zmqio.send_request(sock, wire.encode("rank.progress", body, id=id_, **env))
    return id_


def refusal(sock, id_) -> str:
    """The error code of the reply to id_, which must come within 2 s."""
    assert sock.poll(2000, zmq.POLLIN), "no reply within 2 s"
    reply = zmqio.recv_reply(sock, id_)
    with pytest.raises(RemoteError) as exc:
        reply.unwrap()
    return exc.value.code


def test_an_unsigned_or_foreign_poll_parks_nothing():
    secret = b"k" * 32
    server = CoordinatorServer(JobState(job_id=42, spares=1), bind_address="127.0.0.1", job_secret=secret,
                               driver=CommandsDriver(42, Clock()))
    t = threading.Thread(target=server.serve, daemon=True)
    t.start()
    ep = f"tcp://127.0.0.1:{server.port}"
    s = zmqio.dealer_socket(zmq.Context.instance(), ep)
    try:
        zmqio.request(ep, "rank.register", {"job_id": 42, "rank": 0, "world_size": 2, "node": "n", "pid": 1},
                      timeout_s=2, retries=0, auth=jobauth.JobSigner(secret))
        assert refusal(s, poll(s, 0)) == "unauthenticated"  # unsigned: refused at once
        assert refusal(s, signed_poll(s, secret, rank=1)) == "not_found"  # a rank that never registered
        assert server._parked == {} and server.counters.get("long_polls", 0) == 0
        id_ = signed_poll(s, secret, rank=0)  # the rank itself, signed: parked
        assert answer(s, id_, 0.3) is None and set(server._parked) == {0}
    finally:
        s.close(linger=0)
        server.stop()
        t.join(5)
    assert not t.is_alive()


def test_shutdown_answers_the_parked_polls(parking):
    server, _, _, dealer = parking
    s = dealer()
    id_ = poll(s, 0)
    assert answer(s, id_, 0.3) is None
    server.stop()
    res = answer(s, id_, 3.0)
    assert res is not None and "command" not in res


_until = functools.partial(until, what="the serve loop's state", timeout_s=5.0)


def test_the_coordinator_records_each_application_checkpoint_and_refuses_a_bad_outcome(served):
    """rank.checkpoint (torchpass.checkpoint, rank 0): one event per outcome (docs/checkpoint.md)."""
    _, ep, _ = served
    req(ep, "rank.register", {"job_id": 42, "rank": 0, "world_size": 1, "node": "node1", "pid": 7})
    req(ep, "rank.checkpoint", {"job_id": 42, "rank": 0, "outcome": "completed", "step": 100,
                                "path": "/shared/ckpt/step-000000100", "bytes": 5_000_000, "blocking_s": 0.02,
                                "write_s": 1.5, "waited_s": 0.0, "removed": [80]})
    req(ep, "rank.checkpoint", {"job_id": 42, "rank": 0, "outcome": "failed", "step": 200,
                                "path": "/shared/ckpt/step-000000200", "error": "OSError: No space left on device"})
    with pytest.raises(RemoteError) as exc:
        req(ep, "rank.checkpoint", {"job_id": 42, "rank": 0, "outcome": "maybe", "step": 1, "path": "/x"})
    assert exc.value.code == "bad_request"
    with pytest.raises(RemoteError) as exc:  # a rank that never registered
        req(ep, "rank.checkpoint", {"job_id": 42, "rank": 3, "outcome": "completed", "step": 1, "path": "/x"})
    assert exc.value.code == "not_found"
    # a relaunched (or requeued) script went on from a checkpoint: the job's steps count from there
    req(ep, "rank.progress", {"job_id": 42, "rank": 0, "collectives": 40, "step": 3})
    _until(lambda: served[0].state.ranks[0].step == 3)  # progress is applied on the serve loop's tick
    req(ep, "rank.checkpoint", {"job_id": 42, "rank": 0, "outcome": "loaded", "step": 100,
                                "path": "/shared/ckpt/step-000000100"})
    events = [e for e in req(ep, "job.events")["events"] if e["kind"].startswith("checkpoint.")]
    assert [e["kind"] for e in events] == ["checkpoint.completed", "checkpoint.failed", "checkpoint.loaded"]
    assert events[0]["data"]["step"] == 100 and events[0]["data"]["removed"] == [80]
    assert "5.0 MB" in events[0]["message"] and "blocked 0.020 s" in events[0]["message"]
    assert "No space left" in events[1]["message"]
    assert "loaded the application checkpoint of step 100" in events[2]["message"]
    _until(lambda: served[0].state.step_offset == 97)  # the runtime had counted 3 steps: its step 3 is the job's 100


def test_a_fan_out_encodes_a_shared_command_once_and_every_reply_is_the_same_bytes():
    """server._Replies: a result and command that many ranks get alike are encoded once,
    and each reply is exactly what wire.encode_ok makes of it; a command object of its own, a
    result with a value that cannot be a key, and no command at all are encoded right too."""
    from torchpass import wire
    from torchpass.coordinator import server as srv

    replies = srv._Replies()
    result = {"wait_max_s": 2.0, "report_every_s": 5.461, "reply_within_s": 6.096}
    shared = {"command": "pause", "at": 7, "generation": 2, "fallback": {"command": "resume"}}
    held = {**shared, "hold_file": "/x/rank0"}
    calls = []
    real = wire.encode_result
    try:
        wire.encode_result = lambda r: (calls.append(r), real(r))[1]
        for i, cmd in enumerate([shared, held, shared, shared, None, shared]):
            msg_id = f"id-{i}\u00e9\""
            want = wire.encode_ok(msg_id, dict(result) if cmd is None else {**result, "command": cmd})
            assert replies.encode(msg_id, dict(result), cmd) == want
        assert len(calls) == 3  # shared, held and no command: each encoded once
        odd = {"wait_max_s": 2.0, "list": [1, 2]}  # a value that cannot be a key: encoded by itself
        assert replies.encode("z", odd, shared) == wire.encode_ok("z", {**odd, "command": shared})
    finally:
        wire.encode_result = real


def test_the_saved_event_log_is_what_json_makes_of_every_event_and_each_is_encoded_once():
    """save_events writes the whole log after every event: each event is encoded once (at 8,192
    ranks their rank.registered events cost 40-80 ms a save when encoded again), into the same
    text as json.dumps of every as_dict()."""
    import json

    from torchpass.coordinator.job_record import encode_events

    job = JobState(job_id=7)
    job.carry_on([{"seq": 3, "time": 1.5, "kind": "job.stopping", "message": "earlier run", "data": {"a": [1]}}])
    for r in range(3):
        job.record(100.0 + r, "rank.registered", f"rank {r} on n\u00e9{r} \"quoted\"", rank=r, node=f"n{r}")
    assert encode_events(job.events) == json.dumps([e.as_dict() for e in job.events])
    assert json.loads(encode_events(job.events))[0]["seq"] == 3 and [e.seq for e in job.events] == [3, 4, 5, 6]
    first = job.events[1].encoded()
    assert job.events[1].encoded() is first  # not encoded again
    assert encode_events([]) == "[]"


def test_a_pause_reaches_its_held_ranks_first(parking):
    """At 8,192 ranks a pause's replies take the serve thread 0.25-0.6 s: the ranks of the node that
    moves (PauseAt's hold ranks, executor.urgent) get theirs first, whatever order they parked in."""
    server, _, _, dealer = parking
    s = dealer()
    ids = {rank: poll(s, rank) for rank in range(4)}
    _until(lambda: set(server._parked) == {0, 1, 2, 3})
    pause = {"command": "pause", "at": 50, "generation": 2}

    def pause_all():
        ex = server.driver.executor
        ex.urgent = (3, 2)
        for rank in range(4):
            ex.commands[rank] = pause

    server.later(pause_all)
    order = []
    while len(order) < 4:
        assert s.poll(2000, zmq.POLLIN), f"only {order} answered"
        reply = wire.decode_reply(s.recv_multipart()[-1])
        order.append(next(r for r, i in ids.items() if i == reply.id))
    assert order == [3, 2, 0, 1], order  # one connection: the replies arrive in the order sent


def test_a_health_change_ends_a_batch_after_the_message_in_hand():
    """A batch reads up to BATCH_MAX messages before it is decided on (0.1-0.3 s at 8,192 ranks); a
    node's health change ends it after the message being read, so the decision on it comes at once.
    A batch always reads one message, so a change nobody clears cannot stop the serving."""
    clock = Clock()

    class NewsDriver(CommandsDriver):
        news = True

        def health_news(self):
            return self.news

    driver = NewsDriver(42, clock)
    server = CoordinatorServer(JobState(job_id=42, spares=1), bind_address="127.0.0.1", clock=clock,
                               wall=lambda: 1e9, driver=driver)
    sock = zmqio.dealer_socket(zmq.Context.instance(), f"tcp://127.0.0.1:{server.port}")
    try:
        for rank in range(3):
            zmqio.send_request(sock, wire.encode("rank.register", {"job_id": 42, "rank": rank, "world_size": 3,
                                                                   "node": "n1", "pid": rank}))
        _until(lambda: server.sock.poll(0, zmq.POLLIN))
        time.sleep(0.2)  # all three queued at the ROUTER

        def served_now() -> int:
            got = 0
            while sock.poll(200, zmq.POLLIN):
                sock.recv_multipart()
                got += 1
            return got

        for _ in range(3):
            server._serve_batch()
            assert served_now() == 1  # the change pending: one message a batch, then the decision
        assert len(server.state.ranks) == 3 and driver.executor.saves == 1  # saved once, at the third
        for rank in range(3):
            zmqio.send_request(sock, wire.encode("rank.progress", {"job_id": 42, "rank": rank, "step": 1,
                                                                   "collectives": 5}))
        time.sleep(0.2)
        driver.news = False
        server._serve_batch()
        assert served_now() == 3  # no change: one batch for all that is queued
    finally:
        sock.close(linger=0)
        server.sock.close(linger=0)


def test_news_from_another_thread_is_taken_at_once_not_at_the_polls_time_out(served):
    """later() wakes the serve loop. With no driver the loop polls every 100 ms, and news from
    another thread used to wait for that time-out (20 ms with a driver: five such waits in every
    migration's standstill, one per step)."""
    server, _, _ = served
    lags = []
    for _ in range(9):
        ran = threading.Event()
        time.sleep(0.01)  # the loop is back in its poll
        t0 = time.perf_counter()
        server.later(ran.set)
        assert ran.wait(2.0)
        lags.append(time.perf_counter() - t0)
    assert sorted(lags)[len(lags) // 2] < 0.03, lags


def test_a_drivers_posts_and_health_changes_wake_the_serve_loop():
    from torchpass.coordinator.model import SpareHow

    driver = Driver(JobState(job_id=42), CoordinatorPolicy())
    server = CoordinatorServer(JobState(job_id=42), bind_address="127.0.0.1", driver=driver)
    woken = []
    real_wake = server.wake
    server.wake = lambda: (woken.append(1), real_wake())  # what serve() hands the driver
    t = threading.Thread(target=server.serve, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 5
        while not woken:  # serve() has handed its wake-up over once a post wakes it
            driver.post(ct.SpareAdded("spare9", SpareHow.HOT))
            assert time.monotonic() < deadline, "the driver's posts never woke the serve loop"
            time.sleep(0.01)
        before = len(woken)
        driver.health_changed()
        assert len(woken) == before + 1
    finally:
        server.stop()
        t.join(5)
    assert not t.is_alive()
    after = len(woken)
    driver.post(ct.SpareAdded("spare10", SpareHow.HOT))  # serving is over: nothing to wake
    assert len(woken) == after


def test_a_wake_from_a_signal_handler_in_the_thread_holding_the_wake_lock_does_not_hang(served):
    """SIGTERM's handler (coordinator main) calls stop(), so wake(), in the serve thread, which may be
    inside wake() or closing the pipe at that moment: the lock must let the same thread in again."""
    server, _, _ = served
    done = threading.Event()

    def nested():
        with server._wake_lock:  # as if interrupted in there
            server.wake()
        done.set()

    t = threading.Thread(target=nested, daemon=True)
    t.start()
    assert done.wait(2.0), "wake() deadlocked on its own lock"


def test_a_stop_from_a_signal_handler_that_interrupted_the_stop_itself_does_not_hang():
    """SIGTERM comes twice at a batch step's end: the plugin signals the process group and the
    supervisor forwards its copy. The second handler can run in the main thread while the first is
    inside Event.set(), holding the Event's lock: the handler's stop must take no lock, and the
    serve loop must still end (a coordinator hung there was SIGKILLed 5 s later, its event log
    unsaved)."""
    server = CoordinatorServer(JobState(job_id=42, spares=1), bind_address="127.0.0.1", clock=Clock(),
                               wall=lambda: 1e9)
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()
    until(lambda: server._wake_w >= 0, "the serve loop's wake pipe")
    returned = threading.Event()

    def interrupted_inside_set():
        with server._stop._cond:  # where Event.set() is when the second SIGTERM's handler runs
            server.stop_from_signal()
        returned.set()

    t = threading.Thread(target=interrupted_inside_set, daemon=True)
    t.start()
    assert returned.wait(2.0), "stop_from_signal() waited on the Event's lock"
    serving.join(5)
    assert not serving.is_alive(), "the serve loop did not end after stop_from_signal()"
    assert server._stop.is_set()  # the watch() threads end with it
