"""The rank's control link over one kept connection (torchpass.zmqio.Client).

The link runs its real thread against a stand-in coordinator in another
process (a ROUTER that logs each request's connection identity and answers
ok, or with a pause command), so that the sockets this process holds are the
link's alone: what CRIU would find at a dump.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from test_coordinator_server import RESUME, CommandsDriver
from test_never_left_paused import FALLBACK, FakePG
from torchpass import layout
from torchpass.coordinator import server as srv
from torchpass.coordinator.job_record import JobState
from torchpass.coordinator.server import CoordinatorServer
from torchpass.runtime import control
from torchpass.runtime.pg import Rendezvous

# Answers every request ok; the N-th rank.progress (argv[2], -1: never) gets the pause in argv[1].
PEER = r"""
import json, sys, zmq
from torchpass import wire, zmqio
ctx = zmq.Context()
sock, port = zmqio.bind_router(ctx, "127.0.0.1")
print(port, flush=True)
pause, at, progress = json.loads(sys.argv[1]), int(sys.argv[2]), 0
refuse = sys.argv[3:] == ["refuse-checkpoints"]  # as a coordinator older than rank.checkpoint would
def answer(frame):
    global progress
    msg = wire.decode(frame)
    print(parts[0].hex(), msg.type, flush=True)
    if refuse and msg.type == "rank.checkpoint":
        return wire.encode_error(msg.id, "bad_request", "unknown message type")
    result = {}
    if msg.type == "rank.progress":
        if progress == at:
            result = {"command": pause}
        progress += 1
    return wire.encode_ok(msg.id, result)
while True:
    parts = sock.recv_multipart()
    if parts[1] == wire.RELAY_BUNDLE:  # a node relay's ranks: [relay, mark, bundle]
        items = [(ident, answer(frame)) for ident, frame in wire.unpack_bundle(parts[2])]
        sock.send_multipart([parts[0], wire.RELAY_BUNDLE, wire.pack_bundle(items)])
    else:
        sock.send_multipart(parts[:-1] + [answer(parts[-1])])
"""


class StandInPeer:
    """A stand-in coordinator in a process of its own (the program ``argv[0]``, run with ``-c``):
    its port on the first stdout line, then one line per thing it saw (``parse``)."""

    def __init__(self, argv: list[str]):
        self.proc = subprocess.Popen([sys.executable, "-c", *argv], stdout=subprocess.PIPE, text=True)
        self.endpoint = f"tcp://127.0.0.1:{int(self.proc.stdout.readline())}"
        self.seen: list[tuple] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @staticmethod
    def parse(line: str) -> tuple:
        raise NotImplementedError

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.seen.append(self.parse(line))

    def wait(self, cond, what: str, timeout_s: float = 20.0) -> None:
        end = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < end, f"{what}: not within {timeout_s} s (seen {self.seen[-5:]})"
            time.sleep(0.01)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._reader.join(5)


class Peer(StandInPeer):
    def __init__(self, pause: dict | None = None, at: int = -1, *flags: str):
        super().__init__([PEER, json.dumps(pause), str(at), *flags])

    @staticmethod
    def parse(line: str) -> tuple[str, str]:
        ident, type_ = line.split()  # (connection identity, message type)
        return ident, type_

    def identities(self) -> list[str]:
        return list(dict.fromkeys(i for i, _ in list(self.seen)))


@pytest.fixture
def peers():
    made: list[Peer] = []

    def make(*a, **kw) -> Peer:
        made.append(Peer(*a, **kw))
        return made[-1]

    yield make
    for p in made:
        p.close()


def socket_inodes() -> set[str]:
    """The sockets this process holds (what criu.open_sockets would list)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found.add(target)
    return found


def start_link(endpoint: str, pg=None, **kw) -> control.ControlLink:
    link = control.ControlLink(pg or FakePG(size=2, rank=1), endpoint=endpoint, job_id=7, rank=1, node="n1",
                               interval_s=0.02, paused_interval_s=0.02, request_timeout_s=5.0, **kw)
    link.start()
    return link


