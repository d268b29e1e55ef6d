"""Limits that keep one user from starving tpassd or steering its health view, each driven
through the entry point a user reaches: a tpassd request, a socket, a directory users write."""

from __future__ import annotations

import os
from collections import namedtuple

from structlog.testing import capture_logs

from tpassd.collectors.base import run_collector
from tpassd.collectors.host import HostCollector, user_writable
from tpassd.daemon import Tpassd
from tpassd.testing import fake_node_config, wait_for

DU = namedtuple("DU", "total used free percent")


def test_disk_health_never_watches_a_directory_users_can_write(tmp_path, munge):
    """A shared state_dir is world-writable (users' jobs/J live there): a user filling it must not
    turn every node degraded. tpassd watches snapshot_dir (root's), not state_dir."""
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o1777)  # as a shared state_dir is
    d = Tpassd(fake_node_config(tmp_path, "node1", munge.socket, interval_s=0.2, collector_timeout_s=0.15,
                                state_dir=state),
               job_owner_uids=lambda: set(), admin_uids=lambda: frozenset({0}))
    with d:
        assert wait_for(lambda: d.last_sample is not None)
        host = d.last_sample["components"]["host"]["metrics"]
        watched = {v for k, v in host.items() if k.endswith(".path")}
    assert str(state) not in watched
    assert str(tmp_path / "snapshots") in watched


def test_a_configured_disk_path_users_can_write_is_ignored_with_one_log_line(tmp_path):
    mine = tmp_path / "root-only"
    mine.mkdir(mode=0o755)
    theirs = tmp_path / "users"
    theirs.mkdir()
    os.chmod(theirs, 0o777)
    owned = tmp_path / "owned"
    owned.mkdir()
    os.chown(owned, 65534, 65534)
    assert user_writable(mine) is None
    assert "writable by everyone" in user_writable(theirs)
    assert "uid 65534" in user_writable(owned)
    # every one would be degraded (0 bytes free) if it were watched
    c = HostCollector([mine, theirs, owned], disk_usage=lambda p: DU(100, 100, 0, 100.0))
    with capture_logs() as logs:
        for _ in range(3):
            r = run_collector(c, 0.0)
    paths = {v for k, v in r.components["host"].metrics.items() if k.endswith(".path")}
    assert paths == {str(mine)}
    ignored = [e for e in logs if e["event"].startswith("disk free space not watched")]
    assert sorted(e["path"] for e in ignored) == sorted([str(theirs), str(owned)])  # once each, not per sample
