"""The audit's robust statistics: which node, or which node's link on which rail."""

from __future__ import annotations

from torchpass.fleet import outliers as O


def test_one_slow_node_among_four_is_named_and_nothing_else():
    found = O.outliers({"node1": 1.02, "node2": 0.97, "node3": 4.8, "node4": 1.05}, "compute_s")
    assert [o.key for o in found] == ["node3"]
    assert found[0].rel > 3


def test_a_tight_fleet_with_noise_names_nobody():
    # within 2 %: the MAD is tiny, so z passes 3.5, but the relative rule keeps noise out
    assert O.outliers({"a": 1.00, "b": 1.01, "c": 1.00, "d": 1.02}, "compute_s") == []
    # 40 % apart on a loaded host: still noise for compute (50 % needed)
    assert O.outliers({"a": 1.0, "b": 1.4, "c": 1.0, "d": 1.05}, "compute_s") == []


def test_a_faster_node_is_not_a_fault_and_bandwidth_is_better_higher():
    assert O.outliers({"a": 1.0, "b": 0.2, "c": 1.0, "d": 1.0}, "compute_s") == []
    found = O.outliers({"a": 2e9, "b": 2.1e9, "c": 1e8, "d": 1.9e9}, "bandwidth_bps")
    assert [o.key for o in found] == ["c"]


def test_identical_values_but_one_give_an_infinite_score_and_json_stays_valid():
    import json
    found = O.outliers({"a": 1.0, "b": 1.0, "c": 1.0, "d": 3.0}, "compute_s")
    assert [o.key for o in found] == ["d"] and found[0].as_dict()["z"] is None
    json.dumps(found[0].as_dict(), allow_nan=False)


def test_fewer_than_three_values_have_no_fleet_to_stand_out_of():
    assert O.outliers({"a": 1.0, "b": 9.0}, "compute_s") == []


def _links(slow_node=None, slow_rail=None, every_rail=False):
    out = {}
    for rail in ("rail0", "rail1"):
        bw = {n: 2e9 for n in ("node1", "node2", "node3", "node4")}
        lat = {n: 1e-4 for n in bw}
        if slow_node and (every_rail or rail == slow_rail):
            bw[slow_node] = 1e8
        out[rail] = {"bandwidth_bps": bw, "latency_s": lat}
    return out


def test_a_link_slow_on_one_rail_is_named_with_its_rail():
    v = O.judge({n: 1.0 for n in ("node1", "node2", "node3", "node4")}, _links("node2", "rail1"))
    assert v.nodes == {} and list(v.links) == [("node2", "rail1")]


def test_a_node_slow_on_every_rail_is_a_node_fault_not_two_link_faults():
    v = O.judge({n: 1.0 for n in ("node1", "node2", "node3", "node4")}, _links("node3", every_rail=True))
    assert list(v.nodes) == ["node3"] and v.links == {}


def test_a_compute_outlier_takes_its_link_outliers_with_it():
    compute = {"node1": 1.0, "node2": 1.0, "node3": 9.0, "node4": 1.1}
    v = O.judge(compute, _links("node3", "rail0"))
    assert list(v.nodes) == ["node3"] and v.links == {}
    assert {o.measure for o in v.nodes["node3"]} == {"compute_s", "bandwidth_bps"}


def test_a_failed_check_is_always_named():
    v = O.judge({"node1": 1.0, "node2": 1.0, "node3": 1.0}, {}, failed={"node2": "checksum 5 != 7"})
    assert list(v.nodes) == ["node2"] and "checksum" in v.nodes["node2"][0].measure


def test_a_hundredfold_slower_rail_stands_out_though_one_healthy_node_is_three_times_slower_than_the_rest():
    # best pairs of 4 nodes on a rail: one limited to 0.1 Gbit/s, one healthy at 3 beside two at 10
    found = O.outliers({"n1": 1e8, "n2": 3e9, "n3": 1e10, "n4": 1.02e10}, "bandwidth_bps")
    assert [o.key for o in found] == ["n1"]
