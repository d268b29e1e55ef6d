"""The devcluster's link drills: what each one runs, on which end (commands recorded, not run)."""

import subprocess
from pathlib import Path

import pytest

from torchpass.devcluster import DevclusterSpec
from torchpass.devcluster.rails import LinkAction, RailLinks, rail_address, rail_veth
from torchpass.devcluster.tpassd_node import start_args
from torchpass.errors import DevclusterError
from tpassd.config import load_config
from tpassd.policy import load_policy

INSIDE = ["nsenter", "-t", "42", "--net", "--uts", "--mount", "--"]


class Recorder:
    def __init__(self, fail_with: dict[str, str] | None = None):
        self.calls: list[tuple[list[str], str | None]] = []
        self.fail_with = fail_with or {}

    def __call__(self, argv, stdin=None):
        self.calls.append((list(argv), stdin))
        joined = " ".join(argv)
        for needle, err in self.fail_with.items():
            if needle in joined:
                return subprocess.CompletedProcess(argv, 2, "", err)
        return subprocess.CompletedProcess(argv, 0, "", "")


def links(rec, rails=2):
    return RailLinks("lp", lambda node: int(node[4:]), lambda node: INSIDE, rails, run=rec, sleep=lambda s: None)


def test_down_pulls_the_switch_end_so_the_node_end_loses_its_carrier():
    rec = Recorder()
    line = links(rec).act("node2", 1, LinkAction.parse("down"))
    assert rec.calls == [(["ip", "link", "set", "tplp2r1", "down"], None)]
    assert "rail1: down" in line


def test_flap_goes_down_and_up_the_given_number_of_times():
    rec = Recorder()
    links(rec).act("node1", 0, LinkAction.parse("flap"), times=3)
    states = [argv[-1] for argv, _ in rec.calls]
    assert states == ["down", "up"] * 3


def test_rate_limits_both_ends_and_rate_zero_lifts_it():
    rec = Recorder()
    links(rec).act("node1", 0, LinkAction.parse("rate=50"))
    adds = [argv for argv, _ in rec.calls if "add" in argv]
    assert adds == [
        [*INSIDE, "tc", "qdisc", "add", "dev", "rail0", "root", "tbf", "rate", "50mbit", "burst", "64kb",
         "latency", "400ms"],
        ["tc", "qdisc", "add", "dev", "tplp1r0", "root", "tbf", "rate", "50mbit", "burst", "64kb", "latency", "400ms"],
    ]
    rec = Recorder()
    links(rec).act("node1", 0, LinkAction.parse("rate=0"))
    assert all("del" in argv for argv, _ in rec.calls) and len(rec.calls) == 2


def test_loss_drops_in_both_directions_with_numgen():
    rec = Recorder()
    links(rec).act("node3", 1, LinkAction.parse("loss=10"))
    argv, rules = rec.calls[-1]
    assert argv == [*INSIDE, "nft", "-f", "-"]
    assert 'oifname "rail1" numgen random mod 100 < 10 drop' in rules
    assert 'iifname "rail1" numgen random mod 100 < 10 drop' in rules


def test_delay_without_netem_says_so_in_one_line():
    rec = Recorder(fail_with={"netem": "Error: Specified qdisc kind is unknown."})
    with pytest.raises(DevclusterError, match="needs the kernel's sch_netem") as exc:
        links(rec).act("node1", 0, LinkAction.parse("delay=20"))
    assert "\n" not in str(exc.value)


def test_a_rail_the_cluster_lacks_and_a_bad_action_are_refused():
    with pytest.raises(DevclusterError, match="has 0 data rail"):
        links(Recorder(), rails=0).act("node1", 0, LinkAction.parse("down"))
    for bad in ("sideways", "rate=fast", "loss=150"):
        with pytest.raises(DevclusterError):
            LinkAction.parse(bad)


def test_names_fit_ifnamsiz_and_rails_are_validated():
    assert len(rail_veth("abcdefgh", 16, 3)) <= 15
    assert rail_address(1, 2) == "192.168.101.12"
    assert DevclusterSpec().rails == 0  # the default stays the management network only
    with pytest.raises(DevclusterError, match="--rails 9"):
        DevclusterSpec(rails=9).validate()
    assert DevclusterSpec(rails=2).rail_interfaces == ("rail0", "rail1")


def test_the_nodes_tpassd_keeps_a_flapped_rail_degraded_for_the_specs_window(tmp_path, monkeypatch):
    monkeypatch.setattr("torchpass.devcluster.tpassd_node.tpassd_program", lambda: "/bin/true")
    def configured(node_dir: Path, **kw):
        argv = start_args("node1", "10.0.0.11", node_dir, tmp_path / "munge.sock", **kw)
        cfg = load_config(Path(argv[argv.index("--config") + 1]), environ={})
        return cfg, load_policy(cfg.policy)

    cfg, policy = configured(tmp_path / "short", rails=("rail0", "rail1"), rail_flap_window_s=10.0)
    assert cfg.rails == ("rail0", "rail1") and policy.rail.window_s == 10.0
    assert policy.host.disk_free_gb_degraded == 1.0  # the shared disk's floor stays
    assert configured(tmp_path / "default")[1].rail.window_s == 300.0  # tpassd's own default
    with pytest.raises(DevclusterError, match="flap window"):
        DevclusterSpec(rails=2, rail_flap_window_s=0).validate()
