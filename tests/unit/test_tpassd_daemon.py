"""An in-process tpassd (fake NVML, fixture IB tree, private munged, a fake
Slurm) seen through its real sockets: drills, drains, auth, subscriber,
metrics, shutdown."""

import threading
import time
import urllib.request

import pytest
import zmq
from structlog.testing import capture_logs

from support.fake_slurm import FakeSlurm
from torchpass import auth, wire, zmqio
from torchpass.errors import RemoteError
from torchpass.health import HealthSubscriber, State
from tpassd.collectors.base import Collector
from tpassd.daemon import Tpassd
from tpassd.testing import call, credential_as, fake_node_config, wait_for

SLURM_USER = 64030


@pytest.fixture
def node(tmp_path, munge):
    owners = set()
    fake = FakeSlurm()
    d = Tpassd(fake_node_config(tmp_path, "node1", munge.socket, interval_s=0.2, collector_timeout_s=0.15),
               job_owner_uids=lambda: owners, slurm_client=fake, admin_uids=lambda: frozenset({0, SLURM_USER}))
    d.job_owners = owners
    d.slurm = fake
    d.start()
    p = d.ports()
    d.ctl = f"tcp://127.0.0.1:{p['control_port']}"
    d.pub = f"tcp://127.0.0.1:{p['pub_port']}"
    yield d
    d.stop()


def subscriber(d, munge, **kw):
    def snap(node, ep):
        return call(ep, node, "tpassd.health", munge_socket=munge.socket)
    return HealthSubscriber({d.node: (d.pub, d.ctl)}, snapshot=snap, **kw).start()


DRILLS = [
    ("xid79", {"gpu": 1}, State.FAILED, "Xid 79"),
    ("xid48", {"gpu": 2}, State.FAILED, "Xid 48"),
    ("ecc-sbe-storm", {"gpu": 3}, State.DEGRADED, "SBE ECC storm"),
    ("row-remap-pending", {"gpu": 4}, State.DEGRADED, "row remap pending"),
    ("nvlink-crc", {"gpu": 5}, State.DEGRADED, "NVLink CRC errors"),
    ("nvml-error", {"gpu": 6}, State.UNKNOWN, "nvlink check failed"),
    ("ib-link-down", {"port": "mlx5_1/1"}, State.FAILED, "ib:mlx5_1/1: link state 1: DOWN"),
    ("ib-link-flap", {"port": "2"}, State.DEGRADED, "ib:mlx5_2/1: link flapping"),
]


def test_health_names_the_nodes_nvidia_driver_for_the_coordinators_spare_check(node, munge):
    # the fake NVML provider's driver; a CUDA checkpoint is restored by the same driver only
    assert wait_for(lambda: call(node.ctl, "node1", "tpassd.health", munge_socket=munge.socket)
                    .get("gpu_driver") == "fake-0.0")


def test_every_drill_reaches_a_subscriber_and_clear_heals(node, munge):
    sub = subscriber(node, munge)
    try:
        assert wait_for(lambda: sub.state("node1") is State.HEALTHY)
        for kind, args, state, reason in DRILLS:
            res = call(node.ctl, "node1", "tpassd.drill", {"kind": kind, **args}, munge.socket)
            assert res["kind"] == kind
            assert wait_for(lambda: sub.state("node1") is state), (kind, sub.nodes()["node1"])
            assert any(reason in r for r in sub.nodes()["node1"]["reasons"]), sub.nodes()["node1"]["reasons"]
            call(node.ctl, "node1", "tpassd.drill", {"kind": "clear"}, munge.socket)
            assert wait_for(lambda: sub.state("node1") is State.HEALTHY), (kind, sub.nodes()["node1"])
        assert sub.counters["gaps"] == 0 and sub.counters["malformed"] == 0
    finally:
        sub.close()


