"""Data rails in tpassd: the Ethernet rail collector on fixture files and a fixed link table,
and the rules that keep a rail fault off the node's state until no rail is usable."""

import struct
from pathlib import Path

import pytest

from torchpass.errors import ConfigError
from torchpass.health import State
from tpassd.collectors.base import CollectorResult, ComponentReading, run_collector
from tpassd.collectors.eth_rails import EthRailCollector, LinkInfo, parse_links, parse_net_dev
from tpassd.collectors.ib_sysfs import IbSysfsCollector
from tpassd.config import TpassdConfig
from tpassd.daemon import Tpassd
from tpassd.drills import write_fixture_tree
from tpassd.policy import Policy
from tpassd.rules import RuleEngine

P = Policy()

_HEADER = ("Inter-|   Receive                                                |  Transmit\n"
           " face |bytes    packets errs drop fifo frame compressed multicast|"
           "bytes    packets errs drop fifo colls carrier compressed\n")
NET_DEV = _HEADER + (
    "    lo:     100       2    0    0    0     0      0         0      100       2    0    0    0     0    0    0\n"
    "  eth0:    5000      40    0    0    0     0      0         0     6000      50    0    0    0     0    0    0\n"
    " rail0:    {rx}      10    {rxerr}    {rxdrop}    0     0      0         0     2000      20    0    0    0"
    "     0       0          0\n"
    " rail1:    3000      30    0    0    0     0      0         0     4000      40    0    0    0     0    0    0\n"
)

class Node:
    """A fixture node: PROC/net/dev and a link table the test changes between samples."""

    def __init__(self, tmp_path: Path, rails=("rail0", "rail1")):
        self.proc = tmp_path / "proc"
        (self.proc / "net").mkdir(parents=True)
        self.links = {"lo": LinkInfo("unknown", 0), "eth0": LinkInfo("up", 0),
                      "rail0": LinkInfo("up", 1), "rail1": LinkInfo("up", 1)}
        self.write()
        self.collector = EthRailCollector(rails, self.proc, links=lambda: dict(self.links))

    def write(self, rx=1000, rxerr=0, rxdrop=0):
        (self.proc / "net" / "dev").write_text(NET_DEV.format(rx=rx, rxerr=rxerr, rxdrop=rxdrop))

    def set(self, iface, state, downs):
        self.links[iface] = LinkInfo(state, downs)


def evaluate(engine, collector, now):
    return engine.evaluate(now, [run_collector(collector, now)])


def test_net_dev_is_parsed_per_interface():
    counters = parse_net_dev(NET_DEV.format(rx=1234, rxerr=7, rxdrop=3))
    assert set(counters) == {"lo", "eth0", "rail0", "rail1"}
    assert counters["rail0"]["rx_bytes"] == 1234
    assert counters["rail0"]["rx_errors"] == 7 and counters["rail0"]["rx_dropped"] == 3
    assert counters["rail1"]["tx_bytes"] == 4000


def _newlink(name: str, operstate: int, downs: int) -> bytes:
    def attr(atype, payload):
        raw = struct.pack("=HH", 4 + len(payload), atype) + payload
        return raw + b"\0" * (-len(raw) % 4)

    body = struct.pack("=BxHiII", 0, 1, 5, 0, 0) + attr(3, name.encode() + b"\0") + attr(16, bytes([operstate])) \
        + attr(48, struct.pack("=I", downs))
    return struct.pack("=IHHII", 16 + len(body), 16, 2, 1, 0) + body


def test_netlink_dump_is_parsed():
    links = parse_links(_newlink("rail0", 6, 3) + _newlink("rail1", 2, 7))
    assert links == {"rail0": LinkInfo("up", 3), "rail1": LinkInfo("down", 7)}


def test_both_rails_up_is_healthy_with_bytes(tmp_path):
    node = Node(tmp_path)
    health = evaluate(RuleEngine(P, ("rail0", "rail1")), node.collector, 0.0)
    assert health.state == State.HEALTHY
    assert health.components["rail:rail0"].state == State.HEALTHY
    reading = run_collector(node.collector, 0.0).components["rail:rail0"]
    assert reading.metrics["rx_bytes"] == 1000 and reading.metrics["operstate"] == "up"


def test_one_rail_down_fails_the_rail_not_the_node(tmp_path):
    node = Node(tmp_path)
    engine = RuleEngine(P, ("rail0", "rail1"))
    evaluate(engine, node.collector, 0.0)
    node.set("rail0", "lowerlayerdown", 2)
    health = evaluate(engine, node.collector, 1.0)
    assert health.components["rail:rail0"].state == State.FAILED
    assert "link lowerlayerdown" in health.components["rail:rail0"].reasons[0]
    assert health.state == State.HEALTHY, health.reasons


def test_no_usable_rail_left_fails_the_node(tmp_path):
    node = Node(tmp_path)
    engine = RuleEngine(P, ("rail0", "rail1"))
    evaluate(engine, node.collector, 0.0)
    node.set("rail0", "down", 2)
    node.set("rail1", "down", 2)
    health = evaluate(engine, node.collector, 1.0)
    assert health.state == State.FAILED
    assert health.reasons[0].startswith("no usable data rail left: rail:rail0, rail:rail1 down")


