"""``srun torchrun`` under --torchpass: a degrading node's workers move.

The job (as the tests' ordinary user, 3 training nodes): ``srun torchrun
--nnodes=3 --nproc-per-node=2 --rdzv-backend=c10d
--rdzv-endpoint=<first node>`` of a small gloo DDP script, 6 workers. Each
Slurm task is torchrun's agent; its two workers are ranks of the runtime,
and the task's whole tree (agent and workers) is what tpassd dumps and
restores. The agent on the endpoint's node serves the rendezvous store, and
the agent of node rank 0 the workers' bootstrap store (torch 2.13 sorts the
nodes by name: both on node1): that node cannot move (its servers' clients
could not follow it), so its workers register it as pinned.

Run twice: under plain sbatch (the reference) and under
``--torchpass=spares=1``. In the second, an ECC drill lands on a random
other training node at a random step (seed printed;
``TORCHPASS_TEST_SEED=N`` replays); once that move has completed, a second
drill lands on node1, the store's node. The workers end their training, then
wait for a release file, so the answer to the second drill is seen while
the job runs.

Checked: same job id, COMPLETED 0:0, ``Restarts=0``; every step exactly once
per worker with the reference's losses bit for bit; each worker's
``TORCHELASTIC_RESTART_COUNT`` still 0 at the end (the agent never saw a
worker die); one ``migration.completed`` for the drilled node with both of
its workers moved; the store's node answered by ``migration.skipped`` naming
the store; no ``unprotected`` line. (Without the task key every torchrun
job runs unprotected: the drill is answered by migration.skipped.)

A second job uses docs/runtime.md's recipe (the batch script serves the rendezvous store, no
agent hosts it) in torchrun's elastic form, ``--nnodes=2:3``, and the drill lands on node1.
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
from drill import diagnosis, events, leave_clean
from slurm_helpers import job_id_of, job_python, sbatch, submit_env, tpassctl

pytestmark = pytest.mark.integration

SEED = int(os.environ.get("TORCHPASS_TEST_SEED") or time.time_ns() % 1_000_000)
STEPS = 80
NODES = ("node1", "node2", "node3")  # training nodes; node4 is the spare
WORKERS = 2 * len(NODES)
STORE_NODE = "node1"  # the rendezvous endpoint, and node rank 0 (the bootstrap store)

SCRIPT = textwrap.dedent(
    r"""
    import os, sys, time, torch, torch.distributed as dist, torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    def say(line):  # one write(2) per line: the node's 2 workers share torchrun's stdout
        sys.stdout.write(line + "\n"); sys.stdout.flush()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # env:// as torchrun sets it up
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    for step in range(int(sys.argv[1])):
        x = torch.randn(8, 16, generator=g)
        loss = nn.functional.mse_loss(model(x), torch.tanh(x.sum(1, keepdim=True)))
        opt.zero_grad(); loss.backward(); opt.step()
        t = loss.detach().clone(); dist.all_reduce(t)
        say(f"step={step} loss={(t.item() / world).hex()}")
        time.sleep(0.1)
    release, end = sys.argv[2], time.monotonic() + 180
    while not os.path.exists(release) and time.monotonic() < end:
        time.sleep(0.1)
    dist.barrier()
    say(f"restarts={os.environ.get('TORCHELASTIC_RESTART_COUNT')}")
    dist.destroy_process_group()
    os._exit(0)  # plain torch 2.13 may abort at a normal exit (docs/runtime.md, "Unprotected jobs")
    """
)

# The recipe of docs/runtime.md ("torchrun"): the batch script serves the rendezvous store on the
# batch host, outside every task, and no agent hosts it (is_host=false): every node can move.
SERVE = ('{py} -c "import datetime, sys, time, torch.distributed as d; '
         "s = d.TCPStore(sys.argv[1], int(sys.argv[2]), 1, True, datetime.timedelta(seconds=600), "
         'wait_for_workers=False, multi_tenant=True); time.sleep(86400)" "$head" "$port" &\nstore=$!')


def _submit(d: Path, tag: str, torchpass: bool, user, served_by_batch: bool = False,
            nnodes: str = '"$SLURM_NNODES"') -> tuple[int, Path, Path]:
    """sbatch the torchrun job as ``user``; (job id, its output file, its release file)."""
    release = d / f"{tag}.release"
    args = ["-N", str(len(NODES) + torchpass), "-o", str(d / f"{tag}.%j.out")]
    if torchpass:
        args.insert(0, "--torchpass=spares=1")
    torchrun = Path(job_python()).parent / "torchrun"  # torch's console script in the job venv
    script = tj.torchrun_batch(d, torchrun, nnodes, f"tr.py {STEPS} {release}",
                               serve=SERVE.format(py=job_python()) if served_by_batch else "",
                               conf="--rdzv-conf=is_host=false" if served_by_batch else "",
                               stop="kill $store" if served_by_batch else "")
    job_id = job_id_of(sbatch(args, script, cwd=d, user=user.name, env=submit_env(user.name)))
    return job_id, d / f"{tag}.{job_id}.out", release


def _wait_for(what: str, ready, timeout_s: float, diag) -> None:
    end = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < end, diag(f"{what} not within {timeout_s:g} s")
        time.sleep(0.2)


_REFERENCE: dict = {}  # one plain run for both tests: the same script, the same losses


def _reference(job_dir: Path, job_user, jobs: list[int]) -> dict:
    """Every step's loss under plain sbatch (run once per module)."""
    if "steps" in _REFERENCE:
        return _REFERENCE["steps"]
    (job_dir / "ref.release").touch()  # released from the start
    ref_id, ref_out, _ = _submit(job_dir, "ref", False, job_user)
    jobs.append(ref_id)
    t0 = time.monotonic()
    ref_final = tj.wait_end(ref_id, 300, context="torchrun reference: ")
    ref_text = ref_out.read_text()
    assert ref_final["job_state"][0] == "COMPLETED", ref_text[-3000:]
    # nothing of torchpass's (its lines start "torchpass:"; the job Python's path
    # /opt/torchpass-dev/... shows up in torch's own tracebacks, e.g. an agent's rendezvous
    # shutdown error at the end)
    assert not [ln for ln in ref_text.splitlines() if ln.startswith("torchpass")], ref_text[-3000:]
    assert ref_text.splitlines().count("restarts=0") == WORKERS, ref_text[-3000:]
    ref = tj.per_step(tj.steps(ref_text))
    assert sorted(ref) == list(range(STEPS)) and all(sum(c.values()) == WORKERS for c in ref.values()), \
        ref_text[-3000:]
    assert all(len(c) == 1 for c in ref.values()), "the workers disagree on a step's loss"
    _REFERENCE.update(steps=ref, seconds=time.monotonic() - t0)
    return ref


