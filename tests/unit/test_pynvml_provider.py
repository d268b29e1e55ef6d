"""PynvmlProvider's readings against a stand-in pynvml with the real module's names, types and errors.

This machine has no NVIDIA driver, so the C library is simulated (tests/support/stand_in_pynvml.py);
the constants, NVMLError classes and ctypes structures are nvidia-ml-py's own, and the first test
checks that every simulated function has the installed module's name and parameters.
"""

from __future__ import annotations

import inspect
import threading

import pynvml
import pytest

from tests.support.stand_in_pynvml import StandInGpu, StandInNvml, make_module, stand_in_function_names
from torchpass.errors import DependencyError
from tpassd.collectors.base import UNSUPPORTED
from tpassd.collectors.nvml import NvmlCollector
from tpassd.nvml_provider import EVENT_DBE, EVENT_SBE, EVENT_XID, NvmlError, NvmlLibraryMissing, PynvmlProvider

XID_EVENTS = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeSingleBitEccError \
    | pynvml.nvmlEventTypeDoubleBitEccError


def two_gpus() -> StandInNvml:
    a = StandInGpu(
        uuid="GPU-3b2c1d0e-aaaa-bbbb-cccc-000000000000",
        ecc={(pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC): 3,
             (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC): 1,
             (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_AGGREGATE_ECC): 30,
             (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_AGGREGATE_ECC): 2},
        retired={pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: [0x1000, 0x2000],
                 pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: [0x3000]},
        retired_pending=1,
        remapped=(4, 1, 1, 0),
        nvlinks={0: {"active": 1, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: 7, pynvml.NVML_NVLINK_ERROR_DL_REPLAY: 2},
                 1: {"active": 0, pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: 5}},
        pcie_replay=9, temperature=71, power_mw=412_500, throttle=0x40, util=(97, 55),
        supported_events=XID_EVENTS | pynvml.nvmlEventTypePState,
    )
    b = StandInGpu(uuid="GPU-3b2c1d0e-aaaa-bbbb-cccc-000000000001",
                   supported_events=pynvml.nvmlEventTypeXidCriticalError,
                   mig=(pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_ENABLE))
    return StandInNvml([a, b], driver_version="580.82.07")


def provider(nvml: StandInNvml) -> PynvmlProvider:
    p = PynvmlProvider(clock=lambda: 123.0, module=make_module(nvml))
    p.init()
    return p


def test_the_stand_in_has_the_real_modules_functions_and_errors():
    mod = make_module(two_gpus())
    names = stand_in_function_names(mod)
    assert "nvmlEventSetWait_v2" in names and len(names) >= 20
    for name in names:
        real = getattr(pynvml, name)  # AttributeError: the stand-in invented a name
        assert list(inspect.signature(getattr(mod, name)).parameters) == list(inspect.signature(real).parameters), name
    assert mod.NVMLError is pynvml.NVMLError
    assert type(pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)) is pynvml.NVMLError_GpuIsLost
    assert type(pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)) is pynvml.NVMLError_NotSupported


def test_every_reading_of_a_healthy_and_a_worn_gpu():
    p = provider(two_gpus())
    assert p.device_count() == 2
    assert p.uuid(0) == "GPU-3b2c1d0e-aaaa-bbbb-cccc-000000000000" and p.uuid(1).endswith("0001")
    assert p.driver_version() == "580.82.07"
    assert p.ecc_counts(0) == {"sbe_volatile": 3, "dbe_volatile": 1, "sbe_aggregate": 30, "dbe_aggregate": 2}
    assert p.retired_pages(0) == {"sbe": 2, "dbe": 1, "pending": 1}
    assert p.remapped_rows(0) == {"correctable": 4, "uncorrectable": 1, "pending": 1, "failure": 0}
    # Links 2..35 answer INVALID_ARGUMENT (no such link) and are left out.
    assert p.nvlinks(0) == [
        {"link": 0, "active": 1, "crc_flit": 7, "crc_data": 0, "replay": 2, "recovery": 0},
        {"link": 1, "active": 0, "crc_flit": 0, "crc_data": 0, "replay": 0, "recovery": 5},
    ]
    assert p.pcie_replay(0) == 9 and p.temperature_c(0) == 71.0 and p.power_w(0) == 412.5
    assert p.throttle_reasons(0) == 0x40 and p.utilization(0) == {"gpu": 97, "memory": 55}
    assert (p.mig_enabled(0), p.mig_enabled(1)) == (False, True)
    assert p.ecc_counts(1) == {"sbe_volatile": 0, "dbe_volatile": 0, "sbe_aggregate": 0, "dbe_aggregate": 0}


