"""Malformed input never breaks tpassd (hypothesis): random bytes, wrong
versions, huge frames and wrong types get an error reply or are dropped and
counted, and the daemon keeps serving on both sockets."""

import json
import socket
import time

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchpass import wire
from torchpass.errors import ProtocolError
from torchpass.health import HealthSubscriber
from tpassd.control import USER, ControlServer
from tpassd.daemon import Tpassd
from tpassd.testing import call, fake_node_config

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
TYPES = ["tpassd.health", "tpassd.status", "tpassd.drill", "tpassd.sample", "reply", "nope", ""]
envelopes = st.fixed_dictionaries(
    {},
    optional={"v": st.sampled_from([1, 2, 0, "1", True, None, 1.0]), "type": st.sampled_from(TYPES) | json_values,
              "id": json_values, "auth": json_values, "seq": json_values, "sender": json_values,
              "body": json_values | st.fixed_dictionaries({}, optional={"kind": json_values, "gpu": json_values,
                                                                        "port": json_values})},
)
frames = st.one_of(
    st.binary(max_size=300),
    envelopes.map(lambda d: json.dumps(d).encode()),
    st.sampled_from([b"", b"{}", b"[]", b"null", b'{"v":1}', b'{"v":1,"type":"tpassd.health","body":[]}',
                     b'{"v":NaN}', b"\xff\xfe", b"{" * 5000,
                     b'{"v":1,"type":"tpassd.health"}' + b" " * wire.MAX_FRAME_BYTES]),
)


class Deny:
    def identify(self, msg):
        from torchpass.auth import AuthFailure

        raise AuthFailure("unauthenticated", "test: nobody is authenticated")


@given(frames)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_decode_raises_only_protocol_error(frame):
    try:
        wire.decode(frame)
    except ProtocolError:
        pass


@pytest.fixture(scope="module")
def server():
    ctx = zmq.Context()
    s = ControlServer(ctx, "127.0.0.1", 0, Deny())
    s.register("tpassd.health", lambda m, i: {"ok": 1}, USER)
    yield s
    s.close()
    ctx.term()


@given(frames)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
def test_control_always_replies_with_a_stable_code(server, frame):
    before = dict(server.counters)
    reply = wire.decode_reply(server.handle(frame))
    assert not reply.ok and reply.code in wire.ERROR_CODES
    assert "Traceback" not in (reply.message or "")
    counted = ((server.counters["malformed"] - before["malformed"])
               + (server.counters["auth_failed"] - before["auth_failed"]))
    assert counted == 1 or reply.code == "unknown_type"


@given(st.lists(st.binary(max_size=200), max_size=4))
@settings(max_examples=300, deadline=None)
def test_subscriber_drops_and_counts_garbage(parts):
    s = HealthSubscriber({"n1": ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")}, snapshot=None)
    try:
        s.ingest(parts)
        assert s.counters["malformed"] == 1
    finally:
        s.close()


def test_live_daemon_survives_garbage_on_both_sockets(tmp_path, munge):
    d = Tpassd(fake_node_config(tmp_path, "node1", munge.socket, interval_s=0.2, collector_timeout_s=0.1,
                                metrics_port=-1)).start()
    ctx = zmq.Context()
    try:
        p = d.ports()
        ctl, pub = f"tcp://127.0.0.1:{p['control_port']}", f"tcp://127.0.0.1:{p['pub_port']}"
        # 1. raw TCP garbage (not even ZMTP) to both ports
        for port in (p["control_port"], p["pub_port"]):
            for blob in (b"\x00" * 64, b"GET / HTTP/1.0\r\n\r\n", bytes(range(256)) * 40):
                with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                    s.sendall(blob)
        # 2. ZMTP peers sending bad frames: DEALER without the empty delimiter, REQ with garbage,
        #    a huge frame (cut by MAXMSGSIZE), and an XSUB sending junk "subscriptions" to the PUB
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(ctl)
        dealer.send_multipart([b"no", b"delimiter"])
        dealer.send(b"x" * (wire.MAX_FRAME_BYTES + 10_000))
        replies = []
        for frame in (b"\xff" * 100, b'{"v":2,"type":"tpassd.status","id":"x","body":{}}',
                      b'{"v":1,"type":"tpassd.drill","id":"y","body":{"kind":7}}',
                      b'{"v":1,"type":"tpassd.status","id":"z","body":{},"auth":"MUNGE:forged:"}'):
            req = ctx.socket(zmq.REQ)
            req.setsockopt(zmq.LINGER, 0)
            req.connect(ctl)
            req.send(frame)
            assert req.poll(3000), "no reply to a malformed request"
            replies.append(wire.decode_reply(req.recv()))
            req.close()
        assert [r.code for r in replies] == ["bad_request", "unsupported_version", "bad_request", "unauthenticated"]
        xsub = ctx.socket(zmq.XSUB)
        xsub.setsockopt(zmq.LINGER, 0)
        xsub.connect(pub)
        for junk in (b"\x07garbage", b"", b"\x01" + b"z" * 10000, b"\x00"):
            xsub.send(junk)
        time.sleep(0.3)
        assert d.control.counters["malformed"] >= 3 and d.control.counters["dropped"] >= 1
        # 3. still serving: an authenticated request works and heartbeats still reach a subscriber
        assert call(ctl, "node1", "tpassd.status", munge_socket=munge.socket)["node"] == "node1"
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"tpassd.heartbeat")
        sub.connect(pub)
        assert sub.poll(3000)
        assert wire.decode(sub.recv_multipart()[1]).type == "tpassd.heartbeat"
        for s in (dealer, xsub, sub):
            s.close()
    finally:
        d.stop()
        ctx.term()
