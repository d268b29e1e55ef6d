"""Fault drills: make the fake NVML provider or the fixture InfiniBand tree
show a fault, so the whole path (collector -> rules -> event -> subscriber)
runs exactly as for a real one. Never touches real hardware: a drill needs
the fake provider (GPU kinds) or a sysfs root other than /sys (IB kinds).

One drill exercises the checkpoint path instead: ``restore-fail`` arms this
node's tpassd so that the next snapshot it verifies for a restore here
(``tpassd.restore op=verify``, the coordinator's transfer check) has one
byte of its largest image file flipped *after* the check passed, as bit rot
on the target's copy would. The restore step's own SHA-256 check then
refuses the image (checked while CRIU restores; the restored copy is killed
before it may run), so the coordinator sees a real failed
restore and rolls back. It is one-shot, root-only (it damages a job's
image), and ``clear`` disarms it.

``kill-fail`` (also one-shot, root-only, cleared by ``clear``) arms this
node's tpassd to refuse the next ``tpassd.snapshot op=kill``: the move of a
rank *from* this node fails after its restore on the target succeeded (the
source copy is still there, paused), so the coordinator calls the restored
copy off (``tpassd.restore op=abort``) and resumes on this node: the one
rollback that starts from a running restored copy.

Also builds fixture sysfs trees for tests and the devcluster.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from torchpass.drill_kinds import GPU_KINDS, IB_KINDS, KINDS
from torchpass.errors import RemoteError
from tpassd.collectors.ib_sysfs import COUNTERS, component_name, ib_class_dir
from tpassd.nvml_provider import FakeNvmlProvider
from tpassd.policy import Policy

ACTIVE = ("4: ACTIVE", "5: LinkUp")
DOWN = ("1: DOWN", "3: Disabled")


def _write(path: Path, text: str) -> None:
    """Atomic replace: the collector never reads a half-written fixture file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_fixture_tree(root: Path, devices: Sequence[tuple[str, int]] = (("mlx5_0", 1), ("mlx5_1", 1),
                                                                          ("mlx5_2", 1), ("mlx5_3", 1)),
                       rate: str = "400 Gb/sec (4X NDR)") -> list[str]:
    """A sysfs tree under ``root`` with healthy, ACTIVE ports; returns the component names."""
    names = []
    for dev, nports in devices:
        for port in range(1, nports + 1):
            pdir = ib_class_dir(root) / dev / "ports" / str(port)
            (pdir / "counters").mkdir(parents=True, exist_ok=True)
            (pdir / "state").write_text(ACTIVE[0] + "\n")
            (pdir / "phys_state").write_text(ACTIVE[1] + "\n")
            (pdir / "rate").write_text(rate + "\n")
            for c in COUNTERS:
                (pdir / "counters" / c).write_text("0\n")
            names.append(component_name(dev, str(port)))
    return names


@dataclass(frozen=True)
class DrillResult:
    description: str
    components: list[str]  # whose rule history a `clear` drops


def _fail(code: str, msg: str):
    raise RemoteError(code, msg)


