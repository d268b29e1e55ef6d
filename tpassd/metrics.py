"""tpassd's /metrics: its last sample, its counters and the jobs' summaries, as Prometheus text
(``prometheus_client``: one CollectorRegistry of tpassd's own collectors, never the library's
global one, rendered by ``generate_latest()``), served by ``MetricsServer``: one thread for every
connection, a cap on open connections and a time limit on each. Not ``start_http_server``: its
thread per connection let 200 idle connections make 200 threads.

Names follow Prometheus' conventions (docs/tpassd.md, "Metrics", has the table of the names
before them): ``tpassd_<subsystem>_<name>_<base unit>``, ratios not percentages, ``_total`` for
counters, the node's name in ``tpassd_node_info`` (joined on ``instance``) rather than a label of
one family, and one 0/1 series per throttle reason rather than NVML's bit mask.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from torchpass import __version__
from torchpass.health_state import State
from torchpass.job_metrics import (
    MIGRATION_OUTCOMES,
    PAUSE_BUCKETS_S,
    PAUSE_KINDS,
    SNAPSHOT_OUTCOMES,
    JobReport,
    Pauses,
)
from tpassd.collectors.ib_sysfs import COUNTERS as IB_COUNTERS
from tpassd.nvml_provider import THROTTLE_REASONS

log = structlog.get_logger("tpassd.metrics")

G, C = "gauge", "counter"
# (key in a GPU component's metrics, family, type, help, extra labels, scale). A counter's family
# is named without ``_total``: prometheus_client adds it.
GPU_METRICS: list[tuple[str, str, str, str, dict[str, str], float]] = [
    ("ecc_sbe_volatile", "tpassd_gpu_ecc_errors", C,
     "ECC errors by type (sbe = corrected, dbe = uncorrected) and counter "
     "(volatile = since the driver loaded, aggregate = the GPU's lifetime).",
     {"type": "sbe", "counter": "volatile"}, 1),
    ("ecc_dbe_volatile", "tpassd_gpu_ecc_errors", C, "", {"type": "dbe", "counter": "volatile"}, 1),
    ("ecc_sbe_aggregate", "tpassd_gpu_ecc_errors", C, "", {"type": "sbe", "counter": "aggregate"}, 1),
    ("ecc_dbe_aggregate", "tpassd_gpu_ecc_errors", C, "", {"type": "dbe", "counter": "aggregate"}, 1),
    ("retired_pages_sbe", "tpassd_gpu_retired_pages", G, "Retired memory pages by cause.",
     {"cause": "multiple_sbe"}, 1),
    ("retired_pages_dbe", "tpassd_gpu_retired_pages", G, "", {"cause": "dbe"}, 1),
    ("retired_pages_pending", "tpassd_gpu_retired_pages_pending", G,
     "1 if a page retirement waits for a GPU reset.", {}, 1),
    ("remap_correctable", "tpassd_gpu_remapped_rows", G, "Remapped memory rows by cause.",
     {"cause": "correctable"}, 1),
    ("remap_uncorrectable", "tpassd_gpu_remapped_rows", G, "", {"cause": "uncorrectable"}, 1),
    ("remap_pending", "tpassd_gpu_remapped_rows_pending", G, "1 if a row remap waits for a GPU reset.", {}, 1),
    ("remap_failure", "tpassd_gpu_remapped_rows_failure", G, "1 if a row remap failed (no spare rows).", {}, 1),
    ("nvlink_links_active", "tpassd_gpu_nvlink_links_active", G, "NVLinks in the active state.", {}, 1),
    ("pcie_replay", "tpassd_gpu_pcie_replay", C, "PCIe replays.", {}, 1),
    ("temperature_c", "tpassd_gpu_temperature_celsius", G, "GPU core temperature.", {}, 1),
    ("power_w", "tpassd_gpu_power_watts", G, "GPU power draw.", {}, 1),
    ("utilization_gpu", "tpassd_gpu_utilization_ratio", G,
     "Fraction of the last sample period the GPU (kind gpu) or its memory (kind memory) was busy.",
     {"kind": "gpu"}, 0.01),
    ("utilization_memory", "tpassd_gpu_utilization_ratio", G, "", {"kind": "memory"}, 0.01),
    ("lost", "tpassd_gpu_lost", G, "1 if NVML reports the GPU lost.", {}, 1),
]
IB_METRICS: list[tuple[str, str, str, float]] = [
    ("state_code", "tpassd_infiniband_port_state_id", "Port state (4 = ACTIVE).", 1),
    ("phys_state_code", "tpassd_infiniband_port_physical_state_id", "Port physical state (5 = LinkUp).", 1),
    ("rate_gbps", "tpassd_infiniband_rate_bytes_per_second", "Port rate.", 1e9 / 8),
]
HOST_METRICS: list[tuple[str, str, str]] = [
    ("mem_available_bytes", "tpassd_host_memory_available_bytes", "Memory available without swapping."),
    ("mem_total_bytes", "tpassd_host_memory_total_bytes", "Total memory."),
    ("swap_used_bytes", "tpassd_host_swap_used_bytes", "Swap in use."),
    ("load1", "tpassd_host_load1", "1-minute load average."),
]


def _value(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return None


class _Families:
    """Families by name, each made at its first sample with that sample's label names (every
    sample of a family has the same ones), yielded in the order first used."""

    def __init__(self) -> None:
        self._f: dict[str, Metric] = {}
        self._help: dict[str, str] = {}

    def add(self, name: str, type_: str, help_: str, labels: dict[str, Any], value: Any) -> None:
        v = _value(value)
        if v is None:
            return
        fam = self._f.get(name)
        if fam is None:
            cls = CounterMetricFamily if type_ == C else GaugeMetricFamily
            fam = self._f[name] = cls(name, help_ or self._help.get(name, name), labels=list(labels))
        elif help_ and fam.documentation == name:
            fam.documentation = help_
        fam.add_metric([str(x) for x in labels.values()], v)

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._f.values())


@dataclass(frozen=True)
class NodeView:
    """What the node collector renders: tpassd's last sample (None before the first), its counters
    by group, the Xid events seen per (component, xid), and the labels of ``tpassd_node_info``."""

    sample: dict[str, Any] | None
    counters: dict[str, dict[str, int]] = field(default_factory=dict)
    xid_counts: dict[tuple[str, int], int] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)


class NodeCollector(Collector):
    """tpassd's own view of its node: health, collectors, GPUs, InfiniBand ports, the host, and its
    control and publisher counters. Reads memory only (``view()``): cheap enough for the loop thread."""

    def __init__(self, view: Callable[[], NodeView]):
        self._view = view

    def collect(self) -> Iterable[Metric]:
        v = self._view()
        info = InfoMetricFamily("tpassd_node", "The node this tpassd watches (join on instance for its name).",
                                value=v.info)
        yield info
        yield from render_node(v)


def render_node(v: NodeView) -> _Families:
    f = _Families()
    sample = v.sample
    if sample:
        for state in State:
            f.add("tpassd_node_health", G, "1 for the node's current health state.", {"state": state.value},
                  int(sample["state"] == state.value))
        for name, c in sorted(sample["collectors"].items()):
            f.add("tpassd_scrape_collector_duration_seconds", G,
                  "How long the collector took in the last sample.", {"collector": name}, c["duration_s"])
            f.add("tpassd_scrape_collector_success", G, "1 if the collector succeeded in the last sample.",
                  {"collector": name}, int(c["ok"]))
        for comp, c in sorted(sample["components"].items()):
            for state in State:
                f.add("tpassd_component_health", G, "1 for the component's current health state.",
                      {"component": comp, "state": state.value}, int(c["state"] == state.value))
            m = c.get("metrics", {})
            if comp.startswith("gpu"):
                _gpu(f, comp, m)
            elif comp.startswith("ib:"):
                _ib(f, comp, m)
            elif comp == "host":
                _host(f, m)
    for (comp, xid), n in sorted(v.xid_counts.items()):
        f.add("tpassd_gpu_xid_events", C, "Xid events seen since tpassd started.", {"gpu": comp[3:], "xid": xid}, n)
    for name, n in sorted(v.counters.get("control", {}).items()):
        f.add(f"tpassd_control_{name}", C, f"Control requests: {name.replace('_', ' ')}.", {}, n)
    for type_, n in sorted(v.counters.get("published", {}).items()):
        f.add("tpassd_published_messages", C, "Messages published on the PUB socket, by type.", {"type": type_}, n)
    return f


def _gpu(f: _Families, comp: str, m: dict[str, Any]) -> None:
    gl = {"gpu": comp[3:], "uuid": m.get("uuid", "")}
    for key, fam, type_, help_, extra, scale in GPU_METRICS:
        if key in m and _value(m[key]) is not None:
            f.add(fam, type_, help_, {**gl, **extra}, _value(m[key]) * scale)
    mask = m.get("throttle_reasons")
    if isinstance(mask, int) and not isinstance(mask, bool):
        for reason, bit in THROTTLE_REASONS.items():
            f.add("tpassd_gpu_clock_throttle_active", G,
                  "1 while NVML reports this clock throttle (clocks event) reason for the GPU.",
                  {**gl, "reason": reason}, int(bool(mask & bit)))
    for key, value in sorted(m.items()):
        if key.startswith("nvlink.") and not key.endswith(".active"):
            _, link, kind = key.split(".", 2)
            f.add("tpassd_gpu_nvlink_errors", C, "NVLink error counters by link and kind.",
                  {**gl, "link": link, "kind": kind}, value)


def _ib(f: _Families, comp: str, m: dict[str, Any]) -> None:
    dev, _, port = comp[3:].partition("/")
    il = {"device": dev, "port": port}
    for key, fam, help_, scale in IB_METRICS:
        if key in m and _value(m[key]) is not None:
            f.add(fam, G, help_, il, _value(m[key]) * scale)
    for key in IB_COUNTERS:
        if key in m:
            f.add(f"tpassd_infiniband_{key}", C, f"InfiniBand port counter {key}.", il, m[key])


def _host(f: _Families, m: dict[str, Any]) -> None:
    for key, fam, help_ in HOST_METRICS:
        if key in m:
            f.add(fam, G, help_, {}, m[key])
    i = 0
    while f"disk.{i}.path" in m:
        f.add("tpassd_host_directory_free_bytes", G, "Free space in the snapshot directory and disk_paths.",
              {"path": m[f"disk.{i}.path"]}, m.get(f"disk.{i}.free_bytes"))
        i += 1


class JobCollector(Collector):
    """The jobs' summaries their coordinators sent (tpassd/job_reports.py). ``job_labels`` False
    (Slurm's PrivateData hides jobs): one series per family for all jobs together, without
    ``job_id``: gauges and counters summed, the oldest report's age the largest, histograms
    merged."""

    def __init__(self, reports: Callable[[], list[tuple[float, JobReport]]], job_labels: bool):
        self._reports = reports
        self.job_labels = job_labels

    def collect(self) -> Iterable[Metric]:
        return render_jobs(self._reports(), self.job_labels)


def render_jobs(reports: list[tuple[float, JobReport]], job_labels: bool) -> list[Metric]:
    lab = ["job_id"] if job_labels else []
    jobs = GaugeMetricFamily("tpassd_jobs_reporting", "Jobs whose coordinator sent this tpassd a summary lately.",
                             value=len(reports))
    if not reports:
        return [jobs]
    reg = GaugeMetricFamily("tpassd_job_ranks_registered", "Ranks registered with the job's coordinator.", labels=lab)
    exp = GaugeMetricFamily("tpassd_job_ranks_expected", "Ranks the job starts (0: not known yet).", labels=lab)
    age = GaugeMetricFamily("tpassd_job_oldest_report_age_seconds",
                            "The longest any registered rank of the job has not reported.", labels=lab)
    unp = GaugeMetricFamily("tpassd_job_unprotected",
                            "1 if the job cannot be protected (no migration starts); without job_id, how many.",
                            labels=lab)
    mig = CounterMetricFamily("tpassd_job_migrations", "Migrations of the job's ranks ended, by outcome.",
                              labels=[*lab, "outcome"])
    snap = CounterMetricFamily("tpassd_job_snapshots", "Whole-job snapshots ended, by outcome.",
                               labels=[*lab, "outcome"])
    pause = HistogramMetricFamily("tpassd_job_pause_seconds",
                                  "How long training stood still, by what paused it.", labels=[*lab, "kind"])
    groups: dict[tuple[str, ...], list[tuple[float, JobReport]]] = {}
    for since, r in reports:
        groups.setdefault((str(r.job_id),) if job_labels else (), []).append((since, r))
    for key, rs in groups.items():
        reg.add_metric(list(key), sum(r.ranks_registered for _, r in rs))
        exp.add_metric(list(key), sum(r.ranks_expected for _, r in rs))
        # the age the coordinator saw, plus the time since it sent it
        age.add_metric(list(key), max(r.oldest_report_age_s + since if r.ranks_registered else 0.0 for since, r in rs))
        unp.add_metric(list(key), sum(int(r.unprotected) for _, r in rs))
        for outcome in MIGRATION_OUTCOMES:
            mig.add_metric([*key, outcome], sum(r.migrations.get(outcome, 0) for _, r in rs))
        for outcome in SNAPSHOT_OUTCOMES:
            snap.add_metric([*key, outcome], sum(r.snapshots.get(outcome, 0) for _, r in rs))
        for kind in PAUSE_KINDS:
            h = Pauses()
            for _, r in rs:
                if kind in r.pauses:
                    h = h.merged(r.pauses[kind])
            buckets = [(_le(le), float(n)) for le, n in zip(PAUSE_BUCKETS_S, h.buckets, strict=True)]
            pause.add_metric([*key, kind], [*buckets, ("+Inf", float(h.count))], h.sum_s)
    return [jobs, reg, exp, age, unp, mig, snap, pause]


def _le(bound: float) -> str:
    return repr(float(bound))


def registry(node_view: Callable[[], NodeView], job_reports: Callable[[], list[tuple[float, JobReport]]],
             job_labels: bool) -> CollectorRegistry:
    """tpassd's registry: build info, the node, the jobs, and the tpassd process itself."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_BuildInfo())
    reg.register(NodeCollector(node_view))
    reg.register(JobCollector(job_reports, job_labels))
    ProcessCollector(registry=reg)
    return reg


class _BuildInfo(Collector):
    def collect(self) -> Iterable[Metric]:
        yield InfoMetricFamily("tpassd_build", "The tpassd build that serves these metrics.",
                               value={"version": __version__})


def render(reg: CollectorRegistry) -> bytes:
    return generate_latest(reg)


# The HTTP endpoint. One thread serves every connection (a selector loop): a thread per connection
# let 200 idle connections make 200 threads. A connection has REQUEST_TIMEOUT_S to send its request
# and take the answer; past MAX_CONNECTIONS open ones, the oldest is closed for the new one (a
# scraper's request is answered within milliseconds of its connect, so it is never the oldest for
# long). Rendering reads tpassd's last sample from memory: fast enough for the loop thread.
MAX_CONNECTIONS = 64
REQUEST_TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 8192


class _Conn:
    __slots__ = ("sock", "since", "buf", "out")

    def __init__(self, sock: socket.socket, since: float):
        self.sock, self.since, self.buf, self.out = sock, since, bytearray(), b""


def _response(status: str, body: bytes, ctype: str = "text/plain; charset=utf-8") -> bytes:
    head = (f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n")
    return head.encode() + body


class MetricsServer:
    def __init__(self, address: str, port: int, render_fn: Callable[[], bytes | str], *,
                 max_connections: int = MAX_CONNECTIONS, timeout_s: float = REQUEST_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic):
        self._render = render_fn
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self._clock = clock
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._lsock = socket.socket(family, socket.SOCK_STREAM)
        self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._lsock.bind((address, port))
        self._lsock.listen(128)
        self._lsock.setblocking(False)
        self.port = self._lsock.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._lsock, selectors.EVENT_READ, None)
        self._conns: dict[int, _Conn] = {}
        self.counters = {"connections": 0, "evicted": 0, "timed_out": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tpassd-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def open_connections(self) -> int:
        return len(self._conns)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for key, mask in self._sel.select(timeout=0.2):
                    if key.data is None:
                        self._accept()
                    elif mask & selectors.EVENT_READ:
                        self._read(key.data)
                    else:
                        self._write(key.data)
                self._expire()
            except Exception:
                log.exception("metrics loop error")

    def _accept(self) -> None:
        for _ in range(self.max_connections):
            try:
                sock, _addr = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            sock.setblocking(False)
            if len(self._conns) >= self.max_connections:
                oldest = min(self._conns.values(), key=lambda c: c.since)
                self.counters["evicted"] += 1
                self._drop(oldest)
            c = _Conn(sock, self._clock())
            self._conns[sock.fileno()] = c
            self.counters["connections"] += 1
            self._sel.register(sock, selectors.EVENT_READ, c)

    def _read(self, c: _Conn) -> None:
        try:
            data = c.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(c)
            return
        c.buf += data
        if b"\r\n\r\n" not in c.buf and b"\n\n" not in c.buf:
            if len(c.buf) > MAX_REQUEST_BYTES:
                self._answer(c, _response("431 Request Header Fields Too Large", b"request too large\n"))
            return
        line = bytes(c.buf.split(b"\n", 1)[0]).strip().split()
        if len(line) < 2 or line[0] not in (b"GET", b"HEAD"):
            self._answer(c, _response("405 Method Not Allowed", b"only GET /metrics here\n"))
        elif line[1].split(b"?")[0] != b"/metrics":
            self._answer(c, _response("404 Not Found", b"only /metrics here\n"))
        else:
            try:
                body = self._render()
                body = body.encode() if isinstance(body, str) else body
            except Exception:
                log.exception("metrics rendering failed")
                self._answer(c, _response("500 Internal Server Error",
                                          b"metrics rendering failed; see the tpassd log\n"))
                return
            resp = _response("200 OK", body, CONTENT_TYPE_PLAIN_0_0_4)
            if line[0] == b"HEAD":
                resp = resp[:resp.index(b"\r\n\r\n") + 4]
            self._answer(c, resp)

    def _answer(self, c: _Conn, resp: bytes) -> None:
        c.out = resp
        self._sel.modify(c.sock, selectors.EVENT_WRITE, c)
        self._write(c)

    def _write(self, c: _Conn) -> None:
        try:
            n = c.sock.send(c.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(c)
            return
        c.out = c.out[n:]
        if not c.out:
            self._drop(c)

    def _expire(self) -> None:
        cutoff = self._clock() - self.timeout_s
        for c in [c for c in self._conns.values() if c.since <= cutoff]:
            self.counters["timed_out"] += 1
            self._drop(c)

    def _drop(self, c: _Conn) -> None:
        self._conns.pop(c.sock.fileno(), None)
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for c in list(self._conns.values()):
            self._drop(c)
        self._sel.close()
        self._lsock.close()
