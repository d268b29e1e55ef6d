"""FSDP2 (fully_shard on a 1-D CPU DeviceMesh over the default group) through
the reconfigurable group: pauses between all-gathers / reduce-scatters of a
step leave the losses bit-identical. (FSDP1 needs an accelerator.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from torchpass.runtime import boot_dir
from torchpass.runtime.testing import free_port

SCRIPT = textwrap.dedent(
    r"""
    import os, sys, torch, torch.distributed as dist, torch.nn as nn
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,))
    r = dist.get_rank()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    fully_shard(m[0], mesh=mesh); fully_shard(m[2], mesh=mesh); fully_shard(m, mesh=mesh)
    pg = dist.distributed_c10d._get_default_group()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(r)
    pause = int(os.environ["PAUSE"])
    paused = []
    if pause >= 0:
        from torchpass.runtime.pg import PauseListener, Rendezvous
        assert pg.arm(pause, 1)
        class L(PauseListener):
            def on_quiesced(self, pg, info):
                paused.append(info["in_backward"])
                pg.resume(1, Rendezvous("127.0.0.1", int(os.environ["P2"])))
        pg.listener = L()
    for s in range(4):
        x = torch.randn(8, 32, generator=g); loss = m(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        t = loss.detach().clone(); dist.all_reduce(t)
        print(s, t.item().hex(), flush=True)
    print("paused", paused, type(pg).__name__, flush=True)
    # FSDP2's module state still references gloo work objects; dropped at interpreter
    # finalization they can tear a gloo group down under exiting threads, and torch 2.13
    # then aborts ("terminate called without an active exception"), with or without
    # torchpass: about 1 run in 100 here. Free them while the group is alive, and skip
    # finalization: what this test compares is printed above.
    del m, opt
    dist.destroy_process_group()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)
    """
)


def run(runtime: bool, pause: int = -1) -> list[str]:
    port, p2 = free_port(), free_port()
    procs = []
    for r in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHPASS_", "SLURM_"))}
        env.update(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), P2=str(p2),
                   PYTHONPATH=boot_dir(), TORCHPASS_JOB_ID="7", PAUSE=str(pause),
                   TORCHPASS_RUNTIME="1" if runtime else "0")
        procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL))
    outs = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert p.returncode == 0, e[-3000:]
        outs.append(o.splitlines())
    assert outs[0] == outs[1]
    return outs[0]


def test_fsdp2_pauses_are_bit_identical():
    plain = run(runtime=False)
    assert plain[-1] == "paused [] ProcessGroup"
    # 7 collectives per step: pause before #10 is in step 2's backward (a reduce-scatter),
    # before #7 at the step boundary (the loss all_reduce)
    for pause, in_backward in ((9, True), (6, False)):
        got = run(runtime=True, pause=pause)
        assert got[:-1] == plain[:-1]
        assert got[-1] == f"paused [{in_backward}] ReconfigurablePG"
