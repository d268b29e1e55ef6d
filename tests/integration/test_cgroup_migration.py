"""A migration under Slurm's cgroup plugins, as production clusters run them.

A devcluster of its own (``DevclusterSpec(cgroups=True)``: proctrack/cgroup,
task/cgroup + task/affinity, ConstrainCores, ConstrainRAMSpace, cgroup v1;
each node its own cgroup subtree and cgroup namespace), brought up for this
module beside the session's cluster: the name is TORCHPASS_TEST_CLUSTER's
first 5 letters + "cg", the subnet TORCHPASS_TEST_SUBNET's second octet + 50
(TORCHPASS_TEST_CGROUP_SUBNET overrides it).

examples/train_ddp.py as tpuser1, 2 ranks, ``--torchpass=spares=1``; an ECC
drill on a random node at a random step (seed printed; TORCHPASS_TEST_SEED
replays). Same job id, Restarts=0, COMPLETED 0:0, losses bit-identical to the
plain run. And what only this cluster shows:

* the restored rank (and its tpass-init) is in the restore step's cgroups on
  the spare in every controller Slurm uses (``.../slurm_<spare>/uid_U/job_J/
  step_S``, S the step ``scontrol listpids`` gives for it), not in a path made
  after the source's step (criu's default puts it back where it was dumped);
* its CPU set has the size, and its memory cgroup the limit, of the task it
  replaced;
* after the job ends, no process of the job is left on any node and Slurm's
  job cgroups are gone from every node.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path

import pytest

import training_jobs as tj
from conftest import JobUser, _job_user, make_job_dir, own_cluster_spec, own_devcluster
from drill import Drill, diagnosis, events, leave_clean, reference, submit
from torchpass import layout
from torchpass.devcluster import DevclusterSpec
from torchpass.devcluster import cgroups as dc_cgroups

pytestmark = pytest.mark.integration

SEED = int(os.environ.get("TORCHPASS_TEST_SEED") or time.time_ns() % 1_000_000)
STEPS = 150
# 2 training nodes, node3 the spare; the drill early enough that the restored rank trains a while.
JOB = Drill("cgroup", "", ("--steps", str(STEPS), "--params", "100K", "--sleep", "0.05"), STEPS,
            nodes=2, per_node=1, fault_steps=(2, 30))


def _spec() -> DevclusterSpec:
    return own_cluster_spec("cg", "TORCHPASS_TEST_CGROUP_SUBNET", nodes=3, cgroups=True)


@pytest.fixture(scope="module")
def cg_cluster(plugin_built):
    subtrees: list[Path] = []
    with own_devcluster(_spec()) as c:
        subtrees = [Path(d) for d in c._require_state().cgroups]
        yield c
    assert subtrees and not [d for d in subtrees if d.exists()], "devcluster down left cgroups behind"


@pytest.fixture(scope="module")
def cg_user(cg_cluster) -> JobUser:
    return _job_user(cg_cluster.job_users[0])


@pytest.fixture
def cg_job_dir(cg_cluster, cg_user) -> Path:
    base = Path("/tmp") / f"torchpass-it-{cg_cluster.spec.name}"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(mode=0o755)
    return make_job_dir(base, "cgroup", cg_user)


def _cgroups(pid: int) -> dict[str, str]:
    """controller -> path in the host's view (this test runs in the host's cgroup namespace)."""
    out = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        for n in names.split(","):
            out[n] = path
    return out


def _subtree(cluster, node: str, controller: str) -> str:
    """The node's cgroup in ``controller`` as /proc/PID/cgroup names it in the host's view."""
    root = dc_cgroups.CGROUP_ROOT / controller
    return next("/" + str(Path(d).relative_to(root)) for d in cluster._require_state().cgroups
                if Path(d).name == f"tp-{cluster.spec.name}-{node}" and Path(d).is_relative_to(root))


def _step_of(cluster, node: str, job_id: int, pid: int) -> str:
    """The step Slurm lists ``pid`` in on ``node`` (``scontrol listpids``: Slurm's own account)."""
    listed = cluster.exec_on(node, ["scontrol", "listpids", str(job_id)], capture_output=True, text=True,
                             env={**os.environ, **cluster.env()}, timeout=30)
    steps = {int(r[0]): r[2] for r in (ln.split() for ln in listed.stdout.splitlines()[1:])
             if len(r) >= 3 and r[0].isdigit()}
    assert pid in steps, listed.stdout
    return steps[pid]


def _limits(cg: dict[str, str]) -> tuple[int, int]:
    """(CPUs in the task's cpuset, its memory limit): read where Slurm set them."""
    cpus = dc_cgroups.CGROUP_ROOT / "cpuset" / cg["cpuset"].lstrip("/")
    mem = dc_cgroups.CGROUP_ROOT / "memory" / cg["memory"].lstrip("/")
    n = 0
    for part in (cpus / "cpuset.cpus").read_text().strip().split(","):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    # The limit is the job's (task and step cgroups below it inherit it as a ceiling).
    limits = [int((p / "memory.limit_in_bytes").read_text()) for p in (mem, *mem.parents)
              if (p / "memory.limit_in_bytes").exists() and re.match(r"(job|step|task)_", p.name)]
    return n, min(limits)


def _rank_record(cluster, job_id: int, rank: int) -> dict:
    return json.loads(layout.rank_record(layout.rank_records_dir(cluster.state_dir, job_id), job_id, rank)
                      .read_text())


def test_a_rank_moved_under_slurm_cgroups_lives_in_the_restore_steps_cgroup(cg_cluster, cg_job_dir, cg_user):
    c, user = cg_cluster, cg_user.name
    jobs: list[int] = []
    try:
        ref = reference(JOB, cg_job_dir, user, jobs)
        rng = random.Random(f"{SEED}:{JOB.name}")
        node, at = rng.choice(JOB.training_nodes), rng.randint(*JOB.fault_steps)
        rank = JOB.training_nodes.index(node)
        what = f"seed={SEED} (replay with TORCHPASS_TEST_SEED={SEED}): ecc-sbe-storm on {node} at step {at}"
        print(f"\n{what}")
        job_id = submit(JOB, cg_job_dir, "mig", "spares=1", user)
        jobs.append(job_id)
        out = cg_job_dir / f"mig.{job_id}.out"
        diag = lambda: diagnosis(c, job_id, out, what)  # noqa: E731
        deadline = time.monotonic() + 240
        while not (out.exists() and f"step={at} " in out.read_text()):
            assert time.monotonic() < deadline, diag()
            time.sleep(0.1)
        before = _rank_record(c, job_id, rank)
        src = _cgroups(before["rank_pid"])
        src_step = _step_of(c, node, job_id, before["rank_pid"])
        src_limits = _limits(src)
        assert tj.run([*tj.TPASSCTL, "inject", "--node", node, "--fault", "ecc-sbe-storm"]).returncode == 0
        while not [e for e in events(c, job_id) if e["kind"] == "migration.completed"]:
            assert time.monotonic() < deadline + 200, diag()
            assert tj.job(job_id)["job_state"][0] in tj.ACTIVE, diag()
            time.sleep(0.2)
        rec = _rank_record(c, job_id, rank)
        assert rec["node"] == JOB.spare, (rec, diag())
        step = _step_of(c, JOB.spare, job_id, rec["rank_pid"])
        assert step == _step_of(c, JOB.spare, job_id, rec["wrapper_pid"]) != src_step, diag()
        uid = cg_user.uid
        for pid in (rec["pid"], rec["rank_pid"]):  # tpass-init and the rank
            cg = _cgroups(pid)
            for ctl in ("freezer", "cpuset", "memory"):
                want = f"{_subtree(c, JOB.spare, ctl)}/slurm_{JOB.spare}/uid_{uid}/job_{job_id}/step_{step}"
                if ctl == "freezer":
                    assert cg[ctl] == want, (ctl, cg[ctl], want, "source:", src[ctl], diag())
                else:
                    assert cg[ctl].startswith(want + "/"), (ctl, cg[ctl], want, "source:", src[ctl], diag())
        assert _limits(_cgroups(rec["rank_pid"])) == src_limits, diag()

        final = tj.wait_end(job_id, 300, context=f"{what}: ")
        assert final["job_id"] == job_id and final["job_state"][0] == "COMPLETED", diag()
        assert final["exit_code"]["return_code"]["number"] == 0, diag()
        assert int(final.get("restart_cnt", 0)) == 0, diag()
        assert tj.per_step(tj.steps(out.read_text())) == ref, diag()
        print(f"moved {node} -> {JOB.spare}: from {src['freezer']} to step_{step} on the spare; "
              f"(CPUs, memory limit) {src_limits}")

        # Slurm removes a job's cgroups as its last steps end: give it a moment.
        def leftovers() -> list[str]:
            found = [f"pid {p} in {n}'s namespaces (uid {uid})" for n in c.node_names
                     for p in c._netns_pids(c.spec.netns(c._index(n)))
                     if Path(f"/proc/{p}").exists() and Path(f"/proc/{p}").stat().st_uid == uid]
            for n in c.node_names:
                for d in c._require_state().cgroups:
                    if Path(d).name != f"tp-{c.spec.name}-{n}":
                        continue
                    found += [sub for sub, _, _ in os.walk(d) if f"/job_{job_id}" in sub]
                    found += [f"pid {p} (uid {uid})" for p in dc_cgroups.procs(Path(d))
                              if Path(f"/proc/{p}").exists() and Path(f"/proc/{p}").stat().st_uid == uid]
            return found

        end = time.monotonic() + 30
        while (left := leftovers()) and time.monotonic() < end:
            time.sleep(0.5)
        assert not left, (left, diag())
    finally:
        leave_clean(JOB, jobs)
