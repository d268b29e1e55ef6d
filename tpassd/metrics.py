"""Prometheus text exposition of tpassd's last sample (node_exporter-style
names: ``tpassd_<subsystem>_<name>_<unit>``, ``_total`` for counters, one
HELP and TYPE line per family). Served over HTTP by one thread (``MetricsServer``), with a cap
on open connections and a time limit on each."""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from torchpass.health_state import State

log = structlog.get_logger("tpassd.metrics")

# (metric key in the sample, family, type, help, extra labels)
GPU_METRICS: list[tuple[str, str, str, str, dict[str, str]]] = [
    ("ecc_sbe_volatile", "tpassd_gpu_ecc_errors", "gauge",
     "ECC errors by type (sbe = corrected, dbe = uncorrected) and counter "
     "(volatile = since driver load, aggregate = lifetime).",
     {"type": "sbe", "counter": "volatile"}),
    ("ecc_dbe_volatile", "tpassd_gpu_ecc_errors", "gauge", "", {"type": "dbe", "counter": "volatile"}),
    ("ecc_sbe_aggregate", "tpassd_gpu_ecc_errors", "gauge", "", {"type": "sbe", "counter": "aggregate"}),
    ("ecc_dbe_aggregate", "tpassd_gpu_ecc_errors", "gauge", "", {"type": "dbe", "counter": "aggregate"}),
    ("retired_pages_sbe", "tpassd_gpu_retired_pages", "gauge", "Retired memory pages by cause.",
     {"cause": "multiple_sbe"}),
    ("retired_pages_dbe", "tpassd_gpu_retired_pages", "gauge", "", {"cause": "dbe"}),
    ("retired_pages_pending", "tpassd_gpu_retired_pages_pending", "gauge",
     "1 if a page retirement waits for a GPU reset.", {}),
    ("remap_correctable", "tpassd_gpu_remapped_rows", "gauge", "Remapped memory rows by cause.",
     {"cause": "correctable"}),
    ("remap_uncorrectable", "tpassd_gpu_remapped_rows", "gauge", "", {"cause": "uncorrectable"}),
    ("remap_pending", "tpassd_gpu_remapped_rows_pending", "gauge", "1 if a row remap waits for a GPU reset.", {}),
    ("remap_failure", "tpassd_gpu_remapped_rows_failure", "gauge", "1 if a row remap failed (no spare rows).", {}),
    ("nvlink_links_active", "tpassd_gpu_nvlink_links_active", "gauge", "NVLinks in the active state.", {}),
    ("pcie_replay", "tpassd_gpu_pcie_replay_total", "counter", "PCIe replay counter.", {}),
    ("temperature_c", "tpassd_gpu_temperature_celsius", "gauge", "GPU core temperature.", {}),
    ("power_w", "tpassd_gpu_power_watts", "gauge", "GPU power draw.", {}),
    ("throttle_reasons", "tpassd_gpu_clock_throttle_reasons", "gauge", "NVML clock throttle reason bit mask.", {}),
    ("utilization_gpu", "tpassd_gpu_utilization_percent", "gauge", "GPU utilization by kind.", {"kind": "gpu"}),
    ("utilization_memory", "tpassd_gpu_utilization_percent", "gauge", "", {"kind": "memory"}),
    ("lost", "tpassd_gpu_lost", "gauge", "1 if NVML reports the GPU lost.", {}),
]
NVLINK_KEYS = {"crc_flit": "crc_flit", "crc_data": "crc_data", "replay": "replay", "recovery": "recovery"}
IB_METRICS = [
    ("state_code", "tpassd_infiniband_port_state_id", "gauge", "Port state (4 = ACTIVE)."),
    ("phys_state_code", "tpassd_infiniband_port_physical_state_id", "gauge", "Port physical state (5 = LinkUp)."),
    ("rate_gbps", "tpassd_infiniband_rate_gigabits_per_second", "gauge", "Port rate."),
]
HOST_METRICS = [
    ("mem_available_bytes", "tpassd_host_memory_available_bytes", "gauge", "Memory available without swapping."),
    ("mem_total_bytes", "tpassd_host_memory_total_bytes", "gauge", "Total memory."),
    ("swap_used_bytes", "tpassd_host_swap_used_bytes", "gauge", "Swap in use."),
    ("load1", "tpassd_host_load1", "gauge", "1-minute load average."),
]


def _esc(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(d: dict[str, Any]) -> str:
    if not d:
        return ""
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in d.items()) + "}"