def progress(peer: Peer) -> int:
    return sum(t == "rank.progress" for _, t in list(peer.seen))


def test_every_report_goes_over_one_connection(peers):
    # With a REQ socket per request, each request is a new identity at the coordinator's ROUTER,
    # and a TCP connect and handshake each time.
    peer = peers()
    link = start_link(peer.endpoint)
    try:
        peer.wait(lambda: progress(peer) >= 10, "10 progress reports")
    finally:
        link.stop()
    assert [t for _, t in peer.seen][0] == "rank.register"
    assert len(peer.identities()) == 1, peer.seen
    assert link.registered and link.errors == 0


def test_no_socket_survives_the_close_at_the_hold_and_the_next_connection_is_new(peers, tmp_path):
    hold = layout.hold_file(tmp_path, 7, "m1", 1)
    hold.parent.mkdir(parents=True)
    pg = FakePG(size=2, rank=1)
    peer = peers({"command": "pause", "at": 5, "generation": 3, "hold_file": str(hold)}, at=2)
    before = socket_inodes()
    link = start_link(peer.endpoint, pg, state_dir=str(tmp_path))
    try:
        peer.wait(lambda: pg.arms == [(5, 3)], "the pause armed")
        assert socket_inodes() - before  # the kept connection is open while the rank runs
        # the training thread reaches T (ReconfigurablePG calls this after tearing the group down)
        link.on_quiesced(pg, {"next_generation": 3, "sockets": 0, "drain_s": 0.0})
        peer.wait(lambda: link._holding, "the link holding")
        # What the dump needs: no socket left, not even the control link's (CRIU cannot dump one).
        assert socket_inodes() - before == set()
        types = [t for _, t in peer.seen]
        assert types[-1] == "rank.quiesced" and "rank.armed" in types
        assert len(peer.identities()) == 1  # one connection up to the hold
        n = len(peer.seen)
        time.sleep(0.2)
        assert len(peer.seen) == n and link._holding  # nothing sent while held
        hold.touch()  # restored (or the move aborted): the link goes on, on a new connection
        peer.wait(lambda: progress(peer) >= 6, "progress after the hold")
    finally:
        link.stop()
    assert len(peer.identities()) == 2, peer.seen
    assert socket_inodes() - before == set()  # stop() leaves none either


def test_a_forked_child_leaves_the_parents_connection_alone(peers):
    # A DataLoader worker (or any fork of the rank) inherits the link but not its thread; when it
    # exits, the parent goes on reporting on the connection it had.
    peer = peers()
    link = start_link(peer.endpoint)
    try:
        peer.wait(lambda: progress(peer) >= 3, "3 progress reports")
        pid = os.fork()
        if pid == 0:
            time.sleep(0.2)  # the parent reports meanwhile
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        n = progress(peer)
        peer.wait(lambda: progress(peer) >= n + 5, "5 more progress reports")
    finally:
        link.stop()
    assert len(peer.identities()) == 1, peer.seen
    assert link.errors == 0


# ============================================================================
# Long polls while paused
# ============================================================================
class Recording(CommandsDriver):
    """The test's driver, keeping what the ranks reported (serve thread)."""

    def __init__(self, job_id, clock):
        super().__init__(job_id, clock)
        self.fed: list[str] = []

    def feed(self, outcome):
        self.fed.append(type(outcome).__name__)
        super().feed(outcome)


@pytest.fixture
def coordinator():
    driver = Recording(7, time.monotonic)
    server = CoordinatorServer(JobState(job_id=7, spares=1), bind_address="127.0.0.1", wall=lambda: 1e9,
                               driver=driver)
    t = threading.Thread(target=server.serve, daemon=True)
    t.start()
    yield server, f"tcp://127.0.0.1:{server.port}"
    server.stop()
    t.join(5)


