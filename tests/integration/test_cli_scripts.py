"""tpassctl as a script uses it, on the devcluster: the exit statuses and outputs it can trust.

One 4-node job of the job user (examples/train_ddp.py, 3 ranks and a hot spare):

* ``status`` shows, for each rank, the pid that ``scontrol listpids`` lists on its node (the rank
  itself registers the pid inside its PID namespace);
* ``migrate --wait`` exits 1 for a move that a ``restore-fail`` drill on the spare rolls back,
  then 0 for a move of another node that commits, printing one line per phase;
* ``events --follow``, started before the coordinator is up, ends by itself when the job ends, and
  its JSON lines carry both migrations' ends;
* ``nodes --check`` exits 1 once a drill degrades a node, 0 for a healthy one.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

import training_jobs as tj
from slurm_helpers import as_user, job_python, submit_env, tpassctl
from training_jobs import TPASSCTL

pytestmark = pytest.mark.integration

# Two moves one after the other, each ~40 steps from its request (pause point T = the furthest
# rank + 64 collectives, 2 a step) and a few seconds of dump and restore: room for both.
STEPS = 300


def _follow(job_id: int, user: str) -> subprocess.Popen:
    """``tpassctl events JOB --follow --json`` as ``user``, in the background."""
    prog = str(Path(job_python()).parent / "tpassctl")
    env = {**submit_env(user), **{k: v for k, v in os.environ.items() if k.startswith("TORCHPASS_")}}
    return subprocess.Popen(as_user([prog, "events", str(job_id), "--follow", "--json"], user), env=env, cwd="/",
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _running(job_id: int, user: str, world: int, timeout_s: float = 120) -> dict:
    end = time.monotonic() + timeout_s
    row: dict = {}
    while time.monotonic() < end:
        r = tpassctl("status", str(job_id), "--json", user=user)
        if r.returncode == 0:
            row = json.loads(r.stdout)["jobs"][0]
            if row["state"] == "running" and row.get("registered_ranks") == world and (row.get("min_step") or -1) >= 1:
                return row
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} never ran {world} ranks: {row}")


def test_a_script_can_trust_tpassctl(cluster, plugin_built, job_dir, job_user):
    user = job_user.name
    job_id = tj.submit(job_dir, "cli", STEPS, nodes=4, user=user)
    follower = _follow(job_id, user)
    out_path = job_dir / f"cli.{job_id}.out"

    def diag() -> str:
        got = tpassctl("events", str(job_id), "--json")
        evs = json.loads(got.stdout)["jobs"][0]["events"] if got.returncode == 0 else []
        return ((out_path.read_text()[-2000:] if out_path.exists() else "no output") + "\n"
                + "\n".join(f"{e['kind']}: {e['message']}" for e in evs))

    try:
        row = _running(job_id, user, 3)
        # status: each rank's pid on its node is one Slurm lists for the job there
        env = {**submit_env(None), **cluster.env()}
        for r in row["ranks"]:
            listed = cluster.exec_on(r["node"], ["scontrol", "listpids", str(job_id)], capture_output=True,
                                     text=True, env=env, timeout=30)
            pids = {int(w[0]) for w in (ln.split() for ln in listed.stdout.splitlines()[1:]) if w and w[0].isdigit()}
            assert r["host_pid"] in pids and r["host_pid"] != r["pid"], (r, listed.stdout)
        text = tpassctl("status", str(job_id), user=user)
        assert text.returncode == 0 and "HOST PID" in text.stdout.splitlines()[2], text.stdout

        nodes = sorted({r["node"] for r in row["ranks"]})
        spare = (set(row["nodes"]) - set(nodes)).pop()
        first, second = nodes[1], nodes[2]  # not the batch host (nodes[0] in a clean devcluster)
        armed = tj.run([*TPASSCTL, "inject", "--node", spare, "--fault", "restore-fail"])
        assert armed.returncode == 0, armed.stderr
        t0 = time.monotonic()
        failed = tpassctl("migrate", str(job_id), "--node", first, "--to", spare, "--wait", "150", user=user,
                          timeout=200)
        assert failed.returncode == 1, (failed.stdout, failed.stderr, diag())
        assert "rolled back" in failed.stderr.strip().splitlines()[-1], failed.stderr
        phases = [ln for ln in failed.stdout.splitlines() if ln.startswith("m1: ")]
        assert phases and len(phases) == len(set(phases)), failed.stdout  # one line per phase, not a live line
        print(f"migrate --wait of a rolled-back move: exit 1 after {time.monotonic() - t0:.1f} s; {phases}")

        t0 = time.monotonic()
        done = tpassctl("migrate", str(job_id), "--node", second, "--to", spare, "--wait", "150", "--json",
                        user=user, timeout=200)
        assert done.returncode == 0, (done.stdout, done.stderr, diag())
        lines = [json.loads(ln) for ln in done.stdout.splitlines()]
        assert lines[-1]["outcome"] == "completed" and lines[-1]["event"]["kind"] == "migration.completed", lines
        print(f"migrate --wait of a committed move: exit 0 after {time.monotonic() - t0:.1f} s; "
              f"{[ln['phase'] for ln in lines if 'phase' in ln]}")

        final = tj.wait_end(job_id, 300)
        assert final["job_state"][0] == "COMPLETED", diag()
        t_end = time.monotonic()
        out, err = follower.communicate(timeout=60)
        assert follower.returncode == 0, err
        print(f"events --follow ended {time.monotonic() - t_end:.1f} s after Slurm said the job ended")
        kinds = [json.loads(ln)["kind"] for ln in out.splitlines()]
        assert "migration.rolled_back" in kinds and "migration.completed" in kinds, kinds
        assert kinds.count("rank.registered") >= 3, kinds

        # nodes --check: a degraded node is unhealthy (exit 1); a healthy one is not
        assert tpassctl("nodes", "--node", spare, "--check").returncode == 0
        assert tj.run([*TPASSCTL, "inject", "--node", spare, "--fault", "ecc-sbe-storm"]).returncode == 0
        end = time.monotonic() + 30
        while (check := tpassctl("nodes", "--node", spare, "--check")).returncode == 0 and time.monotonic() < end:
            time.sleep(0.5)
        assert check.returncode == 1 and f"unhealthy (at or past degraded): {spare}" in check.stderr, check.stderr
        assert tpassctl("nodes", "--node", spare, "--check=failed").returncode == 0
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.communicate()
        tj.run(["scancel", str(job_id)])
        for n in ("node1", "node2", "node3", "node4"):
            tj.run([*TPASSCTL, "inject", "--node", n, "--fault", "clear"])
            st = tj.node(n)
            if "DRAIN" in st["state"] and st.get("reason", "").startswith("torchpass"):
                tj.run(["scontrol", "update", f"NodeName={n}", "State=RESUME"])
