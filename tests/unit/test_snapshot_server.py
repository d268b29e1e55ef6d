"""`job.snapshot` on the coordinator's socket: the job's owner or an admin, proven by munge;
accepted, it queues the snapshot and records who asked; a second one, or one beside a migration, is a
conflict; anyone else is forbidden."""

from __future__ import annotations

import threading

import pytest

from torchpass import auth, zmqio
from torchpass.coordinator import contract as ct
from torchpass.coordinator.driver import Driver
from torchpass.coordinator.job_record import JobState
from torchpass.coordinator.policy import CoordinatorPolicy
from torchpass.coordinator.server import CoordinatorServer
from torchpass.errors import RemoteError
from torchpass.health_state import State


def _serve(munge, owner_uid: int, admin_uids: frozenset[int]):
    job = JobState(job_id=42)
    driver = Driver(job, CoordinatorPolicy())
    for r in range(3):
        driver.feed(ct.RankRegistered(r, f"node{r + 1}", 3))
        driver.feed(ct.NodeHealthChanged(f"node{r + 1}", State.HEALTHY))
    server = CoordinatorServer(job, bind_address="127.0.0.1", wall=lambda: 1.7e9, driver=driver,
                               munge_socket=munge.socket, owner_uid=owner_uid, admin_uids=admin_uids)
    t = threading.Thread(target=server.serve, daemon=True)
    t.start()
    return server, t, f"tcp://127.0.0.1:{server.port}"


def _ask(ep, munge, type_="job.snapshot", body=None):
    body = body or {}
    return zmqio.request(ep, type_, body, timeout_s=2, retries=0,
                         auth=auth.credential_for(type_, body, auth.job_target(42), munge.socket))


@pytest.mark.parametrize("admin", [False, True])
def test_the_owner_or_an_admin_takes_a_snapshot_once(munge, admin):
    server, t, ep = _serve(munge, owner_uid=1001 if admin else 0, admin_uids=frozenset({0}))
    try:
        res = _ask(ep, munge)
        assert res["snapshot"] == "20231114T221320Z-1"
        st = server.driver.state
        assert st.snapshot is not None and st.snapshot.id == res["snapshot"] and st.snapshot.phase == "pause"
        asked = [e for e in server.job.events if e.kind == "snapshot.requested"]
        assert len(asked) == 1 and asked[0].data == {"snapshot": res["snapshot"], "trigger": "operator", "uid": 0}
        with pytest.raises(RemoteError) as exc:
            _ask(ep, munge)
        assert exc.value.code == "conflict" and "already in flight" in str(exc.value)
        # a migration asked meanwhile queues, and waits until the snapshot ended
        assert _ask(ep, munge, "job.migrate", {"node": "node2"})["migration"] == "m1"
        assert server.driver.state.migration is None and server.driver.state.snapshot is not None
    finally:
        server.stop()
        t.join(5)


def test_anyone_else_is_forbidden(munge):
    server, t, ep = _serve(munge, owner_uid=1001, admin_uids=frozenset({1002}))
    try:
        with pytest.raises(RemoteError) as exc:
            _ask(ep, munge)
        assert exc.value.code == "forbidden" and "only its owner or an admin may snapshot it" in str(exc.value)
        assert server.driver.state.snapshot is None
    finally:
        server.stop()
        t.join(5)
