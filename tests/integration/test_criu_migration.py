"""Live migration of a real gloo DDP rank between network namespaces.

Rank 0 runs in namespace N0, rank 1 (under rankwrap, PID 1 of its own PID
namespace) in namespace A. The MiniCoordinator pauses both at collective T
with a hold file for rank 1; tpassd's checkpoint service (the code tpassd
runs: torchpass.checkpoint.service) dumps rank 1 from A's namespaces and
leaves it running, held; it verifies the snapshot; rankwrap --restore brings
it back inside namespace B; the service kills the source copy; the hold file
appears (the coordinator's Resume); the ranks rebuild the group and finish. The per-step losses (float.hex) must equal a
fault-free run, and the job's output must have no gap or duplicate.

Needs root, iproute2 and CRIU >= 4.0 (the project's system dependencies).
Addresses: TORCHPASS_TEST_MIGRATION_SUBNET (default 10.81.200), only inside
namespaces and a bridge this test creates and removes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchpass import auth, layout, wire
from torchpass.checkpoint import criu, manifest
from torchpass.checkpoint.service import CheckpointService
from torchpass.runtime import boot_dir
from torchpass.runtime.testing import MiniCoordinator, free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train_ddp.py"
SUBNET = os.environ.get("TORCHPASS_TEST_MIGRATION_SUBNET", "10.81.200")
STEPS = 30
ARGS = ["--steps", str(STEPS), "--params", "1M", "--sleep", "0.03"]
JOB = 8181


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check)


class Net:
    """A bridge with one veth'd network namespace per 'node'."""

    def __init__(self, tag: str, nodes: dict[str, str]):
        self.bridge = f"tpb{tag}"
        self.nodes = {f"tpm{tag}{n}": (n, host) for n, host in nodes.items()}
        self.made: list[tuple[str, str]] = []

    def up(self) -> None:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        self.made.append(("link", self.bridge))
        sh("ip", "addr", "add", f"{SUBNET}.1/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for ns, (short, host) in self.nodes.items():
            sh("ip", "netns", "add", ns)
            self.made.append(("netns", ns))
            peer = f"{ns}p"[-15:]
            sh("ip", "link", "add", "eth0x", "netns", ns, "type", "veth", "peer", "name", peer)
            self.made.append(("link", peer))
            sh("ip", "link", "set", peer, "master", self.bridge, "up")
            sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{host}/24", "dev", "eth0x")
            sh("ip", "-n", ns, "link", "set", "eth0x", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")

    def ns(self, short: str) -> str:
        return next(ns for ns, (s, _h) in self.nodes.items() if s == short)

    def down(self) -> None:
        for kind, name in reversed(self.made):
            if kind == "netns":
                sh("ip", "netns", "del", name, check=False)
            else:
                sh("ip", "link", "del", name, check=False)


@pytest.fixture
def net():
    if os.geteuid() != 0:
        pytest.fail("this integration test needs root (network namespaces, CRIU)")
    n = Net(f"{os.getpid() % 10000}", {"n0": "10", "a": "11", "b": "12"})
    try:
        n.up()
        yield n
    finally:
        n.down()


def rank_env(rank: int, port: int, runtime: bool, coordinator: str | None, master: str,
             state_dir: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHPASS_", "SLURM_", "PYTHON"))}
    env.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR=master, MASTER_PORT=str(port),
               PYTHONPATH=boot_dir(), TORCHPASS_JOB_ID=str(JOB), TORCHPASS_PROGRESS_INTERVAL="0.05",
               TORCHPASS_DEBUG="1")
    if state_dir is not None:  # a rank takes a hold file only where the layout puts it in STATE_DIR
        env["TORCHPASS_STATE_DIR"] = str(state_dir)
    if not runtime:
        env["TORCHPASS_RUNTIME"] = "0"
    if coordinator:
        env["TORCHPASS_COORDINATOR"] = coordinator
    return env


def reference(tmp: Path) -> list[str]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(TRAIN), *ARGS], env=rank_env(r, port, False, None, "127.0.0.1"),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              stdin=subprocess.DEVNULL) for r in range(2)]
    outs = [p.communicate(timeout=300)[0].splitlines() for p in procs]
    assert all(p.returncode == 0 for p in procs) and outs[0] == outs[1] and len(outs[0]) == STEPS
    return outs[0]


