"""Integration fixtures: a real local Slurm cluster for the whole session.

The cluster's name and subnet come from TORCHPASS_TEST_CLUSTER and
TORCHPASS_TEST_SUBNET (defaults "t" and 10.78.0, apart from the demo's
10.77.0) so that a developer's own devcluster keeps running beside the tests.
Under pytest-xdist (``make test``: ``-n 2 --dist loadfile``) each worker brings
up a cluster of its own: worker gwN's is NAME+N on 10.X.(Y+N). A module's tests
stay on one worker, so its module-scoped jobs and reference runs stay on one
cluster.

Jobs are submitted as an ordinary user (``job_user``, tpuser1: real clusters
have no root jobs) with the cluster's job Python (``cluster.job_python``), in
a ``job_dir`` that user owns under a directory every user can reach (pytest's
own tmp dirs are 0700 root).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from torchpass import layout
from torchpass.coordinator.policy import DEFAULT_POLICIES_DIR
from torchpass.devcluster import Devcluster, DevclusterSpec
from torchpass.devcluster.cluster import REPO_ROOT
from torchpass.errors import DevclusterError
from torchpass.runtime import relay

pytestmark = pytest.mark.integration


def _preflight() -> None:
    if os.geteuid() != 0:
        pytest.fail("integration tests need root (network namespaces, slurmd); run 'make test' as root",
                    pytrace=False)


@pytest.fixture(scope="session")
def plugin_built() -> Path:
    """Tests of --torchpass jobs need the SPANK plugin; 'make test' builds it first."""
    plugin = REPO_ROOT / "slurm_spank" / "torchpass.so"
    if not plugin.exists():
        pytest.fail(f"{plugin} is not built; 'make test' builds it (make -C slurm_spank)", pytrace=False)
    return plugin


def worker_cluster(name: str, subnet: str, worker: str | None) -> tuple[str, str]:
    """The devcluster of one pytest-xdist worker ("gw0", "gw1", ...; None: no xdist): its name
    (the base name, cut to leave room, and the worker's number) and its subnet (the third octet
    plus the number). The devcluster derives slurmctld's port and its job ids from the subnet."""
    if not worker:
        return name, subnet
    n = int(worker.removeprefix("gw"))
    a, b, c = subnet.split(".")
    return f"{name[:8 - len(str(n))]}{n}", f"{a}.{b}.{int(c) + n}"


# The modules that need a devcluster of another shape (cgroups, data rails, GPUs) bring up their
# own, beside the worker's, on 10.(X+offset).Y: one offset per module, so that two of them on the
# two workers never share a subnet (nor the slurmctld port the devcluster derives from it).
OWN_CLUSTER_OFFSETS = {"cg": 50, "lp": 60, "fa": 70, "gp": 80}


def own_cluster_spec(suffix: str, subnet_env: str | None = None, **shape) -> DevclusterSpec:
    """The spec of a module's own devcluster: NAME[:5]+suffix, on its own subnet (``subnet_env``
    names a variable that may set it instead)."""
    subnet = os.environ.get(subnet_env) if subnet_env else None
    if not subnet:
        a, b, c = os.environ.get("TORCHPASS_TEST_SUBNET", "10.78.0").split(".")
        subnet = f"{a}.{(int(b) + OWN_CLUSTER_OFFSETS[suffix]) % 256}.{c}"
    return DevclusterSpec(name=os.environ.get("TORCHPASS_TEST_CLUSTER", "t")[:5] + suffix, subnet=subnet, **shape)


@contextmanager
def site_policy(name: str, toml: str) -> Iterator[str]:
    """/etc/torchpass/policies/NAME.toml holding ``toml`` for the block, for jobs submitted with
    ``--torchpass=policy=NAME`` (the directory is the machine's, shared by every devcluster: NAME
    must be the module's own); yields NAME."""
    path = DEFAULT_POLICIES_DIR / f"{name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(toml)
    try:
        yield name
    finally:
        path.unlink(missing_ok=True)


