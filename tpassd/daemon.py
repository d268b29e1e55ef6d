"""The tpassd core: sample every interval, apply the rules, publish.

Threads (each with a stop path; ``stop()`` joins them all):
  sampler     ticks every ``interval_s`` (or at once when an NVML event or a
              drill asks), runs the collectors, applies the rules, publishes
              the sample, one event per changed component and a heartbeat.
              The only user of the PUB socket.
  collector   one worker per collector, so a hung NVML call costs that
              collector an "unknown" for the tick, not the heartbeat.
  nvml-events the NVML event-set watcher (tpassd/collectors/nvml.py).
  control     the authenticated ROUTER endpoint (tpassd/control.py): one
              front thread answers health and status itself and hands
              drill, drain (``_h_drain``) and snapshot/restore
              (tpassd/checkpoint_handlers.py) to a bounded pool of
              workers ("tpassd-op-N"), each request with its own deadline,
              once authenticated and authorized: two "tpassd-owner-N"
              threads ask Slurm for job owners (cached), "tpassd-peers"
              caps the control socket's connections.
  metrics     the Prometheus HTTP endpoint (tpassd/metrics.py): one
              thread for every connection, capped, each time-limited;
              it renders the last sample and the jobs' summaries that
              their coordinators sent (``tpassd.job_metrics``,
              tpassd/job_reports.py) from memory.
  sweep       at start and every ``sweep_interval_s``: removes the images and
              hold files of jobs Slurm no longer lists (tpassd/sweep.py).

Drains (docs/tpassd.md, "Drains"): slurmctld lets only root and SlurmUser
drain a node, so a job's coordinator (the job user) asks the bad node's own
tpassd. tpassd drains only on its own evidence: its health view says the
node is degraded or failed, and slurmctld says the requester owns a job
running on this node. Root and SlurmUser may always ask. Every drain request
leaves one audit line (``tpassd.audit``).
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import zmq

from torchpass import slurm, wire
from torchpass.auth import AuthFailure
from torchpass.checkpoint import criu as criu_mod
from torchpass.checkpoint.admission import Audit
from torchpass.drill_kinds import ROOT_KINDS
from torchpass.errors import ConfigError, RemoteError, TorchpassError
from torchpass.fleet import records as fleet_records
from torchpass.health_state import State
from torchpass.job_metrics import ReportError
from torchpass.job_metrics import parse as parse_job_report
from torchpass.slurm import NodeInfo, SlurmClient
from torchpass.slurm.conf import job_privacy
from tpassd.accounting import JobAccounting
from tpassd.checkpoint_handlers import job_state_dir
from tpassd.checkpoint_handlers import register as register_checkpoint
from tpassd.collectors.base import Collector, CollectorResult, run_collector
from tpassd.collectors.eth_rails import EthRailCollector
from tpassd.collectors.host import HostCollector
from tpassd.collectors.ib_sysfs import IbSysfsCollector
from tpassd.collectors.nvml import NvmlCollector
from tpassd.config import TpassdConfig
from tpassd.control import OWNER, USER, Authenticator, ControlServer, audit_refusal
from tpassd.drills import Drills
from tpassd.job_reports import JobReports
from tpassd.metrics import MetricsServer, NodeView, registry
from tpassd.metrics import render as render_metrics
from tpassd.nvml_provider import select_provider
from tpassd.policy import Policy, load_policy
from tpassd.publisher import Publisher
from tpassd.rules import RuleEngine
from tpassd.sweep import Sweeper

log = structlog.get_logger("tpassd")


class _Worker:
    """Runs one collector on its own daemon thread; the sampler waits with a timeout."""

    def __init__(self, collector: Collector):
        self.collector = collector
        self._cv = threading.Condition()
        self._job: float | None = None
        self._result: CollectorResult | None = None
        self._busy_since: float | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"collector-{collector.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._job is None and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                now = self._job
            res = run_collector(self.collector, now)
            with self._cv:
                self._job = None
                self._busy_since = None
                self._result = res
                self._cv.notify_all()

    def submit(self, now: float) -> bool:
        with self._cv:
            if self._busy_since is not None:
                return False
            self._result = None
            self._job = now
            self._busy_since = time.monotonic()
            self._cv.notify_all()
            return True

    def result(self, deadline: float) -> CollectorResult:
        with self._cv:
            while self._result is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    busy = time.monotonic() - (self._busy_since or time.monotonic())
                    return CollectorResult(self.collector.name, False, busy,
                                           f"still running after {busy:.2f} s (hung?)", {})
                self._cv.wait(left)
            res, self._result = self._result, None
            return res

    def busy_for(self) -> float:
        with self._cv:
            return 0.0 if self._busy_since is None else time.monotonic() - self._busy_since

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=1)


def probe_checkpoint(criu_binary: str | None = None) -> dict[str, str]:
    """Can this node dump and restore ranks? Checked once at start.

    A node without a usable CRIU still reports health (its main job), so this
    is not a health component: a failed one would make the coordinator move
    every rank off a perfectly good node. It is shown by `tpassctl nodes`.
    """
    try:
        c = criu_mod.find_criu(criu_binary)
    except TorchpassError as exc:
        log.error("live migration unavailable on this node", reason=str(exc))
        return {"state": "unavailable", "detail": str(exc)}
    return {"state": "ready", "detail": f"criu {c.version_text} at {c.path}"}


def slurm_job_owner_uids(node: str) -> Callable[[], set[int]]:
    """uids owning a running job on ``node``, asked from Slurm at call time."""

    def owners() -> set[int]:
        try:
            jobs = slurm.client().jobs(states=("RUNNING",))
        except Exception as exc:  # noqa: BLE001 - no Slurm answer: the caller refuses all but root
            log.warning("cannot ask Slurm for job owners; only root may do this", error=str(exc))
            raise RemoteError("unavailable", f"cannot ask Slurm which jobs run on {node} ({exc})") from None
        return {j.user_id for j in jobs if node in j.nodes}

    return owners


def slurm_admin_uids() -> frozenset[int]:
    """root and slurm.conf's SlurmUser: the uids slurmctld lets drain nodes."""
    return job_privacy()[1]


