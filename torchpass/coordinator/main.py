"""`tpass-coordinator`: started once per job by the SPANK plugin on the batch host."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import resource
import signal
import socket
import sys
import time
from pathlib import Path

import click
import zmq

from torchpass import __version__, auth, jobauth, layout, logs
from torchpass.coordinator.decide_relaunch import resumed_from_stop
from torchpass.coordinator.driver import Driver
from torchpass.coordinator.executor import Executor
from torchpass.coordinator.executor_ports import TpassdClient
from torchpass.coordinator.job_metrics import JobMetrics, MetricsPusher, batch_host
from torchpass.coordinator.job_record import JobState
from torchpass.coordinator.policy import CoordinatorPolicy, load_policy
from torchpass.coordinator.recovery import InFlightWriter, Recovery, RecoveryAction, recover
from torchpass.coordinator.recovery import read as read_in_flight
from torchpass.coordinator.recovery_actions import settle
from torchpass.coordinator.server import CoordinatorServer, job_liveness_check, write_registration
from torchpass.coordinator.stopped import read_stopped
from torchpass.coordinator.supervisor import Supervisor
from torchpass.errors import TorchpassError
from torchpass.health import HealthSubscriber
from torchpass.slurm import client
from torchpass.slurm.conf import job_privacy, slurm_munge_socket, task_plugins
from torchpass.slurm.gres import spare_strategies_for
from torchpass.tpassd_ports import tpassd_ports

MIN_MAX_SOCKETS = 1024  # zmq's default limit of sockets per context (1,023) and headroom above it
# Open files: every rank keeps a connection (torchpass.zmqio.Client), and a rank whose request
# timed out makes a new one before the old one is gone; each node's tpassd has a subscription and
# a control connection; the rest (log, state files, zmq's own fds) fits in the slack. The soft
# limit a job's processes start with is often 1,024: too few for 8,192 ranks.
FDS_PER_RANK = 2
FDS_PER_NODE = 2
FDS_SLACK = 256
# A restarted coordinator listens where the ranks look (its supervisor passes the port); a port
# in the ephemeral range can be an outgoing connection's for a moment: it tries again this long.
RESTART_BIND_WAITS_S = (0.2, 0.5, 1.0, 2.0)


def job_size(env=os.environ) -> tuple[int | None, int | None]:
    """(ranks, nodes) of the job from the environment Slurm gives the coordinator (None: not there).

    Ranks: SLURM_NTASKS (set with --ntasks), else the sum of SLURM_TASKS_PER_NODE ("8(x1024),4").
    """
    def number(*keys: str) -> int | None:
        for k in keys:
            v = env.get(k, "")
            if v.isdigit():
                return int(v)
        return None

    ranks = number("SLURM_NTASKS", "SLURM_NPROCS")
    per_node = env.get("SLURM_TASKS_PER_NODE", "")
    if ranks is None and per_node:
        parts = [re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", p) for p in per_node.split(",")]
        if all(parts):
            ranks = sum(int(m[1]) * int(m[2] or 1) for m in parts)
    return ranks, number("SLURM_JOB_NUM_NODES", "SLURM_NNODES")


def raise_open_files(ranks: int | None, nodes: int | None, log) -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; say so in one line if it stays below what
    ``ranks`` and ``nodes`` need. Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = FDS_PER_RANK * (ranks or 0) + FDS_PER_NODE * (nodes or 0) + FDS_SLACK
    # An unlimited hard limit is capped by the kernel (fs.nr_open): ask for what the job needs.
    want = hard if hard != resource.RLIM_INFINITY else max(soft, need)
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit", soft=soft, hard=hard, error=str(exc))
    if soft < need:
        log.warning("open-file limit below what this job needs: ranks beyond it cannot connect; raise the "
                    "hard limit for the coordinator (slurmd's LimitNOFILE, or limits.conf)",
                    limit=soft, needed=need, ranks=ranks, nodes=nodes)
    return soft


def _own_address() -> str:
    """The address other nodes reach this host by (its name, resolved here)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _resumed(job: JobState, state_dir, log, marker: dict | None = None):
    """A job stopped with `tpassctl snapshot --stop` and now resumed: the decision state its
    coordinator starts from (decide.resumed_from_stop), the earlier run's events kept; else None.
    ``marker``: filled in with the stop marker's fields."""
    try:
        stopped = read_stopped(state_dir, job.job_id)
    except TorchpassError as exc:
        log.error("not resuming from a snapshot", job_id=job.job_id, error=str(exc))
        return None
    if stopped is None:
        return None
    if marker is not None:
        marker.update(stopped)
    try:
        job.carry_on(json.loads(layout.events_json(state_dir, job.job_id).read_text()))
    except (OSError, ValueError):
        pass
    job.record(time.time(), "job.resuming", f"job {job.job_id} was stopped with snapshot {stopped['snapshot']} at "
               f"step {stopped['snapshot_step']}: the ranks of its step {stopped['step']} are restored from it",
               snapshot=stopped["snapshot"], snapshot_step=stopped["snapshot_step"], step=stopped["step"])
    return resumed_from_stop(job.job_id, time.monotonic(), stopped["snapshot"], stopped["snapshot_step"],
                             stopped["generation"], stopped["world_size"], stopped["step_offset"])


