"""tpassd benchmark: drill-to-subscriber detection latency, and the daemon's
CPU and RSS with 8 fake GPUs and 4 fixture IB ports at 1 Hz.

    .venv/bin/python bench/bench_tpassd.py [--drills 30] [--cpu-seconds 60]

tpassd runs as its own process (so its CPU and RSS are its own) on
127.0.0.1 with a private munged. For each drill: wait a random fraction of
the interval (so injections fall at every phase of the sampling tick), send
the authenticated drill, time until the subscriber receives the matching
``tpassd.event``; then clear and wait for healthy. Writes
bench/results/tpassd.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import zmq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from torchpass import wire  # noqa: E402
from torchpass.devcluster.tpassd_node import start_args  # noqa: E402
from tpassd.testing import call, private_munged  # noqa: E402

# kind -> (drill body, component, expected state, how it is detected)
KINDS = {
    "ecc-sbe-storm": ({"kind": "ecc-sbe-storm", "gpu": 3}, "gpu3", "degraded", "NVML event"),
    "xid79": ({"kind": "xid79", "gpu": 5}, "gpu5", "failed", "NVML event"),
    "nvlink-crc": ({"kind": "nvlink-crc", "gpu": 2}, "gpu2", "degraded", "polled"),
    "ib-link-down": ({"kind": "ib-link-down", "port": "1"}, "ib:mlx5_1/1", "failed", "polled"),
}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class Node:
    def __init__(self, tmp: Path, munge_socket: str, interval_s: float):
        self.dir = tmp / f"node-{interval_s:g}"
        argv = start_args("bench1", "127.0.0.1", self.dir, Path(munge_socket), interval_s=interval_s)
        cfg = self.dir / "tpassd.toml"
        text = cfg.read_text()
        for key in ("pub_port", "control_port", "metrics_port"):
            text = "\n".join(f"{key} = 0" if line.startswith(f"{key} =") else line for line in text.splitlines())
        timeout = min(0.5, interval_s / 2)
        cfg.write_text(text + f"\ncollector_timeout_s = {timeout}\n")
        self.log = open(self.dir / "tpassd.log", "wb")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        ports_file = self.dir / "ports.json"
        end = time.monotonic() + 30
        while not ports_file.exists():
            if time.monotonic() > end or self.proc.poll() is not None:
                raise SystemExit(f"tpassd did not start; see {self.dir / 'tpassd.log'}")
            time.sleep(0.05)
        p = json.loads(ports_file.read_text())
        self.ctl = f"tcp://127.0.0.1:{p['control_port']}"
        self.pub = f"tcp://127.0.0.1:{p['pub_port']}"
        self.munge = munge_socket

    def drill(self, body: dict) -> None:
        call(self.ctl, "bench1", "tpassd.drill", body, self.munge, timeout_s=5, retries=0)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def wait_event(sub: zmq.Socket, component: str, state: str, timeout_s: float = 10.0) -> float:
    end = time.monotonic() + timeout_s
    while True:
        left = end - time.monotonic()
        if left <= 0 or not sub.poll(int(left * 1000)):
            raise SystemExit(f"no event {component} -> {state} within {timeout_s} s")
        _topic, frame = sub.recv_multipart()
        t = time.perf_counter()
        b = wire.decode(frame).body
        if b["component"] == component and b["state"] == state:
            return t


def latency_series(node: Node, kinds: list[str], n_each: int, interval_s: float) -> dict[str, list[float]]:
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"tpassd.event")
    sub.connect(node.pub)
    time.sleep(2 * interval_s + 0.5)  # connected and the first ticks done
    while sub.poll(10):
        sub.recv_multipart()
    out: dict[str, list[float]] = {k: [] for k in kinds}
    order = [k for _ in range(n_each) for k in kinds]
    for kind in order:
        body, comp, state, _how = KINDS[kind]
        time.sleep(random.uniform(0, interval_s))
        t0 = time.perf_counter()
        node.drill(body)
        out[kind].append(wait_event(sub, comp, state) - t0)
        node.drill({"kind": "clear"})
        wait_event(sub, "node", "healthy")
    sub.close()
    return out


def cpu_rss(node: Node, seconds: float) -> tuple[float, float]:
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)  # a subscriber taking everything, as a coordinator would
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(node.pub)
    p = psutil.Process(node.proc.pid)
    time.sleep(5)  # warm up
    c0, t0 = p.cpu_times(), time.monotonic()
    end = t0 + seconds
    while time.monotonic() < end:
        while sub.poll(100):
            sub.recv_multipart()
    c1, t1 = p.cpu_times(), time.monotonic()
    rss = p.memory_info().rss / 2**20
    sub.close()
    cpu = (c1.user + c1.system - c0.user - c0.system) / (t1 - t0) * 100
    return cpu, rss


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drills", type=int, default=30, help="drills per kind at the default 1 s interval")
    ap.add_argument("--fast-drills", type=int, default=20, help="drills per kind at 0.25 s")
    ap.add_argument("--cpu-seconds", type=float, default=60)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "tpassd.json")
    args = ap.parse_args()
    random.seed(1)
    kinds = list(KINDS)
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="tpassd-bench-") as tmp, private_munged() as munge:
        node = Node(Path(tmp), munge.socket, 1.0)
        try:
            cpu, rss = cpu_rss(node, args.cpu_seconds)
            lat = latency_series(node, kinds, args.drills, 1.0)
        finally:
            node.stop()
        fast = Node(Path(tmp), munge.socket, 0.25)
        try:
            lat_fast = latency_series(fast, ["ecc-sbe-storm", "nvlink-crc"], args.fast_drills, 0.25)
        finally:
            fast.stop()
    all_lat = [x for xs in lat.values() for x in xs]
    results = {
        "detection_latency_s": {"p50": round(statistics.median(all_lat), 4), "p99": round(pct(all_lat, 0.99), 4),
                                "n": len(all_lat), "interval_s": 1.0},
        "detection_latency_by_kind_s": {
            k: {"how": KINDS[k][3], "p50": round(statistics.median(v), 4), "p99": round(pct(v, 0.99), 4),
                "max": round(max(v), 4), "n": len(v)} for k, v in lat.items()},
        "detection_latency_interval_0.25s": {
            k: {"how": KINDS[k][3], "p50": round(statistics.median(v), 4), "p99": round(pct(v, 0.99), 4),
                "n": len(v)} for k, v in lat_fast.items()},
        "tpassd_cpu_percent": round(cpu, 3),
        "tpassd_rss_mb": round(rss, 1),
        "setup": {"fake_gpus": 8, "nvlinks_per_gpu": 4, "ib_ports": 4, "interval_s": 1.0,
                  "cpu_window_s": args.cpu_seconds, "cpus": psutil.cpu_count(), "python": sys.version.split()[0]},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    d = results["detection_latency_s"]
    print(f"detection latency, drill -> subscriber event, interval 1 s: p50 {d['p50'] * 1000:.0f} ms, "
          f"p99 {d['p99'] * 1000:.0f} ms over {d['n']} drills")
    for k, v in results["detection_latency_by_kind_s"].items():
        print(f"  {k:<14} ({v['how']:<10}) p50 {v['p50'] * 1000:6.0f} ms  p99 {v['p99'] * 1000:6.0f} ms  "
              f"max {v['max'] * 1000:6.0f} ms  n={v['n']}")
    print("at interval 0.25 s:")
    for k, v in results["detection_latency_interval_0.25s"].items():
        print(f"  {k:<14} ({v['how']:<10}) p50 {v['p50'] * 1000:6.0f} ms  p99 {v['p99'] * 1000:6.0f} ms  n={v['n']}")
    print(f"tpassd CPU {results['tpassd_cpu_percent']:.2f}% of one core, RSS {results['tpassd_rss_mb']:.1f} MB "
          f"(8 fake GPUs, 4 IB ports, 1 Hz, {args.cpu_seconds:g} s window)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
