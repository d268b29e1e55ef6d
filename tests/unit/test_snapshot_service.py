"""Whole-job snapshots on tpassd's side: a real CRIU dump into the snapshot's own directory
(no hand-off marker), the root-written job manifest (checked parts, owner-only), retention, deletion,
and `tpassctl snapshots` listing only what the caller may see."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import time

import pytest
from click.testing import CliRunner

from torchpass import auth, layout, wire
from torchpass.checkpoint import manifest as mf
from torchpass.checkpoint.service import CheckpointService
from torchpass.errors import RemoteError
from tpassctl.cli import cli
from tpassctl.snapshot_cmd import list_snapshots

ROOT = auth.Identity(uid=0, gid=0)
OWNER = auth.Identity(uid=1001, gid=1001)
OTHER = auth.Identity(uid=1002, gid=1002)


def _service(tmp_path, **kw) -> CheckpointService:
    (layout.job_dir(tmp_path / "state", 5)).mkdir(parents=True, exist_ok=True)
    clock = iter(range(1000, 2000))
    return CheckpointService(tmp_path / "snap", "n1", state_dir=tmp_path / "state", job_owner=lambda j: 1001,
                             owner_gid=lambda uid: uid, wall=lambda: float(next(clock)), **kw)


def _fake_rank(tmp_path, snap: str, rank: int, size: int = 100, job: int = 5) -> dict:
    """What a snap op leaves: the rank's images and its root-written manifest."""
    d = layout.snapshot_images_dir(tmp_path / "snap", job, snap, rank)
    d.mkdir(parents=True)
    (d / "pages-1.img").write_bytes(b"x" * size)
    mf.write_manifest(d, {"job": job, "rank": rank, "snapshot": snap, "node": f"n{rank}"})
    return {"rank": rank, "node": f"n{rank}", "images": str(d), "checksum": mf.checksum(d)}


def _commit(svc, tmp_path, snap: str, ident=OWNER, keep: int = 2, parts=None, job: int = 5):
    parts = parts if parts is not None else [_fake_rank(tmp_path, snap, r, 100 * (r + 1), job) for r in range(2)]
    body = {"job_id": job, "rank": 0, "op": "commit", "snapshot": snap, "step": 12, "generation": 1,
            "collectives": 40, "keep": keep, "parts": parts}
    return svc.snapshot(wire.Message("tpassd.snapshot", body), ident)


def test_commit_writes_a_root_owned_manifest_only_the_owner_reads(tmp_path):
    svc = _service(tmp_path)
    out = _commit(svc, tmp_path, "s1")
    path = layout.snapshot_manifest(tmp_path / "state", 5, "s1")
    assert out["manifest"] == str(path) and out["bytes"] == 300 and out["removed"] == []
    m = json.loads(path.read_text())
    assert (m["job_id"], m["snapshot"], m["uid"], m["step"], m["generation"], m["world_size"]) == (5, "s1", 1001, 12, 1,
                                                                                                   2)
    assert [(p["rank"], p["bytes"]) for p in m["ranks"]] == [(0, 100), (1, 200)] and m["nodes"] == ["n0", "n1"]
    st, dst = path.stat(), path.parent.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 1001, 0o640)
    assert (dst.st_uid, dst.st_gid, stat.S_IMODE(dst.st_mode)) == (0, 1001, 0o750)


def test_commit_refuses_images_of_another_rank_snapshot_or_a_wrong_checksum(tmp_path):
    svc = _service(tmp_path)
    a = _fake_rank(tmp_path, "s1", 0)
    with pytest.raises(RemoteError, match="not rank 1's directory of snapshot s1"):
        _commit(svc, tmp_path, "s1", parts=[{**a, "rank": 1}])
    with pytest.raises(RemoteError, match="not rank 0's directory of snapshot s2"):
        _commit(svc, tmp_path, "s2", parts=[a])
    with pytest.raises(RemoteError, match="does not match its checksum"):
        _commit(svc, tmp_path, "s1", parts=[{**a, "checksum": "0" * 64}])
    with pytest.raises(RemoteError, match="not rank 0's"):
        _commit(svc, tmp_path, "s1", parts=[{**a, "images": str(tmp_path / "elsewhere/rank0")}])
    with pytest.raises(auth.AuthFailure):
        _commit(svc, tmp_path, "s1", ident=OTHER, parts=[a])
    assert not layout.snapshot_manifest(tmp_path / "state", 5, "s1").exists()


