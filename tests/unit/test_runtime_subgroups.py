"""Subgroups under the runtime, driven through the control link.

A job that makes process groups besides the default one (new_group,
DeviceMesh) runs exactly as without the runtime (same losses bit for bit,
float.hex; exit code 0) and its groups are reconfigurable: the coordinator
pauses every rank (no socket left in the process while it holds), resumes
it at a new rendezvous, and training goes on identically
(test_subgroup_pause.py pauses meshes, HSDP and a pipeline at several points
without a coordinator). Do no harm: when the runtime fails to make a group
reconfigurable (an error injected there), the group is made as torch makes
it, every rank says once that it is unprotected and refuses pauses cleanly,
and training is unchanged; an error inside the runtime's own check changes
nothing either. The scripts know nothing about torchpass; the runtime comes
in through boot/sitecustomize.py, as in a job.
"""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from torchpass.runtime.pg import count_sockets
from torchpass.runtime.store import StoreClosedError, SwitchableStore
from torchpass.runtime.testing import JobUnprotected, MiniCoordinator, free_port, hold_files, run_ranks

JOB = 4343

SCRIPT = textwrap.dedent(
    r"""
    import os, time, torch, torch.distributed as dist, torch.nn as nn
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mode, r = os.environ["MODE"], dist.get_rank()
    go = os.environ.get("GO")
    while go and not os.path.exists(go):
        time.sleep(0.01)
    if mode == "newgroup":
        try:  # CPU gloo cannot split: the same error with and without the runtime
            dist.split_group(split_ranks=[[0], [1]])
            print("split_group ok", flush=True)
        except Exception as exc:
            print("split_group", type(exc).__name__, exc, flush=True)
        dp, tp, dp_i, tp_i = dist.new_group([0, 1], backend=os.environ.get("NG_BACKEND") or None), None, r, 0
    else:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
        dp_i, tp_i = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
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
        total = loss.clone(); dist.all_reduce(total)  # and the default group
        print(s, loss.item().hex(), total.item().hex(), flush=True)
        time.sleep(float(os.environ.get("SLEEP", "0")))
    dist.destroy_process_group()
    os._exit(0)  # plain torch 2.13 may abort at a normal exit (docs/runtime.md, "Unprotected jobs")
    """
)

# Errors inside the runtime, injected from a sitecustomize that boot/sitecustomize.py chains to.
INJECT = {
    "check": textwrap.dedent(
        """
        import torchpass.runtime.pg as pg

        def broken(self):
            raise RuntimeError("injected fault in the runtime")

        pg.ReconfigurablePG.note_native_groups = broken
        """
    ),
    "subgroup": textwrap.dedent(
        """
        import torchpass.runtime.pg as pg

        def broken(self, *args):
            raise RuntimeError("injected fault in the runtime")

        pg.ReconfigurablePG._new_subgroup = broken
        """
    ),
}


def run(tmp: Path, tag: str, mode: str, world: int, runtime: bool, steps: int = 4, inject: str = "",
        coordinator: str | None = None, env_extra: dict | None = None,
        on_start=None) -> tuple[list[list[str]], list[str]]:
    extra_path = []
    if inject:
        (tmp / inject).mkdir()
        (tmp / inject / "sitecustomize.py").write_text(INJECT[inject])
        extra_path = [str(tmp / inject)]
    return run_ranks(SCRIPT, world, tmp, tag, runtime=runtime, job_id=JOB, extra_path=extra_path,
                     coordinator=coordinator, on_start=on_start,
                     env={"MODE": mode, "STEPS": str(steps), **(env_extra or {})})


def torchpass_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("torchpass:")]


