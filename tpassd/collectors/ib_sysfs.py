"""InfiniBand port health from sysfs (after node_exporter's infiniband_linux.go).

Under ``ROOT/class/infiniband/<dev>/ports/<port>/``: ``state`` ("4: ACTIVE"),
``phys_state`` ("5: LinkUp"), ``rate`` ("200 Gb/sec (4X HDR)") and the error
counters in ``counters/``. The root is a parameter (default /sys) so tests
and the devcluster run against fixture trees. Each value is reported raw and,
for counters, as a per-second rate over the last sample. A file that cannot
be read fails its check: a missing counter is not a healthy link.
"""

from __future__ import annotations

import os
from pathlib import Path

from tpassd.collectors.base import Collector, ComponentReading

COUNTERS = (
    "symbol_error",
    "link_error_recovery",
    "link_downed",
    "port_rcv_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "port_xmit_discards",
    "port_xmit_wait",
)


def component_name(device: str, port: str) -> str:
    return f"ib:{device}/{port}"


def ib_class_dir(root: Path) -> Path:
    return Path(root) / "class" / "infiniband"


def parse_state(text: str) -> tuple[int, str]:
    """'4: ACTIVE' -> (4, 'ACTIVE')."""
    num, _, name = text.strip().partition(":")
    return int(num), name.strip()


def parse_rate(text: str) -> float:
    """'200 Gb/sec (4X HDR)' -> 200.0 (Gb/s)."""
    return float(text.strip().split()[0])


class IbSysfsCollector(Collector):
    name = "ib_sysfs"
    kind = "ib"

    def __init__(self, sysfs_root: Path = Path("/sys"), expected_ports: int = -1):
        self.root = Path(sysfs_root)
        self.expected_ports = expected_ports
        self._prev: dict[tuple[str, str], tuple[float, int]] = {}

    def has_port(self, device: str, port: str) -> bool:
        return (ib_class_dir(self.root) / device / "ports" / port).is_dir()

    def ports(self) -> list[tuple[str, str]]:
        base = ib_class_dir(self.root)
        if not base.is_dir():
            return []
        found = []
        for dev in sorted(os.listdir(base)):
            pdir = base / dev / "ports"
            if not pdir.is_dir():
                continue
            for port in sorted(os.listdir(pdir), key=lambda p: (len(p), p)):
                found.append((dev, port))
        return found

    def collect(self, now: float) -> dict[str, ComponentReading]:
        out: dict[str, ComponentReading] = {}
        ports = self.ports()
        for dev, port in ports:
            out[component_name(dev, port)] = self._read_port(now, dev, port)
        if self.expected_ports >= 0 and len(ports) < self.expected_ports:
            r = ComponentReading(kind="ib")
            r.metrics["ports_found"] = len(ports)
            r.metrics["ports_expected"] = self.expected_ports
            out["ib"] = r
        return out

    def _read_port(self, now: float, dev: str, port: str) -> ComponentReading:
        r = ComponentReading(kind="ib")
        pdir = ib_class_dir(self.root) / dev / "ports" / port
        m = r.metrics
        for name, parse in (("state", parse_state), ("phys_state", parse_state)):
            try:
                code, text = parse((pdir / name).read_text())
            except (OSError, ValueError) as exc:
                r.checks[name] = f"cannot read {pdir / name}: {exc}"
                continue
            r.checks[name] = None
            m[name] = text
            m[f"{name}_code"] = code
        # "InfiniBand" or "Ethernet" (RoCE). Optional: fixture trees written before it was read
        # lack it, and an unknown layer is judged as InfiniBand, as before.
        try:
            m["link_layer"] = (pdir / "link_layer").read_text().strip()
        except OSError:
            pass
        try:
            m["rate_gbps"] = parse_rate((pdir / "rate").read_text())
            r.checks["rate"] = None
        except (OSError, ValueError, IndexError) as exc:
            r.checks["rate"] = f"cannot read {pdir / 'rate'}: {exc}"
        for counter in COUNTERS:
            path = pdir / "counters" / counter
            try:
                value = int((path).read_text().strip(), 0)
            except (OSError, ValueError) as exc:
                r.checks[counter] = f"cannot read {path}: {exc}"
                continue
            r.checks[counter] = None
            m[counter] = value
            key = (f"{dev}/{port}", counter)
            prev = self._prev.get(key)
            if prev is not None and now > prev[0]:
                inc = value - prev[1] if value >= prev[1] else value  # a reset counts from 0
                m[f"{counter}_per_s"] = round(inc / (now - prev[0]), 6)
            self._prev[key] = (now, value)
        return r
