"""Collectors against the fake NVML provider, fixture sysfs trees and injected psutil."""

from collections import namedtuple

import pytest

from torchpass.errors import DependencyError
from tpassd.collectors.base import UNSUPPORTED, Collector, run_collector
from tpassd.collectors.host import HostCollector
from tpassd.collectors.ib_sysfs import IbSysfsCollector, parse_rate, parse_state
from tpassd.collectors.nvml import NvmlCollector
from tpassd.drills import write_fixture_tree
from tpassd.nvml_provider import (
    NVML_ERROR_NOT_SUPPORTED,
    BrokenProvider,
    FakeNvmlProvider,
    NvmlError,
    PynvmlProvider,
    select_provider,
)


def fake(n=2):
    p = FakeNvmlProvider(gpus=n, nvlinks=2)
    p.init()
    return p


def test_nvml_collector_reads_every_gpu_and_metric():
    p = fake()
    out = NvmlCollector(p, events=False).collect(0.0)
    assert set(out) == {"gpu0", "gpu1"}
    m = out["gpu1"].metrics
    for key in ("ecc_sbe_volatile", "ecc_dbe_aggregate", "retired_pages_pending", "remap_pending",
                "remap_failure", "nvlink.0.crc_flit", "nvlink.1.recovery", "nvlink_crc_errors", "pcie_replay",
                "temperature_c", "power_w", "throttle_reasons", "utilization_gpu", "lost", "uuid"):
        assert key in m, key
    assert out["gpu1"].failed_checks() == {}


def test_nvml_collector_counts_drilled_errors():
    p = fake()
    p.sbe(0, 7)
    p.nvlink_errors(0, 1, crc_flit=3, crc_data=2, replay=4, recovery=1)
    m = NvmlCollector(p, events=False).collect(0.0)["gpu0"].metrics
    assert m["ecc_sbe_volatile"] == 7 and m["nvlink_crc_errors"] == 5
    assert m["nvlink_replay_errors"] == 4 and m["nvlink_recovery_errors"] == 1


def test_nvml_lost_gpu_and_failed_query():
    p = fake()
    p.set(0, lost=True)
    p.fail_query(1, "nvlink")
    out = NvmlCollector(p, events=False).collect(0.0)
    assert out["gpu0"].lost and out["gpu0"].metrics["lost"] == 1
    assert set(out["gpu1"].failed_checks()) == {"nvlink"}


def test_nvml_not_supported_is_not_a_failure():
    class NoEcc(FakeNvmlProvider):
        def ecc_counts(self, gpu):
            raise NvmlError(NVML_ERROR_NOT_SUPPORTED, "Not Supported")

    p = NoEcc(1, 1)
    p.init()
    r = NvmlCollector(p, events=False).collect(0.0)["gpu0"]
    assert r.checks["ecc"] == UNSUPPORTED and r.failed_checks() == {}


def test_nvml_events_thread_delivers_xids_and_wakes():
    import threading

    p = fake()
    woke = threading.Event()
    c = NvmlCollector(p)
    c.start(woke.set)
    try:
        p.xid(1, 48)
        assert woke.wait(2)
        out = c.collect(0.0)
        assert out["gpu1"].events[0]["xid"] == 48 and out["gpu1"].metrics["ecc_dbe_volatile"] == 1
        assert out["gpu0"].events == []
        assert c.collect(1.0)["gpu1"].events == []  # delivered once
    finally:
        c.close()


def test_uninitialised_provider_raises_never_none():
    p = FakeNvmlProvider(1)
    with pytest.raises(NvmlError):
        p.device_count()
    real = PynvmlProvider()
    with pytest.raises(NvmlError):
        real.device_count()


def test_real_provider_missing_library_is_a_clear_error():
    # This machine has no libnvidia-ml: "nvml" refuses to start, "auto" runs without GPUs.
    with pytest.raises(DependencyError, match="libnvidia-ml"):
        select_provider("nvml")
    choice = select_provider("auto")
    assert choice.provider is None and "libnvidia-ml" in choice.why
    assert isinstance(select_provider("fake", fake_gpus=3).provider, FakeNvmlProvider)
    assert select_provider("none").provider is None


