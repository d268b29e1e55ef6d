"""Subgroups are reconfigurable: pauses of jobs that make their own groups.

Real gloo, several ranks on 127.0.0.1, the runtime loaded through
boot/sitecustomize.py as in a job. Each rank arms its default group itself
(as the coordinator would, through the same ``arm``/``resume`` calls) at
several pause points: a step end and in the middle of a step (before a
default-group collective, with subgroup collectives of the step already
issued). At each pause every group is torn down (the rank holds no socket:
CRIU would refuse one) and after it every group is rebuilt at a new
rendezvous port; the losses are bit-identical (float.hex) to the same script
without the runtime, and the objects the script and DeviceMesh hold are the
ones it got before the pauses.

Counting in a job with subgroups (or a pipeline over the default group alone): ``collectives`` = default-group
collectives + optimizer step ends; a pause at T stops with exactly T counted
(pg.py ``step_ended``).
"""

from __future__ import annotations

import ast
import textwrap

import pytest

from torchpass.runtime.testing import free_port, run_ranks

SCRIPT = textwrap.dedent(
    r"""
    import os, time, torch, torch.distributed as dist, torch.nn as nn
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mode, r = os.environ["MODE"], dist.get_rank()
    pg = dist.distributed_c10d._get_default_group()
    pauses = [int(x) for x in os.environ.get("PAUSES", "").split(",") if x]
    ports = [int(x) for x in os.environ.get("PORTS", "").split(",") if x]
    log = []
    if pauses:  # arm each pause as a coordinator would
        from torchpass.runtime.testing import arm_self
        log = arm_self(pg, pauses, ports, ("collectives", "sockets", "at_step_end"))
    from torch.distributed.device_mesh import init_device_mesh
    groups, mesh = [], None
    if mode == "hsdp":
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        groups = [mesh.get_group("replicate"), mesh.get_group("shard")]
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
        fully_shard(m[0], mesh=mesh); fully_shard(m[2], mesh=mesh); fully_shard(m, mesh=mesh)
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(r)
        def step():
            x = torch.randn(8, 16, generator=g); loss = m(x).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
            return loss.detach().clone()
    elif mode in ("pipeline", "pipeline_default"):  # 2 stages, activations and gradients by send/recv
        # in a group of their own, or on the default group alone (which then carries no collective)
        pp = dist.new_group([0, 1]) if mode == "pipeline" else None
        groups = [pp] if pp is not None else []
        torch.manual_seed(r)
        m = nn.Linear(16, 16) if r == 0 else nn.Sequential(nn.Tanh(), nn.Linear(16, 1))
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(0)
        def step():
            opt.zero_grad()
            if r == 0:
                h = m(torch.randn(8, 16, generator=g))
                dist.send(h.detach(), 1, group=pp)
                gh = torch.empty_like(h); dist.recv(gh, 1, group=pp)
                h.backward(gh); loss = torch.zeros(())
            else:
                h = torch.empty(8, 16); dist.recv(h, 0, group=pp); h.requires_grad_()
                loss = m(h).pow(2).mean(); loss.backward()
                dist.send(h.grad, 0, group=pp)
            opt.step()
            loss = loss.detach().clone()
            if pp is not None:
                dist.broadcast(loss, 1)  # the last stage's loss, on the default group
            elif r == 0:
                dist.recv(loss, 1)  # by send/recv too: no collective at all
            else:
                dist.send(loss, 0)
            return loss
    elif mode == "ddp_p2p":  # gradients averaged on the default group; ranks 0 and 1 alone send/recv, once
        torch.manual_seed(0)
        m = nn.Linear(16, 1)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        seed = torch.tensor([7])
        if r == 0:
            dist.send(seed, 1)
        elif r == 1:
            dist.recv(seed, 0)
        g = torch.Generator().manual_seed(int(seed) + r)
        def step():
            loss = m(torch.randn(8, 16, generator=g)).pow(2).mean()
            opt.zero_grad(); loss.backward()
            for p in m.parameters():
                dist.all_reduce(p.grad); p.grad /= dist.get_world_size()
            opt.step()
            return loss.detach().clone()
    else:  # DP x TP (2-D) or DP x PP x TP (3-D) mesh: gradients averaged over dp, loss summed over tp
        shape, names = {"mesh2d": ((2, 2), ("dp", "tp")), "mesh3d": ((2, 1, 2), ("dp", "pp", "tp"))}[mode]
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        groups = [mesh.get_group(n) for n in names]
        dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
        torch.manual_seed(mesh.get_local_rank("tp"))
        m = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(mesh.get_local_rank("dp"))
        def step():
            part = m(torch.randn(8, 16, generator=g)).pow(2).mean()
            opt.zero_grad(); part.backward()
            for p in m.parameters():
                dist.all_reduce(p.grad, group=dp); p.grad /= dist.get_world_size(dp)
            opt.step()
            loss = part.detach().clone()
            for n in names[1:]:
                dist.all_reduce(loss, group=mesh.get_group(n))
            return loss
    for s in range(int(os.environ["STEPS"])):
        loss = step()
        total = loss.clone()
        if mode != "pipeline_default":
            dist.all_reduce(total)  # and the default group
        print(s, loss.item().hex(), total.item().hex(), flush=True)
    same = mesh is None or [mesh.get_group(n) for n in mesh.mesh_dim_names] == groups
    print("paused", (log, [type(x).__name__ for x in groups], [getattr(x, "generation", None) for x in groups],
                     same), flush=True)
    dist.destroy_process_group()
    # Plain torch too (no runtime) can abort at interpreter exit here ("terminate called
    # without an active exception": gloo Work objects of the send/recv group freed under
    # exiting threads, 1 run in CI): what the ranks print is above, so leave without
    # finalization, as examples/train_parallel.py does.
    import sys; sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
    """
)

