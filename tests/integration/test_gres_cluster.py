"""GPUs as Slurm GRES: a rank moves with its GPU, its CPUs and its memory; a spare with too few
GPUs refuses the move in one line.

A devcluster of its own (``DevclusterSpec(gpus=(2, 2, 2, 1), cgroups=True)``: fake GPUs as
GRES, char devices of a major no driver has, ConstrainDevices=yes, cgroup v1): the name is
TORCHPASS_TEST_CLUSTER's first 5 letters + "gp", the subnet TORCHPASS_TEST_SUBNET's second
octet + 70 (TORCHPASS_TEST_GRES_SUBNET overrides it). One reference run (plain sbatch, the
module's) and one ``--torchpass=spares=1`` job as tpuser1: ``--ntasks-per-node=2
--gpus-per-task=1`` on node1 and node2, node3 (2 GPUs) the hot spare, node4 (1 GPU) idle.
gloo training: no CUDA state, so the CUDA checkpoint is skipped; the GPU table is still made
from the GPUs each task's devices cgroup lets it open.

Every rank probes its node's GPU files every 0.1 s in a thread of its own (``os.open``,
O_RDWR) and appends what it sees when it changes: ENXIO for a file its cgroup allows (no
driver behind the major), EPERM for one it denies.

1. The spare is made unusable (an ECC drill on node3), then node1 is drilled: the companion
   spare asked for (2 GPUs, the job's share of node1) can only be node4, which has 1, and
   Slurm refuses it at once: ``spare.unavailable`` in one line; the job trains on.
2. node3 is healthy again; node2 is drilled and moves there: each restore step allows exactly
   one GPU file (the restored rank gets ENXIO on it, EPERM on the other), the two steps hold
   different GPUs, each has the CPUs and memory of its source task's share, and the event's
   ``gpu_pairs`` maps each rank's source GPU UUID to its restore step's, as the node's
   inventory names them. Same job id, Restarts=0, COMPLETED 0:0, losses bit-identical.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest

import training_jobs as tj
from conftest import JobUser, _job_user, make_job_dir, own_cluster_spec, own_devcluster
from drill import Drill, diagnosis, events, leave_clean, reference, submit, wait_step
from torchpass import layout
from torchpass.devcluster import DevclusterSpec, gpus
from torchpass.devcluster import cgroups as dc_cgroups

pytestmark = pytest.mark.integration

STEPS = 260
PROBE = '''import errno, json, os, socket, sys, threading, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_ddp
DEV, OUT = sys.argv.pop(1), sys.argv.pop(1)


def probe():  # what this process's devices cgroup lets it open, appended when it changes
    rank, job, seen = os.environ.get("SLURM_PROCID", "x"), os.environ.get("SLURM_JOB_ID", "x"), None
    while True:
        got = {}
        for name in sorted(os.listdir(DEV)):
            if name[:3] == "gpu" and name[3:].isdigit():
                try:
                    os.close(os.open(os.path.join(DEV, name), os.O_RDWR))
                    got[name] = "opened"
                except OSError as e:
                    got[name] = errno.errorcode.get(e.errno, str(e.errno))
        cg = [ln.split(":", 2)[2] for ln in open("/proc/self/cgroup").read().split() if ":devices:" in ln]
        now = {"host": socket.gethostname(), "files": got, "devices": cg[0] if cg else ""}
        if now != seen:
            with open(os.path.join(OUT, f"probe.{job}.rank{rank}.jsonl"), "a") as f:
                f.write(json.dumps(now) + "\\n")
            seen = now
        time.sleep(0.1)


threading.Thread(target=probe, daemon=True).start()
sys.exit(train_ddp.main())
'''


def _spec() -> DevclusterSpec:
    return own_cluster_spec("gp", "TORCHPASS_TEST_GRES_SUBNET", nodes=4, cgroups=True, gpus=(2, 2, 2, 1))


@pytest.fixture(scope="module")
def gres_cluster(plugin_built):
    with own_devcluster(_spec()) as c:
        yield c


@pytest.fixture(scope="module")
def gres_user(gres_cluster) -> JobUser:
    return _job_user(gres_cluster.job_users[0])


@pytest.fixture(scope="module")
def gres_job_dir(gres_cluster, gres_user) -> Path:
    base = Path("/tmp") / f"torchpass-it-{gres_cluster.spec.name}"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(mode=0o755)
    return make_job_dir(base, "gres", gres_user)


@pytest.fixture(scope="module")
def job(gres_cluster, gres_job_dir) -> Drill:
    return Drill("gres", PROBE, (str(gres_cluster.spec.gpu_dev_dir), str(gres_job_dir), "--steps", str(STEPS),
                                 "--params", "100K", "--sleep", "0.05"),
                 STEPS, nodes=2, per_node=2, sbatch_extra=("--ntasks-per-node=2", "--gpus-per-task=1"))


@pytest.fixture(scope="module")
def ref(job, gres_job_dir, gres_user) -> dict:
    jobs: list[int] = []
    try:
        return reference(job, gres_job_dir, gres_user.name, jobs)
    finally:
        leave_clean(job, jobs)


def _probes(job_dir: Path, job_id: int, rank: int) -> list[dict]:
    p = job_dir / f"probe.{job_id}.rank{rank}.jsonl"
    return [json.loads(ln) for ln in p.read_text().splitlines()] if p.exists() else []


def _own(files: dict[str, str]) -> str:
    """The one GPU file a rank's cgroup allows (ENXIO: allowed, no driver); the others are EPERM."""
    allowed = [n for n, e in files.items() if e == "ENXIO"]
    assert len(allowed) == 1 and all(e == "EPERM" for n, e in files.items() if n not in allowed), files
    return allowed[0]


