"""Restore tokens on tpassd's side: ``tpassd.restore`` op=prepare writes one only for a restore it
checked (the requester owns the job per Slurm; a snapshot restore names a committed snapshot of that
owner), in a directory of root's with mode 0700, file mode 0600.

The plugin's side (the token taken once, bound to one step, refused when it names another job, rank,
kind or uid, when expired, symlinked, hard-linked or not root's) is slurm_spank/tests/test_args.c's
test_token (run by test_spank_args.py); the attack through srun is in
tests/integration/test_nonroot_migration.py."""

from __future__ import annotations

import os
import stat

import pytest

from test_snapshot_service import OTHER, OWNER, ROOT, _commit, _service
from torchpass import auth, layout, wire
from torchpass.auth import AuthFailure
from torchpass.checkpoint import restore_token as rt
from torchpass.errors import RemoteError

ME = os.geteuid()


def _svc(tmp_path, **kw):
    tokens = tmp_path / "tokens"
    tokens.mkdir(mode=0o700)
    return _service(tmp_path, restore_tokens=tokens, token_owner=ME, **kw), tokens


def _prepare(svc, ident, **body):
    return svc.restore(wire.Message("tpassd.restore", {"job_id": 5, "rank": 2, "op": "prepare", **body}), ident)


def _fields(path) -> dict:
    return rt.parse_token(path.read_text())


def test_the_owners_migration_prepare_writes_a_root_only_token(tmp_path):
    svc, tokens = _svc(tmp_path)
    out = _prepare(svc, OWNER, kind="migration", generation=3)
    path = layout.restore_token(tokens, "n1", 5, "migration", rank=2)
    assert out["token"] == path.name and out["ttl_s"] == layout.RESTORE_TOKEN_TTL_S
    assert _fields(path) == {"kind": "migration", "job": 5, "alloc": 5, "uid": 1001, "rank": 2, "generation": 3,
                             "created": 1000}
    st = path.stat()
    assert st.st_uid == ME and stat.S_IMODE(st.st_mode) == 0o600 and st.st_nlink == 1
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_another_user_cannot_prepare_and_bad_requests_write_nothing(tmp_path):
    svc, tokens = _svc(tmp_path)
    with pytest.raises(AuthFailure, match="does not own job 5"):
        _prepare(svc, OTHER, kind="migration", generation=3)
    with pytest.raises(RemoteError, match="kind 'root' is not one of"):
        _prepare(svc, OWNER, kind="root")
    with pytest.raises(RemoteError, match="generation must be a non-negative integer"):
        _prepare(svc, OWNER, kind="migration")
    with pytest.raises(RemoteError, match="needs a snapshot id"):
        _prepare(svc, OWNER, kind="snapshot", snapshot="../../etc")
    with pytest.raises(RemoteError, match="images"):  # verify without images: a line, not a crash
        svc.restore(wire.Message("tpassd.restore", {"job_id": 5, "rank": 2, "op": "verify"}), OWNER)
    assert not (tokens / "n1").exists() or os.listdir(tokens / "n1") == []


def test_a_companion_allocation_of_another_owner_is_refused(tmp_path):
    svc, _ = _svc(tmp_path)
    svc.job_owner = lambda j: {5: 1001, 9: 1001, 10: 1002}.get(j)
    _prepare(svc, OWNER, kind="migration", generation=1, alloc=9)
    with pytest.raises(RemoteError, match="job 10 is not of job 5's owner"):
        _prepare(svc, OWNER, kind="migration", generation=1, alloc=10)


@pytest.mark.skipif(ME != 0, reason="job manifests are root's: a commit needs root")
def test_a_snapshot_restore_needs_a_committed_snapshot_of_the_owner(tmp_path):
    svc, tokens = _svc(tmp_path)
    with pytest.raises(RemoteError, match="no snapshots|no committed snapshot"):
        _prepare(svc, OWNER, kind="snapshot", snapshot="s1")
    _commit(svc, tmp_path, "s1")
    with pytest.raises(RemoteError, match="no committed snapshot s2"):
        _prepare(svc, OWNER, kind="snapshot", snapshot="s2")
    _prepare(svc, OWNER, kind="snapshot", snapshot="s1")
    _prepare(svc, ROOT, kind="stopped", snapshot="s1", step=4)
    got = _fields(layout.restore_token(tokens, "n1", 5, "stopped"))
    assert got.pop("created") > 0
    assert got == {"kind": "stopped", "job": 5, "alloc": 5, "uid": 1001, "snapshot": "s1", "step": 4}
    # a snapshot another uid's manifest records is not restored for this owner
    svc.job_owner = lambda j: 1002
    with pytest.raises(RemoteError, match="not of the job's owner"):
        _prepare(svc, auth.Identity(uid=1002, gid=1002), kind="snapshot", snapshot="s1")


def test_a_token_directory_that_is_a_symlink_or_not_root_only_is_refused(tmp_path):
    svc, tokens = _svc(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tokens / "n1").symlink_to(elsewhere)
    with pytest.raises(RemoteError, match="symlink"):
        _prepare(svc, OWNER, kind="migration", generation=3)
    assert os.listdir(elsewhere) == []
    (tokens / "n1").unlink()
    (tokens / "n1").mkdir(mode=0o755)
    (tokens / "n1").chmod(0o755)
    with pytest.raises(RemoteError, match="not root's with mode 0700"):
        _prepare(svc, OWNER, kind="migration", generation=3)


def test_a_new_prepare_replaces_the_old_token_and_unbinds_its_step(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.mkdir(mode=0o700)
    rt.write_token(tokens, "n1", kind="snapshot", job=5, alloc=5, uid=1001, snapshot="s1", now=100, owner=ME)
    d = layout.restore_token_dir(tokens, "n1")
    os.rename(d / "job5.snapshot.token", d / "job5.snapshot.step3.token")  # what the plugin does
    rt.write_token(tokens, "n1", kind="snapshot", job=5, alloc=5, uid=1001, snapshot="s2", now=200, owner=ME)
    assert sorted(os.listdir(d)) == ["job5.snapshot.token"]
    assert _fields(d / "job5.snapshot.token")["snapshot"] == "s2"
    # expired tokens are swept at the next prepare
    rt.write_token(tokens, "n1", kind="migration", job=6, alloc=6, uid=1001, rank=0, generation=1, owner=ME)
    os.utime(d / "job5.snapshot.token", (0, 0))
    rt.write_token(tokens, "n1", kind="migration", job=6, alloc=6, uid=1001, rank=1, generation=1, owner=ME)
    assert sorted(os.listdir(d)) == ["job6.rank0.token", "job6.rank1.token"]