def test_unauthenticated_and_forged_requests_are_refused_and_logged(node, munge):
    with capture_logs() as logs:
        for cred in (None, "MUNGE:forged:", auth.make_credential(b"wrong payload", munge.socket)):
            with pytest.raises(RemoteError) as ei:
                zmqio.request(node.ctl, "tpassd.status", {}, auth=cred, timeout_s=2, retries=0)
            assert ei.value.code == "unauthenticated"
    assert sum(1 for e in logs if e["event"] == "unauthenticated request refused") == 3
    assert node.control.counters["auth_failed"] == 3
    # a replayed (captured) credential is refused too
    cred = auth.make_credential(auth.request_digest("tpassd.status", {}, "node1"), munge.socket)
    zmqio.request(node.ctl, "tpassd.status", {}, auth=cred, timeout_s=2, retries=0)
    with pytest.raises(RemoteError, match="replayed"):
        zmqio.request(node.ctl, "tpassd.status", {}, auth=cred, timeout_s=2, retries=0)


def test_drills_need_root_or_a_job_owner(node, munge):
    body = {"kind": "xid48", "gpu": 0}

    def as_nobody(type_, b):
        return credential_as(65534, 65534, auth.request_digest(type_, b, "node1"), munge.socket)

    # read-only requests: any authenticated user
    assert zmqio.request(node.ctl, "tpassd.health", {}, auth=as_nobody("tpassd.health", {}))["node"] == "node1"
    with capture_logs() as logs:
        with pytest.raises(RemoteError) as ei:
            zmqio.request(node.ctl, "tpassd.drill", body, auth=as_nobody("tpassd.drill", body), retries=0)
    assert ei.value.code == "forbidden" and "uid 65534" in ei.value.remote_message
    assert any(e["event"] == "forbidden request refused" for e in logs)
    node.job_owners.add(65534)
    assert zmqio.request(node.ctl, "tpassd.drill", body, auth=as_nobody("tpassd.drill", body))["kind"] == "xid48"


def test_restore_fail_drill_is_root_only_one_shot_and_cleared(node, munge):
    body = {"kind": "restore-fail"}

    def as_nobody(type_, b):
        return credential_as(65534, 65534, auth.request_digest(type_, b, "node1"), munge.socket)

    node.job_owners.add(65534)  # a job owner may drill health, not corrupt a snapshot
    with pytest.raises(RemoteError) as ei:
        zmqio.request(node.ctl, "tpassd.drill", body, auth=as_nobody("tpassd.drill", body), retries=0)
    assert ei.value.code == "forbidden" and "needs root" in ei.value.remote_message
    assert not node.drills.restore_fail_armed
    res = call(node.ctl, "node1", "tpassd.drill", body, munge.socket)
    assert res["kind"] == "restore-fail" and "armed" in res["applied"]
    assert node.checkpoint.restore_fault() is True   # the checkpoint service takes it ...
    assert node.checkpoint.restore_fault() is False  # ... once
    call(node.ctl, "node1", "tpassd.drill", body, munge.socket)
    cleared = call(node.ctl, "node1", "tpassd.drill", {"kind": "clear"}, munge.socket)
    assert "restore-fail disarmed" in cleared["applied"]
    assert node.checkpoint.restore_fault() is False


def as_uid(uid, type_, b, munge):
    return credential_as(uid, uid, auth.request_digest(type_, b, "node1"), munge.socket)


def test_a_user_may_drill_only_a_node_no_other_user_runs_jobs_on(node, munge):
    body = {"kind": "ecc-sbe-storm", "gpu": 0}
    node.job_owners.update({65534, 1002})  # a shared node: a drill would move user 1002's ranks too
    with capture_logs() as logs, pytest.raises(RemoteError) as ei:
        zmqio.request(node.ctl, "tpassd.drill", body, auth=as_uid(65534, "tpassd.drill", body, munge), retries=0)
    audit = [e for e in logs if e["event"] == "privileged action"]  # every refusal: one audit line
    assert [(a["requester_uid"], a["action"], a["outcome"]) for a in audit] == [(65534, "drill", "forbidden")]
    assert ei.value.code == "forbidden" and "other users (uids [1002])" in ei.value.remote_message
    assert call(node.ctl, "node1", "tpassd.drill", body, munge.socket)["kind"] == body["kind"]  # root may


def drain(node, uid, job_id, munge, reason="torchpass: gpu0: SBE ECC storm", lost=None):
    body = {"job_id": job_id, "reason": reason, **({"node": lost} if lost is not None else {})}
    return zmqio.request(node.ctl, "tpassd.drain", body, auth=as_uid(uid, "tpassd.drain", body, munge),
                         timeout_s=5, retries=0)