STEPS = 6
WORLD = {"mesh2d": 4, "mesh3d": 4, "hsdp": 4, "pipeline": 2, "pipeline_default": 2, "ddp_p2p": 3}
# Per step: the step end, then the default group's collectives: the pipeline's loss
# broadcast and the total all_reduce (2), the meshes' and HSDP's total all_reduce (1).
# T = k * PER_STEP stops at the end of step k (after optimizer.step()); other Ts stop
# before a default-group collective, in the middle of a step.
# pipeline_default: no collective, only the step end. ddp_p2p counts no step end (its default group
# carries collectives): 2 gradient all_reduces, the step end at 3k + 2, then the total all_reduce.
PER_STEP = {"mesh2d": 2, "mesh3d": 2, "hsdp": 2, "pipeline": 3, "pipeline_default": 1, "ddp_p2p": 3}
STEP_END = {"ddp_p2p": 2}  # T % PER_STEP at a step end (0 unless given)


def run(tmp, mode: str, pauses: tuple[int, ...] = ()) -> tuple[list[list[str]], list[str]]:
    env = {"MODE": mode, "STEPS": str(STEPS), "PAUSES": ",".join(map(str, pauses)),
           "PORTS": ",".join(str(free_port()) for _ in pauses)}
    tag = f"{mode}-{'-'.join(map(str, pauses)) or 'plain'}"
    return run_ranks(SCRIPT, WORLD[mode], tmp, tag, runtime=bool(pauses), env=env)


@pytest.mark.parametrize("mode, pauses", [
    ("mesh2d", (2, 5)),  # the end of step 1; before step 2's total all_reduce
    ("mesh3d", (3, 8)),  # before step 1's total all_reduce; the end of step 4
    ("hsdp", (4, 7)),  # the end of step 2 (FSDP2 waits for its reduce-scatters there); mid-step 3
    ("pipeline", (4, 9)),  # before step 1's loss broadcast (send/recv done); the end of step 3
    # send/recv on the default group and nothing else on it: its count once stood still, and no
    # pause was ever reached; the ends of steps 2 and 4
    ("pipeline_default", (2, 4)),
    # DDP whose ranks 0 and 1 alone send/recv once at the start: counted as before, collectives only,
    # on every rank alike (counting step ends on those two alone stopped them elsewhere than rank 2);
    # the end of step 0, before step 2's second gradient all_reduce
    ("ddp_p2p", (2, 7)),
])
def test_pauses_tear_down_and_rebuild_every_group_bit_identically(tmp_path, mode, pauses):
    plain, _ = run(tmp_path, mode)
    out, errs = run(tmp_path, mode, pauses)
    world = WORLD[mode]
    assert all(o[:-1] == plain[r][:-1] and len(o) == STEPS + 1 for r, o in enumerate(out)), (out, plain)
    for r in range(world):
        assert not [ln for ln in errs[r].splitlines() if ln.startswith("torchpass:")], errs[r]
        # (T, sockets, at a step end) per pause: every T reached, no socket left
        log, types, generations, same = ast.literal_eval(out[r][-1].removeprefix("paused "))
        assert log == [(t, 0, t % PER_STEP[mode] == STEP_END.get(mode, 0)) for t in pauses], log
        assert set(types) == ({"ReconfigurableSubgroup"} if mode not in ("pipeline_default", "ddp_p2p") else set()) \
            and same
        assert generations == [len(pauses)] * len(types)  # rebuilt at every pause, same objects
    assert out[0][:-1] != out[world // 2][:-1] or mode.startswith("pipeline")  # other data per dp index