def test_retention_keeps_the_newest_and_delete_is_owner_only(tmp_path):
    svc = _service(tmp_path)
    for s in ("s1", "s2", "s3"):
        out = _commit(svc, tmp_path, s, keep=2)
    assert out["removed"] == ["s1"]
    discard = wire.Message("tpassd.snapshot", {"job_id": 5, "rank": 0, "op": "discard", "snapshot": "s3"})
    with pytest.raises(RemoteError, match="is complete"):  # a committed snapshot is deleted, not discarded
        svc.snapshot(discard, OWNER)
    assert not layout.snapshot_manifest(tmp_path / "state", 5, "s1").exists()
    assert not (layout.snapshot_tree(tmp_path / "snap", 5) / "s1").exists()
    assert (layout.snapshot_tree(tmp_path / "snap", 5) / "s2").is_dir()
    rows = list_snapshots(tmp_path / "state", 5, uid=1001, now=2000.0)
    assert [(r["snapshot"], r["step"], r["bytes"]) for r in rows] == [("s2", 12, 300), ("s3", 12, 300)]
    assert rows[0]["age_s"] > 0
    assert list_snapshots(tmp_path / "state", 5, uid=1002) == []  # another user sees none of them
    assert len(list_snapshots(tmp_path / "state", None, uid=0)) == 2  # an admin sees them all

    delete = wire.Message("tpassd.snapshot", {"job_id": 5, "rank": 0, "op": "delete", "snapshot": "s2"})
    with pytest.raises(auth.AuthFailure):
        svc.snapshot(delete, OTHER)
    gone = CheckpointService(tmp_path / "snap", "n1", state_dir=tmp_path / "state", job_owner=lambda j: None)
    assert gone.snapshot(delete, OWNER)["deleted"] is True  # Slurm forgot the job: the manifest's uid counts
    assert [r["snapshot"] for r in list_snapshots(tmp_path / "state", 5, uid=1001)] == ["s3"]
    with pytest.raises(RemoteError, match="no snapshot s2"):
        svc.snapshot(delete, OWNER)


def test_a_users_quota_counts_all_their_jobs_minus_what_retention_removes(tmp_path):
    svc = _service(tmp_path)
    svc.snapshot_quota_bytes = 900  # each commit below is 300 bytes (two ranks: 100 + 200)
    layout.job_dir(tmp_path / "state", 6).mkdir(parents=True)
    _commit(svc, tmp_path, "a1", job=6)
    _commit(svc, tmp_path, "s1", keep=2)
    _commit(svc, tmp_path, "s2", keep=2)  # 900: at the quota, not over it
    out = _commit(svc, tmp_path, "s3", keep=2)  # s1 goes by retention: still 900
    assert out["removed"] == ["s1"]
    with pytest.raises(RemoteError, match=r"would bring uid 1001's snapshots to 0\.00 GB, over this cluster's quota") \
            as exc:
        _commit(svc, tmp_path, "s4", keep=3)  # keeping 3 of job 5 (s2 s3 s4) + job 6's a1: 1,200
    assert exc.value.code == "conflict" and "tpassctl snapshots JOBID --delete ID" in str(exc.value)
    assert not layout.snapshot_manifest(tmp_path / "state", 5, "s4").exists()
    assert sorted(r["snapshot"] for r in list_snapshots(tmp_path / "state", None, uid=1001)) == ["a1", "s2", "s3"]


def test_snapshots_older_than_the_age_limit_are_removed_by_the_tpassd_that_wrote_them(tmp_path):
    now = [10_000.0]
    svc = _service(tmp_path)
    svc.wall = lambda: now[0]
    _commit(svc, tmp_path, "s1")
    now[0] += 3000
    _commit(svc, tmp_path, "s2")
    other = CheckpointService(tmp_path / "snap", "n9", state_dir=tmp_path / "state", job_owner=lambda j: 1001,
                              wall=lambda: now[0] + 10_000)
    other.snapshot_max_age_s = 3600.0
    assert other.expire_snapshots() == []  # n1 wrote them: n9 leaves them alone
    svc.snapshot_max_age_s = 0.0
    assert svc.expire_snapshots() == []  # no limit
    svc.snapshot_max_age_s = 3600.0
    now[0] += 1000  # s1 is 4,000 s old, s2 1,000 s
    assert svc.expire_snapshots() == ["5/s1"]
    assert not (layout.snapshot_tree(tmp_path / "snap", 5) / "s1").exists()
    assert [r["snapshot"] for r in list_snapshots(tmp_path / "state", 5, uid=1001)] == ["s2"]


