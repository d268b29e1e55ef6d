"""NVML behind a thin provider: the real one wraps pynvml, the fake one
serves tests and fault drills. Both expose the same methods; every query
returns a value or raises NvmlError, never None.

Choosing one (``nvml_provider`` in tpassd.toml):
  "auto"  the real provider when libnvidia-ml loads; otherwise no GPU
          collector at all (logged at start), never the fake.
  "nvml"  the real provider; a missing libnvidia-ml is a start-up error.
  "fake"  FakeNvmlProvider with ``fake_gpus`` GPUs (tests, drills, devcluster).
  "none"  no GPU collector (CPU-only nodes).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torchpass.errors import DependencyError, TorchpassError

# NVML return codes we treat specially (nvml.h).
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNINITIALIZED = 1

# Clock throttle / event reason bits (nvml.h) that mean hardware slowdown.
THROTTLE_HW_SLOWDOWN = 0x08
THROTTLE_SW_THERMAL = 0x20
THROTTLE_HW_THERMAL = 0x40
THROTTLE_HW_POWER_BRAKE = 0x80
HW_SLOWDOWN_MASK = THROTTLE_HW_SLOWDOWN | THROTTLE_HW_THERMAL | THROTTLE_HW_POWER_BRAKE | THROTTLE_SW_THERMAL
# Every reason bit nvml.h defines (nvmlClocksEventReason*, formerly nvmlClocksThrottleReason*), by
# the name tpassd's metrics give it (tpassd_gpu_clock_throttle_active{reason}).
THROTTLE_REASONS = {
    "gpu_idle": 0x01,
    "applications_clocks_setting": 0x02,
    "sw_power_cap": 0x04,
    "hw_slowdown": THROTTLE_HW_SLOWDOWN,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": THROTTLE_SW_THERMAL,
    "hw_thermal_slowdown": THROTTLE_HW_THERMAL,
    "hw_power_brake_slowdown": THROTTLE_HW_POWER_BRAKE,
    "display_clock_setting": 0x100,
}

# Event kinds delivered by wait_event.
EVENT_XID = "xid"
EVENT_SBE = "sbe"
EVENT_DBE = "dbe"


class NvmlError(TorchpassError):
    """An NVML call failed; ``code`` is the NVML return code."""

    def __init__(self, code: int, message: str):
        super().__init__(f"NVML error {code}: {message}")
        self.code = code

    @property
    def gpu_lost(self) -> bool:
        return self.code == NVML_ERROR_GPU_IS_LOST

    @property
    def not_supported(self) -> bool:
        return self.code == NVML_ERROR_NOT_SUPPORTED


class NvmlLibraryMissing(DependencyError):
    """libnvidia-ml could not be loaded at all."""


class BrokenProvider:
    """Stands in for NVML that loaded but failed to initialise: every query
    raises, so the GPU checks report unknown (never healthy) with the cause."""

    name = "nvml-broken"

    def __init__(self, why: str):
        self.why = why

    def init(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def __getattr__(self, attr: str):
        def fail(*_a: Any, **_k: Any) -> Any:
            raise NvmlError(NVML_ERROR_UNINITIALIZED, self.why)
        return fail


@dataclass(frozen=True)
class NvmlEvent:
    gpu: int
    kind: str  # EVENT_XID / EVENT_SBE / EVENT_DBE
    xid: int = 0
    t: float = 0.0  # the provider's clock when it was seen


class NvmlProvider(Protocol):
    name: str

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def device_count(self) -> int: ...
    def uuid(self, gpu: int) -> str: ...
    def driver_version(self) -> str: ...
    def mig_enabled(self, gpu: int) -> bool: ...
    def ecc_counts(self, gpu: int) -> dict[str, int]: ...
    def retired_pages(self, gpu: int) -> dict[str, int]: ...
    def remapped_rows(self, gpu: int) -> dict[str, int]: ...
    def nvlinks(self, gpu: int) -> list[dict[str, int]]: ...
    def pcie_replay(self, gpu: int) -> int: ...
    def temperature_c(self, gpu: int) -> float: ...
    def power_w(self, gpu: int) -> float: ...
    def throttle_reasons(self, gpu: int) -> int: ...
    def utilization(self, gpu: int) -> dict[str, int]: ...
    def register_events(self) -> None: ...
    def wait_event(self, timeout_ms: int) -> NvmlEvent | None: ...


# --------------------------------------------------------------------------
# The real provider
# --------------------------------------------------------------------------
class PynvmlProvider:
    """pynvml with every call serialised by one lock (as NVIDIA's NVRx does).

    The blocking nvmlEventSetWait is made without the lock (NVML is
    thread-safe; the lock only keeps our own call sequences tidy), so a
    waiting event thread never delays a sample.
    """

    name = "nvml"

    def __init__(self, clock: Callable[[], float] | None = None, module: Any = None):
        """``module`` is the pynvml module to use (tests pass a stand-in); by default, ``import pynvml``."""
        import time

        if module is None:
            try:
                import pynvml as module
            except ImportError:  # pragma: no cover - a base dependency
                raise DependencyError("the nvidia-ml-py package is not installed; pip install nvidia-ml-py") from None
        self._nv = module
        self._lock = threading.Lock()
        self._handles: list[Any] = []
        self._initialised = False
        self._event_set = None
        self._clock = clock or time.time

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if not self._initialised:
            raise NvmlError(NVML_ERROR_UNINITIALIZED, "provider used before init()")
        try:
            with self._lock:
                return fn(*args)
        except self._nv.NVMLError as exc:
            raise NvmlError(exc.value, str(exc)) from None

    def init(self) -> None:
        try:
            with self._lock:
                self._nv.nvmlInit()
                count = self._nv.nvmlDeviceGetCount()
                self._handles = [self._nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except self._nv.NVMLError as exc:
            if exc.value == NVML_ERROR_LIBRARY_NOT_FOUND:
                raise NvmlLibraryMissing(
                    "libnvidia-ml.so.1 (the NVIDIA driver's NVML library) was not found; install the "
                    "driver, or set nvml_provider = \"none\" on nodes without GPUs"
                ) from None
            raise DependencyError(f"NVML initialisation failed: {exc}") from None
        self._initialised = True

    def shutdown(self) -> None:
        if not self._initialised:
            return
        self._initialised = False
        try:
            with self._lock:
                if self._event_set is not None:
                    self._nv.nvmlEventSetFree(self._event_set)
                    self._event_set = None
                self._nv.nvmlShutdown()
        except self._nv.NVMLError:
            pass

    def _h(self, gpu: int) -> Any:
        if not self._initialised:
            raise NvmlError(NVML_ERROR_UNINITIALIZED, "provider used before init()")
        return self._handles[gpu]

    def device_count(self) -> int:
        if not self._initialised:
            raise NvmlError(NVML_ERROR_UNINITIALIZED, "provider used before init()")
        return len(self._handles)

    def uuid(self, gpu: int) -> str:
        u = self._call(self._nv.nvmlDeviceGetUUID, self._h(gpu))
        return u.decode() if isinstance(u, bytes) else str(u)

    def driver_version(self) -> str:
        v = self._call(self._nv.nvmlSystemGetDriverVersion)
        return v.decode() if isinstance(v, bytes) else str(v)

    def mig_enabled(self, gpu: int) -> bool:
        """Whether MIG mode is on (current mode); a GPU without MIG support answers False."""
        try:
            current, _pending = self._call(self._nv.nvmlDeviceGetMigMode, self._h(gpu))
        except NvmlError as exc:
            if exc.not_supported:
                return False
            raise
        return bool(current == self._nv.NVML_DEVICE_MIG_ENABLE)

    def ecc_counts(self, gpu: int) -> dict[str, int]:
        nv, h = self._nv, self._h(gpu)
        out = {}
        for key, etype, ctype in (
            ("sbe_volatile", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC),
            ("dbe_volatile", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC),
            ("sbe_aggregate", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_AGGREGATE_ECC),
            ("dbe_aggregate", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_AGGREGATE_ECC),
        ):
            out[key] = int(self._call(nv.nvmlDeviceGetTotalEccErrors, h, etype, ctype))
        return out

    def retired_pages(self, gpu: int) -> dict[str, int]:
        nv, h = self._nv, self._h(gpu)
        sbe = self._call(nv.nvmlDeviceGetRetiredPages, h, nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
        dbe = self._call(nv.nvmlDeviceGetRetiredPages, h, nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        pending = self._call(nv.nvmlDeviceGetRetiredPagesPendingStatus, h)
        return {"sbe": len(sbe), "dbe": len(dbe), "pending": int(bool(pending))}

    def remapped_rows(self, gpu: int) -> dict[str, int]:
        corr, unc, pending, failure = self._call(self._nv.nvmlDeviceGetRemappedRows, self._h(gpu))
        return {"correctable": int(corr), "uncorrectable": int(unc), "pending": int(bool(pending)),
                "failure": int(bool(failure))}

    def nvlinks(self, gpu: int) -> list[dict[str, int]]:
        nv, h = self._nv, self._h(gpu)
        links = []
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                active = self._call(nv.nvmlDeviceGetNvLinkState, h, link)
            except NvmlError as exc:
                if exc.code in (NVML_ERROR_NOT_SUPPORTED, 2):  # 2 = INVALID_ARGUMENT: no such link
                    continue
                raise
            row = {"link": link, "active": int(bool(active))}
            for key, counter in (
                ("crc_flit", nv.NVML_NVLINK_ERROR_DL_CRC_FLIT),
                ("crc_data", nv.NVML_NVLINK_ERROR_DL_CRC_DATA),
                ("replay", nv.NVML_NVLINK_ERROR_DL_REPLAY),
                ("recovery", nv.NVML_NVLINK_ERROR_DL_RECOVERY),
            ):
                row[key] = int(self._call(nv.nvmlDeviceGetNvLinkErrorCounter, h, link, counter))
            links.append(row)
        return links

    def pcie_replay(self, gpu: int) -> int:
        return int(self._call(self._nv.nvmlDeviceGetPcieReplayCounter, self._h(gpu)))

    def temperature_c(self, gpu: int) -> float:
        return float(self._call(self._nv.nvmlDeviceGetTemperature, self._h(gpu), self._nv.NVML_TEMPERATURE_GPU))

    def power_w(self, gpu: int) -> float:
        return self._call(self._nv.nvmlDeviceGetPowerUsage, self._h(gpu)) / 1000.0

    def throttle_reasons(self, gpu: int) -> int:
        return int(self._call(self._nv.nvmlDeviceGetCurrentClocksThrottleReasons, self._h(gpu)))

    def utilization(self, gpu: int) -> dict[str, int]:
        u = self._call(self._nv.nvmlDeviceGetUtilizationRates, self._h(gpu))
        return {"gpu": int(u.gpu), "memory": int(u.memory)}

    def register_events(self) -> None:
        nv = self._nv
        wanted = (nv.nvmlEventTypeXidCriticalError | nv.nvmlEventTypeSingleBitEccError
                  | nv.nvmlEventTypeDoubleBitEccError)
        self._event_set = self._call(nv.nvmlEventSetCreate)
        for h in self._handles:
            supported = self._call(nv.nvmlDeviceGetSupportedEventTypes, h)
            if supported & wanted:
                self._call(nv.nvmlDeviceRegisterEvents, h, supported & wanted, self._event_set)

    def _index_of(self, device: Any) -> int:
        """The index of an event's device, by its handle's address. Asking NVML
        (nvmlDeviceGetIndex) fails with GPU_IS_LOST on the GPU that Xid 79 has just
        taken off the bus, which would drop exactly the event that matters most."""
        import ctypes

        address = ctypes.cast(device, ctypes.c_void_p).value
        for i, h in enumerate(self._handles):
            if ctypes.cast(h, ctypes.c_void_p).value == address:
                return i
        return int(self._call(self._nv.nvmlDeviceGetIndex, device))

    def wait_event(self, timeout_ms: int) -> NvmlEvent | None:
        nv = self._nv
        if self._event_set is None:
            raise NvmlError(NVML_ERROR_UNINITIALIZED, "register_events() was not called")
        try:
            data = nv.nvmlEventSetWait_v2(self._event_set, timeout_ms)  # no lock: blocks
        except nv.NVMLError as exc:
            if exc.value == NVML_ERROR_TIMEOUT:
                return None
            raise NvmlError(exc.value, str(exc)) from None
        gpu = self._index_of(data.device)
        if data.eventType & nv.nvmlEventTypeXidCriticalError:
            return NvmlEvent(gpu, EVENT_XID, int(data.eventData), self._clock())
        if data.eventType & nv.nvmlEventTypeDoubleBitEccError:
            return NvmlEvent(gpu, EVENT_DBE, 0, self._clock())
        return NvmlEvent(gpu, EVENT_SBE, 0, self._clock())


# --------------------------------------------------------------------------
# The fake provider
# --------------------------------------------------------------------------
def _pristine_gpu(index: int, links: int, uuid: str = "") -> dict[str, Any]:
    return {
        "uuid": uuid or f"GPU-fake-{index:04d}-0000-0000-0000-000000000000",
        "lost": False,
        "ecc": {"sbe_volatile": 0, "dbe_volatile": 0, "sbe_aggregate": 0, "dbe_aggregate": 0},
        "retired": {"sbe": 0, "dbe": 0, "pending": 0},
        "remap": {"correctable": 0, "uncorrectable": 0, "pending": 0, "failure": 0},
        "nvlinks": [{"link": link, "active": 1, "crc_flit": 0, "crc_data": 0, "replay": 0, "recovery": 0}
                    for link in range(links)],
        "pcie_replay": 0,
        "temperature_c": 38.0 + index,
        "power_w": 70.0 + index,
        "throttle": 0,
        "util": {"gpu": 0, "memory": 0},
        "mig": False,
        "failing": set(),  # query names that raise a (non-lost) NVML error
    }


class FakeNvmlProvider:
    """In-memory GPUs with the real provider's interface, driven by fault drills.

    Every mutation goes through a method below (called by tpassd/drills.py);
    the collector reads it exactly as it reads pynvml.
    """

    name = "fake"

    def __init__(self, gpus: int = 8, nvlinks: int = 4, clock: Callable[[], float] | None = None,
                 driver_version: str = "fake-0.0", uuids: tuple[str, ...] = ()):
        """``uuids``: GPU i's UUID (the devcluster's node inventory names the same); () = by index."""
        import time

        if uuids and len(uuids) != gpus:
            raise ValueError(f"{len(uuids)} UUIDs for {gpus} fake GPUs")
        self._uuids = tuple(uuids) or ("",) * gpus
        self._driver_version = driver_version
        self._n = gpus
        self._links = nvlinks
        self._lock = threading.Lock()
        self._gpus = [_pristine_gpu(i, nvlinks, self._uuids[i]) for i in range(gpus)]
        self._events: queue.Queue[NvmlEvent] = queue.Queue()
        self._initialised = False
        self._registered = False
        self._clock = clock or time.time

    # -- the provider interface -------------------------------------------
    def init(self) -> None:
        self._initialised = True

    def shutdown(self) -> None:
        self._initialised = False

    def device_count(self) -> int:
        self._check()
        return self._n

    def _check(self) -> None:
        if not self._initialised:
            raise NvmlError(NVML_ERROR_UNINITIALIZED, "provider used before init()")

    def _get(self, gpu: int, query: str) -> dict[str, Any]:
        self._check()
        if not 0 <= gpu < self._n:
            raise NvmlError(2, f"invalid GPU index {gpu}")
        g = self._gpus[gpu]
        if g["lost"]:
            raise NvmlError(NVML_ERROR_GPU_IS_LOST, "GPU is lost")
        if query in g["failing"] or "all" in g["failing"]:
            raise NvmlError(999, f"injected failure of {query}")
        return g

    def uuid(self, gpu: int) -> str:
        with self._lock:
            return self._get(gpu, "uuid")["uuid"]

    def driver_version(self) -> str:
        self._check()
        return self._driver_version

    def mig_enabled(self, gpu: int) -> bool:
        with self._lock:
            return bool(self._get(gpu, "mig")["mig"])

    def ecc_counts(self, gpu: int) -> dict[str, int]:
        with self._lock:
            return dict(self._get(gpu, "ecc")["ecc"])

    def retired_pages(self, gpu: int) -> dict[str, int]:
        with self._lock:
            return dict(self._get(gpu, "retired")["retired"])

    def remapped_rows(self, gpu: int) -> dict[str, int]:
        with self._lock:
            return dict(self._get(gpu, "remap")["remap"])

    def nvlinks(self, gpu: int) -> list[dict[str, int]]:
        with self._lock:
            return [dict(r) for r in self._get(gpu, "nvlink")["nvlinks"]]

    def pcie_replay(self, gpu: int) -> int:
        with self._lock:
            return self._get(gpu, "pcie")["pcie_replay"]

    def temperature_c(self, gpu: int) -> float:
        with self._lock:
            return self._get(gpu, "temperature")["temperature_c"]

    def power_w(self, gpu: int) -> float:
        with self._lock:
            return self._get(gpu, "power")["power_w"]

    def throttle_reasons(self, gpu: int) -> int:
        with self._lock:
            return self._get(gpu, "throttle")["throttle"]

    def utilization(self, gpu: int) -> dict[str, int]:
        with self._lock:
            return dict(self._get(gpu, "util")["util"])

    def register_events(self) -> None:
        self._check()
        self._registered = True

    def wait_event(self, timeout_ms: int) -> NvmlEvent | None:
        self._check()
        try:
            return self._events.get(timeout=max(0, timeout_ms) / 1000.0)
        except queue.Empty:
            return None

    # -- fault injection (drills and tests) -------------------------------
    def _post(self, gpu: int, kind: str, xid: int = 0) -> None:
        if self._registered:
            self._events.put(NvmlEvent(gpu, kind, xid, self._clock()))

    def _gpu(self, gpu: int) -> dict[str, Any]:
        if not 0 <= gpu < self._n:
            raise IndexError(f"no GPU {gpu} (this fake has {self._n})")
        return self._gpus[gpu]

    def xid(self, gpu: int, code: int) -> None:
        """An Xid as the driver reports it; 79 also takes the GPU off the bus, 48 is a DBE."""
        with self._lock:
            g = self._gpu(gpu)
            if code == 48:
                g["ecc"]["dbe_volatile"] += 1
                g["ecc"]["dbe_aggregate"] += 1
            if code == 63:
                g["remap"]["pending"] = 1
                g["remap"]["correctable"] += 1
        self._post(gpu, EVENT_XID, code)
        if code == 79:
            with self._lock:
                self._gpus[gpu]["lost"] = True

    def sbe(self, gpu: int, count: int) -> None:
        with self._lock:
            g = self._gpu(gpu)
            g["ecc"]["sbe_volatile"] += count
            g["ecc"]["sbe_aggregate"] += count
        self._post(gpu, EVENT_SBE)

    def remap_pending(self, gpu: int) -> None:
        # Real hardware records the remap with Xid 63.
        self.xid(gpu, 63)

    def nvlink_errors(self, gpu: int, link: int = 0, crc_flit: int = 0, crc_data: int = 0,
                      replay: int = 0, recovery: int = 0, active: int | None = None) -> None:
        with self._lock:
            row = self._gpu(gpu)["nvlinks"][link]
            row["crc_flit"] += crc_flit
            row["crc_data"] += crc_data
            row["replay"] += replay
            row["recovery"] += recovery
            if active is not None:
                row["active"] = int(active)

    def set(self, gpu: int, **values: Any) -> None:
        """Set plain readings: temperature_c, power_w, throttle, pcie_replay, lost, mig."""
        with self._lock:
            g = self._gpu(gpu)
            for k, v in values.items():
                if k not in ("temperature_c", "power_w", "throttle", "pcie_replay", "lost", "mig"):
                    raise KeyError(k)
                g[k] = v

    def fail_query(self, gpu: int, query: str = "all") -> None:
        """Make a query raise an NVML error (not GPU-lost): the check becomes unknown."""
        with self._lock:
            self._gpu(gpu)["failing"].add(query)

    def clear(self, gpu: int | None = None) -> None:
        """Back to a pristine GPU (as after a reset and repair)."""
        with self._lock:
            for i in range(self._n) if gpu is None else [gpu]:
                self._gpu(i)
                self._gpus[i] = _pristine_gpu(i, self._links, self._uuids[i])


@dataclass
class ProviderChoice:
    provider: NvmlProvider | None
    why: str = ""
    notes: list[str] = field(default_factory=list)


def select_provider(kind: str, *, fake_gpus: int = 8, fake_nvlinks: int = 4,
                    fake_uuids: tuple[str, ...] = ()) -> ProviderChoice:
    """Resolve ``nvml_provider``; the returned provider is already init()ed."""
    if kind == "none":
        return ProviderChoice(None, "nvml_provider = none: no GPU collector")
    if kind == "fake":
        p = FakeNvmlProvider(fake_gpus, fake_nvlinks, uuids=fake_uuids)
        p.init()
        return ProviderChoice(p, f"fake NVML provider with {fake_gpus} GPUs (configured)")
    if kind in ("nvml", "auto"):
        p = PynvmlProvider()
        try:
            p.init()
        except NvmlLibraryMissing as exc:
            if kind == "nvml":
                raise
            return ProviderChoice(None, f"nvml_provider = auto and {exc}; no GPU collector on this node")
        except DependencyError as exc:
            # The library is there but NVML does not work: report the GPUs
            # as unknown rather than pretending this node has none.
            return ProviderChoice(BrokenProvider(str(exc)), f"NVML is present but broken: {exc}")
        return ProviderChoice(p, f"NVML provider, {p.device_count()} GPUs")
    raise DependencyError(f"unknown nvml_provider {kind!r}")