@contextmanager
def own_devcluster(spec: DevclusterSpec) -> Iterator[Devcluster]:
    """A module's own devcluster, up for the block, with the Slurm helpers' environment pointing
    at it; down after, whatever happened."""
    _preflight()
    c = Devcluster.up(spec)
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in c.env().items():
                mp.setenv(k, v)
            yield c
    finally:
        c.down()


@pytest.fixture(scope="session")
def cluster():
    """The session's devcluster. Bring-up writes plugstack.conf, so a
    plugin built after this point is not loaded: build it first."""
    _preflight()
    name, subnet = worker_cluster(os.environ.get("TORCHPASS_TEST_CLUSTER", "t"),
                                  os.environ.get("TORCHPASS_TEST_SUBNET", "10.78.0"),
                                  os.environ.get("PYTEST_XDIST_WORKER"))
    spec = DevclusterSpec(
        name=name,
        subnet=subnet,
        nodes=4,
        tpassd=os.environ.get("TORCHPASS_TEST_NO_TPASSD") != "1",
    )
    failure = None
    try:
        c = Devcluster.up(spec)
    except DevclusterError as exc:  # e.g. no job Python the job users can run: one line says what to run
        failure = f"devcluster {spec.name!r} did not come up: {exc}"
    if failure:
        pytest.fail(failure, pytrace=False)
    saved = {k: os.environ.get(k) for k in c.env()}
    os.environ.update(c.env())
    try:
        yield c
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        uids = {0}
        for user in spec.job_users:
            try:
                uids.add(pwd.getpwnam(user).pw_uid)
            except KeyError:
                pass
        c.down()
        # The jobs' node relays are gone with the cluster: their socket files go too (one left by
        # a process ended with os._exit, as the test jobs end, is otherwise swept only by a later
        # relay host of the same user: torchpass.runtime.relay.sweep_dead).
        for uid in uids:  # only a real directory of that user (lstat: not a link it planted)
            directory = relay.private_dir(relay.relay_dir({}, uid=uid), create=False, uid=uid)
            if directory is not None:
                relay.sweep_dead(directory, older_s=0.0)
        leftover = [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
                    if ns.startswith(f"tp-{spec.name}-")]
        assert not leftover, f"devcluster left namespaces behind: {leftover}"


# What a module may find on the worker's devcluster when it starts: every node idle, in
# service and with no drill armed. The modules of one xdist worker share its cluster, and a
# module that fails mid-way (or ends while slurmctld still completes its jobs) may leave a job,
# a drained node or a drill behind for the next one; a test that places ranks on node1..node3
# then finds them elsewhere.
MODULE_RESET_S = 90.0


def _module_uses_cluster(session, module) -> bool:
    return any(item.module is module and "cluster" in item.fixturenames for item in session.items)


@pytest.fixture(scope="module", autouse=True)
def _cluster_as_new_for_each_module(request):
    """Before each module that uses the devcluster: no job left, no drill, no node drained or
    down, every node idle (at most MODULE_RESET_S). A reset that cannot finish fails the
    module's first test with what is left, rather than a test failing later on a busy node."""
    if not _module_uses_cluster(request.session, request.module):
        yield
        return
    c = request.getfixturevalue("cluster")
    env = {**os.environ, **c.env()}

    def run(argv):
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=30)

    status = c.status()
    for node in list(status.get("crashed", [])):
        c.revive(node)
    restarted = []
    if c.spec.tpassd:  # a test that killed a tpassd and failed before restarting it
        for node in c.node_names:
            proc = status["processes"].get(f"tpassd.{node}")
            if node not in status.get("crashed", []) and proc is not None and not proc["alive"]:
                c.tpassd_restart(node)
                restarted.append(node)
    left = run(["squeue", "--noheader", "--format", "%i"]).stdout.split()
    for job in left:
        run(["scancel", job])
    tpassctl = str(Path(sys.executable).parent / "tpassctl")
    if c.spec.tpassd:
        for node in c.node_names:
            run([tpassctl, "inject", "--node", node, "--fault", "clear"])
    deadline = time.monotonic() + MODULE_RESET_S
    while True:
        busy = run(["squeue", "--noheader", "--format", "%i %T"]).stdout.strip()
        nodes = {n["name"]: n for n in json.loads(run(["scontrol", "show", "nodes", "--json"]).stdout)["nodes"]}
        for name, n in nodes.items():
            if {"DRAIN", "DOWN", "FAIL"} & set(n["state"]):
                run(["scontrol", "update", f"NodeName={name}", "State=RESUME"])
        not_idle = {name: n["state"] for name, n in nodes.items() if n["state"] != ["IDLE"]}
        if c.spec.tpassd and run([tpassctl, "nodes", "--json"]).returncode != 0:  # 3: a tpassd did not answer
            not_idle["tpassd"] = ["NOT ANSWERING"]
        if not busy and not not_idle:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"the devcluster did not come back to idle in {MODULE_RESET_S:g} s before "
                        f"{request.module.__name__}: jobs {busy!r}, nodes {not_idle}", pytrace=False)
        time.sleep(0.5)
    if left or restarted:
        print(f"\n{request.module.__name__}: cancelled jobs {left} and restarted the tpassd of {restarted}, "
              "which an earlier module left on the devcluster")
    yield


