"""tpassd's control endpoint never blocks one request on another (every control request
has a deadline, so no request can block another). Real ZeroMQ sockets on 127.0.0.1; the slow
handlers are fakes that sleep: the point is the concurrency, not CRIU.

With one thread serving every request in turn, a health request would wait for a dump."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from torchpass import auth, wire, zmqio
from torchpass.errors import RemoteError
from tpassd.control import USER, ControlServer
from tpassd.testing import wait_for


class AnyRoot:
    """Every request is root's (authentication is tested elsewhere: test_tpassd_daemon.py)."""

    def identify(self, msg):
        return auth.Identity(0, 0)


class Slow:
    """A handler that sleeps until released (or ``seconds``), recording what ran."""

    def __init__(self, seconds: float = 10.0):
        self.seconds = seconds
        self.release = threading.Event()
        self.started: list[dict] = []
        self.lock = threading.Lock()

    def __call__(self, msg, ident):
        with self.lock:
            self.started.append(dict(msg.body))
        self.release.wait(self.seconds)
        return {"rank": msg.body.get("rank")}


@pytest.fixture
def server():
    ctx = zmq.Context()
    made = []

    def make(**kw):
        s = ControlServer(ctx, "127.0.0.1", 0, AnyRoot(), **kw)
        s.register("tpassd.health", lambda m, i: {"state": "healthy"}, USER, inline=True)
        s.start()
        made.append(s)
        return s, f"tcp://127.0.0.1:{s.port}"

    yield make
    for s in made:
        s.close()
    ctx.term()


def ask(ep, type_, body=None, timeout_s=5.0):
    return zmqio.request(ep, type_, body or {}, timeout_s=timeout_s, retries=0)


def in_background(fn):
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


DUMP = {"job_id": 7, "rank": 1, "op": "dump"}


def test_health_answers_within_100_ms_while_a_slow_snapshot_runs(server):
    s, ep = server()
    slow = Slow()
    s.register("tpassd.snapshot", slow, USER)
    t, box = in_background(lambda: ask(ep, "tpassd.snapshot", DUMP, timeout_s=10.0))
    assert wait_for(lambda: slow.started), "the snapshot handler never started"
    worst = 0.0
    for _ in range(20):
        t0 = time.monotonic()
        assert ask(ep, "tpassd.health", timeout_s=1.0) == {"state": "healthy"}
        worst = max(worst, time.monotonic() - t0)
    assert worst < 0.1, f"health took {worst * 1000:.0f} ms while a snapshot ran"
    assert t.is_alive(), "the snapshot should still be running"
    slow.release.set()
    t.join(5)
    assert box.get("result") == {"rank": 1}


def test_one_op_per_rank_a_second_waits_for_it_other_ranks_run_alongside(server):
    s, ep = server()
    slow = Slow()
    s.register("tpassd.snapshot", slow, USER)
    t1, b1 = in_background(lambda: ask(ep, "tpassd.snapshot", DUMP, timeout_s=10.0))
    assert wait_for(lambda: len(slow.started) == 1)
    # the coordinator's abort of a rank whose dump still runs: queued behind it, then run
    ta, ba = in_background(lambda: ask(ep, "tpassd.snapshot", {**DUMP, "op": "abort"}, timeout_s=10.0))
    assert wait_for(lambda: s.counters["queued_behind_rank_op"] == 1)
    t2, b2 = in_background(lambda: ask(ep, "tpassd.snapshot", {**DUMP, "rank": 2}, timeout_s=10.0))
    assert wait_for(lambda: len(slow.started) == 2), "another rank's op waited for the first"
    assert ta.is_alive() and "result" not in ba, "the abort ran beside its rank's dump"
    slow.release.set()
    for t in (t1, t2, ta):
        t.join(5)
    assert b1.get("result") == {"rank": 1} and b2.get("result") == {"rank": 2}
    assert ba.get("result") == {"rank": 1}, ba
    assert len(slow.started) == 3  # the abort started only after the dump ended


