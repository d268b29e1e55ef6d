"""The local cluster: bring-up, tear-down, status and command execution."""

from __future__ import annotations

import fcntl
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import structlog

import torchpass
from torchpass import envnames
from torchpass.devcluster import cgroups, cpu_quota, gpus, jobpython, rails
from torchpass.devcluster.tpassd_node import ports_toml, start_args
from torchpass.errors import DependencyError, DevclusterError
from torchpass.ports import TPASSD_CONTROL_PORT, TPASSD_METRICS_PORT, TPASSD_PUB_PORT

log = structlog.get_logger("torchpass.devcluster")

DEFAULT_BASE_DIR = Path("/run/torchpass/devcluster")
REPO_ROOT = Path(torchpass.__file__).resolve().parent.parent
_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
_SUBNET_RE = re.compile(r"^10\.(\d{1,3})\.(\d{1,3})$")
# slurmctld's port (DevclusterSpec.ctld_port) and job ids (first_job_id), per subnet.
CTLD_PORT_BASE = 7000
CTLD_PORT_SLOTS = 25000
JOB_ID_BLOCK = 10000
JOB_ID_BLOCKS = 6000
_USER_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,30}$")
# Unprivileged users made on bring-up if missing (nodes share the host's /etc/passwd).
DEFAULT_JOB_USERS = ("tpuser1", "tpuser2")


