"""The restore wrapper says why a restore failed in --error-file, not only on
its stderr (which goes to the job's output): the coordinator's rollback event
quotes that file."""

from __future__ import annotations

import subprocess
import sys

from torchpass.checkpoint import criu, manifest


def test_restore_of_a_corrupt_snapshot_writes_the_reason_to_the_error_file(tmp_path):
    d = tmp_path / "img"
    d.mkdir()
    (d / "pages-1.img").write_bytes(b"p" * 4096)
    manifest.write_manifest(d, {"job": 5, "rank": 1})
    with open(d / "pages-1.img", "r+b") as f:  # what the restore-fail drill does to a verified image
        f.seek(2048)
        f.write(b"q")
    err = tmp_path / "restore.err"
    proc = subprocess.run([sys.executable, "-m", "torchpass.checkpoint.rankwrap", "--restore", str(d),
                           "--state-dir", str(tmp_path / "ranks"), "--error-file", str(err)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("torchpass: ")]
    assert said and err.read_text().splitlines() == said
    try:
        criu.find_criu(None)
    except Exception:  # noqa: BLE001 - no usable criu here: the reason is that, still one line
        return
    assert "pages-1.img fails its BLAKE3 check" in said[0]
