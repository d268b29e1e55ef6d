"""torchpass.checkpoint: criu detection, image manifests, refusal paths, and
the CUDA checkpoint wrapper's error paths and call sequence (no GPU here)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import blake3
import pytest

from torchpass import auth, layout, wire
from torchpass.checkpoint import criu, cuda, manifest
from torchpass.checkpoint.service import CheckpointService
from torchpass.errors import CheckpointError, DependencyError, RemoteError


def fake_criu(tmp_path: Path, version_line: str) -> Path:
    p = tmp_path / "criu"
    log = tmp_path / "criu.calls"
    p.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\necho '{version_line}'\n")
    p.chmod(0o755)
    return p


@pytest.mark.parametrize(
    "text,want",
    [("Version: 4.1.1\n", (4, 1, 1)), ("Version: 3.17\nGitID: v3.17\n", (3, 17)), ("criu 4.1", None), ("", None)],
)
def test_parse_version(text, want):
    assert criu.parse_version(text) == want


def test_installed_criu_is_found_and_new_enough():
    c = criu.find_criu()
    assert c.version[:2] >= (4, 0) and os.access(c.path, os.X_OK)


def test_old_criu_is_one_clear_line(tmp_path):
    with pytest.raises(DependencyError) as ei:
        criu.find_criu(str(fake_criu(tmp_path, "Version: 3.17")))
    msg = str(ei.value)
    assert "criu 3.17" in msg and "too old" in msg and ">= 4.0" in msg and "\n" not in msg


def test_missing_criu_is_one_clear_line(tmp_path):
    with pytest.raises(DependencyError, match=r"criu not found at .*CRIU >= 4.0"):
        criu.find_criu(str(tmp_path / "nope"))
    with pytest.raises(DependencyError, match="criu not found on PATH or in /usr/sbin"):
        criu.find_criu(which=lambda _n: None, fallbacks=(str(tmp_path / "nope"),))


def test_criu_without_version_output(tmp_path):
    with pytest.raises(DependencyError, match="printed no version"):
        criu.find_criu(str(fake_criu(tmp_path, "hello")))


def make_images(d: Path) -> None:
    d.mkdir(mode=0o700)
    (d / "core-1.img").write_bytes(os.urandom(5000))
    (d / "pages-1.img").write_bytes(os.urandom(70000))
    (d / "dump.log").write_text("log lines are not part of the manifest\n")


def test_manifest_round_trip_and_permissions(tmp_path):
    d = tmp_path / "snap"
    make_images(d)
    m = manifest.write_manifest(d, {"job": 1, "rank": 0})
    assert set(m["files"]) == {"core-1.img", "pages-1.img"}
    assert stat.S_IMODE((d / "pages-1.img").stat().st_mode) == 0o600
    assert stat.S_IMODE((d / "manifest.json").stat().st_mode) == 0o600
    assert manifest.verify_manifest(d)["meta"] == {"job": 1, "rank": 0}
    (d / "restore.log").write_text("later logs do not matter\n")
    manifest.verify_manifest(d)


@pytest.mark.parametrize(
    "damage,pattern",
    [
        (lambda d: (d / "manifest.json").unlink(), "no manifest.json: it is incomplete"),
        (lambda d: (d / "pages-1.img").unlink(), "pages-1.img is missing"),
        (lambda d: (d / "pages-1.img").write_bytes(b"x"), "pages-1.img has 1 bytes"),
        (lambda d: _flip_byte(d / "pages-1.img", 12345), "pages-1.img fails its BLAKE3 check"),
        (lambda d: (d / "manifest.json").write_text("{not json"), "manifest.json is unreadable"),
    ],
)
def test_corrupt_snapshot_is_a_clear_error_and_criu_never_runs(tmp_path, damage, pattern):
    d = tmp_path / "snap"
    make_images(d)
    manifest.write_manifest(d)
    damage(d)
    fake = criu.Criu(str(fake_criu(tmp_path, "Version: 4.1")), (4, 1))
    with pytest.raises(CheckpointError, match=pattern) as ei:
        criu.restore(fake, d)
    assert "\n" not in str(ei.value)
    assert not (tmp_path / "criu.calls").exists()  # no half-restored process: criu was not started


def _flip_byte(p: Path, off: int) -> None:
    b = bytearray(p.read_bytes())
    b[off] ^= 0x01
    p.write_bytes(bytes(b))


def _format_1_manifest(d: Path) -> None:
    """manifest.json as tpassd wrote it before BLAKE3 (format 1: each file's SHA-256)."""
    files = {p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in sorted(d.iterdir()) if p.name.endswith(".img")}
    (d / "manifest.json").write_text(json.dumps({"format": 1, "files": files, "meta": {}}))


def test_a_format_1_snapshot_still_verifies_by_its_sha256(tmp_path):
    d = tmp_path / "snap"
    make_images(d)
    _format_1_manifest(d)
    assert manifest.verify_manifest(d)["format"] == 1
    _flip_byte(d / "pages-1.img", 12345)
    with pytest.raises(CheckpointError, match="pages-1.img fails its SHA-256 check"):
        manifest.verify_manifest(d)


@pytest.mark.parametrize("edit,pattern", [
    (lambda m: {**m, "format": 3}, r"not a torchpass manifest \(format 3; this tpassd reads formats 1, 2\)"),
    (lambda m: {**m, "format": [2]}, r"not a torchpass manifest \(format \[2\];"),
    (lambda m: {**m, "format": True}, r"not a torchpass manifest \(format True;"),
    (lambda m: [m], r"not a torchpass manifest \(format None;"),
    (lambda m: {**m, "files": {**m["files"], "pages-1.img": {"size": m["files"]["pages-1.img"]["size"]}}},
     "gives no BLAKE3 digest for pages-1.img"),
    (lambda m: {**m, "files": {**m["files"], "pages-1.img": "x"}}, "gives no BLAKE3 digest for pages-1.img"),
])
def test_a_malformed_manifest_is_one_clear_line(tmp_path, edit, pattern):
    d = tmp_path / "snap"
    make_images(d)
    m = manifest.write_manifest(d)
    (d / "manifest.json").write_text(json.dumps(edit(m)))
    with pytest.raises(CheckpointError, match=pattern) as ei:
        manifest.read_manifest(d)
    assert "\n" not in str(ei.value) and "take a new snapshot" in str(ei.value)


def test_private_dir_is_0700(tmp_path):
    d = criu.make_private_dir(tmp_path / "a" / "b")
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    os.chmod(d, 0o755)
    criu.make_private_dir(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700


def test_dump_refuses_a_process_holding_a_socket(tmp_path):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    child = subprocess.Popen(
        [sys.executable, "-c", f"import socket,time; s=socket.create_connection(('127.0.0.1',{srv.getsockname()[1]})); "
                               "print('up', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        fake = criu.Criu(str(fake_criu(tmp_path, "Version: 4.1")), (4, 1))
        with pytest.raises(CheckpointError, match=rf"process {child.pid} still holds 1 socket"):
            criu.dump(fake, child.pid, tmp_path / "img", wait_no_sockets_s=0.2)
        assert not (tmp_path / "criu.calls").exists()
        assert child.poll() is None  # left running
    finally:
        child.kill()
        child.wait()
        srv.close()


def test_dump_of_a_process_reading_a_terminal_is_refused_and_it_runs_on(tmp_path):
    """stdin on a terminal (``srun --pty``): CRIU cannot dump a terminal whose other end is outside
    the tree, so a move of such a rank is refused in one line and the rank is left running
    (docs/runtime.md, "What is covered", stdin)."""
    controller, terminal = os.openpty()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=terminal,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        time.sleep(0.3)
        with pytest.raises(CheckpointError,
                           match=r"criu dump of pid \d+ failed .*tty.*the rank was left running") as ei:
            criu.dump(criu.find_criu(), proc.pid, tmp_path / "snap")
        assert "\n" not in str(ei.value)
        assert proc.poll() is None and not (tmp_path / "snap").exists()
    finally:
        proc.kill()
        proc.wait()
        os.close(controller)
        os.close(terminal)


def test_dump_wants_a_fresh_directory(tmp_path):
    d = tmp_path / "img"
    d.mkdir()
    (d / "old.img").write_text("x")
    with pytest.raises(CheckpointError, match="not empty"):
        criu.dump(criu.Criu("/bin/false", (4, 1)), os.getpid(), d)


# -- CUDA -------------------------------------------------------------------------------
def test_no_libcuda_is_a_dependency_error():
    def loader():
        raise DependencyError("libcuda not found (x): GPU ranks cannot be checkpointed on this node")

    with pytest.raises(DependencyError, match="libcuda not found"):
        cuda.CudaCheckpoint.load(loader)


def test_real_loader_on_this_machine_without_a_driver():
    # This machine has no NVIDIA driver: the real loader must say so clearly.
    if any(os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia")):
        pytest.skip("an NVIDIA driver is present: this test checks the no-driver message")
    with pytest.raises(DependencyError, match=r"libcuda not found .*driver >= 570"):
        cuda.CudaCheckpoint.load()


class FakeLib:
    """Stands in for libcuda: records calls, keeps a per-pid state machine."""

    def __init__(self, symbols=cuda.SYMBOLS, fail=None):
        self.calls = []
        self.state = cuda.ProcessState.RUNNING
        self.fail = fail or {}
        for s in symbols:
            setattr(self, s, self._fn(s))
        self.cuInit = self._fn("cuInit")

    def _fn(self, name):
        def f(*args):
            self.calls.append(name)
            if name in self.fail:
                return self.fail[name]
            S = cuda.ProcessState
            nxt = {"cuCheckpointProcessLock": (S.RUNNING, S.LOCKED),
                   "cuCheckpointProcessCheckpoint": (S.LOCKED, S.CHECKPOINTED),
                   "cuCheckpointProcessRestore": (S.CHECKPOINTED, S.LOCKED),
                   "cuCheckpointProcessUnlock": (S.LOCKED, S.RUNNING)}
            if name == "cuCheckpointProcessGetState":
                args[1]._obj.value = int(self.state)
            elif name in nxt:
                if self.state != nxt[name][0]:
                    return 401  # CUDA_ERROR_ILLEGAL_STATE
                self.state = nxt[name][1]
            return 0

        return f


def test_missing_symbols_name_the_driver_requirement():
    with pytest.raises(DependencyError, match=r"lacks cuCheckpointProcessLock.*driver >= 570"):
        cuda.CudaCheckpoint(FakeLib(symbols=cuda.SYMBOLS[1:]))


def test_suspend_and_resume_follow_the_driver_state_machine():
    lib = FakeLib()
    cc = cuda.CudaCheckpoint(lib)
    cc.suspend(4321)
    assert lib.state == cuda.ProcessState.CHECKPOINTED
    cc.resume(4321)
    assert lib.state == cuda.ProcessState.RUNNING
    order = [c for c in lib.calls if c not in ("cuInit", "cuCheckpointProcessGetState")]
    assert order == ["cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                     "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock"]


def test_failed_checkpoint_unlocks_and_raises():
    lib = FakeLib(fail={"cuCheckpointProcessCheckpoint": 2})  # CUDA_ERROR_OUT_OF_MEMORY
    cc = cuda.CudaCheckpoint(lib)
    with pytest.raises(CheckpointError, match=r"cuCheckpointProcessCheckpoint\(pid 7\) failed: CUresult 2"):
        cc.suspend(7)
    assert lib.state == cuda.ProcessState.RUNNING and lib.calls[-1] == "cuCheckpointProcessUnlock"


# -- the snapshot action's hand-off markers -------------------------------------------------
def test_failed_dump_marks_abort_and_leaves_the_rank_running(tmp_path):
    failing = tmp_path / "criu"
    failing.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'Version: 4.1.1'; exit 0; fi\n"
                       "echo 'Error (criu/cr-dump.c:1): simulated failure' > \"$5/dump.log\"; exit 1\n")
    failing.chmod(0o755)
    rank = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL,
                            env={**os.environ, "SLURM_JOB_ID": "3", "RANK": "1"})
    try:
        deadline = time.monotonic() + 10  # until sleep has exec'd, its environ is still ours
        while b"SLURM_JOB_ID=3" not in Path(f"/proc/{rank.pid}/environ").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        # The rank: this test's child; Slurm's view of the job on this node: both.
        svc = CheckpointService(tmp_path / "images", socket.gethostname(), criu_binary=str(failing),
                                state_dir=tmp_path / "state", job_owner=lambda j: 0,
                                job_pids=lambda j: {rank.pid, os.getpid()})
        rank_dir = layout.rank_records_dir(tmp_path / "state", 3)
        layout.rank_record(rank_dir, 3, 1).parent.mkdir(parents=True)
        layout.rank_record(rank_dir, 3, 1).write_text(json.dumps({"pid": rank.pid, "wrapper_pid": os.getpid()}))
        root = auth.Identity(uid=0, gid=0)

        def dump(r):
            return svc.snapshot(wire.Message("tpassd.snapshot", {"job_id": 3, "rank": r, "op": "dump",
                                                                 "generation": 1,
                                                                 "rank_dir": str(rank_dir)}), root)

        with pytest.raises(CheckpointError, match=r"criu dump of pid \d+ failed \(exit 1\): .*simulated failure"):
            dump(1)
        assert layout.handoff(rank_dir, 3, 1).read_text() == "abort\n"
        assert rank.poll() is None
        assert stat.S_IMODE((tmp_path / "images" / "job3").stat().st_mode) == 0o700
        with pytest.raises(RemoteError, match="rank 2 of job 3 does not run under rankwrap"):
            dump(2)
    finally:
        rank.kill()
        rank.wait()


def test_tail_hasher_follows_a_file_being_written(tmp_path):
    d = tmp_path / "snap"
    d.mkdir(mode=0o700)
    data = os.urandom(6 << 20)
    with manifest.TailHasher(d, min_bytes=1 << 20, chunk=1 << 18) as hasher:
        with open(d / "pages-1.img", "wb") as f:  # written front to back, like CRIU does
            for i in range(0, len(data), 1 << 19):
                f.write(data[i:i + (1 << 19)])
                f.flush()
                time.sleep(0.002)
        (d / "core-1.img").write_bytes(b"small")
        hashed = hasher.finish()
    assert hashed == {"pages-1.img": (len(data), blake3.blake3(data).hexdigest())}  # small files: at the end
    m = manifest.write_manifest(d, {"job": 1}, hashed)
    assert m["format"] == 2 and m["files"]["core-1.img"]["blake3"] == blake3.blake3(b"small").hexdigest()
    manifest.verify_manifest(d)
    # A digest that no longer covers the file (size changed) is not trusted: hashed afresh.
    with open(d / "pages-1.img", "ab") as f:
        f.write(b"more")
    m = manifest.write_manifest(d, None, hashed)
    assert m["files"]["pages-1.img"]["blake3"] == blake3.blake3(data + b"more").hexdigest()


def test_real_dump_hashes_while_criu_writes_and_the_manifest_verifies(tmp_path):
    """CRIU really writes its images front to back: the digests taken while it
    wrote match the files (the restore side's check would refuse them otherwise)."""
    c = criu.find_criu()
    out = open(tmp_path / "out", "w")
    proc = subprocess.Popen([sys.executable, "-c",
                             "import time; b = bytearray(48 << 20); b[::4096] = b'x' * (48 << 8); "
                             "time.sleep(60)"],
                            stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    try:
        time.sleep(1.0)
        res = criu.dump(c, proc.pid, tmp_path / "snap")
        assert res.bytes > 48 << 20
        big = [n for n, f in res.manifest["files"].items() if f["size"] >= 1 << 20]
        assert big, res.manifest["files"]
        manifest.verify_manifest(res.images)  # every digest, the ones taken during the dump included
        assert proc.poll() is None  # left running
    finally:
        proc.kill()
        proc.wait()
        out.close()


def _restoring_criu(tmp_path: Path, restored: int) -> criu.Criu:
    """A criu whose "restore" writes ``restored`` (a child of the caller, as criu's restored root is
    of its subreaper) to --pidfile."""
    p = tmp_path / "criu"
    p.write_text(f"#!/bin/sh\nwhile [ \"$1\" != --pidfile ]; do shift; done\necho {restored} > \"$2\"\n")
    p.chmod(0o755)
    return criu.Criu(str(p), (4, 1))


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True


def test_restore_hashes_while_criu_restores(tmp_path):
    d = tmp_path / "snap"
    make_images(d)
    manifest.write_manifest(d, {"job": 1, "rank": 0})
    m = manifest.read_manifest(d)
    sleeper = _sleeper()
    try:
        pid, _s = criu.restore(_restoring_criu(tmp_path, sleeper.pid), d, checked=m)
        assert pid == sleeper.pid and not _gone(pid)  # the check passed: the restored process lives
    finally:
        sleeper.kill()
        sleeper.wait()


def test_corrupt_snapshot_found_during_the_restore_kills_the_restored_tree(tmp_path):
    """read_manifest checks presence and sizes only; the flipped byte is found by the hash
    that runs while CRIU restores, and the restored process is killed before restore returns."""
    d = tmp_path / "snap"
    make_images(d)
    manifest.write_manifest(d, {"job": 1, "rank": 0})
    m = manifest.read_manifest(d)
    _flip_byte(d / "pages-1.img", 12345)
    sleeper = _sleeper()
    pid = sleeper.pid
    with pytest.raises(CheckpointError, match="pages-1.img fails its BLAKE3 check") as ei:
        criu.restore(_restoring_criu(tmp_path, pid), d, checked=m)
    assert "\n" not in str(ei.value)
    sleeper.wait()
    deadline = time.monotonic() + 5
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _gone(pid)
