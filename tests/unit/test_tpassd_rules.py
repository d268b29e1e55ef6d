"""Every health rule, with an injected clock (``now`` moved by hand)."""

from dataclasses import replace

import pytest

from torchpass.health import State
from tpassd.collectors.base import UNSUPPORTED, CollectorResult, ComponentReading
from tpassd.policy import IbPolicy, Policy
from tpassd.rules import RuleEngine

P = Policy()


def gpu(**metrics):
    base = {"ecc_sbe_volatile": 0, "ecc_dbe_volatile": 0, "remap_pending": 0, "remap_failure": 0,
            "retired_pages_sbe": 0, "retired_pages_dbe": 0, "retired_pages_pending": 0,
            "nvlink_crc_errors": 0, "nvlink_replay_errors": 0, "nvlink_recovery_errors": 0,
            "nvlink.0.active": 1, "nvlink.1.active": 1, "pcie_replay": 0, "throttle_reasons": 0,
            "temperature_c": 40.0}
    base.update(metrics)
    return ComponentReading(kind="gpu", metrics=base, checks={"ecc": None})


def ib(**metrics):
    base = {"state": "ACTIVE", "state_code": 4, "phys_state": "LinkUp", "phys_state_code": 5,
            "symbol_error": 0, "link_error_recovery": 0, "link_downed": 0, "port_rcv_errors": 0,
            "local_link_integrity_errors": 0, "excessive_buffer_overrun_errors": 0,
            "port_xmit_discards": 0, "port_xmit_wait": 0}
    base.update(metrics)
    return ComponentReading(kind="ib", metrics=base, checks={"state": None})


def host(**metrics):
    base = {"mem_available_percent": 50.0, "swap_used_percent": 0.0, "disk.0.path": "/var/lib/torchpass",
            "disk.0.free_bytes": 100 * 10**9, "load1_per_cpu": 0.5}
    base.update(metrics)
    return ComponentReading(kind="host", metrics=base, checks={"memory": None})


def run(engine, now, comp, reading, collector="c"):
    return engine.evaluate(now, [CollectorResult(collector, True, 0.0, None, {comp: reading})]).components[comp]


def test_healthy_baseline():
    e = RuleEngine(P)
    v = run(e, 0.0, "gpu0", gpu())
    assert v.state is State.HEALTHY and v.reasons == ()


def test_sbe_storm_in_window_then_ages_out():
    e = RuleEngine(P)
    run(e, 0.0, "gpu0", gpu(ecc_sbe_volatile=10))  # baseline: old errors are not new ones
    assert run(e, 1.0, "gpu0", gpu(ecc_sbe_volatile=60)).state is State.HEALTHY  # +50 < 100
    v = run(e, 2.0, "gpu0", gpu(ecc_sbe_volatile=120))  # +110 within 60 s
    assert v.state is State.DEGRADED and "SBE ECC storm: 110" in v.reasons[0]
    assert run(e, 60.5, "gpu0", gpu(ecc_sbe_volatile=120)).state is State.DEGRADED  # both increases in
    assert run(e, 61.5, "gpu0", gpu(ecc_sbe_volatile=120)).state is State.HEALTHY  # only +60 left


def test_counter_reset_counts_new_value():
    e = RuleEngine(P)
    run(e, 0.0, "gpu0", gpu(ecc_sbe_volatile=1000))
    v = run(e, 1.0, "gpu0", gpu(ecc_sbe_volatile=150))  # went down: driver reload, 150 new
    assert v.state is State.DEGRADED


def test_dbe_volatile_is_failed():
    e = RuleEngine(P)
    v = run(e, 0.0, "gpu0", gpu(ecc_dbe_volatile=1))
    assert v.state is State.FAILED and "uncorrectable" in v.reasons[0]