def test_a_manifest_not_written_by_root_is_not_listed(tmp_path):
    svc = _service(tmp_path)
    _commit(svc, tmp_path, "s1")
    d = layout.snapshot_manifests_dir(tmp_path / "state", 5)
    forged = d / layout.snapshot_manifest(".", 5, "s9").name
    forged.write_text(json.dumps({"job_id": 5, "snapshot": "s9", "uid": 1001, "created": 1.0}))
    os.chown(forged, 1001, 1001)
    assert [r["snapshot"] for r in list_snapshots(tmp_path / "state", 5, uid=1001)] == ["s1"]


def test_tpassctl_snapshots_lists_and_refuses_a_bad_delete(tmp_path):
    svc = _service(tmp_path)
    _commit(svc, tmp_path, "s1")
    r = CliRunner().invoke(cli, ["--state-dir", str(tmp_path / "state"), "snapshots", "5", "--json"])
    assert r.exit_code == 0, r.output
    (row,) = json.loads(r.output)["snapshots"]
    assert (row["snapshot"], row["step"], row["bytes"], row["ranks"]) == ("s1", 12, 300, 2)
    r = CliRunner().invoke(cli, ["--state-dir", str(tmp_path / "state"), "snapshots", "5"])
    assert "s1" in r.output and "0.0 MB" in r.output
    r = CliRunner().invoke(cli, ["--state-dir", str(tmp_path / "state"), "snapshots", "5", "--delete", "nope"])
    assert r.exit_code == 4 and "has no snapshot nope" in r.output  # not found (docs/cli.md)


@contextlib.contextmanager
def _sleeping_rank(tmp_path):
    """Rank 1 of job 5: a real process (sleep) with its rank record, this process as its wrapper."""
    proc = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        rank_dir = layout.rank_records_dir(tmp_path / "state", 5)
        record = layout.rank_record(rank_dir, 5, 1)
        record.parent.mkdir(parents=True)
        record.write_text(json.dumps({"pid": proc.pid, "wrapper_pid": os.getpid()}))
        yield proc, rank_dir
    finally:
        proc.kill()
        proc.wait()


def test_snap_dumps_a_real_process_into_the_snapshot_leaving_it_running_without_a_marker(tmp_path):
    with _sleeping_rank(tmp_path) as (proc, rank_dir):
        time.sleep(0.3)
        svc = CheckpointService(tmp_path / "snap", "n1", state_dir=tmp_path / "state", job_owner=lambda j: 0,
                                job_pids=lambda j: {proc.pid, os.getpid()}, gpu_in_use=lambda pid: False)
        body = {"job_id": 5, "rank": 1, "op": "snap", "snapshot": "s1", "generation": 3}
        out = svc.snapshot(wire.Message("tpassd.snapshot", body), ROOT)
        images = layout.snapshot_images_dir(tmp_path / "snap", 5, "s1", 1)
        assert out["images"] == str(images) and out["snapshot"] == "s1" and out["bytes"] > 0
        assert proc.poll() is None  # left running
        assert not layout.handoff(rank_dir, 5, 1).exists()  # nothing moves: no hand-off marker
        assert stat.S_IMODE(images.stat().st_mode) == 0o700 and images.stat().st_uid == 0
        assert json.loads((images / mf.MANIFEST).read_text())["meta"]["snapshot"] == "s1"
        # a space reserve the disk cannot give (tpassd's free-space rule) refuses the dump first
        svc.keep_free_bytes = 1 << 62
        with pytest.raises(Exception, match="no space"):
            svc.snapshot(wire.Message("tpassd.snapshot", {**body, "snapshot": "s2"}), ROOT)
        assert proc.poll() is None
        discard = {"job_id": 5, "rank": 0, "op": "discard", "snapshot": "s1"}
        assert svc.snapshot(wire.Message("tpassd.snapshot", discard), ROOT)["discarded_mb"] >= 0
        assert not images.exists()