def _cg(pid: int, controller: str) -> Path:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if controller in names.split(","):
            return dc_cgroups.CGROUP_ROOT / controller / path.lstrip("/")
    raise AssertionError(f"no {controller} cgroup for {pid}")


def _step_dir(d: Path) -> Path:
    return next(p for p in (d, *d.parents) if re.fullmatch(r"step_\d+", p.name))


def _cpus(d: Path) -> int:
    n = 0
    for part in filter(None, (d / "cpuset.cpus").read_text().strip().split(",")):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n


def _share(pid: int, tasks_on_node: int) -> tuple[int, int]:
    """(CPUs, memory limit in bytes) of ``pid``'s step on its node, per task there."""
    cpus, mem = _step_dir(_cg(pid, "cpuset")), _step_dir(_cg(pid, "memory"))
    return _cpus(cpus) // tasks_on_node, int((mem / "memory.limit_in_bytes").read_text()) // tasks_on_node


def _rank_record(cluster, job_id: int, rank: int) -> dict:
    return json.loads(layout.rank_record(layout.rank_records_dir(cluster.state_dir, job_id), job_id, rank)
                      .read_text())


def _inject(node: str, fault: str) -> None:
    r = tj.run([*tj.TPASSCTL, "inject", "--node", node, "--fault", fault])
    assert r.returncode == 0, (node, fault, r.stderr)


def _wait_event(cluster, job_id: int, kind: str, diag, timeout_s: float = 120, about: str = "") -> dict:
    end = time.monotonic() + timeout_s
    while not (found := [e for e in events(cluster, job_id) if e["kind"] == kind and about in e["message"]]):
        assert time.monotonic() < end, diag()
        assert tj.job(job_id)["job_state"][0] in tj.ACTIVE, diag()
        time.sleep(0.2)
    return found[0]