def wait_for(cond, what: str, timeout_s: float = 10.0) -> float:
    """Seconds until cond() held."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(0.005)
    return time.monotonic() - t0


def test_a_paused_rank_long_polls_and_its_resume_arrives_at_once(coordinator):
    server, ep = coordinator
    pg = FakePG(size=2, rank=1)
    link = start_link(ep, pg)
    try:
        wait_for(lambda: link.registered and link.wait_max_s == srv.PARK_MIN_S, "registered")
        pg.paused = True  # quiesced at T: every poll now waits at the coordinator
        wait_for(lambda: 1 in server._parked, "a parked poll")
        n = server.counters.get("long_polls", 0)
        time.sleep(1.0)
        # At most one poll per wait_s, not one every 20 ms (~50 in that second with a poll per 20 ms).
        assert server.counters["long_polls"] - n <= 2, server.counters
        server.later(lambda: server.driver.executor.commands.__setitem__(1, dict(RESUME)))
        took = wait_for(lambda: pg.resumes, "the resume")
        assert took < 1.0, f"the resume reached the paused rank {took:.3f} s after it was set"
        assert pg.resumes[0] == (3, Rendezvous("127.0.0.1", 29500))  # (repeated until acknowledged)
        # A report to send gives the wait up at once (the training thread reached T again).
        server.later(lambda: server.driver.executor.commands.clear())
        wait_for(lambda: 1 in server._parked, "a parked poll again")
        time.sleep(0.1)
        link.on_quiesced(pg, {"next_generation": 4, "sockets": 0, "drain_s": 0.0})
        took = wait_for(lambda: "Quiesced" in server.driver.fed, "rank.quiesced at the coordinator", 5.0)
        assert took < 1.0, f"rank.quiesced waited {took:.3f} s behind a long poll"
        wait_for(lambda: 1 in server._parked, "a parked poll after the report")
        t0 = time.monotonic()
    finally:
        link.stop()
    assert time.monotonic() - t0 < 1.0  # stop() gives the long poll up too
    assert link.errors == 0


def test_a_running_rank_long_polls_and_its_pause_arrives_at_once(coordinator):
    # Issue 13: a running rank's report waits at the coordinator for the report interval, so a pause
    # reaches it when it is decided, not in the reply to its next report (up to 5.5 s later at
    # 8,192 ranks). While the poll waits, the control thread sleeps in zmq's poll: no wake-ups.
    server, ep = coordinator
    pg = FakePG(size=2, rank=1)
    link = control.ControlLink(pg, endpoint=ep, job_id=7, rank=1, node="n1", interval_s=3.0,
                               paused_interval_s=0.02, request_timeout_s=5.0)
    asked = [0]
    wants = link._wants_link

    def counted():
        asked[0] += 1
        return wants()

    link._wants_link = counted
    link.start()
    try:
        wait_for(lambda: link.registered and link.wait_max_s == srv.PARK_MIN_S, "registered")
        wait_for(lambda: 1 in server._parked, "a parked report")
        n, a = server.counters.get("long_polls", 0), asked[0]
        time.sleep(1.0)
        assert server.counters.get("long_polls", 0) - n <= 1, server.counters  # one report per interval
        assert asked[0] - a <= 2, asked[0] - a  # not every 10 ms (~100 in that second)
        pause = {"command": "pause", "at": 50, "generation": 3, "deadline_s": 30.0, "fallback": FALLBACK,
                 "join_s": 5.0}
        t0 = time.monotonic()
        server.later(lambda: server.driver.executor.commands.__setitem__(1, dict(pause)))
        took = wait_for(lambda: pg.arms, "the pause")
        assert took < 0.5, f"the pause reached the running rank {took:.3f} s after it was set"
        assert pg.arms[0] == (50, 3)
        # rank.armed leaves at once: given up the next long poll through the wake-up pipe.
        took = wait_for(lambda: "Armed" in server.driver.fed, "rank.armed at the coordinator", 5.0)
        assert time.monotonic() - t0 < 1.0
    finally:
        link.stop()
    assert link.errors == 0


class TimedPG(FakePG):
    def resume(self, gen, rv):
        self.resumed_at = time.time()
        return super().resume(gen, rv)


# A stand-in coordinator, run with python -c: a ROUTER on a free port (printed first), reading
# requests; each script below adds what it does with them.
STAND_IN = r"""
import json, sys, time, zmq
from torchpass import wire, zmqio
ctx = zmq.Context()
sock, port = zmqio.bind_router(ctx, "127.0.0.1")
print(port, flush=True)
while True:
    parts = sock.recv_multipart()
    msg = wire.decode(parts[-1])