def test_a_bad_snapshot_id_is_refused(tmp_path):
    svc = _service(tmp_path)
    for bad in ("../x", ".x", "a/b", ""):
        with pytest.raises(RemoteError, match="needs a snapshot id"):
            svc.snapshot(wire.Message("tpassd.snapshot", {"job_id": 5, "rank": 0, "op": "discard", "snapshot": bad}),
                         ROOT)


def test_the_snapshot_layout():
    assert layout.snapshot_images_dir("/snap", 7, "s1", 2) == layout.snapshot_tree("/snap", 7) / "s1/rank2"
    assert str(layout.snapshot_tree("/snap", 7)) == "/snap/snapshots/job7"
    assert str(layout.snapshot_manifest("/s", 7, "s1")) == "/s/jobs/7/snapshots/s1.json"
    p = layout.snapshot_images_dir("/snap", 7, "s1", 2)
    assert layout.parse_snapshot_images_dir(p, 7, 2) == (layout.Path("/snap"), "s1")
    assert layout.parse_snapshot_images_dir(p, 7, 3) is None and layout.parse_snapshot_images_dir(p, 8, 2) is None
    assert layout.parse_snapshot_images_dir("/snap/snapshots/job7/../x/rank2", 7, 2) is None


def test_a_rank_that_alone_would_pass_the_quota_is_refused_before_anything_is_written(tmp_path):
    """The quota is checked exactly at the commit; a rank whose own image (its tree's resident memory)
    would already take the owner past it is refused before CRIU writes a byte, counting what
    retention removes."""
    with _sleeping_rank(tmp_path) as (proc, _):
        svc = CheckpointService(tmp_path / "snap", "n1", state_dir=tmp_path / "state", job_owner=lambda j: 0,
                                job_pids=lambda j: {proc.pid, os.getpid()}, gpu_in_use=lambda pid: False,
                                owner_gid=lambda uid: uid, image_estimate=lambda pid: 10_000)
        _commit(svc, tmp_path, "s0", ident=ROOT, keep=2)  # the job's older snapshot: 300 bytes
        svc.snapshot_quota_bytes = 10_100
        body = {"job_id": 5, "rank": 1, "op": "snap", "snapshot": "s1", "generation": 3, "keep": 2}
        with pytest.raises(RemoteError, match=r"rank 1 alone of snapshot s1 of job 5 \(estimated\)") as exc:
            svc.snapshot(wire.Message("tpassd.snapshot", body), ROOT)  # s0 stays: 300 + 10,000
        assert exc.value.code == "conflict"
        images = layout.snapshot_images_dir(tmp_path / "snap", 5, "s1", 1)
        assert not images.exists() or not any(images.iterdir())  # nothing written
        assert proc.poll() is None
        out = svc.snapshot(wire.Message("tpassd.snapshot", {**body, "keep": 1}), ROOT)  # s0 would go: fits
        assert out["images"] == str(images) and out["bytes"] > 0 and proc.poll() is None


def test_renaming_the_jobs_snapshots_directory_hides_nothing_from_the_quota_or_the_expiry(tmp_path):
    """STATE_DIR/jobs/J belongs to the job's owner, who may rename jobs/J/snapshots (done here as
    root, in the owner's place: the same rename(2)). The quota and the expiry count the root-only
    records beside the images in SNAPSHOT_DIR, which no user can rename."""
    now = [10_000.0]
    svc = _service(tmp_path)
    svc.wall = lambda: now[0]
    svc.snapshot_quota_bytes = 600  # each commit is 300 bytes
    _commit(svc, tmp_path, "s1", keep=5)
    _commit(svc, tmp_path, "s2", keep=5)
    hidden = layout.job_dir(tmp_path / "state", 5) / "not-snapshots"
    os.rename(layout.snapshot_manifests_dir(tmp_path / "state", 5), hidden)
    with pytest.raises(RemoteError, match="over this cluster's quota") as exc:
        _commit(svc, tmp_path, "s3", keep=5)
    assert exc.value.code == "conflict"
    records = layout.snapshot_tree(tmp_path / "snap", 5)
    st = os.stat(records / f"s1{layout.SNAPSHOT_MANIFEST_SUFFIX}")
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o600
    svc.snapshot_max_age_s = 3600.0
    now[0] += 7200
    assert sorted(svc.expire_snapshots()) == ["5/s1", "5/s2"]
    assert not (records / "s1").exists() and not (records / "s2").exists()
