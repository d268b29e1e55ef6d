"""GPU health through an NVML provider (tpassd/nvml_provider.py).

Per GPU: volatile and aggregate ECC counts, retired pages, remapped rows,
NVLink per-link state and CRC/replay/recovery counters, the PCIe replay
counter, temperature, power, clock throttle reasons, utilization, and
whether the GPU is lost. Xid and ECC events come from an NVML event set
watched by a thread, which asks the daemon for an immediate sample so an
Xid reaches subscribers in milliseconds rather than at the next tick.

Each query is its own check: an NVML error fails that check only (the GPU's
state becomes unknown unless another check finds a real problem);
NVML_ERROR_NOT_SUPPORTED is "this GPU does not have it"; GPU_IS_LOST marks
the GPU lost.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from tpassd.collectors.base import UNSUPPORTED, Collector, ComponentReading
from tpassd.nvml_provider import EVENT_XID, NvmlError, NvmlProvider

log = structlog.get_logger("tpassd.collectors.nvml")


class NvmlCollector(Collector):
    name = "nvml"
    kind = "gpu"

    def __init__(self, provider: NvmlProvider, *, clock: Callable[[], float] = time.time, events: bool = True):
        self.provider = provider
        self._clock = clock
        self._events_enabled = events
        self._pending: list[Any] = []
        self._pending_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake: Callable[[], None] = lambda: None
        self.event_thread_error: str | None = None
        # The NVIDIA driver's version, read once a GPU is seen: a CUDA checkpoint is restored by
        # the same driver only, so the coordinator compares a spare's with the source's (tpassd.health).
        self.driver_version: str | None = None

    # -- the event thread --------------------------------------------------
    def start(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        if not self._events_enabled:
            return
        try:
            self.provider.register_events()
        except NvmlError as exc:
            self.event_thread_error = f"NVML event registration failed: {exc}"
            log.warning("no NVML events; Xids will not be seen", error=str(exc))
            return
        self._thread = threading.Thread(target=self._watch, name="nvml-events", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                ev = self.provider.wait_event(200)
            except NvmlError as exc:
                self.event_thread_error = str(exc)
                self._stop.wait(1.0)
                continue
            if ev is None:
                continue
            with self._pending_lock:
                self._pending.append(ev)
            log.info("nvml event", gpu=ev.gpu, kind=ev.kind, xid=ev.xid)
            self._wake()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None

    # -- sampling ------------------------------------------------------------
    def collect(self, now: float) -> dict[str, ComponentReading]:
        count = self.provider.device_count()  # failure here fails the collector
        if count and self.driver_version is None:
            try:
                self.driver_version = self.provider.driver_version()
            except NvmlError as exc:
                log.warning("NVIDIA driver version not read", error=str(exc))
        with self._pending_lock:
            pending, self._pending = self._pending, []
        out: dict[str, ComponentReading] = {}
        for gpu in range(count):
            r = ComponentReading(kind="gpu")
            self._read_gpu(gpu, r)
            for ev in pending:
                if ev.gpu == gpu:
                    e = {"kind": ev.kind, "t": ev.t}
                    if ev.kind == EVENT_XID:
                        e["xid"] = ev.xid
                    r.events.append(e)
            if self.event_thread_error:
                r.checks["events"] = self.event_thread_error
            elif self._events_enabled:
                r.checks["events"] = None
            out[f"gpu{gpu}"] = r
        return out

    def _query(self, r: ComponentReading, check: str, fn: Callable[[], Any]) -> Any:
        if r.lost:
            return None
        try:
            value = fn()
        except NvmlError as exc:
            if exc.gpu_lost:
                r.lost = True
                r.checks[check] = str(exc)
            elif exc.not_supported:
                r.checks[check] = UNSUPPORTED
            else:
                r.checks[check] = str(exc)
            return None
        r.checks[check] = None
        return value

    def _read_gpu(self, gpu: int, r: ComponentReading) -> None:
        p, m = self.provider, r.metrics
        uuid = self._query(r, "uuid", lambda: p.uuid(gpu))
        if uuid is not None:
            m["uuid"] = uuid
        ecc = self._query(r, "ecc", lambda: p.ecc_counts(gpu))
        if ecc is not None:
            m.update({f"ecc_{k}": v for k, v in ecc.items()})
        ret = self._query(r, "retired_pages", lambda: p.retired_pages(gpu))
        if ret is not None:
            m["retired_pages_sbe"] = ret["sbe"]
            m["retired_pages_dbe"] = ret["dbe"]
            m["retired_pages_pending"] = ret["pending"]
        rows = self._query(r, "remapped_rows", lambda: p.remapped_rows(gpu))
        if rows is not None:
            m.update({f"remap_{k}": v for k, v in rows.items()})
        links = self._query(r, "nvlink", lambda: p.nvlinks(gpu))
        if links is not None:
            crc = replay = recovery = active = 0
            for row in links:
                link = row["link"]
                for key in ("active", "crc_flit", "crc_data", "replay", "recovery"):
                    m[f"nvlink.{link}.{key}"] = row[key]
                crc += row["crc_flit"] + row["crc_data"]
                replay += row["replay"]
                recovery += row["recovery"]
                active += row["active"]
            m["nvlink_links"] = len(links)
            m["nvlink_links_active"] = active
            m["nvlink_crc_errors"] = crc
            m["nvlink_replay_errors"] = replay
            m["nvlink_recovery_errors"] = recovery
        for check, key, fn in (
            ("pcie_replay", "pcie_replay", lambda: p.pcie_replay(gpu)),
            ("temperature", "temperature_c", lambda: p.temperature_c(gpu)),
            ("power", "power_w", lambda: p.power_w(gpu)),
            ("throttle", "throttle_reasons", lambda: p.throttle_reasons(gpu)),
        ):
            v = self._query(r, check, fn)
            if v is not None:
                m[key] = v
        util = self._query(r, "utilization", lambda: p.utilization(gpu))
        if util is not None:
            m["utilization_gpu"] = util["gpu"]
            m["utilization_memory"] = util["memory"]
        m["lost"] = int(r.lost)
