"""Golden output: one published sample and one event, byte for byte after
zeroing the collector timings (the only non-deterministic values).

Regenerate after an intended schema change with TPASSD_UPDATE_GOLDEN=1.
"""

import json
import os
from collections import namedtuple
from pathlib import Path

import zmq

from torchpass import wire
from tpassd.collectors.host import HostCollector
from tpassd.collectors.ib_sysfs import IbSysfsCollector
from tpassd.collectors.nvml import NvmlCollector
from tpassd.daemon import Tpassd
from tpassd.drills import write_fixture_tree
from tpassd.nvml_provider import FakeNvmlProvider
from tpassd.testing import fake_node_config

GOLDEN = Path(__file__).with_name("golden")
VM = namedtuple("VM", "total available")
SW = namedtuple("SW", "total used percent")
DU = namedtuple("DU", "free")


class Accept:
    def identify(self, msg):
        raise AssertionError("no requests in this test")


def normalise(frame: bytes) -> dict:
    obj = json.loads(frame)
    for c in obj["body"].get("collectors", {}).values():
        c["duration_s"] = 0.0
    return obj


def test_published_sample_and_event_match_golden(tmp_path):
    clock = lambda: 1700000000.0  # noqa: E731
    provider = FakeNvmlProvider(gpus=2, nvlinks=2, clock=clock)
    provider.init()
    write_fixture_tree(tmp_path / "sys", [("mlx5_0", 1)])
    collectors = [
        NvmlCollector(provider, clock=clock),
        IbSysfsCollector(tmp_path / "sys"),
        HostCollector(["/var/lib/torchpass"], virtual_memory=lambda: VM(64 * 2**30, 48 * 2**30),
                      swap_memory=lambda: SW(0, 0, 0.0), disk_usage=lambda p: DU(500 * 10**9),
                      loadavg=lambda: (0.5, 0.25, 0.125), cpu_count=lambda: 16),
    ]
    cfg = fake_node_config(tmp_path, "node7", interval_s=3600.0, collector_timeout_s=5.0, metrics_port=-1)
    ctx = zmq.Context()
    d = Tpassd(cfg, provider=provider, collectors=collectors, clock=clock, context=ctx, authenticator=Accept(),
               job_owner_uids=set)
    d.incarnation = "golden"
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        d.start()
        sub.connect(f"tcp://127.0.0.1:{d.ports()['pub_port']}")
        # The start-up tick is gone before we connect; wait until the subscription is live.
        seen = {}
        for _ in range(200):
            d.tick()
            if sub.poll(50):
                break
        while sub.poll(100):
            sub.recv_multipart()
        provider.sbe(1, 500)  # an SBE storm: the NVML event wakes the sampler
        while "tpassd.sample" not in seen or "tpassd.event" not in seen:
            assert sub.poll(5000), "no publication"
            topic, frame = sub.recv_multipart()
            msg = wire.decode(frame)
            assert topic == msg.type.encode()
            if msg.type in ("tpassd.sample", "tpassd.event") and msg.type not in seen:
                if msg.type == "tpassd.sample" and msg.body["state"] != "degraded":
                    continue
                seen[msg.type] = normalise(frame)
    finally:
        d.stop()
        sub.close()
        ctx.term()
    for name, type_ in (("tpassd_sample.json", "tpassd.sample"), ("tpassd_event.json", "tpassd.event")):
        path = GOLDEN / name
        got = seen[type_]
        got.pop("seq")  # depends on how many ticks it took the subscription to connect
        got.pop("id")
        if os.environ.get("TPASSD_UPDATE_GOLDEN") == "1":
            path.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
        assert got == json.loads(path.read_text()), f"{type_} differs from {path}"