@dataclass(frozen=True)
class DevclusterSpec:
    """What to bring up. Several clusters coexist if names and subnets differ."""

    name: str = "dev"
    nodes: int = 4
    # First three octets of a private /24 that exists only on this machine.
    subnet: str = "10.77.0"
    base_dir: Path = DEFAULT_BASE_DIR
    # Start a tpassd on every node (the health daemon, with fake GPUs).
    tpassd: bool = True
    plugin: Path | None = None  # default: <repo>/slurm_spank/torchpass.so if built
    # Ordinary users that submit jobs; created (useradd -m) if missing.
    job_users: tuple[str, ...] = DEFAULT_JOB_USERS
    # The interpreter jobs, coordinators and rank wrappers run: it must be
    # usable by every job user. Default: the job venv (jobpython.py), refreshed
    # from this checkout on every bring-up.
    job_python: Path | None = None
    # tpassd's (pub, control, metrics) ports on every node; the coordinator and
    # tpassctl read them from RUN_DIR/etc/tpassd-ports.toml ($TORCHPASS_TPASSD_CONFIG).
    tpassd_ports: tuple[int, int, int] = (TPASSD_PUB_PORT, TPASSD_CONTROL_PORT, TPASSD_METRICS_PORT)
    # Slurm's cgroup plugins, as production clusters run them (proctrack/cgroup,
    # task/cgroup + task/affinity, ConstrainCores, ConstrainRAMSpace; cgroup v1):
    # each node gets its own cgroup subtree and cgroup namespace (cgroups.py).
    cgroups: bool = False
    # Data rails beside the management network (eth0): railR on every node, one bridge per rail
    # (rails.py). 0 = the management network only.
    rails: int = 0
    # How long a rail that flapped stays degraded on the nodes' tpassds (the [rail] window_s of
    # their policy; tpassd's default, 300 s, outlasts a test job).
    rail_flap_window_s: float = 300.0
    # Fake GPUs per node as Slurm GRES (gpus.py), node1 first; () = none. Needs the cgroup mode
    # (ConstrainDevices is task/cgroup's).
    gpus: tuple[int, ...] = ()

    def validate(self) -> None:
        if not _NAME_RE.match(self.name):
            raise DevclusterError(
                f"cluster name {self.name!r} must be 1-8 lowercase letters/digits, starting with a letter"
            )
        if not 1 <= self.nodes <= 16:
            raise DevclusterError(f"--nodes {self.nodes} is out of range; use 1 to 16")
        m = _SUBNET_RE.match(self.subnet)
        if not m or not (0 <= int(m.group(1)) <= 255 and 0 <= int(m.group(2)) <= 255):
            raise DevclusterError(f"subnet {self.subnet!r} must look like 10.X.Y (a private /24)")
        pub, control, metrics = self.tpassd_ports
        if not (1 <= pub <= 65535 and 1 <= control <= 65535 and pub != control
                and (metrics == -1 or 1 <= metrics <= 65535)):
            raise DevclusterError(f"tpassd ports {self.tpassd_ports} must be two distinct ports 1..65535 "
                                  "(pub, control) and a metrics port or -1")
        if not 0 <= self.rails <= rails.MAX_RAILS:
            raise DevclusterError(f"--rails {self.rails} is out of range; use 0 to {rails.MAX_RAILS}")
        if not self.rail_flap_window_s > 0:
            raise DevclusterError(f"rail flap window {self.rail_flap_window_s!r} s must be > 0")
        gpus.check_counts(self.gpus, self.nodes)
        if any(self.gpus) and not self.cgroups:
            raise DevclusterError("--gpus needs the cgroup mode (--cgroups): Slurm confines a step's GPUs with "
                                  "task/cgroup's ConstrainDevices")
        for user in self.job_users:
            if not _USER_RE.match(user) or user == "root":
                raise DevclusterError(f"job user {user!r} must be an ordinary user name (lowercase, not root)")

    @property
    def run_dir(self) -> Path:
        return Path(self.base_dir) / self.name

    @property
    def subnet_index(self) -> int:
        """10.X.Y as X*256 + Y: distinct for distinct subnets, and two clusters on one machine
        never share a subnet (their bridges would route the same /24)."""
        _, x, y = (int(part) for part in self.subnet.split("."))
        return x * 256 + y

    @property
    def ctld_port(self) -> int:
        """slurmctld's port. It is the one port a cluster takes in the root network namespace
        (slurmd and tpassd listen inside their nodes' namespaces), so it comes from the whole
        subnet: 10.78.0 and 10.78.1 get different ports. 7000..31999 stays below Linux's
        ephemeral range (32768..60999), where a client's connection could hold it. Two subnets
        whose indexes differ by a multiple of CTLD_PORT_SLOTS share a port: ``up`` refuses the
        second with one line (cluster_conflicts)."""
        return CTLD_PORT_BASE + self.subnet_index % CTLD_PORT_SLOTS

    @property
    def first_job_id(self) -> int:
        """Slurm's FirstJobId. Files outside the cluster's own directory that are named by job and
        node (a node relay's socket, ``/tmp/torchpass-relay-UID/jobJ.S-nodeN.sock``, shared by
        every cluster of the machine) must not meet: each cluster numbers its jobs from its own
        block of JOB_ID_BLOCK ids (Slurm's MaxJobId, 67,043,328, bounds the blocks)."""
        return 1 + (self.subnet_index % JOB_ID_BLOCKS) * JOB_ID_BLOCK

    @property
    def bridge(self) -> str:
        return f"tp-{self.name}"

    @property
    def gpu_dev_dir(self) -> Path:
        """Where each node's GPU device files and inventory are, inside its own mount namespace."""
        return self.run_dir / "dev"

    def node_gpus(self, i: int) -> int:
        return self.gpus[i - 1] if self.gpus else 0

    @property
    def rail_interfaces(self) -> tuple[str, ...]:
        return tuple(rails.rail_interface(r) for r in range(self.rails))

    def node_name(self, i: int) -> str:
        return f"node{i}"

    def node_address(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    def netns(self, i: int) -> str:
        return f"tp-{self.name}-n{i}"

    def veth(self, i: int) -> str:
        return f"tp{self.name}{i}"

    @property
    def controller_address(self) -> str:
        return f"{self.subnet}.1"


@dataclass
class _State:
    """What is running and what exists, written as it happens."""

    spec: dict
    pids: dict[str, int] = field(default_factory=dict)  # role -> pid
    netns: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    up: bool = False
    env: dict[str, str] = field(default_factory=dict)
    job_python: str = ""  # what plugstack.conf names (resolved at bring-up)
    crashed: list[str] = field(default_factory=list)  # nodes a drill cut off (crash) and not yet revived
    cgroups: list[str] = field(default_factory=list)  # the nodes' cgroup subtrees (cgroup mode), removed by down
    gpu_major: int = 0  # the fake GPUs' character major (gpus.unused_char_major), chosen at bring-up


def _run(argv: list[str], *, check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, **kw)
    if check and proc.returncode != 0:
        err = " ".join((proc.stderr or proc.stdout).split())[:300]
        raise DevclusterError(f"'{' '.join(argv)}' failed: {err}")
    return proc


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _read_pidfile(path: Path, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid = int(path.read_text().strip())
            if pid_alive(pid):
                return pid
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    raise DevclusterError(f"{path} did not appear within {timeout_s:g} s; see the logs in {path.parent.parent / 'log'}")


def _check_dependencies() -> None:
    if os.geteuid() != 0:
        raise DevclusterError("the devcluster needs root (network namespaces, slurmd); rerun as root")
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch", "ip", "nsenter", "unshare")
               if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]
    if missing:
        raise DependencyError(
            f"missing {', '.join(missing)}; install them with 'make deps' (scripts/install-system-deps.sh)"
        )


def power_cut(pids: Callable[[], list[int]], *, rounds: int = 50,
              send: Callable[[int, int], None] = os.kill) -> list[int]:
    """Stop every process ``pids()`` lists with SIGSTOP until it lists no running one (a
    process forked meanwhile is stopped in the next round), then SIGKILL them all at once:
    no process of the node sees another die and acts on it (a slurmstepd reporting its
    task's end, a wrapper writing an exit code). Returns the pids killed."""
    stopped: list[int] = []
    for _ in range(rounds):
        fresh = [p for p in dict.fromkeys(pids()) if p not in stopped and p != os.getpid()]
        if not fresh:
            break
        for p in fresh:
            try:
                send(p, signal.SIGSTOP)
            except ProcessLookupError:
                continue
            stopped.append(p)
    for p in stopped:
        try:
            send(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return stopped


def cluster_conflicts(spec: DevclusterSpec) -> list[str]:
    """What keeps ``spec`` from coming up beside the clusters recorded under its base_dir: the
    same subnet, slurmctld port or job-id block as one of them (empty if nothing does)."""
    found = []
    try:
        records = sorted(Path(spec.base_dir).glob("*/cluster.json"))
    except OSError:
        return found
    for path in records:
        try:
            other_d = json.loads(path.read_text())["spec"]
            other = DevclusterSpec(name=other_d["name"], subnet=other_d["subnet"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if other.name == spec.name:
            continue
        shared = [what for what, mine, theirs in (
            ("subnet", spec.subnet, other.subnet),
            (f"slurmctld port {spec.ctld_port}", spec.ctld_port, other.ctld_port),
            (f"first job id {spec.first_job_id}", spec.first_job_id, other.first_job_id),
        ) if mine == theirs]
        if shared:
            found.append(f"devcluster {other.name!r} ({other.subnet}) has the same {' and '.join(shared)}")
    return found


class Devcluster:
    """A handle on one local cluster (running or not)."""

    def __init__(self, spec: DevclusterSpec):
        spec.validate()
        self.spec = spec
        self.run_dir = spec.run_dir
        self._state_path = self.run_dir / "cluster.json"
        self._state: _State | None = None
        self._runtime_dir: Path | None = None  # torchpass.runtime as the job Python sees it

    # --- public ----------------------------------------------------------
    @classmethod
    def up(cls, spec: DevclusterSpec, *, timeout_s: float = 60.0) -> "Devcluster":
        """Bring the cluster up (tearing down any leftover of the same name first)."""
        cluster = cls(spec)
        _check_dependencies()
        with cluster._lock():
            cluster._down_locked()
            conflicts = cluster_conflicts(spec)
            if conflicts:
                raise DevclusterError(f"devcluster {spec.name!r} ({spec.subnet}) cannot come up beside "
                                      f"{'; '.join(conflicts)}: pick another --subnet")
            try:
                cluster._up_locked(timeout_s)
            except BaseException:
                log.error("devcluster bring-up failed; tearing down what was started", name=spec.name)
                cluster._down_locked()
                raise
        return cluster

    @classmethod
    def attach(cls, name: str = "dev", base_dir: Path = DEFAULT_BASE_DIR) -> "Devcluster":
        """A running cluster by name; DevclusterError if it is not up."""
        path = Path(base_dir) / name / "cluster.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise DevclusterError(f"no devcluster named {name!r} is up; "
                                  "start one with 'tpassctl devcluster up'") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise DevclusterError(f"{path} is unreadable ({exc}); "
                                  f"run 'tpassctl devcluster down --name {name}'") from None
        spec_d = data["spec"]
        spec_d["base_dir"] = Path(spec_d["base_dir"])
        for key in ("plugin", "job_python"):
            if spec_d.get(key):
                spec_d[key] = Path(spec_d[key])
        spec_d["job_users"] = tuple(spec_d.get("job_users", DEFAULT_JOB_USERS))
        spec_d["gpus"] = tuple(spec_d.get("gpus", ()))
        if "tpassd_ports" in spec_d:
            spec_d["tpassd_ports"] = tuple(spec_d["tpassd_ports"])
        cluster = cls(DevclusterSpec(**spec_d))
        cluster._state = _State(**data)
        return cluster

    def down(self) -> None:
        with self._lock():
            self._down_locked()

    @property
    def node_names(self) -> list[str]:
        return [self.spec.node_name(i) for i in range(1, self.spec.nodes + 1)]

    def node_address(self, node: str) -> str:
        return self.spec.node_address(self._index(node))

    @property
    def state_dir(self) -> Path:
        return self.run_dir / "state"

    @property
    def restore_tokens(self) -> Path:
        """plugstack.conf's restore_tokens= and every tpassd's restore_token_dir: TOKENS/NODE keeps
        the nodes apart (they share this host's /run), the cluster's name the clusters."""
        return self.run_dir / "restore-tokens"

    @property
    def snapshot_dir(self) -> Path:
        """Every node's tpassd snapshot_dir: one directory, as docs/admin.md asks of a real cluster
        (a rank of a node lost outright is restored elsewhere from its images)."""
        return self.run_dir / "snapshots"

    @property
    def job_python(self) -> Path:
        """The interpreter jobs run (every job user can run it); use it in job scripts."""
        return Path(self._require_state().job_python)

    @property
    def job_users(self) -> tuple[str, ...]:
        return self.spec.job_users

    @property
    def slurm_conf(self) -> Path:
        return self.run_dir / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.run_dir / "munge" / "munge.socket.2"

    def env(self) -> dict[str, str]:
        """Exports that make plain Slurm commands and tpassctl talk to this cluster,
        and name the interpreter job scripts should run (TORCHPASS_JOB_PYTHON)."""
        env = {
            "SLURM_CONF": str(self.slurm_conf),
            envnames.STATE_DIR: str(self.state_dir),
            envnames.MUNGE_SOCKET: str(self.munge_socket),
            envnames.DEVCLUSTER: self.spec.name,
            # Where tpassd listens (torchpass.tpassd_ports): slurmd hands it on to the coordinator.
            envnames.TPASSD_CONFIG: str(self.run_dir / "etc" / "tpassd-ports.toml"),
        }
        if self._state is not None and self._state.job_python:
            env[envnames.JOB_PYTHON] = self._state.job_python
        if self.spec.rails:
            # sbatch hands it on to every task: the runtime builds its inner groups on these.
            env[envnames.DATA_RAILS] = ",".join(self.spec.rail_interfaces)
        return env

    def slurmd_pid(self, node: str) -> int:
        state = self._require_state()
        return state.pids[f"slurmd.{node}"]

    def exec_on(self, node: str, argv: list[str], **kw) -> subprocess.CompletedProcess:
        """Run argv inside ``node``'s network, UTS and mount namespaces."""
        return subprocess.run(self.ns_argv(node) + list(argv), **kw)

    def ns_argv(self, node: str) -> list[str]:
        if node in self._require_state().crashed:
            raise DevclusterError(f"{node} is crashed (a drill); 'tpassctl devcluster revive {node}' brings it back")
        pid = self.slurmd_pid(node)
        return ["nsenter", "-t", str(pid), "--net", "--uts", "--mount", "--"]

    def status(self) -> dict:
        state = self._require_state()
        procs = {role: {"pid": pid, "alive": pid_alive(pid)} for role, pid in state.pids.items()}
        nodes = []
        try:
            out = _run(["scontrol", "show", "nodes", "--json"], env={**os.environ, **self.env()}, timeout=10)
            for n in json.loads(out.stdout).get("nodes", []):
                nodes.append({"name": n["name"], "address": n.get("address"), "state": n.get("state"),
                              "reason": n.get("reason", "")})
        except (DevclusterError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
            nodes = [{"error": str(exc)}]
        return {"name": self.spec.name, "run_dir": str(self.run_dir), "processes": procs,
                "nodes": nodes, "crashed": list(state.crashed), "env": self.env()}

    def tpassd_restart(self, node: str) -> int:
        """(Re)start the tpassd of one node; returns its pid."""
        state = self._require_state()
        with self._lock():
            old = state.pids.get(f"tpassd.{node}")
            if old and pid_alive(old):
                self._kill(old)
            pid = self._start_tpassd(self._index(node))
            self._save()
            return pid

    # --- drills -------------------------------------------------------------
    def crash(self, node: str) -> list[int]:
        """A power cut of ``node``: its network goes down first (nothing it does from then on
        reaches anyone), then every process of the node is stopped and killed with SIGKILL, all
        at once (slurmd, tpassd, slurmstepd, the job's wrappers and ranks). The node's processes
        are what the devcluster knows: its recorded slurmd and tpassd and everything in its
        network namespace (``ip netns pids``), never a process name. Returns the pids killed."""
        state = self._require_state()
        i = self._index(node)
        with self._lock():
            if node in state.crashed:
                raise DevclusterError(f"{node} is already crashed; bring it back with "
                                      f"'tpassctl devcluster revive {node} --name {self.spec.name}'")
            ns = self.spec.netns(i)
            # The node keeps its namespace (revive brings it back): only its link goes down.
            _run(["ip", "-n", ns, "link", "set", "eth0", "down"])
            state.crashed.append(node)
            self._save()
            recorded = [pid for role, pid in state.pids.items() if role in (f"slurmd.{node}", f"tpassd.{node}")]

            def pids() -> list[int]:
                return [p for p in recorded if self._is_ours(p)] + self._netns_pids(ns)

            killed = power_cut(pids)
            left = self._wait_gone(pids)
            if left:
                raise DevclusterError(f"{node}'s processes {left[:5]} survived SIGKILL; "
                                      f"run 'tpassctl devcluster down --name {self.spec.name}'")
            for role in (f"slurmd.{node}", f"tpassd.{node}"):
                pid = state.pids.get(role)
                if pid:
                    try:
                        os.waitpid(pid, os.WNOHANG)  # tpassd may be our child
                    except ChildProcessError:
                        pass
            log.warning("devcluster node crashed", name=self.spec.name, node=node, killed=len(killed))
            return killed

    def slow(self, node: str, cpu_pct: int, for_s: float | None = None,
             cgroup_root: Path = cpu_quota.CGROUP_ROOT) -> dict:
        """Slow ``node`` down (a drill): every process in its network namespace but its tpassd
        under ``cpu_pct`` % of one CPU (100: the quota lifted); ``for_s``: lifted again after that
        many seconds. What was done, as --json prints it.

        slurmd goes into the slowed group too, as on a real slow node: every step it starts later
        (an idle node audited) is slow from its first instruction. A watcher alone that moved new
        processes in every 0.2 s lost the race to a short step on a loaded machine: a 0.3 s
        compute probe finished at full speed in one CI run at two devclusters' load. tpassd stays
        out: it is torchpass' own view of the node."""
        state = self._require_state()
        i = self._index(node)
        with self._lock():
            if node in state.crashed:
                raise DevclusterError(f"{node} is crashed; revive it first")
            daemons = {pid for role, pid in state.pids.items() if role == f"tpassd.{node}"}
            pids = [p for p in self._netns_pids(self.spec.netns(i)) if p not in daemons]
            h = cpu_quota.find_hierarchy(cgroup_root)
            group = cpu_quota.slow(h, self.spec.name, node, pids, cpu_pct)
            lifter = cpu_quota.lift_later(h, group, for_s) if for_s and cpu_pct < 100 else None
            if cpu_pct < 100:  # steps started later (an idle node audited) are slow too
                cpu_quota.keep_slowing(h, group, self.spec.netns(i), daemons)
        log.warning("devcluster node slowed", name=self.spec.name, node=node, cpu_pct=cpu_pct, for_s=for_s,
                    processes=len(pids))
        return {"cpu_pct": min(cpu_pct, 100), "processes": len(pids), "cgroup": str(group),
                "cgroup_version": h.version, "for_s": for_s if lifter else None}

    def kill_gpu(self, node: str, gpu: int = 0) -> dict:
        """GPU ``gpu`` of ``node`` falls off the bus (a drill, gpu_kill.py): tpassd's ``xid79`` drill
        (Xid 79, and NVML's GPU-is-lost from then on), then SIGKILL of the node's ranks whose
        SLURM_LOCALID is ``gpu``, found by the pids their wrappers recorded. What was done, as
        --json prints it."""
        from torchpass import auth, zmqio
        from torchpass.devcluster.gpu_kill import ranks_on_gpu

        self._require_state()
        i = self._index(node)
        if node in self._require_state().crashed:
            raise DevclusterError(f"{node} is crashed; revive it first")
        endpoint = f"tcp://{self.node_address(node)}:{self.spec.tpassd_ports[1]}"
        body = {"kind": "xid79", "gpu": gpu}
        try:
            res = zmqio.request(endpoint, "tpassd.drill", body, timeout_s=5.0, retries=0,
                                auth=auth.credential_for("tpassd.drill", body, node, str(self.munge_socket)))
        except Exception as exc:  # noqa: BLE001 - any failure: the drill did not happen, say why
            raise DevclusterError(f"{node}'s tpassd did not apply the xid79 drill: {exc}") from None
        victims = ranks_on_gpu(self.state_dir, node, gpu, self._netns_pids(self.spec.netns(i)))
        killed = []
        for v in victims:
            try:
                os.kill(v.pid, signal.SIGKILL)
                killed.append({"job": int(v.job), "rank": int(v.rank) if v.rank.isdigit() else v.rank, "pid": v.pid})
            except ProcessLookupError:
                continue
        log.warning("devcluster GPU killed", name=self.spec.name, node=node, gpu=gpu, killed=killed)
        return {"gpu": gpu, "applied": res.get("applied", ""), "killed": killed}

    def link(self, node: str, rail: int, action: str, *, times: int = 5, period_s: float = 2.0) -> str:
        """A link drill on ``node``'s data ``rail`` (rails.py): one line saying what was done."""
        state = self._require_state()
        if node in state.crashed:
            raise DevclusterError(f"{node} is crashed; revive it first")
        parsed = rails.LinkAction.parse(action)
        with self._lock():
            line = rails.RailLinks(self.spec.name, self._index, self.ns_argv, self.spec.rails).act(
                node, rail, parsed, times=times, period_s=period_s)
        log.warning("devcluster link drill", name=self.spec.name, node=node, rail=rail, action=action)
        return line

    def revive(self, node: str) -> None:
        """Bring a crashed node back as at bring-up: its link up, a fresh slurmd (its own UTS
        and mount namespaces again) and tpassd. slurmctld returns it to service when its slurmd
        registers (ReturnToService=2)."""
        state = self._require_state()
        i = self._index(node)
        with self._lock():
            if node not in state.crashed:
                raise DevclusterError(f"{node} is not crashed; 'tpassctl devcluster crash {node}' cuts it off first")
            left = self._wait_gone(lambda: self._netns_pids(self.spec.netns(i)))
            if left:
                raise DevclusterError(f"{node} still runs processes {left[:5]} after its crash; "
                                      f"run 'tpassctl devcluster down --name {self.spec.name}'")
            _run(["ip", "-n", self.spec.netns(i), "link", "set", "eth0", "up"])
            # The dead slurmd's pid file would name a pid that may be another process's by now.
            (self.run_dir / node / "slurmd.pid").unlink(missing_ok=True)
            self._start_slurmd(i)
            state.crashed.remove(node)
            self._save()
            if self.spec.tpassd:
                self._start_tpassd(i)
            log.info("devcluster node revived", name=self.spec.name, node=node)

    @staticmethod
    def _wait_gone(pids: Callable[[], list[int]], timeout_s: float = 10.0) -> list[int]:
        """What ``pids()`` still lists after up to ``timeout_s`` (a killed process takes a moment)."""
        deadline = time.monotonic() + timeout_s
        left = pids()
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = pids()
        return left

    # --- bring-up ---------------------------------------------------------
    def _lock(self):
        self.spec.base_dir.mkdir(parents=True, exist_ok=True)
        fh = open(self.spec.base_dir / f".{self.spec.name}.lock", "w")

        class _Ctx:
            def __enter__(s):
                fcntl.flock(fh, fcntl.LOCK_EX)
                return s

            def __exit__(s, *exc):
                fcntl.flock(fh, fcntl.LOCK_UN)
                fh.close()

        return _Ctx()

    def _save(self) -> None:
        assert self._state is not None
        tmp = self._state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self._state), indent=1, default=str))
        os.replace(tmp, self._state_path)

    def refresh(self) -> None:
        """Read the state file again: after another process changed it (``tpassctl devcluster
        crash`` or ``revive`` give a node a new slurmd pid), this object's cached pids are stale."""
        self._state = None

    def _require_state(self) -> _State:
        if self._state is None:
            other = Devcluster.attach(self.spec.name, self.spec.base_dir)
            self._state = other._state
        assert self._state is not None
        return self._state

    def _index(self, node: str) -> int:
        m = re.fullmatch(r"node(\d+)", node)
        if not m or not 1 <= int(m.group(1)) <= self.spec.nodes:
            raise DevclusterError(f"no node {node!r} in devcluster {self.spec.name!r}; "
                                  f"nodes: {', '.join(self.node_names)}")
        return int(m.group(1))

    def _up_locked(self, timeout_s: float) -> None:
        spec = self.spec
        t0 = time.monotonic()
        rd = self.run_dir
        for sub in ("etc", "log", "ctld", "munge", "state"):
            (rd / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(rd, 0o755)
        os.chmod(rd / "state", 0o1777)  # every job user registers its coordinator here
        self._state = _State(spec={k: str(v) if isinstance(v, Path) else v for k, v in asdict(spec).items()})
        self._save()

        self._ensure_users()
        self._state.job_python = str(self._prepare_job_python())
        self._start_munge()
        self._make_network()
        self._write_configs()
        self._state.env = self.env()
        self._start_slurmctld()
        for i in range(1, spec.nodes + 1):
            self._start_slurmd(i)
        self._save()
        self._wait_idle(timeout_s - (time.monotonic() - t0))
        if spec.tpassd:
            for i in range(1, spec.nodes + 1):
                self._start_tpassd(i)
        self._state.up = True
        self._save()
        log.info("devcluster up", name=spec.name, nodes=spec.nodes, seconds=round(time.monotonic() - t0, 2))

    def _ensure_users(self) -> None:
        for user in self.spec.job_users:
            try:
                pwd.getpwnam(user)
            except KeyError:
                # 0700 homes are fine: only the user needs theirs (a restored rank writes to it).
                _run(["useradd", "--create-home", "--shell", "/bin/bash", user])
                log.info("job user created", user=user, uid=pwd.getpwnam(user).pw_uid)

    def _prepare_job_python(self) -> Path:
        """The job Python, refreshed from this checkout when it is the job venv; checked usable by every job user."""
        if self.spec.job_python is not None:
            python = Path(self.spec.job_python)
        else:
            python = jobpython.ensure(jobpython.job_venv(), create=False)
        self._runtime_dir = jobpython.check_usable(python, list(self.spec.job_users))
        return python

    def _start_munge(self) -> None:
        md = self.run_dir / "munge"
        key = md / "munge.key"
        key.write_bytes(os.urandom(1024))
        shutil.chown(md, "munge", "munge")
        shutil.chown(key, "munge", "munge")
        os.chmod(key, 0o400)
        os.chmod(md, 0o755)  # clients (every job user) must reach the socket
        _run([
            "runuser", "-u", "munge", "--", "munged",
            f"--key-file={key}", f"--socket={self.munge_socket}", f"--pid-file={md / 'munged.pid'}",
            f"--log-file={md / 'munged.log'}", f"--seed-file={md / 'munged.seed'}",
        ])
        self._state.pids["munged"] = _read_pidfile(md / "munged.pid")
        self._save()

    def _make_network(self) -> None:
        spec = self.spec
        _run(["ip", "link", "add", spec.bridge, "type", "bridge"])
        self._state.links.append(spec.bridge)
        self._save()
        _run(["ip", "addr", "add", f"{spec.controller_address}/24", "dev", spec.bridge])
        _run(["ip", "link", "set", spec.bridge, "up"])
        for i in range(1, spec.nodes + 1):
            ns, veth = spec.netns(i), spec.veth(i)
            _run(["ip", "netns", "add", ns])
            self._state.netns.append(ns)
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            self._state.links.append(veth)
            self._save()
            _run(["ip", "link", "set", veth, "master", spec.bridge, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{spec.node_address(i)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        self._make_rails()

    def _make_rails(self) -> None:
        """Rail r: one bridge with no host address, and railR on every node cabled to it
        (rails.py). Two ip calls per node and rail, about 10 ms each."""
        spec = self.spec
        for r in range(spec.rails):
            bridge = rails.rail_bridge(spec.name, r)
            _run(["ip", "link", "add", bridge, "type", "bridge"])
            self._state.links.append(bridge)
            self._save()
            _run(["ip", "link", "set", bridge, "up"])
            for i in range(1, spec.nodes + 1):
                ns, veth, inside = spec.netns(i), rails.rail_veth(spec.name, i, r), rails.rail_interface(r)
                _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", inside, "netns", ns])
                self._state.links.append(veth)
                self._save()
                _run(["ip", "link", "set", veth, "master", bridge, "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{rails.rail_address(r, i)}/24", "dev", inside])
                _run(["ip", "-n", ns, "link", "set", inside, "up"])

    def _write_configs(self) -> None:
        spec, rd = self.spec, self.run_dir
        host = socket.gethostname()
        hosts = ["127.0.0.1 localhost", f"{spec.controller_address} {host} controller"]
        hosts += [f"{spec.node_address(i)} {spec.node_name(i)}" for i in range(1, spec.nodes + 1)]
        (rd / "etc" / "hosts").write_text("\n".join(hosts) + "\n")
        (rd / "etc" / "tpassd-ports.toml").write_text("\n".join(ports_toml(spec.tpassd_ports)) + "\n")
        built = spec.plugin or (REPO_ROOT / "slurm_spank" / "torchpass.so")
        plugin = self._install_plugin(built) if built.exists() else built
        # Jobs run as their users: the programs and the runtime come from the job
        # Python (readable by them), never from root's interpreter or this checkout.
        bindir = Path(self._state.job_python).parent
        runtime = self._runtime_dir / "boot"
        plug_line = (
            f"optional {plugin} coordinator={bindir / 'tpass-coordinator'} state_dir={self.state_dir}"
            f" runtime_path={runtime} rank_wrapper={bindir / 'tpass-rankwrap'}"
            # the nodes share this host's /run: the cluster's own restore tokens (per node below it)
            f" restore_tokens={self.restore_tokens}"
            # a dev cluster's jobs last seconds: periodic snapshots may be as close as 1 s apart
            " snapshot_every_min_s=1"
            # fake GPUs: the restore agent reads the node's own inventory (each node mounts its own there)
            + (f" gpu_inventory={spec.gpu_dev_dir / gpus.INVENTORY_NAME}" if any(spec.gpus) else "") + "\n"
        )
        (rd / "etc" / "plugstack.conf").write_text(plug_line if plugin.exists() else "")
        if not plugin.exists():
            log.warning("SPANK plugin not built; --torchpass will be unknown to sbatch", plugin=str(plugin),
                        hint="make -C slurm_spank")
        n = spec.nodes
        plugins = "\n".join(cgroups.SLURM_CONF_PLUGINS if spec.cgroups
                             else ("ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none"))
        select = "\n".join(cgroups.SLURM_CONF_SELECT if spec.cgroups else ("SelectTypeParameters=CR_Core",))
        if spec.cgroups:
            # Slurm reads cgroup.conf and gres.conf beside slurm.conf
            (rd / "etc" / "cgroup.conf").write_text(cgroups.CGROUP_CONF + ("ConstrainDevices=yes\n" if any(spec.gpus)
                                                                            else ""))
        node_hw = "CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=2000"
        node_lines = f"NodeName=node[1-{n}] NodeAddr={spec.subnet}.[11-{10 + n}] {node_hw} State=UNKNOWN"
        gres_types = ""
        if any(spec.gpus):
            gres_types = "GresTypes=gpu\n"
            node_lines = "\n".join(
                f"NodeName={spec.node_name(i)} NodeAddr={spec.node_address(i)} {node_hw}"
                + (f" Gres=gpu:{spec.node_gpus(i)}" if spec.node_gpus(i) else "") + " State=UNKNOWN"
                for i in range(1, n + 1))
            (rd / "etc" / "gres.conf").write_text(gpus.gres_conf(self.node_names, spec.gpus, spec.gpu_dev_dir))
        conf = f"""# Generated by torchpass devcluster {spec.name!r}; rewritten on every 'up'.
ClusterName=tp{spec.name}
SlurmctldHost={host}({spec.controller_address})
SlurmctldPort={spec.ctld_port}
FirstJobId={spec.first_job_id}
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
# As on production clusters: a job is visible only to its owner and admins
# (the coordinator's job.status and job.events follow it).
PrivateData=jobs
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={rd}/ctld
SlurmctldPidFile={rd}/ctld/slurmctld.pid
SlurmctldLogFile={rd}/log/slurmctld.log
SlurmdSpoolDir={rd}/%n/spool
SlurmdPidFile={rd}/%n/slurmd.pid
SlurmdLogFile={rd}/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
{plugins}
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
{select}
SchedulerParameters=permit_job_expansion
ReturnToService=2
SlurmdTimeout=20
KillWait=5
MinJobAge=600
PlugStackConfig={rd}/etc/plugstack.conf
{gres_types}{node_lines}
PartitionName=debug Nodes=node[1-{n}] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""
        if n == 1:
            conf = conf.replace(f"NodeName=node[1-1] NodeAddr={spec.subnet}.[11-11]",
                                f"NodeName=node1 NodeAddr={spec.subnet}.11").replace("Nodes=node[1-1]", "Nodes=node1")
        self.slurm_conf.write_text(conf)
        for i in range(1, n + 1):
            (rd / spec.node_name(i) / "spool").mkdir(parents=True, exist_ok=True)

    def _install_plugin(self, built: Path) -> Path:
        """Copy the plugin and the programs it runs from beside itself (tpass-*) into RUN_DIR/lib.

        The job user's sbatch and srun load the plugin too, and the checkout it was
        built in may be unreadable to them (a clone under /root); RUN_DIR is
        root-owned and 0755, as an installed plugin's directory is."""
        lib = self.run_dir / "lib"
        lib.mkdir(mode=0o755, exist_ok=True)
        for src in [built, *sorted(built.parent.glob("tpass-*"))]:
            if src.is_file() and (src == built or os.access(src, os.X_OK)):
                shutil.copyfile(src, lib / src.name)
                os.chmod(lib / src.name, 0o755)
        return lib / built.name

    def _start_slurmctld(self) -> None:
        rd = self.run_dir
        _run(["slurmctld", "-f", str(self.slurm_conf), "-i"], env={**os.environ, **self.env()})
        self._state.pids["slurmctld"] = _read_pidfile(rd / "ctld" / "slurmctld.pid")
        self._save()

    def _start_slurmd(self, i: int) -> None:
        spec, rd = self.spec, self.run_dir
        node = spec.node_name(i)
        # Not `ip netns exec`: it remounts /sys and hides /sys/fs/cgroup.
        slurmd = f"slurmd -f {self.slurm_conf}"
        start = f"exec {slurmd}"
        if spec.cgroups:
            dirs = cgroups.node_dirs(spec.name, node)
            self._state.cgroups += [str(d) for d in dirs if str(d) not in self._state.cgroups]
            self._save()
            cgroups.make(dirs)
            start = cgroups.slurmd_command(dirs, slurmd)
        dev = ""
        if spec.node_gpus(i):
            spec.gpu_dev_dir.mkdir(mode=0o755, exist_ok=True)  # each node mounts its own tmpfs here
            inv = gpus.inventory(spec.name, node, spec.node_gpus(i), self._gpu_major(), spec.gpu_dev_dir)
            dev = " && ".join(gpus.node_dev_commands(spec.node_gpus(i), self._gpu_major(), spec.gpu_dev_dir,
                                                     gpus.inventory_json(inv))) + " && "
        script = f"hostname {node} && mount --bind {rd / 'etc' / 'hosts'} /etc/hosts && {dev}{start}"
        _run(
            ["nsenter", f"--net=/run/netns/{spec.netns(i)}", "--", "unshare", "--uts", "--mount",
             "--propagation", "slave", "--", "sh", "-c", script],
            env={**os.environ, **self.env()},
        )
        self._state.pids[f"slurmd.{node}"] = _read_pidfile(rd / node / "slurmd.pid")
        self._save()

    def _gpu_major(self) -> int:
        """The fake GPUs' major: chosen once per bring-up (a revived node keeps it)."""
        if not self._state.gpu_major:
            self._state.gpu_major = gpus.unused_char_major(Path("/proc/devices").read_text())
            self._save()
        return self._state.gpu_major

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + max(timeout_s, 5.0)
        env = {**os.environ, **self.env()}
        last = ""
        while time.monotonic() < deadline:
            proc = _run(["scontrol", "show", "nodes", "--json"], check=False, env=env, timeout=10)
            if proc.returncode == 0:
                try:
                    nodes = json.loads(proc.stdout).get("nodes", [])
                except json.JSONDecodeError:
                    nodes = []
                states = {n["name"]: n.get("state", []) for n in nodes}
                last = str(states)
                if len(states) == self.spec.nodes and all(s == ["IDLE"] for s in states.values()):
                    return
            time.sleep(0.1)
        raise DevclusterError(f"nodes did not become IDLE in time: {last}; see {self.run_dir / 'log'}")

    def _start_tpassd(self, i: int) -> int:
        spec, rd = self.spec, self.run_dir
        node = spec.node_name(i)
        node_dir = rd / node / "tpassd"
        node_dir.mkdir(parents=True, exist_ok=True)
        argv = start_args(node, spec.node_address(i), node_dir, self.munge_socket, ports=spec.tpassd_ports,
                          restore_tokens=self.restore_tokens,
                          snapshot_dir=self.snapshot_dir, rails=spec.rail_interfaces,
                          rail_flap_window_s=spec.rail_flap_window_s,
                          fake_gpu_uuids=tuple(gpus.fake_uuid(spec.name, node, g) for g in range(spec.node_gpus(i)))
                          if spec.gpus else None,
                          gpu_inventory=spec.gpu_dev_dir / gpus.INVENTORY_NAME if spec.node_gpus(i) else None,
                          # one spool every node shares, as a site's shared state_dir would give
                          fleet_spool=self.state_dir / "fleet" / "spool")
        logf = open(rd / "log" / f"tpassd.{node}.log", "ab")
        try:
            proc = subprocess.Popen(
                self.ns_argv(node) + argv,
                stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                start_new_session=True, env={**os.environ, **self.env()},
            )
        finally:
            logf.close()
        # nsenter execs the target after entering, so the pid is tpassd's own.
        self._state.pids[f"tpassd.{node}"] = proc.pid
        self._save()
        return proc.pid

    # --- tear-down ----------------------------------------------------------
    @staticmethod
    def _kill(pid: int, grace_s: float = 3.0) -> None:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and pid_alive(pid):
            time.sleep(0.05)
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # Reap if it is our child (tpassd started by this process).
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass

    def _netns_pids(self, ns: str) -> list[int]:
        proc = _run(["ip", "netns", "pids", ns], check=False)
        return [int(p) for p in proc.stdout.split() if p.isdigit()]

    def _down_locked(self) -> None:
        spec = self.spec
        state = None
        if self._state_path.exists():
            try:
                state = _State(**json.loads(self._state_path.read_text()))
            except (OSError, json.JSONDecodeError, TypeError):
                state = None
        pids = dict(state.pids) if state else {}
        # Pid files cover a crash between start and the state file's update.
        for pidfile, role in [(self.run_dir / "ctld" / "slurmctld.pid", "slurmctld"),
                              (self.run_dir / "munge" / "munged.pid", "munged")]:
            try:
                pids.setdefault(role, int(pidfile.read_text().strip()))
            except (OSError, ValueError):
                pass
        for i in range(1, 17):
            try:
                pids.setdefault(f"slurmd.node{i}", int((self.run_dir / f"node{i}" / "slurmd.pid").read_text().strip()))
            except (OSError, ValueError):
                pass
        namespaces = set(state.netns if state else [])
        namespaces |= {ns for ns in _run(["ip", "netns", "list"], check=False).stdout.split()
                       if ns.startswith(f"tp-{spec.name}-n")}
        # Everything inside our node namespaces is ours: jobs, coordinators, tpassds.
        ns_pids = [p for ns in namespaces for p in self._netns_pids(ns)]
        ours = {p for p in pids.values() if self._is_ours(p)} | set(ns_pids)
        for role in ("tpassd", "slurmd", "slurmctld", "munged"):
            for name, pid in pids.items():
                if name.startswith(role) and pid in ours:
                    self._kill(pid)
        for pid in ns_pids:
            if pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for ns in sorted(namespaces):
            _run(["ip", "netns", "delete", ns], check=False)
        # Every process of the nodes is gone: their cgroup subtrees (and Slurm's job and step
        # cgroups inside) can go. The recorded ones, and those this process would make.
        subtrees = set(state.cgroups if state else [])
        if spec.cgroups or subtrees:
            try:
                subtrees |= {str(d) for i in range(1, spec.nodes + 1)
                             for d in cgroups.node_dirs(spec.name, spec.node_name(i))}
            except DevclusterError:
                pass  # no v1 hierarchies: nothing was made here
        left = cgroups.remove(sorted(Path(d) for d in subtrees if Path(d).exists()))
        left += cpu_quota.remove_all(spec.name)  # `devcluster slow`'s
        if left:
            log.error("devcluster cgroups left behind (processes still in them?)", cgroups=[str(d) for d in left])
        links = set(state.links if state else []) | {spec.bridge} | {spec.veth(i) for i in range(1, 17)}
        links |= {rails.rail_bridge(spec.name, r) for r in range(rails.MAX_RAILS)}
        links |= {rails.rail_veth(spec.name, i, r) for i in range(1, 17) for r in range(rails.MAX_RAILS)}
        for link in sorted(links):
            if Path(f"/sys/class/net/{link}").exists():
                _run(["ip", "link", "delete", link], check=False)
        if self.run_dir.exists():
            shutil.rmtree(self.run_dir, ignore_errors=True)
        self._state = None

    def _is_ours(self, pid: int) -> bool:
        """A recorded pid is ours if it still runs one of the programs we start."""
        if not pid_alive(pid):
            return False
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        # Every daemon we start names a file under our run dir on its command line.
        return str(self.run_dir) in b" ".join(cmd).decode(errors="replace")