def drain_refused(node, uid, job_id, munge, **kw) -> RemoteError:
    with pytest.raises(RemoteError) as ei:
        drain(node, uid, job_id, munge, **kw)
    return ei.value


def test_a_job_owner_drains_only_a_degraded_node_running_their_job(node, munge):
    node.slurm.run_job(7, user="u1001", uid=1001, nodes=("node1", "node2"))
    node.slurm.run_job(8, user="u1002", uid=1002, nodes=("node2",))
    assert wait_for(lambda: (node.last_sample or {}).get("state") == "healthy")
    with capture_logs() as logs:
        e = drain_refused(node, 1001, 7, munge)  # healthy in tpassd's own view: the owner's word is not enough
        assert e.code == "conflict" and "node1 is healthy" in e.remote_message
        assert node.slurm.drained == []
        call(node.ctl, "node1", "tpassd.drill", {"kind": "ecc-sbe-storm", "gpu": 0}, munge.socket)
        assert wait_for(lambda: node.last_sample["state"] == "degraded")
        e = drain_refused(node, 1002, 7, munge)  # another user's job
        assert e.code == "forbidden" and "uid 1002 does not own job 7" in e.remote_message
        e = drain_refused(node, 1002, 8, munge)  # their own job, elsewhere
        assert e.code == "forbidden" and "job 8 does not run on node1" in e.remote_message
        e = drain_refused(node, 1002, 9, munge)  # no such job
        assert e.code == "forbidden"
        for bad in ("operator request", "torchpass: two\nlines", "torchpass: " + "x" * 200):
            assert drain_refused(node, 1001, 7, munge, reason=bad).code == "bad_request"
        assert node.slurm.drained == []
        res = drain(node, 1001, 7, munge)
    assert res == {"node": "node1", "reason": "torchpass: gpu0: SBE ECC storm", "health": "degraded"}
    assert node.slurm.drained == [("node1", "torchpass: gpu0: SBE ECC storm")]
    audit = [e for e in logs if e["event"] == "privileged action" and e["action"] == "drain"]
    assert [(a["requester_uid"], a["job_id"], a["outcome"]) for a in audit] == [
        (1001, 7, "conflict"), (1002, 7, "forbidden"), (1002, 8, "forbidden"), (1002, 9, "forbidden"),
        (1001, 7, "bad_request"), (1001, 7, "bad_request"), (1001, 7, "bad_request"), (1001, 7, "ok")]
    assert all(a["node"] == "node1" for a in audit) and audit[-1]["reason"] == "torchpass: gpu0: SBE ECC storm"


def test_root_and_slurm_user_may_drain_a_healthy_node(node, munge):
    assert wait_for(lambda: (node.last_sample or {}).get("state") == "healthy")
    assert call(node.ctl, "node1", "tpassd.drain", {"job_id": 3, "reason": "torchpass: operator request"},
                munge.socket)["health"] == "healthy"
    assert drain(node, SLURM_USER, 3, munge, reason="torchpass: operator request")["node"] == "node1"
    assert node.slurm.drained == [("node1", "torchpass: operator request")] * 2


