"""Replies to ranks carry the job secret's MAC; a pause's hold file lies where the layout says.

A rank obeys what its coordinator's replies say: pause, hold, and after a hold the coordinator and
secret its hold file names. Whoever answers the rank's socket instead (a server on the coordinator's
port once it is gone, or one a forged hold file points a restored copy at) must not be able to
command it. These tests run the real rank runtime's control link (its own thread, its own
connection) against a stand-in coordinator in another process that answers with forged replies:
the link must drop them with one line and go on training, and must refuse a hold file anywhere
but STATE_DIR/jobs/J/hold/M.rankR. The stand-in seals its genuine replies with its own few lines
of HMAC, so the wire format is checked against a second implementation.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from test_never_left_paused import FakePG
from test_runtime_control import StandInPeer
from torchpass import jobauth, layout
from torchpass.coordinator.job_record import JobState
from torchpass.coordinator.server import CoordinatorServer
from torchpass.runtime import control

SECRET = b"5" * 64
JOB, RANK = 7, 1

# A stand-in coordinator: answers every request with a sealed empty result; the N-th rank.progress
# gets the answers that the plan (argv[2]: {N: [[mode, result], ...]}) gives it, each sent in turn
# for that one request. Prints each request as JSON [type, body].
PEER = r"""
import hashlib, hmac, json, sys, zmq
from torchpass import wire, zmqio
key = sys.argv[1].encode()
plan = {int(k): v for k, v in json.loads(sys.argv[2]).items()}
ctx = zmq.Context()
sock, port = zmqio.bind_router(ctx, "127.0.0.1")
print(port, flush=True)

def seal(k, sender, seq, reply):
    mac = hmac.new(k, b"torchpass-job-reply-v1\0%s\0%d\0%s" % (sender.encode(), seq, reply), hashlib.sha256)
    return reply[:-1] + b',"auth":"job1:%s"}' % mac.hexdigest().encode()

progress = 0
while True:
    parts = sock.recv_multipart()
    msg = wire.decode(parts[-1])
    print(json.dumps([msg.type, msg.body]), flush=True)
    answers = [["good", {}]]
    if msg.type == "rank.progress":
        answers = plan.get(progress, answers)
        progress += 1
    for mode, result in answers:
        reply = wire.encode_ok(msg.id, result)
        if mode == "good":
            reply = seal(key, msg.sender, msg.seq, reply)
        elif mode == "wrong-key":  # sealed by a coordinator with another secret
            reply = seal(b"0" * 64, msg.sender, msg.seq, reply)
        elif mode == "other-seq":  # a genuine seal, of the rank's next try: moved to this one
            reply = seal(key, msg.sender, msg.seq + 1, reply)
        elif mode == "forged-field":  # the right shape, a MAC of the right length that is no MAC
            reply = reply[:-1] + b',"auth":"job1:%s"}' % (b"ab" * 32)
        # "missing": as encoded, no MAC
        sock.send_multipart(parts[:-1] + [reply])
