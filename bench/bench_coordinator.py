"""Coordinator at scale: the real ``tpass-coordinator`` against simulated ranks and tpassds.

    .venv/bin/python bench/bench_coordinator.py [--sizes 64,512,2048,8192] [--trials 5]

What runs, per size (ranks, 8 per node, plus one hot spare node):

* the real coordinator process, started as the SPANK plugin starts it
  (slurm_spank/coordinator.c: ``--job-id --state-dir --spares --policy
  --ready-fd --secret-fd``, stdout/stderr to the job's coordinator.log, the
  job secret on a pipe), plus ``--bind-address 127.0.0.1``;
* Slurm replaced at the coordinator's own seam, its Slurm CLI backend
  (torchpass.slurm.cli): ``scontrol``/``squeue``/``srun``/``salloc``/
  ``scancel`` on the coordinator's PATH are small shell scripts that print
  the job (RUNNING, every node), the nodes (each with its own loopback
  address 127.77.x.y) and ``{"steps": []}``; ``srun`` (the gated restore
  step launched at the pause) waits for its gate file; a private munged;
* simulated tpassds (one process): per node the real ``tpassd.publisher``
  PUB on ADDR:717 with heartbeats every 1 s (tpassd's default interval)
  and a ROUTER on ADDR:718 answering ``tpassd.health`` (the snapshot) and
  ``tpassd.snapshot`` (``op=dump`` is refused: there is nothing to dump, so
  every fault ends in the coordinator's rollback, a resume in place on the
  source, which exercises the same pause and resume fan-out); munge
  credentials are not verified there;
* simulated ranks in several load-generator processes (one event loop each,
  many sockets), speaking the rank protocol of torchpass.runtime.control:
  ``rank.register``, then ``rank.progress`` every 0.5 s (or less often, as
  the coordinator's ``report_every_s`` asks), each a long poll of that
  interval, as the rank runtime sends it
  (``wait_s``: the coordinator answers at once with a command, else at the
  end of the interval, and the next report goes then; ``--running-poll
  short``: a plain report, the next 0.5 s after its reply, as before); while
  paused a long poll (``wait_s``, 80-100 % of the coordinator's
  ``wait_max_s``: it answers when the rank has a command; given up for a
  report to send), or with
  ``--paused-poll short`` a poll every 0.02 s (or ``paused_every_s``), as
  before; each request signed with the job secret
  (torchpass.jobauth.JobSigner) with a 2 s time-out over one DEALER socket
  per rank kept across requests and replaced after a time-out, as the
  runtime's torchpass.zmqio.Client (``--connection per-request``: a new REQ
  socket per request, as torchpass.zmqio.request); commands from the
  replies are obeyed: ``pause`` -> ``rank.armed``, stop at collective T ->
  ``rank.quiesced`` (ranks of the faulty node then close their sockets and
  wait for the hold file), ``resume`` -> ``rank.resumed``. Collectives
  advance at 40/s in lockstep.

Measured: the coordinator's CPU (fraction of one core) and RSS over a
steady-state window, ``job.status`` latency in that window, the fraction of
rank requests answered (steady state, and over the whole run), then for each
trial (a ``degraded`` event for one node): fault -> first pause command
received by a rank of that node (``decision``), fault -> ``migration.started``
in the coordinator's own event log, pause fan-out (first to last rank
receiving the pause; pause -> every ``rank.quiesced`` answered) and resume
fan-out (first to last rank receiving the resume; -> every ``rank.resumed``
answered). Every phase has a time limit, so every size ends by itself.

Writes bench/results/coordinator.json (sizes merged by ``ranks``) and
bench/results/coordinator.png.
"""

from __future__ import annotations

import argparse
import heapq
import json
import multiprocessing as mp
import os
import random
import resource
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RESULTS = REPO / "bench" / "results"
RANKS_PER_NODE = 8
JOB_ID = 77001
PROGRESS_INTERVAL_S = 0.5  # torchpass.runtime.control defaults
PAUSED_INTERVAL_S = 0.02
MAX_HINT_S = 10.0  # torchpass.runtime.control.MAX_HINT_S
MAX_REPLY_HINT_S = 20.0  # torchpass.runtime.control.MAX_REPLY_HINT_S
REQUEST_TIMEOUT_S = 2.0
OUTBOX_RETRY_S = 0.2
RELAY_RETRY_S = 30.0  # torchpass.runtime.relay.RELAY_RETRY_S
TIMEOUTS_BEFORE_DIRECT = 2  # torchpass.runtime.relay.TIMEOUTS_BEFORE_DIRECT
HOLD_POLL_S = 0.02
HEARTBEAT_S = 1.0  # tpassd's default interval_s
COLLECTIVES_PER_S = 40.0
COLLECTIVES_PER_STEP = 10
SYNC_S = 0.005  # how often a load generator looks at the other ranks (the barrier at T: a store round trip)
PUB_PORT = 717  # torchpass.ports (imported in the children; the addresses differ per node)


def node_name(i: int) -> str:
    return f"sim{i:04d}"


def node_address(i: int) -> str:
    return f"127.77.{i // 200}.{i % 200 + 1}"


def q(xs: list[float], p: float) -> float | None:
    """Percentile ``p`` (0-100) in ms of seconds ``xs``; None when empty."""
    return round(float(np.percentile(np.asarray(xs) * 1000.0, p)), 1) if xs else None


# ============================================================================
# Simulated tpassds (one process, every node)
# ============================================================================
def tpassd_sim(nodes: list[tuple[str, str]], conn) -> None:
    import zmq

    from torchpass import logs, zmqio
    from torchpass.errors import RemoteError
    from torchpass.ports import TPASSD_CONTROL_PORT, TPASSD_PUB_PORT
    from tpassd.publisher import Publisher

    logs.configure("error")  # every refused dump would log a warning
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 65536)
    pubs: dict[str, Publisher] = {}
    routers: dict[Any, tuple[str, dict]] = {}
    served = {"health": 0}
    t0 = time.monotonic()

    def handlers_for(node: str, pub: Publisher) -> dict:
        def health(msg):
            served["health"] += 1
            return {**pub.snapshot(), "checkpoint": {"criu": True, "cuda": False, "bench": "simulated"}}

        def snapshot(msg):
            key = f"snapshot.{msg.body['op']}"
            served[key] = served.get(key, 0) + 1
            if msg.body["op"] == "dump":
                raise RemoteError("failed", f"bench: the simulated tpassd on {node} does not dump")
            return {"node": node, "op": msg.body["op"]}

        return {"tpassd.health": health, "tpassd.snapshot": snapshot}

    try:
        for name, addr in nodes:
            pub = Publisher(ctx, addr, TPASSD_PUB_PORT, name, secrets.token_hex(4), HEARTBEAT_S)
            pubs[name] = pub
            sock, _ = zmqio.bind_router(ctx, addr, TPASSD_CONTROL_PORT)
            routers[sock] = (name, handlers_for(name, pub))
            pub.event(time.time(), "node", "healthy", "unknown", [], "healthy", [], {})
    except zmq.ZMQError as exc:
        conn.send(("error", f"cannot bind a simulated tpassd ({exc}); is port {PUB_PORT} in use on 127.77.*?"))
        return
    conn.send(("ready", len(pubs)))
    names = list(pubs)
    hb_next = [t0 + HEARTBEAT_S * i / len(names) for i in range(len(names))]
    hb_heap = [(t, i) for i, t in enumerate(hb_next)]
    heapq.heapify(hb_heap)
    poller = zmq.Poller()
    for s in routers:
        poller.register(s, zmq.POLLIN)
    poller.register(conn.fileno(), zmq.POLLIN)
    state = {n: "healthy" for n in names}

    def set_state(node: str, new: str) -> float:
        old = state[node]
        state[node] = new
        reasons = ["gpu3: bench: simulated ECC storm"] if new != "healthy" else []
        comps = {"gpu3": {"state": new, "reasons": reasons}}
        pub = pubs[node]
        pub.event(time.time(), "gpu3", new, old, reasons, new, reasons, comps)
        pub.event(time.time(), "node", new, old, reasons, new, reasons, comps)
        return time.monotonic(), time.time()

    while True:
        now = time.monotonic()
        while hb_heap and hb_heap[0][0] <= now:
            t, i = heapq.heappop(hb_heap)
            pubs[names[i]].heartbeat(time.time(), now - t0)
            heapq.heappush(hb_heap, (t + HEARTBEAT_S, i))
        wait = max(0.0, min(hb_heap[0][0] - time.monotonic(), 0.05))
        for s, _ in poller.poll(int(wait * 1000)):
            if s == conn.fileno():
                cmd = conn.recv()
                if cmd[0] == "set":
                    conn.send(set_state(cmd[1], cmd[2]))
                elif cmd[0] == "stats":
                    conn.send(dict(served))
                else:  # stop
                    for p in pubs.values():
                        p.close()
                    for r in routers:
                        r.close(linger=0)
                    ctx.term()
                    conn.send("stopped")
                    return
            else:
                zmqio.serve_one(s, routers[s][1])