def _make_driver(job, state_dir, spares, policy_name, log, *, snapshot_every_s: float = 0.0):
    """The migration driver: policy, the job's nodes and hot spares, health of their tpassds.

    Without Slurm or a policy the coordinator still serves the job (status,
    events) but cannot migrate; that is logged, never fatal.
    """
    try:
        pol = load_policy(policy_name, flags={"snapshot_every_s": snapshot_every_s} if snapshot_every_s else None)
        ports = tpassd_ports()  # the nodes' own tpassd.toml: one place for a site to move a port
        slurm = client()
        info = slurm.job(job.job_id)
        nodes = list(info.nodes) if info is not None else []
        if not nodes and os.environ.get("SLURM_JOB_NODELIST"):
            nodes = slurm.expand_nodelist(os.environ["SLURM_JOB_NODELIST"])
    except (TorchpassError, OSError) as exc:
        log.warning("migrations disabled for this job", job_id=job.job_id, error=str(exc))
        return None
    kept, why = spare_strategies_for(pol.spare_strategies, task_plugins())
    if why:
        pol = dataclasses.replace(pol, spare_strategies=kept)
        job.record(time.time(), "spare.strategies", why, dropped=["expand"], strategies=list(kept))
        log.info("spare strategies chosen from slurm.conf", why=why)
    hot = tuple(nodes[len(nodes) - spares:]) if 0 < spares < len(nodes) else ()
    addresses = {}
    try:
        addresses = {n.name: n.address for n in slurm.nodes()}
    except (TorchpassError, OSError):
        pass

    def address_of(node: str) -> str:
        a = addresses.get(node)
        if a and a != node:
            return a
        return socket.gethostbyname(node)

    munge_socket = auth.default_socket() or slurm_munge_socket()
    tp = TpassdClient(address_of, port=ports.control_port, munge_socket=munge_socket)

    def snapshot(node: str, endpoint: str) -> dict:
        return tp.request(node, "tpassd.health", {}, 2.0)

    health = None
    driver_box: list[Driver] = []  # the driver, for the subscriber's on_change (made after it)
    try:
        pubs = {n: (f"tcp://{address_of(n)}:{ports.pub_port}", f"tcp://{address_of(n)}:{tp.port}") for n in nodes}
        # One SUB socket per node on the shared context, whose default limit is 1,023 sockets (a
        # 1,024-node job needs about 2,050). Set before the context makes its first socket.
        zmq.Context.instance().set(zmq.MAX_SOCKETS, max(MIN_MAX_SOCKETS, 2 * len(pubs) + MIN_MAX_SOCKETS))

        def on_change(_view, _before) -> None:
            if driver_box:
                driver_box[0].health_changed()

        health = HealthSubscriber(pubs, snapshot=snapshot, on_change=on_change).start()
    except (OSError, TorchpassError, zmq.ZMQError) as exc:
        log.warning("cannot follow node health; only operator migrations will run", error=str(exc))
    stopped: dict = {}
    driver = Driver(job, pol, health=health, spares=hot, initial=_resumed(job, state_dir, log, stopped))
    driver_box.append(driver)
    def follow(node: str) -> None:  # a spare obtained from slurmctld: follow its tpassd too
        if health is not None:
            health.follow(node, f"tcp://{address_of(node)}:{ports.pub_port}", f"tcp://{address_of(node)}:{tp.port}")

    driver.executor = Executor(job, state_dir=state_dir, post=driver.post, policy=pol, tpassd=tp, slurm=slurm,
                               address_of=address_of, follow=follow, output=info.output if info is not None else "")
    if stopped:
        # Before the ready line, hence before the batch script's srun: the restoring step's tasks
        # take these tokens at launch, and without one they fail rather than start afresh.
        failed = driver.executor.prepare_all(nodes, "stopped", snapshot=stopped["snapshot"], step=stopped["step"])
        if failed:
            log.error("the stopped job's restore is not set up on every node; its step's tasks there fail",
                      snapshot=stopped["snapshot"], step=stopped["step"], failed=failed)
    log.info("migration driver ready", job_id=job.job_id, nodes=nodes, hot_spares=list(hot), policy=policy_name,
             snapshot_every_s=pol.snapshot_every_s)
    return driver


