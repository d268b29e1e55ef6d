"""Training shapes of large-model jobs on CPU (gloo), knowing nothing about torchpass.

Each layout makes its own process groups from its first lines, as modern
training does:

- ``mesh3d``: a 3-D DeviceMesh ``(dp, cp, tp)`` (8 ranks: 2 x 2 x 2).
  Gradients are averaged over ``dp`` and ``cp`` (data and context parallel
  ranks see other data), the loss is summed over ``tp`` and ``cp``.
- ``hsdp``: FSDP2 ``fully_shard`` on a 2-D ``(replicate, shard)`` mesh
  (HSDP; 6 ranks: 3 x 2).
- ``pipeline``: two stages, Megatron style: ``new_group`` for every
  pipeline pair and every data-parallel group. Stage 0 sends activations to
  stage 1 by ``send``/``recv`` on the pipeline group, stage 1 sends their
  gradients back; gradients are averaged over each stage's data-parallel
  group (6 ranks: 2 stages x 3).
- ``p2p``: the same two stages over the default group, which carries only
  ``send``/``recv`` (as torch.distributed.pipelining given no group): no
  subgroup and no collective at all; stage 1 sends its loss back too
  (2 ranks).

Reads its place in the job as examples/train_ddp.py does (``setup_env``:
RANK etc., or Slurm's variables). Deterministic (one thread, seeded data):
every rank prints the same global mean loss, one line per step,
``step=N loss=<float.hex>``, bit for bit the same in every run.

    srun python examples/train_parallel.py pipeline --steps 50 --sleep 0.05
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_ddp import setup_env  # beside this file, also in a job dir

WIDTH = 32


def mlp(seed: int, hidden: int = 64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def mesh3d(world: int, hidden: int):
    """One step function on a (dp, cp, tp) DeviceMesh; returns this rank's loss share."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // 4, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    dp, cp, tp = (mesh.get_group(n) for n in ("dp", "cp", "tp"))
    m = mlp(mesh.get_local_rank("tp"), hidden)  # a tensor-parallel shard per tp index
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(2 * mesh.get_local_rank("dp") + mesh.get_local_rank("cp"))
    n_data = dist.get_world_size(dp) * dist.get_world_size(cp)

    def step() -> torch.Tensor:
        part = m(torch.randn(16, WIDTH, generator=g)).pow(2).mean()
        opt.zero_grad()
        part.backward()
        for p in m.parameters():
            dist.all_reduce(p.grad, group=dp)
            dist.all_reduce(p.grad, group=cp)
            p.grad /= n_data
        opt.step()
        loss = part.detach().clone()
        dist.all_reduce(loss, group=tp)
        dist.all_reduce(loss, group=cp)
        return loss

    return step, None


def hsdp(world: int, hidden: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    m = mlp(0, hidden)
    fully_shard(m[0], mesh=mesh)
    fully_shard(m[2], mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())

    def step() -> torch.Tensor:
        loss = m(torch.randn(16, WIDTH, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach().clone()

    return step, m


def _stage(stage: int, data_seed: int):
    """One pipeline stage's model, optimizer and data generator (stage 0: the input layer)."""
    torch.manual_seed(stage)
    m = nn.Linear(WIDTH, WIDTH) if stage == 0 else nn.Sequential(nn.Tanh(), nn.Linear(WIDTH, 1))
    return m, torch.optim.SGD(m.parameters(), lr=0.05), torch.Generator().manual_seed(data_seed)


def _microbatches(stage: int, m: nn.Module, g: torch.Generator, peer: int, group) -> torch.Tensor:
    """Two micro-batches, each forward and backward through both stages, activations and their
    gradients by send/recv on ``group`` (None: the default group). Stage 1's loss; zero on stage 0."""
    loss = torch.zeros(())
    for _ in range(2):
        if stage == 0:
            h = m(torch.randn(8, WIDTH, generator=g))
            dist.send(h.detach(), peer, group=group)
            grad = torch.empty_like(h)
            dist.recv(grad, peer, group=group)
            h.backward(grad)
        else:
            h = torch.empty(8, WIDTH)
            dist.recv(h, peer, group=group)
            h.requires_grad_()
            part = m(h).pow(2).mean() / 2
            part.backward()
            dist.send(h.grad, peer, group=group)
            loss += part.detach()
    return loss


def pipeline(world: int, hidden: int):  # its stages are WIDTH wide: hidden is not used
    rank, dp_size = dist.get_rank(), world // 2
    stage, index = divmod(rank, dp_size)
    # every rank makes every group, in the same order (as new_group requires)
    pps = [dist.new_group([i, i + dp_size]) for i in range(dp_size)]
    dps = [dist.new_group(list(range(s * dp_size, (s + 1) * dp_size))) for s in range(2)]
    pp, dp = pps[index], dps[stage]
    peer = index + dp_size if stage == 0 else index  # the other stage's rank of this pipeline
    m, opt, g = _stage(stage, index)  # data per pipeline (data-parallel index)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = _microbatches(stage, m, g, peer, pp)
        for p in m.parameters():
            dist.all_reduce(p.grad, group=dp)
            p.grad /= dp_size
        opt.step()
        return loss  # stage 1's; stage 0 adds zero to the default group's sum

    return step, None


def p2p(world: int, hidden: int):  # 2 stages over the default group, which carries nothing else
    if world != 2:
        raise SystemExit("p2p: 2 ranks (one per stage)")
    stage, peer = dist.get_rank(), 1 - dist.get_rank()
    m, opt, g = _stage(stage, 0)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = _microbatches(stage, m, g, peer, None)
        if stage == 0:
            dist.recv(loss, peer)  # stage 1's loss, by send/recv too: no collective at all
        else:
            dist.send(loss, peer)
        opt.step()
        return loss * 2  # the "sum" the other layouts' all_reduce makes (stage 0 would add zero)

    return step, None


LAYOUTS = {"mesh3d": mesh3d, "hsdp": hsdp, "pipeline": pipeline, "p2p": p2p}
P2P_ONLY = {"p2p"}  # layouts whose default group carries only send/recv: no loss all_reduce


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("layout", choices=sorted(LAYOUTS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep after each step")
    ap.add_argument("--hidden", type=int, default=64,
                    help="hidden width of the mesh3d and hsdp MLPs (about 34 x HIDDEN parameters)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    setup_env()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    step, model = LAYOUTS[args.layout](world, args.hidden)
    for n in range(args.steps):
        loss = step()
        if args.layout not in P2P_ONLY:
            dist.all_reduce(loss)  # the global mean, the same on every rank
        print(f"step={n} loss={(loss.item() / world).hex()}", flush=True)
        if args.sleep:
            time.sleep(args.sleep)
    # FSDP2's module state keeps gloo Work objects; freed at interpreter exit they can
    # tear a gloo group down under exiting threads and torch aborts ("terminate called
    # without an active exception"), with or without torchpass: free them while the
    # group lives, then leave without finalization (what the job prints is above).
    del model, step
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
