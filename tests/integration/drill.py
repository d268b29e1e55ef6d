"""One fault drill of a training job on the devcluster, for any script.

``Drill`` names a job: a script written into the job dir (beside
examples/train_ddp.py, whose ``setup_env`` it may import), its arguments,
the training nodes and ranks per node. ``reference`` runs it under plain
sbatch (no ``--torchpass``: the runtime is not loaded) and returns its
per-step losses; ``migrate`` runs it with ``--torchpass=spares=1`` and one
more node (the spare), puts an ECC drill on a random training node at a
random step (both from ``seed``, printed), and checks the outcome: same job
id, ``Restarts=0``, COMPLETED 0:0, every step exactly once per rank with the
reference's losses bit for bit, one ``migration.completed`` event from that
node to the spare; with several ranks per node, before the fault, one
connection to the coordinator per node (the node relay). It returns that event's data (phase durations: the
stall is ``paused``). bench/bench_ranks_per_node.py uses it too.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import training_jobs as tj
from slurm_helpers import job_id_of, job_python, sbatch, submit_env
from torchpass import layout


@dataclass(frozen=True)
class Drill:
    name: str  # also the script's file name (NAME.py) and the tag of the outputs
    script: str  # its text; "" runs examples/train_ddp.py
    args: tuple[str, ...]
    steps: int
    nodes: int = 2  # training nodes; the spare is the next one
    per_node: int = 1
    fault_steps: tuple[int, int] = (2, 40)
    sbatch_extra: tuple[str, ...] = field(default=())

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node

    @property
    def training_nodes(self) -> tuple[str, ...]:
        return tuple(f"node{i}" for i in range(1, self.nodes + 1))

    @property
    def spare(self) -> str:
        return f"node{self.nodes + 1}"


def _script(d: Drill, job_dir: Path) -> Path:
    train = tj.train_script(job_dir)
    if not d.script:
        return train
    path = job_dir / f"{d.name}.py"
    if not path.exists():
        path.write_text(d.script)
        st = job_dir.stat()
        os.chown(path, st.st_uid, st.st_gid)
    return path


def submit(d: Drill, job_dir: Path, tag: str, torchpass: str | None, user: str | None) -> int:
    nodes = d.nodes + (1 if torchpass else 0)
    strict = {k: v for k, v in os.environ.items() if k == "TORCHPASS_STRICT_TRANSITIONS"}
    # -n, not --ntasks-per-node: with --overcommit Slurm refuses more tasks per node than CPUs
    # that way ("Requested node configuration is not available"); -n spreads them evenly
    args = ["-N", str(nodes), "-n", str(nodes * d.per_node), *d.sbatch_extra,
            "-o", str(job_dir / f"{tag}.%j.out")]
    if torchpass:
        args.insert(0, f"--torchpass={torchpass}")
    # a plain srun: under --torchpass the plugin keeps the spare's slots out of the step
    body = f"srun {job_python()} {_script(d, job_dir)} {' '.join(d.args)}\n"
    proc = sbatch(args, "#!/bin/bash\n" + body, cwd=job_dir, user=user, env={**submit_env(user), **strict})
    return job_id_of(proc)


def events(cluster, job_id: int) -> list[dict]:
    p = layout.events_json(cluster.state_dir, job_id)
    return json.loads(p.read_text()) if p.exists() else []



def coordinator_connections(cluster, job_id: int, nodes: tuple[str, ...]) -> int:
    """Established TCP connections to the job's coordinator, counted in every node's network."""
    port = json.loads(layout.coordinator_json(cluster.state_dir, job_id).read_text())["endpoint"].rsplit(":", 1)[1]
    n = 0
    for node in nodes:
        ss = cluster.exec_on(node, ["ss", "-Htn", "state", "established", f"( sport = :{port} )"],
                             capture_output=True, text=True, check=True)
        n += len(ss.stdout.splitlines())
    return n


def wait_step(cluster, job_id: int, out_path: Path, step: int, what: str, timeout_s: float = 240) -> None:
    """Wait until the job's output shows ``step`` (its ``step=N`` line); fail with the diagnosis."""
    deadline = time.monotonic() + timeout_s
    while not (out_path.exists() and f"step={step} " in out_path.read_text()):
        assert time.monotonic() < deadline, diagnosis(cluster, job_id, out_path, f"step {step} not reached; {what}")
        time.sleep(0.1)

def diagnosis(cluster, job_id: int, out_path: Path, what: str) -> str:
    log = layout.coordinator_log(cluster.state_dir, job_id)
    return "\n".join([what, tj.excerpt(out_path.read_text()) if out_path.exists() else "no job output",
                      "--- events ---", *(f"{e['kind']}: {e['message']}" for e in events(cluster, job_id)),
                      "--- coordinator.log ---", log.read_text()[-6000:] if log.exists() else ""])


