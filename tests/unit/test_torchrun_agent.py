"""torchrun's agent lets go of its rendezvous connection while its node moves.

* ``ReconnectingStore``: the agent's c10d client. ``hold()`` waits for the
  call in flight, then closes the connection (no socket left: CRIU can dump
  the tree) and makes later calls wait; ``release()`` lets them go on over a
  new connection. A connection lost some other way (here cut by hand:
  ``dup2`` of an unconnected socket over the client's fds) fails as torch's
  own client would.
* ``AgentHoldWatch``: holds the store while every worker's marker is there.
* the hook gives torchrun's c10d backend that store when the agent is a
  client, and torch's own server when it hosts the store.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from torchpass.runtime import hook, store
from torchpass.runtime.control import _agent_marker
from torchpass.runtime.testing import free_port

T = datetime.timedelta(seconds=10)


def _socket_fds() -> set[int]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                out.add(int(fd))
        except OSError:
            pass
    return out


def _cut(fds: set[int]) -> None:
    """What CRIU's --tcp-close restore leaves in place of a connection: a new socket, shut down."""
    for fd in fds:
        s = socket.socket()
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # ENOTCONN
        os.dup2(s.fileno(), fd)
        s.close()


SERVE = ("import datetime, sys, time, torch.distributed as d\n"
         "s = d.TCPStore('127.0.0.1', 0, 1, True, datetime.timedelta(seconds=60), wait_for_workers=False,"
         " multi_tenant=True)\n"
         "print(s.port, flush=True)\n"
         "sys.stdin.read()\n")


