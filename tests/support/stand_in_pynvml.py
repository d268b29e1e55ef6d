# ruff: noqa: N802  (the real pynvml's function names)
"""A stand-in for the ``pynvml`` module (nvidia-ml-py) on machines without an NVIDIA driver.

It is the real module's surface, not a guess at it: the constants, the ``NVMLError``
hierarchy (``NVMLError(15)`` is an ``NVMLError_GpuIsLost``) and the ctypes structures
(``c_nvmlEventData_t``, ``c_nvmlUtilization_t``, ``c_nvmlDevice_t`` handles) are taken
from the installed nvidia-ml-py, and every function defined here has the real function's
name and parameters (tests/unit/test_pynvml_provider.py checks that against the installed
module). Only what the C library would compute is simulated: per-GPU readings, lost GPUs,
queries the GPU does not support, and an event set that delivers Xid and ECC events or
times out with ``NVMLError_Timeout`` as nvmlEventSetWait_v2 does.
"""

from __future__ import annotations

import ctypes
import queue
import types
from dataclasses import dataclass, field
from typing import Any

import pynvml as _real


@dataclass
class StandInGpu:
    uuid: str
    ecc: dict[tuple[int, int], int] = field(default_factory=dict)  # (error type, counter type) -> count
    retired: dict[int, list[int]] = field(default_factory=dict)  # cause -> page addresses
    retired_pending: int = 0
    remapped: tuple[int, int, int, int] = (0, 0, 0, 0)  # corr, unc, pending, failure
    nvlinks: dict[int, dict[str, int]] = field(default_factory=dict)  # link -> {"active", counter: n}
    pcie_replay: int = 0
    temperature: int = 40
    power_mw: int = 70_000
    throttle: int = 0
    util: tuple[int, int] = (0, 0)
    mig: tuple[int, int] = (0, 0)  # current, pending
    supported_events: int = 0
    lost: bool = False
    unsupported: set[str] = field(default_factory=set)  # function names that raise NotSupported


class StandInNvml:
    """The simulated driver behind the stand-in module: tests mutate it directly."""

    def __init__(self, gpus: list[StandInGpu], driver_version: str = "580.82.07", library_missing: bool = False):
        self.gpus = gpus
        self.driver_version = driver_version
        self.library_missing = library_missing
        self.initialised = False
        self.events: queue.Queue[tuple[int, int, int]] = queue.Queue()  # (gpu, event type, data)
        self.registered: dict[int, int] = {}  # gpu -> registered event mask
        self.freed_sets = 0
        # Distinct opaque pointers, as nvmlDeviceGetHandleByIndex_v2 returns.
        self.handles = [ctypes.cast(ctypes.c_void_p(0x7F0000 + 0x100 * i), _real.c_nvmlDevice_t)
                        for i in range(len(gpus))]

    def post(self, gpu: int, event_type: int, data: int = 0) -> None:
        """The driver reports an event (an Xid's number is its data)."""
        if self.registered.get(gpu, 0) & event_type:
            self.events.put((gpu, event_type, data))

    def index_of(self, handle: Any) -> int:
        address = ctypes.cast(handle, ctypes.c_void_p).value
        for i, h in enumerate(self.handles):
            if ctypes.cast(h, ctypes.c_void_p).value == address:
                return i
        raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)