def _num(v: Any) -> str | None:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, (int, float)):
        return repr(float(v)) if isinstance(v, float) else str(v)
    return None


class _Families:
    def __init__(self) -> None:
        self.meta: dict[str, tuple[str, str]] = {}
        self.rows: dict[str, list[str]] = {}

    def add(self, family: str, type_: str, help_: str, labels: dict[str, Any], value: Any) -> None:
        v = _num(value)
        if v is None:
            return
        if family not in self.meta or (help_ and not self.meta[family][1]):
            self.meta[family] = (type_, help_ or self.meta.get(family, ("", ""))[1])
        self.rows.setdefault(family, []).append(f"{family}{_labels(labels)} {v}")

    def render(self) -> str:
        out = []
        for fam, rows in self.rows.items():
            type_, help_ = self.meta[fam]
            out.append(f"# HELP {fam} {help_ or fam}")
            out.append(f"# TYPE {fam} {type_}")
            out.extend(rows)
        return "\n".join(out) + "\n"


def render(sample: dict[str, Any] | None, counters: dict[str, dict[str, int]],
           xid_counts: dict[tuple[str, int], int]) -> str:
    f = _Families()
    if sample:
        node = sample["node"]
        for state in State:
            f.add("tpassd_node_health", "gauge", "1 for the node's current health state.",
                  {"node": node, "state": state.value}, int(sample["state"] == state.value))
        for name, c in sorted(sample["collectors"].items()):
            f.add("tpassd_scrape_collector_duration_seconds", "gauge",
                  "How long the collector took in the last sample.", {"collector": name}, c["duration_s"])
            f.add("tpassd_scrape_collector_success", "gauge", "1 if the collector succeeded in the last sample.",
                  {"collector": name}, int(c["ok"]))
        for comp, c in sorted(sample["components"].items()):
            for state in State:
                f.add("tpassd_component_health", "gauge", "1 for the component's current health state.",
                      {"component": comp, "state": state.value}, int(c["state"] == state.value))
            m = c.get("metrics", {})
            if comp.startswith("gpu"):
                gl = {"gpu": comp[3:], "uuid": m.get("uuid", "")}
                for key, fam, type_, help_, extra in GPU_METRICS:
                    if key in m:
                        f.add(fam, type_, help_, {**gl, **extra}, m[key])
                for key, value in m.items():
                    if key.startswith("nvlink.") and not key.endswith(".active"):
                        _, link, kind = key.split(".", 2)
                        f.add("tpassd_gpu_nvlink_errors_total", "counter", "NVLink error counters by link and kind.",
                              {**gl, "link": link, "kind": NVLINK_KEYS.get(kind, kind)}, value)
            elif comp.startswith("ib:"):
                dev, _, port = comp[3:].partition("/")
                il = {"device": dev, "port": port}
                for key, fam, type_, help_ in IB_METRICS:
                    if key in m:
                        f.add(fam, type_, help_, il, m[key])
                for key, value in m.items():
                    if key.endswith("_per_s") or key.endswith("_code") or key in ("state", "phys_state", "rate_gbps"):
                        continue
                    f.add(f"tpassd_infiniband_{key}_total", "counter", f"InfiniBand port counter {key}.", il, value)
            elif comp == "host":
                for key, fam, type_, help_ in HOST_METRICS:
                    if key in m:
                        f.add(fam, type_, help_, {}, m[key])
                i = 0
                while f"disk.{i}.path" in m:
                    f.add("tpassd_host_directory_free_bytes", "gauge",
                          "Free space in the state and snapshot directories.",
                          {"path": m[f"disk.{i}.path"]}, m.get(f"disk.{i}.free_bytes"))
                    i += 1
    for (comp, xid), n in sorted(xid_counts.items()):
        f.add("tpassd_gpu_xid_events_total", "counter", "Xid events seen since tpassd started.",
              {"gpu": comp[3:], "xid": xid}, n)
    for group, cs in sorted(counters.items()):
        for name, n in sorted(cs.items()):
            f.add(f"tpassd_{group}_{name}_total", "counter", f"tpassd {group} {name.replace('_', ' ')}.", {}, n)
    return f.render()


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
    def __init__(self, address: str, port: int, render_fn: Callable[[], str], *,
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
                body = self._render().encode()
            except Exception:
                log.exception("metrics rendering failed")
                self._answer(c, _response("500 Internal Server Error",
                                          b"metrics rendering failed; see the tpassd log\n"))
                return
            resp = _response("200 OK", body, "text/plain; version=0.0.4; charset=utf-8")
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
