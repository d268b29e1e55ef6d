"""Host health via psutil: memory pressure, swap, free space of root-only
directories (snapshot_dir and tpassd's disk_paths), load. The psutil entry
points are parameters so tests pass their own.

Free space is watched only where no user can write: a directory a user may
fill (a shared, world-writable state_dir) would let one user mark every node
that watches it degraded. A configured path that a uid other than root may
write, or whose parent a non-root uid may rename, is left out of the health
view with one log line (``user_writable``)."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil
import structlog

from tpassd.collectors.base import Collector, ComponentReading

log = structlog.get_logger("tpassd.collectors.host")


def user_writable(path: Path) -> str | None:
    """Why a uid other than root can write ``path`` or swap it for a directory of its own (None:
    it cannot): the directory is not root's or is writable by a non-root group or by others, or an
    ancestor is writable by a non-root uid without the sticky bit. A missing path: None (the
    collector reports it as a check it cannot make)."""
    try:
        real = Path(os.path.realpath(path))
        st = os.stat(real)
    except OSError:
        return None
    if st.st_uid != 0:
        return f"{path} belongs to uid {st.st_uid}"
    if st.st_mode & 0o002 or (st.st_mode & 0o020 and st.st_gid != 0):
        return f"{path} is writable by {'everyone' if st.st_mode & 0o002 else f'group {st.st_gid}'}"
    for parent in real.parents:
        try:
            pst = os.stat(parent)
        except OSError:
            return None
        others = pst.st_mode & 0o002 or (pst.st_mode & 0o020 and pst.st_gid != 0)
        if pst.st_uid != 0 or (others and not pst.st_mode & stat.S_ISVTX):
            return f"{parent}, a parent of {path}, can be changed by a user other than root"
    return None


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
        self._ignored: set[Path] = set()  # logged once each
        self._vm, self._swap, self._disk = virtual_memory, swap_memory, disk_usage
        self._load, self._cpus = loadavg, cpu_count

    def watched(self) -> list[Path]:
        """The directories whose free space is health: those no user can write (checked at each
        sample: a directory made or chmodded since start is seen at the next one)."""
        out = []
        for d in self.directories:
            why = user_writable(d)
            if why is None:
                out.append(d)
            elif d not in self._ignored:
                self._ignored.add(d)
                log.warning("disk free space not watched: users can write there", path=str(d), why=why)
        return out

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
        for i, d in enumerate(self.watched()):
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
