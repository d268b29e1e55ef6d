"""A snapshot written before BLAKE3 (manifest format 1: each image file's SHA-256) still restores.

Whole-job snapshots may be days old when they are restored, so the restore of this version must
take the manifests of the one before. The scenario (a real process, dumped leave-running with
torchpass's own criu.dump, killed, its manifest rewritten as the earlier tpassd wrote it, then
restored with criu.restore(checked=...), which checks the digests while CRIU restores, as the
restore wrapper does) runs in a child subreaper, as tests/unit/test_snapshot_files.py's does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="criu dump and restore of another process need root")

SCENARIO = textwrap.dedent(
    r"""
    import ctypes, hashlib, json, os, subprocess, sys, time
    from pathlib import Path
    from torchpass.checkpoint import criu, manifest
    from torchpass.errors import CheckpointError

    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    tmp, damage = Path(sys.argv[1]), sys.argv[2] == "damaged"
    log = tmp / "train.log"
    APP = ("import sys, time\nb = bytearray(8 << 20)\nf = open(sys.argv[1], 'a')\ni = 0\nwhile True:\n"
           "    b[i % len(b)] = i % 251; f.write(f'step={i}\\n'); f.flush(); i += 1; time.sleep(0.05)\n")

    def lines():
        try:
            return log.read_text().splitlines()
        except FileNotFoundError:
            return []

    def until(pred, what):
        end = time.monotonic() + 20
        while not pred():
            if time.monotonic() > end:
                raise SystemExit(f"timed out waiting for {what}")
            time.sleep(0.01)

    app = subprocess.Popen([sys.executable, "-c", APP, str(log)], stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    until(lambda: len(lines()) >= 5, "the first steps")
    c = criu.find_criu()
    img = tmp / "img"
    res = criu.dump(c, app.pid, img)
    app.kill(); app.wait()
    m = json.loads((img / "manifest.json").read_text())
    files = {n: {"size": f["size"], "sha256": hashlib.sha256((img / n).read_bytes()).hexdigest()}
             for n, f in m["files"].items()}
    (img / "manifest.json").write_text(json.dumps({"format": 1, "files": files, "meta": m["meta"]}))
    if damage:
        big = max(files, key=lambda n: files[n]["size"])
        data = bytearray((img / big).read_bytes()); data[len(data) // 2] ^= 0xFF; (img / big).write_bytes(data)
    kept = len(lines())
    try:
        checked = manifest.read_manifest(img)
        pid, _ = criu.restore(c, img, pidfile=tmp / "restored.pid", checked=checked)
    except CheckpointError as exc:
        print(json.dumps({"format": checked["format"], "error": str(exc)}))
        raise SystemExit(0)
    until(lambda: len(lines()) >= kept + 5, "steps of the restored copy")
    os.kill(pid, 9); os.waitpid(pid, 0)
    print(json.dumps({"format": checked["format"], "written": res.manifest["format"], "kept": kept,
                      "after": lines()}))
    """
)


def _scenario(tmp_path, damage: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCENARIO, str(tmp_path), damage], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_format_1_snapshot_restores_and_the_process_goes_on(tmp_path):
    r = _scenario(tmp_path, "intact")
    assert r["written"] == 2 and r["format"] == 1  # dumped as today, then rewritten as before
    steps = [int(ln.removeprefix("step=")) for ln in r["after"][r["kept"]:]]
    assert len(steps) >= 5 and steps == list(range(steps[0], steps[0] + len(steps)))  # the restored copy ran on


def test_a_damaged_format_1_snapshot_is_refused_by_its_sha256(tmp_path):
    r = _scenario(tmp_path, "damaged")
    assert r["format"] == 1 and "fails its SHA-256 check; take a new snapshot" in r["error"], r
    assert "\n" not in r["error"]
