"""The health subscriber over real ZeroMQ PUB/SUB on loopback: publications are bound to the
tpassd followed on their endpoint, and every numeric field is range-checked."""

from __future__ import annotations

import time

import pytest
import structlog
import zmq

from torchpass import wire
from torchpass.health import HealthSubscriber, OutOfRange, State, check_publication


def hb(node, seq, *, sender=None, interval_s=1.0, inc="a", **over):
    body = {"node": node, "incarnation": inc, "t": 1.7e9, "interval_s": interval_s, "state": "healthy",
            "last_event_seq": -1, "uptime_s": 1.0, **over}
    return [b"tpassd.heartbeat", wire.encode("tpassd.heartbeat", body, seq=seq, sender=sender or node)]


def ev(node, seq, state="healthy", *, sender=None, prev=-1, **over):
    body = {"node": node, "incarnation": "a", "t": 1.7e9, "component": "node", "state": state,
            "previous": "unknown", "reasons": [], "node_state": state, "prev_event_seq": prev, **over}
    return [b"tpassd.event", wire.encode("tpassd.event", body, seq=seq, sender=sender or node)]


class Pub:
    """A PUB socket on 127.0.0.1 standing in for one tpassd."""

    def __init__(self, ctx):
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"

    def send(self, parts):
        self.sock.send_multipart(parts)