def test_a_gpu_rank_moves_with_its_gpu_and_a_spare_with_too_few_gpus_is_refused(gres_cluster, gres_job_dir,
                                                                                gres_user, job, ref):
    c, jobs = gres_cluster, []
    try:
        job_id = submit(job, gres_job_dir, "mig", "spares=1", gres_user.name)
        jobs.append(job_id)
        out = gres_job_dir / f"mig.{job_id}.out"
        diag = lambda: diagnosis(c, job_id, out, "GRES job")  # noqa: E731
        wait_step(c, job_id, out, 5, "GRES job")

        # Before any move: every rank may open its own GPU file and no other; a node's two ranks hold
        # different GPUs; Slurm set CUDA_VISIBLE_DEVICES as on a real cluster (one GPU each: "0").
        before = {r: _probes(gres_job_dir, job_id, r)[-1] for r in range(job.ranks)}
        for node in job.training_nodes:
            owned = [_own(p["files"]) for p in before.values() if p["host"] == node]
            assert sorted(owned) == ["gpu0", "gpu1"], (before, diag())
        for r in range(job.ranks):
            env = Path(f"/proc/{_rank_record(c, job_id, r)['rank_pid']}/environ").read_bytes().split(b"\0")
            assert b"CUDA_VISIBLE_DEVICES=0" in env, (r, diag())

        # 1. No usable hot spare: node1's companion spare would need 2 GPUs; only node4 (1 GPU) is free.
        _inject(job.spare, "ecc-sbe-storm")
        time.sleep(3)  # tpassd samples every second; the coordinator sees node3 degraded
        _inject("node1", "ecc-sbe-storm")
        refused = _wait_event(c, job_id, "spare.unavailable", diag, about="no spare for node1")
        assert "no spare for node1" in refused["message"] and "--gres=gpu:2)" in refused["message"] \
            and "Requested node configuration is not available" in refused["message"] \
            and "\n" not in refused["message"], (refused, diag())
        assert not [e for e in events(c, job_id) if e["kind"] == "migration.completed"], diag()
        _inject("node1", "clear")
        _inject(job.spare, "clear")
        trained = tj.steps(out.read_text())
        time.sleep(3)
        assert len(tj.steps(out.read_text())) > len(trained), ("the job stopped training", diag())

        # 2. node3 is healthy again: node2 moves there.
        src = {r: _rank_record(c, job_id, r) for r in range(job.ranks) if before[r]["host"] == "node2"}
        src_share = {r: _share(rec["rank_pid"], 2) for r, rec in src.items()}
        _inject("node2", "ecc-sbe-storm")
        done = _wait_event(c, job_id, "migration.completed", diag, timeout_s=240)
        assert done["data"]["node"] == "node2" and done["data"]["target"] == job.spare, (done, diag())
        moved: dict[int, str] = {}
        for r, rec in src.items():
            now = _rank_record(c, job_id, r)
            assert now["node"] == job.spare, (r, now, diag())
            # The restore step has the CPUs and memory of the source task's share (1 task per restore step).
            assert _share(now["rank_pid"], 1) == src_share[r], (r, src_share[r], diag())
            end = time.monotonic() + 10
            while (p := _probes(gres_job_dir, job_id, r)[-1])["devices"] == before[r]["devices"]:
                assert time.monotonic() < end, (r, p, diag())
                time.sleep(0.1)
            moved[r] = _own(p["files"])  # exactly its restore step's GPU: ENXIO; the other: EPERM
        assert sorted(moved.values()) == ["gpu0", "gpu1"], (moved, diag())  # two restore steps, two GPUs
        # The table: each rank's source GPU onto its restore step's, as the nodes' inventories name them.
        name = c.spec.name
        want = {str(r): [[gpus.fake_uuid(name, "node2", int(_own(before[r]["files"])[3:])),
                          gpus.fake_uuid(name, job.spare, int(moved[r][3:]))]] for r in src}
        assert done["data"].get("gpu_pairs") == want, (done["data"], diag())

        final = tj.wait_end(job_id, 300, context="GRES job: ")
        assert final["job_id"] == job_id and final["job_state"][0] == "COMPLETED", diag()
        assert final["exit_code"]["return_code"]["number"] == 0, diag()
        assert int(final.get("restart_cnt", 0)) == 0, diag()
        assert tj.per_step(tj.steps(out.read_text())) == ref, diag()
        print(f"refused: {refused['message']}\nmoved node2 -> {job.spare}: {moved}, pairs {want}, "
              f"(CPUs, memory) per task {src_share}")
    finally:
        leave_clean(job, jobs)
        for n in ("node1", "node2"):
            tj.run([*tj.TPASSCTL, "inject", "--node", n, "--fault", "clear"])