def _script(job_dir: Path, job_user) -> None:
    (job_dir / "tr.py").write_text(SCRIPT)
    os.chown(job_dir / "tr.py", job_user.uid, job_user.gid)


def _check_end(cluster, job_id: int, out: Path, ref: dict, moved: list[str], diag) -> list[dict]:
    """The job ended as the plain one did, with exactly the moves of ``moved``; its events."""
    final = tj.wait_end(job_id, 300, context=f"torchrun job {job_id}: ")
    text, evs = out.read_text(), events(cluster, job_id)
    d = diag("after the job")
    assert final["job_id"] == job_id and final["job_state"][0] == "COMPLETED", d
    assert final["exit_code"]["return_code"]["number"] == 0, d
    assert final["exit_code"]["signal"]["id"]["number"] == 0, d
    assert int(final.get("restart_cnt", 0)) == 0, d
    # the same training, bit for bit, and torchrun never restarted its workers
    assert tj.per_step(tj.steps(text)) == ref, d
    assert text.splitlines().count("restarts=0") == WORKERS, d
    assert not [ln for ln in text.splitlines() if ln.startswith("torchpass:") and "unprotected" in ln], d
    assert [e["data"].get("node") for e in evs if e["kind"] == "migration.completed"] == moved, d
    assert [e["data"].get("node") for e in evs if e["kind"] == "migration.started"] == moved, d
    return evs


