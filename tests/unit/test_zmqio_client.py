"""torchpass.zmqio.Client: one kept DEALER connection per peer, with request()'s contract (real sockets)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import zmq

from torchpass import jobauth, wire, zmqio
from torchpass.coordinator.job_record import JobState
from torchpass.coordinator.server import CoordinatorServer
from torchpass.errors import RemoteError, UnreachableError


class Peer:
    """A ROUTER on 127.0.0.1 whose answers a test chooses: ``behave(n, msg)`` returns the reply
    frames to send for the n-th request (0-based; [] to stay silent). Records each request's
    connection identity and message."""

    def __init__(self, behave=None):
        self.behave = behave or (lambda n, msg: [wire.encode_ok(msg.id, {"echo": msg.body})])
        self.ctx = zmq.Context()
        self.sock, port = zmqio.bind_router(self.ctx, "127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.identities: list[bytes] = []
        self.messages: list[wire.Message] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            parts = self.sock.recv_multipart()
            msg = wire.decode(parts[-1])
            n = len(self.messages)
            self.identities.append(parts[0])
            self.messages.append(msg)
            for frame in self.behave(n, msg):
                self.sock.send_multipart(parts[:-1] + [frame])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        assert not self._thread.is_alive()
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def peer_factory():
    peers: list[Peer] = []

    def make(behave=None) -> Peer:
        peers.append(Peer(behave))
        return peers[-1]

    yield make
    for p in peers:
        p.close()


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_requests_share_one_connection(peer_factory, ctx):
    peer = peer_factory()
    client = zmqio.Client(peer.endpoint, context=ctx, timeout_s=2, retries=0)
    for i in range(20):
        assert client.request("job.events", {"since_seq": i}) == {"echo": {"since_seq": i}}
    assert client.connects == 1
    assert len(set(peer.identities)) == 1 and len(peer.identities) == 20  # one connection at the server too
    client.close()


def test_a_late_or_duplicate_reply_is_never_taken_for_the_answer(peer_factory, ctx):
    # Each request is answered three times: a reply to another id first, then its own, then its own
    # again (a duplicate still queued when the next request is sent).
    peer = peer_factory(lambda n, msg: [wire.encode_ok("other-id", {"wrong": n}),
                                        wire.encode_ok(msg.id, {"n": n}), wire.encode_ok(msg.id, {"dup": n})])
    client = zmqio.Client(peer.endpoint, context=ctx, timeout_s=2, retries=0)
    assert [client.request("job.status") for _ in range(3)] == [{"n": 0}, {"n": 1}, {"n": 2}]


def test_a_time_out_retries_on_a_fresh_connection_with_a_fresh_credential(peer_factory, ctx):
    peer = peer_factory(lambda n, msg: [] if n == 0 else [wire.encode_ok(msg.id, {"auth": msg.auth})])
    creds = iter(["cred-1", "cred-2", "cred-3"])
    client = zmqio.Client(peer.endpoint, context=ctx, timeout_s=0.3, retries=1, auth=lambda: next(creds))
    assert client.request("job.status") == {"auth": "cred-2"}
    assert client.connects == 2 and len(set(peer.identities)) == 2
    assert [m.auth for m in peer.messages] == ["cred-1", "cred-2"]
    assert peer.messages[0].id != peer.messages[1].id


def test_no_peer_raises_unreachable_after_every_try(ctx):
    client = zmqio.Client("tcp://127.0.0.1:9", context=ctx, timeout_s=0.1, retries=2)
    t0 = time.monotonic()
    with pytest.raises(UnreachableError, match=r"no reply from tcp://127.0.0.1:9 to job.status after 3 tries"):
        client.request("job.status")
    assert time.monotonic() - t0 >= 0.3
    assert client.connects == 3


def test_an_error_reply_raises_remote_error_and_keeps_the_connection(peer_factory, ctx):
    peer = peer_factory(lambda n, msg: [wire.encode_error(msg.id, "not_found", "no such rank") if n == 0
                                        else wire.encode_ok(msg.id, {})])
    client = zmqio.Client(peer.endpoint, context=ctx, timeout_s=2, retries=2)
    with pytest.raises(RemoteError, match="no such rank") as info:
        client.request("job.status")
    assert info.value.code == "not_found"
    assert client.request("job.status") == {}
    assert client.connects == 1 and len(peer.messages) == 2  # an error reply is an answer: no retry


def test_a_destroyed_context_is_replaced_lazily_as_after_a_hold(peer_factory):
    # The rank runtime destroys its context before a CRIU dump and opens a new one after; the client
    # holds no socket meanwhile and makes one in the new context at the next request.
    peer = peer_factory()
    holder = {"ctx": zmq.Context()}
    client = zmqio.Client(peer.endpoint, context=lambda: holder["ctx"], timeout_s=2, retries=0)
    assert client.request("job.events", {"since_seq": 1}) == {"echo": {"since_seq": 1}}
    holder["ctx"].destroy(linger=0)
    holder["ctx"] = zmq.Context()
    try:
        assert client.request("job.events", {"since_seq": 2}) == {"echo": {"since_seq": 2}}
        assert client.connects == 2 and len(set(peer.identities)) == 2
    finally:
        client.close()
        holder["ctx"].destroy(linger=0)


def test_a_forked_child_makes_its_own_connection(peer_factory):
    peer = peer_factory()
    client = zmqio.Client(peer.endpoint, timeout_s=2, retries=0)  # zmq.Context.instance()
    assert client.request("job.events", {"since_seq": 1}) == {"echo": {"since_seq": 1}}
    pid = os.fork()
    if pid == 0:  # the child: never touch the parent's socket; exit code says what happened
        code = 1
        try:
            ok = client.request("job.events", {"since_seq": 2}) == {"echo": {"since_seq": 2}}
            code = 0 if ok and client.connects == 2 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert client.request("job.events", {"since_seq": 1}) == {"echo": {"since_seq": 1}}
    assert client.connects == 1  # the parent's connection is untouched by the child
    assert len(set(peer.identities)) == 2
    client.close()


def test_threads_share_a_client_and_each_gets_its_own_answer(peer_factory, ctx):
    peer = peer_factory()
    client = zmqio.Client(peer.endpoint, context=ctx, timeout_s=2, retries=0)
    got: dict[int, list] = {}

    def run(t: int) -> None:
        got[t] = [client.request("job.events", {"since_seq": 100 * t + i}) for i in range(25)]

    threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert got == {t: [{"echo": {"since_seq": 100 * t + i}} for i in range(25)] for t in range(4)}
    assert client.connects == 1


def test_the_coordinator_serves_signed_rank_requests_over_one_connection(ctx):
    # The real serve loop (its batch reads REQ envelopes) and the job secret's per-try signature.
    secret = b"k" * 32
    server = CoordinatorServer(JobState(job_id=42, spares=1), bind_address="127.0.0.1", job_secret=secret)
    t = threading.Thread(target=server.serve, daemon=True)
    t.start()
    try:
        client = zmqio.Client(f"tcp://127.0.0.1:{server.port}", context=ctx, timeout_s=2, retries=0,
                              auth=jobauth.JobSigner(secret))
        client.request("rank.register", {"job_id": 42, "rank": 0, "world_size": 2, "node": "n1", "pid": 7})
        for step in range(5):
            res = client.request("rank.progress", {"job_id": 42, "rank": 0, "step": step, "collectives": step})
            assert "report_every_s" in res
        assert server.state.ranks[0].step == 4
        assert client.connects == 1
        unsigned = zmqio.Client(f"tcp://127.0.0.1:{server.port}", context=ctx, timeout_s=2, retries=0)
        with pytest.raises(RemoteError) as info:
            unsigned.request("rank.progress", {"job_id": 42, "rank": 0, "step": 5, "collectives": 5})
        assert info.value.code == "unauthenticated"
    finally:
        server.stop()
        t.join(5)
    assert not t.is_alive()


def test_a_wait_given_up_returns_none_and_keeps_the_connection(peer_factory, ctx):
    # A long poll: the server holds the first request; the client gives the wait up when
    # asked to (a report to send), and its next request goes over the same connection; the held
    # request's late answer is never taken for the next one's.
    held: list[bytes] = []

    def behave(n, msg):
        if n == 0:
            held.append(wire.encode_ok(msg.id, {"late": True}))
            return []
        return held[:1] + [wire.encode_ok(msg.id, {"n": n})]

    peer = peer_factory(behave)
    client = zmqio.Client(peer.endpoint, context=ctx, timeout_s=30, retries=0)
    give_up = threading.Event()
    threading.Timer(0.2, give_up.set).start()
    t0 = time.monotonic()
    assert client.request("job.status", abandon=give_up.is_set) is None
    assert 0.15 < time.monotonic() - t0 < 5.0  # given up when asked, long before the 30 s time-out
    assert client.request("job.status") == {"n": 1}
    assert client.connects == 1 and len(set(peer.identities)) == 1


def test_a_wait_with_a_wake_up_pipe_sleeps_until_the_pipe_says_to_look(peer_factory, ctx):
    # A long poll of a running rank waits for seconds at a time: abandon() is asked when the wake-up
    # pipe is written, not every ABANDON_CHECK_S.
    peer = peer_factory(lambda n, msg: [])  # never answers
    client = zmqio.Client(peer.endpoint, context=ctx, timeout_s=30, retries=0)
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    asked = [0]
    give_up = threading.Event()

    def abandon():
        asked[0] += 1
        return give_up.is_set()

    def later():
        time.sleep(0.5)
        give_up.set()
        os.write(w, b"x")

    threading.Thread(target=later, daemon=True).start()
    t0 = time.monotonic()
    try:
        assert client.request("job.status", abandon=abandon, wake_fd=r) is None
        took = time.monotonic() - t0
        assert 0.45 < took < 2.0, took
        assert asked[0] <= 3, asked[0]  # before the write and after it (~50 with the 10 ms checks)
        with pytest.raises(BlockingIOError):
            os.read(r, 1)  # drained
    finally:
        os.close(r)
        os.close(w)