def test_a_job_owner_drains_a_node_of_their_job_that_slurmctld_no_longer_hears(node, munge):
    """A node lost outright has no tpassd: another node of the job witnesses for it, on
    slurmctld's word (the job's owner, the job on both nodes, the lost node not answering)."""
    node.slurm.run_job(7, user="u1001", uid=1001, nodes=("node1", "node2"))
    node.slurm.run_job(8, user="u1002", uid=1002, nodes=("node2", "node3"))
    for name, state in (("node1", "MIXED"), ("node2", "MIXED"), ("node3", "IDLE")):
        node.slurm.set_node(name, state)
    reason = "torchpass: node2 failed outright (tpassd silent); no clean dump possible"
    with capture_logs() as logs:
        e = drain_refused(node, 1001, 7, munge, reason=reason, lost="node2")  # slurmctld still hears it
        assert e.code == "conflict" and "slurmctld still hears node2 (MIXED)" in e.remote_message
        node.slurm.set_node("node2", "MIXED", "NOT_RESPONDING")
        e = drain_refused(node, 1002, 7, munge, reason=reason, lost="node2")  # not their job
        assert e.code == "forbidden" and "uid 1002 does not own job 7" in e.remote_message
        e = drain_refused(node, 1002, 8, munge, reason=reason, lost="node2")  # their job, not on this witness
        assert e.code == "forbidden" and "does not run on both node1 and node2" in e.remote_message
        node.slurm.set_node("node3", "IDLE", "NOT_RESPONDING")
        e = drain_refused(node, 1001, 7, munge, reason=reason, lost="node3")  # not in the job
        assert e.code == "forbidden" and "does not run on both node1 and node3" in e.remote_message
        for bad in ("node[2-3]", "node2,node3", "-x"):
            assert drain_refused(node, 1001, 7, munge, reason=reason, lost=bad).code == "bad_request"
        assert drain_refused(node, 1001, 7, munge, reason="node2 is gone", lost="node2").code == "bad_request"
        assert node.slurm.drained == []
        res = drain(node, 1001, 7, munge, reason=reason, lost="node2")
    assert res == {"node": "node2", "reason": reason, "health": "unknown", "witness": "node1",
                   "slurm_state": "MIXED+NOT_RESPONDING"}
    assert node.slurm.drained == [("node2", reason)]
    audit = [e for e in logs if e["event"] == "privileged action" and e["action"] == "drain"]
    assert [(a["requester_uid"], a["node"], a["outcome"]) for a in audit][-1] == (1001, "node2", "ok")
    assert all(a["witness"] == "node1" for a in audit) and len(audit) == 9
    # root and SlurmUser need no witness evidence, as for any drain
    node.slurm.set_node("node3", "IDLE")
    assert drain(node, SLURM_USER, 99, munge, reason=reason, lost="node3")["node"] == "node3"
    # naming this node itself is an ordinary drain of it (its own health view decides)
    e = drain_refused(node, 1001, 7, munge, reason=reason, lost="node1")
    assert e.code == "conflict" and "node1 is healthy" in e.remote_message


def test_the_executor_drains_through_the_nodes_tpassd(node, munge, tmp_path):
    """The coordinator's Drain goes to the node's tpassd (here as root), never to Slurm itself."""
    import queue

    from torchpass.coordinator import contract as ct
    from torchpass.coordinator.executor import Executor
    from torchpass.coordinator.executor_ports import TpassdClient
    from torchpass.coordinator.job_record import JobState
    from torchpass.coordinator.policy import CoordinatorPolicy

    posted = queue.Queue()
    tp = TpassdClient(lambda n: "127.0.0.1", port=node.control.port, munge_socket=munge.socket)
    ex = Executor(JobState(job_id=42, spares=1), state_dir=tmp_path, post=posted.put, policy=CoordinatorPolicy(),
                  tpassd=tp, slurm=None, prelaunch_restore=False)
    try:
        ex.perform(ct.Drain("m1", "node1", "torchpass: rank 2 stalled"), None)
        assert posted.get(timeout=10) == ct.Drained("m1", "node1")
        assert node.slurm.drained == [("node1", "torchpass: rank 2 stalled")]
    finally:
        ex.close()


def test_drill_errors(node, munge):
    for body, code in (({"kind": "meteor"}, "not_found"), ({"kind": "xid79", "gpu": 99}, "not_found"),
                       ({"kind": "ib-link-down", "port": "mlx9_9/1"}, "not_found")):
        with pytest.raises(RemoteError) as ei:
            call(node.ctl, "node1", "tpassd.drill", body, munge.socket)
        assert ei.value.code == code


