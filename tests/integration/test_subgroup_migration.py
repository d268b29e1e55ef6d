"""A DeviceMesh job moves like a DDP job (issue 11, subgroups).

The job: data x tensor parallel on a 2-D CPU DeviceMesh, 6 ranks, 2 per
node: ``init_device_mesh("cpu", (3, 2), mesh_dim_names=("dp", "tp"))``,
gradients averaged over ``dp``, the loss summed over ``tp``, and the global
mean loss (the default group) printed as ``step=N loss=<float.hex>``. The
script knows nothing about torchpass.

The reference is the same script under plain ``sbatch -N3`` (no
``--torchpass``: the runtime is not even loaded). The drilled job runs as
the tests' ordinary job user with ``-N4 --torchpass=spares=1``; an ECC drill
lands on a random training node at a random step: both ranks there are
paused with every group torn down (no socket left: CRIU dumps them), moved
to the spare, and every group, the mesh's included, is rebuilt. The job
keeps its id, ``Restarts=0``, ends COMPLETED 0:0, and every step appears
exactly once per rank with the reference's losses bit for bit.

Randomness: node and step from one seed, printed; ``TORCHPASS_TEST_SEED=N``
replays a run.
"""

from __future__ import annotations

import json
import os
import random
import textwrap
import time
from pathlib import Path

import pytest
import training_jobs as tj

from slurm_helpers import job_id_of, job_python, sbatch, submit_env
from torchpass import layout

pytestmark = pytest.mark.integration

STEPS = 120
TRAINING_NODES = ("node1", "node2", "node3")
SPARE = "node4"
RANKS = 6
# Each step counts 2 (its end and the loss all_reduce): T = max + 64 is ~32 steps
# after the drill; leave the move time to finish before training does.
FAULT_STEPS = (2, 60)
SEED = int(os.environ.get("TORCHPASS_TEST_SEED") or time.time_ns() % 1_000_000)

MESH_SCRIPT = textwrap.dedent(
    r"""
    import os, sys, time, torch, torch.distributed as dist, torch.nn as nn
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_ddp import setup_env  # RANK/WORLD_SIZE/MASTER_* from Slurm
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    setup_env()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
    torch.manual_seed(mesh.get_local_rank("tp"))  # a tensor-parallel shard per tp index
    m = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(mesh.get_local_rank("dp"))  # data per dp index
    for step in range(int(sys.argv[1])):
        part = m(torch.randn(16, 32, generator=g)).pow(2).mean()
        opt.zero_grad(); part.backward()
        for p in m.parameters():
            dist.all_reduce(p.grad, group=dp); p.grad /= dist.get_world_size(dp)
        opt.step()
        loss = part.detach().clone(); dist.all_reduce(loss, group=tp)
        dist.all_reduce(loss)
        print(f"step={step} loss={(loss.item() / world).hex()}", flush=True)
        time.sleep(0.05)
    dist.destroy_process_group()
    """
)


def _submit(job_dir: Path, tag: str, nodes: int, torchpass: str | None, user: str | None) -> int:
    tj.train_script(job_dir)  # train_ddp.py beside it: setup_env
    script = job_dir / "train_mesh.py"
    if not script.exists():
        script.write_text(MESH_SCRIPT)
        st = job_dir.stat()
        os.chown(script, st.st_uid, st.st_gid)
    strict = {k: v for k, v in os.environ.items() if k == "TORCHPASS_STRICT_TRANSITIONS"}
    args = ["-N", str(nodes), "--ntasks-per-node=2", "-o", str(job_dir / f"{tag}.%j.out")]
    if torchpass:
        args.insert(0, f"--torchpass={torchpass}")
    proc = sbatch(args, f"#!/bin/bash\nsrun {job_python()} {script} {STEPS}\n", cwd=job_dir, user=user,
                  env={**submit_env(user), **strict})
    return job_id_of(proc)


def _events(cluster, job_id: int) -> list[dict]:
    p = layout.events_json(cluster.state_dir, job_id)
    return json.loads(p.read_text()) if p.exists() else []