def make_module(nvml: StandInNvml) -> types.ModuleType:
    """A module object that PynvmlProvider can use in place of ``import pynvml``."""
    mod = types.ModuleType("pynvml")
    for name in dir(_real):
        value = getattr(_real, name)
        if not (callable(value) and isinstance(value, types.FunctionType)) and not name.startswith("__"):
            setattr(mod, name, value)  # constants, NVMLError and its subclasses, ctypes types
    err = _real.NVMLError

    def gpu_for(handle: Any, fn: str) -> StandInGpu:
        if not nvml.initialised:
            raise err(_real.NVML_ERROR_UNINITIALIZED)
        g = nvml.gpus[nvml.index_of(handle)]
        if g.lost:
            raise err(_real.NVML_ERROR_GPU_IS_LOST)
        if fn in g.unsupported:
            raise err(_real.NVML_ERROR_NOT_SUPPORTED)
        return g

    def nvmlInit():
        if nvml.library_missing:
            raise err(_real.NVML_ERROR_LIBRARY_NOT_FOUND)
        nvml.initialised = True

    def nvmlShutdown():
        if not nvml.initialised:
            raise err(_real.NVML_ERROR_UNINITIALIZED)
        nvml.initialised = False

    def nvmlSystemGetDriverVersion():
        if not nvml.initialised:
            raise err(_real.NVML_ERROR_UNINITIALIZED)
        return nvml.driver_version  # str: the real one is wrapped in convertStrBytes

    def nvmlDeviceGetCount():
        if not nvml.initialised:
            raise err(_real.NVML_ERROR_UNINITIALIZED)
        return len(nvml.gpus)

    def nvmlDeviceGetHandleByIndex(index):
        if not nvml.initialised:
            raise err(_real.NVML_ERROR_UNINITIALIZED)
        if not 0 <= index < len(nvml.gpus):
            raise err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return nvml.handles[index]

    def nvmlDeviceGetIndex(handle):
        gpu_for(handle, "nvmlDeviceGetIndex")
        return nvml.index_of(handle)

    def nvmlDeviceGetUUID(handle):
        return gpu_for(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetTotalEccErrors(handle, errorType, counterType):
        return gpu_for(handle, "nvmlDeviceGetTotalEccErrors").ecc.get((errorType, counterType), 0)

    def nvmlDeviceGetRetiredPages(device, sourceFilter):
        return list(gpu_for(device, "nvmlDeviceGetRetiredPages").retired.get(sourceFilter, []))

    def nvmlDeviceGetRetiredPagesPendingStatus(device):
        return int(gpu_for(device, "nvmlDeviceGetRetiredPagesPendingStatus").retired_pending)

    def nvmlDeviceGetRemappedRows(device):
        return tuple(gpu_for(device, "nvmlDeviceGetRemappedRows").remapped)

    def nvmlDeviceGetNvLinkState(device, link):
        g = gpu_for(device, "nvmlDeviceGetNvLinkState")
        if link not in g.nvlinks:
            raise err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return g.nvlinks[link]["active"]

    def nvmlDeviceGetNvLinkErrorCounter(device, link, counter):
        g = gpu_for(device, "nvmlDeviceGetNvLinkErrorCounter")
        if link not in g.nvlinks:
            raise err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return g.nvlinks[link].get(counter, 0)

    def nvmlDeviceGetPcieReplayCounter(handle):
        return gpu_for(handle, "nvmlDeviceGetPcieReplayCounter").pcie_replay

    def nvmlDeviceGetTemperature(handle, sensor):
        if sensor != _real.NVML_TEMPERATURE_GPU:
            raise err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return gpu_for(handle, "nvmlDeviceGetTemperature").temperature

    def nvmlDeviceGetPowerUsage(handle):
        return gpu_for(handle, "nvmlDeviceGetPowerUsage").power_mw  # milliwatts, as NVML

    def nvmlDeviceGetCurrentClocksThrottleReasons(handle):
        return gpu_for(handle, "nvmlDeviceGetCurrentClocksThrottleReasons").throttle

    def nvmlDeviceGetUtilizationRates(handle):
        g = gpu_for(handle, "nvmlDeviceGetUtilizationRates")
        return _real.c_nvmlUtilization_t(gpu=g.util[0], memory=g.util[1])

    def nvmlDeviceGetMigMode(device):
        return list(gpu_for(device, "nvmlDeviceGetMigMode").mig)

    def nvmlDeviceGetSupportedEventTypes(handle):
        return gpu_for(handle, "nvmlDeviceGetSupportedEventTypes").supported_events

    def nvmlEventSetCreate():
        if not nvml.initialised:
            raise err(_real.NVML_ERROR_UNINITIALIZED)
        return ctypes.cast(ctypes.c_void_p(0x5E7), _real.c_nvmlEventSet_t)

    def nvmlDeviceRegisterEvents(handle, eventTypes, eventSet):
        g = gpu_for(handle, "nvmlDeviceRegisterEvents")
        if eventTypes & ~g.supported_events:
            raise err(_real.NVML_ERROR_NOT_SUPPORTED)
        nvml.registered[nvml.index_of(handle)] = eventTypes

    def nvmlEventSetWait_v2(eventSet, timeoutms):
        try:
            gpu, event_type, data = nvml.events.get(timeout=timeoutms / 1000.0)
        except queue.Empty:
            raise err(_real.NVML_ERROR_TIMEOUT) from None
        return _real.c_nvmlEventData_t(device=nvml.handles[gpu], eventType=event_type, eventData=data)

    def nvmlEventSetFree(eventSet):
        nvml.freed_sets += 1

    for fn in list(locals().values()):
        if isinstance(fn, types.FunctionType) and fn.__name__.startswith("nvml"):
            setattr(mod, fn.__name__, fn)
    return mod


def stand_in_function_names(mod: types.ModuleType) -> list[str]:
    """The functions the stand-in simulates (each must exist in the real module with its parameters)."""
    return sorted(n for n in dir(mod) if n.startswith("nvml") and isinstance(getattr(mod, n), types.FunctionType))