def test_status_and_metrics(node, munge):
    assert wait_for(lambda: node.ticks >= 2)
    st = call(node.ctl, "node1", "tpassd.status", munge_socket=munge.socket)
    assert st["state"] == "healthy" and set(st["collectors"]) == {"nvml", "ib_sysfs", "host"}
    assert all(c["ok"] for c in st["collectors"].values())
    text = urllib.request.urlopen(f"http://127.0.0.1:{node.ports()['metrics_port']}/metrics", timeout=5).read().decode()
    for family in ("tpassd_node_health", "tpassd_component_health", "tpassd_gpu_ecc_errors_total",
                   "tpassd_gpu_nvlink_errors_total", "tpassd_gpu_temperature_celsius",
                   "tpassd_infiniband_port_state_id", "tpassd_infiniband_symbol_error_total",
                   "tpassd_host_memory_available_bytes", "tpassd_scrape_collector_success",
                   "tpassd_control_auth_failed_total", "tpassd_build_info", "tpassd_node_info"):
        assert f"# HELP {family} " in text and f"# TYPE {family} " in text, family
    assert 'tpassd_node_health{state="healthy"} 1.0' in text
    assert 'tpassd_node_info{gpu_driver="fake-0.0",node="node1"} 1.0' in text
    assert ('tpassd_gpu_ecc_errors_total{counter="volatile",gpu="0",type="sbe",'
            'uuid="GPU-fake-0000-0000-0000-0000-000000000000"} 0.0' in text)


class Hang(Collector):
    name = "hang"
    kind = "host"

    def __init__(self):
        self.release = threading.Event()

    def collect(self, now):
        self.release.wait(10)
        return {}


def test_hung_collector_is_unknown_and_heartbeats_continue(tmp_path, munge):
    hang = Hang()
    cfg = fake_node_config(tmp_path, "node1", munge.socket, interval_s=0.2, collector_timeout_s=0.1, metrics_port=-1)
    d = Tpassd(cfg, collectors=[hang]).start()
    try:
        p = d.ports()
        d.ctl, d.pub = f"tcp://127.0.0.1:{p['control_port']}", f"tcp://127.0.0.1:{p['pub_port']}"
        sub = subscriber(d, munge)
        try:
            assert wait_for(lambda: sub.nodes()["node1"]["last_heartbeat_age_s"] is not None)
            time.sleep(1.0)
            v = sub.nodes()["node1"]
            assert v["state"] == "unknown" and v["last_heartbeat_age_s"] < 0.6
            assert "collector hang failed" in v["reasons"][0]
        finally:
            sub.close()
    finally:
        hang.release.set()
        d.stop()


def test_stop_leaves_no_threads(tmp_path, munge):
    before = {t.ident for t in threading.enumerate()}
    d = Tpassd(fake_node_config(tmp_path, "node1", munge.socket, interval_s=0.1, collector_timeout_s=0.1)).start()
    time.sleep(0.3)
    d.stop()
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert left == []


# --- the subscriber on its own, with crafted publications and an injected clock --------

class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def pub(type_, seq, body, sender="n1"):
    return [type_.encode(), wire.encode(type_, body, seq=seq, sender=sender)]


def hb(seq, last_event_seq, inc="a", state="healthy"):
    return pub("tpassd.heartbeat", seq, {"node": "n1", "incarnation": inc, "t": 0.0, "interval_s": 1.0,
                                         "state": state, "last_event_seq": last_event_seq, "uptime_s": 1.0})


def ev(seq, prev, comp, state, inc="a"):
    return pub("tpassd.event", seq, {"node": "n1", "incarnation": inc, "t": 0.0, "component": comp, "state": state,
                                     "previous": "healthy", "reasons": [f"{comp}: bad"], "node_state": state,
                                     "prev_event_seq": prev})


def snapshot_result(seq, last, inc="a", state="healthy"):
    return {"node": "n1", "incarnation": inc, "seq": seq, "last_event_seq": last, "interval_s": 1.0,
            "state": state, "reasons": [], "components": {"gpu0": {"state": state, "reasons": []}}}