@pytest.fixture(scope="module")
def store_port():
    """A store served by another process: every new socket in this one is a client's."""
    proc = subprocess.Popen([sys.executable, "-c", SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield int(proc.stdout.readline())
    finally:
        proc.stdin.close()
        proc.wait(30)


class Server:
    """One test's view of the shared server: its keys live under a prefix of their own."""

    def __init__(self, port: int, prefix: str):
        self.port, self.prefix = port, prefix
        self.peek = dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", port, 1, False, T))

    def get(self, key):
        return self.peek.get(key)

    def set(self, key, value):
        self.peek.set(key, value)

    def connect(self):
        return dist.PrefixStore(self.prefix, dist.TCPStore("127.0.0.1", self.port, 1, False, T))


@pytest.fixture
def server(store_port, request):
    return Server(store_port, request.node.name)


def _client(server) -> tuple[store.ReconnectingStore, set[int]]:
    before = _socket_fds()
    st = store.ReconnectingStore(server.connect)
    return st, _socket_fds() - before


def test_a_held_store_has_no_socket_and_its_calls_wait_for_the_release(server):
    st, fds = _client(server)
    st.set("k", "1")
    assert fds and fds <= _socket_fds()
    assert st.hold() is True
    assert not fds & _socket_fds()  # the client's sockets are closed
    got = []
    t = threading.Thread(target=lambda: got.append(st.add("n", 3)))
    t.start()
    time.sleep(0.3)
    assert got == [] and t.is_alive()  # waits while held: nothing is sent
    st.release()
    t.join(10)
    assert got == [3] and st.reconnects == 1  # sent once, over a new connection
    assert st.get("k") == b"1" and server.get("n") == b"3"
    # gloo and the c10d backend go through a PrefixStore: the Python store answers through it
    assert dist.PrefixStore("p", st).add("m", 2) == 2 and server.get("p/m") == b"2"


def test_hold_waits_for_the_call_in_flight(server):
    st, _ = _client(server)
    done = []
    t = threading.Thread(target=lambda: done.append(st.wait(["late"], datetime.timedelta(seconds=5))))
    t.start()
    time.sleep(0.2)
    holder = threading.Thread(target=lambda: done.append(st.hold()))
    holder.start()
    time.sleep(0.2)
    assert done == [] and holder.is_alive()  # the wait is in flight: the connection stays
    server.set("late", "x")
    t.join(10)
    holder.join(10)
    assert done == [None, True]
    st.release()


def test_a_connection_lost_some_other_way_fails_as_torchs_own_client_would(server):
    """At a job's end the store's host leaves first: the other agents must get torch's error at
    once, as without torchpass (on the first try of this test's integration run, a reconnect
    there made a moved agent wait 60 s per connection attempt)."""
    st, fds = _client(server)
    st.set("k", "1")
    _cut(fds)
    with pytest.raises(dist.DistNetworkError):
        st.compare_set("k", "1", "2")
    assert st.reconnects == 0 and server.get("k") == b"1"


def test_the_watch_holds_while_every_worker_marker_is_there(server, tmp_path):
    st, _ = _client(server)
    watch = store.AgentHoldWatch(st, str(tmp_path), interval_s=0.01).start()
    try:
        env = {store.AGENT_DIR_ENV: str(tmp_path), "LOCAL_WORLD_SIZE": "2"}
        m0, m1 = (_agent_marker({**env, "LOCAL_RANK": str(i)}) for i in (0, 1))
        assert _agent_marker({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}) is None  # not under torchrun
        open(m0[0], "w").write(m0[1])
        time.sleep(0.2)
        assert not st.held  # one worker of two
        open(m1[0], "w").write(m1[1])
        deadline = time.monotonic() + 5
        while not st.held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert st.held and st._inner is None
        os.unlink(m0[0])
        deadline = time.monotonic() + 5
        while st.held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not st.held
        server.set("after", "1")
        assert st.get("after") == b"1"
    finally:
        watch.stop()


def test_the_hook_gives_an_agent_that_is_a_client_a_holdable_store(server, monkeypatch):
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as backend

    monkeypatch.setenv("TORCHPASS_COORDINATOR", "tcp://127.0.0.1:1")
    monkeypatch.delenv("TORCHPASS_RUNTIME", raising=False)
    monkeypatch.delenv(store.AGENT_DIR_ENV, raising=False)
    monkeypatch.delenv(hook.NO_SHARED_STORE_ENV, raising=False)
    orig = backend._create_tcp_store
    monkeypatch.setattr(backend, "_create_tcp_store", orig)
    hook._patch_torchrun_agent(backend)
    assert backend._create_tcp_store.__torchpass_orig__ is orig
    # the workers' bootstrap store is worker 0's (torch's own switch), not the agent's
    assert os.environ[hook.NO_SHARED_STORE_ENV] == "1"

    client = backend._create_tcp_store(
        RendezvousParameters("c10d", f"127.0.0.1:{server.port}", "run", 1, 1, is_host=False))
    assert isinstance(client, store.ReconnectingStore)
    assert os.path.isdir(os.environ[store.AGENT_DIR_ENV])  # exported for the workers it starts
    client.set("hook-x", "y")  # the hook's client has no prefix
    assert dist.TCPStore("127.0.0.1", server.port, 1, False, T).get("hook-x") == b"y"
    hook.state.pop("agent_watch").stop()
    # the host of the store keeps torch's own server (its node is pinned: it cannot move)
    port = free_port()
    host = backend._create_tcp_store(RendezvousParameters("c10d", f"127.0.0.1:{port}", "run", 1, 1, is_host=True))
    assert type(host) is dist.TCPStore and host.port == port


def test_the_hook_leaves_the_agent_alone_without_torchpass(monkeypatch):
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as backend

    orig = backend._create_tcp_store
    monkeypatch.setattr(backend, "_create_tcp_store", orig)
    monkeypatch.setenv("TORCHPASS_COORDINATOR", "tcp://127.0.0.1:1")
    monkeypatch.setenv("TORCHPASS_RUNTIME", "0")
    monkeypatch.delenv(hook.NO_SHARED_STORE_ENV, raising=False)
    hook._patch_torchrun_agent(backend)
    monkeypatch.delenv("TORCHPASS_COORDINATOR")
    monkeypatch.delenv("TORCHPASS_RUNTIME")
    hook._patch_torchrun_agent(backend)
    assert backend._create_tcp_store is orig and hook.NO_SHARED_STORE_ENV not in os.environ
