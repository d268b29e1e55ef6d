"""A pause's fan-out in the coordinator: its serve thread answering every parked poll with the command.

    .venv/bin/python bench/bench_fanout.py [--sizes 512,2048,8192] [--repeat 7]

The real ``CoordinatorServer`` on a real ROUTER socket, ``--peers`` DEALER connections whose
envelopes the parked polls take in turn (a ROUTER sends to a connection whatever its identity
says; a connection per rank would only add file descriptors). For each size every rank has a long
poll parked, with the hints a rank.progress reply carries, and a pause command from the executor
(``Executor._do_PauseAt``: one command object for every rank that is not held; two ranks held).
Measured: ``_answer_parked()``, which sends every reply, against the baseline in the same run: the
same replies encoded one by one with ``wire.encode_ok`` and sent (what the server did before it
encoded a shared result once), and ``sealed``: the same ``_answer_parked()`` with the job secret's MAC on every reply
(a coordinator started with a secret, jobauth.ReplySealer; each poll parked with its request's
sender and seq). Median of ``--repeat`` runs each, interleaved. Results: bench/results/fanout.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import zmq

from torchpass import jobauth, wire
from torchpass.coordinator import server as srv
from torchpass.coordinator.state import JobState

RESULTS = Path(__file__).resolve().parent / "results"


class _Executor:
    """What _answer_parked asks of the executor: the commands, one object for the ranks not held."""

    def __init__(self, ranks: int, held: tuple[int, ...]):
        fallback = {"command": "resume", "generation": 3, "master_addr": "10.0.0.1", "master_port": 29517}
        cmd = {"command": "pause", "at": 2308, "generation": 3, "deadline_s": 120.0, "fallback": fallback,
               "join_s": 60.0}
        self.commands: dict[int, dict[str, Any]] = {r: cmd for r in range(ranks)}
        for r in held:
            self.commands[r] = {**cmd, "hold_file": f"/var/lib/torchpass/jobs/42/hold/m1/rank{r}"}

    def command_for(self, rank: int) -> dict[str, Any] | None:
        return self.commands.get(rank)


class _Driver:
    def __init__(self, executor: _Executor):
        self.executor = executor


def _park_all(server: srv.CoordinatorServer, envelopes: list[list[bytes]], ranks: int) -> None:
    hint = srv.Pace(time.monotonic).hint(ranks)
    due = time.monotonic() + 600.0
    for r in range(ranks):
        result = {"wait_max_s": srv.PARK_MIN_S, **hint}  # as _with_command builds a progress reply
        server._park(r, srv._Parked(envelopes[r % len(envelopes)], f"{r:08x}{r:024x}", result, due,
                                    (f"{r:016x}", r + 1)))


def _baseline(server: srv.CoordinatorServer, ex: _Executor) -> None:
    """The replies as the server sent them before: each encoded by itself."""
    for rank in list(server._parked):
        parked = server._parked.pop(rank)
        server._send(parked.envelope, wire.encode_ok(parked.msg_id, {**parked.result,
                                                                      "command": ex.command_for(rank)}))
    server._park_due.clear()


def _drain(peers: list[zmq.Socket], expect: int) -> int:
    """Read what the peers got (every reply must arrive: the figures count sends that were made)."""
    got = 0
    poller = zmq.Poller()
    for p in peers:
        poller.register(p, zmq.POLLIN)
    end = time.monotonic() + 30.0
    while got < expect and time.monotonic() < end:
        for sock, _ in poller.poll(200):
            while True:
                try:
                    parts = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                reply = wire.decode_reply(parts[-1])
                assert reply.ok and reply.result["command"]["command"] == "pause", reply
                got += 1
    return got


def run_size(ranks: int, repeat: int, peers_n: int) -> dict[str, Any]:
    ctx = zmq.Context()
    server = srv.CoordinatorServer(JobState(job_id=42, spares=0), bind_address="127.0.0.1", context=ctx)
    ex = _Executor(ranks, held=(0, 1))
    server.driver = _Driver(ex)
    server.sock.setsockopt(zmq.SNDHWM, 0)
    peers = []
    for _ in range(peers_n):
        p = ctx.socket(zmq.DEALER)
        p.setsockopt(zmq.RCVHWM, 0)
        p.setsockopt(zmq.LINGER, 0)
        p.connect(f"tcp://127.0.0.1:{server.port}")
        p.send_multipart([b"", b"hello"])
        peers.append(p)
    envelopes = [server.sock.recv_multipart()[:-1] for _ in peers]
    times: dict[str, list[float]] = {"baseline": [], "server": [], "sealed": []}
    sealer = jobauth.ReplySealer(b"5" * 64)
    try:
        for _ in range(repeat):
            for kind in ("baseline", "server", "sealed"):
                _park_all(server, envelopes, ranks)
                server.sealer = sealer if kind == "sealed" else None
                t = time.perf_counter()
                if kind in ("server", "sealed"):
                    server._answer_parked()
                else:
                    _baseline(server, ex)
                times[kind].append(time.perf_counter() - t)
                got = _drain(peers, ranks)
                if got != ranks or server._parked:
                    raise RuntimeError(f"{kind}: {got} of {ranks} replies arrived, {len(server._parked)} left parked")
    finally:
        for p in peers:
            p.close(linger=0)
        server.sock.close(linger=0)
        ctx.term()
    base, new = statistics.median(times["baseline"]), statistics.median(times["server"])
    sealed = statistics.median(times["sealed"])
    return {"ranks": ranks, "repeat": repeat, "peers": peers_n,
            "baseline_ms": round(base * 1000, 1), "server_ms": round(new * 1000, 1),
            "sealed_ms": round(sealed * 1000, 1), "sealed_us_per_reply": round(sealed / ranks * 1e6, 2),
            "sealed_runs_ms": [round(x * 1000, 1) for x in times["sealed"]],
            "baseline_us_per_reply": round(base / ranks * 1e6, 2), "server_us_per_reply": round(new / ranks * 1e6, 2),
            "speedup": round(base / new, 2),
            "baseline_runs_ms": [round(x * 1000, 1) for x in times["baseline"]],
            "server_runs_ms": [round(x * 1000, 1) for x in times["server"]]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="512,2048,8192", help="comma-separated rank counts")
    ap.add_argument("--repeat", type=int, default=7, help="runs of each path per size (median)")
    ap.add_argument("--peers", type=int, default=256, help="DEALER connections the replies go to")
    ap.add_argument("--out", type=Path, default=RESULTS / "fanout.json")
    args = ap.parse_args()
    rows = []
    for n in (int(s) for s in args.sizes.split(",") if s.strip()):
        row = run_size(n, args.repeat, args.peers)
        rows.append(row)
        print(f"{n:>6} ranks: fan-out {row['server_ms']:.1f} ms ({row['server_us_per_reply']:.1f} us a reply), "
              f"baseline (each reply encoded by itself) {row['baseline_ms']:.1f} ms "
              f"({row['baseline_us_per_reply']:.1f} us): {row['speedup']:.2f}x; sealed {row['sealed_ms']:.1f} ms "
              f"({row['sealed_us_per_reply']:.1f} us a reply)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "fanout",
                                    "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                    "sizes": rows}, indent=1) + "\n")
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