@pytest.fixture(scope="module")
def plain_mesh2d(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plain")
    out, errs = run(tmp, "plain", "mesh2d", 4, runtime=False, steps=10)
    assert all(len(o) == 10 for o in out) and not any(torchpass_lines(e) for e in errs)
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


def test_2d_mesh_is_paused_and_resumed_by_the_coordinator(plain_mesh2d, tmp_path):
    """A pause accepted before the mesh exists is carried out after it: every rank
    holds no socket (what CRIU's dump needs), then resumes at a new port."""
    go = tmp_path / "go"
    holding: dict[int, int] = {}
    with MiniCoordinator(4, JOB) as coord:
        def drive():
            coord.wait_registered()
            # each step: its end, then the total all_reduce (the mesh's groups are not counted)
            holds = hold_files(tmp_path, JOB, "m1", range(4))
            at, gen = coord.pause(margin=0, at=7, hold_files=holds)  # mid-step 3, before its total all_reduce
            go.touch()  # now every rank makes the mesh
            quiesced = coord.wait_quiesced()
            assert {q["collectives"] for q in quiesced.values()} == {7}
            for r, v in coord.ranks.items():
                deadline = time.monotonic() + 20
                while count_sockets(v.pid) and time.monotonic() < deadline:
                    time.sleep(0.02)  # the link closes its context right after the quiesced reply
                holding[r] = count_sockets(v.pid)
            coord.resume(gen, "127.0.0.1", free_port())
            for h in holds.values():
                Path(h).touch()
            assert all(r["generation"] == gen and not r.get("cancelled") for r in coord.wait_resumed(gen).values())

        out, errs = run(tmp_path, "pause", "mesh2d", 4, runtime=True, steps=10, coordinator=coord.endpoint,
                        env_extra={"GO": str(go)}, on_start=drive)
    assert holding == {0: 0, 1: 0, 2: 0, 3: 0}
    assert out == plain_mesh2d
    assert not any(torchpass_lines(e) for e in errs), errs


def test_a_group_the_runtime_fails_to_make_is_native_and_refuses_pauses(plain_mesh2d, tmp_path):
    """Do no harm: with an error injected where the runtime makes a subgroup, the
    mesh's groups are made as torch makes them, each rank says once that it is
    unprotected, a pause is refused and cancelled, and training is unchanged."""
    with MiniCoordinator(4, JOB) as coord:
        def drive():
            coord.wait_registered()
            coord.wait_collectives(4)
            with pytest.raises(JobUnprotected) as refused:
                coord.pause(margin=2)
            assert refused.value.generation == 1 and set(refused.value.reasons) == {0, 1, 2, 3}
            assert all("cannot move" in why for why in refused.value.reasons.values())
            coord.resume(1, "127.0.0.1", 1)  # the cancel (no rebuild: the port is not used)
            assert all(r.get("cancelled") for r in coord.wait_resumed(1).values())

        out, errs = run(tmp_path, "refuse", "mesh2d", 4, runtime=True, steps=10, inject="subgroup",
                        coordinator=coord.endpoint, env_extra={"SLEEP": "0.1"}, on_start=drive)
    assert out == plain_mesh2d
    for r, err in enumerate(errs):
        lines = torchpass_lines(err)
        made = [ln for ln in lines if "could not make group" in ln]
        assert len(made) == 2 and all("injected fault" in ln for ln in made), err  # dp and tp
        rest = [ln for ln in lines if ln not in made]
        assert len(rest) == 1 and rest[0].startswith(f"torchpass: rank {r} unprotected: ") \
            and "cannot move" in rest[0], err


def test_an_error_inside_the_runtimes_check_leaves_training_unchanged(plain_mesh2d, tmp_path):
    out, errs = run(tmp_path, "fault", "mesh2d", 4, runtime=True, steps=10, inject="check")
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
    assert not any(torchpass_lines(e) for e in errs), errs
    # a backend the runtime does not serve as asked for: torch makes the group, unprotected
    out, errs = run(tmp_path, "other", "newgroup", 2, runtime=True, env_extra={"NG_BACKEND": "cpu:gloo"})
    assert out == plain
    for r, err in enumerate(errs):
        lines = torchpass_lines(err)
        assert len(lines) == 1 and lines[0].startswith(f"torchpass: rank {r} unprotected: the job made native"), err
