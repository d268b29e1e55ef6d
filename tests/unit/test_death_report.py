"""The task wrapper's death report (torchpass.checkpoint.death_report): a rank that ends abnormally
is reported to the coordinator and the wrapper's exit held while the coordinator says hold; a clean
exit, no coordinator, a silent coordinator or an endless hold never keep the task alive."""

from __future__ import annotations

import signal

from torchpass.checkpoint import death_report as dr
from torchpass.errors import UnreachableError

ENV = {"TORCHPASS_COORDINATOR": "10.0.0.1:5555", "TORCHPASS_JOB_ID": "42", "SLURM_LOCALID": "1"}


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


def test_a_killed_rank_is_reported_with_its_signal_and_held_until_the_coordinator_says_exit():
    clock, sent = Clock(), []
    verdicts = iter(["hold", "hold", "exit"])

    def request(type_, body):
        sent.append((type_, dict(body)))
        return {"verdict": next(verdicts), "retry_s": 0.5}

    old = signal.getsignal(signal.SIGTERM)
    try:
        assert dr.hold_exit("1", -9, ENV, request=request, clock=clock, sleep=clock.sleep) == "exit"
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the step's end ends the hold at once
    finally:
        signal.signal(signal.SIGTERM, old)
    assert len(sent) == 3 and clock.t == 1.0
    assert sent[0] == ("rank.exited", {"job_id": 42, "rank": 1, "node": sent[0][1]["node"], "code": 137,
                                       "signal": 9, "gpu": 1})


def test_a_clean_exit_or_no_coordinator_reports_nothing():
    def request(*_a):
        raise AssertionError("nothing to report")

    assert dr.hold_exit("1", 0, ENV, request=request) == "clean"
    assert dr.hold_exit("1", 1, {"TORCHPASS_JOB_ID": "42"}, request=request) == "no coordinator"
    assert dr.report_body(ENV, "2", 3) == {"job_id": 42, "rank": 2, "node": dr.report_body(ENV, "2", 3)["node"],
                                           "code": 3, "gpu": 1}


def test_a_silent_coordinator_or_an_endless_hold_ends_the_hold():
    clock = Clock()

    def silent(*_a):
        clock.t += dr.REQUEST_TIMEOUT_S
        raise UnreachableError("no reply")

    old = signal.getsignal(signal.SIGTERM)
    try:
        assert dr.hold_exit("1", 1, ENV, request=silent, clock=clock, sleep=clock.sleep) == "silent"
        assert clock.t < dr.SILENT_S + 5
        clock.t = 0.0
        assert dr.hold_exit("1", 1, ENV, request=lambda *_a: {"verdict": "hold", "retry_s": 2},
                            clock=clock, sleep=clock.sleep) == "expired"
        assert dr.HOLD_MAX_S <= clock.t < dr.HOLD_MAX_S + 3
    finally:
        signal.signal(signal.SIGTERM, old)


def test_the_report_reaches_a_zeromq_router_over_plain_tcp_without_a_thread():
    """The wrapper speaks ZMTP 3 itself: libzmq's I/O thread cannot start in a process whose
    children go to another PID namespace (pthread_create: EINVAL, and libzmq aborts)."""
    import threading

    import zmq

    from torchpass import wire

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    got = []

    def serve():
        for _ in range(2):
            ident, empty, frame = router.recv_multipart()
            msg = wire.decode(frame)
            got.append((empty, msg.type, dict(msg.body)))
            router.send_multipart([ident, b"", wire.encode_ok(msg.id, {"verdict": "exit", "size": len(frame)})])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        threads = threading.active_count()
        request = dr._zmtp_requester(f"tcp://127.0.0.1:{port}", None)
        assert request("rank.exited", {"job_id": 1, "rank": 0, "node": "n1", "code": 1})["verdict"] == "exit"
        big = request("rank.exited", {"job_id": 1, "rank": 0, "node": "n" * 400, "code": 1})  # a long frame
        assert big["size"] > 255 and threading.active_count() <= threads  # no thread of its own
        assert got[0] == (b"", "rank.exited", {"job_id": 1, "rank": 0, "node": "n1", "code": 1})
    finally:
        t.join(5)
        router.close()
        ctx.term()