def test_a_request_over_its_deadline_gets_timeout_and_its_rank_stays_busy_until_the_work_ends(server):
    s, ep = server()
    slow = Slow()
    s.register("tpassd.snapshot", slow, USER, deadline_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(RemoteError) as e:
        ask(ep, "tpassd.snapshot", DUMP, timeout_s=5.0)
    took = time.monotonic() - t0
    assert e.value.code == "timeout" and "0.3 s deadline" in str(e.value), e.value
    assert 0.25 <= took < 1.0, took
    # the dump itself still runs: a second op on the rank waits behind it, past its own deadline
    t2, b2 = in_background(lambda: ask(ep, "tpassd.snapshot", DUMP, timeout_s=5.0))
    assert wait_for(lambda: s.counters["queued_behind_rank_op"] == 1)
    time.sleep(0.4)
    assert s.busy_jobs() == {7} and len(slow.started) == 1
    slow.release.set()
    t2.join(5)
    assert isinstance(b2.get("error"), RemoteError) and b2["error"].code == "timeout", b2  # never started
    assert len(slow.started) == 1
    assert wait_for(lambda: not s.busy_jobs())
    slow.release.clear()
    slow.seconds = 0.0
    assert ask(ep, "tpassd.snapshot", DUMP) == {"rank": 1}
    assert s.counters["timed_out"] == 2


def test_a_request_that_timed_out_waiting_for_a_worker_never_starts(server):
    s, ep = server(workers=1)
    slow = Slow()
    s.register("tpassd.snapshot", slow, USER, deadline_s=0.4)
    first, _ = in_background(lambda: ask(ep, "tpassd.snapshot", DUMP, timeout_s=5.0))
    assert wait_for(lambda: len(slow.started) == 1)
    with pytest.raises(RemoteError) as e:  # queued behind the first on the only worker
        ask(ep, "tpassd.snapshot", {**DUMP, "rank": 2}, timeout_s=5.0)
    assert e.value.code == "timeout"
    first.join(5)
    slow.release.set()
    assert wait_for(lambda: not s.busy_jobs())
    time.sleep(0.1)
    assert [b["rank"] for b in slow.started] == [1], slow.started


def test_a_full_pool_refuses_clearly_and_health_still_answers(server):
    s, ep = server(workers=1, max_in_flight=2)
    slow = Slow()
    s.register("tpassd.snapshot", slow, USER)
    threads = [in_background(lambda r=r: ask(ep, "tpassd.snapshot", {**DUMP, "rank": r}, timeout_s=10.0))
               for r in (1, 2)]
    assert wait_for(lambda: len(slow.started) == 1)
    assert wait_for(lambda: len(s._pending) == 2)  # one running, one waiting for the worker
    with pytest.raises(RemoteError) as e:
        ask(ep, "tpassd.snapshot", {**DUMP, "rank": 3}, timeout_s=1.0)
    assert e.value.code == "unavailable" and "busy" in str(e.value)
    assert ask(ep, "tpassd.health", timeout_s=0.5)
    slow.release.set()
    for t, box in threads:
        t.join(5)
        assert "result" in box, box


def test_malformed_and_unknown_requests_are_answered_by_the_front_thread(server):
    s, ep = server()
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(ep)
    try:
        sock.send(b"not json")
        assert sock.poll(1000)
        assert wire.decode_reply(sock.recv()).code == "bad_request"
    finally:
        sock.close()
    with pytest.raises(RemoteError) as e:
        ask(ep, "tpassd.drill", {"kind": "xid79"}, timeout_s=1.0)
    assert e.value.code == "unknown_type"


def test_close_does_not_wait_for_a_running_op(server):
    s, ep = server()
    slow = Slow(seconds=30.0)
    s.register("tpassd.snapshot", slow, USER)
    in_background(lambda: ask(ep, "tpassd.snapshot", DUMP, timeout_s=1.0))
    assert wait_for(lambda: slow.started)
    t0 = time.monotonic()
    s.close()
    assert time.monotonic() - t0 < 6.0
    slow.release.set()  # the worker wakes and finds the server closed: no write to a closed fd


def test_tpassd_answers_health_within_100_ms_while_a_snapshot_runs_and_a_fifo_is_verified(tmp_path, munge):
    """The whole daemon, munge-authenticated: its snapshot handler swapped for a sleeper, plus
    the issue's FIFO manifest in op=verify (refused fast), while health keeps flowing."""
    import os

    from torchpass import layout
    from torchpass.checkpoint import manifest as mf
    from tpassd.daemon import Tpassd
    from tpassd.testing import call, fake_node_config

    cfg = fake_node_config(tmp_path, "node1", munge.socket, interval_s=0.2, collector_timeout_s=0.15)
    d = layout.images_dir(cfg.snapshot_dir, 7, 2, 1)  # rank 2: rank 1 is busy with the dump
    d.mkdir(parents=True)
    os.mkfifo(d / mf.MANIFEST)
    node = Tpassd(cfg).start()
    slow = Slow()
    node.control.register("tpassd.snapshot", slow, USER)
    ctl = f"tcp://127.0.0.1:{node.ports()['control_port']}"
    try:
        t, box = in_background(lambda: call(ctl, "node1", "tpassd.snapshot", DUMP, munge.socket, timeout_s=10.0,
                                            retries=0))
        assert wait_for(lambda: slow.started)
        verify = {"job_id": 7, "rank": 2, "op": "verify", "images": str(d)}
        t0 = time.monotonic()
        with pytest.raises(RemoteError, match="is a FIFO; refused"):
            call(ctl, "node1", "tpassd.restore", verify, munge.socket, timeout_s=1.0, retries=0)
        assert time.monotonic() - t0 < 1.0
        worst = 0.0
        for _ in range(10):
            t0 = time.monotonic()
            assert call(ctl, "node1", "tpassd.health", munge_socket=munge.socket, timeout_s=1.0, retries=0)
            worst = max(worst, time.monotonic() - t0)
        assert worst < 0.1, f"health took {worst * 1000:.0f} ms while a snapshot ran"
        assert t.is_alive()
    finally:
        slow.release.set()
        node.stop()
        try:  # release a reader still blocked in open() (old code)
            os.close(os.open(d / mf.MANIFEST, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
