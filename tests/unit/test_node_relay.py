"""The node relay: the ranks of a node share one connection to the coordinator.

Real links (torchpass.runtime.control.ControlLink, their real threads) and a real relay
(torchpass.runtime.relay.NodeRelay) against the stand-in coordinator of test_runtime_control (a
ROUTER in another process that logs each request's connection identity), and against the real
CoordinatorServer for the long poll.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import zmq

from test_never_left_paused import FakePG
from test_runtime_control import RESUME, coordinator, peers, socket_inodes, wait_for  # noqa: F401 - fixtures
from torchpass import layout, wire, zmqio
from torchpass.coordinator import server as srv
from torchpass.runtime import control, relay


@pytest.fixture
def relay_dir(tmp_path):
    d = tmp_path / "relay"
    d.mkdir(mode=0o700)
    return d


def link(endpoint: str, path, rank: int, *, host: bool, pg=None, size: int = 3, **kw) -> control.ControlLink:
    ln = control.ControlLink(pg or FakePG(size=size, rank=rank), endpoint=endpoint, job_id=7, rank=rank, node="n1",
                             interval_s=0.02, paused_interval_s=0.02, request_timeout_s=5.0,
                             relay_path=str(path), relay_host=host, **kw)
    ln.start()
    return ln


def progress(peer, n: int) -> bool:
    return sum(t == "rank.progress" for _, t in list(peer.seen)) >= n


def test_the_ranks_of_a_node_share_one_connection_through_the_relay(peers, relay_dir):  # noqa: F811
    # Before, each rank kept its own connection: 3 identities at the coordinator here, 8,192 at
    # 1,024 nodes x 8 ranks.
    peer = peers()
    path = relay_dir / "job7.0-n1.sock"
    links = [link(peer.endpoint, path, 0, host=True)]
    links += [link(peer.endpoint, path, r, host=False) for r in (1, 2)]
    try:
        peer.wait(lambda: progress(peer, 30), "30 progress reports")
        assert all(ln.registered and ln.channel.via_relay for ln in links)
    finally:
        for ln in links:
            ln.stop()
    assert sum(t == "rank.register" for _, t in peer.seen) == 3
    assert len(peer.identities()) == 1, peer.identities()
    assert not path.exists()  # the relay removed its socket when it stopped


def test_a_rank_with_no_relay_connects_itself_and_takes_the_relay_once_it_listens(peers, relay_dir, monkeypatch):  # noqa: F811
    monkeypatch.setattr(relay, "FIRST_WAIT_S", 0.2)
    monkeypatch.setattr(relay, "RELAY_RETRY_S", 0.5)
    peer = peers()
    path = relay_dir / "job7.0-n1.sock"
    path.touch()  # a file a relay that is gone left: nobody listens on it
    rank1 = link(peer.endpoint, path, 1, host=False)
    host = None
    try:
        peer.wait(lambda: progress(peer, 5), "reports straight to the coordinator")
        assert not rank1.channel.via_relay and len(peer.identities()) == 1
        host = link(peer.endpoint, path, 0, host=True)
        wait_for(lambda: rank1.channel.via_relay, "rank 1 through the relay", 5.0)
        n = len(peer.seen)
        peer.wait(lambda: len(peer.seen) >= n + 10, "reports through the relay")
        last = {i for i, _ in peer.seen[n + 2:]}
        assert len(last) == 1, last  # rank 1 and the host share the relay's one connection
        assert rank1.errors == 0
    finally:
        rank1.stop()
        if host is not None:
            host.stop()


def test_time_outs_through_the_relay_send_the_next_try_to_the_coordinator_itself(peers, relay_dir, monkeypatch):  # noqa: F811
    # A relay that stopped forwarding (here: bound, never read) must not cut the rank off: after
    # relay.TIMEOUTS_BEFORE_DIRECT time-outs in a row the rank goes to the coordinator itself.
    monkeypatch.setattr(relay, "RELAY_RETRY_S", 60.0)
    peer = peers()
    path = relay_dir / "job7.0-n1.sock"
    ctx = zmq.Context()
    mute = ctx.socket(zmq.ROUTER)
    mute.bind(f"ipc://{path}")
    ln = control.ControlLink(FakePG(size=2, rank=1), endpoint=peer.endpoint, job_id=7, rank=1, node="n1",
                             interval_s=0.02, paused_interval_s=0.02, request_timeout_s=0.5,
                             relay_path=str(path), relay_host=False)
    ln.start()
    try:
        peer.wait(lambda: progress(peer, 3), "reports after the time-outs", timeout_s=10)
        assert ln.registered and not ln.channel.via_relay and ln.errors == 0
        tries = 0
        while mute.poll(0):
            mute.recv_multipart()
            tries += 1
        assert tries == relay.TIMEOUTS_BEFORE_DIRECT  # the register, through the relay, before going direct
    finally:
        ln.stop()
        mute.close(linger=0)
        ctx.term()


def test_the_relay_host_lets_its_nodes_ranks_report_before_it_holds_and_keeps_no_socket(relay_dir):
    # A move takes a whole node: the host's hold waits (at most DRAIN_S) for the other ranks'
    # rank.quiesced to be answered through the relay, then the relay closes every socket.
    ctx = zmq.Context()
    coord, port = zmqio.bind_router(ctx, "127.0.0.1")
    path = str(relay_dir / "r.sock")
    before = socket_inodes()
    r = relay.NodeRelay(path, f"tcp://127.0.0.1:{port}")
    assert r.start()
    rank = zmqio.dealer_socket(ctx, f"ipc://{path}")

    def ask(type_: str, body: dict) -> tuple[bytes, bytes, str]:
        id_ = wire.new_id()
        zmqio.send_request(rank, wire.encode(type_, body, id=id_))
        parts = coord.recv_multipart()
        assert len(parts) == 3 and parts[1] == wire.RELAY_BUNDLE, parts  # [relay, mark, bundle]
        ((ident, frame),) = wire.unpack_bundle(parts[2])
        assert wire.decode(frame).id == id_  # the rank's frame, unchanged
        return parts[0], ident, id_

    def answer(relay_id: bytes, ident: bytes, id_: str) -> None:
        coord.send_multipart([relay_id, wire.RELAY_BUNDLE, wire.pack_bundle([(ident, wire.encode_ok(id_, {}))])])

    answer(*ask("rank.progress", {"job_id": 7, "rank": 1, "step": 0, "collectives": 0}))
    assert rank.poll(2000) and rank.recv_multipart()
    relay_id, ident, id_ = ask("rank.quiesced", {"job_id": 7, "rank": 1, "generation": 3, "collectives": 9,
                                                 "sockets": 0, "drain_s": 0.0, "node": "n1", "pid": 1, "hold": True})
    stopped = []
    t0 = time.monotonic()
    stopper = threading.Thread(target=lambda: (r.stop(drain_s=2.0), stopped.append(time.monotonic() - t0)))
    stopper.start()
    time.sleep(0.3)
    assert not stopped  # rank 1 is still waiting for its answer
    answer(relay_id, ident, id_)
    assert rank.poll(2000), "the answer to rank.quiesced did not come through"
    assert zmqio.recv_reply(rank, id_) is not None
    stopper.join(5)
    assert stopped and stopped[0] < 1.0, stopped  # at once after the answer, not at the 2 s bound
    rank.close(linger=0)
    coord.close(linger=0)
    ctx.term()
    assert socket_inodes() - before == set()  # nothing for CRIU to refuse
    assert not os.path.exists(path)


def test_a_held_host_with_nobody_to_wait_for_stops_its_relay_at_once(relay_dir):
    r = relay.NodeRelay(str(relay_dir / "r.sock"), "tcp://127.0.0.1:1")
    assert r.start()
    t0 = time.monotonic()
    r.stop(drain_s=2.0)
    assert time.monotonic() - t0 < 0.5 and not r.running


def test_a_paused_rank_behind_the_relay_gets_its_resume_at_once(coordinator, relay_dir):  # noqa: F811
    server, ep = coordinator
    path = relay_dir / "job7.0-n1.sock"
    host = link(ep, path, 0, host=True, size=2)
    pg = FakePG(size=2, rank=1)
    ln = link(ep, path, 1, host=False, pg=pg, size=2)
    try:
        wait_for(lambda: ln.registered and ln.wait_max_s == srv.PARK_MIN_S and ln.channel.via_relay, "registered")
        pg.paused = True
        wait_for(lambda: 1 in server._parked, "rank 1's poll parked at the coordinator")
        assert server._parked[1].envelope[1] == wire.RELAY_BUNDLE  # [relay, mark, rank socket]
        server.later(lambda: server.driver.executor.commands.__setitem__(1, dict(RESUME)))
        took = wait_for(lambda: pg.resumes, "the resume")
        assert took < 1.0, f"the resume reached the paused rank {took:.3f} s after it was set"
    finally:
        ln.stop()
        host.stop()
    assert ln.errors == 0


@pytest.mark.parametrize("how", ["mode 0755", "a symlink", "another user's"])
def test_a_relay_directory_others_could_use_is_refused(tmp_path, how, capsys):
    target = tmp_path / "d"
    target.mkdir(mode=0o700)
    path = target
    if how == "mode 0755":
        target.chmod(0o755)
    elif how == "a symlink":
        path = tmp_path / "link"
        path.symlink_to(target)
    else:
        if os.getuid() != 0:
            pytest.skip("needs root to give the directory to another user")
        os.chown(target, 65534, 65534)
    assert relay.private_dir(str(path), create=True) is None
    assert "no node relay" in capsys.readouterr().err
    assert relay.private_dir(str(target), create=False, uid=os.getuid()) is None or how == "a symlink"


def test_the_relay_host_and_its_socket_come_from_the_task_environment(tmp_path):
    env = {"TORCHPASS_JOB_ID": "42", "SLURM_STEP_ID": "3", "SLURMD_NODENAME": "node7",
           "SLURM_LOCALID": "0", "TORCHPASS_RELAY_DIR": str(tmp_path)}
    assert control._relay_args(env) == {"relay_path": str(tmp_path / "job42.3-node7.sock"), "relay_host": True}
    assert control._relay_args({**env, "SLURM_LOCALID": "2"})["relay_host"] is False
    assert control._relay_args({**env, "LOCAL_RANK": "1"})["relay_host"] is False  # torchrun's local rank first
    assert control._relay_args({**env, "TORCHPASS_RELAY": "0"}) == {}
    # No local rank (a task started outside srun and torchrun): no host to wait for, no relay.
    assert control._relay_args({k: v for k, v in env.items() if k != "SLURM_LOCALID"}) == {}
    assert relay.relay_dir({}, uid=1001) == "/tmp/torchpass-relay-1001"


def test_a_held_relay_host_keeps_no_socket_and_relays_again_after_the_hold(peers, relay_dir, tmp_path):  # noqa: F811
    hold = layout.hold_file(tmp_path, 7, "m1", 0)
    hold.parent.mkdir(parents=True)
    pg = FakePG(size=2, rank=0)
    peer = peers({"command": "pause", "at": 5, "generation": 3, "hold_file": str(hold)}, at=2)
    path = relay_dir / "job7.0-n1.sock"
    before = socket_inodes()
    host = link(peer.endpoint, path, 0, host=True, pg=pg, size=2, state_dir=str(tmp_path))
    try:
        peer.wait(lambda: pg.arms == [(5, 3)], "the pause armed")
        host.on_quiesced(pg, {"next_generation": 3, "sockets": 0, "drain_s": 0.0})
        peer.wait(lambda: host._holding, "the host holding")
        assert socket_inodes() - before == set()  # neither its link nor its relay: CRIU can dump it
        assert not path.exists()
        hold.touch()  # the move was called off: the host goes on where it is, and relays again
        peer.wait(lambda: progress(peer, 6), "progress after the hold")
        assert host.channel.relay is not None and host.channel.via_relay
    finally:
        host.stop()
    assert len(peer.identities()) == 2  # the relay's connection before the hold, and its new one
    assert socket_inodes() - before == set()


def bundle_of(*items: tuple[bytes, bytes]) -> list[bytes]:
    return [wire.RELAY_BUNDLE, wire.pack_bundle(list(items))]


def test_the_coordinator_answers_a_nodes_ranks_and_their_parked_polls_in_one_message_each_time(
        coordinator):  # noqa: F811
    server, ep = coordinator
    ctx = zmq.Context()
    relay_sock = zmqio.dealer_socket(ctx, ep)  # what a node relay's DEALER sends and reads

    def req(rank: int, type_: str, body: dict) -> tuple[bytes, bytes, str]:
        id_ = wire.new_id()
        return b"r%d" % rank, wire.encode(type_, {"job_id": 7, "rank": rank, **body}, id=id_), id_

    def replies(timeout_ms: int = 3000) -> dict[bytes, wire.Reply]:
        assert relay_sock.poll(timeout_ms), "no bundle came back"
        parts = relay_sock.recv_multipart()
        assert len(parts) == 2 and parts[0] == wire.RELAY_BUNDLE, parts
        return {ident: wire.decode_reply(frame) for ident, frame in wire.unpack_bundle(parts[1])}

    try:
        regs = [req(r, "rank.register", {"world_size": 2, "node": "n1", "pid": 100 + r, "generation": 0})
                for r in (0, 1)]
        relay_sock.send_multipart(bundle_of(*((i, f) for i, f, _ in regs)))
        got = replies()
        assert {i: (r.ok, r.id) for i, r in got.items()} == {b"r0": (True, regs[0][2]), b"r1": (True, regs[1][2])}
        polls = [req(r, "rank.progress", {"step": 0, "collectives": 0, "node": "n1", "wait_s": 5.0})
                 for r in (0, 1)]
        relay_sock.send_multipart(bundle_of(*((i, f) for i, f, _ in polls)))
        wait_for(lambda: {0, 1} <= set(server._parked), "both polls parked")
        assert not relay_sock.poll(200)  # nothing to say yet
        n = server.counters.get("dropped", 0)
        cut = wire.pack_bundle([(b"r0", polls[0][1])])[:-3]  # an item cut short
        relay_sock.send_multipart([wire.RELAY_BUNDLE, cut])
        wait_for(lambda: server.counters.get("dropped", 0) == n + 1, "the broken bundle dropped")

        def resume_both():
            server.driver.executor.commands.update({0: dict(RESUME), 1: dict(RESUME)})

        server.later(resume_both)
        got = replies()  # the resume to both ranks: one message
        assert {i: (r.id, r.result["command"]["command"]) for i, r in got.items()} == {
            b"r0": (polls[0][2], "resume"), b"r1": (polls[1][2], "resume")}
        assert not relay_sock.poll(200)
    finally:
        relay_sock.close(linger=0)
        ctx.term()


def test_a_bundle_unpacks_to_its_items_and_a_broken_one_is_one_protocol_error():
    from torchpass.errors import ProtocolError

    items = [(b"\x00abcd", b'{"v":1}'), (b"r", b""), (bytes(255), b"x" * 70000)]
    blob = wire.pack_bundle(items)
    assert wire.unpack_bundle(blob) == items and wire.unpack_bundle(b"") == []
    for broken in (blob[:3], blob[:-1], blob + b"\x01"):
        with pytest.raises(ProtocolError):
            wire.unpack_bundle(broken)
    huge = wire._ITEM_HEAD.pack(1, wire.MAX_FRAME_BYTES + 1) + b"r"
    with pytest.raises(ProtocolError, match="frame limit"):
        wire.unpack_bundle(huge)


def test_a_bundle_too_large_for_one_frame_goes_as_several_each_under_the_limit():
    # The coordinator's socket disconnects a peer that sends a frame over MAXMSGSIZE (bind_router):
    # a relay's bundle must never be one.
    ctx = zmq.Context()
    coord, port = zmqio.bind_router(ctx, "127.0.0.1")
    relay_sock = zmqio.dealer_socket(ctx, f"tcp://127.0.0.1:{port}")
    try:
        big = [(b"r%d" % i, b"x" * (wire.MAX_FRAME_BYTES // 3)) for i in range(5)]
        assert zmqio.send_bundle(relay_sock, big)
        got = []
        while len(got) < len(big):
            assert coord.poll(3000), f"{len(got)} of {len(big)} items came"
            parts = coord.recv_multipart()
            assert parts[1] == wire.RELAY_BUNDLE and len(parts[2]) <= wire.MAX_FRAME_BYTES
            got += wire.unpack_bundle(parts[2])
        assert got == big
    finally:
        relay_sock.close(linger=0)
        coord.close(linger=0)
        ctx.term()


def test_a_process_that_exits_with_its_relay_running_leaves_no_socket_file(relay_dir):
    # Training ends and the interpreter exits with the relay thread (a daemon) still running: its
    # socket file went on piling up in /tmp/torchpass-relay-UID, one per job step and node.
    import subprocess
    import sys

    path = relay_dir / "job7.0-node1.sock"
    code = ("import sys, time\nfrom torchpass.runtime import relay\n"
            f"r = relay.NodeRelay({str(path)!r}, 'tcp://127.0.0.1:1')\nassert r.start()\n"
            "print('bound', flush=True)\ntime.sleep(0.2)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "bound" in out.stdout, out.stderr
    assert not path.exists()
    # ... but not a socket file bound since by another relay on the same path
    other = relay.NodeRelay(str(path), "tcp://127.0.0.1:1")
    assert other.start()
    try:
        stale = relay.NodeRelay(str(path), "tcp://127.0.0.1:1")
        stale._inode = -1  # bound long ago; the file is not its own any more
        stale._remove_socket()
        assert path.exists()
    finally:
        other.stop()
    assert not path.exists()


def test_a_relay_host_sweeps_the_socket_files_nobody_listens_on_any_more(relay_dir):
    # A process ended with os._exit (the examples do; torch 2.13 may abort at exit) or killed runs no
    # atexit handler: the next relay host of the user on the node removes its file once it is old.
    import socket as socket_mod

    dead = relay_dir / "job1.0-node1.sock"
    s = socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM)
    s.bind(str(dead))
    s.close()  # bound, never listening: what a relay killed outright leaves
    live = relay.NodeRelay(str(relay_dir / "job2.0-node1.sock"), "tcp://127.0.0.1:1")
    assert live.start()
    young = relay_dir / "job3.0-node1.sock"
    s = socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM)
    s.bind(str(young))
    s.close()
    other = relay_dir / "notes.sock.txt"
    other.write_text("not a socket")
    try:
        past = os.stat(dead).st_mtime - 120
        for p in (dead, relay_dir / "job2.0-node1.sock"):
            os.utime(p, (past, past), follow_symlinks=False)
        assert relay.sweep_dead(str(relay_dir)) == 1
        assert not dead.exists()  # nobody listens, and old
        assert (relay_dir / "job2.0-node1.sock").exists()  # old, but its relay listens
        assert young.exists() and other.exists()  # too young to tell; not a socket file
    finally:
        live.stop()