def pump(sub, until, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, "publication never arrived"
        sub.poll_once(20)


@pytest.fixture
def two_nodes():
    """Publishers followed as n1 and n2 (no snapshot source: publications alone set the state)."""
    ctx = zmq.Context()
    p1, p2 = Pub(ctx), Pub(ctx)
    sub = HealthSubscriber({"n1": (p1.endpoint, "tcp://127.0.0.1:1"), "n2": (p2.endpoint, "tcp://127.0.0.1:1")},
                           snapshot=None, context=ctx)
    seq = {"n1": 0, "n2": 0}

    def joined(pub, node):
        # The slow joiner: heartbeat until one arrives (the subscription is then in place).
        pub.send(hb(node, seq[node]))
        seq[node] += 1
        sub.poll_once(20)
        return sub.view(node).received_seq >= 0

    for pub, node in ((p1, "n1"), (p2, "n2")):
        pump(sub, lambda pub=pub, node=node: joined(pub, node))
    try:
        yield sub, p1, p2, seq
    finally:
        sub.close()
        p1.sock.close()
        p2.sock.close()
        ctx.term()


def marker(sub, pub, node, seq):
    """Send a good heartbeat and wait for it: everything sent before it has been ingested."""
    n = seq[node] = seq[node] + 1000
    pub.send(hb(node, n))
    pump(sub, lambda: sub.view(node).received_seq == n)


def test_a_publication_from_the_wrong_sender_is_dropped_and_logged_once(two_nodes):
    sub, p1, p2, seq = two_nodes
    assert sub.state("n2") is State.UNKNOWN
    with structlog.testing.capture_logs() as logs:
        # From n1's endpoint: publications claiming to be n2 (envelope and body), or about n2.
        p1.send(ev("n2", 5000))
        p1.send(ev("n2", 5001, sender="n1"))
        p1.send(ev("n1", 5002, sender="n2"))
        marker(sub, p1, "n1", seq)
    assert sub.counters["wrong_sender"] == 3 and sub.counters["malformed"] == 0
    assert sub.state("n2") is State.UNKNOWN and sub.view("n2").reported_state is State.UNKNOWN
    assert sub.state("n1") is State.UNKNOWN and sub.view("n1").reported_state is State.UNKNOWN
    warned = [e for e in logs if e["event"] == "dropped publication" and e["log_level"] == "warning"]
    assert [(e["kind"], e["node"]) for e in warned] == [("wrong_sender", "n1")]
    # n2's own endpoint still works.
    p2.send(ev("n2", seq["n2"] + 1))
    pump(sub, lambda: sub.state("n2") is State.HEALTHY)


@pytest.mark.parametrize("bad", [
    {"interval_s": 0}, {"interval_s": -1.0}, {"interval_s": 3600.5}, {"interval_s": 1e9},
    {"uptime_s": -3.0}, {"last_event_seq": -2}, {"t": -1.0}, {"state": "splendid"},
])
def test_an_out_of_range_heartbeat_is_dropped(two_nodes, bad):
    sub, p1, _, seq = two_nodes
    before = sub.view("n1").interval_s
    p1.send(hb("n1", seq["n1"] + 1, **bad))
    marker(sub, p1, "n1", seq)
    assert sub.counters["out_of_range"] == 1 and sub.counters["malformed"] == 0
    assert sub.view("n1").interval_s == before == 1.0


def test_infinite_readings_and_seq_going_back_are_dropped_and_never_make_a_node_healthy(two_nodes):
    sub, p1, _, seq = two_nodes
    # 1e999 is valid JSON that Python reads as infinity (the encoder refuses to write it).
    frame = wire.encode("tpassd.heartbeat", {"node": "n1", "incarnation": "a", "t": 1.7e9, "interval_s": 12345.25,
                                             "state": "healthy", "last_event_seq": -1, "uptime_s": 1.0},
                        seq=seq["n1"] + 1, sender="n1").replace(b"12345.25", b"1e999")
    p1.send([b"tpassd.heartbeat", frame])
    sample = {"node": "n1", "incarnation": "a", "t": 1.7e9, "interval_s": 1.0, "state": "healthy", "reasons": [],
              "components": {"gpu0": {"state": "healthy", "reasons": [], "metrics": {"temp_c": 5.5}}},
              "collectors": {}}
    frame = wire.encode("tpassd.sample", sample, seq=seq["n1"] + 2, sender="n1").replace(b"5.5", b"-1e999")
    sub.ingest([b"tpassd.sample", frame], "n1")  # samples are not subscribed to: fed by hand
    marker(sub, p1, "n1", seq)
    top = seq["n1"]
    p1.send(ev("n1", top - 1))  # older than the marker: a replay
    p1.send(ev("n1", top))  # the marker's own seq again
    marker(sub, p1, "n1", seq)
    # wire.decode refuses an infinite top-level field itself (malformed); the rest is range-checked here.
    assert sub.counters["malformed"] == 1 and sub.counters["out_of_range"] == 3
    assert sub.state("n1") is State.UNKNOWN and sub.view("n1").reported_state is State.UNKNOWN
    p1.send(ev("n1", seq["n1"] + 1))  # a good one still counts
    pump(sub, lambda: sub.state("n1") is State.HEALTHY)


def test_a_silent_node_is_not_kept_alive_by_dropped_publications(two_nodes):
    sub, p1, _, seq = two_nodes
    t0 = sub.view("n1").last_heartbeat
    time.sleep(0.05)
    p1.send(hb("n1", seq["n1"] + 1, interval_s=0))
    p1.send(ev("n2", seq["n1"] + 2))
    n = seq["n1"] = seq["n1"] + 1000
    p1.send(ev("n2", n, state="failed", sender="n1"))  # from n1, about n2
    deadline = time.monotonic() + 5
    while sub.counters["out_of_range"] + sub.counters["wrong_sender"] < 3:
        assert time.monotonic() < deadline
        sub.poll_once(20)
    assert sub.view("n1").last_heartbeat == t0


def test_check_publication_ranges():
    check_publication("tpassd.heartbeat", {"interval_s": 3600, "t": 0, "last_event_seq": -1}, 0)
    for body, seq in (({}, -1), ({}, True), ({"interval_s": float("nan")}, 1), ({"prev_event_seq": 1.5}, 1),
                      ({"reasons": [1]}, 1), ({"components": {"g": {"metrics": {"x": float("inf")}}}}, 1)):
        with pytest.raises(OutOfRange):
            check_publication("tpassd.event", body, seq)


def test_many_publishers_are_read_by_readiness_and_a_flood_starves_no_other():
    """The subscriber waits on its sockets' ZMQ_FDs with epoll (a zmq.Poller walked all
    1,025 sockets per publication). Every publication of every publisher is read, a burst queued
    on one socket beyond DRAIN_MAX included, and another publisher's is read meanwhile."""
    from torchpass import health

    ctx = zmq.Context()

    class InprocPub(Pub):  # inproc: a sent message is queued on the SUB at once (no timing)
        def __init__(self, ctx, name):
            self.sock = ctx.socket(zmq.PUB)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.endpoint = f"inproc://health-{name}"
            self.sock.bind(self.endpoint)

    pubs = {f"n{i}": InprocPub(ctx, f"n{i}") for i in range(40)}
    sub = HealthSubscriber({n: (p.endpoint, "tcp://127.0.0.1:1") for n, p in pubs.items()},
                           snapshot=None, context=ctx)
    seq = dict.fromkeys(pubs, 0)
    try:
        def all_joined():
            for n, p in pubs.items():
                if sub.view(n).received_seq < 0:
                    p.send(hb(n, seq[n]))
                    seq[n] += 1
            sub.poll_once(20)
            return all(sub.view(n).received_seq >= 0 for n in pubs)

        pump(sub, all_joined)
        burst = 5 * health.DRAIN_MAX
        first = seq["n0"]
        for i in range(burst):  # queued on n0's socket before the subscriber reads again
            pubs["n0"].send(hb("n0", first + i))
        for n in pubs:
            if n != "n0":
                pubs[n].send(hb(n, seq[n] + 1))
        sub.poll_once(0)  # one pass: n0 yields after DRAIN_MAX, the others are read
        assert first <= sub.view("n0").received_seq < first + burst - 1
        assert all(sub.view(n).received_seq == seq[n] + 1 for n in pubs if n != "n0")
        pump(sub, lambda: sub.view("n0").received_seq == first + burst - 1)  # the rest, later
        for n in pubs:  # a later publication wakes the wait again (the edge was re-armed)
            pubs[n].send(hb(n, 10_000))
        pump(sub, lambda: all(sub.view(n).received_seq == 10_000 for n in pubs))
    finally:
        sub.close()
        for p in pubs.values():
            p.sock.close()
        ctx.term()
