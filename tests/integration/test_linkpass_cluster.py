"""Data rails on a real devcluster: a rail pulled, flapping or lost with its twin.

A devcluster of its own (``DevclusterSpec(rails=2)``: rail0 and rail1 on every node, each on
its own bridge, beside the management network eth0), brought up for this module so that the
shared cluster's tests keep today's single network. Nothing but the drills and tpassd runs:

* ``devcluster link NODE --rail 0 down`` on a random node (seed printed, TORCHPASS_TEST_SEED
  replays) makes that node's tpassd publish rail0 failed while the node stays healthy (a job
  reroutes around a rail, nothing moves), and the management network still answers;
* five flaps leave the rail degraded (flapping) once it is back up, the node still healthy;
* with both rails down the node is failed ("no usable data rail left"); plugged back, it is not;
* an ordinary user's 2-node gloo job, submitted with the cluster's exports (TORCHPASS_DATA_RAILS),
  trains over the data rails: their byte counters carry its collectives, eth0 does not;
* the same job with rail0 of a random node flapping five times at a random step is rerouted in
  place once (link.down, link.rerouted with the pause), no migration, every rank on its node, the
  losses of a fault-free run of the same job bit for bit; once the rail has stayed healthy for the
  policy's rail_restore_after_s, the job goes back onto both rails (link.restored) and rail0's
  byte counters rise again.

The nodes' tpassds keep a flapped rail degraded for 10 s (``rail_flap_window_s``; 300 s by
default), so that the rail comes back within a test job.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

import training_jobs as tj
from conftest import _job_user, make_job_dir, own_cluster_spec, own_devcluster, site_policy
from slurm_helpers import job_id_of, job_python, sbatch, submit_env, wait_job
from support.wait import until
from torchpass import envnames, layout
from torchpass.devcluster import DevclusterSpec
from training_jobs import train_script

pytestmark = pytest.mark.integration

SEED = int(os.environ.get("TORCHPASS_TEST_SEED") or time.time_ns() % 1_000_000)
TPASSCTL = str(Path(sys.executable).parent / "tpassctl")


FLAP_WINDOW_S = 10.0
RESTORE_AFTER_S = 3.0
POLICY = "tprailback-lp"  # a file name no other test uses (/etc/torchpass/policies is global)


def _spec() -> DevclusterSpec:
    return own_cluster_spec("lp", nodes=2, rails=2, rail_flap_window_s=FLAP_WINDOW_S)


@pytest.fixture(scope="module")
def rail_policy():
    """The jobs' policy: rails back in use after 3 s of health on every node (30 s by default)."""
    with site_policy(POLICY, f"rail_restore_after_s = {RESTORE_AFTER_S}\n") as name:
        yield name


@pytest.fixture(scope="module")
def rail_cluster():
    with own_devcluster(_spec()) as c:
        yield c


