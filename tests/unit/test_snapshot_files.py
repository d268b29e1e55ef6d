"""Files a rank keeps appending to after a leave-running snapshot (logs, metrics).

A whole-job snapshot leaves the job running, so by the time it is restored the rank's log has
grown, or been rotated or removed. What CRIU 4.1.1 does then, with torchpass's own dump and
restore calls (torchpass.checkpoint.criu, the options a migration uses) on a real process that
appends a line per step to a file opened in append mode, dumped leave-running, left to write on,
then killed and restored from the snapshot:

* the file grew: the restore succeeds; the restored copy writes on from the snapshot's step,
  after the file's current end: every line written before stays, the steps since the snapshot
  appear again after them (the last line per step is the restored run's);
* the file was truncated (``copytruncate`` log rotation): the restore succeeds, the restored copy
  writes from the start of the now empty file;
* the file was removed: the restore fails, with CRIU's line naming the file (one CheckpointError;
  nothing runs).

The same scenario restores a snapshot whose manifest is rewritten as tpassd wrote it before BLAKE3
(format 1: each image file's SHA-256), with criu.restore(checked=...), which checks the digests
while CRIU restores, as the restore wrapper does: whole-job snapshots may be days old when they are
restored, so this version must take the manifests of the one before.

The scenario runs in a child process that is a child subreaper (as the restore wrapper is), so
that the restored process, detached by ``criu restore -d``, is its child and is reaped.
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
    tmp, mode = Path(sys.argv[1]), sys.argv[2]
    log = tmp / "train.log"
    APP = ("import sys, time\nf = open(sys.argv[1], 'a')\ni = 0\nwhile True:\n"
           "    f.write(f'step={i}\\n'); f.flush(); i += 1; time.sleep(0.05)\n")

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
    first = len(lines())
    criu.dump(c, app.pid, tmp / "img")  # leave-running
    last = len(lines())
    until(lambda: len(lines()) >= last + 5, "steps after the snapshot")
    app.kill(); app.wait()
    before = lines()
    if mode == "truncated":
        os.truncate(log, 0)
    elif mode == "removed":
        log.unlink()
    checked = None
    if mode.startswith("format1"):  # the manifest as tpassd wrote it before BLAKE3
        img = tmp / "img"
        m = json.loads((img / "manifest.json").read_text())
        files = {n: {"size": f["size"], "sha256": hashlib.sha256((img / n).read_bytes()).hexdigest()}
                 for n, f in m["files"].items()}
        (img / "manifest.json").write_text(json.dumps({"format": 1, "files": files, "meta": m["meta"]}))
        if mode == "format1-damaged":
            big = max(files, key=lambda n: files[n]["size"])
            data = bytearray((img / big).read_bytes())
            data[len(data) // 2] ^= 0xFF
            (img / big).write_bytes(data)
        checked = manifest.read_manifest(img)
    kept = len(lines())
    try:
        pid, _ = criu.restore(c, tmp / "img", checked=checked)
    except CheckpointError as exc:
        print(json.dumps({"error": str(exc), "format": checked and checked["format"]}))
        raise SystemExit(0)
    until(lambda: len(lines()) >= kept + 5, "steps of the restored copy")
    os.kill(pid, 9); os.waitpid(pid, 0)
    print(json.dumps({"snapshot_steps": [first, last], "before": before, "after": lines(),
                      "format": checked and checked["format"]}))
    """
)


def _scenario(tmp_path, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCENARIO, str(tmp_path), mode], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _step(line: str) -> int:
    return int(line.removeprefix("step="))


def test_a_log_that_grew_after_the_snapshot_is_appended_to_from_the_snapshots_step(tmp_path):
    r = _scenario(tmp_path, "grown")
    first, last = r["snapshot_steps"]
    before, after = r["before"], r["after"]
    assert len(before) >= last + 5  # the source wrote on after the snapshot
    assert after[:len(before)] == before  # nothing written before the restore is lost or overwritten
    resumed = _step(after[len(before)])
    assert first <= resumed <= last, (first, last, resumed)  # the snapshot's step, written again
    assert [_step(ln) for ln in after[len(before):]] == list(range(resumed, resumed + len(after) - len(before)))


def test_a_truncated_log_is_written_from_its_start(tmp_path):
    r = _scenario(tmp_path, "truncated")
    first, last = r["snapshot_steps"]
    resumed = _step(r["after"][0])
    assert first <= resumed <= last, (first, last, resumed)
    assert [_step(ln) for ln in r["after"]] == list(range(resumed, resumed + len(r["after"])))


def test_a_removed_log_fails_the_restore_in_one_line_naming_the_file(tmp_path):
    r = _scenario(tmp_path, "removed")
    assert "Can't open file" in r["error"] and "train.log" in r["error"], r["error"]
    assert r["error"].startswith("criu restore from ") and "\n" not in r["error"]


def test_a_format_1_snapshot_restores_and_the_process_goes_on(tmp_path):
    r = _scenario(tmp_path, "format1")
    assert r["format"] == 1  # dumped as today (format 2), then rewritten as before
    first, last = r["snapshot_steps"]
    before, after = r["before"], r["after"]
    assert after[:len(before)] == before
    steps = [_step(ln) for ln in after[len(before):]]
    assert len(steps) >= 5 and first <= steps[0] <= last and steps == list(range(steps[0], steps[0] + len(steps)))


def test_a_damaged_format_1_snapshot_is_refused_by_its_sha256(tmp_path):
    r = _scenario(tmp_path, "format1-damaged")
    assert r["format"] == 1 and "fails its SHA-256 check; take a new snapshot" in r["error"], r
    assert "\n" not in r["error"]