"""


# Answers rank.register (and every report) with wait_max_s, but never a rank.progress: a
# coordinator that parks polls and then never answers them (hung, or gone after the pause).
SILENT = STAND_IN + r"""
    print(json.dumps([msg.type, msg.body, time.time()]), flush=True)
    if msg.type != "rank.progress":
        sock.send_multipart(parts[:-1] + [wire.encode_ok(msg.id, {"wait_max_s": 2.0})])
"""


def test_a_long_polling_rank_falls_back_at_its_deadline_when_the_coordinator_never_answers(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SILENT], stdout=subprocess.PIPE, text=True)
    seen: list[tuple[str, dict, float]] = []  # (type, body, wall time received)
    try:
        ep = f"tcp://127.0.0.1:{int(proc.stdout.readline())}"
        reader = threading.Thread(target=lambda: [seen.append(tuple(json.loads(line))) for line in proc.stdout],
                                  daemon=True)
        reader.start()
        pg = TimedPG(size=2, rank=1)
        exits: list[int] = []
        link = control.ControlLink(pg, endpoint=ep, job_id=7, rank=1, node="n1", interval_s=0.05,
                                   paused_interval_s=0.02, request_timeout_s=0.5, state_dir=str(tmp_path),
                                   exit=exits.append)
        link.start()
        try:
            wait_for(lambda: link.registered and link.wait_max_s == 2.0, "registered")
            deadline_s = 1.5
            link._handle({"command": {"command": "pause", "at": 50, "generation": 3, "deadline_s": deadline_s,
                                      "fallback": FALLBACK, "join_s": 5.0}})
            pg.paused = True
            link.on_quiesced(pg, {"next_generation": 3, "sockets": 0, "drain_s": 0.0})
            took = wait_for(lambda: pg.resumes, "the fallback resume", 10.0)
            link.on_resumed(pg, {"rebuild_s": 0.0})  # the rebuild completed: the join watcher ends
        finally:
            link.stop()
        types = [t for t, _, _ in seen]
        # From rank.quiesced (the deadline runs) to the fallback.
        after = [m for m in seen[types.index("rank.quiesced"):] if m[2] < pg.resumed_at]
        waits = [b["wait_s"] for t, b, _ in after if t == "rank.progress" and "wait_s" in b]
        assert waits, seen  # it long-polled while paused
        assert max(waits) <= deadline_s, after  # never past the deadline
        # The deadline still holds: resumed in place by the pause's fallback, within the long
        # poll's time-out of the deadline.
        assert pg.resumes == [(3, Rendezvous("127.0.0.1", 1))]
        assert deadline_s - 0.1 <= took < deadline_s + link.request_timeout_s + 1.0, took
        assert link.fell_back and exits == []
    finally:
        proc.kill()
        proc.wait()


def test_a_checkpoint_report_the_coordinator_refuses_is_dropped_and_holds_up_nothing(peers):
    """A coordinator that does not know rank.checkpoint answers it with an error: the link drops
    the report (never resent), close() does not wait for it, and the reports after it flow."""
    peer = peers(None, -1, "refuse-checkpoints")
    link = start_link(peer.endpoint)
    try:
        peer.wait(lambda: progress(peer) >= 2, "the first reports")
        link.report_checkpoint({"outcome": "completed", "step": 10, "path": "/ckpt/step-000000010"})
        assert link.checkpoints_told(10.0)
        before = progress(peer)
        peer.wait(lambda: progress(peer) >= before + 5, "reports after the refused one")
        assert sum(t == "rank.checkpoint" for _, t in list(peer.seen)) == 1
    finally:
        link.stop()


# Answers rank.register at once with reply_within_s (argv[1]; "" for none) and every later request
# only after 1.2 s: a coordinator busy with a fan-in, as at 8,192 ranks.
SLOW = STAND_IN + r"""
    hint = {"reply_within_s": float(sys.argv[1])} if sys.argv[1] else {}
    print(json.dumps([parts[0].hex(), msg.type]), flush=True)
    if msg.type != "rank.register":
        time.sleep(1.2)
    sock.send_multipart(parts[:-1] + [wire.encode_ok(msg.id, hint)])