# ============================================================================
# Simulated ranks (one load generator process = an event loop over many ranks)
# ============================================================================
class SimRank:
    """One rank as torchpass.runtime.control.ControlLink + ReconfigurablePG behave on the wire."""

    __slots__ = ("rank", "node", "signer", "registered", "outbox", "inflight", "holding", "hold_file",
                 "armed", "waiting", "frozen", "generation", "base_t", "base_c", "armed_reported", "seen", "sock",
                 "hint_s", "paused_hint_s", "wait_max_s", "reply_hint_s", "ident", "idents", "direct_until",
                 "relay_timeouts")

    def __init__(self, rank: int, node: str, signer, t0: float):
        self.rank, self.node, self.signer = rank, node, signer
        self.registered = False
        self.outbox: list[tuple[str, dict]] = []
        self.inflight = None  # (sock, type, body, t_sent, token)
        self.holding = False
        self.hold_file: str | None = None
        self.armed: tuple[int, int] | None = None  # (at, generation)
        self.waiting = False  # at T, waiting for every rank to reach T (group intact)
        self.frozen = False  # torn down at T (rank.quiesced sent)
        self.generation = 0
        self.base_t, self.base_c = t0, 0
        self.armed_reported = None
        self.seen: set = set()  # commands seen, for first-receipt times
        self.sock = None  # persistent DEALER socket (--connection persistent)
        self.hint_s = 0.0  # the coordinator's backpressure hints (report_every_s, paused_every_s)
        self.paused_hint_s = 0.0
        self.wait_max_s = 0.0  # > 0: the coordinator parks long polls (its replies' wait_max_s)
        self.reply_hint_s = 0.0  # the coordinator's reply_within_s (ControlLink.reply_hint_s)
        # --connection relay: this rank's socket identity at its node's relay (a new one after a
        # time-out, as a new ipc connection), and until when it talks to the coordinator itself
        # (ControlLink after TIMEOUTS_BEFORE_DIRECT time-outs in a row through the relay:
        # RELAY_RETRY_S), and how many it had in a row.
        self.idents = 0
        self.ident = b"r%d.0" % rank
        self.direct_until = 0.0
        self.relay_timeouts = 0

    def every(self) -> float:
        """Seconds to the next report, as ControlLink.every_s/paused_every_s choose them."""
        every = max(PROGRESS_INTERVAL_S, self.hint_s)
        return min(max(PAUSED_INTERVAL_S, self.paused_hint_s), every) if self.paused else every

    @property
    def paused(self) -> bool:
        return self.waiting or self.frozen


