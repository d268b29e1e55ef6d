"""Subgroups under the runtime: do no harm (issue 11).

A job that makes process groups besides the default one (new_group,
DeviceMesh in 2-D and 3-D) runs exactly as without the runtime: same losses
bit for bit (float.hex), exit code 0. Until such groups are movable every
rank says once that it is unprotected, and refuses pauses cleanly: before
the subgroup exists a pause it had accepted is refused as soon as the
subgroup is made, after that at once; the coordinator's cancel is
acknowledged and training goes on. An error inside the runtime's own check
changes nothing for training. The scripts know nothing about torchpass; the
runtime comes in through boot/sitecustomize.py, as in a job.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

from torchpass.runtime import boot_dir
from torchpass.runtime.store import StoreClosedError, SwitchableStore
from torchpass.runtime.testing import JobUnprotected, MiniCoordinator, free_port

JOB = 4343

SCRIPT = textwrap.dedent(
    r"""
    import os, time, torch, torch.distributed as dist, torch.nn as nn
    torch.set_num_threads(1)
    MESH3D = tuple(int(n) for n in os.environ.get("MESH3D", "2,1,2").split(","))
    dist.init_process_group("gloo")
    mode, r = os.environ["MODE"], dist.get_rank()
    go = os.environ.get("GO")
    while go and not os.path.exists(go):
        time.sleep(0.01)
    extra = None
    if mode == "newgroup":
        try:  # CPU gloo cannot split: the same error with and without the runtime
            dist.split_group(split_ranks=[[0], [1]])
            print("split_group ok", flush=True)
        except Exception as exc:
            print("split_group", type(exc).__name__, exc, flush=True)
        dp, tp, dp_i, tp_i = dist.new_group([0, 1]), None, r, 0
    else:
        from torch.distributed.device_mesh import init_device_mesh
        shape, names = ((2, 2), ("dp", "tp")) if mode == "mesh2d" else (MESH3D, ("dp", "pp", "tp"))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
        dp_i, tp_i = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
        extra = mesh.get_group("pp") if mode == "mesh3d" else None
    torch.manual_seed(tp_i)  # a tensor-parallel shard per tp index, replicated over dp
    m = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(dp_i)  # data per dp index
    for s in range(int(os.environ["STEPS"])):
        x = torch.randn(8, 16, generator=g)
        part = m(x).pow(2).mean()
        opt.zero_grad(); part.backward()
        for p in m.parameters():  # gradients averaged over dp
            dist.all_reduce(p.grad, group=dp); p.grad /= dist.get_world_size(dp)
        opt.step()
        loss = part.detach().clone()
        if tp is not None:
            dist.all_reduce(loss, group=tp)  # loss summed over tp
        if extra is not None:
            dist.all_reduce(loss, group=extra)
        total = loss.clone(); dist.all_reduce(total)  # and the default group
        print(s, loss.item().hex(), total.item().hex(), flush=True)
        time.sleep(float(os.environ.get("SLEEP", "0")))
    dist.destroy_process_group()
    """
)

# An error inside the runtime, injected from a sitecustomize that boot/sitecustomize.py chains to.
INJECT = textwrap.dedent(
    """
    import torchpass.runtime.pg as pg

    def broken(self):
        raise RuntimeError("injected fault in the runtime")

    pg.ReconfigurablePG.note_native_groups = broken
    """
)


def run(tmp: Path, tag: str, mode: str, world: int, runtime: bool, steps: int = 4,
        extra_path: list[str] = (), coordinator: str | None = None, env_extra: dict | None = None,
        on_start=None) -> tuple[list[list[str]], list[str]]:
    port = free_port()
    procs = []
    for r in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHPASS_", "SLURM_", "PYTHON"))}
        env.update(RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   MODE=mode, STEPS=str(steps), PYTHONPATH=os.pathsep.join([boot_dir(), *extra_path]),
                   TORCHPASS_JOB_ID=str(JOB), TORCHPASS_RUNTIME="1" if runtime else "0",
                   TORCHPASS_PROGRESS_INTERVAL="0.05", **(env_extra or {}))
        if coordinator:
            env["TORCHPASS_COORDINATOR"] = coordinator
        out, err = open(tmp / f"{tag}.{r}.out", "w"), open(tmp / f"{tag}.{r}.err", "w")
        procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=out, stderr=err,
                                      stdin=subprocess.DEVNULL))
    try:
        if on_start is not None:
            on_start()
        for p in procs:
            p.wait(240)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    errs = [(tmp / f"{tag}.{r}.err").read_text() for r in range(world)]
    for r, p in enumerate(procs):
        assert p.returncode == 0, errs[r][-3000:]
    return [(tmp / f"{tag}.{r}.out").read_text().splitlines() for r in range(world)], errs


def torchpass_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("torchpass:")]


def assert_one_unprotected_line(errs: list[str]) -> None:
    for r, err in enumerate(errs):
        lines = torchpass_lines(err)
        assert len(lines) == 1 and lines[0].startswith(f"torchpass: rank {r} unprotected: "), err
        assert "cannot move" in lines[0], lines[0]


@pytest.fixture(scope="module")
def plain_mesh2d(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plain")
    out, errs = run(tmp, "plain", "mesh2d", 4, runtime=False, steps=12)
    assert all(len(o) == 12 for o in out) and not any(torchpass_lines(e) for e in errs)
    # ranks 0, 1 form a tp group (same summed loss), ranks 0, 2 a dp group (other data)
    assert out[0] == out[1] and out[0] != out[2]
    return out


def test_switchable_store_clones_its_current_store():
    inner = dist.HashStore()
    clone = SwitchableStore(inner).clone()  # was: pure virtual function ::c10d::Store::clone
    clone.set("k", "v")
    assert inner.get("k") == b"v"
    with pytest.raises(StoreClosedError):
        SwitchableStore().clone()


def test_2d_mesh_runs_as_without_the_runtime(plain_mesh2d, tmp_path):
    out, errs = run(tmp_path, "on", "mesh2d", 4, runtime=True, steps=12)
    assert out == plain_mesh2d
    assert_one_unprotected_line(errs)


def test_2d_mesh_refuses_pauses_cleanly(plain_mesh2d, tmp_path):
    """A pause accepted before the mesh exists is refused once it does; a pause
    asked for later is refused at once. Each is cancelled and training runs on."""
    go = tmp_path / "go"
    with MiniCoordinator(4, JOB) as coord:
        def drive():
            coord.wait_registered()
            at, gen = coord.pause(margin=0, at=10**6)  # accepted: no subgroup yet
            assert gen == 1 and not any(v.unprotected for v in coord.ranks.values())
            go.touch()  # now every rank makes the mesh
            reasons = coord.wait_refused()
            assert all("cannot move" in why for why in reasons.values()), reasons
            coord.resume(gen, "127.0.0.1", 1)  # the cancel (no rebuild: the port is not used)
            assert all(r.get("cancelled") for r in coord.wait_resumed(gen).values())
            coord.wait_collectives(6)
            with pytest.raises(JobUnprotected) as refused:
                coord.pause(margin=2)
            assert refused.value.generation == 2 and set(refused.value.reasons) == {0, 1, 2, 3}
            coord.resume(2, "127.0.0.1", 1)
            assert all(r.get("cancelled") for r in coord.wait_resumed(2).values())

        out, errs = run(tmp_path, "refuse", "mesh2d", 4, runtime=True, steps=12, coordinator=coord.endpoint,
                        env_extra={"GO": str(go), "SLEEP": "0.1"}, on_start=drive)
    assert out == plain_mesh2d
    assert_one_unprotected_line(errs)


def test_an_error_inside_the_runtime_leaves_training_unchanged(plain_mesh2d, tmp_path):
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(INJECT)
    out, errs = run(tmp_path, "fault", "mesh2d", 4, runtime=True, steps=12, extra_path=[str(inject)])
    assert out == plain_mesh2d
    for err in errs:
        lines = torchpass_lines(err)
        assert lines and all("could not check the new process group (RuntimeError: injected fault" in ln
                             for ln in lines), err


def test_new_group_runs_as_without_the_runtime(tmp_path):
    plain, _ = run(tmp_path, "plain", "newgroup", 2, runtime=False)
    out, errs = run(tmp_path, "on", "newgroup", 2, runtime=True)
    assert out == plain and len(out[0]) == 5
    assert out[0][0].startswith("split_group RuntimeError")  # gloo on CPU cannot split, either way
    assert_one_unprotected_line(errs)


def test_3d_mesh_runs_as_without_the_runtime(tmp_path):
    """A 2 x 1 x 2 mesh: DeviceMesh makes the groups of all three dimensions.
    (2 x 2 x 2 on 8 ranks passes too, but costs ~2 minutes on 2 shared cores;
    MESH3D=2,2,2 with WORLD3D=8 runs it.)"""
    world = int(os.environ.get("WORLD3D", "4"))
    extra = {"MESH3D": os.environ.get("MESH3D", "2,1,2")}
    plain, _ = run(tmp_path, "plain", "mesh3d", world, runtime=False, steps=2, env_extra=extra)
    out, errs = run(tmp_path, "on", "mesh3d", world, runtime=True, steps=2, env_extra=extra)
    assert out == plain and len(out[0]) == 2
    assert out[0] != out[world // 2]  # another dp index: other data
    assert_one_unprotected_line(errs)