def test_srun_torchrun_moves_a_degrading_node_and_keeps_the_store_node(cluster, plugin_built, job_dir, job_user):
    rng = random.Random(f"{SEED}:torchrun")
    node, at = rng.choice([n for n in NODES if n != STORE_NODE]), rng.randint(3, 15)
    what = (f"seed={SEED} (replay with TORCHPASS_TEST_SEED={SEED}): ecc-sbe-storm on {node} at step {at}, "
            f"then on {STORE_NODE}; srun torchrun --nnodes=3 --nproc-per-node=2")
    print(f"\n{what}")
    _script(job_dir, job_user)
    jobs: list[int] = []
    try:
        ref = _reference(job_dir, job_user, jobs)
        job_id, out, release = _submit(job_dir, "tp", True, job_user)
        t0 = time.monotonic()
        jobs.append(job_id)

        def diag(msg: str) -> str:
            return diagnosis(cluster, job_id, out, f"{msg}; {what}")

        def kinds(kind: str, on: str) -> list[dict]:
            return [e for e in events(cluster, job_id) if e["kind"] == kind and e["data"].get("node") == on]

        _wait_for(f"step {at}", lambda: out.exists() and f"step={at} " in out.read_text(), 240, diag)
        try:
            inj = tj.run([*tj.TPASSCTL, "inject", "--node", node, "--fault", "ecc-sbe-storm"])
            assert inj.returncode == 0, (what, inj.stderr)
            _wait_for("migration.completed", lambda: kinds("migration.completed", node), 180, diag)
            t_moved = time.monotonic() - t0
            inj = tj.run([*tj.TPASSCTL, "inject", "--node", STORE_NODE, "--fault", "ecc-sbe-storm"])
            assert inj.returncode == 0, (what, inj.stderr)
            _wait_for("migration.skipped", lambda: kinds("migration.skipped", STORE_NODE), 120, diag)
            st = tpassctl("status", str(job_id), "--json", user=job_user.name)
        finally:
            release.touch()  # the workers leave whatever happened
        assert st.returncode == 0, st.stderr
        row = json.loads(st.stdout)["jobs"][0]
        assert row["protected"] is True and row["registered_ranks"] == WORKERS, row
        evs = _check_end(cluster, job_id, out, ref, [node], diag)
        skipped = [e for e in evs if e["kind"] == "migration.skipped" and e["data"].get("node") == STORE_NODE]
        assert "serves a TCP store" in skipped[0]["message"], diag("after the job")
        done = [e for e in evs if e["kind"] in ("migration.resumed", "migration.completed")]
        print(f"torchrun: {node} moved at step {at}, {STORE_NODE} kept: {skipped[0]['message']}\n"
              f"reference {_REFERENCE['seconds']:.1f} s; under --torchpass moved after {t_moved:.1f} s, "
              f"ended after {time.monotonic() - t0:.1f} s; " + "; ".join(e["message"] for e in done))
    finally:
        leave_clean_nodes(jobs)


def test_elastic_torchrun_with_the_store_served_by_the_batch_script_moves_the_batch_hosts_node(
        cluster, plugin_built, job_dir, job_user):
    """The recipe: the batch script serves the rendezvous store on the batch host (node1), outside
    every task; no agent hosts it, so no node is pinned. The drill lands on node1 itself.

    The elastic form, ``--nnodes=2:3``: the 3 agents meet in one round (it closes when the
    maximum has joined), so the job is the reference's (3 nodes, the same ranks); the move
    starts no new round (the moved agent keeps its place), so nothing restarts."""
    at = random.Random(f"{SEED}:torchrun-served").randint(3, 15)
    what = (f"seed={SEED} (replay with TORCHPASS_TEST_SEED={SEED}): ecc-sbe-storm on {STORE_NODE} at step {at}; "
            "srun torchrun --nnodes=2:3, the rendezvous store served by the batch script")
    print(f"\n{what}")
    _script(job_dir, job_user)
    jobs: list[int] = []
    try:
        ref = _reference(job_dir, job_user, jobs)
        job_id, out, release = _submit(job_dir, "served", True, job_user, served_by_batch=True,
                                       nnodes=f"2:{len(NODES)}")
        t0 = time.monotonic()
        jobs.append(job_id)

        def diag(msg: str) -> str:
            return diagnosis(cluster, job_id, out, f"{msg}; {what}")

        _wait_for(f"step {at}", lambda: out.exists() and f"step={at} " in out.read_text(), 240, diag)
        try:
            inj = tj.run([*tj.TPASSCTL, "inject", "--node", STORE_NODE, "--fault", "ecc-sbe-storm"])
            assert inj.returncode == 0, (what, inj.stderr)
            _wait_for("migration.completed", lambda: [e for e in events(cluster, job_id)
                                                      if e["kind"] == "migration.completed"], 180, diag)
        finally:
            release.touch()
        evs = _check_end(cluster, job_id, out, ref, [STORE_NODE], diag)
        assert not [e for e in evs if e["kind"] == "migration.skipped"], diag("after the job")
        done = [e for e in evs if e["kind"] in ("migration.resumed", "migration.completed")]
        print(f"elastic torchrun (store served by the batch script): {STORE_NODE} moved at step {at}, job ended after "
              f"{time.monotonic() - t0:.1f} s; " + "; ".join(e["message"] for e in done))
    finally:
        leave_clean_nodes(jobs)


def leave_clean_nodes(jobs: list[int]) -> None:
    """No job left, no drill armed, no torchpass drain (drill.leave_clean over these nodes)."""
    from drill import Drill

    leave_clean(Drill("torchrun", "", (), STEPS, nodes=len(NODES)), jobs)