@pytest.mark.parametrize("xid,state", [(48, State.FAILED), (64, State.FAILED), (79, State.FAILED),
                                       (95, State.FAILED), (119, State.FAILED), (120, State.FAILED),
                                       (63, State.DEGRADED), (74, State.DEGRADED), (92, State.DEGRADED),
                                       (94, State.DEGRADED), (13, State.HEALTHY), (31, State.HEALTHY)])
def test_xid_classes_and_hold(xid, state):
    e = RuleEngine(P)
    r = gpu()
    r.events = [{"kind": "xid", "xid": xid, "t": 5.0}]
    v = run(e, 5.0, "gpu0", r)
    assert v.state is state
    if state is not State.HEALTHY:
        assert f"Xid {xid}" in v.reasons[0]
        assert run(e, 5.0 + P.xid.hold_s - 1, "gpu0", gpu()).state is state
        assert run(e, 5.0 + P.xid.hold_s + 1, "gpu0", gpu()).state is State.HEALTHY


def test_forget_drops_xid_hold():
    e = RuleEngine(P)
    r = gpu()
    r.events = [{"kind": "xid", "xid": 79, "t": 0.0}]
    assert run(e, 0.0, "gpu0", r).state is State.FAILED
    e.forget(["gpu0"])
    assert run(e, 1.0, "gpu0", gpu()).state is State.HEALTHY


def test_gpu_lost_is_failed():
    e = RuleEngine(P)
    r = gpu()
    r.lost = True
    r.checks["ecc"] = "NVML error 15: GPU is lost"
    v = run(e, 0.0, "gpu0", r)
    assert v.state is State.FAILED and "GPU is lost" in " ".join(v.reasons)


def test_remap_pending_and_failure_and_retired_pages():
    e = RuleEngine(P)
    assert run(e, 0.0, "gpu0", gpu(remap_pending=1)).state is State.DEGRADED
    assert run(e, 0.0, "gpu1", gpu(remap_failure=1)).state is State.FAILED
    assert run(e, 0.0, "gpu2", gpu(retired_pages_pending=1)).state is State.DEGRADED
    assert run(e, 0.0, "gpu3", gpu(retired_pages_sbe=40, retired_pages_dbe=20)).state is State.FAILED
    assert run(e, 0.0, "gpu4", gpu(retired_pages_sbe=40, retired_pages_dbe=19)).state is State.HEALTHY


def test_nvlink_crc_burst_replay_recovery_and_link_down():
    e = RuleEngine(P)
    run(e, 0.0, "gpu0", gpu())
    v = run(e, 1.0, "gpu0", gpu(nvlink_crc_errors=100))
    assert v.state is State.DEGRADED and "NVLink CRC" in v.reasons[0]
    e2 = RuleEngine(P)
    run(e2, 0.0, "gpu0", gpu())
    assert run(e2, 1.0, "gpu0", gpu(nvlink_replay_errors=99)).state is State.HEALTHY
    assert run(e2, 2.0, "gpu0", gpu(nvlink_replay_errors=100)).state is State.DEGRADED
    e3 = RuleEngine(P)
    run(e3, 0.0, "gpu0", gpu())
    assert run(e3, 1.0, "gpu0", gpu(nvlink_recovery_errors=1)).state is State.DEGRADED
    e4 = RuleEngine(P)
    run(e4, 0.0, "gpu0", gpu())
    v = run(e4, 1.0, "gpu0", gpu(**{"nvlink.1.active": 0}))
    assert v.state is State.DEGRADED and "NVLink 1 went down" in v.reasons[0]
    # a link never seen up (not cabled) is not a fault
    e5 = RuleEngine(P)
    assert run(e5, 0.0, "gpu0", gpu(**{"nvlink.1.active": 0})).state is State.HEALTHY


def test_pcie_replay_rate():
    e = RuleEngine(P)
    run(e, 0.0, "gpu0", gpu(pcie_replay=1000))
    assert run(e, 30.0, "gpu0", gpu(pcie_replay=1007)).state is State.HEALTHY
    assert run(e, 31.0, "gpu0", gpu(pcie_replay=1008)).state is State.DEGRADED
    assert run(e, 91.5, "gpu0", gpu(pcie_replay=1008)).state is State.HEALTHY


