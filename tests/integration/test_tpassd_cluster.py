"""tpassd on the devcluster: every node runs a real tpassd (fake NVML, fixture
IB tree) in its own namespaces; we watch them from the root namespace.

Run with e.g. TORCHPASS_TEST_SUBNET=10.79.0 TORCHPASS_TEST_CLUSTER=t3.
Drills are an admin's (root); node health is anyone's, so an ordinary user reads it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from slurm_helpers import tpassctl as tpassctl_as
from torchpass import auth, zmqio
from torchpass.health import HealthSubscriber, State
from torchpass.ports import TPASSD_CONTROL_PORT, TPASSD_PUB_PORT

pytestmark = pytest.mark.integration

# The installed console script, as an admin runs it.
TPASSCTL = [os.path.join(os.path.dirname(sys.executable), "tpassctl")]


def tpassctl(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(TPASSCTL + list(args), capture_output=True, text=True, timeout=60, check=check,
                          env=os.environ)


USER: str | None = None  # who reads node health: the job user (set by the fixture below)


@pytest.fixture(autouse=True, scope="module")
def _user(job_user):
    global USER
    USER = job_user.name


def nodes_json() -> dict:
    """`tpassctl nodes --json`: exit 0 when every tpassd answered, 3 (docs/cli.md) when one did not;
    that node is then listed as unknown."""
    out = tpassctl_as("nodes", "--json", user=USER)
    nodes = {n["node"]: n for n in json.loads(out.stdout)["nodes"]}
    silent = [name for name, n in nodes.items() if not n.get("reachable", True)]
    assert out.returncode == (3 if silent else 0), (out.returncode, out.stdout, out.stderr)
    return nodes


def wait_for(pred, timeout: float, what: str, show=None):
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        last = pred()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what} ({timeout:g} s)" + (f"; now: {show()!r}" if show else ""))


@pytest.fixture(scope="module")
def subscriber(cluster):
    sock = str(cluster.munge_socket)

    def snap(node, endpoint):
        return zmqio.request(endpoint, "tpassd.health", {}, timeout_s=1.0, retries=0,
                             auth=auth.credential_for("tpassd.health", {}, node, sock))

    pubs = {n: (f"tcp://{cluster.node_address(n)}:{TPASSD_PUB_PORT}",
                f"tcp://{cluster.node_address(n)}:{TPASSD_CONTROL_PORT}") for n in cluster.node_names}
    with HealthSubscriber(pubs, snapshot=snap, missed_heartbeats=3) as sub:
        yield sub


def test_heartbeats_from_all_four(cluster, subscriber):
    assert len(cluster.node_names) == 4
    wait_for(lambda: all(subscriber.state(n) is State.HEALTHY for n in cluster.node_names), 20,
             "all four tpassds healthy")
    views = subscriber.nodes()
    assert all(v["last_heartbeat_age_s"] < 2.0 for v in views.values()), views


def test_inject_sbe_storm_degrades_node2_and_clear_heals(cluster, subscriber):
    wait_for(lambda: nodes_json()["node2"]["state"] == "healthy", 20, "node2 healthy")
    out = tpassctl("inject", "--node", "node2", "--fault", "ecc-sbe-storm", "--gpu", "3")
    assert "gpu3" in out.stdout
    row = wait_for(lambda: (r := nodes_json()["node2"])["state"] == "degraded" and r, 30, "node2 degraded",
                   show=lambda: nodes_json()["node2"])
    assert any("SBE ECC storm" in r for r in row["reasons"]), row
    assert row["last_heartbeat_age_s"] is not None and row["last_heartbeat_age_s"] < 2.0
    others = nodes_json()
    assert all(others[n]["state"] == "healthy" for n in ("node1", "node3", "node4")), others
    wait_for(lambda: subscriber.state("node2") is State.DEGRADED, 5, "subscriber sees node2 degraded")
    tpassctl("inject", "--node", "node2", "--fault", "clear")
    wait_for(lambda: nodes_json()["node2"]["state"] == "healthy", 30, "node2 healthy after clear")
    wait_for(lambda: subscriber.state("node2") is State.HEALTHY, 5, "subscriber sees node2 healthy")


def test_kill_9_is_unknown_then_healthy_after_restart(cluster, subscriber):
    wait_for(lambda: subscriber.state("node3") is State.HEALTHY, 20, "node3 healthy")
    pid = cluster.status()["processes"]["tpassd.node3"]["pid"]
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    wait_for(lambda: subscriber.state("node3") is State.UNKNOWN, 10, "node3 unknown")
    took = time.monotonic() - t0
    view = subscriber.nodes()["node3"]
    assert view["state"] == "unknown" and "no heartbeat" in view["reasons"][0], view
    assert 2.0 <= took <= 5.0, f"unknown after {took:.1f} s; window is 3 x 1 s"
    assert nodes_json()["node3"]["state"] == "unknown"  # unreachable: unknown, never failed
    # the others are untouched
    assert all(subscriber.state(n) is State.HEALTHY for n in ("node1", "node2", "node4"))
    cluster.tpassd_restart("node3")
    wait_for(lambda: subscriber.state("node3") is State.HEALTHY, 20, "node3 healthy after restart")
    assert subscriber.view("node3").incarnation is not None


def test_every_tpassd_runs_with_the_systemd_units_capability_bounding_set(cluster):
    """Each devcluster tpassd (a restarted one too) is bounded as contrib/systemd/tpassd.service
    bounds it, so the migration tests run with the unit's capabilities."""
    from torchpass.checkpoint.criu import CAP_NAMES
    from torchpass.devcluster.tpassd_node import unit_bounding_set, unit_file

    unit = sum(1 << CAP_NAMES.index(c) for c in unit_bounding_set(unit_file().read_text()))
    with open("/proc/self/status") as f:  # setpriv can only drop: what this machine gives us bounds it too
        own = int(next(ln for ln in f if ln.startswith("CapBnd:")).split()[1], 16)
    want = unit & own
    assert want != own, "the unit's set would drop nothing here; the check would prove nothing"
    procs = cluster.status()["processes"]
    tpassds = {role: p["pid"] for role, p in procs.items() if role.startswith("tpassd.") and p["alive"]}
    assert len(tpassds) == len(cluster.node_names), procs
    for role, pid in tpassds.items():
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
        assert "tpassd" in open(f"/proc/{pid}/cmdline").read(), role  # setpriv exec'd tpassd: same pid
        assert int(status["CapBnd"], 16) == want, f"{role}: CapBnd {status['CapBnd']}"
        assert int(status["CapEff"], 16) == want, f"{role}: CapEff {status['CapEff']}"