class LoadGen:
    """Many ranks in one event loop. The job's collectives are coupled through shared memory
    (``wait_at``/``wait_gen``: the T and generation each rank stands at, -1 when running), as in
    a real job: no rank completes collective T+1 while another stands at T (a running rank's count
    stops at T+1, where it blocks), and ranks tear down at T only once every rank has reached it."""

    def __init__(self, endpoint: str, job_id: int, world: int, ranks: range, secret: str, t0: float,
                 persistent: bool, conn, wait_at, wait_gen, long_poll: bool = True, running_long: bool = True,
                 reply_hints: bool = True, relay: bool = False):
        import zmq

        from torchpass import jobauth, wire, zmqio

        self.zmq, self.wire, self.zmqio = zmq, wire, zmqio
        self.endpoint, self.job_id, self.world = endpoint, job_id, world
        self.persistent = persistent or relay
        # One connection per node (torchpass.runtime.relay): every rank's request goes over its
        # node's one DEALER in the envelope the node relay forwards ([rank socket, "", frame]).
        self.relay = relay
        self.node_socks: dict[str, Any] = {}
        self.by_ident: dict[bytes, int] = {}
        self.relay_socks: set[Any] = set()
        self.bundles: dict[Any, list[tuple[bytes, bytes]]] = {}  # node socket -> (identity, frame) to send
        self.long_poll = long_poll  # paused ranks long-poll as the runtime does (else every 20 ms, as before)
        self.running_long = running_long  # running ranks' reports are long polls too (else plain, as before)
        self.reply_hints = reply_hints  # a request waits max(2 s, reply_within_s) (else 2 s, as before)
        self.conn = conn
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, 65536)
        key = jobauth.parse_secret(secret)
        self.ranks = [SimRank(r, node_name(r // RANKS_PER_NODE), jobauth.JobSigner(key), t0) for r in ranks]
        self.wait_at = np.frombuffer(wait_at, dtype=np.int64)
        self.wait_gen = np.frombuffer(wait_gen, dtype=np.int64)
        self.cap: int | None = None  # the most collectives any running rank can have issued now
        self.timers: list[tuple[float, int, int, str]] = []  # (t, seq, rank index, kind)
        self.deadlines: list[tuple[float, int, int]] = []  # (t, token, rank index)
        self.by_sock: dict[Any, int] = {}
        # The ranks' sockets are waited on with epoll over their ZMQ_FDs, as the coordinator's health
        # subscriber does: a zmq.Poller walks all ~1,024 sockets of a generator on every call, and
        # the generators then took the cores the coordinator was measured on. ZMQ_FD is
        # edge-triggered: a socket is read while ZMQ_EVENTS says POLLIN (_unread until then).
        self.epoll = select.epoll()
        self.epoll.register(conn.fileno(), select.EPOLLIN)
        self.by_fd: dict[int, Any] = {}
        self.unread: set[Any] = set()
        self._seq = 0
        self.events: list[tuple[int, str, int, float]] = []  # (rank, kind, generation, t)
        self.totals = self._zero()
        self.window = self._zero()
        self.rtts: list[float] = []  # rank.progress round trips since the last mark
        self.resumed_since: set[int] = set()
        # Relayed requests given up on (ident -> when): a reply that still comes for one is
        # counted late, with how late, so a time-out tells a slow answer from a lost one.
        self.gave_up: dict[bytes, tuple[float, str]] = {}  # identity -> (when, request type)
        self.late_s: list[float] = []
        self.late_types: dict[str, int] = {}
        self.inbox: list[tuple[int, float, Any]] = []  # relayed replies read, not yet handled

    def collectives(self, rk: SimRank, now: float) -> int:
        if rk.paused:
            return rk.base_c
        c = rk.base_c + int((now - rk.base_t) * COLLECTIVES_PER_S)
        return c if self.cap is None else min(c, self.cap)

    def _sync(self, now: float) -> None:
        """Follow the other ranks: the cap on collectives, and the barrier at T."""
        # One copy of each shared array: the other load generators write them meanwhile, and a mask
        # and an index read at two moments saw a -1 as standing (a cap of 0: every running rank of
        # this generator re-based to 0 and fell hundreds of collectives behind the others).
        wait_at, wait_gen = self.wait_at.copy(), self.wait_gen.copy()
        standing = wait_at[wait_at >= 0]
        cap = int(standing.min()) + 1 if standing.size else None
        if cap != self.cap:
            for rk in self.ranks:  # re-base running ranks at what they had issued under the old cap
                if not rk.paused:
                    rk.base_c, rk.base_t = self.collectives(rk, now), now
            self.cap = cap
        targets = {rk.armed for rk in self.ranks if rk.waiting}
        for at, gen in targets:
            if bool(np.all((wait_at == at) & (wait_gen == gen))):
                for i, rk in enumerate(self.ranks):
                    if rk.waiting and rk.armed == (at, gen):
                        self._quiesce(i, now)

    def _stand(self, rk: SimRank, at: int, gen: int) -> None:
        self.wait_at[rk.rank], self.wait_gen[rk.rank] = at, gen

    @staticmethod
    def _zero() -> dict[str, int]:
        return {"sent": 0, "answered": 0, "timeouts": 0, "timeouts_reply_waiting": 0, "timeouts_relayed": 0,
                "timeouts_progress": 0, "timeouts_acks": 0, "error_replies": 0,
                "refused_pauses": 0, "late_replies": 0}

    def _count(self, key: str) -> None:
        self.totals[key] += 1
        self.window[key] += 1

    def _timer(self, t: float, i: int, kind: str = "tick") -> None:
        self._seq += 1
        heapq.heappush(self.timers, (t, self._seq, i, kind))

    # -- requests -----------------------------------------------------------------
    def _send(self, i: int, type_: str, body: dict, now: float) -> None:
        zmq, wire = self.zmq, self.wire
        rk = self.ranks[i]
        id_ = wire.new_id()
        frame = wire.encode(type_, body, id=id_, **rk.signer.envelope(type_, id_, body))
        via_relay = self.relay and now >= rk.direct_until
        if via_relay:  # the node relay's one connection (torchpass.runtime.relay), kept for the run
            sock = self.node_socks.get(rk.node)
            if sock is None:
                sock = self.node_socks[rk.node] = self.zmqio.dealer_socket(self.ctx, self.endpoint)
                self.relay_socks.add(sock)
            # The relay bundles what its ranks send together (wire.RELAY_BUNDLE): sent at the end
            # of this pass of the loop (_flush_bundles), with whatever the node's other ranks sent.
            self.bundles.setdefault(sock, []).append((rk.ident, frame))
        elif self.persistent:  # as torchpass.zmqio.Client: one DEALER kept until a time-out
            sock = rk.sock = rk.sock or self.zmqio.dealer_socket(self.ctx, self.endpoint)
            self.zmqio.send_request(sock, frame)
        else:  # as torchpass.zmqio.request: a REQ socket per request
            sock = self.ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.endpoint)
            sock.send(frame)
        self._seq += 1
        rk.inflight = (sock, type_, body, now, self._seq, id_, via_relay)
        if via_relay:
            self.by_ident[rk.ident] = i
        else:
            self.by_sock[sock] = i
        fd = sock.getsockopt(zmq.FD)
        if self.by_fd.get(fd) is not sock:
            if fd in self.by_fd:  # a closed socket's number, reused
                self.epoll.unregister(fd)
            self.epoll.register(fd, select.EPOLLIN)
            self.by_fd[fd] = sock
        self.unread.add(sock)  # the edge may have come before the registration
        # as ControlLink: rank.register, before any answer said reply_within_s, expects what it would say
        expect = self.wire.reply_within_s(self.world) if type_ == "rank.register" else 0.0
        timeout_s = max(REQUEST_TIMEOUT_S, rk.reply_hint_s or expect) if self.reply_hints else REQUEST_TIMEOUT_S
        heapq.heappush(self.deadlines, (now + timeout_s + body.get("wait_s", 0.0), self._seq, i))
        self._count("sent")

    def _finish(self, i: int, keep: bool) -> None:
        rk = self.ranks[i]
        sock, type_, via_relay = rk.inflight[0], rk.inflight[1], rk.inflight[6]
        rk.inflight = None
        if via_relay:  # the node's connection stays; a time-out: a new ipc connection, and the next
            del self.by_ident[rk.ident]  # try to the coordinator itself (ControlLink._request)
            if not keep:
                self.gave_up[rk.ident] = (time.monotonic(), type_)
                rk.idents += 1
                rk.ident = b"r%d.%d" % (rk.rank, rk.idents)
                rk.relay_timeouts += 1
                if rk.relay_timeouts >= TIMEOUTS_BEFORE_DIRECT:
                    rk.direct_until, rk.relay_timeouts = time.monotonic() + RELAY_RETRY_S, 0
            return
        del self.by_sock[sock]
        if not (keep and self.persistent):
            fd = sock.getsockopt(self.zmq.FD)
            if self.by_fd.get(fd) is sock:
                self.epoll.unregister(fd)
                del self.by_fd[fd]
            self.unread.discard(sock)
            sock.close(linger=0)
            rk.sock = None

    def _tick(self, i: int, now: float) -> None:
        rk = self.ranks[i]
        if rk.inflight is not None:
            return
        if rk.holding:
            if rk.hold_file and os.path.exists(rk.hold_file):
                rk.holding, rk.hold_file = False, None
                self.events.append((rk.rank, "unheld", -1, now))
                self._timer(now, i)
            else:
                self._timer(now + HOLD_POLL_S, i)
            return
        base = {"job_id": self.job_id, "rank": rk.rank}
        if not rk.registered:
            self._send(i, "rank.register", {**base, "world_size": self.world, "node": rk.node,
                                            "pid": 100000 + rk.rank, "generation": 0}, now)
        elif rk.outbox:
            self._send(i, *rk.outbox[0], now)
        else:
            c = self.collectives(rk, now)
            body = {**base, "step": c // COLLECTIVES_PER_STEP, "collectives": c, "node": rk.node}
            if self.long_poll and rk.paused and rk.wait_max_s > 0:  # ControlLink.long_poll_s
                body["wait_s"] = round(rk.wait_max_s * random.uniform(0.8, 1.0), 3)
            elif self.running_long and not rk.paused and rk.wait_max_s > 0:
                body["wait_s"] = round(rk.every(), 3)
            self._send(i, "rank.progress", body, now)

    def _post(self, i: int, type_: str, body: dict, now: float) -> None:
        rk = self.ranks[i]
        rk.outbox.append((type_, {"job_id": self.job_id, "rank": rk.rank, **body}))
        if rk.inflight is not None and "wait_s" in rk.inflight[2]:
            # A long poll is given up for the report (zmqio.Client's abandon): the connection
            # stays, its late answer is dropped by id.
            self._finish(i, keep=True)
        if rk.inflight is None and not rk.holding:
            self._timer(now, i)  # the control thread's condition variable wakes it

    def _reply(self, i: int, now: float, relayed=None) -> None:
        rk = self.ranks[i]
        sock, type_, body, t_sent, _, id_, _ = rk.inflight
        reply, frame = relayed, None
        if relayed is not None:
            pass
        elif self.persistent:
            reply = self.zmqio.recv_reply(sock, id_)
            if reply is None:  # a late reply to an earlier try: the client drops it
                return
        else:
            frame = sock.recv()
        self._count("answered")
        rk.relay_timeouts = 0  # an answer, whichever way: ControlLink._request
        try:
            result = (reply or self.wire.decode_reply(frame)).unwrap()
        except Exception:  # noqa: BLE001 - an error reply: the rank treats it as no reply
            result = None
            self._count("error_replies")
        self._finish(i, keep=True)
        if type_ == "rank.progress" and "wait_s" not in body:
            self.rtts.append(now - t_sent)
        elif type_ == "rank.progress" and not (isinstance(result, dict) and result.get("command")):
            # A long poll waits by design: how late its answer came after the wait it asked for.
            self.rtts.append(max(0.0, now - t_sent - float(body["wait_s"])))
        if result is None:
            self._failed(i, type_, now, body, t_sent)
            return
        if type_ == "rank.register":
            rk.registered = True
            self._handle(i, result, now)
            self._timer(now, i)
            return
        if type_ != "rank.progress":
            rk.outbox.pop(0)
            if type_ == "rank.quiesced":
                self.events.append((rk.rank, "quiesced", body["generation"], now))
            elif type_ == "rank.resumed":
                self.events.append((rk.rank, "resumed", body["generation"], now))
                self.resumed_since.add(rk.rank)
            self._handle(i, result, now)
            if type_ == "rank.quiesced" and body["hold"]:
                rk.holding = True
                self.events.append((rk.rank, "hold", body["generation"], now))
            self._timer(now, i)
            return
        self._handle(i, result, now)
        commanded = isinstance(result, dict) and isinstance(result.get("command"), dict)
        self._timer(now + self._next_poll(rk, body, t_sent, now, commanded), i)

    @staticmethod
    def _next_poll(rk: SimRank, body: dict, t_sent: float, now: float, commanded: bool = False) -> float:
        """Seconds to the next report, as ControlLink._run: after a long poll at once (not twice in
        20 ms; a running rank's poll answered early with no command waits out every()), else every()."""
        if "wait_s" not in body:
            return rk.every()
        spacing = rk.every() if not rk.paused and not commanded else PAUSED_INTERVAL_S
        return max(0.0, spacing - (now - t_sent))

    def _failed(self, i: int, type_: str, now: float, body: dict | None = None, t_sent: float = 0.0) -> None:
        rk = self.ranks[i]
        if type_ == "rank.register":
            self._timer(now + PROGRESS_INTERVAL_S, i)
        elif type_ == "rank.progress":
            self._timer(now + self._next_poll(rk, body or {}, t_sent, now), i)
        else:
            self._timer(now + min(PROGRESS_INTERVAL_S, OUTBOX_RETRY_S), i)

    def _handle(self, i: int, result: dict, now: float) -> None:
        """A command in a reply, as ControlLink._handle and ReconfigurablePG.arm/resume take it."""
        rk = self.ranks[i]
        if isinstance(result, dict):
            rk.hint_s = min(float(result.get("report_every_s") or 0.0), MAX_HINT_S)
            rk.paused_hint_s = min(float(result.get("paused_every_s") or 0.0), MAX_HINT_S)
            rk.wait_max_s = min(float(result.get("wait_max_s") or 0.0), MAX_HINT_S)
            rk.reply_hint_s = min(float(result.get("reply_within_s") or 0.0), MAX_REPLY_HINT_S)
        cmd = result.get("command") if isinstance(result, dict) else None
        if not isinstance(cmd, dict):
            return
        kind = cmd.get("command")
        if kind == "pause":
            at, gen = int(cmd["at"]), int(cmd["generation"])
            if ("pause", at, gen) not in rk.seen:
                rk.seen.add(("pause", at, gen))
                self.events.append((rk.rank, "pause", gen, now))
            if rk.frozen or rk.armed == (at, gen):
                ok = rk.armed == (at, gen)
            elif self.collectives(rk, now) > at or gen <= rk.generation:
                ok = False
            else:  # armed; a rank standing at an earlier T runs on to the new one
                ok = True
                if rk.waiting:
                    rk.waiting = False
                    rk.base_t = now
                    self._stand(rk, -1, -1)
                rk.armed = (at, gen)
                rk.hold_file = cmd.get("hold_file")
                self._timer(now + max(0.0, (at - self.collectives(rk, now)) / COLLECTIVES_PER_S), i,
                            f"reach:{at}:{gen}")
            if (at, gen, ok) != rk.armed_reported:
                rk.armed_reported = (at, gen, ok)
                if not ok:
                    self._count("refused_pauses")
                self._post(i, "rank.armed", {"at": at, "generation": gen, "collectives": self.collectives(rk, now),
                                             "accepted": ok}, now)
        elif kind == "resume":
            gen = int(cmd["generation"])
            if ("resume", gen) not in rk.seen:
                rk.seen.add(("resume", gen))
                self.events.append((rk.rank, "resume", gen, now))
            if rk.armed is None or rk.armed[1] != gen:
                return  # a repeat, or not for this rank
            if rk.frozen:  # torn down: rebuild as gen
                self._post(i, "rank.resumed", {"generation": gen, "collectives": rk.base_c, "rebuild_s": 0.001,
                                               "node": rk.node, "moved": False}, now)
            else:  # T not reached (or not torn down): cancelled, the generation adopted
                self._post(i, "rank.resumed", {"generation": gen, "collectives": self.collectives(rk, now),
                                               "rebuild_s": 0.0, "node": rk.node, "moved": False,
                                               "cancelled": True}, now)
            if rk.paused:
                rk.base_t = now
                self._stand(rk, -1, -1)
            rk.generation = gen
            rk.armed = rk.armed_reported = None
            rk.waiting = rk.frozen = False
            if not rk.holding:
                rk.hold_file = None

    def _reach(self, i: int, kind: str, now: float) -> None:
        """The rank's training thread at collective T: it stands there until every rank has."""
        rk = self.ranks[i]
        _, at, gen = kind.split(":")
        at, gen = int(at), int(gen)
        if rk.armed != (at, gen) or rk.paused:
            return  # cancelled or re-armed meanwhile
        c = self.collectives(rk, now)
        if c < at:  # held back by a rank standing at an earlier T, or early
            self._timer(now + max(0.005, (at - c) / COLLECTIVES_PER_S), i, kind)
            return
        rk.base_c, rk.waiting = at, True
        self._stand(rk, at, gen)
        self.events.append((rk.rank, "at_T", gen, now))

    def _quiesce(self, i: int, now: float) -> None:
        rk = self.ranks[i]
        at, gen = rk.armed
        rk.waiting, rk.frozen = False, True
        self._post(i, "rank.quiesced", {"generation": gen, "collectives": at, "sockets": 0,
                                        "drain_s": 0.0, "node": rk.node, "pid": 100000 + rk.rank,
                                        "hold": rk.hold_file is not None}, now)

    # -- the loop ----------------------------------------------------------------------
    def stats(self, rtts: bool = False) -> dict[str, Any]:
        return {"totals": dict(self.totals), "window": dict(self.window), "late_s": list(self.late_s),
                "late_types": dict(self.late_types),
                "asked_per_s": sum(1.0 / max(PROGRESS_INTERVAL_S, rk.hint_s) for rk in self.ranks),
                "rtts": list(self.rtts) if rtts else [],
                "registered": sum(r.registered for r in self.ranks), "resumed_since": len(self.resumed_since),
                "holding": sum(r.holding for r in self.ranks), "paused": sum(r.paused for r in self.ranks)}

    def command(self, cmd: tuple) -> bool:
        if cmd[0] == "mark":
            self.window, self.rtts, self.resumed_since, self.events = self._zero(), [], set(), []
            self.conn.send("ok")
        elif cmd[0] == "stats":
            self.conn.send(self.stats(rtts=len(cmd) > 1 and cmd[1] == "rtts"))
        elif cmd[0] == "events":
            self.conn.send(self.events)
            self.events = []
        elif cmd[0] == "counts":  # the lowest and highest count of this generator's ranks now
            now = time.monotonic()
            c = [self.collectives(r, now) for r in self.ranks]
            self.conn.send((min(c), max(c)) if c else None)
        elif cmd[0] == "lagging":  # armed ranks not yet standing at T, and what holds them back
            now = time.monotonic()
            wait_at, wait_gen = self.wait_at.copy(), self.wait_gen.copy()
            standing = np.nonzero(wait_at >= 0)[0]
            low = int(standing[np.argmin(wait_at[standing])]) if standing.size else None
            self.conn.send({"cap": self.cap, "standing": int(standing.size),
                            "lowest": None if low is None else (low, int(wait_at[low]), int(wait_gen[low])),
                            "behind": sorted(r.rank for r in self.ranks if not r.paused and r.armed
                                             and self.collectives(r, now) < r.armed[0] - 2)[:64],
                            "ranks": [{"rank": r.rank, "armed": r.armed, "count": self.collectives(r, now),
                                       "base": (r.base_c, round(r.base_t - now, 3)),
                                       "inflight": r.inflight[1] if r.inflight else None, "holding": r.holding,
                                       "outbox": [t for t, _ in r.outbox], "generation": r.generation}
                                      for r in self.ranks if not r.paused][:cmd[1]]})
        elif cmd[0] == "stuck":  # the ranks that did not resume since the mark, as they stand
            self.conn.send([{"rank": r.rank, "armed": r.armed, "waiting": r.waiting, "frozen": r.frozen,
                             "holding": r.holding, "generation": r.generation, "outbox": [t for t, _ in r.outbox],
                             "seen": sorted(map(str, r.seen))[-4:]}
                            for r in self.ranks if r.rank not in self.resumed_since][:cmd[1]])
        else:  # stop
            self.conn.send(self.stats())
            return False
        return True

    def run(self) -> None:
        now = time.monotonic()
        for i in range(len(self.ranks)):  # the ranks start within one interval, as srun starts them
            self._timer(now + PROGRESS_INTERVAL_S * i / len(self.ranks), i)
        conn_fd = self.conn.fileno()
        next_sync = now
        wait_s = 0.0
        while True:
            # The replies first: on a cluster every rank (and every node's relay) reads its own
            # socket while the others work, so a reply that has arrived is read before this loop
            # sends what the replies it read before asked for (1,024 acknowledgments of a pause,
            # signed and sent, took ~0.1 s of this loop before the next reply was read).
            for fd, _ in self.epoll.poll(wait_s):
                if fd == conn_fd:
                    if not self.command(self.conn.recv()):
                        self.ctx.destroy(linger=0)
                        return
                elif (sock := self.by_fd.get(fd)) is not None:
                    self.unread.add(sock)
            for sock in list(self.unread):
                self._read(sock)
            # The relayed replies read in this pass, each stamped when its bundle left the socket:
            # on a cluster each rank has its reply then, and what it does with it (arming, signing
            # its acknowledgment) is its own work, not a delay to the next node's ranks.
            inbox, self.inbox = self.inbox, []
            for i, t_read, reply in inbox:
                self._reply(i, t_read, reply)
            now = time.monotonic()
            while self.deadlines and self.deadlines[0][0] <= now:
                _, token, i = heapq.heappop(self.deadlines)
                rk = self.ranks[i]
                if rk.inflight is not None and rk.inflight[4] == token:
                    sock, type_, body, t_sent = rk.inflight[:4]
                    if (not rk.inflight[6] and not sock.closed
                            and sock.getsockopt(self.zmq.EVENTS) & self.zmq.POLLIN):
                        # Its reply is in the rank's socket, unread: this generator, sharing the
                        # cores with the coordinator, came to it late (a rank process of its own
                        # would likely have read it in time). Still a time-out; counted apart too.
                        self._count("timeouts_reply_waiting")
                    if rk.inflight[6]:
                        self._count("timeouts_relayed")
                    self._count("timeouts_progress" if type_ == "rank.progress" else "timeouts_acks")
                    self._finish(i, keep=False)  # Lazy Pirate: a fresh socket next time
                    self._count("timeouts")
                    self._failed(i, type_, now, body, t_sent)
            while self.timers and self.timers[0][0] <= now:
                _, _, i, kind = heapq.heappop(self.timers)
                if kind == "tick":
                    self._tick(i, now)
                else:
                    self._reach(i, kind, now)
            if now >= next_sync:
                self._sync(now)
                next_sync = now + SYNC_S
            self._flush_bundles()  # each node's requests of this pass, as its relay bundles them
            nxt = min(self.timers[0][0] if self.timers else now + 0.05,
                      self.deadlines[0][0] if self.deadlines else now + 0.05)
            wait_s = 0.0 if self.unread else max(0.0, min(SYNC_S, nxt - time.monotonic()))

    def _flush_bundles(self) -> None:
        """Each node's requests of this pass as one message, as its relay sends them."""
        if not self.bundles:
            return
        bundles, self.bundles = self.bundles, {}
        for sock, items in bundles.items():
            self.zmqio.send_bundle(sock, items)  # as the relay: a full queue drops it, the ranks ask again

    def _read(self, sock) -> None:
        """The replies waiting on ``sock`` (a few per pass); it leaves ``unread`` when it has none."""
        zmq = self.zmq
        if sock in self.relay_socks:
            return self._read_relay(sock)
        for _ in range(8):
            if sock.closed or not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self.unread.discard(sock)
                return
            i = self.by_sock.get(sock)
            if i is None:  # nothing in flight on it: a late reply, dropped as the client drops it
                sock.recv_multipart(zmq.NOBLOCK)
                continue
            self._reply(i, time.monotonic())


    def _read_relay(self, sock) -> None:
        """The replies waiting on a node's connection, each routed to its rank by its socket identity
        as the node relay's ROUTER routes it (a late one, or one to an identity given up, dropped)."""
        zmq = self.zmq
        for _ in range(8):
            if sock.closed or not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self.unread.discard(sock)
                return
            parts = sock.recv_multipart(zmq.NOBLOCK)
            t_read = time.monotonic()
            if len(parts) != 2 or parts[0] != self.wire.RELAY_BUNDLE:
                continue
            for ident, frame in self.wire.unpack_bundle(parts[1]):
                i = self.by_ident.get(ident)
                if i is None:
                    gave_up = self.gave_up.pop(ident, None)
                    if gave_up is not None:  # answered after its rank gave up on it
                        self._count("late_replies")
                        self.late_s.append(t_read - gave_up[0])
                        self.late_types[gave_up[1]] = self.late_types.get(gave_up[1], 0) + 1
                    continue
                try:
                    reply = self.wire.decode_reply(frame)
                except Exception:  # noqa: BLE001 - not a reply: the rank's client drops it
                    continue
                inflight = self.ranks[i].inflight
                if inflight is not None and reply.id == inflight[5]:
                    self.inbox.append((i, t_read, reply))  # handled once every socket was read (run)


def loadgen_main(endpoint, job_id, world, lo, hi, secret, t0, persistent, conn, wait_at, wait_gen,
                 long_poll=True, running_long=True, reply_hints=True, relay=False) -> None:
    lim = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim[1], lim[1]))
    LoadGen(endpoint, job_id, world, range(lo, hi), secret, t0, persistent, conn, wait_at, wait_gen,
            long_poll, running_long, reply_hints, relay).run()


# ============================================================================
# Slurm stand-in: the commands the CLI backend runs
# ============================================================================
SCONTROL = """#!/bin/sh
d=$(dirname "$0")
case "$1 $2" in
  "show job") cat "$d/job.json" ;;
  "show nodes") cat "$d/nodes.json" ;;
  "show hostnames") cat "$d/hostnames" ;;
  update*) exit 0 ;;
  *) echo "bench scontrol: unsupported: $*" >&2; exit 1 ;;
esac
"""
SQUEUE = """#!/bin/sh
d=$(dirname "$0")
case " $* " in *" --steps "*) echo '{"steps": []}' ;; *) cat "$d/job.json" ;; esac
"""
# The gated restore step launched at the pause: wait for the gate (restore_gate's file), then end.
SRUN = """#!/bin/sh
gate=""; prev=""
for a in "$@"; do [ "$prev" = "torchpass.checkpoint.restore_gate" ] && gate="$a"; prev="$a"; done
i=0
while [ -n "$gate" ] && [ ! -s "$gate" ] && [ $i -lt 3000 ]; do sleep 0.2; i=$((i+1)); done
exit 0
"""
SALLOC = "#!/bin/sh\necho 'salloc: bench: no spare to allocate' >&2\nexit 1\n"
SCANCEL = "#!/bin/sh\nexit 0\n"


def fake_slurm(d: Path, nodes: int) -> dict[str, str]:
    """Write the stand-in commands under ``d``; return the coordinator's environment additions."""
    d.mkdir(parents=True)
    names = [node_name(i) for i in range(nodes)]
    nodelist = f"sim[0000-{nodes - 1:04d}]"
    job = {"jobs": [{"job_id": JOB_ID, "name": "bench", "user_name": "root", "user_id": os.getuid(),
                     "job_state": ["RUNNING"], "nodes": nodelist, "batch_host": names[0],
                     "standard_output": str(d / "job.out"), "partition": "bench"}]}
    (d / "job.json").write_text(json.dumps(job))
    (d / "nodes.json").write_text(json.dumps({"nodes": [
        {"name": n, "address": node_address(i), "state": ["ALLOCATED"], "reason": ""} for i, n in enumerate(names)]}))
    (d / "hostnames").write_text("\n".join(names) + "\n")
    (d / "slurm.conf").write_text("ClusterName=bench\n")
    for name, text in (("scontrol", SCONTROL), ("squeue", SQUEUE), ("srun", SRUN), ("salloc", SALLOC),
                       ("scancel", SCANCEL)):
        (d / name).write_text(text)
        (d / name).chmod(0o755)
    return {"PATH": f"{d}:{os.environ.get('PATH', '/usr/bin:/bin')}", "SLURM_CONF": str(d / "slurm.conf"),
            "SLURM_JOB_ID": str(JOB_ID), "SLURM_JOB_NODELIST": nodelist, "TORCHPASS_SLURM_BACKEND": "cli"}


# ============================================================================
# One size
# ============================================================================
class Coordinator:
    """The real tpass-coordinator, started as the plugin starts it."""

    def __init__(self, tmp: Path, nodes: int, secret: str, munge_socket: str, profile: Path | None = None):
        from torchpass import layout

        self.state_dir = tmp / "state"
        jobdir = layout.job_dir(self.state_dir, JOB_ID)
        jobdir.mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHPASS_"))}
        env.update(fake_slurm(tmp / "slurm", nodes), TORCHPASS_MUNGE_SOCKET=munge_socket)
        ready_r, ready_w = os.pipe()
        secret_r, secret_w = os.pipe()
        os.write(secret_w, secret.encode())
        os.close(secret_w)
        exe = shutil.which("tpass-coordinator", path=str(Path(sys.executable).parent)) or "tpass-coordinator"
        argv = [exe, "--job-id", str(JOB_ID), "--state-dir", str(self.state_dir), "--spares", "1",
                "--policy", "default", "--ready-fd", str(ready_w), "--secret-fd", str(secret_r),
                "--bind-address", "127.0.0.1"]
        if profile is not None:  # cProfile writes it when the coordinator exits (SIGTERM: a clean exit)
            argv = [sys.executable, "-m", "cProfile", "-o", str(profile), *argv]
        self.log_path = jobdir / layout.COORDINATOR_LOG
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, env=env, cwd=jobdir, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT, pass_fds=(ready_w, secret_r), start_new_session=True)
        self.ps = psutil.Process(self.proc.pid)  # before any stop()
        os.close(ready_w)
        os.close(secret_r)
        line = b""
        deadline = time.monotonic() + 60
        while not line.endswith(b"\n") and time.monotonic() < deadline:
            chunk = os.read(ready_r, 256)
            if not chunk:
                break
            line += chunk
        os.close(ready_r)
        if not line.startswith(b"tcp://"):
            self.stop()
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"tpass-coordinator did not start (ready line {line!r}); its log ends:\n{tail}")
        self.endpoint = line.decode().strip()
        # tpass-coordinator supervises the coordinator it starts (torchpass.coordinator.supervisor):
        # the figures are the coordinator's, the supervisor's child once it is ready (the
        # supervisor itself measured 0.0 of a core and 43.5 MB at 8,192 ranks).
        children = self.ps.children()
        if children:
            self.ps = children[0]

    def cpu_s(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def rss_mb(self) -> float:
        return self.ps.memory_info().rss / 1e6

    def log_errors(self) -> list[str]:
        """Error lines and tracebacks in the coordinator's log (a bug the load brought out)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        return [ln[:300] for ln in lines if '"level": "error"' in ln or ln.startswith("Traceback")
                or "[error" in ln]

    def parked_sends(self) -> list[dict]:
        """The coordinator's own part of each fan-out: its "command sent to parked polls" lines
        (a pause or a resume to many parked polls: encoded and sent, in seconds)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        out = []
        for ln in lines:
            if '"command sent to parked polls"' in ln:
                try:
                    rec = json.loads(ln)
                    out.append({"command": rec.get("command"), "commanded": rec["commanded"],
                                "seconds": rec["seconds"]})
                except (ValueError, KeyError):
                    pass
        return out

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # as the plugin's epilog stops it
            _, alive = psutil.wait_procs([self.ps], timeout=15)
            for p in alive:
                p.kill()
        self.proc.wait()
        self.log.close()
        return self.proc.returncode


def _ask(conns: list, cmd: tuple, timeout_s: float = 30.0) -> list:
    for c in conns:
        c.send(cmd)
    out = []
    for c in conns:
        if not c.poll(timeout_s):
            raise RuntimeError(f"a load generator did not answer {cmd[0]!r} in {timeout_s:g} s")
        out.append(c.recv())
    return out


def _request(endpoint: str, type_: str, body: dict, timeout_s: float) -> tuple[float, dict | None, str]:
    from torchpass import zmqio
    from torchpass.errors import TorchpassError

    t = time.monotonic()
    try:
        res = zmqio.request(endpoint, type_, body, timeout_s=timeout_s, retries=0)
        return time.monotonic() - t, res, ""
    except TorchpassError as exc:
        return time.monotonic() - t, None, str(exc)


def _fanout(first: dict[tuple[str, int], float], sent: str, acked: str) -> dict[str, Any]:
    """A command's fan-out: each rank's receipt after the first one, and the last acknowledgement."""
    got = [t for (k, _r), t in first.items() if k == sent]
    if not got:
        return {}
    t0 = min(got)
    done = [t for (k, _r), t in first.items() if k == acked]
    out: dict[str, Any] = {f"{sent}_delays_s": [t - t0 for t in got], f"ranks_{acked}": len(done)}
    if done:
        out[f"all_{acked}_s"] = max(done) - t0
    return out


def trial_figures(events: list[tuple[int, str, int, float]], t_fault: float, bad_ranks: set[int]) -> dict[str, Any]:
    """One fault's figures from the ranks' first-receipt times (seconds, monotonic)."""
    first: dict[tuple[str, int], float] = {}
    for r, kind, _gen, t in events:
        first.setdefault((kind, r), t)
    pause = {r: t for (k, r), t in first.items() if k == "pause"}
    out: dict[str, Any] = {"ranks_paused": len(pause)}
    bad = [t for r, t in pause.items() if r in bad_ranks]
    if bad:
        out["decision_s"] = min(bad) - t_fault
    out.update(_fanout(first, "pause", "quiesced"))
    out.update(_fanout(first, "resume", "resumed"))
    return out


def run_size(ranks: int, args, munge_socket: str, connection: str, paused_poll: str = "long",
             running_poll: str = "long", reply_timeout: str = "hinted") -> dict[str, Any]:
    from torchpass.ports import TPASSD_PUB_PORT

    assert TPASSD_PUB_PORT == PUB_PORT
    nodes = ranks // RANKS_PER_NODE + 1  # + the hot spare (the allocation's last node)
    gens = args.generators or max(1, min(16, -(-ranks // 1024)))
    size_deadline = time.monotonic() + args.size_timeout_s
    load_start = os.getloadavg()
    spawn = mp.get_context("spawn")
    secret = secrets.token_hex(32)
    out: dict[str, Any] = {"ranks": ranks, "nodes": nodes - 1, "spare_nodes": 1, "load_generators": gens,
                           "connection": connection, "paused_poll": paused_poll, "running_poll": running_poll,
                           "reply_timeout": reply_timeout,
                           "loadavg_start": [round(x, 2) for x in load_start]}
    procs: list = []
    conns: list = []
    coord = None
    with tempfile.TemporaryDirectory(prefix="tpass-bench-coord-") as tmpd:
        tmp = Path(tmpd)
        try:
            tp_conn, child = spawn.Pipe()
            tp = spawn.Process(target=tpassd_sim, args=([(node_name(i), node_address(i)) for i in range(nodes)],
                                                        child), daemon=True)
            tp.start()
            procs.append(tp)
            if not tp_conn.poll(120):
                raise RuntimeError("the simulated tpassds did not come up in 120 s")
            msg = tp_conn.recv()
            if msg[0] != "ready":
                raise RuntimeError(msg[1])
            coord = Coordinator(tmp, nodes, secret, munge_socket,
                                args.profile / f"coordinator-{ranks}.prof" if args.profile else None)
            out["coordinator_pid"] = coord.ps.pid
            t0 = time.monotonic()
            per = -(-ranks // gens)
            wait_at, wait_gen = spawn.RawArray("q", ranks), spawn.RawArray("q", ranks)
            np.frombuffer(wait_at, dtype=np.int64)[:] = -1  # every rank runs
            np.frombuffer(wait_gen, dtype=np.int64)[:] = -1
            for g in range(gens):
                lo, hi = g * per, min(ranks, (g + 1) * per)
                a, child = spawn.Pipe()
                p = spawn.Process(target=loadgen_main, daemon=True,
                                  args=(coord.endpoint, JOB_ID, ranks, lo, hi, secret, t0,
                                        connection == "persistent", child, wait_at, wait_gen,
                                        paused_poll == "long", running_poll == "long",
                                        reply_timeout == "hinted", connection == "relay"))
                p.start()
                procs.append(p)
                conns.append(a)
            # -- registration ---------------------------------------------------------
            t_reg = time.monotonic()
            registered = 0
            while time.monotonic() - t_reg < args.register_timeout_s:
                registered = sum(s["registered"] for s in _ask(conns, ("stats",)))
                if registered == ranks:
                    break
                time.sleep(0.5)
            out["registered"] = registered
            out["register_s"] = round(time.monotonic() - t_reg, 2)
            print(f"  {ranks} ranks: {registered} registered in {out['register_s']} s", flush=True)
            # -- steady state ------------------------------------------------------------
            time.sleep(args.warmup_s)
            _ask(conns, ("mark",))
            cpu0, w0 = coord.cpu_s(), time.monotonic()
            status_lat: list[float] = []
            status_fail: list[str] = []
            rss_peak = 0.0
            last_seq = 0
            while time.monotonic() - w0 < args.steady_s:
                lat, res, err = _request(coord.endpoint, "job.status", {}, args.status_timeout_s)
                if res is None:
                    status_fail.append(err[:200])
                else:
                    status_lat.append(lat)
                    last_seq = res.get("last_event_seq", last_seq)
                rss_peak = max(rss_peak, coord.rss_mb())
                time.sleep(max(0.0, 1.0 - lat))
            wall = time.monotonic() - w0
            cpu = coord.cpu_s() - cpu0
            rss = coord.rss_mb()
            st = _ask(conns, ("stats", "rtts"))
            win = {k: sum(s["window"][k] for s in st) for k in st[0]["window"]}
            rtts = [x for s in st for x in s["rtts"]]
            done = win["answered"] + win["timeouts"]
            out.update({
                "steady_s": round(wall, 1),
                "cpu_core_fraction": round(cpu / wall, 3),
                "rss_mb": round(rss, 1),
                "rss_peak_mb": round(max(rss_peak, rss), 1),
                "requests_per_s": round(win["sent"] / wall, 1),
                "wanted_per_s": round(ranks / PROGRESS_INTERVAL_S, 1),
                # what the coordinator's backpressure (report_every_s) asked for at the end
                "asked_per_s": round(sum(s["asked_per_s"] for s in st), 1),
                "replies_per_s": round(win["answered"] / wall, 1),
                "replies_fraction": round(win["answered"] / done, 4) if done else 0.0,
                "error_replies": win["error_replies"],
                "progress_p50_ms": q(rtts, 50), "progress_p99_ms": q(rtts, 99),
                "status_p50_ms": q(status_lat, 50), "status_p99_ms": q(status_lat, 99),
                "status_max_ms": q(status_lat, 100),
                "status_answered": f"{len(status_lat)}/{len(status_lat) + len(status_fail)}",
            })
            if status_fail:
                out["status_error"] = status_fail[-1]
            print(f"  {ranks} ranks steady: cpu {out['cpu_core_fraction']:.2f} core, rss {out['rss_mb']} MB, "
                  f"replies {out['replies_per_s']}/s of {out['wanted_per_s']} wanted "
                  f"({out['asked_per_s']} asked) "
                  f"(fraction {out['replies_fraction']}), job.status p50 {out['status_p50_ms']} ms", flush=True)
            # -- faults ------------------------------------------------------------------
            trials: list[dict[str, Any]] = []
            for k in range(args.trials):
                if time.monotonic() + args.trial_timeout_s + 5 > size_deadline:
                    out["trials_skipped"] = args.trials - k
                    break
                node = k % (nodes - 1)
                bad = set(range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE))
                _ask(conns, ("mark",))
                counts = _ask(conns, ("counts",))  # per generator: the lockstep holds (a real job's does)
                tp_conn.send(("set", node_name(node), "degraded"))
                t_fault, wall_fault = tp_conn.recv()
                ok = False
                t_end = t_fault + args.trial_timeout_s
                lagging = None
                while time.monotonic() < t_end:
                    time.sleep(0.2)
                    if sum(s["resumed_since"] for s in _ask(conns, ("stats",))) >= ranks:
                        ok = True
                        break
                    if lagging is None and time.monotonic() > t_fault + 8.0:
                        lagging = _ask(conns, ("lagging", 3))
                        print(f"  after 8 s: {lagging}", flush=True)
                evs = [e for part in _ask(conns, ("events",)) for e in part]
                fig = trial_figures(evs, t_fault, bad)
                fig.update(node=node_name(node), complete=ok, t_wall=wall_fault, counts_at_fault=counts)
                if lagging is not None:
                    fig["after_8s"] = lagging
                if not ok and fig["ranks_paused"]:
                    fig["not_resumed"] = [x for part in _ask(conns, ("stuck", 3)) for x in part][:3]
                    print(f"  not resumed: {fig['not_resumed']}", flush=True)
                trials.append(fig)
                tp_conn.send(("set", node_name(node), "healthy"))
                tp_conn.recv()
                print(f"  {ranks} ranks trial {k}: complete={ok} decision "
                      f"{round(fig.get('decision_s', float('nan')) * 1000, 1)} ms, paused {fig['ranks_paused']}, "
                      f"resumed {fig.get('ranks_resumed', 0)}", flush=True)
                time.sleep(args.cooldown_s)
            _, stres, _ = _request(coord.endpoint, "job.status", {}, 30.0)
            counters = ((stres or {}).get("coordinator") or {}).get("counters") or {}
            # the coordinator's count of rank requests it handled long after they were signed
            out["handled_after"] = {k.removeprefix("rank_requests_handled_after_"): v
                                    for k, v in counters.items() if k.startswith("rank_requests_handled_after_")}
            _, evres, _ = _request(coord.endpoint, "job.events", {"since_seq": last_seq}, 30.0)
            started = [e for e in (evres or {}).get("events", []) if e["kind"] == "migration.started"]
            dec_ev = []
            for tr in trials:
                m = [e["time"] - tr["t_wall"] for e in started
                     if e.get("data", {}).get("node") == tr["node"] and e["time"] >= tr["t_wall"] - 0.001]
                if m:
                    dec_ev.append(min(m))
            dec = [t["decision_s"] for t in trials if "decision_s" in t]
            pdel = [x for t in trials for x in t.get("pause_delays_s", [])]
            rdel = [x for t in trials for x in t.get("resume_delays_s", [])]
            allq = [t["all_quiesced_s"] for t in trials if "all_quiesced_s" in t and t["ranks_quiesced"] == ranks]
            allr = [t["all_resumed_s"] for t in trials if "all_resumed_s" in t and t.get("ranks_resumed") == ranks]
            # The coordinator's own part of each pause's fan-out (encoding and sending it to the
            # ranks' parked polls, from its log), against what the ranks saw (pause_fanout_*, which
            # adds the generators' reading of the replies on the cores they share with it).
            pauses = [x for x in coord.parked_sends() if x["command"] == "pause"]
            sends = [x["seconds"] for x in pauses]
            out["pause_sent_p50_ms"], out["pause_sent_max_ms"] = q(sends, 50), q(sends, 100)
            out["pause_sends"] = len(sends)
            # ranks whose poll was parked when the pause was decided (the others had theirs on its
            # way, or in the coordinator's queue: the pause is the answer to it, when it is read)
            out["pause_parked_ranks"] = [x["commanded"] for x in pauses]
            st = _ask(conns, ("stats",))
            tot = {k: sum(s["totals"][k] for s in st) for k in st[0]["totals"]}
            done = tot["answered"] + tot["timeouts"]
            out.update({
                "trials": len(trials), "trials_complete": sum(t["complete"] for t in trials),
                "decision_p50_ms": q(dec, 50), "decision_p99_ms": q(dec, 99),
                "decision_event_p50_ms": q(dec_ev, 50), "decision_event_p99_ms": q(dec_ev, 99),
                "pause_fanout_p50_ms": q(pdel, 50), "pause_fanout_p99_ms": q(pdel, 99),
                "pause_fanout_max_ms": q(pdel, 100),
                "all_quiesced_p50_ms": q(allq, 50), "all_quiesced_max_ms": q(allq, 100),
                "resume_fanout_p50_ms": q(rdel, 50), "resume_fanout_p99_ms": q(rdel, 99),
                "resume_fanout_max_ms": q(rdel, 100),
                "all_resumed_p50_ms": q(allr, 50), "all_resumed_max_ms": q(allr, 100),
                "trial_details": [{"node": t["node"], "complete": t["complete"], "ranks_paused": t["ranks_paused"],
                                   "decision_ms": q([t["decision_s"]], 50) if "decision_s" in t else None,
                                   "all_quiesced_ms": q([t["all_quiesced_s"]], 50) if "all_quiesced_s" in t else None,
                                   "all_resumed_ms": q([t["all_resumed_s"]], 50) if "all_resumed_s" in t else None,
                                   **({"not_resumed": t["not_resumed"]} if "not_resumed" in t else {})}
                                  for t in trials],
                "refused_pauses": tot["refused_pauses"],
                "requests_total": tot["sent"], "replies_total": tot["answered"], "timeouts_total": tot["timeouts"],
                "timeouts_reply_waiting": tot["timeouts_reply_waiting"],
                # relayed requests answered after their rank gave up (the rest were never answered),
                # and by how much after
                "late_replies": tot["late_replies"],
                "late_by_p50_ms": q([x for s in st for x in s["late_s"]], 50),
                "late_by_max_ms": q([x for s in st for x in s["late_s"]], 100),
                "late_types": {t: sum(s["late_types"].get(t, 0) for s in st)
                               for t in sorted({t for s in st for t in s["late_types"]})},
                # which requests timed out: rank.progress, the rest (register, armed, quiesced,
                # resumed), and how many of them had gone through a node relay
                **{k: tot[k] for k in ("timeouts_progress", "timeouts_acks", "timeouts_relayed")},
                "error_replies_total": tot["error_replies"],
                "replies_fraction_all": round(tot["answered"] / done, 4) if done else 0.0,
                "loadavg_end": [round(x, 2) for x in os.getloadavg()],
                "tpassd_served": _tpassd_stats(tp_conn),
                "generators_cpu_s": None,
            })
        finally:
            gen_cpu = 0.0
            for c, p in zip(conns, procs[1:]):
                try:
                    gen_cpu += sum(psutil.Process(p.pid).cpu_times()[:2])
                    c.send(("stop",))
                    c.poll(10) and c.recv()
                except (OSError, EOFError, psutil.Error):
                    pass
            out["generators_cpu_s"] = round(gen_cpu, 1)
            if coord is not None:
                out["coordinator_exit"] = coord.stop()
                if args.keep_logs:
                    args.keep_logs.mkdir(parents=True, exist_ok=True)
                    shutil.copy(coord.log_path, args.keep_logs / f"coordinator-{ranks}.log")
                errors = coord.log_errors()
                out["coordinator_log_errors"] = len(errors)
                if errors:
                    out["coordinator_log_error_first"] = errors[0]
            if procs:
                try:
                    tp_conn.send(("stop",))
                    tp_conn.poll(10) and tp_conn.recv()
                except (OSError, EOFError):
                    pass
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
                    p.join()
    out["wall_s"] = round(args.size_timeout_s - (size_deadline - time.monotonic()), 1)
    return out


def _tpassd_stats(conn) -> dict:
    conn.send(("stats",))
    return conn.recv() if conn.poll(10) else {}


# ============================================================================
def plot_rows(rows: list[dict[str, Any]], path: Path, before: list[dict[str, Any]] = ()) -> None:
    """The curves of the runtime's protocol (the node relay where measured, else persistent
    connections; long polls where measured), with the protocol before it dotted."""
    def runtime(connection: str) -> list[dict[str, Any]]:
        got = [r for r in rows if r.get("connection", "per-request") == connection]
        got = [r for r in got if r.get("paused_poll") == "long"] or got
        got = [r for r in got if r.get("running_poll") == "long"] or got
        return [r for r in got if r.get("reply_timeout") == "hinted"] or got

    relay, persistent, per_request = runtime("relay"), runtime("persistent"), runtime("per-request")
    if relay:
        plot(relay, path, before, persistent, "a connection per rank")
    else:
        plot(persistent or per_request, path, before, per_request if persistent else [], "per-request sockets")


def plot(rows: list[dict[str, Any]], path: Path, before: list[dict[str, Any]] = (),
         per_request: list[dict[str, Any]] = (), other: str = "per-request sockets") -> None:
    """``per_request``: the rows of the protocol before, dotted, labelled ``other``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: r["ranks"])
    x = [r["ranks"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    for key, label in (("decision_p99_ms", "fault -> pause received (p99)"),
                       ("decision_event_p99_ms", "fault -> decision logged (p99)"),
                       ("pause_fanout_p99_ms", "pause fan-out (p99)"),
                       ("resume_fanout_p99_ms", "resume fan-out (p99)"),
                       ("pause_sent_max_ms", "pause sent by the coordinator (max)"),
                       ("status_p99_ms", "job.status (p99)")):
        pts = [(r["ranks"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    for r in rows:
        if r.get("decision_p99_ms") is None:  # no rank ever saw a pause: nothing to plot
            ax.text(r["ranks"], 0.5, f"no pause\nreached\n{r.get('registered')}/{r['ranks']}\nregistered",
                    transform=ax.get_xaxis_transform(), ha="center", va="center", color="tab:red", fontsize=8)
    for key, label in (("decision_p99_ms", f"pause received, {other}"),
                       ("pause_fanout_p99_ms", f"pause fan-out, {other}")):
        pts = [(r["ranks"], r[key]) for r in per_request if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), ls=":", marker=".", label=label)
    ax.axhline(100, color="grey", ls=":", lw=1)
    ax.axhline(250, color="grey", ls="--", lw=1)
    ax.set(xscale="log", yscale="log", xlabel="ranks", ylabel="ms", title="latency (goals: 100 / 250 ms)")
    ax.legend(fontsize=7)
    ax = axes[1]
    ax.plot(x, [r.get("cpu_core_fraction") for r in rows], marker="o", label="CPU (cores)")
    ax.axhline(0.5, color="grey", ls=":", lw=1)
    ax2 = ax.twinx()
    ax2.plot(x, [r.get("rss_mb") for r in rows], marker="s", color="tab:red", label="RSS (MB)")
    ax2.axhline(500, color="tab:red", ls=":", lw=1)
    ax.set(xscale="log", xlabel="ranks", ylabel="cores", title="coordinator CPU and RSS (goals: 0.5 / 500 MB)")
    ax.set_ylim(0, max(1.05, *(r.get("cpu_core_fraction") or 0 for r in rows)))
    ax2.set_ylim(0, max(550, *(r.get("rss_mb") or 0 for r in rows)))
    ax2.set_ylabel("MB")
    ax.legend(loc="upper left", fontsize=7)
    ax2.legend(loc="lower right", fontsize=7)
    if before:
        bx = [r["ranks"] for r in before]
        ax.plot(bx, [r.get("cpu_core_fraction") for r in before], ls="--", color="grey", label="CPU before")
    if per_request:
        ax.plot([r["ranks"] for r in per_request], [r.get("cpu_core_fraction") for r in per_request], ls=":",
                marker=".", label=f"CPU, {other}")
    ax = axes[2]
    if before:
        ax.plot(bx, [r.get("replies_fraction") for r in before], ls="--", color="grey",
                label="steady state, before")
    if per_request:
        ax.plot([r["ranks"] for r in per_request], [r.get("replies_fraction_all") for r in per_request], ls=":",
                marker=".", label=f"whole run, {other}")
    ax.plot(x, [r.get("replies_fraction") for r in rows], marker="o", label="steady state")
    ax.plot(x, [r.get("replies_fraction_all") for r in rows], marker="s", label="whole run")
    ax.set(xscale="log", ylim=(0, 1.05), xlabel="ranks", ylabel="fraction", title="rank requests answered")
    ax.legend(fontsize=7)
    for a in axes:
        a.set_xlim(min(x) / 1.6, max(x) * 1.6)
        a.set_xticks(x, [str(v) for v in x])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot from --out and exit")
    ap.add_argument("--sizes", default="64,512,2048,8192", help="comma-separated rank counts (multiples of 8)")
    ap.add_argument("--trials", type=int, default=5, help="faults per size")
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--steady-s", type=float, default=15.0, help="steady-state window (CPU, RSS, job.status)")
    ap.add_argument("--register-timeout-s", type=float, default=60.0)
    ap.add_argument("--trial-timeout-s", type=float, default=30.0)
    ap.add_argument("--cooldown-s", type=float, default=1.5)
    ap.add_argument("--status-timeout-s", type=float, default=10.0)
    ap.add_argument("--size-timeout-s", type=float, default=300.0, help="no new trial starts after this")
    ap.add_argument("--generators", type=int, default=0, help="load generator processes (0: one per 1024 ranks)")
    ap.add_argument("--connection", choices=("per-request", "persistent", "relay", "both", "per-node-ab"),
                    default="relay",
                    help="relay: the ranks of a node share one DEALER to the coordinator, as the node relay "
                         "forwards them (torchpass.runtime.relay, what the rank runtime does); "
                         "persistent: one DEALER socket per rank (torchpass.zmqio.Client, "
                         "the runtime before the relay); per-request: a new REQ socket per request "
                         "(torchpass.zmqio.request, the runtime before that); both: per-request, then persistent; "
                         "per-node-ab: persistent, then relay, each size")
    ap.add_argument("--paused-poll", choices=("long", "short", "both"), default="long",
                    help="long: a paused rank's poll carries wait_s and waits at the coordinator for its command "
                         "(what the rank runtime does); short: a poll every 20 ms (or "
                         "paused_every_s), as before; both: each size with short, then long")
    ap.add_argument("--running-poll", choices=("long", "short", "both"), default="long",
                    help="long: a running rank's report carries wait_s (its report interval) and waits at the "
                         "coordinator, which answers it at once with a pause (what the rank runtime "
                         "does); short: a plain report every 0.5 s (or report_every_s), as before; "
                         "both: each size with short, then long")
    ap.add_argument("--reply-timeout", choices=("hinted", "fixed", "both"), default="hinted",
                    help="hinted: a request waits for its answer the larger of 2 s and the coordinator's "
                         "reply_within_s (what the rank runtime does); fixed: 2 s, as before; "
                         "both: each size with fixed, then hinted")
    ap.add_argument("--profile", type=Path, default=None,
                    help="run the coordinator under cProfile; write coordinator-<ranks>.prof here")
    ap.add_argument("--keep-logs", type=Path, default=None, help="copy each size's coordinator.log here")
    ap.add_argument("--out", type=Path, default=RESULTS / "coordinator.json", help="merged by ranks")
    ap.add_argument("--plot", type=Path, default=RESULTS / "coordinator.png", help="'' for none")
    return ap


def main() -> int:
    ap = arg_parser()
    args = ap.parse_args()
    if args.plot_only:
        old = json.loads(args.out.read_text())
        plot_rows(old["sizes"], args.plot, old.get("before", []))
        return 0
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if any(s < 16 or s % RANKS_PER_NODE for s in sizes):
        ap.error("every size must be a multiple of 8, at least 16")
    # Open files, inherited by the coordinator and the load generators: a connection per rank
    # and more (stale ones). Root may raise the hard limit; others get what the hard limit allows.
    want = max(65536, 4 * max(sizes) + 4096)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(want, hard)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        if hard < want:
            print(f"warning: open files limited to {hard}; {max(sizes)} ranks may want {want}", flush=True)
    from tpassd.testing import private_munged

    conns = {"both": ("per-request", "persistent"), "per-node-ab": ("persistent", "relay")}.get(
        args.connection, (args.connection,))
    polls = ("short", "long") if args.paused_poll == "both" else (args.paused_poll,)
    running = ("short", "long") if args.running_poll == "both" else (args.running_poll,)
    replies = ("fixed", "hinted") if args.reply_timeout == "both" else (args.reply_timeout,)

    rows = []
    with private_munged() as munge:
        for n in sizes:
            for connection in conns:
                for poll in polls:
                    for run_poll in running:
                        for reply in replies:
                            print(f"=== {n} ranks, {connection}, {poll} paused polls, {run_poll} running polls, "
                                  f"{reply} reply time-out (load average {os.getloadavg()[0]:.2f})", flush=True)
                            rows.append(run_size(n, args, munge.socket, connection, poll, run_poll, reply))
                            print(json.dumps({k: v for k, v in rows[-1].items()
                                              if not isinstance(v, (list, dict))}), flush=True)
    old = json.loads(args.out.read_text()) if args.out.exists() else {}

    def key(r: dict) -> tuple:  # rows measured before a field existed: what the harness did then
        return (r["ranks"], r.get("connection", "per-request"), r.get("paused_poll", "short"),
                r.get("running_poll", "short"), r.get("reply_timeout", "fixed"))

    done = {key(r) for r in rows}
    merged = sorted([r for r in old.get("sizes", []) if key(r) not in done] + rows, key=key)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "coordinator", "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {"cpus": os.cpu_count(), "memory_gb": round(psutil.virtual_memory().total / 2**30, 1)},
        "client": {"progress_interval_s": PROGRESS_INTERVAL_S, "paused_interval_s": PAUSED_INTERVAL_S,
                   "timeout_s": REQUEST_TIMEOUT_S, "heartbeat_s": HEARTBEAT_S,
                   "collectives_per_s": COLLECTIVES_PER_S},
        # the coordinator of 2026-12-03, before fan-in hints, kept connections and long polls,
        # measured by this harness (kept for the plot)
        **{k: old[k] for k in ("before", "before_generated") if k in old},
        "sizes": merged}, indent=1) + "\n")
    print(f"wrote {args.out}", flush=True)
    if str(args.plot) not in ("", "."):
        plot_rows(merged, args.plot, old.get("before", []))
        print(f"wrote {args.plot}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
