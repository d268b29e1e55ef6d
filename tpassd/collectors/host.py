"""Host health via psutil: memory pressure, swap, free space of the state and
snapshot directories, load. The psutil entry points are parameters so tests
pass their own."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from tpassd.collectors.base import Collector, ComponentReading


class HostCollector(Collector):
    name = "host"
    kind = "host"

    def __init__(
        self,
        directories: Sequence[Path] = (),
        *,
        virtual_memory: Callable[[], Any] = psutil.virtual_memory,
        swap_memory: Callable[[], Any] = psutil.swap_memory,
        disk_usage: Callable[[str], Any] = psutil.disk_usage,
        loadavg: Callable[[], tuple[float, float, float]] = os.getloadavg,
        cpu_count: Callable[[], int | None] = os.cpu_count,
    ):
        self.directories = [Path(d) for d in directories]
        self._vm, self._swap, self._disk = virtual_memory, swap_memory, disk_usage
        self._load, self._cpus = loadavg, cpu_count

    def collect(self, now: float) -> dict[str, ComponentReading]:
        r = ComponentReading(kind="host")
        m = r.metrics
        try:
            vm = self._vm()
            m["mem_total_bytes"] = int(vm.total)
            m["mem_available_bytes"] = int(vm.available)
            m["mem_available_percent"] = round(100.0 * vm.available / vm.total, 3) if vm.total else 0.0
            r.checks["memory"] = None
        except Exception as exc:  # noqa: BLE001
            r.checks["memory"] = f"cannot read memory: {exc}"
        try:
            sw = self._swap()
            m["swap_total_bytes"] = int(sw.total)
            m["swap_used_bytes"] = int(sw.used)
            m["swap_used_percent"] = float(sw.percent)
            r.checks["swap"] = None
        except Exception as exc:  # noqa: BLE001
            r.checks["swap"] = f"cannot read swap: {exc}"
        for i, d in enumerate(self.directories):
            try:
                du = self._disk(str(d))
                m[f"disk.{i}.path"] = str(d)
                m[f"disk.{i}.free_bytes"] = int(du.free)
                r.checks[f"disk:{d}"] = None
            except Exception as exc:  # noqa: BLE001
                r.checks[f"disk:{d}"] = f"cannot stat {d}: {exc}"
        try:
            l1, l5, l15 = self._load()
            cpus = self._cpus() or 1
            m.update(load1=l1, load5=l5, load15=l15, cpus=cpus, load1_per_cpu=round(l1 / cpus, 4))
            r.checks["load"] = None
        except Exception as exc:  # noqa: BLE001
            r.checks["load"] = f"cannot read load: {exc}"
        return {"host": r}