def test_the_collector_reads_the_real_provider():
    out = NvmlCollector(provider(two_gpus()), events=False).collect(0.0)
    m = out["gpu0"].metrics
    assert m["uuid"].endswith("0000") and m["ecc_dbe_volatile"] == 1 and m["retired_pages_dbe"] == 1
    assert m["nvlink_links"] == 2 and m["nvlink_links_active"] == 1 and m["nvlink_crc_errors"] == 7
    assert m["power_w"] == 412.5 and m["throttle_reasons"] == 0x40 and m["lost"] == 0
    assert all(v is None for v in out["gpu0"].checks.values())


def test_not_supported_is_unsupported_and_lost_is_lost():
    nvml = two_gpus()
    nvml.gpus[0].unsupported = {"nvmlDeviceGetRemappedRows", "nvmlDeviceGetNvLinkState"}
    nvml.gpus[1].lost = True
    p = provider(nvml)
    with pytest.raises(NvmlError) as exc:
        p.remapped_rows(0)
    assert exc.value.not_supported and not exc.value.gpu_lost
    assert p.nvlinks(0) == []  # no NVLink on this GPU: not an error
    with pytest.raises(NvmlError) as exc:
        p.temperature_c(1)
    assert exc.value.gpu_lost
    out = NvmlCollector(p, events=False).collect(0.0)
    assert out["gpu0"].checks["remapped_rows"] == UNSUPPORTED and out["gpu0"].metrics["nvlink_links"] == 0
    assert out["gpu1"].lost and out["gpu1"].metrics["lost"] == 1


def test_events_xid_ecc_timeout_and_the_xid_of_a_gpu_that_fell_off_the_bus():
    nvml = two_gpus()
    p = provider(nvml)
    p.register_events()
    # Only the wanted types the GPU supports are registered (PState is not wanted).
    assert nvml.registered == {0: XID_EVENTS, 1: pynvml.nvmlEventTypeXidCriticalError}
    assert p.wait_event(10) is None  # NVMLError_Timeout means no event
    nvml.post(1, pynvml.nvmlEventTypeXidCriticalError, 13)
    ev = p.wait_event(1000)
    assert (ev.gpu, ev.kind, ev.xid) == (1, EVENT_XID, 13)
    nvml.post(0, pynvml.nvmlEventTypeDoubleBitEccError)
    nvml.post(0, pynvml.nvmlEventTypeSingleBitEccError)
    got = [p.wait_event(1000), p.wait_event(1000)]
    assert [(e.gpu, e.kind) for e in got] == [(0, EVENT_DBE), (0, EVENT_SBE)]
    # Xid 79: the GPU is off the bus, so every query of it (nvmlDeviceGetIndex too) is GPU_IS_LOST;
    # the event must still name it.
    nvml.gpus[1].lost = True
    nvml.post(1, pynvml.nvmlEventTypeXidCriticalError, 79)
    ev = p.wait_event(1000)
    assert (ev.gpu, ev.kind, ev.xid, ev.t) == (1, EVENT_XID, 79, 123.0)
    p.shutdown()
    assert nvml.freed_sets == 1 and not nvml.initialised


def test_an_xid_reaches_the_collector_through_its_event_thread():
    nvml = two_gpus()
    woke = threading.Event()
    c = NvmlCollector(provider(nvml))
    c.start(woke.set)
    try:
        nvml.post(0, pynvml.nvmlEventTypeXidCriticalError, 48)
        assert woke.wait(5)
        out = c.collect(0.0)
        assert out["gpu0"].events == [{"kind": EVENT_XID, "t": 123.0, "xid": 48}] and out["gpu1"].events == []
        assert out["gpu0"].checks["events"] is None
    finally:
        c.close()


def test_a_missing_library_and_a_failed_init_are_clear_errors():
    with pytest.raises(NvmlLibraryMissing, match="libnvidia-ml"):
        PynvmlProvider(module=make_module(StandInNvml([], library_missing=True))).init()
    p = PynvmlProvider(module=make_module(two_gpus()))
    with pytest.raises(NvmlError, match="before init"):
        p.uuid(0)
    with pytest.raises(DependencyError):
        PynvmlProvider(module=make_module(StandInNvml([StandInGpu("GPU-x")], library_missing=True))).init()
