"""A minimal coordinator for the rank runtime: enough of the pause/resume
protocol to drive real ranks in tests and by hand, and a reference for the
job coordinator (torchpass/coordinator), which owns the real state machine.

It serves the rank.* messages of torchpass.wire from a ROUTER socket and
returns each rank's pending command in every reply until the rank
acknowledges it (rank.armed for pause, rank.resumed for resume).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import zmq

from torchpass import envnames, wire, zmqio


@dataclass
class RankView:
    rank: int
    node: str = ""
    pid: int = 0
    collectives: int = 0
    step: int = 0
    generation: int = 0
    armed: tuple[int, int, bool] | None = None  # (at, generation, accepted)
    quiesced: dict | None = None
    resumed: dict | None = None
    command: dict | None = None
    unprotected: str = ""  # why the rank refuses pauses (its reports say), "" while it does not
    history: list = field(default_factory=list)
    compute: dict = field(default_factory=dict)  # step -> its compute time (rank.progress compute_s)


class JobUnprotected(RuntimeError):
    """A pause was refused by unprotected ranks; cancel it with resume(generation, ...)."""

    def __init__(self, generation: int, reasons: dict[int, str]):
        super().__init__(f"pause of generation {generation} refused: {reasons}")
        self.generation = generation
        self.reasons = reasons


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (``bind(0)``), for a test's
    rendezvous store. (Drawing at random from 20000-32767 instead made the plain-torch
    FSDP2 reference run abort at exit, "terminate called without an active exception",
    in 2 of 23 runs against 0 of 23 with bind(0); the cause was not found.)"""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MiniCoordinator:
    def __init__(self, world_size: int, job_id: int, address: str = "127.0.0.1", port: int = 0):
        self.world_size = world_size
        self.job_id = job_id
        self._ctx = zmq.Context()
        self._sock, self.port = zmqio.bind_router(self._ctx, address, port)
        self.endpoint = f"tcp://{address}:{self.port}"
        self.ranks: dict[int, RankView] = {}
        self._lock = threading.Condition()
        self._stop = False
        self.generation = 0
        self._handlers = {
            "rank.register": self._register,
            "rank.progress": self._progress,
            "rank.armed": self._armed,
            "rank.quiesced": self._quiesced,
            "rank.resumed": self._resumed,
            "rank.checkpoint": self._checkpoint,
        }
        self.checkpoints: list[dict] = []  # rank.checkpoint bodies, in arrival order
        self._thread = threading.Thread(target=self._serve, name="mini-coordinator", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- serving ------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop:
            if self._sock.poll(50, zmq.POLLIN):
                zmqio.serve_one(self._sock, self._handlers, bundles=True)  # ranks behind a node relay

    def _view(self, body) -> RankView:
        if body["job_id"] != self.job_id:
            from torchpass.errors import TorchpassError

            err = TorchpassError(f"job {body['job_id']} is not served here")
            err.code = "not_found"
            raise err
        return self.ranks.setdefault(body["rank"], RankView(body["rank"]))

    def _reply(self, v: RankView) -> dict:
        return {"command": v.command} if v.command else {}

    def _register(self, msg):
        with self._lock:
            v = self._view(msg.body)
            v.node, v.pid = msg.body["node"], msg.body["pid"]
            v.generation = msg.body.get("generation") or 0
            v.unprotected = msg.body.get("unprotected") or v.unprotected
            v.history.append(("register", msg.body))
            self._lock.notify_all()
            return self._reply(v)

    def _progress(self, msg):
        with self._lock:
            v = self._view(msg.body)
            v.collectives = max(v.collectives, msg.body["collectives"])
            v.step = msg.body["step"]
            v.node = msg.body.get("node") or v.node
            v.unprotected = msg.body.get("unprotected") or v.unprotected
            figures, last = msg.body.get("compute_s") or [], msg.body.get("compute_step", -1)
            v.compute.update({last - len(figures) + 1 + i: f for i, f in enumerate(figures)})
            self._lock.notify_all()
            return self._reply(v)

    def _armed(self, msg):
        b = msg.body
        with self._lock:
            v = self._view(b)
            v.collectives = max(v.collectives, b["collectives"])
            v.armed = (b["at"], b["generation"], b["accepted"])
            v.unprotected = b.get("unprotected") or v.unprotected
            v.history.append(("armed", b))
            if v.command and v.command.get("command") == wire.COMMAND_PAUSE and v.command["at"] == b["at"]:
                v.command = None
            self._lock.notify_all()
            return self._reply(v)

    def _quiesced(self, msg):
        with self._lock:
            v = self._view(msg.body)
            v.quiesced = dict(msg.body)
            v.history.append(("quiesced", msg.body))
            self._lock.notify_all()
            return self._reply(v)

    def _resumed(self, msg):
        b = msg.body
        with self._lock:
            v = self._view(b)
            v.resumed = dict(b)
            v.generation = b["generation"]
            v.node = b["node"]
            v.history.append(("resumed", b))
            if v.command and v.command.get("command") == wire.COMMAND_RESUME:
                v.command = None
            if b.get("cancelled"):
                self.generation = b["generation"]  # nothing was rebuilt
            self._lock.notify_all()
            return self._reply(v)

    def _checkpoint(self, msg):
        with self._lock:
            v = self._view(msg.body)
            self.checkpoints.append(dict(msg.body))
            self._lock.notify_all()
            return self._reply(v)

    # -- driving --------------------------------------------------------------------
    def _wait(self, pred, timeout: float, what: str):
        end = time.monotonic() + timeout
        with self._lock:
            while not pred():
                left = end - time.monotonic()
                if left <= 0:
                    seen = {r: (v.collectives, v.armed, bool(v.quiesced)) for r, v in self.ranks.items()}
                    raise TimeoutError(f"mini coordinator: timed out waiting for {what}: {seen}")
                self._lock.wait(min(left, 0.1))

    def wait_registered(self, timeout: float = 60) -> None:
        self._wait(lambda: len(self.ranks) == self.world_size, timeout, "all ranks to register")

    def wait_collectives(self, n: int, timeout: float = 60) -> None:
        self._wait(lambda: all(v.collectives >= n for v in self.ranks.values()), timeout, f"{n} collectives")

    def pause(self, margin: int, hold_files: dict[int, str] | None = None, timeout: float = 60,
              at: int | None = None) -> tuple[int, int]:
        """Arm every rank at the same T (``at``, or max(collectives) + margin);
        re-arm at max(collectives) + margin if some rank was already past it.
        Returns (T, next generation). Raises JobUnprotected when a rank refused
        because it is unprotected (no later T would do)."""
        gen = self.generation + 1
        with self._lock:
            if at is None:
                at = max(v.collectives for v in self.ranks.values()) + margin
        while True:
            with self._lock:
                for r, v in self.ranks.items():
                    v.armed, v.quiesced, v.resumed = None, None, None
                    cmd = {"command": wire.COMMAND_PAUSE, "at": at, "generation": gen}
                    if hold_files and r in hold_files:
                        cmd["hold_file"] = hold_files[r]
                    v.command = cmd
            self._wait(lambda: all(v.armed and v.armed[0] == at for v in self.ranks.values()), timeout, "arms")
            with self._lock:
                if all(v.armed[2] for v in self.ranks.values()):
                    return at, gen
                refused = {r: v.unprotected for r, v in self.ranks.items() if not v.armed[2] and v.unprotected}
                if refused:
                    raise JobUnprotected(gen, refused)
                at = max(v.collectives for v in self.ranks.values()) + margin

    def wait_refused(self, timeout: float = 60) -> dict[int, str]:
        """Wait until every rank has refused its arm as unprotected (a pause it had
        accepted before it made a subgroup); returns the reasons."""
        self._wait(lambda: all(v.armed and not v.armed[2] and v.unprotected for v in self.ranks.values()),
                   timeout, "unprotected refusals")
        return {r: v.unprotected for r, v in self.ranks.items()}

    def wait_quiesced(self, timeout: float = 60) -> dict[int, dict]:
        self._wait(lambda: all(v.quiesced for v in self.ranks.values()), timeout, "quiesce")
        return {r: v.quiesced for r, v in self.ranks.items()}

    def resume(self, gen: int, master_addr: str, master_port: int) -> None:
        with self._lock:
            for v in self.ranks.values():
                v.command = {"command": wire.COMMAND_RESUME, "generation": gen, "master_addr": master_addr,
                             "master_port": master_port}
            self.generation = gen

    def wait_resumed(self, gen: int, timeout: float = 60) -> dict[int, dict]:
        self._wait(lambda: all(v.resumed and (v.resumed["generation"] == gen or v.resumed.get("cancelled"))
                               for v in self.ranks.values()),
                   timeout, f"resume to generation {gen}")
        return {r: v.resumed for r, v in self.ranks.items()}



def arm_self(pg, pauses: list[int], ports: list[int], fields: tuple[str, ...] = ("collectives", "sockets")) -> list:
    """In a rank script (the runtime loaded): arm the default group ``pg`` at each of ``pauses`` in
    turn, as a coordinator would, and resume each pause at the next of ``ports`` on 127.0.0.1.
    Returns the list that gets, per pause, the ``rank.quiesced`` report's ``fields``."""
    from torchpass.runtime.pg import PauseListener, Rendezvous

    log: list = []

    class SelfArmed(PauseListener):
        def on_quiesced(self, pg, info):
            log.append(tuple(info[f] for f in fields))
            pg.resume(info["next_generation"], Rendezvous("127.0.0.1", ports[len(log) - 1]))

        def on_resumed(self, pg, info):
            if len(log) < len(pauses):
                assert pg.arm(pauses[len(log)], info["generation"] + 1)

    pg.listener = SelfArmed()
    assert pg.arm(pauses[0], 1)
    return log


def hold_files(state_dir, job_id: int, migration: str, ranks) -> dict[int, str]:
    """Each rank's hold file for pause ``migration`` where the layout puts it (a rank refuses a hold
    file anywhere else), under ``state_dir`` (the ranks' TORCHPASS_STATE_DIR), its directory made."""
    from torchpass import layout

    out = {r: layout.hold_file(state_dir, job_id, migration, r) for r in ranks}
    for p in out.values():
        p.parent.mkdir(parents=True, exist_ok=True)
    return {r: str(p) for r, p in out.items()}


def launch_ranks(argv: list[str], world: int, tmp, tag: str, *, runtime: bool, env: dict | None = None,
                 job_id: int = 4343, extra_path=(), coordinator: str | None = None) -> list:
    """Start ``argv`` as ``world`` ranks on 127.0.0.1 (env:// rendezvous), the runtime
    loaded through boot/sitecustomize.py as in a job (``runtime=False``: present but
    switched off, TORCHPASS_RUNTIME=0); stdout/stderr to ``tmp/tag.R.out|err``. Their
    TORCHPASS_STATE_DIR is ``tmp`` unless ``env`` says (hold_files(tmp, ...) gives their hold files)."""
    import os
    import subprocess
    from pathlib import Path

    from torchpass.runtime import boot_dir

    tmp = Path(tmp)
    port = free_port()
    procs = []
    for r in range(world):
        e = {k: v for k, v in os.environ.items() if not k.startswith((envnames.PREFIX, "SLURM_", "PYTHON"))}
        e.update(RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 PYTHONPATH=os.pathsep.join([boot_dir(), *extra_path]), TORCHPASS_JOB_ID=str(job_id),
                 TORCHPASS_RUNTIME="1" if runtime else "0", TORCHPASS_PROGRESS_INTERVAL="0.05",
                 TORCHPASS_STATE_DIR=str(tmp), **(env or {}))
        if coordinator:
            e[envnames.COORDINATOR] = coordinator
        with open(_log(tmp, tag, r, "out"), "w") as out, open(_log(tmp, tag, r, "err"), "w") as err:
            procs.append(subprocess.Popen(argv, env=e, stdout=out, stderr=err, stdin=subprocess.DEVNULL))
    return procs


def _log(tmp, tag: str, rank: int, stream: str):
    """TMP/TAG.RANK.STREAM: a test rank's captured stdout or stderr."""
    from pathlib import Path

    return Path(tmp, f"{tag}.{rank}.{stream}")


def _reap(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def finish_ranks(procs, tmp, tag: str, timeout: float = 240) -> tuple[list[list[str]], list[str]]:
    """Wait for the ranks of ``launch_ranks`` (killed after ``timeout``); every rank must
    exit 0. Returns each rank's stdout lines and stderr text."""
    from pathlib import Path

    tmp = Path(tmp)
    try:
        for p in procs:
            p.wait(timeout)
    finally:
        _reap(procs)
    errs = [_log(tmp, tag, r, "err").read_text() for r in range(len(procs))]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}: {errs[r][-3000:]}"
    return [_log(tmp, tag, r, "out").read_text().splitlines() for r in range(len(procs))], errs


def run_ranks(script: str, world: int, tmp, tag: str, *, on_start=None, timeout: float = 240,
              **kw) -> tuple[list[list[str]], list[str]]:
    """``launch_ranks`` of ``python -c script``, ``on_start()`` while they run (drive a
    MiniCoordinator there), then ``finish_ranks``."""
    import sys

    procs = launch_ranks([sys.executable, "-c", script], world, tmp, tag, **kw)
    try:
        if on_start is not None:
            on_start()
    except BaseException:
        _reap(procs)
        raise
    return finish_ranks(procs, tmp, tag, timeout)
