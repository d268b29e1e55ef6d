"""Why the coordinator's RSS grows with the ranks: libzmq's memory per connection.

    .venv/bin/python bench/bench_zmq_memory.py [--ranks 8192] [--per-node 8] [--messages 1,20,200]

A ROUTER socket in a process of its own (the coordinator's socket, with nothing else: no job
state, no Python objects per peer) answers every request; DEALER peers in another process connect
over TCP to 127.0.0.1 and send 400-byte requests, as ranks do, each waiting for its 300-byte reply.
The ROUTER process's RSS is read before any peer connects and after each number of messages per
connection, for two layouts of the same ranks, side by side in the same run:

* ``per-rank``: one connection per rank (today's runtime: 8,192 connections at 8,192 ranks);
* ``per-node``: one connection per node carrying the messages of its ``--per-node`` ranks (the
  issue's per-node aggregation: 1,024 connections, each with 8 times the messages).

Then the per-rank peers close every connection and open new ones (each rank timing out once, as
the Lazy Pirate client replaces its socket) and send one message each: what that adds.

Results: bench/results/zmq_memory.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import sys
import time
from pathlib import Path
from typing import Any

import zmq

RESULTS = Path(__file__).resolve().parent / "results"
REQUEST, REPLY = b"x" * 400, b"y" * 300


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def router_main(conn) -> None:
    """Answers every request; on the parent's word, says its RSS."""
    _raise_nofile()
    ctx = zmq.Context()
    ctx.max_sockets = 65536
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    conn.send(sock.bind_to_random_port("tcp://127.0.0.1"))
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(conn.fileno(), zmq.POLLIN)
    while True:
        for what, _ in poller.poll():
            if what is sock:
                for _ in range(256):
                    try:
                        parts = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    sock.send_multipart([*parts[:-1], REPLY])
            elif conn.recv() == "rss":
                conn.send(_rss_mb())
            else:
                sock.close(linger=0)
                ctx.term()
                return


def peers_main(port: int, connections: int, conn) -> None:
    """``connections`` DEALERs; on the parent's word each sends N requests, one at a time, or all
    are replaced by new ones (a time-out each)."""
    _raise_nofile()
    ctx = zmq.Context()
    ctx.max_sockets = 65536

    def connect() -> list[zmq.Socket]:
        out = []
        for _ in range(connections):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(f"tcp://127.0.0.1:{port}")
            out.append(d)
        return out

    socks = connect()
    while True:
        cmd = conn.recv()
        if cmd[0] == "send":
            for _ in range(cmd[1]):
                for d in socks:
                    d.send(REQUEST)
                for d in socks:
                    d.recv()
            conn.send("done")
        elif cmd[0] == "replace":
            for d in socks:
                d.close(linger=0)
            socks = connect()
            conn.send("done")
        else:
            for d in socks:
                d.close(linger=0)
            ctx.term()
            return


def _ask(conn, what) -> Any:
    conn.send(what)
    if not conn.poll(600):
        raise RuntimeError(f"no answer to {what!r} in 600 s")
    return conn.recv()


def run_layout(connections: int, per_connection: list[int], replace: bool) -> dict[str, Any]:
    mp_ctx = mp.get_context("spawn")
    r_parent, r_child = mp_ctx.Pipe()
    router = mp_ctx.Process(target=router_main, args=(r_child,), daemon=True)
    router.start()
    port = r_parent.recv()
    base = _ask(r_parent, "rss")
    p_parent, p_child = mp_ctx.Pipe()
    peers = mp_ctx.Process(target=peers_main, args=(port, connections, p_child), daemon=True)
    peers.start()
    row: dict[str, Any] = {"connections": connections, "rss_mb_before": round(base, 1), "after": []}
    sent = 0
    try:
        for n in per_connection:
            _ask(p_parent, ("send", n - sent))
            sent = n
            rss = _ask(r_parent, "rss")
            row["after"].append({"messages_per_connection": n, "rss_mb": round(rss, 1),
                                 "kb_per_connection": round((rss - base) * 1024 / connections, 1)})
        if replace:
            _ask(p_parent, ("replace",))
            _ask(p_parent, ("send", 1))
            time.sleep(1.0)  # the closed connections' disconnects reach the ROUTER
            rss = _ask(r_parent, "rss")
            row["after_replacing_every_connection"] = {
                "rss_mb": round(rss, 1), "kb_per_connection": round((rss - base) * 1024 / connections, 1)}
    finally:
        p_parent.send(("stop",))
        peers.join(30)
        r_parent.send("stop")
        router.join(30)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=8192)
    ap.add_argument("--per-node", type=int, default=8, help="ranks per node (per-node layout)")
    ap.add_argument("--messages", default="1,20,200",
                    help="messages per rank at which RSS is read (comma-separated, increasing)")
    ap.add_argument("--out", type=Path, default=RESULTS / "zmq_memory.json")
    args = ap.parse_args()
    per_rank = [int(s) for s in args.messages.split(",") if s.strip()]
    nodes = args.ranks // args.per_node
    rank_row = run_layout(args.ranks, per_rank, replace=True)
    node_row = run_layout(nodes, [n * args.per_node for n in per_rank], replace=False)
    print(f"ROUTER process alone: {rank_row['rss_mb_before']:.0f} MB")
    print(f"{'messages a rank':>16} | {args.ranks} connections (per rank) | {nodes} connections (per node) | ratio")
    for a, b in zip(rank_row["after"], node_row["after"]):
        grew_a, grew_b = a["rss_mb"] - rank_row["rss_mb_before"], b["rss_mb"] - node_row["rss_mb_before"]
        print(f"{a['messages_per_connection']:>16} | +{grew_a:6.0f} MB ({a['kb_per_connection']:5.1f} KB each)"
              f"      | +{grew_b:5.0f} MB ({b['kb_per_connection']:5.1f} KB each)    | "
              f"{grew_a / max(grew_b, 0.1):.1f}x")
    again = rank_row["after_replacing_every_connection"]
    grew = again["rss_mb"] - rank_row["rss_mb_before"]
    print(f"every per-rank connection replaced once, one message each: +{grew:.0f} MB "
          f"({again['kb_per_connection']:.1f} KB a rank)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "zmq_memory",
                                    "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                    "zmq": zmq.zmq_version(), "pyzmq": zmq.__version__,
                                    "ranks": args.ranks, "per_node": args.per_node,
                                    "per_rank": rank_row, "per_node_layout": node_row}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
