"""The fleet audit and the fleet history on a real devcluster (4 nodes, 2 data rails, its own).

One audit covers both cases the audit must tell apart: ``devcluster slow node3 --cpu 5`` (a slow
node) and ``devcluster link NODE --rail R rate=100`` on another node and rail, both random (seed
printed, TORCHPASS_TEST_SEED replays). ``tpassctl fleet audit --drain`` (root, real sbatch-free
srun steps in a maintenance reservation, gloo pairs per rail) must name node3 and that
(node, rail), nothing else, and drain exactly those two with ``torchpass-audit: ...``.

With both faults lifted, a second audit takes the two drained nodes through a maintenance
reservation, names nothing, and leaves them drained with their reasons.

Then the history: the real tpassds append their nodes' state changes (``inject`` xid79 on node3:
failed; row-remap-pending on node2: degraded) to the shared spool, the audit appended its
results, and a real coordinator's event log (tests/unit/golden/migration_events.json, recorded
from a devcluster migration: ranks moved off node3, a migration off node2 rolled back) sits in
``jobs/J`` owned by the job user. ``fleet report`` (root: it ingests first) ranks node3 first,
ahead of node2 (a milder state, no rank moved) and draws the timeline.
"""

from __future__ import annotations

import json
import os
import pwd
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import own_cluster_spec, own_devcluster
from torchpass import layout
from torchpass.devcluster import DevclusterSpec

pytestmark = pytest.mark.integration

SEED = int(os.environ.get("TORCHPASS_TEST_SEED") or time.time_ns() % 1_000_000)
TPASSCTL = str(Path(sys.executable).parent / "tpassctl")
GOLDEN = Path(__file__).parents[1] / "unit" / "golden" / "migration_events.json"
SLOW = "node3"


def _spec() -> DevclusterSpec:
    return own_cluster_spec("fa", nodes=4, rails=2)


@pytest.fixture(scope="module")
def fleet_cluster():
    with own_devcluster(_spec()) as c:
        yield c


def tpassctl(cluster, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    argv = [TPASSCTL, *args, "--name", cluster.spec.name] if args[0] == "devcluster" else [TPASSCTL, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env={**os.environ, **cluster.env()})


def test_the_audit_names_the_slow_node_and_the_limited_rail_then_the_report_ranks_the_faulty_node(
        fleet_cluster, tmp_path):
    c = fleet_cluster
    rng = random.Random(SEED)
    link_node = rng.choice([n for n in c.node_names if n != SLOW])
    rail = rng.randrange(2)
    print(f"seed={SEED}: {SLOW} slowed, {link_node} rail{rail} limited to 100 Mbit/s")
    assert tpassctl(c, "devcluster", "slow", SLOW, "--cpu", "5").returncode == 0
    assert tpassctl(c, "devcluster", "link", link_node, "--rail", str(rail), "rate=100").returncode == 0

    t0 = time.monotonic()
    out = tpassctl(c, "fleet", "audit", "--drain", "--json", timeout=400)
    took = time.monotonic() - t0
    assert out.returncode == 1, out.stderr[-3000:]
    res = json.loads(out.stdout)
    print(f"seed={SEED}: audit took {took:.1f} s; verdict {json.dumps(res['verdict'])}")
    compute = {n: r["all_seconds"] for n, r in res["compute"].items()}
    assert list(res["verdict"]["nodes"]) == [SLOW], (SEED, compute, res["verdict"])
    assert [(x["node"], x["rail"]) for x in res["verdict"]["links"]] == [(link_node, f"rail{rail}")], (
        SEED, res["links"])
    assert "[1/4]" in out.stderr and "links:" in out.stderr  # progress, on stderr only
    assert {n: t["dcgmi"] for n, t in ((n, r["tools"]) for n, r in res["compute"].items())} == {
        n: "absent" for n in c.node_names}
    reasons = dict(line.split("|", 1) for line in subprocess.run(
        ["sinfo", "-R", "-h", "-o", "%N|%E"], capture_output=True, text=True, env={**os.environ, **c.env()},
        check=True).stdout.splitlines())
    assert sorted(reasons) == sorted({SLOW, link_node}), reasons
    assert all(r.startswith("torchpass-audit: ") for r in reasons.values()), reasons
    assert "compute_s" in reasons[SLOW] and f"rail{rail}" in reasons[link_node]
    # the reservation is gone
    rsv = subprocess.run(["scontrol", "show", "reservation"], capture_output=True, text=True,
                         env={**os.environ, **c.env()})
    assert "torchpass-audit" not in rsv.stdout

    # repaired: the drained nodes are audited through a maintenance reservation and stay drained
    assert tpassctl(c, "devcluster", "slow", SLOW, "--cpu", "clear").returncode == 0
    assert tpassctl(c, "devcluster", "link", link_node, "--rail", str(rail), "clear").returncode == 0
    again = tpassctl(c, "fleet", "audit", "--json", timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    res2 = json.loads(again.stdout)
    assert sorted(res2["nodes"]) == sorted(c.node_names) and res2["verdict"] == {"nodes": {}, "links": []}, res2
    assert "reservation torchpass-audit-" in again.stderr
    after = dict(line.split("|", 1) for line in subprocess.run(
        ["sinfo", "-R", "-h", "-o", "%N|%E"], capture_output=True, text=True, env={**os.environ, **c.env()},
        check=True).stdout.splitlines())
    assert after == reasons  # drained again with their own reasons: only an admin returns them
    assert "torchpass-audit" not in subprocess.run(["scontrol", "show", "reservation"], capture_output=True,
                                                   text=True, env={**os.environ, **c.env()}).stdout

    # --- the history: real tpassd health changes, the audit's records, a real coordinator's log ---
    assert tpassctl(c, "inject", "--node", SLOW, "--fault", "xid79").returncode == 0
    assert tpassctl(c, "inject", "--node", "node2", "--fault", "row-remap-pending").returncode == 0
    user = pwd.getpwnam(c.job_users[0])
    jobs = layout.jobs_dir(c.state_dir)
    jobs.mkdir(mode=layout.JOBS_DIR_MODE, exist_ok=True)
    jd = layout.job_dir(c.state_dir, 77)
    jd.mkdir(mode=0o750)
    shutil.copy(GOLDEN, jd / layout.EVENTS_JSON)
    for p in (jd, jd / layout.EVENTS_JSON):
        os.chown(p, user.pw_uid, user.pw_gid)
    store = tmp_path / "fleet.sqlite"
    plot = tmp_path / "fleet.png"
    deadline = time.monotonic() + 60
    while True:
        rep = tpassctl(c, "fleet", "report", "--json", "--store", str(store), "--plot", str(plot))
        assert rep.returncode == 0, rep.stderr
        ranked = json.loads(rep.stdout)["nodes"]
        by = {r["node"]: r for r in ranked}
        if by.get(SLOW, {}).get("failed") and by.get("node2", {}).get("degraded"):
            break
        assert time.monotonic() < deadline, f"tpassd's health changes never reached the history: {ranked}"
        time.sleep(1)
    print(f"seed={SEED}: ranking {[(r['node'], r['score']) for r in ranked]}")
    assert ranked[0]["node"] == SLOW and ranked[0]["score"] > by["node2"]["score"]
    assert by[SLOW]["migrations_out"] == 1 and by[SLOW]["ranks_moved"] == 1 and by[SLOW]["audit_outliers"] == 1
    assert by["node2"]["migrations_out"] == 0 and by["node2"]["failed"] == 0
    assert by[link_node]["rail_outliers"] == 1
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