def tpassctl(cluster, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([TPASSCTL, *args, "--name", cluster.spec.name] if args[0] == "devcluster" else
                          [TPASSCTL, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **cluster.env()})


def node_row(cluster, node: str) -> dict:
    out = tpassctl(cluster, "nodes", "--node", node, "--json")
    rows = json.loads(out.stdout)["nodes"]
    return rows[0] if rows else {}


def wait_for(cluster, node: str, what, timeout_s: float = 30.0) -> dict:
    """The node's row once ``what(row)`` holds (tpassd samples once a second)."""
    deadline = time.monotonic() + timeout_s
    row: dict = {}
    while time.monotonic() < deadline:
        row = node_row(cluster, node)
        if row and what(row):
            return row
        time.sleep(0.5)
    raise AssertionError(f"{node} never got there; last: {row}")


def link(cluster, node: str, rail: int, *action: str) -> str:
    out = tpassctl(cluster, "devcluster", "link", node, "--rail", str(rail), *action)
    assert out.returncode == 0, out.stderr
    return out.stdout


# --- the reroute: a flapping rail, the job rerouted in place -----------------------------------
# The rail-health test below pulls the other node's rails, so that it never meets the flapped one
# still degraded. 400 steps: the rail comes back about 15 s after the flaps (the flap window, then
# rail_restore_after_s), about step 200 at 0.1 s a step, with steps left to carry on both rails.
STEPS = 400


def _nodes(cluster) -> tuple[str, str]:
    """(the node whose rail0 flaps under a job, the node whose rails are pulled without one): random."""
    a, b = random.Random(SEED).sample(list(cluster.node_names), 2)
    return a, b


def _job_events(cluster, job_id: int) -> list[dict]:
    p = layout.events_json(cluster.state_dir, job_id)
    return json.loads(p.read_text()) if p.exists() else []


def _submit_rail_job(cluster, tag: str) -> tuple[int, Path]:
    """The ordinary user's 2-node gloo DDP job over the data rails (examples/train_ddp.py)."""
    user = _job_user(cluster.job_users[0])
    base = Path("/tmp") / f"torchpass-it-{cluster.spec.name}"
    base.mkdir(mode=0o755, exist_ok=True)
    job_dir = make_job_dir(base, tag, user)
    env = {**submit_env(user.name), envnames.DATA_RAILS: cluster.env()[envnames.DATA_RAILS]}
    script = ("#!/bin/bash\n"
              f"srun {job_python()} {train_script(job_dir)} --steps {STEPS} --params 1M --sleep 0.05\n")
    out = job_dir / "out.txt"
    job_id = job_id_of(sbatch(["-N2", "--ntasks-per-node=1", f"--torchpass=policy={POLICY}", "-o", str(out)], script,
                              cwd=job_dir, user=user.name, env=env))
    return job_id, out


def _wait_step(out: Path, step: int, timeout_s: float = 120) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if out.exists() and f"step={step} " in out.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"seed={SEED}: the job did not reach step {step}")


def _rails_in_use(cluster, job_id: int) -> list[str] | None:
    """The data rails the job's coordinator has its ranks on (tpassctl status); None: not known."""
    out = tpassctl(cluster, "status", str(job_id), "--json")
    try:
        rails = json.loads(out.stdout)["jobs"][0].get("rails")
    except (ValueError, KeyError, IndexError):
        return None
    return list(rails["using"]) if rails else None


def _live_event(cluster, job_id: int, kind: str, each=None) -> dict | None:
    """The job's first ``kind`` event so far, from its running coordinator (tpassctl events), or
    None; ``each()`` is called first (for ``until``, which asks again until there is one)."""
    if each is not None:
        each()
    out = tpassctl(cluster, "events", str(job_id), "--json")
    try:
        events = json.loads(out.stdout)["jobs"][0]["events"]
    except (ValueError, KeyError, IndexError):
        return None
    return next((e for e in events if e["kind"] == kind), None)


@pytest.fixture(scope="module")
def rail_reference(rail_cluster, rail_policy) -> dict:
    """The same job with no fault: its per-step losses (every rank prints the global loss)."""
    job_id, out = _submit_rail_job(rail_cluster, "reference")
    info = wait_job(job_id, timeout_s=240)
    assert info.state == "COMPLETED", out.read_text()[-3000:]
    return tj.per_step(tj.steps(out.read_text()))