HEALTHCHECK = os.path.join(os.path.dirname(__file__), "..", "..", "contrib", "slurm", "torchpass-healthcheck")


def test_the_healthcheck_program_drains_a_node_its_tpassd_calls_failed(cluster):
    """contrib/slurm/torchpass-healthcheck, run as slurmd runs HealthCheckProgram (as root, in the
    node's namespaces, SLURMD_NODENAME set), drains an idle node whose tpassd says failed, with a
    "torchpass: " reason that sinfo -R shows; a healthy node is left alone."""
    node = "node3"
    env = {**os.environ, **cluster.env(), "SLURMD_NODENAME": node, "TPASSCTL": TPASSCTL[0],
           "TORCHPASS_HEALTHCHECK_CONFIG": "/nonexistent"}

    def check() -> subprocess.CompletedProcess:
        return cluster.exec_on(node, ["bash", HEALTHCHECK], env=env, capture_output=True, text=True, timeout=60)

    def sinfo_reason() -> str:
        out = subprocess.run(["sinfo", "-R", "-h", "-n", node, "-o", "%E"], capture_output=True, text=True,
                             timeout=30, env=env)
        return out.stdout.strip()

    wait_for(lambda: nodes_json()[node]["state"] == "healthy", 20, f"{node} healthy")
    healthy = check()
    assert healthy.returncode == 0 and sinfo_reason() == "", (healthy.stdout, healthy.stderr)
    tpassctl("inject", "--node", node, "--fault", "xid79", "--gpu", "1")
    try:
        wait_for(lambda: nodes_json()[node]["state"] == "failed", 30, f"{node} failed",
                 show=lambda: nodes_json()[node])
        failed = check()
        assert failed.returncode == 1, (failed.stdout, failed.stderr)
        reason = sinfo_reason()
        assert reason.startswith("torchpass: ") and "79" in reason, (reason, failed.stdout)
        state = json.loads(subprocess.run(["scontrol", "show", "node", node, "--json"], capture_output=True,
                                          text=True, timeout=30, env=env, check=True).stdout)["nodes"][0]["state"]
        assert "DRAIN" in state and "DOWN" not in state, state
    finally:
        tpassctl("inject", "--node", node, "--fault", "clear")
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], env=env, timeout=30,
                       capture_output=True)