def test_hw_slowdown_must_persist():
    e = RuleEngine(P)
    assert run(e, 0.0, "gpu0", gpu(throttle_reasons=0x40)).state is State.HEALTHY
    assert run(e, 9.0, "gpu0", gpu(throttle_reasons=0x40)).state is State.HEALTHY
    assert run(e, 10.0, "gpu0", gpu(throttle_reasons=0x40)).state is State.DEGRADED
    assert run(e, 11.0, "gpu0", gpu(throttle_reasons=0x1)).state is State.HEALTHY  # idle: not HW
    assert run(e, 12.0, "gpu0", gpu(throttle_reasons=0x8)).state is State.HEALTHY  # restarted timer


def test_temperature_threshold_when_enabled():
    pol = replace(P, thermal=replace(P.thermal, temperature_c_degraded=85.0))
    e = RuleEngine(pol)
    assert run(e, 0.0, "gpu0", gpu(temperature_c=84.0)).state is State.HEALTHY
    assert run(e, 1.0, "gpu0", gpu(temperature_c=90.0)).state is State.DEGRADED


def test_failed_check_is_unknown_never_healthy_or_failed():
    e = RuleEngine(P)
    r = gpu()
    r.checks["nvlink"] = "NVML error 999: injected"
    v = run(e, 0.0, "gpu0", r)
    assert v.state is State.UNKNOWN and "nvlink check failed" in v.reasons[0]
    r2 = gpu()
    r2.checks["ecc"] = UNSUPPORTED  # the GPU has no ECC: not a failure
    assert run(e, 0.0, "gpu1", r2).state is State.HEALTHY


def test_known_problem_outranks_unknown_check():
    e = RuleEngine(P)
    r = gpu(remap_pending=1)
    r.checks["nvlink"] = "NVML error 999: injected"
    v = run(e, 0.0, "gpu0", r)
    assert v.state is State.DEGRADED and any("check failed" in x for x in v.reasons)


def test_collector_failure_makes_its_components_unknown():
    e = RuleEngine(P)
    e.evaluate(0.0, [CollectorResult("nvml", True, 0.0, None, {"gpu0": gpu(), "gpu1": gpu()})])
    h = e.evaluate(1.0, [CollectorResult("nvml", False, 0.5, "still running after 0.50 s (hung?)", {})])
    assert set(h.components) == {"gpu0", "gpu1"}
    assert all(v.state is State.UNKNOWN for v in h.components.values())
    assert h.state is State.UNKNOWN
    first = RuleEngine(P).evaluate(0.0, [CollectorResult("nvml", False, 0.0, "boom", {})])
    assert first.components["gpu"].state is State.UNKNOWN


def test_ib_link_down_and_phys_state():
    e = RuleEngine(P)
    v = run(e, 0.0, "ib:mlx5_0/1", ib(state="DOWN", state_code=1))
    assert v.state is State.FAILED and "link state 1: DOWN" in v.reasons[0]
    v = run(e, 0.0, "ib:mlx5_1/1", ib(phys_state="Polling", phys_state_code=2))
    assert v.state is State.FAILED
    pol = replace(P, ib=replace(P.ib, link_down_severity="degraded"))
    assert run(RuleEngine(pol), 0.0, "ib:x/1", ib(state="INIT", state_code=2)).state is State.DEGRADED


def test_ib_flapping_window():
    e = RuleEngine(P)
    run(e, 0.0, "ib:mlx5_0/1", ib(link_downed=5))
    assert run(e, 10.0, "ib:mlx5_0/1", ib(link_downed=6)).state is State.HEALTHY
    v = run(e, 20.0, "ib:mlx5_0/1", ib(link_downed=7))
    assert v.state is State.DEGRADED and "flapping: went down 2 times" in v.reasons[0]
    assert run(e, 309.0, "ib:mlx5_0/1", ib(link_downed=7)).state is State.DEGRADED
    assert run(e, 311.0, "ib:mlx5_0/1", ib(link_downed=7)).state is State.HEALTHY