# The one module whose jobs may record a fail-slow decision.
FAILSLOW_MODULES = ("test_failslow_cluster",)


@pytest.fixture(autouse=True)
def no_failslow_decision_elsewhere(request):
    """Fail-slow is on in every integration test (the default policy), and only the fail-slow
    tests may see it decide: a ``failslow.detected`` event in the log of any job that recorded an
    event during another test fails it (on a shared 2-core machine, a node picked as slow by
    scheduler noise would be a false move)."""
    if "cluster" not in request.fixturenames:
        yield
        return
    c = request.getfixturevalue("cluster")
    started = time.time()
    yield
    if request.module.__name__.rsplit(".", 1)[-1] in FAILSLOW_MODULES:
        return
    decided = []
    for events in (c.state_dir / "jobs").glob(f"*/{layout.EVENTS_JSON}"):
        try:
            if events.stat().st_mtime < started:
                continue
            log = json.loads(events.read_text())
        except (OSError, ValueError):
            continue
        decided += [f"job {events.parent.name}: {e.get('message')}" for e in log
                    if isinstance(e, dict) and e.get("kind") == "failslow.detected" and e.get("time", 0) >= started]
    assert not decided, f"a fail-slow decision outside the fail-slow tests: {decided}"


@dataclass(frozen=True)
class JobUser:
    """An unprivileged user of the devcluster (made by its bring-up)."""

    name: str
    uid: int
    gid: int
    home: Path


def _job_user(name: str) -> JobUser:
    pw = pwd.getpwnam(name)
    return JobUser(pw.pw_name, pw.pw_uid, pw.pw_gid, Path(pw.pw_dir))


@pytest.fixture(scope="session")
def job_user(cluster) -> JobUser:
    """The user the tests' jobs run as (tpuser1)."""
    return _job_user(cluster.job_users[0])


@pytest.fixture(scope="session")
def other_user(cluster) -> JobUser:
    """A second ordinary user (tpuser2): must not see or steer job_user's jobs."""
    return _job_user(cluster.job_users[1])


@pytest.fixture(scope="session")
def jobs_base(cluster) -> Path:
    """/tmp/torchpass-it-NAME: reachable by every user, emptied at the start of each session
    (kept after it, for a look at the jobs' output)."""
    base = Path("/tmp") / f"torchpass-it-{cluster.spec.name}"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(mode=0o755)
    base.chmod(0o755)
    return base


def make_job_dir(base: Path, name: str, owner: JobUser | None) -> Path:
    """A fresh directory under ``base`` owned by ``owner`` (root if None)."""
    d = base / name
    n = 1
    while d.exists():
        n += 1
        d = base / f"{name}{n}"
    d.mkdir(mode=0o755)
    if owner is not None:
        os.chown(d, owner.uid, owner.gid)
    return d


@pytest.fixture
def job_dir(request, jobs_base, job_user) -> Path:
    """A directory the job user owns and every node reaches (one machine: a shared fs).
    Root (the test, a root job) writes in it too."""
    return make_job_dir(jobs_base, request.node.name[:60].replace("/", "_").replace("[", "-").rstrip("]"), job_user)
