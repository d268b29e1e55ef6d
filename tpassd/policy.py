"""Health policy: every threshold the rules use, loaded from a TOML file.

The defaults below are the documented defaults; ``tpassd/policy_default.toml``
spells the same values out with their sources, and a unit test checks that
the two agree. Unknown keys are rejected by name (torchpass.config).

Where a default comes from NVIDIA's documentation it says so; where it is
our own heuristic it says that too. A threshold of 0 disables a rate rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from torchpass import config as tconfig
from torchpass.errors import ConfigError

_SEVERITIES = ("degraded", "failed")


def _check_severity(where: str, value: str) -> None:
    if value not in _SEVERITIES:
        raise ConfigError(f"{where} must be one of {', '.join(_SEVERITIES)}, got {value!r}")


def _check_nonneg(where: str, value: float) -> None:
    if value < 0:
        raise ConfigError(f"{where} must be >= 0, got {value!r}")


@dataclass(frozen=True)
class XidPolicy:
    # NVIDIA Xid catalog: 48 DBE ECC, 64 row-remap/page-retirement failure,
    # 79 fell off the bus, 95 uncontained ECC, 119/120 GSP RPC timeout/error:
    # the GPU needs a reset (or an RMA) and its work is lost.
    failed: list[int] = field(default_factory=lambda: [48, 64, 79, 95, 119, 120])
    # 63 row remap / page retirement recorded (reset to apply), 74 NVLink
    # error, 92 high single-bit ECC rate, 94 contained ECC error: plan a
    # migration, the GPU keeps running for now.
    degraded: list[int] = field(default_factory=lambda: [63, 74, 92, 94])
    # How long an Xid keeps its GPU degraded/failed (a `clear` drill or a
    # daemon restart forgets it sooner).
    hold_s: float = 600.0

    def validate(self) -> None:
        both = sorted(set(self.failed) & set(self.degraded))
        if both:
            raise ConfigError(f"xid: code(s) {both} are listed both as failed and degraded")
        _check_nonneg("xid.hold_s", self.hold_s)


@dataclass(frozen=True)
class EccPolicy:
    # Any uncorrectable (double-bit) error since the last driver load: the
    # data on that GPU is suspect (NVIDIA: reset the GPU).
    dbe_volatile_severity: str = "failed"
    # Our heuristic for an SBE storm: this many new correctable errors within
    # window_s (NVML also raises an "SBE storm" event on recent GPUs).
    sbe_storm_count: int = 100
    window_s: float = 60.0
    # NVIDIA (pre-Ampere dynamic page retirement): RMA when retired pages
    # reach ~60; a pending retirement needs a reset to take effect.
    retired_pages_failed: int = 60
    retired_pending_severity: str = "degraded"
    # Ampere+ row remapping (NVIDIA "Row Remapping" doc): a pending remap
    # needs a GPU reset; a remapping failure means RMA.
    remap_pending_severity: str = "degraded"
    remap_failure_severity: str = "failed"

    def validate(self) -> None:
        for name in ("dbe_volatile_severity", "retired_pending_severity",
                     "remap_pending_severity", "remap_failure_severity"):
            _check_severity(f"ecc.{name}", getattr(self, name))
        _check_nonneg("ecc.sbe_storm_count", self.sbe_storm_count)
        _check_nonneg("ecc.window_s", self.window_s)


@dataclass(frozen=True)
class NvlinkPolicy:
    # DCGM's NVLink health watch flags CRC errors above a rate; we count new
    # errors over a window (our defaults, tune per fabric).
    window_s: float = 60.0
    crc_errors_per_window: int = 100
    replay_errors_per_window: int = 100
    # A recovery is a link retrain: one is already a warning sign.
    recovery_errors_per_window: int = 1
    # A link that was up and is now down.
    link_down_severity: str = "degraded"

    def validate(self) -> None:
        _check_severity("nvlink.link_down_severity", self.link_down_severity)
        _check_nonneg("nvlink.window_s", self.window_s)


@dataclass(frozen=True)
class PciePolicy:
    # DCGM's PCIe health watch: more than 8 replays per minute is unhealthy.
    replays_per_window: int = 8
    window_s: float = 60.0


@dataclass(frozen=True)
class ThermalPolicy:
    # A hardware slowdown (thermal, power brake, HW slowdown) lasting this
    # long degrades the GPU: a slow rank stalls every collective.
    hw_slowdown_min_s: float = 10.0
    temperature_c_degraded: float = 0.0  # 0 = rely on the throttle reasons only


@dataclass(frozen=True)
class IbPolicy:
    # A port whose state is not ACTIVE or whose phys_state is not LinkUp.
    link_down_severity: str = "failed"
    # Flapping: this many link_downed increments within window_s.
    flap_count: int = 2
    window_s: float = 300.0
    # Error counters: new errors within window_s that degrade the port
    # (after the usual IB fabric-health practice: symbol errors and link
    # error recoveries are the first signs of a bad cable or transceiver).
    symbol_error_per_window: int = 100
    link_error_recovery_per_window: int = 1
    port_rcv_errors_per_window: int = 100
    local_link_integrity_errors_per_window: int = 1
    excessive_buffer_overrun_errors_per_window: int = 1
    port_xmit_discards_per_window: int = 0  # congestion, not a fault: off by default

    def validate(self) -> None:
        _check_severity("ib.link_down_severity", self.link_down_severity)
        _check_nonneg("ib.window_s", self.window_s)


@dataclass(frozen=True)
class RailPolicy:
    """Ethernet data rails (tpassd/collectors/eth_rails.py). A rail that is not up is unusable
    (its verdict is ``failed``) but fails the node only when no listed rail is usable."""

    # Flapping: the carrier went down this many times within window_s (IFLA_CARRIER_DOWN_COUNT).
    flap_count: int = 2
    window_s: float = 300.0
    # New receive+transmit errors / drops within window_s that degrade the rail; 0 = off.
    # Drops are off by default: a full socket buffer drops too, which is load, not a fault.
    errors_per_window: int = 100
    drops_per_window: int = 0

    def validate(self) -> None:
        _check_nonneg("rail.window_s", self.window_s)
        _check_nonneg("rail.flap_count", self.flap_count)


@dataclass(frozen=True)
class HostPolicy:
    mem_available_percent_degraded: float = 5.0
    swap_used_percent_degraded: float = 0.0  # 0 = off (many nodes run without swap)
    disk_free_gb_degraded: float = 10.0  # in the state and snapshot directories
    load_per_cpu_degraded: float = 0.0  # 0 = off


@dataclass(frozen=True)
class Policy:
    xid: XidPolicy = field(default_factory=XidPolicy)
    ecc: EccPolicy = field(default_factory=EccPolicy)
    nvlink: NvlinkPolicy = field(default_factory=NvlinkPolicy)
    pcie: PciePolicy = field(default_factory=PciePolicy)
    thermal: ThermalPolicy = field(default_factory=ThermalPolicy)
    ib: IbPolicy = field(default_factory=IbPolicy)
    rail: RailPolicy = field(default_factory=RailPolicy)
    host: HostPolicy = field(default_factory=HostPolicy)

    def max_window_s(self) -> float:
        return max(self.ecc.window_s, self.nvlink.window_s, self.pcie.window_s,
                   self.ib.window_s, self.rail.window_s, self.thermal.hw_slowdown_min_s, 1.0)


DEFAULT_POLICY_FILE = Path(__file__).with_name("policy_default.toml")


def load_policy(path: Path | None) -> Policy:
    """Defaults, overridden by ``path`` when given (which must then exist)."""
    if path is None:
        return Policy()
    return tconfig.load(Policy, path=Path(path), required_file=True)