def test_subscriber_expiry_gap_and_restart():
    clock = Clock()
    snaps = []

    def snap(node, ep):
        snaps.append(node)
        return snapshot_result(5, 4)

    s = HealthSubscriber({"n1": ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")}, snapshot=snap, clock=clock,
                         missed_heartbeats=3)
    try:
        assert s.state("n1") is State.UNKNOWN
        s.ingest(hb(6, 4))
        s._fetch_snapshots()
        assert s.state("n1") is State.HEALTHY and snaps == ["n1"]
        s.ingest(ev(7, 4, "node", "degraded"))
        assert s.state("n1") is State.DEGRADED and s.nodes()["n1"]["reasons"] == ["node: bad"]
        s.ingest(ev(6, 3, "node", "failed"))  # older than what we have: ignored
        assert s.state("n1") is State.DEGRADED
        # missed heartbeats: unknown (not failed) after 3 intervals, back on the next one
        clock.t += 3.5
        s.expire()
        assert s.state("n1") is State.UNKNOWN and "no heartbeat for 3.5 s" in s.nodes()["n1"]["reasons"][0]
        s.ingest(hb(8, 7))
        assert s.state("n1") is State.DEGRADED
        # a gap (event 9 lost): re-read the snapshot
        s.ingest(ev(10, 9, "node", "failed"))
        assert s.counters["gaps"] == 1 and s.state("n1") is State.UNKNOWN
        clock.t += 2
        s._fetch_snapshots()
        assert s.state("n1") is State.HEALTHY and len(snaps) == 2
        # a restarted publisher (new incarnation, seq from 0): snapshot again
        s.ingest(hb(0, -1, inc="b"))
        assert s.state("n1") is State.UNKNOWN
        clock.t += 2
        s._views["n1"]
        s._snapshot = lambda n, e: snapshot_result(0, -1, inc="b")
        s._fetch_snapshots()
        assert s.state("n1") is State.HEALTHY and s.view("n1").incarnation == "b"
        # garbage is dropped and counted
        for bad in ([b"x"], [b"tpassd.event", b"\xff"], hb(1, 0, inc="b")[:1] + [b"{}"],
                    [b"tpassd.sample", wire.encode("tpassd.heartbeat", hb(1, 0)[1] and {
                        "node": "n1", "incarnation": "b", "t": 0.0, "interval_s": 1.0, "state": "healthy",
                        "last_event_seq": -1, "uptime_s": 1.0}, seq=1, sender="n1")],
                    pub("tpassd.heartbeat", 1, {"node": "zz", "incarnation": "b", "t": 0.0, "interval_s": 1.0,
                                                "state": "healthy", "last_event_seq": -1, "uptime_s": 1.0},
                        sender="unknown-node")):
            s.ingest(bad)
        assert s.counters["malformed"] == 5 and s.state("n1") is State.HEALTHY
    finally:
        s.close()


def test_subscriber_socket_closes(tmp_path):
    ctx = zmq.Context()
    s = HealthSubscriber({"n1": ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")}, snapshot=None, context=ctx).start()
    s.close()
    ctx.term()  # would hang if a socket were left open


def test_a_user_may_not_drain_a_degraded_node_that_runs_another_users_job(node, munge):
    """A degraded node still serves the jobs on it: user 1001's drain request must not take it from
    user 1002's job. A node that tpassd itself sees failed is drained on tpassd's own evidence."""
    node.slurm.run_job(7, user="u1001", uid=1001, nodes=("node1",))
    node.slurm.run_job(8, user="u1002", uid=1002, nodes=("node1",))
    node.job_owners.update({1001, 1002})  # Slurm's view: both users' jobs run on node1
    call(node.ctl, "node1", "tpassd.drill", {"kind": "ecc-sbe-storm", "gpu": 0}, munge.socket)
    assert wait_for(lambda: (node.last_sample or {}).get("state") == "degraded")
    with capture_logs() as logs:
        e = drain_refused(node, 1001, 7, munge)
    assert e.code == "forbidden" and "uids [1002]" in e.remote_message and "not failed" in e.remote_message
    assert node.slurm.drained == []
    audit = [x for x in logs if x["event"] == "privileged action" and x["action"] == "drain"]
    assert [(a["requester_uid"], a["job_id"], a["outcome"]) for a in audit] == [(1001, 7, "forbidden")]
    call(node.ctl, "node1", "tpassd.drill", {"kind": "xid79", "gpu": 1}, munge.socket)
    assert wait_for(lambda: (node.last_sample or {}).get("state") == "failed")
    assert drain(node, 1001, 7, munge)["health"] == "failed"
    assert node.slurm.drained == [("node1", "torchpass: gpu0: SBE ECC storm")]