def _supervise(job_id, state_dir, spares, policy, snapshot_every, ready_fd, bind_address, port, slurm_poll_s,
               secret_fd, log_level, log) -> int:
    """Be the supervisor (supervisor.py) of this job's coordinator; its exit status."""
    try:
        limit = load_policy(policy).coordinator_restarts
    except (TorchpassError, OSError) as exc:  # the coordinator says so itself, and runs without migrations
        limit = CoordinatorPolicy().coordinator_restarts
        log.warning("policy not loaded; coordinator restarts as by default", policy=policy, error=str(exc))
    try:
        secret = jobauth.read_secret_fd(secret_fd) if secret_fd is not None else None
    except TorchpassError as exc:
        click.echo(f"tpass-coordinator: {exc}", err=True)
        return 1
    args = ["--job-id", str(job_id), "--state-dir", str(state_dir), "--spares", str(spares), "--policy", policy,
            "--snapshot-every", repr(float(snapshot_every)), "--slurm-poll-s", repr(float(slurm_poll_s)),
            "--log-level", log_level]
    if bind_address:
        args += ["--bind-address", bind_address]
    if port:
        args += ["--port", str(port)]
    return Supervisor(args, job_id=job_id, state_dir=state_dir, limit=limit, ready_fd=ready_fd,
                      secret=secret).run()


def _push_metrics(job: JobState, server: CoordinatorServer, driver, log) -> MetricsPusher | None:
    """The job's summary for Prometheus, sent to the batch host's tpassd (torchpass/job_metrics.py)
    over the executor's authenticated tpassd channel; None without one (no Slurm: no driver)."""
    if driver is None or driver.executor is None or driver.executor.tpassd is None:
        return None
    ex = driver.executor
    metrics = JobMetrics()
    host: list[str | None] = []

    def build():
        metrics.observe(job.events)
        return metrics.report(job.job_id, server.state, server.clock(), pusher.every_s)

    def send(body: dict, timeout_s: float) -> dict:
        if not host:
            host.append(batch_host(dict(os.environ), lambda: ex.slurm.job(job.job_id)))
        if host[0] is None:
            raise TorchpassError("neither SLURMD_NODENAME nor slurmctld names this job's batch host")
        return ex.tpassd.request(host[0], "tpassd.job_metrics", body, timeout_s=timeout_s)

    pusher = MetricsPusher(build, server.later, send)
    log.info("job metrics go to the batch host's tpassd", every_s=pusher.every_s)
    return pusher.start()


def _restarted(job: JobState, state_dir, restart: int, reason: str, log) -> Recovery:
    """This coordinator replaces one that died: the saved events go on, and what it left paused is
    decided on (recovery.recover) before anything else runs."""
    try:
        job.carry_on(json.loads(layout.events_json(state_dir, job.job_id).read_text()))
    except (OSError, ValueError):
        pass
    try:
        decision = recover(read_in_flight(state_dir, job.job_id))
    except ValueError as exc:
        decision = Recovery(RecoveryAction.NOTHING, f"unreadable in-flight record ({exc}): nothing resumed by it")
    job.record(time.time(), "coordinator.restarted", f"coordinator restarted ({reason}; restart {restart}): "
               f"rebuilding from the ranks' registrations and the saved events; {decision.reason}",
               restart=restart, previous=reason, recovery=decision.action.value)
    log.warning("coordinator restarted", job_id=job.job_id, restart=restart, previous=reason,
                recovery=decision.action.value, why=decision.reason)
    return decision


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tpass-coordinator")
@click.option("--job-id", type=click.IntRange(min=1), required=True, help="The Slurm job this coordinator serves.")
@click.option("--state-dir", type=click.Path(path_type=Path, file_okay=False), required=True,
              help="Shared torchpass state directory; registration goes to STATE_DIR/jobs/JOBID/.")
@click.option("--spares", type=click.IntRange(0, 64), default=0, show_default=True,
              help="Hot spare nodes in the allocation.")
@click.option("--policy", default="default", show_default=True, help="Policy name (from --torchpass=policy=).")
@click.option("--snapshot-every", "snapshot_every", type=click.FloatRange(min=0), default=0, show_default=True,
              help="Seconds between periodic whole-job snapshots (--torchpass=snapshot_every=); "
                   "0: the policy's snapshot_every_s.")
@click.option("--ready-fd", type=int, default=None,
              help="Write the endpoint (tcp://ADDR:PORT) and a newline to this fd once listening, then close it.")
@click.option("--bind-address", default=None, help="Address to listen on [default: this host's address].")
@click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True, help="0 picks a free port.")
@click.option("--slurm-poll-s", type=click.FloatRange(min=0.1), default=5.0, show_default=True,
              help="How often to ask slurmctld whether the job still runs; the coordinator exits when it has ended.")
@click.option("--secret-fd", type=click.IntRange(min=0), default=None,
              help="Read the job secret (64 hex digits, from the plugin) from this fd; rank.* requests must be "
                   "signed with it. Without it they are accepted unsigned (a coordinator started by hand).")