def _diag(cluster, job_id: int, out_path: Path, what: str) -> str:
    """Everything to look at when the job went wrong: its output, events, coordinator log."""
    log = layout.coordinator_log(cluster.state_dir, job_id)
    parts = [f"seed={SEED} ({what}; replay with TORCHPASS_TEST_SEED={SEED})",
             out_path.read_text()[-3000:] if out_path.exists() else "no job output",
             "--- events ---", *(f"{e['kind']}: {e['message']}" for e in _events(cluster, job_id)),
             "--- coordinator.log ---", log.read_text()[-6000:] if log.exists() else ""]
    return "\n".join(parts)


def _reached(out_path: Path, step: int) -> bool:
    return out_path.exists() and f"step={step} " in out_path.read_text()


def _leave_clean(jobs: list[int]) -> None:
    """No job of the test left, no drill armed, no torchpass drain."""
    for j in jobs:
        tj.run(["scancel", str(j)])
    for n in (*TRAINING_NODES, SPARE):
        tj.run([*tj.TPASSCTL, "inject", "--node", n, "--fault", "clear"])
        if "DRAIN" in tj.node(n)["state"] and tj.node(n).get("reason", "").startswith("torchpass"):
            tj.run(["scontrol", "update", f"NodeName={n}", "State=RESUME"])


def test_2d_mesh_job_migrates_bit_identical(cluster, plugin_built, job_dir, job_user):
    jobs: list[int] = []
    try:
        _drill(cluster, job_dir, job_user, jobs)
    finally:
        _leave_clean(jobs)


def _drill(cluster, job_dir: Path, job_user, clean: list[int]) -> None:
    rng = random.Random(f"{SEED}:mesh2d")
    node, at = rng.choice(TRAINING_NODES), rng.randint(*FAULT_STEPS)
    what = f"ecc-sbe-storm on {node} at step {at}, DP x TP mesh of {RANKS} ranks, 2 per node"
    print(f"\ntest_subgroup_migration seed={SEED}: {what}")

    ref_id = _submit(job_dir, "ref", 3, None, job_user.name)
    clean.append(ref_id)
    ref = tj.wait_end(ref_id, 300, context=f"seed={SEED}: reference ")
    ref_text = (job_dir / f"ref.{ref_id}.out").read_text()
    assert ref["job_state"][0] == "COMPLETED", ref_text[-3000:]
    ref_lines = tj.steps(ref_text)
    assert len(ref_lines) == RANKS * STEPS and "torchpass" not in ref_text, ref_text[-3000:]
    reference = tj.per_step(ref_lines)
    assert all(len(c) == 1 for c in reference.values())  # every rank prints the same global loss

    job_id = _submit(job_dir, "mig", 4, "spares=1", job_user.name)
    clean.append(job_id)
    out_path = job_dir / f"mig.{job_id}.out"
    deadline = time.monotonic() + 180
    while not _reached(out_path, at):
        assert time.monotonic() < deadline, _diag(cluster, job_id, out_path, f"step {at} not reached")
        time.sleep(0.1)
    inj = tj.run([*tj.TPASSCTL, "inject", "--node", node, "--fault", "ecc-sbe-storm"])
    assert inj.returncode == 0, (SEED, inj.stderr)

    final = tj.wait_end(job_id, 300, context=f"seed={SEED}: ")
    diag = _diag(cluster, job_id, out_path, what)
    assert final["job_id"] == job_id, diag
    assert final["job_state"][0] == "COMPLETED", diag
    assert final["exit_code"]["return_code"]["number"] == 0, diag
    assert int(final.get("restart_cnt", 0)) == 0, diag
    text = out_path.read_text()
    assert "unprotected" not in text, diag
    assert tj.per_step(tj.steps(text)) == reference, diag
    done = [e for e in _events(cluster, job_id) if e["kind"] == "migration.completed"]
    assert len(done) == 1, diag
    assert done[0]["data"]["node"] == node and done[0]["data"]["target"] == SPARE, diag
    print(f"migration {node} -> {SPARE} (drill at step {at}): phases {done[0]['data'].get('phase_durations')}")