@pytest.mark.parametrize("timens", [False, True], ids=["pidns", "pidns+timens"])
def test_rank_migrates_between_namespaces_bit_identical(net, tmp_path, timens):
    c = criu.find_criu()
    ref = reference(tmp_path)
    state = layout.rank_records_dir(tmp_path / "state", JOB)  # where tpassd looks: STATE_DIR/jobs/J/ranks
    images = layout.images_dir(tmp_path / "images", JOB, 1, 1)
    wake = layout.hold_file(tmp_path / "state", JOB, "m1", 1)
    master = f"{SUBNET}.10"
    port = 29000 + os.getpid() % 1000
    procs: list[subprocess.Popen] = []
    files = {}

    def start(name, argv, ns, env, **kw):
        files[name] = tmp_path / f"{name}.out"
        p = subprocess.Popen(["nsenter", f"--net=/run/netns/{net.ns(ns)}", "--", *argv], env=env,
                             stdout=open(files[name], "w"), stderr=open(tmp_path / f"{name}.err", "w"),
                             stdin=subprocess.DEVNULL, **kw)
        procs.append(p)
        return p

    with MiniCoordinator(2, JOB, address=f"{SUBNET}.1") as coord:
        try:
            start("rank0", [sys.executable, str(TRAIN), *ARGS], "n0",
                  rank_env(0, port, True, coord.endpoint, master, tmp_path / "state"))
            src = start("rank1", [sys.executable, "-m", "torchpass.checkpoint.rankwrap", "--state-dir", str(state),
                                  *(["--timens"] if timens else []), "--", sys.executable, str(TRAIN), *ARGS], "a",
                        rank_env(1, port, True, coord.endpoint, master, tmp_path / "state"))
            coord.wait_registered(timeout=120)
            coord.wait_collectives(40, timeout=120)
            t0 = time.monotonic()
            at, gen = coord.pause(margin=12, hold_files={1: str(wake)})
            q = coord.wait_quiesced()
            t_quiesced = time.monotonic()
            assert q[1]["hold"] and q[1]["collectives"] == at
            rec = json.loads(layout.rank_record(state, JOB, 1).read_text())
            assert rec["wrapper_pid"] == src.pid
            # tpassd's service; what Slurm would list for the job on this node: the test's tasks' trees
            svc = CheckpointService(tmp_path / "images", socket.gethostname(), state_dir=tmp_path / "state",
                                    criu_binary=c.path, job_owner=lambda j: 0,
                                    job_pids=lambda j: {p for x in procs for p in criu.tree_pids(x.pid)})
            root = auth.Identity(uid=0, gid=0)
            body = {"job_id": JOB, "rank": 1, "rank_dir": str(state)}
            handoff = layout.handoff(state, JOB, 1)
            # tpassd.snapshot op=dump on the source node: dumped, left running (held)
            dumped = svc.snapshot(wire.Message("tpassd.snapshot", {**body, "op": "dump", "generation": gen}), root)
            assert dumped["images"] == str(images)
            assert handoff.read_text() == "moved\n"
            assert os.path.exists(f"/proc/{rec['pid']}")  # still alive, held: a rollback resumes it in place
            assert oct(images.stat().st_mode & 0o777) == "0o700"
            # tpassd.restore op=verify on the target node
            verified = svc.restore(wire.Message("tpassd.restore", {**body, "op": "verify", "images": dumped["images"],
                                                                   "checksum": dumped["checksum"]}), root)
            assert verified["files"] >= 1
            # the restore step on the target node (here: inside namespace B), as the executor starts it
            dst = start("rank1.restored", [sys.executable, "-m", "torchpass.checkpoint.rankwrap", "--restore",
                                           dumped["images"], "--state-dir", str(state)],
                        "b", rank_env(1, port, True, None, master, tmp_path / "state"))
            deadline = time.monotonic() + 120
            while json.loads(layout.rank_record(state, JOB, 1).read_text()).get("restored_from") != dumped["images"]:
                assert dst.poll() is None and time.monotonic() < deadline, "the restore wrapper's record"
                time.sleep(0.02)
            # tpassd.snapshot op=kill on the source node: the source copy dies, its wrapper sees a hand-off
            killed = svc.snapshot(wire.Message("tpassd.snapshot", {**body, "op": "kill", "pid": rec["pid"]}), root)
            assert killed["killed"] is True and not images.exists()  # the images are discarded
            assert handoff.read_text() == "moved\n"
            # the coordinator's Resume: the hold file appears once the source copy is dead
            wake.parent.mkdir(parents=True, exist_ok=True)
            wake.touch()
            # the restored rank wakes, reconnects from namespace B and asks for its command
            coord.resume(gen, master, port + 1)
            res = coord.wait_resumed(gen, timeout=120)
            t_resumed = time.monotonic()
            assert res[1]["moved"] is True and res[0]["moved"] is False
            assert res[1]["collectives"] == at
            for p in procs:
                p.wait(timeout=300)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    errs = {n: (tmp_path / f"{n}.err").read_text()[-2000:] for n in files}
    assert procs[0].returncode == 0, errs
    assert dst.returncode == 0, errs
    assert src.returncode == 0, errs  # the hand-off is not a failure: it waited for the moved rank's exit
    # rank 1's output: the source wrapper's part, then the restored part, no gap, no duplicate
    moved_lines = files["rank1"].read_text().splitlines() + files["rank1.restored"].read_text().splitlines()
    assert moved_lines == ref
    assert files["rank0"].read_text().splitlines() == ref
    assert files["rank1.restored"].read_text().splitlines()  # steps really ran after the restore
    print(f"\nmigration: T={at} image={dumped['bytes'] / 1e6:.1f} MB dump={dumped['criu_dump_s']:.2f}s "
          f"quiesce={t_quiesced - t0:.2f}s pause-to-resumed={t_resumed - t_quiesced:.2f}s")


def test_corrupt_snapshot_restores_nothing(net, tmp_path):
    """A damaged image directory: rankwrap --restore exits 1 with one clear line, no process appears."""
    d = tmp_path / "img"
    d.mkdir(mode=0o700)
    (d / "core-1.img").write_bytes(b"\0" * 4096)
    manifest.write_manifest(d, {"job": JOB, "rank": 1})
    (d / "core-1.img").write_bytes(b"\1" * 4096)
    r = subprocess.run(["nsenter", f"--net=/run/netns/{net.ns('b')}", "--", sys.executable, "-m",
                        "torchpass.checkpoint.rankwrap", "--restore", str(d), "--state-dir", str(tmp_path / "s")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        f"torchpass: snapshot {d} is corrupt: core-1.img fails its BLAKE3 check; take a new snapshot"]
    assert not (d / "restored.pid").exists()