DRAIN_PREFIX = "torchpass: "
DRAIN_REASON_MAX = 200
DRAINABLE = (State.DEGRADED.value, State.FAILED.value)
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


class Tpassd:
    def __init__(
        self,
        cfg: TpassdConfig,
        *,
        policy: Policy | None = None,
        provider: Any = "from-config",
        collectors: list[Collector] | None = None,
        clock: Callable[[], float] = time.time,
        context: zmq.Context | None = None,
        authenticator: Any = None,
        job_owner_uids: Callable[[], set[int]] | None = None,
        slurm_client: SlurmClient | None = None,
        admin_uids: Callable[[], frozenset[int]] = slurm_admin_uids,
        on_tick: Callable[[dict[str, Any]], None] | None = None,
        jobs_private: Callable[[], bool] = lambda: job_privacy()[0],
    ):
        self.cfg = cfg
        self.node = cfg.node
        self.policy = policy if policy is not None else load_policy(cfg.policy)
        self.clock = clock
        self.incarnation = uuid.uuid4().hex[:12]
        self._own_ctx = context is None
        self.ctx = context or zmq.Context()
        if provider == "from-config":
            choice = select_provider(cfg.nvml_provider, fake_gpus=cfg.fake_gpus, fake_nvlinks=cfg.fake_nvlinks,
                                     fake_uuids=cfg.fake_gpu_uuids)
            self.provider = choice.provider
            self.provider_note = choice.why
        else:
            self.provider = provider
            self.provider_note = "provider given by the caller"
        if collectors is None:
            collectors = []
            if self.provider is not None:
                collectors.append(NvmlCollector(self.provider, clock=clock))
            ib = IbSysfsCollector(cfg.sysfs_root, cfg.ib_expected_ports)
            collectors.append(ib)
            eth = EthRailCollector(tuple(r for r in cfg.rails if not r.startswith("ib:")), cfg.procfs_root)
            if eth.interfaces:
                collectors.append(eth)
            missing = [r for r in cfg.rails if r.startswith("ib:") and not ib.has_port(*r[3:].split("/", 1))]
            missing += eth.missing_rails() if eth.interfaces else []
            if missing:
                raise ConfigError(f"rails {', '.join(missing)} named in the config are not on node {cfg.node}")
            # Never state_dir: users write there (jobs/J), so its free space is theirs to steer.
            collectors.append(HostCollector([cfg.snapshot_dir, *cfg.disk_paths]))
        self.collectors = collectors
        self.engine = RuleEngine(self.policy, cfg.rails)
        self.drills = Drills(self.provider, cfg.sysfs_root, self.policy, cfg.drills)
        self._authenticator = authenticator or Authenticator(self.node, cfg.munge_socket)
        self._job_owner_uids = job_owner_uids or slurm_job_owner_uids(self.node)
        self._slurm = slurm_client  # None: slurm.client() at the first drain
        self._admin_uids = admin_uids
        self._admins: frozenset[int] | None = None
        self._on_tick = on_tick
        self._jobs_private = jobs_private
        self.job_reports = JobReports()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._tick_lock = threading.Lock()
        self._started = 0.0
        self._workers: list[_Worker] = []
        self._thread: threading.Thread | None = None
        self._sweep_thread: threading.Thread | None = None
        self.sweeper: Sweeper | None = None
        self.publisher: Publisher | None = None
        self.control: ControlServer | None = None
        self.checkpoint: Any = None  # the checkpoint service, registered by start()
        self.accounting: JobAccounting | None = None  # tpassd.account, registered by start()
        self.metrics = None
        self.last_sample: dict[str, Any] | None = None
        self.ticks = 0
        self.last_tick_end: float | None = None  # time.monotonic() at the end of the last tick (the watchdog's)
        self.xid_counts: dict[tuple[str, int], int] = {}
        self._components: dict[str, dict[str, Any]] = {}
        self._node_state = State.UNKNOWN.value
        self.tick_seconds = 0.0
        spool = None if cfg.fleet_spool == "-" else (cfg.fleet_spool or fleet_records.spool_dir(cfg.state_dir))
        self.fleet_spool = None if spool is None else fleet_records.SpoolAppender(spool, self.node)

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> Tpassd:
        cfg = self.cfg
        self._started = time.monotonic()
        self.publisher = Publisher(self.ctx, cfg.bind_address, cfg.pub_port, self.node, self.incarnation,
                                   cfg.interval_s)
        self.control = ControlServer(self.ctx, cfg.bind_address, cfg.control_port, self._authenticator,
                                     self._job_owner_uids, job_owner=self._slurm_job_owner,
                                     max_jobs_per_uid=cfg.max_jobs_per_uid, max_peers=cfg.control_max_peers,
                                     is_admin=self._slurm_admin)
        # health and status read memory only: answered by the control front thread itself;
        # every other request runs on a worker with its own deadline (tpassd/control.py).
        self.control.register("tpassd.health", self._h_health, USER, inline=True)
        self.control.register("tpassd.status", self._h_status, USER, inline=True)
        self.control.register("tpassd.drill", self._h_drill, OWNER)
        # the job's owner (or root, SlurmUser) is checked before it is queued; the rest per request
        self.control.register("tpassd.drain", self._h_drain, USER, admin_ok=True)
        # The job's "torchpass: ..." part of its AdminComment (tpassd/accounting.py): owner or admins.
        self.accounting = JobAccounting(self.node, job_state_dir(cfg), cfg.accounting_field, self._slurm_client,
                                        self._slurm_admin)
        self.control.register("tpassd.account", self.accounting.handle, USER, admin_ok=True)
        # The checkpoint engine: snapshot / restore (root or the job's owner, checked per job).
        self.checkpoint = register_checkpoint(self.control, cfg, self.node,
                                              restore_fault=self.drills.take_restore_fault,
                                              kill_fault=self.drills.take_kill_fault)
        self._apply_policy_limits()
        self.checkpoint.snapshot_quota_bytes = int(cfg.snapshot_quota_gb * 1e9)
        self.checkpoint.snapshot_max_age_s = cfg.snapshot_max_age_h * 3600.0
        self.checkpoint_capability = probe_checkpoint(cfg.criu_binary or None)
        # The coordinators' job summaries (root or the job's owner, as Slurm says; kept in memory).
        self.control.register("tpassd.job_metrics", self._h_job_metrics, USER, deadline_s=5.0)
        if cfg.metrics_port >= 0:
            # job_id tells every reader of the port which jobs run: left out where Slurm's
            # PrivateData hides jobs (slurm.conf, read once at start; docs/tpassd.md, "Job metrics").
            reg = registry(self._node_view, self.job_reports.current, job_labels=not self._jobs_private())
            self.metrics = MetricsServer(cfg.metrics_address or cfg.bind_address, cfg.metrics_port,
                                         lambda: render_metrics(reg))
            self.metrics.start()
        for c in self.collectors:
            c.start(self._wake.set)
        self._workers = [_Worker(c) for c in self.collectors]
        self.control.start()
        self._thread = threading.Thread(target=self._loop, name="tpassd-sampler", daemon=True)
        self._thread.start()
        self.sweeper = Sweeper(cfg.snapshot_dir, job_state_dir(cfg), self._slurm_client,
                               busy_jobs=self.control.busy_jobs,
                               job_dir_retention_s=cfg.job_dir_retention_h * 3600.0)
        if cfg.sweep_interval_s > 0:
            self._sweep_thread = threading.Thread(target=self._sweep_loop, name="tpassd-sweep", daemon=True)
            self._sweep_thread.start()
        if cfg.ports_file:
            tmp = Path(f"{cfg.ports_file}.tmp")
            tmp.write_text(json.dumps(self.ports()))
            os.replace(tmp, cfg.ports_file)
        log.info("tpassd started", node=self.node, incarnation=self.incarnation, gpu=self.provider_note,
                 **self.ports())
        return self

    def _apply_policy_limits(self) -> None:
        # A whole-job snapshot must leave the free space this tpassd's own health rule wants.
        self.checkpoint.keep_free_bytes = int(self.policy.host.disk_free_gb_degraded * 1e9)

    def set_policy(self, policy: Policy) -> None:
        """Apply a new health policy (SIGHUP) from the next sample on. Each component's history
        (counter windows, Xids, slowdowns) is kept: a rate rule judges the new thresholds against
        the errors already seen, as if the policy had always been the new one."""
        with self._tick_lock:
            self.policy = policy
            self.engine.policy = policy
            self.drills.policy = policy
            if self.checkpoint is not None:
                self._apply_policy_limits()

    def ports(self) -> dict[str, int]:
        return {"pub_port": self.publisher.port if self.publisher else -1,
                "control_port": self.control.port if self.control else -1,
                "metrics_port": self.metrics.port if self.metrics else -1}

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self._sweep_thread is not None:
            # It may be in a Slurm call (15 s timeout): a daemon thread, not waited for long.
            self._sweep_thread.join(timeout=2)
            self._sweep_thread = None
        if self.control is not None:
            self.control.close()
        if self.metrics is not None:
            self.metrics.close()
        for c in self.collectors:
            c.close()
        for w in self._workers:
            w.stop()
        if self.publisher is not None:
            self.publisher.close()
        if self.provider is not None:
            self.provider.shutdown()
        if self._own_ctx:
            self.ctx.term()
        log.info("tpassd stopped", node=self.node)

    def __enter__(self) -> Tpassd:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def wake(self) -> None:
        self._wake.set()

    # -- the sweep -------------------------------------------------------------
    def _sweep_loop(self) -> None:
        while not self._stop.is_set():
            try:
                res = self.sweeper.sweep()
                if res.removed or res.aborted or res.kept_busy or res.failed:
                    log.info("sweep done", **res.as_dict())
            except Exception:
                log.exception("sweep failed")
            try:
                self.checkpoint.expire_snapshots()
            except Exception:
                log.exception("snapshot expiry failed")
            # +-10 %: the tpassds of a cluster started together do not all ask slurmctld at once
            self._stop.wait(self.cfg.sweep_interval_s * random.uniform(0.9, 1.1))

    # -- the sampler -----------------------------------------------------------
    def _loop(self) -> None:
        interval = self.cfg.interval_s
        next_tick = time.monotonic()
        while not self._stop.is_set():
            woken = self._wake.wait(max(0.0, next_tick - time.monotonic()))
            if self._stop.is_set():
                break
            self._wake.clear()
            try:
                self.tick(heartbeat=not woken or time.monotonic() >= next_tick)
            except Exception:
                log.exception("sampling tick failed")
            if time.monotonic() >= next_tick:
                next_tick += interval
                if next_tick < time.monotonic():  # we fell behind: skip, do not burst
                    next_tick = time.monotonic() + interval

    def tick(self, heartbeat: bool = True) -> dict[str, Any]:
        """One sample: collect, evaluate, publish. Runs on the sampler thread."""
        with self._tick_lock:
            t0 = time.perf_counter()
            now = self.clock()
            deadline = time.monotonic() + self.cfg.collector_timeout_s
            submitted = [(w, w.submit(now)) for w in self._workers]
            results = []
            for w, ok in submitted:
                if ok:
                    results.append(w.result(deadline))
                else:
                    results.append(CollectorResult(w.collector.name, False, w.busy_for(),
                                                   f"previous run still going after {w.busy_for():.1f} s", {}))
            health = self.engine.evaluate(now, results)
            comps: dict[str, dict[str, Any]] = {}
            readings = {c: r for res in results for c, r in res.components.items()}
            for comp, verdict in sorted(health.components.items()):
                entry = verdict.as_dict()
                r = readings.get(comp)
                entry["metrics"] = dict(r.metrics) if r is not None else {}
                comps[comp] = entry
                if r is not None:
                    for ev in r.events:
                        if ev.get("kind") == "xid":
                            key = (comp, int(ev["xid"]))
                            self.xid_counts[key] = self.xid_counts.get(key, 0) + 1
            sample = {
                "node": self.node, "incarnation": self.incarnation, "t": now,
                "interval_s": self.cfg.interval_s, "state": health.state.value,
                "reasons": list(health.reasons), "components": comps,
                "collectors": {r.name: {"ok": r.ok, "duration_s": round(r.duration_s, 6), "error": r.error}
                               for r in results},
            }
            pub = self.publisher
            if pub is not None:
                pub.sample(sample)
                self._publish_changes(now, health, comps)
                if heartbeat:
                    pub.heartbeat(now, time.monotonic() - self._started)
            self.last_sample = sample
            self.ticks += 1
            self.last_tick_end = time.monotonic()
            self.tick_seconds = time.perf_counter() - t0
            if self._on_tick is not None:
                self._on_tick(sample)
            return sample

    def _publish_changes(self, now: float, health: Any, comps: dict[str, dict[str, Any]]) -> None:
        pub = self.publisher
        brief = {c: {"state": v["state"], "reasons": v["reasons"]} for c, v in comps.items()}
        old = self._components
        node_state = health.state.value
        changed = [c for c in sorted(set(brief) | set(old))
                   if brief.get(c) != old.get(c)]
        for c in changed:
            new = brief.get(c, {"state": State.UNKNOWN.value, "reasons": [f"{c}: no longer reported"]})
            prev = old.get(c, {"state": State.UNKNOWN.value})["state"]
            if c not in brief:
                continue  # a vanished component: covered by the node event and the snapshot
            pub.event(now, c, new["state"], prev, new["reasons"], node_state, list(health.reasons), brief)
            if new["state"] != prev:
                log.info("component state changed", component=c, state=new["state"], previous=prev,
                         reasons=new["reasons"])
        if node_state != self._node_state or changed:
            if node_state != self._node_state:
                log.info("node state changed", state=node_state, previous=self._node_state,
                         reasons=list(health.reasons))
                self._spool_change(now, node_state, list(health.reasons))
            pub.event(now, "node", node_state, self._node_state, list(health.reasons), node_state,
                      list(health.reasons), brief)
        self._components = brief
        self._node_state = node_state

    def _spool_change(self, now: float, state: str, reasons: list[str]) -> None:
        """The node's state change, for the fleet history. Never stops a tick: a spool that
        cannot be written (not root's, full) is logged."""
        if self.fleet_spool is None:
            return
        try:
            rec = fleet_records.record("health.change", self.node, now, state=state, previous=self._node_state,
                                       reasons=reasons[:20])
            if not self.fleet_spool.append(rec):
                log.warning("fleet spool full: health change not recorded", dropped=self.fleet_spool.dropped)
        except (OSError, fleet_records.FleetError) as exc:
            log.warning("fleet spool: health change not recorded", error=str(exc))

    # -- control handlers ------------------------------------------------------
    def _h_health(self, msg: wire.Message, ident: Any) -> dict[str, Any]:
        driver = next((c.driver_version for c in self.collectors if getattr(c, "driver_version", None)), None)
        return {**self.publisher.snapshot(), "checkpoint": self.checkpoint_capability,
                **({"gpu_driver": driver} if driver else {})}  # the node's NVIDIA driver (NVML), when it has GPUs

    def _node_view(self) -> NodeView:
        driver = next((c.driver_version for c in self.collectors if getattr(c, "driver_version", None)), None)
        return NodeView(self.last_sample, self.counters(), dict(self.xid_counts),
                        {"node": self.node, "gpu_driver": driver or ""})

    def _h_job_metrics(self, msg: wire.Message, ident: Any) -> dict[str, Any]:
        """Keep the job's summary for /metrics (the control server checked that the requester is
        root or the job's owner before queueing it)."""
        try:
            report = parse_job_report(msg.body)
        except ReportError as exc:
            raise RemoteError("bad_request", f"tpassd.job_metrics: {exc}") from None
        return {"node": self.node, "jobs": self.job_reports.put(report)}

    def counters(self) -> dict[str, dict[str, int]]:
        out = {"control": dict(self.control.counters) if self.control else {}}
        if self.publisher:
            out["published"] = {k.split(".")[1]: v for k, v in self.publisher.sent.items()}
        return out

    def _h_status(self, msg: wire.Message, ident: Any) -> dict[str, Any]:
        snap = self.publisher.snapshot()
        s = self.last_sample or {}
        snap.update({
            "uptime_s": round(time.monotonic() - self._started, 3),
            "ticks": self.ticks,
            "last_tick_s": round(self.tick_seconds, 6),
            "collectors": s.get("collectors", {}),
            "gpu_provider": self.provider_note,
            "drills": self.cfg.drills,
            "checkpoint": self.checkpoint_capability,
            "counters": self.counters(),
            "ports": self.ports(),
        })
        return snap

    def _h_drill(self, msg: wire.Message, ident: Any) -> dict[str, Any]:
        b = msg.body
        if ident.uid != 0:
            # A job owner may drill health readings, not damage a (maybe another user's) snapshot,
            # and only on a node where no other user's job runs (a drill moves every job's ranks).
            others = sorted(self._job_owner_uids() - {ident.uid})
            why = (f"drill {b['kind']} needs root; uid {ident.uid} is not" if b["kind"] in ROOT_KINDS else
                   f"drill {b['kind']}: jobs of other users (uids {others}) run on {self.node}; only root may"
                   if others else None)
            if why:
                log.warning("forbidden request refused", type=msg.type, kind=b["kind"], uid=ident.uid, gid=ident.gid)
                audit_refusal(ident, msg, "forbidden", why, self.node)
                raise AuthFailure("forbidden", why)
        res = self.drills.apply(b["kind"], b.get("gpu"), b.get("port"), b.get("count"))
        if b["kind"] == "clear":
            with self._tick_lock:
                self.engine.forget(res.components)
        log.warning("fault drill applied", kind=b["kind"], uid=ident.uid, what=res.description)
        t = self.clock()
        # Drills on polled sources take effect at the next regular sample, as a
        # real fault would; only NVML events wake the sampler early.
        return {"node": self.node, "kind": b["kind"], "applied": res.description, "t": t,
                "components": res.components}

    def _h_drain(self, msg: wire.Message, ident: Any) -> dict[str, Any]:
        """Drain this node in Slurm with the coordinator's ``torchpass: ...`` reason, if allowed."""
        b = msg.body
        lost = b.get("node")
        if lost is not None and lost != self.node:
            return self._drain_lost(b, lost, ident)
        with Audit(ident, "drain", b) as act:
            # health first, so that a refused drain's audit line names the state it was refused on
            act.fields.update(node=self.node, reason=b.get("reason"),
                              health=(self.last_sample or {}).get("state", State.UNKNOWN.value))
            reason, health = self._drain_allowed(b, ident)
            try:
                self._slurm_client().drain(self.node, reason)
            except TorchpassError as exc:
                raise RemoteError("failed", f"scontrol could not drain {self.node}: {exc}") from None
            log.warning("node drained", node=self.node, reason=reason, uid=ident.uid, job_id=b["job_id"])
            return {"node": self.node, "reason": reason, "health": health}

    def _drain_lost(self, b: dict[str, Any], lost: str, ident: Any) -> dict[str, Any]:
        """Drain ``lost``, a node of the requester's job whose own tpassd died with it, on
        slurmctld's word that it no longer hears it (docs/tpassd.md, "Drains")."""
        with Audit(ident, "drain", b) as act:
            act.fields.update(node=lost, witness=self.node, reason=b.get("reason"), health=State.UNKNOWN.value)
            if not NODE_NAME.fullmatch(lost):  # one node: scontrol would expand "node[1-9]" or "a,b"
                raise RemoteError("bad_request", f"tpassd.drain: node must be one node's name, got {lost!r}")
            reason = self._drain_request(b)
            view = self._lost_node_view(b["job_id"], lost, ident)
            act.fields["slurm_state"] = "+".join(view.state) if view else ""
            try:
                self._slurm_client().drain(lost, reason)
            except TorchpassError as exc:
                raise RemoteError("failed", f"scontrol could not drain {lost}: {exc}") from None
            log.warning("lost node drained", node=lost, witness=self.node, reason=reason, uid=ident.uid,
                        job_id=b["job_id"])
            return {"node": lost, "reason": reason, "health": State.UNKNOWN.value, "witness": self.node,
                    "slurm_state": act.fields["slurm_state"]}

    def _lost_node_view(self, job_id: int, lost: str, ident: Any) -> NodeInfo | None:
        """slurmctld's record of ``lost`` once the requester may have it drained (None for root and
        SlurmUser, who may drain any node); AuthFailure / RemoteError otherwise."""
        if self._slurm_admin(ident.uid):
            return None
        try:
            job = self._slurm_client().job(job_id)
            view = next((n for n in self._slurm_client().nodes() if n.name == lost), None)
        except TorchpassError as exc:
            raise RemoteError("unavailable", f"cannot ask Slurm about job {job_id} and {lost} ({exc})") from None
        if job is None or job.user_id != ident.uid:
            raise AuthFailure("forbidden", f"uid {ident.uid} does not own job {job_id}")
        if job.state != "RUNNING" or self.node not in job.nodes or lost not in job.nodes:
            raise AuthFailure("forbidden", f"job {job_id} does not run on both {self.node} and {lost}")
        if view is None or not view.not_answering:
            said = "+".join(view.state) if view else "nothing"
            raise RemoteError("conflict", f"slurmctld still hears {lost} ({said}); only root or SlurmUser may "
                                          "drain a node that slurmctld does not report NOT_RESPONDING or DOWN")
        return view

    def _slurm_admin(self, uid: int) -> bool:
        """Root or SlurmUser: may drain any node, as with scontrol."""
        if self._admins is None:
            self._admins = frozenset(self._admin_uids())
        return uid in self._admins

    @staticmethod
    def _drain_request(b: dict[str, Any]) -> str:
        """The reason of a well-formed drain request (bad_request otherwise)."""
        if isinstance(b["job_id"], bool) or b["job_id"] < 0:
            raise RemoteError("bad_request", "tpassd.drain: job_id must be a non-negative integer")
        reason = b["reason"]
        if (not reason.startswith(DRAIN_PREFIX) or len(reason) > DRAIN_REASON_MAX
                or not reason.isprintable()):
            raise RemoteError("bad_request", f"tpassd.drain: reason must be one printable line starting with "
                                             f"{DRAIN_PREFIX!r}, at most {DRAIN_REASON_MAX} characters")
        return reason

    def _slurm_job_owner(self, job_id: int) -> int | None:
        """The owner slurmctld records for the job (None: it does not know the job)."""
        info = self._slurm_client().job(job_id)
        return None if info is None else info.user_id

    def _slurm_client(self) -> SlurmClient:
        if self._slurm is None:
            self._slurm = slurm.client()
        return self._slurm

    def _drain_allowed(self, b: dict[str, Any], ident: Any) -> tuple[str, str]:
        """(the reason, tpassd's node state) of an allowed drain; AuthFailure / RemoteError otherwise."""
        job_id = b["job_id"]
        reason = self._drain_request(b)
        health = (self.last_sample or {}).get("state", State.UNKNOWN.value)
        if self._slurm_admin(ident.uid):
            return reason, health  # root and SlurmUser may drain any node (as with scontrol)
        try:
            job = self._slurm_client().job(job_id)
        except TorchpassError as exc:
            raise RemoteError("unavailable", f"cannot ask Slurm about job {job_id} ({exc})") from None
        if job is None or job.user_id != ident.uid:
            raise AuthFailure("forbidden", f"uid {ident.uid} does not own job {job_id}")
        if job.state != "RUNNING" or self.node not in job.nodes:
            raise AuthFailure("forbidden", f"job {job_id} does not run on {self.node}")
        if health not in DRAINABLE:
            raise RemoteError("conflict", f"{self.node} is {health} in tpassd's health view; only root or "
                                          "SlurmUser may drain a node that is not degraded or failed")
        if health == State.FAILED.value:
            return reason, health  # tpassd's own evidence: the node is lost to every job on it anyway
        # A degraded node still serves the jobs on it: one user's word may not take it from another's.
        try:
            others = sorted(self._job_owner_uids() - {ident.uid})
        except TorchpassError as exc:
            raise RemoteError("unavailable", f"cannot ask Slurm which jobs run on {self.node} ({exc})") from None
        if others:
            raise AuthFailure("forbidden", f"jobs of other users (uids {others}) run on {self.node}, which is "
                                           f"{health}, not failed; only root or SlurmUser may drain it")
        return reason, health


__all__ = ["Tpassd", "RemoteError"]