@click.option("--log-level", default="info", show_default=True)
@click.option("--supervised", is_flag=True, hidden=True,
              help="Run the coordinator itself (its supervisor passes this); without it this process supervises.")
@click.option("--restart", type=click.IntRange(min=0), default=0, hidden=True,
              help="This coordinator replaces one that died (the supervisor's restart count).")
@click.option("--restart-reason", default="", hidden=True, help="How the coordinator it replaces ended.")
def main(job_id, state_dir, spares, policy, snapshot_every, ready_fd, bind_address, port, slurm_poll_s, secret_fd,
         log_level, supervised, restart, restart_reason):
    """Per-job torchpass coordinator (started by the SPANK plugin; not run by hand).

    It supervises the coordinator it starts: a coordinator that dies is started again on the same
    address, at most the policy's coordinator_restarts times (docs/coordinator.md, "The coordinator
    comes back")."""
    logs.configure(log_level)
    log = logs.get_logger("torchpass.coordinator")
    if not supervised:
        sys.exit(_supervise(job_id, state_dir, spares, policy, snapshot_every, ready_fd, bind_address, port,
                            slurm_poll_s, secret_fd, log_level, log))
    raise_open_files(*job_size(), log)
    address = bind_address or _own_address()
    try:
        secret = jobauth.read_secret_fd(secret_fd) if secret_fd is not None else None
        private, admins = job_privacy()
        job = JobState(job_id=job_id, spares=spares, policy=policy, started_wall=time.time())
        recovered = _restarted(job, state_dir, restart, restart_reason, log) if restart else None
        driver = _make_driver(job, state_dir, spares, policy, log, snapshot_every_s=snapshot_every)
        munge = driver.executor.tpassd.munge_socket if driver else auth.default_socket() or slurm_munge_socket()
        for wait_s in (*RESTART_BIND_WAITS_S, None) if restart else (None,):
            try:
                server = CoordinatorServer(job, bind_address=address, port=port, driver=driver, munge_socket=munge,
                                           job_secret=secret, private_jobs=private, admin_uids=admins)
                break
            except zmq.ZMQError as exc:  # the ranks' port, briefly taken (an outgoing connection's): again
                if wait_s is None:
                    raise TorchpassError(f"cannot listen on {address}:{port} again: {exc}") from None
                time.sleep(wait_s)
        endpoint = f"tcp://{address}:{server.port}"
        write_registration(state_dir, job_id, {
            "job_id": job_id, "endpoint": endpoint, "pid": os.getpid(), "host": socket.gethostname(),
            "uid": os.getuid(), "started": job.started_wall, "spares": spares, "policy": policy,
        })
    except (TorchpassError, OSError) as exc:
        click.echo(f"tpass-coordinator: {exc}", err=True)
        sys.exit(1)
    if ready_fd is not None:
        try:
            os.write(ready_fd, (endpoint + "\n").encode())
            os.close(ready_fd)
        except OSError as exc:
            log.warning("could not write the ready line", fd=ready_fd, error=str(exc))
    job.record(time.time(), "coordinator.started", f"coordinator for job {job_id} listening on {endpoint}")
    if driver is not None and driver.executor is not None:
        driver.in_flight = InFlightWriter(state_dir, job_id)
        if recovered is not None:
            settle(job, driver, recovered)
            driver.executor.save_events()  # coordinator.restarted on disk at once (tpassctl events, tests)
    log.info("coordinator listening", job_id=job_id, endpoint=endpoint, spares=spares, policy=policy)

    pusher = None
    signal.signal(signal.SIGTERM, lambda *_: server.stop_from_signal())
    signal.signal(signal.SIGINT, lambda *_: server.stop_from_signal())
    try:
        def slurm_changed(available: bool, why: str) -> None:  # in the liveness thread
            server.later(lambda: server.note_slurm(available, why))

        server.watch(job_liveness_check(client(), job_id, on_change=slurm_changed), slurm_poll_s)
        pusher = _push_metrics(job, server, driver, log)
        server.serve()
    finally:
        if driver is not None and driver.executor is not None:
            # The log outlives the coordinator, also of a job that never had an event worth saving
            # at once (tpassctl events of an ended job; readable by its owner, root and SlurmUser only).
            # First: the plugin's SIGKILL follows its SIGTERM after stop_timeout (5 s by default),
            # and what comes below talks to tpassd, which a loaded node answers slowly.
            driver.executor.save_events()
        if pusher is not None:
            pusher.close(final=True)
        if driver is not None and driver.health is not None:
            driver.health.close()
    try:
        layout.coordinator_json(state_dir, job_id).unlink()
    except OSError:
        pass
    log.info("coordinator stopped", job_id=job_id)


if __name__ == "__main__":
    main()