@pytest.mark.parametrize("counter,field", [
    ("symbol_error", "symbol_error_per_window"),
    ("link_error_recovery", "link_error_recovery_per_window"),
    ("port_rcv_errors", "port_rcv_errors_per_window"),
    ("local_link_integrity_errors", "local_link_integrity_errors_per_window"),
    ("excessive_buffer_overrun_errors", "excessive_buffer_overrun_errors_per_window"),
])
def test_ib_error_counters(counter, field):
    limit = getattr(IbPolicy(), field)
    e = RuleEngine(P)
    run(e, 0.0, "ib:d/1", ib())
    if limit > 1:
        assert run(e, 1.0, "ib:d/1", ib(**{counter: limit - 1})).state is State.HEALTHY
    v = run(e, 2.0, "ib:d/1", ib(**{counter: limit}))
    assert v.state is State.DEGRADED and counter in v.reasons[0]


def test_ib_xmit_discards_off_by_default_and_missing_counter_unknown():
    e = RuleEngine(P)
    run(e, 0.0, "ib:d/1", ib())
    assert run(e, 1.0, "ib:d/1", ib(port_xmit_discards=10**6, port_xmit_wait=10**9)).state is State.HEALTHY
    r = ib()
    r.checks["symbol_error"] = "cannot read .../counters/symbol_error: No such file"
    assert run(e, 2.0, "ib:d/1", r).state is State.UNKNOWN


def test_ib_fewer_ports_than_expected():
    r = ComponentReading(kind="ib", metrics={"ports_found": 1, "ports_expected": 4})
    v = run(RuleEngine(P), 0.0, "ib", r)
    assert v.state is State.FAILED and "1 InfiniBand port(s) found, 4 expected" in v.reasons[0]


def test_host_rules():
    e = RuleEngine(P)
    assert run(e, 0.0, "host", host()).state is State.HEALTHY
    v = run(e, 0.0, "host", host(mem_available_percent=3.0))
    assert v.state is State.DEGRADED and "memory pressure" in v.reasons[0]
    v = run(e, 0.0, "host", host(**{"disk.0.free_bytes": 2 * 10**9}))
    assert v.state is State.DEGRADED and "2.0 GB free in /var/lib/torchpass" in v.reasons[0]
    assert run(e, 0.0, "host", host(swap_used_percent=90.0, load1_per_cpu=30.0)).state is State.HEALTHY  # off
    pol = replace(P, host=replace(P.host, swap_used_percent_degraded=50.0, load_per_cpu_degraded=4.0))
    assert run(RuleEngine(pol), 0.0, "host", host(swap_used_percent=60.0)).state is State.DEGRADED
    assert run(RuleEngine(pol), 0.0, "host", host(load1_per_cpu=4.5)).state is State.DEGRADED
    r = host()
    r.checks["disk:/x"] = "cannot stat /x: No such file"
    assert run(e, 0.0, "host", r).state is State.UNKNOWN


def test_node_state_is_worst_and_reasons_ordered():
    e = RuleEngine(P)
    bad_ib = ib(state="DOWN", state_code=1)
    unk = gpu()
    unk.checks["nvlink"] = "err"
    h = e.evaluate(0.0, [CollectorResult("nvml", True, 0, None, {"gpu0": gpu(remap_pending=1), "gpu1": unk}),
                         CollectorResult("ib_sysfs", True, 0, None, {"ib:d/1": bad_ib}),
                         CollectorResult("host", True, 0, None, {"host": host()})])
    assert h.state is State.FAILED
    assert h.reasons[0].startswith("ib:d/1") and h.reasons[1].startswith("gpu0") and h.reasons[2].startswith("gpu1")
    assert RuleEngine(P).evaluate(0.0, []).state is State.UNKNOWN