def leave_clean(d: Drill, jobs: list[int]) -> None:
    """No job of the test left, no drill armed, no torchpass drain."""
    for j in jobs:
        tj.run(["scancel", str(j)])
    for n in (*d.training_nodes, d.spare):
        tj.run([*tj.TPASSCTL, "inject", "--node", n, "--fault", "clear"])
        if "DRAIN" in tj.node(n)["state"] and tj.node(n).get("reason", "").startswith("torchpass"):
            tj.run(["scontrol", "update", f"NodeName={n}", "State=RESUME"])


# The reference losses of each job shape run so far in this pytest process: a process serves one
# devcluster (an xdist worker's), and the modules it runs share them (the losses depend on the
# script, its arguments, the ranks' layout and sbatch options; a reference run takes 20-60 s here).
_REFERENCES: dict[tuple, dict] = {}


def reference(d: Drill, job_dir: Path, user: str | None, jobs: list[int]) -> dict:
    """The per-step losses of ``d`` under plain sbatch: run once per process and shape."""
    key = (d.script, d.args, d.nodes, d.per_node, d.sbatch_extra)
    if key in _REFERENCES:
        return _REFERENCES[key]
    job_id = submit(d, job_dir, "ref", None, user)
    jobs.append(job_id)
    final = tj.wait_end(job_id, 300, context=f"{d.name} reference: ")
    text = (job_dir / f"ref.{job_id}.out").read_text()
    assert final["job_state"][0] == "COMPLETED", tj.excerpt(text)
    lines = tj.steps(text)
    assert len(lines) == d.ranks * d.steps and "torchpass" not in text, tj.excerpt(text)
    ref = tj.per_step(lines)
    assert all(len(c) == 1 for c in ref.values()), "the ranks disagree on a step's loss"
    _REFERENCES[key] = ref
    return ref


def migrate(cluster, d: Drill, job_dir: Path, user: str | None, seed: int, jobs: list[int],
            ref: dict | None, unprotected: str = "") -> dict:
    """The drilled run (checked against ``ref`` when given); the completed migration's data.
    With ``unprotected``: the job must instead say so (that text, one line per rank that saw it:
    the first one's refusal cancels the pause for all) and the move roll back, training on
    unchanged; the rollback's data."""
    rng = random.Random(f"{seed}:{d.name}")
    node, at = rng.choice(d.training_nodes), rng.randint(*d.fault_steps)
    what = (f"seed={seed} (replay with TORCHPASS_TEST_SEED={seed}): ecc-sbe-storm on {node} at step {at}, "
            f"{d.name}: {d.ranks} ranks, {d.per_node} per node")
    print(f"\n{what}")
    job_id = submit(d, job_dir, "mig", "spares=1", user)
    jobs.append(job_id)
    out_path = job_dir / f"mig.{job_id}.out"
    wait_step(cluster, job_id, out_path, at, what)
    if d.per_node > 1:
        # The ranks of a node share one connection to the coordinator (the node relay).
        end, conns = time.monotonic() + 5, -1
        while conns != d.nodes and time.monotonic() < end:
            conns = coordinator_connections(cluster, job_id, (*d.training_nodes, d.spare))
            time.sleep(0.2)
        assert conns == d.nodes, diagnosis(cluster, job_id, out_path,
                                           f"{what}: {conns} connections to the coordinator, not one per node")
    inj = tj.run([*tj.TPASSCTL, "inject", "--node", node, "--fault", "ecc-sbe-storm"])
    assert inj.returncode == 0, (what, inj.stderr)
    final = tj.wait_end(job_id, 400, context=f"{what}: ")
    diag = diagnosis(cluster, job_id, out_path, what)
    assert final["job_id"] == job_id, diag
    assert final["job_state"][0] == "COMPLETED", diag
    assert final["exit_code"]["return_code"]["number"] == 0, diag
    assert int(final.get("restart_cnt", 0)) == 0, diag
    text = out_path.read_text()
    if ref is not None:
        assert tj.per_step(tj.steps(text)) == ref, diag
    if unprotected:
        said = [ln for ln in text.splitlines() if ln.startswith("torchpass:") and unprotected in ln]
        assert 1 <= len(said) <= d.ranks and len(said) == len(set(said)), diag
        evs = events(cluster, job_id)
        assert not [e for e in evs if e["kind"] == "migration.completed"], diag
        assert [e for e in evs if e["kind"] == "job.unprotected" and unprotected in e["message"]], diag
        back = [e for e in evs if e["kind"] == "migration.rollback" and "unprotected" in e["message"]]
        assert len(back) == 1, diag
        print(f"{d.name}: unprotected, migration rolled back: {back[0]['message']}")
        return back[0]["data"]
    assert "unprotected" not in text, diag
    done = [e for e in events(cluster, job_id) if e["kind"] == "migration.completed"]
    assert len(done) == 1, diag
    assert done[0]["data"]["node"] == node and done[0]["data"]["target"] == d.spare, diag
    moved = done[0]["message"].split("moved ranks [", 1)[-1].split("]", 1)[0]
    assert len(moved.split(",")) == d.per_node, diag  # every rank of the node moved, none left behind
    print(f"{d.name}: migration {node} -> {d.spare} (drill at step {at}): "
          f"phases {done[0]['data'].get('phase_durations')}")
    return done[0]["data"]