def test_broken_provider_makes_the_gpu_collector_fail():
    res = run_collector(NvmlCollector(BrokenProvider("driver/library version mismatch"), events=False), 0.0)
    assert not res.ok and "version mismatch" in res.error


def test_ib_collector_reads_fixture_tree_and_rates(tmp_path):
    names = write_fixture_tree(tmp_path, [("mlx5_0", 2), ("mlx5_1", 1)], rate="200 Gb/sec (4X HDR)")
    c = IbSysfsCollector(tmp_path)
    out = c.collect(10.0)
    assert sorted(out) == sorted(names) == ["ib:mlx5_0/1", "ib:mlx5_0/2", "ib:mlx5_1/1"]
    m = out["ib:mlx5_0/2"].metrics
    assert (m["state"], m["state_code"], m["phys_state"], m["rate_gbps"]) == ("ACTIVE", 4, "LinkUp", 200.0)
    assert m["symbol_error"] == 0 and "symbol_error_per_s" not in m  # no rate before 2 samples
    (tmp_path / "class/infiniband/mlx5_0/ports/2/counters/symbol_error").write_text("50\n")
    m = c.collect(12.0)["ib:mlx5_0/2"].metrics
    assert m["symbol_error"] == 50 and m["symbol_error_per_s"] == 25.0


def test_ib_missing_file_fails_its_check(tmp_path):
    write_fixture_tree(tmp_path, [("mlx5_0", 1)])
    (tmp_path / "class/infiniband/mlx5_0/ports/1/counters/link_downed").unlink()
    (tmp_path / "class/infiniband/mlx5_0/ports/1/state").write_text("garbage")
    r = IbSysfsCollector(tmp_path).collect(0.0)["ib:mlx5_0/1"]
    assert set(r.failed_checks()) == {"link_downed", "state"}


def test_ib_no_tree_and_expected_ports(tmp_path):
    assert IbSysfsCollector(tmp_path).collect(0.0) == {}
    out = IbSysfsCollector(tmp_path, expected_ports=2).collect(0.0)
    assert out["ib"].metrics == {"ports_found": 0, "ports_expected": 2}


def test_parsers():
    assert parse_state("4: ACTIVE\n") == (4, "ACTIVE")
    assert parse_state("5: LinkUp") == (5, "LinkUp")
    assert parse_rate("100 Gb/sec (4X EDR)") == 100.0


VM = namedtuple("VM", "total available")
SW = namedtuple("SW", "total used percent")
DU = namedtuple("DU", "free")


def test_host_collector_with_injected_sources():
    def disk(path):
        if path == "/missing":
            raise FileNotFoundError(path)
        return DU(5 * 10**9)

    c = HostCollector(["/state", "/missing"], virtual_memory=lambda: VM(100, 4), swap_memory=lambda: SW(0, 0, 0.0),
                      disk_usage=disk, loadavg=lambda: (3.0, 2.0, 1.0), cpu_count=lambda: 2)
    r = c.collect(0.0)["host"]
    assert r.metrics["mem_available_percent"] == 4.0 and r.metrics["load1_per_cpu"] == 1.5
    assert r.metrics["disk.0.free_bytes"] == 5 * 10**9 and r.metrics["disk.0.path"] == "/state"
    assert set(r.failed_checks()) == {"disk:/missing"}


def test_run_collector_times_and_catches():
    class Boom(Collector):
        name = "boom"

        def collect(self, now):
            raise RuntimeError("sysfs went away")

    res = run_collector(Boom(), 0.0)
    assert not res.ok and res.error == "RuntimeError: sysfs went away" and res.duration_s >= 0
    ok = run_collector(HostCollector([]), 0.0)
    assert ok.ok and ok.duration_s > 0 and "host" in ok.components
