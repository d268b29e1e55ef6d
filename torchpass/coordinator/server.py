"""The coordinator's sockets and main loop (all I/O; decisions live elsewhere)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import zmq

from torchpass import wire, zmqio
from torchpass.coordinator.state import JobState, RankState
from torchpass.errors import RemoteError, SlurmError, TorchpassError

log = structlog.get_logger("torchpass.coordinator")


def _mc():
    from torchpass.coordinator import machine

    return machine


class Conflict(TorchpassError):
    code = "conflict"


class NotFound(TorchpassError):
    code = "not_found"


class CoordinatorServer:
    """Serves one job. ``clock`` is monotonic seconds, ``wall`` epoch seconds."""

    def __init__(
        self,
        job: JobState,
        *,
        bind_address: str = "0.0.0.0",
        port: int = 0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        context: zmq.Context | None = None,
        driver=None,
        owner_uid: int | None = None,
        munge_socket: str | None = None,
    ):
        self.job = job
        self.driver = driver  # executor.Driver: migration decisions and actions (None: report only)
        self.owner_uid = os.getuid() if owner_uid is None else owner_uid
        self.munge_socket = munge_socket
        self.clock = clock
        self.wall = wall
        self.ctx = context or zmq.Context.instance()
        self.sock, self.port = zmqio.bind_router(self.ctx, bind_address, port)
        self.counters: dict[str, int] = {}
        self._stop = threading.Event()
        self.handlers: dict[str, zmqio.Handler] = {
            "rank.register": self._on_register,
            "rank.progress": self._on_progress,
            "job.status": self._on_status,
            "job.events": self._on_events,
            "rank.armed": self._on_armed,
            "rank.quiesced": self._on_quiesced,
            "rank.resumed": self._on_resumed,
            "job.migrate": self._on_migrate,
        }

    # --- handlers ------------------------------------------------------------
    def _check_job(self, body: dict[str, Any]) -> None:
        if body["job_id"] != self.job.job_id:
            raise NotFound(f"this coordinator serves job {self.job.job_id}, not {body['job_id']}")

    def _on_register(self, msg: wire.Message) -> dict[str, Any]:
        b = msg.body
        self._check_job(b)
        if not 0 <= b["rank"] < b["world_size"]:
            raise RemoteError("bad_request", f"rank {b['rank']} outside world size {b['world_size']}")
        if self.job.world_size is not None and b["world_size"] != self.job.world_size:
            raise Conflict(f"world size {b['world_size']} differs from the job's {self.job.world_size}")
        self.job.world_size = b["world_size"]
        now = self.clock()
        prev = self.job.ranks.get(b["rank"])
        self.job.ranks[b["rank"]] = RankState(
            rank=b["rank"], node=b["node"], pid=b["pid"], world_size=b["world_size"],
            generation=b.get("generation") or 0, registered_at=now, last_report=now,
            step=prev.step if prev else -1, collectives=prev.collectives if prev else 0,
        )
        if prev is None or prev.node != b["node"] or prev.pid != b["pid"]:
            self.job.record(self.wall(), "rank.registered", f"rank {b['rank']} on {b['node']} (pid {b['pid']})",
                            rank=b["rank"], node=b["node"], pid=b["pid"])
            log.info("rank registered", job_id=self.job.job_id, rank=b["rank"], node=b["node"], pid=b["pid"])
        self._feed(_mc().RankRegistered(b["rank"], b["node"], b["world_size"]))
        return self._with_command(b["rank"], {"generation": self.job.ranks[b["rank"]].generation})

    def _on_progress(self, msg: wire.Message) -> dict[str, Any]:
        b = msg.body
        self._check_job(b)
        r = self.job.ranks.get(b["rank"])
        if r is None:
            raise NotFound(f"rank {b['rank']} has not registered with job {self.job.job_id}")
        r.step = b["step"]
        r.collectives = b["collectives"]
        if b.get("node"):
            r.node = b["node"]
        r.last_report = self.clock()
        self._feed(_mc().RankProgress(b["rank"], b["collectives"], b["step"], b.get("node"),
                                      b.get("boundary", -1), b.get("boundary_step", -1)), decide=False)
        return self._with_command(b["rank"], {})

    # --- migration (driver) ---------------------------------------------------
    def _feed(self, outcome, decide: bool = True) -> None:
        if self.driver is None:
            return
        if decide:
            self.driver.feed(outcome)
        else:  # frequent progress reports: decided on the next tick
            self.driver.post(outcome)

    def _with_command(self, rank: int, result: dict[str, Any]) -> dict[str, Any]:
        ex = self.driver.executor if self.driver is not None else None
        cmd = ex.command_for(rank) if ex is not None else None
        if cmd is not None:
            result = {**result, "command": cmd}
        return result

    def _rank(self, b: dict[str, Any]) -> RankState:
        self._check_job(b)
        r = self.job.ranks.get(b["rank"])
        if r is None:
            raise NotFound(f"rank {b['rank']} has not registered with job {self.job.job_id}")
        r.last_report = self.clock()
        return r

    def _on_armed(self, msg: wire.Message) -> dict[str, Any]:
        b = msg.body
        self._rank(b)
        if self.driver is not None and self.driver.executor is not None:
            self.driver.executor.acknowledge(b["rank"], "pause", b["generation"], b["at"])
        self._feed(_mc().Armed(b["rank"], b["at"], b["generation"], b["accepted"], b["collectives"]))
        return self._with_command(b["rank"], {})

    def _on_quiesced(self, msg: wire.Message) -> dict[str, Any]:
        b = msg.body
        self._rank(b).collectives = b["collectives"]
        log.info("rank quiesced", rank=b["rank"], generation=b["generation"], collectives=b["collectives"],
                 hold=b["hold"], sockets=b["sockets"], drain_s=b["drain_s"])
        self._feed(_mc().Quiesced(b["rank"], b["generation"], b["collectives"], float(b.get("drain_s") or 0.0)))
        return self._with_command(b["rank"], {})

    def _on_resumed(self, msg: wire.Message) -> dict[str, Any]:
        b = msg.body
        r = self._rank(b)
        r.node, r.generation, r.collectives = b["node"], b["generation"], b["collectives"]
        if self.driver is not None and self.driver.executor is not None:
            self.driver.executor.acknowledge(b["rank"], "resume", b["generation"])
        log.info("rank resumed", rank=b["rank"], generation=b["generation"], node=b["node"], moved=b["moved"],
                 rebuild_s=b["rebuild_s"], cancelled=b.get("cancelled", False))
        self._feed(_mc().Resumed(b["rank"], b["generation"], b["node"], bool(b.get("cancelled", False))))
        return self._with_command(b["rank"], {})

    def _on_migrate(self, msg: wire.Message) -> dict[str, Any]:
        from torchpass import auth

        target = f"job:{self.job.job_id}"
        ident = auth.verify(msg.auth, auth.request_digest(msg.type, msg.body, target),
                            self.munge_socket or auth.default_socket())
        if ident.uid not in (0, self.owner_uid):
            raise auth.AuthFailure("forbidden", f"uid {ident.uid} does not own job {self.job.job_id}")
        if self.driver is None:
            raise RemoteError("unavailable", f"the coordinator of job {self.job.job_id} runs without migrations")
        node, to = msg.body["node"], msg.body.get("to")
        mid = self.driver.accept_operator(node, to)  # OperatorRejected carries the wire code
        st = self.driver.state
        ahead = ([st.migration.id] if st.migration else []) + [r.id for r in st.operator_requests if r.id != mid]
        self.job.record(self.wall(), "migration.requested",
                        f"{mid}: operator (uid {ident.uid}) asked to move {node}" + (f" to {to}" if to else ""),
                        migration=mid, node=node, to=to, uid=ident.uid)
        self.driver.decide()
        return {"migration": mid, "node": node, "to": to, "queued_behind": ahead}

    def _on_status(self, msg: wire.Message) -> dict[str, Any]:
        st = self.job.status(self.clock())
        st["coordinator"] = {"pid": os.getpid(), "port": self.port, "counters": dict(self.counters)}
        return st

    def _on_events(self, msg: wire.Message) -> dict[str, Any]:
        since = msg.body.get("since_seq") or 0
        return {"events": [e.as_dict() for e in self.job.events if e.seq > since]}

    # --- loop --------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def serve(self, *, tick: Callable[[], bool] | None = None, tick_interval_s: float = 1.0) -> None:
        """Serve until stop() or until ``tick`` returns False (the job is gone)."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        next_tick = self.clock()
        try:
            while not self._stop.is_set():
                if tick is not None and self.clock() >= next_tick:
                    if not tick():
                        break
                    next_tick = self.clock() + tick_interval_s
                for sock, _ in poller.poll(100 if self.driver is None else 20):
                    zmqio.serve_one(sock, self.handlers, counters=self.counters)
                if self.driver is not None:
                    try:
                        self.driver.pump()
                    except Exception:  # noqa: BLE001 - never stop serving the job over a bug
                        log.exception("driver error")
        finally:
            if self.driver is not None and self.driver.executor is not None:
                self.driver.executor.close()
            self.sock.close(linger=0)


def job_liveness_check(client, job_id: int, *, max_failures: int = 30) -> Callable[[], bool]:
    """A tick that is False once slurmctld says the job has ended.

    Slurm being briefly unreachable is not the job ending: only after
    ``max_failures`` consecutive failed queries does the coordinator give up.
    """
    failures = 0

    def tick() -> bool:
        nonlocal failures
        try:
            job = client.job(job_id)
        except (SlurmError, TorchpassError) as exc:
            failures += 1
            log.warning("cannot query slurm for the job", job_id=job_id, error=str(exc), failures=failures)
            return failures < max_failures
        failures = 0
        if job is None or not job.active:
            log.info("job has ended; coordinator exits", job_id=job_id, state=job.state if job else "gone")
            return False
        return True

    return tick


def write_registration(state_dir: Path, job_id: int, info: dict[str, Any]) -> Path:
    """Record where this job's coordinator listens, for tpassctl on login nodes."""
    job_dir = Path(state_dir) / "jobs" / str(job_id)
    job_dir.mkdir(parents=True, exist_ok=True)
    path = job_dir / "coordinator.json"
    tmp = job_dir / f".coordinator.json.{os.getpid()}"
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, path)
    return path