def test_a_flapping_rail_reroutes_the_job_in_place_once_then_back_with_the_same_losses(rail_cluster,
                                                                                         rail_reference):
    """Five flaps of rail0 on a random node (the batch host included) at a random step: the rail is
    degraded (still carrying packets between flaps, so no collective is lost on it), the
    coordinator pauses every rank at one collective and resumes them in place on rail1: one
    reroute, no migration, every rank on its node. Once rail0 has been healthy for
    rail_restore_after_s, the ranks go back onto both rails (link.restored), and rail0 carries the
    job's collectives again. The reference's losses bit for bit."""
    node, _ = _nodes(rail_cluster)
    at = random.Random(f"{SEED}:flap").randint(5, 30)
    print(f"seed {SEED}: flapping {node}'s rail0 at step {at} (TORCHPASS_TEST_SEED={SEED} replays)")
    for n in rail_cluster.node_names:  # a fresh cluster: every rail up and never flapped
        wait_for(rail_cluster, n, lambda r: r["rails"] == {"rail0": "healthy", "rail1": "healthy"})
    job_id, out = _submit_rail_job(rail_cluster, "flap")

    def early_diag() -> str:
        return f"seed={SEED}\n{out.read_text()[-2000:] if out.exists() else ''}"

    _wait_step(out, at)
    link(rail_cluster, node, 0, "flap", "--times", "5", "--period", "0.4")
    # Between the two events every rank is on rail1 alone (the coordinator records each once every
    # rank resumed on its new rails), and tpassctl status says which rails the job uses.
    rerouted = until(lambda: _live_event(rail_cluster, job_id, "link.rerouted"), "a link.rerouted event", 90,
                     every=0.3, diag=early_diag)
    assert _rails_in_use(rail_cluster, job_id) == ["rail1"], early_diag()
    samples: list[tuple[float, int]] = []  # (wall time, rail0's bytes sent) while rail0 is left out
    restored = until(lambda: _live_event(rail_cluster, job_id, "link.restored", each=lambda: samples.append(
        (time.time(), net_dev(rail_cluster, node)["rail0"][1]))), "a link.restored event", 90, every=0.3,
        diag=early_diag)
    rail0_sent_at_restore = net_dev(rail_cluster, node)["rail0"][1]
    assert _rails_in_use(rail_cluster, job_id) == ["rail0", "rail1"], early_diag()
    # The control: the samples taken at least 0.5 s after the reroute was recorded and 0.5 s
    # before the way back was (the ranks use rail0 again once they rebuilt, just before then).
    left_out = [b for t, b in samples if rerouted["time"] + 0.5 < t < restored["time"] - 0.5]
    assert len(left_out) >= 2, (samples, rerouted["time"], restored["time"])
    step_at_restore = max(tj.per_step(tj.steps(out.read_text())))
    info = wait_job(job_id, timeout_s=240)
    rail0_sent_after = net_dev(rail_cluster, node)["rail0"][1] - rail0_sent_at_restore
    rail0_sent_unused = left_out[-1] - left_out[0]
    events = _job_events(rail_cluster, job_id)
    diag = (f"seed={SEED}\n{out.read_text()[-2000:]}\n--- events ---\n"
            + "\n".join(f"{e['kind']}: {e['message']}" for e in events))
    assert info.state == "COMPLETED", diag
    kinds = [e["kind"] for e in events]
    assert kinds.count("link.rerouted") == 1 and kinds.count("link.restored") == 1, diag
    assert kinds.index("link.rerouted") < kinds.index("link.restored"), diag
    assert "link.down" in kinds and not any(k.startswith("migration.") for k in kinds), diag
    rerouted = next(e for e in events if e["kind"] == "link.rerouted")
    assert rerouted["data"]["rails"] == ["rail1"] and rerouted["data"]["rails_before"] == ["rail0", "rail1"], diag
    restored = next(e for e in events if e["kind"] == "link.restored")
    assert restored["data"]["rails"] == ["rail0", "rail1"] and restored["data"]["rails_before"] == ["rail1"], diag
    print(f"seed {SEED}: training stood still {rerouted['data']['pause_s']} s for the reroute and "
          f"{restored['data']['pause_s']} s for the way back, {restored['time'] - rerouted['time']:.1f} s apart")
    # Back on both rails: gloo takes each collective's context round robin, one per rail, so about
    # half of the steps left send the rank's ~4 MB share of the 1M-parameter all-reduce on rail0.
    # Left out, rail0 sends next to nothing (the control).
    print(f"seed {SEED}: rail0 of {node} sent {rail0_sent_unused / 2**10:.0f} KiB while left out, "
          f"{rail0_sent_after / 2**20:.1f} MiB in the {STEPS - step_at_restore} steps after the way back")
    assert rail0_sent_unused < 2**20 < rail0_sent_after, (rail0_sent_unused, rail0_sent_after, diag)
    registered = [e for e in events if e["kind"] == "rank.registered"]
    assert len(registered) == 2, diag  # every rank on its node: none registered again
    assert tj.per_step(tj.steps(out.read_text())) == rail_reference, diag