class Drills:
    def __init__(self, provider: object | None, sysfs_root: Path, policy: Policy, enabled: bool):
        self.provider = provider
        self.root = Path(sysfs_root)
        self.policy = policy
        self.enabled = enabled
        # restore-fail: armed until the checkpoint service takes it (one-shot).
        self._restore_fault = threading.Lock()
        self.restore_fail_armed = False
        self.kill_fail_armed = False  # kill-fail, under the same lock

    def take_kill_fault(self) -> bool:
        """True once after ``kill-fail`` was armed (the checkpoint service asks at each op=kill)."""
        with self._restore_fault:
            armed, self.kill_fail_armed = self.kill_fail_armed, False
            return armed

    def take_restore_fault(self) -> bool:
        """True once after ``restore-fail`` was armed (the checkpoint service asks at each verify)."""
        with self._restore_fault:
            armed, self.restore_fail_armed = self.restore_fail_armed, False
            return armed

    def _fake(self) -> FakeNvmlProvider:
        if not isinstance(self.provider, FakeNvmlProvider):
            _fail("conflict", "GPU drills need nvml_provider = \"fake\"; this tpassd watches real GPUs")
        return self.provider  # type: ignore[return-value]

    def _ports(self) -> list[tuple[str, str]]:
        base = ib_class_dir(self.root)
        if not base.is_dir():
            return []
        return [(d.name, p.name) for d in sorted(base.iterdir()) if (d / "ports").is_dir()
                for p in sorted((d / "ports").iterdir(), key=lambda x: (len(x.name), x.name))]

    def _port_dir(self, port: str | None) -> tuple[Path, str]:
        if self.root.resolve() == Path("/sys"):
            _fail("conflict", "IB drills need a fixture sysfs_root; this tpassd reads the real /sys")
        ports = self._ports()
        if not ports:
            _fail("not_found", f"no InfiniBand ports under {self.root}")
        if port is None or port == "":
            dev, p = ports[0]
        elif port.isdigit() and int(port) < len(ports) and "/" not in port:
            dev, p = ports[int(port)]
        else:
            wanted = port.removeprefix("ib:").replace(":", "/")
            match = [(d, q) for d, q in ports if f"{d}/{q}" == wanted]
            if not match:
                _fail("not_found", f"no InfiniBand port {port!r}; ports here: "
                                   f"{', '.join(f'{d}/{q}' for d, q in ports)} (or an index 0..{len(ports) - 1})")
            dev, p = match[0]
        return ib_class_dir(self.root) / dev / "ports" / p, component_name(dev, p)

    @staticmethod
    def _bump(pdir: Path, counter: str, n: int) -> None:
        f = pdir / "counters" / counter
        _write(f, f"{int(f.read_text().strip() or 0) + n}\n")

    def apply(self, kind: str, gpu: int | None = None, port: str | None = None,
              count: int | None = None) -> DrillResult:
        if not self.enabled:
            _fail("forbidden", "fault drills are disabled on this tpassd (set drills = true with a fake provider)")
        if kind not in KINDS:
            _fail("not_found", f"unknown drill {kind!r}; kinds: {', '.join(KINDS)}")
        g = 0 if gpu is None else gpu
        if kind == "restore-fail":
            with self._restore_fault:
                self.restore_fail_armed = True
            return DrillResult("armed: the next snapshot verified here for a restore gets a corrupted image "
                               "(the restore step refuses it)", [])
        if kind == "kill-fail":
            with self._restore_fault:
                self.kill_fail_armed = True
            return DrillResult("armed: the next kill of a moved rank's source copy here is refused "
                               "(the move rolls back after its restore)", [])
        if kind in GPU_KINDS:
            fake = self._fake()
            if not 0 <= g < fake.device_count():
                _fail("not_found", f"no GPU {g} (this node has {fake.device_count()})")
            comp = f"gpu{g}"
            if kind == "xid79":
                fake.xid(g, 79)
                return DrillResult(f"{comp}: Xid 79 (fell off the bus)", [comp])
            if kind == "xid48":
                fake.xid(g, 48)
                return DrillResult(f"{comp}: Xid 48 (double-bit ECC)", [comp])
            if kind == "ecc-sbe-storm":
                n = count or max(1, self.policy.ecc.sbe_storm_count) * 5
                fake.sbe(g, n)
                return DrillResult(f"{comp}: {n} correctable ECC errors at once", [comp])
            if kind == "row-remap-pending":
                fake.remap_pending(g)
                return DrillResult(f"{comp}: row remap pending (with Xid 63)", [comp])
            if kind == "nvlink-crc":
                n = count or max(1, self.policy.nvlink.crc_errors_per_window) * 5
                fake.nvlink_errors(g, 0, crc_flit=n)
                return DrillResult(f"{comp}: {n} NVLink CRC errors on link 0", [comp])
            if kind == "nvml-error":
                fake.fail_query(g, "nvlink")
                return DrillResult(f"{comp}: NVML nvlink queries now fail", [comp])
        if kind in IB_KINDS:
            pdir, comp = self._port_dir(port)
            if kind == "ib-link-down":
                _write(pdir / "state", DOWN[0] + "\n")
                _write(pdir / "phys_state", DOWN[1] + "\n")
                self._bump(pdir, "link_downed", 1)
                return DrillResult(f"{comp}: link down", [comp])
            n = count or max(1, self.policy.ib.flap_count)
            self._bump(pdir, "link_downed", n)
            self._bump(pdir, "link_error_recovery", n)
            return DrillResult(f"{comp}: link went down and up {n} times", [comp])
        # clear: everything back to pristine
        touched = []
        with self._restore_fault:
            disarmed = [k for k, armed in (("restore-fail", self.restore_fail_armed),
                                           ("kill-fail", self.kill_fail_armed)) if armed]
            self.restore_fail_armed = self.kill_fail_armed = False
        if isinstance(self.provider, FakeNvmlProvider):
            gpus = range(self.provider.device_count()) if gpu is None else [g]
            for i in gpus:
                self.provider.clear(i)
                touched.append(f"gpu{i}")
        if self.root.resolve() != Path("/sys"):
            for dev, p in self._ports():
                if port not in (None, "") and port.removeprefix("ib:").replace(":", "/") != f"{dev}/{p}":
                    continue
                pdir = ib_class_dir(self.root) / dev / "ports" / p
                _write(pdir / "state", ACTIVE[0] + "\n")
                _write(pdir / "phys_state", ACTIVE[1] + "\n")
                for c in COUNTERS:
                    _write(pdir / "counters" / c, "0\n")
                touched.append(component_name(dev, p))
        return DrillResult(f"cleared {len(touched)} component(s)" + "".join(f"; {k} disarmed" for k in disarmed),
                           touched)