def test_flaps_are_counted_from_carrier_losses(tmp_path):
    node = Node(tmp_path)
    engine = RuleEngine(P, ("rail0", "rail1"))
    evaluate(engine, node.collector, 0.0)
    node.set("rail0", "up", 2)  # went down and came back between two samples
    assert evaluate(engine, node.collector, 1.0).components["rail:rail0"].state == State.HEALTHY
    node.set("rail0", "up", 3)
    verdict = evaluate(engine, node.collector, 2.0).components["rail:rail0"]
    assert verdict.state == State.DEGRADED
    assert "carrier lost 2 times" in verdict.reasons[0]


def test_error_counters_degrade_the_rail(tmp_path):
    node = Node(tmp_path)
    engine = RuleEngine(P, ("rail0", "rail1"))
    evaluate(engine, node.collector, 0.0)
    node.write(rxerr=150)
    verdict = evaluate(engine, node.collector, 1.0).components["rail:rail0"]
    assert verdict.state == State.DEGRADED and "150 new errors" in verdict.reasons[0]


def test_a_rail_missing_from_net_dev_is_unknown_not_healthy(tmp_path):
    node = Node(tmp_path, rails=("rail0", "rail7"))
    verdict = evaluate(RuleEngine(P, ("rail0", "rail7")), node.collector, 0.0).components["rail:rail7"]
    assert verdict.state == State.UNKNOWN
    assert node.collector.missing_rails() == ["rail7"]


def ib_port(state="ACTIVE", phys="LinkUp", link_layer=None):
    m = {"state": state, "state_code": 4 if state == "ACTIVE" else 1, "phys_state": phys,
         "phys_state_code": 5 if phys == "LinkUp" else 3, "link_downed": 0}
    if link_layer:
        m["link_layer"] = link_layer
    return ComponentReading(kind="ib", metrics=m, checks={"state": None})


def test_hca_port_in_ethernet_mode_never_fails_the_node():
    engine = RuleEngine(P)
    res = CollectorResult("ib_sysfs", True, 0.0, None, {"ib:mlx5_0/1": ib_port("DOWN", "Polling", "Ethernet")})
    health = engine.evaluate(0.0, [res])
    assert health.components["ib:mlx5_0/1"].state == State.DEGRADED
    assert health.state == State.DEGRADED
    # the same port in InfiniBand mode fails the node, as it always did
    res = CollectorResult("ib_sysfs", True, 0.0, None, {"ib:mlx5_0/1": ib_port("DOWN", "Polling", "InfiniBand")})
    assert RuleEngine(P).evaluate(0.0, [res]).state == State.FAILED


def test_unlisted_ib_port_is_ignored_while_rails_are_listed(tmp_path):
    node = Node(tmp_path)
    engine = RuleEngine(P, ("rail0", "rail1"))
    ib_res = CollectorResult("ib_sysfs", True, 0.0, None, {"ib:mlx5_3/1": ib_port("DOWN", "Polling")})
    health = engine.evaluate(0.0, [ib_res, run_collector(node.collector, 0.0)])
    assert health.components["ib:mlx5_3/1"].state == State.FAILED  # published ...
    assert health.state == State.HEALTHY  # ... and ignored


def test_listed_ib_rail_down_counts_as_an_unusable_rail(tmp_path):
    node = Node(tmp_path, rails=("rail0",))
    engine = RuleEngine(P, ("rail0", "ib:mlx5_0/1"))
    node.set("rail0", "down", 2)
    ib_res = CollectorResult("ib_sysfs", True, 0.0, None, {"ib:mlx5_0/1": ib_port("DOWN", "Polling")})
    health = engine.evaluate(0.0, [ib_res, run_collector(node.collector, 0.0)])
    assert health.state == State.FAILED and "ib:mlx5_0/1" in health.reasons[0]


def test_ib_link_layer_is_read_from_sysfs(tmp_path):
    write_fixture_tree(tmp_path)
    port = tmp_path / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    (port / "link_layer").write_text("Ethernet\n")
    reading = IbSysfsCollector(tmp_path).collect(0.0)["ib:mlx5_0/1"]
    assert reading.metrics["link_layer"] == "Ethernet"


def test_a_configured_rail_the_node_lacks_stops_tpassd(tmp_path):
    cfg = TpassdConfig(node_name="n1", sysfs_root=tmp_path / "sys", rails=("tp-no-such-rail0",),
                       state_dir=tmp_path / "state", snapshot_dir=tmp_path / "snap", nvml_provider="none")
    with pytest.raises(ConfigError, match=r"^rails tp-no-such-rail0 named in the config are not on node n1$"):
        Tpassd(cfg, policy=P)


def test_config_rejects_a_malformed_rail():
    with pytest.raises(ConfigError, match="ib:DEVICE/PORT"):
        TpassdConfig(rails=("ib:mlx5_0",)).validate()
    with pytest.raises(ConfigError, match="twice"):
        TpassdConfig(rails=("eth1", "eth1")).validate()
