"""The job manifest's one format (torchpass.checkpoint.job_manifest): what tpassd writes, the
relaunched rank wrapper and tpassctl read, and which files a reader takes as one."""

from __future__ import annotations

import os

import pytest

from torchpass import layout
from torchpass.checkpoint import job_manifest, safeio

JOB = 42


def _parts():
    return [{"rank": r, "node": f"n{r % 2}", "images": f"/snap/snapshots/job{JOB}/s1/rank{r}", "checksum": "c",
             "bytes": 10 + r} for r in range(3)]


def test_a_built_manifest_reads_back_and_names_each_ranks_images():
    m = job_manifest.build(job_id=JOB, snapshot="s1", uid=1001, created=12.34567, step=9, generation=2,
                           collectives=40, parts=_parts(), written_by="n0")
    back = job_manifest.parse(job_manifest.encode(m))
    assert back == m
    assert (back["world_size"], back["nodes"], back["bytes"], back["created"]) == (3, ["n0", "n1"], 33, 12.346)
    assert job_manifest.rank_images(back, 2) == f"/snap/snapshots/job{JOB}/s1/rank2"
    assert job_manifest.rank_images(back, "1") == f"/snap/snapshots/job{JOB}/s1/rank1"
    assert job_manifest.rank_images(back, 3) is None
    for bad in (b"[1, 2]", b"not json", b'"s"'):
        with pytest.raises(ValueError):
            job_manifest.parse(bad)


@pytest.mark.skipif(os.geteuid() != 0, reason="a manifest counts only when root owns it: chown needs root")
def test_only_roots_single_linked_regular_manifests_of_this_job_named_by_their_id_are_read(tmp_path):
    d = tmp_path / "snapshots"
    d.mkdir()

    def put(name: str, snap: str, job: int = JOB, created: float = 1.0) -> os.PathLike:
        m = job_manifest.build(job_id=job, snapshot=snap, uid=1001, created=created, step=1, generation=1,
                               collectives=1, parts=_parts(), written_by="n0")
        p = d / name
        p.write_bytes(job_manifest.encode(m))
        return p

    suffix = layout.SNAPSHOT_MANIFEST_SUFFIX
    put(f"s2{suffix}", "s2", created=2.0)
    put(f"s1{suffix}", "s1", created=1.0)
    put(f"s3{suffix}", "other")  # its name is not its id
    put(f"s4{suffix}", "s4", job=JOB + 1)  # another job's
    os.chown(put(f"s5{suffix}", "s5"), 65534, 65534)  # a user's: forged
    os.link(put(f"s6{suffix}", "s6"), d / "elsewhere")  # a second link: not root's own file
    os.symlink(d / f"s1{suffix}", d / f"s7{suffix}")
    os.mkfifo(d / f"s8{suffix}")  # never blocks the reader
    (d / f"s9{suffix}").write_bytes(b"{broken")
    dfd = safeio.open_dir(str(d), ())
    try:
        found = job_manifest.read_all(dfd, JOB)
    finally:
        os.close(dfd)
    assert [m["snapshot"] for m in found] == ["s1", "s2"]  # oldest first