def test_rail_down_flap_and_both_down(rail_cluster):
    _, node = _nodes(rail_cluster)
    print(f"seed {SEED}: pulling {node}'s rail0 (TORCHPASS_TEST_SEED={SEED} replays)")
    assert rail_cluster.env()["TORCHPASS_DATA_RAILS"] == "rail0,rail1"
    wait_for(rail_cluster, node, lambda r: r["rails"] == {"rail0": "healthy", "rail1": "healthy"})

    link(rail_cluster, node, 0, "down")
    row = wait_for(rail_cluster, node, lambda r: r["rails"].get("rail0") == "failed")
    assert row["state"] == "healthy" and row["rails"]["rail1"] == "healthy", row
    assert row["reachable"]  # the management network is never pulled
    table = tpassctl(rail_cluster, "nodes", "--node", node).stdout
    assert "RAILS" in table and "rail0 failed, rail1 healthy" in table, table

    link(rail_cluster, node, 0, "up")
    link(rail_cluster, node, 0, "flap", "--times", "5", "--period", "0.4")
    row = wait_for(rail_cluster, node, lambda r: r["rails"].get("rail0") == "degraded")
    assert row["state"] == "healthy", row

    link(rail_cluster, node, 0, "down")
    link(rail_cluster, node, 1, "down")
    row = wait_for(rail_cluster, node, lambda r: r["state"] == "failed")
    assert row["reasons"][0].startswith("no usable data rail left: rail:rail0, rail:rail1 down"), row
    other = next(n for n in rail_cluster.node_names if n != node)
    assert node_row(rail_cluster, other)["state"] == "healthy"  # the far ends' own rails are up

    link(rail_cluster, node, 0, "clear")
    link(rail_cluster, node, 1, "clear")
    row = wait_for(rail_cluster, node, lambda r: r["state"] != "failed" and r["rails"].get("rail1") == "healthy")
    assert row["rails"]["rail0"] in ("healthy", "degraded"), row  # still flapping within the window


def net_dev(cluster, node: str) -> dict[str, tuple[int, int]]:
    """interface -> (rx bytes, tx bytes), read in the node's own network namespace."""
    text = cluster.exec_on(node, ["cat", "/proc/net/dev"], capture_output=True, text=True, check=True).stdout
    out = {}
    for line in text.splitlines()[2:]:
        name, _, rest = line.partition(":")
        v = rest.split()
        out[name.strip()] = (int(v[0]), int(v[8]))
    return out


def test_a_job_trains_over_the_data_rails_not_the_management_network(rail_cluster):
    user = _job_user(rail_cluster.job_users[0])
    base = Path("/tmp") / f"torchpass-it-{rail_cluster.spec.name}"
    base.mkdir(mode=0o755, exist_ok=True)
    job_dir = make_job_dir(base, "rails", user)
    before = {n: net_dev(rail_cluster, n) for n in rail_cluster.node_names}
    # The user's environment after `eval "$(tpassctl devcluster env)"`: the rails come with it.
    env = {**submit_env(user.name), envnames.DATA_RAILS: rail_cluster.env()[envnames.DATA_RAILS]}
    script = ("#!/bin/bash\n"
              "export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1) MASTER_PORT=29511\n"
              f"srun --kill-on-bad-exit=1 {job_python()} {train_script(job_dir)} --steps 30 --params 1M --sleep 0.02\n")
    job_id = job_id_of(sbatch(["-N2", "--ntasks-per-node=1", "--torchpass", "-o", str(job_dir / "out.txt")], script,
                              cwd=job_dir, user=user.name, env=env))
    info = wait_job(job_id, timeout_s=180)
    assert info.state == "COMPLETED", (job_dir / "out.txt").read_text()[-3000:]
    for n in rail_cluster.node_names:
        after = net_dev(rail_cluster, n)
        sent = {i: after[i][1] - before[n][i][1] for i in ("eth0", "rail0", "rail1")}
        rails = sent["rail0"] + sent["rail1"]
        # 30 steps of a 1M-parameter all-reduce: ~4 MB a step each way, all of it on the rails.
        assert rails > 10 * 2**20 and rails > 10 * sent["eth0"], (n, sent)