"""


class Peer(StandInPeer):
    def __init__(self, plan: dict[int, list]):
        super().__init__([PEER, SECRET.decode(), json.dumps(plan)])

    @staticmethod
    def parse(line: str) -> tuple[str, dict]:
        return tuple(json.loads(line))

    def of(self, type_: str) -> list[dict]:
        return [b for t, b in list(self.seen) if t == type_]


@pytest.fixture
def peers():
    made: list[Peer] = []

    def make(plan) -> Peer:
        made.append(Peer(plan))
        return made[-1]

    yield make
    for p in made:
        p.close()


def start_link(endpoint: str, pg, state_dir, secret: bytes = SECRET, timeout_s: float = 5.0) -> control.ControlLink:
    link = control.ControlLink(pg, endpoint=endpoint, job_id=JOB, rank=RANK, node="n1", interval_s=0.02,
                               paused_interval_s=0.02, request_timeout_s=timeout_s, auth=jobauth.JobSigner(secret),
                               state_dir=str(state_dir))
    link.start()
    return link


def pause(at: int, gen: int, **kw) -> dict:
    return {"command": {"command": "pause", "at": at, "generation": gen, **kw}}


@pytest.mark.parametrize("mode", ["missing", "wrong-key", "other-seq", "forged-field"])
def test_a_forged_reply_is_dropped_and_the_real_one_taken(peers, tmp_path, capfd, mode):
    # Report 2 is answered twice: first a forged pause (at 5, generation 3), then the genuine
    # empty answer; report 6 gets a genuine pause (at 9, generation 4). A link that obeys
    # the first answer to come arms the forged pause.
    pg = FakePG(size=2, rank=RANK)
    peer = peers({2: [[mode, pause(5, 3)], ["good", {}]], 6: [["good", pause(9, 4)]]})
    link = start_link(peer.endpoint, pg, tmp_path)
    try:
        peer.wait(lambda: pg.arms, "the genuine pause armed")
        peer.wait(lambda: peer.of("rank.armed"), "the rank's rank.armed")
    finally:
        link.stop()
    assert pg.arms == [(9, 4)], "the forged pause was obeyed"
    assert peer.of("rank.armed")[0]["at"] == 9 and peer.of("rank.armed")[0]["accepted"] is True
    # The forged answer was dropped while the try went on: the genuine one answered the same
    # request, nothing timed out, and training was never touched.
    assert link.errors == 0 and link.replies_refused == 1 and link.fell_back is None
    lines = [ln for ln in capfd.readouterr().err.splitlines() if "dropped a reply" in ln]
    assert len(lines) == 1 and lines[0].startswith("torchpass: rank 1: dropped a reply from tcp://"), lines


def test_a_link_of_another_secret_obeys_nothing(peers, tmp_path, capfd):
    # A rank whose coordinator is not the one answering (a server with its own secret on the
    # coordinator's port): every reply is dropped, the rank never registers nor arms, and says so
    # in a few lines (the 1st, 10th, 100th, ... reply dropped), not one per reply.
    pg = FakePG(size=2, rank=RANK)
    peer = peers({0: [["good", pause(5, 3)]]})
    link = start_link(peer.endpoint, pg, tmp_path, secret=b"6" * 64, timeout_s=0.3)
    try:
        peer.wait(lambda: link.replies_refused >= 2, "two replies dropped")
    finally:
        link.stop()
    assert not link.registered and pg.arms == []
    lines = [ln for ln in capfd.readouterr().err.splitlines() if "dropped a reply" in ln]
    assert len(lines) == 1 + (link.replies_refused >= 10), lines


def test_the_real_coordinator_seals_what_the_link_takes(tmp_path):
    # The real coordinator, with the job's secret, and a real link signed with it: every reply
    # (the registration, reports, parked long polls) is sealed for its request and taken.
    server = CoordinatorServer(JobState(job_id=JOB), bind_address="127.0.0.1", job_secret=SECRET)
    t = threading.Thread(target=server.serve, daemon=True)
    t.start()
    pg = FakePG(size=2, rank=RANK)
    link = start_link(f"tcp://127.0.0.1:{server.port}", pg, tmp_path)
    try:
        end = time.monotonic() + 20
        while not (link.registered and server.state.ranks.get(RANK) and server.counters.get("long_polls", 0) >= 3):
            assert time.monotonic() < end, (link.registered, server.counters)
            time.sleep(0.02)
    finally:
        link.stop()
        server.stop()
        t.join(5)
    assert link.replies_refused == 0 and link.errors == 0


def test_sealed_replies_pass_the_node_relay_unchanged(tmp_path):
    # Two ranks of one node behind the relay (rank 0 hosts it) and the real coordinator with the
    # job's secret: the bundles carry the sealed replies through, and both ranks take them.
    relay_dir = tmp_path / "relay"
    relay_dir.mkdir(mode=0o700)
    path = relay_dir / "job7.0-n1.sock"
    server = CoordinatorServer(JobState(job_id=JOB), bind_address="127.0.0.1", job_secret=SECRET)
    t = threading.Thread(target=server.serve, daemon=True)
    t.start()
    links = []
    for rank in (0, 1):
        ln = control.ControlLink(FakePG(size=2, rank=rank), endpoint=f"tcp://127.0.0.1:{server.port}", job_id=JOB,
                                 rank=rank, node="n1", interval_s=0.02, paused_interval_s=0.02,
                                 request_timeout_s=5.0, auth=jobauth.JobSigner(SECRET), state_dir=str(tmp_path),
                                 relay_path=str(path), relay_host=rank == 0)
        ln.start()
        links.append(ln)
    try:
        end = time.monotonic() + 20
        while not (all(ln.registered and ln.channel.via_relay for ln in links) and links[0].channel.relay is not None
                   and links[0].channel.relay.forwarded >= 20):
            assert time.monotonic() < end, [(ln.registered, ln.channel.via_relay, ln.errors) for ln in links]
            time.sleep(0.02)
    finally:
        for ln in links:
            ln.stop()
        server.stop()
        t.join(5)
    assert [(ln.replies_refused, ln.errors) for ln in links] == [(0, 0), (0, 0)]
    assert sorted(server.state.ranks) == [0, 1]


def test_sealing_is_hmac_sha256_of_the_request_and_the_reply():
    sealer = jobauth.ReplySealer(SECRET)
    import hmac

    assert sealer.mac(b"x" * 300) == hmac.new(SECRET, b"x" * 300, "sha256").hexdigest()
    reply = b'{"v":1,"type":"reply","id":"a-1","ok":true,"result":{}}'
    sealed = sealer.seal("0123456789abcdef", 5, reply)
    assert jobauth.open_reply(SECRET, "0123456789abcdef", 5, sealed) == reply
    for sender, seq in (("0123456789abcdef", 6), ("fedcba9876543210", 5)):
        with pytest.raises(jobauth.AuthFailure):
            jobauth.open_reply(SECRET, sender, seq, sealed)
    with pytest.raises(jobauth.AuthFailure):  # a changed byte of the reply
        jobauth.open_reply(SECRET, "0123456789abcdef", 5, sealed.replace(b'"a-1"', b'"a-2"'))


def _elsewhere(tmp_path) -> dict[str, str]:
    sd = tmp_path / "state"
    return {
        "a path of the user's choosing": str(tmp_path / "mine" / "m1.rank1"),
        "another rank's hold file": str(layout.hold_file(sd, JOB, "m1", 0)),
        "another job's hold file": str(layout.hold_file(sd, JOB + 1, "m1", RANK)),
        "out of the hold directory by ..": str(layout.job_dir(sd, JOB) / "hold" / ".." / ".." / "8" / "hold"
                                               / "m1.rank1"),
        "a relative path": f"jobs/{JOB}/hold/m1.rank1",
        "a bad migration id": str(layout.job_dir(sd, JOB) / "hold" / ".m1.rank1"),
    }


HOLD_CASES = ["a path of the user's choosing", "another rank's hold file", "another job's hold file",
              "out of the hold directory by ..", "a relative path", "a bad migration id"]


@pytest.mark.parametrize("case", HOLD_CASES)
def test_a_hold_file_elsewhere_is_refused(peers, tmp_path, capfd, case):
    # A pause that comes sealed (its coordinator is the job's) but names a hold file outside the
    # layout's place for this rank: the file's contents could send a restored copy to another
    # coordinator and secret. The rank refuses the pause as unprotected (rank.armed accepted
    # false, with why), never arms, and trains on. A rank that trusted the hold file would arm and hold.
    hold = _elsewhere(tmp_path)[case]
    pg = FakePG(size=2, rank=RANK)
    peer = peers({2: [["good", pause(5, 3, hold_file=hold)]]})
    link = start_link(peer.endpoint, pg, tmp_path / "state")
    try:
        peer.wait(lambda: peer.of("rank.armed"), "the rank's answer to the pause")
        n = len(peer.of("rank.progress"))
        peer.wait(lambda: len(peer.of("rank.progress")) >= n + 3, "reports after the refusal")
    finally:
        link.stop()
    armed = peer.of("rank.armed")[0]
    assert pg.arms == [] and armed["accepted"] is False and "hold file" in armed["unprotected"], armed
    assert "hold file" in peer.of("rank.progress")[-1]["unprotected"]  # every report says why
    lines = [ln for ln in capfd.readouterr().err.splitlines() if "hold file" in ln]
    assert len(lines) == 1 and "refused" in lines[0], lines


def test_the_layouts_hold_file_is_taken(peers, tmp_path):
    hold = layout.hold_file(tmp_path / "state", JOB, "m1", RANK)
    pg = FakePG(size=2, rank=RANK)
    peer = peers({2: [["good", pause(5, 3, hold_file=str(hold))]]})
    link = start_link(peer.endpoint, pg, tmp_path / "state")
    try:
        peer.wait(lambda: peer.of("rank.armed"), "the rank's answer to the pause")
    finally:
        link.stop()
    assert pg.arms == [(5, 3)] and peer.of("rank.armed")[0]["accepted"] is True
    assert link._hold_file == str(hold)