"""


@pytest.mark.parametrize("hint", ["3.0", ""])
def test_a_rank_waits_as_long_as_the_coordinator_says_its_answers_may_take(hint):
    """reply_within_s: the rank waits for an answer the larger of its own time-out (0.5 s here) and
    the coordinator's hint, so a slow answer is taken on the same connection instead of given up and
    sent again on a new one; without the hint the same answer is given up on."""
    proc = subprocess.Popen([sys.executable, "-c", SLOW, hint], stdout=subprocess.PIPE, text=True)
    seen: list[tuple[str, str]] = []
    try:
        ep = f"tcp://127.0.0.1:{int(proc.stdout.readline())}"
        threading.Thread(target=lambda: [seen.append(tuple(json.loads(line))) for line in proc.stdout],
                         daemon=True).start()
        link = control.ControlLink(FakePG(size=2, rank=1), endpoint=ep, job_id=7, rank=1, node="n1",
                                   interval_s=0.05, paused_interval_s=0.02, request_timeout_s=0.5)
        link.start()
        try:
            wait_for(lambda: link.registered, "registered")
            wait_for(lambda: sum(t == "rank.progress" for _, t in seen) >= 2, "two reports", 10.0)
        finally:
            link.stop()
        if hint:
            assert link.reply_hint_s == 3.0
            assert link.errors == 0 and link.channel.client.connects == 1  # answered, on the one connection
        else:
            assert link.reply_hint_s == 0.0
            assert len({ident for ident, _ in seen}) >= 2  # given up after 0.5 s: a new connection
    finally:
        proc.kill()
        proc.wait()


# Answers rank.register only after 2.5 s (every rank of a large job registers at once), the rest at once.
SLOW_REGISTER = STAND_IN + r"""
    print(json.dumps([parts[0].hex(), msg.type]), flush=True)
    if msg.type == "rank.register":
        time.sleep(2.5)
    sock.send_multipart(parts[:-1] + [wire.encode_ok(msg.id, {})])
"""


@pytest.mark.parametrize("world", [8192, 2])
def test_a_rank_of_a_large_job_waits_for_its_registration_as_long_as_the_fan_in_may_take(world):
    """Before any answer says reply_within_s, rank.register waits what the coordinator would say
    for the job's size (wire.reply_within_s: 6.1 s at 8,192 ranks; 2 s for 2), so a large job's
    registrations are not given up and sent again while the coordinator works through them."""
    proc = subprocess.Popen([sys.executable, "-c", SLOW_REGISTER], stdout=subprocess.PIPE, text=True)
    seen: list[tuple[str, str]] = []
    try:
        ep = f"tcp://127.0.0.1:{int(proc.stdout.readline())}"
        threading.Thread(target=lambda: [seen.append(tuple(json.loads(line))) for line in proc.stdout],
                         daemon=True).start()
        link = control.ControlLink(FakePG(size=world, rank=1), endpoint=ep, job_id=7, rank=1, node="n1",
                                   interval_s=0.05, paused_interval_s=0.02, request_timeout_s=0.5)
        link.start()
        try:
            if world == 8192:
                wait_for(lambda: link.registered, "registered", 15.0)
            else:  # given up after 2 s, 0.5 s before its answer: sent again on a new connection
                wait_for(lambda: len({i for i, t in seen if t == "rank.register"}) >= 2, "registered again", 15.0)
        finally:
            link.stop()
        if world == 8192:
            assert [t for _, t in seen].count("rank.register") == 1
            assert link.channel.client.connects == 1  # answered, on the one connection
    finally:
        proc.kill()
        proc.wait()
