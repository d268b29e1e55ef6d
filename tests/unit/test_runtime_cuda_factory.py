"""Every CUDA backend of the runtime goes through one factory: made at init, shut down before the
dump (at the pause), made anew after it. A stand-in factory (gloo backends registered for "cuda")
records the order on a machine without CUDA; no CUDA tensor is used."""

from __future__ import annotations

import datetime

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from torchpass.runtime import pg as pg_mod  # noqa: E402
from torchpass.runtime.testing import free_port  # noqa: E402


class StandInFactory:
    def __init__(self):
        self.events: list[str] = []
        self.live: list[object] = []

    def create(self, store, rank, size, timeout):
        backend = dist.ProcessGroupGloo(store, rank, size, timeout=timeout)
        self.live.append(backend)
        self.events.append(f"create {len(self.live)}")
        return backend

    def shutdown(self, backend):
        self.events.append(f"shutdown {self.live.index(backend) + 1}")


def test_created_at_init_shut_down_at_the_pause_rebuilt_after(monkeypatch):
    factory = StandInFactory()
    monkeypatch.setattr(pg_mod, "CUDA_BACKENDS", factory)
    rv1 = pg_mod.Rendezvous("127.0.0.1", free_port())
    rv2 = pg_mod.Rendezvous("127.0.0.1", free_port())
    pg = pg_mod.ReconfigurablePG(rank=0, size=1, timeout=datetime.timedelta(seconds=20), rendezvous=rv1,
                                 use_nccl=True)
    assert factory.events == ["create 1"]
    seen = {}

    class Listener(pg_mod.PauseListener):
        def on_quiesced(self, pg, info):
            # where the dump happens: the CUDA backend is already shut down, none made since
            seen["at_dump"] = list(factory.events)
            pg.resume(1, rv2)

    pg.listener = Listener()
    assert pg.arm(2, 1)
    t = torch.ones(4)
    for _ in range(4):
        pg.allreduce([t]).wait()
    assert seen["at_dump"] == ["create 1", "shutdown 1"]
    assert factory.events == ["create 1", "shutdown 1", "create 2"] and pg.generation == 1
    assert torch.equal(t, torch.ones(4))  # one rank: a sum over one
