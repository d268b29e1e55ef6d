"""The coordinator's sockets and main loop (all I/O; decisions live elsewhere).

Who may say what (docs/coordinator.md, "Authentication"):

* ``rank.*``: only the job's own ranks, proven by the job secret
  (torchpass.jobauth; refused with ``unauthenticated`` before any handler
  runs, so a forged ``rank.armed`` cannot touch a pause). A coordinator
  started without a secret (by hand) accepts them unsigned and says so in
  its log and in job.status. Each reply to a rank.* request that proved itself
  ends with the job secret's MAC over it and the request's sender and seq
  (jobauth.ReplySealer; the rank drops a reply without it), whether it comes
  at once, with a batch's command, or from a parked poll.
* ``job.status`` / ``job.events``: as Slurm's PrivateData says: when it
  hides jobs, only the job's owner or an admin (root, SlurmUser), proven by
  munge; others get ``forbidden``. Otherwise anyone.
* ``job.migrate``: the owner or an admin, proven by munge.
* ``job.snapshot``: the owner or an admin, proven by munge.
"""

from __future__ import annotations

import heapq
import json
import os
import queue
import secrets
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import zmq

from torchpass import auth, jobauth, layout, wire, zmqio
from torchpass.coordinator import contract as ct
from torchpass.coordinator import machine as mc
from torchpass.coordinator.decide_failslow import compute_figures
from torchpass.coordinator.job_record import JobState
from torchpass.coordinator.model import CoordState
from torchpass.errors import ProtocolError, RemoteError, SlurmError, TorchpassError

log = structlog.get_logger("torchpass.coordinator")


# A held task wrapper asks again this often: the decision comes with tpassd's event (milliseconds
# after the death) or when death_event_window_s passes.
DEATH_RETRY_S = 0.5


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return "unknown signal"


class Conflict(TorchpassError):
    code = "conflict"


class NotFound(TorchpassError):
    code = "not_found"


class Facts:
    """The decision state without decisions, for a coordinator that cannot migrate: rank
    reports are applied (machine.apply) so that job.status has them; nothing is decided."""

    def __init__(self, job_id: int, clock: Callable[[], float]):
        self.state = CoordState(job_id=job_id)
        self.clock = clock

    def feed(self, outcome: Any) -> None:
        self.state = mc.apply(self.state, outcome, self.clock())

    post = feed


# Backpressure: every reply to a rank says how often it should report
# ("report_every_s") and, while paused at T, poll ("paused_every_s"); the rank takes the larger
# of its own setting and these. The coordinator's load grows with the ranks, so the intervals do:
# the job's ranks together send about PROGRESS_BUDGET_PER_S progress reports (PAUSED_BUDGET_PER_S
# polls while paused), times a factor that grows while serving takes more than BUSY_HIGH of the
# serve thread's time (measured each second) and shrinks back below BUSY_LOW.
PROGRESS_BUDGET_PER_S = 1500.0
PAUSED_BUDGET_PER_S = 2500.0
BUSY_HIGH, BUSY_LOW = 0.6, 0.3
PACE_FACTOR_MAX = 4.0


class Pace:
    """The backpressure hints of the replies (see PROGRESS_BUDGET_PER_S)."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.factor = 1.0
        self._busy_s = 0.0
        self._since = clock()

    def busy(self, seconds: float) -> None:
        """The serve thread spent ``seconds`` serving a batch."""
        self._busy_s += seconds
        now = self.clock()
        span = now - self._since
        if span < 1.0:
            return
        frac = self._busy_s / span
        if frac > BUSY_HIGH:
            self.factor = min(PACE_FACTOR_MAX, self.factor * 1.5)
        elif frac < BUSY_LOW:
            self.factor = max(1.0, self.factor / 1.5)
        self._busy_s, self._since = 0.0, now

    def hint(self, world: int | None) -> dict[str, float]:
        if not world:
            return {}
        return {"report_every_s": round(world / PROGRESS_BUDGET_PER_S * self.factor, 3),
                "paused_every_s": round(world / PAUSED_BUDGET_PER_S * self.factor, 3),
                "wait_max_s": round(min(PARK_MAX_S, max(PARK_MIN_S, world / PARKED_BUDGET_PER_S * self.factor)), 3),
                # a fan-in: a rank that gave up on its request after a fixed 2 s sent it
                # again on a fresh connection, which made the queue longer still
                "reply_within_s": wire.reply_within_s(world, self.factor)}


# At most this many messages are read before the batch is decided on and answered: a reply
# waits for at most this many handlers (30 us each alone; 0.2-0.6 ms each at 8,192 ranks, where
# the serve thread shares the cores) and one decision. A node's health change ends a batch early.
BATCH_MAX = 512

# A rank's request handled this long (or longer) after it was signed is counted in job.status
# (rank_requests_handled_after_<N>s): a coordinator falling behind shows there before ranks time out.
REQUEST_AGE_COUNTED_S = (1.0, 2.0, 4.0, 6.0)

# A command to at least this many parked polls at once (a pause, a resume) is logged with the time
# the coordinator took to encode and send it: its own part of the fan-out the ranks see.
FANOUT_LOG_MIN = 64

# Long polls: a paused rank's rank.progress carries ``wait_s``; with no command for the
# rank, the request is parked (its ROUTER envelope kept, one per rank: a rank's newer message
# answers the older poll) until decide gives the rank a command, which goes out from the serve loop
# at once, or until wait_s (at most PARK_MAX_S) passes: then the answer it would have had at once.
# So the resume fan-out is one batch of replies, and a paused rank asks every few seconds instead
# of every 20 ms. Every rank.* reply says ``wait_max_s``, the wait to ask for: PARK_MIN_S, longer
# for a large job so that all its ranks, paused, poll about PARKED_BUDGET_PER_S times a second
# (times the pace factor; at 8,192 ranks polls every 2 s alone were 4,096/s, more than one
# coordinator serves on a shared core). A runtime sends wait_s only to a coordinator that said it
# (an older one refuses the field). The rank's time-out is wait_s plus its own.
PARK_MIN_S, PARK_MAX_S = 2.0, 10.0
PARKED_BUDGET_PER_S = 1000.0

_Pending = tuple[str, int, dict[str, Any], float]  # message id, rank, result, seconds it may be parked


class _Parked:
    """A rank's long poll, parked: where its answer goes and what it says without a command."""

    __slots__ = ("envelope", "msg_id", "result", "due", "seq", "signed")

    def __init__(self, envelope: list[bytes], msg_id: str, result: dict[str, Any], due: float,
                 signed: tuple[str, int] | None = None):
        self.envelope, self.msg_id, self.result, self.due = envelope, msg_id, result, due
        self.seq = 0  # set when parked: which entry of the due times is this poll's
        self.signed = signed  # the poll's (sender, seq): its answer is sealed for them


class _Batch:
    """The messages of one serve_batch: their replies, each with the rank whose command it takes."""

    __slots__ = ("msg_id", "pending", "replies", "signed")

    def __init__(self) -> None:
        self.msg_id = ""  # of the message being handled (_authenticate)
        self.signed: tuple[str, int] | None = None  # its (sender, seq) once the job secret verified it
        # (message id, rank, result, park seconds) of the message being handled when it may take a
        # command (set by _with_command): its reply is encoded again if the batch's decision gave
        # one, or, with none and park seconds > 0 (a long poll), parked.
        self.pending: _Pending | None = None
        self.replies: list[tuple[list[bytes], bytes, _Pending | None, tuple[str, int] | None]] = []


class _Replies:
    """Encodes the replies of one fan-out (_answer_parked, _reply_batch). What many ranks get alike
    (the same hints, and one pause or resume command: the executor gives every rank of it the same
    dict) is encoded once (wire.encode_result); each reply only wraps its request id around it
    (wire.encode_ok_raw). A pause to 8,192 parked polls takes 119 ms of the serve thread, against
    239 ms with each reply encoded by itself (bench/bench_fanout.py)."""

    __slots__ = ("_encoded",)

    def __init__(self) -> None:
        self._encoded: dict[tuple, tuple[Any, bytes]] = {}  # (result items, id(command)) -> (command, bytes)

    def encode(self, msg_id: str, result: dict[str, Any], cmd: dict[str, Any] | None) -> bytes:
        try:
            key = (tuple(result.items()), id(cmd))
            hit = self._encoded.get(key)
        except TypeError:  # a value that cannot be a key: this reply is encoded by itself
            return wire.encode_ok(msg_id, result if cmd is None else {**result, "command": cmd})
        if hit is None or hit[0] is not cmd:  # the command object is kept, so its id stays its own
            hit = self._encoded[key] = (cmd, wire.encode_result(result if cmd is None else {**result, "command": cmd}))
        return wire.encode_ok_raw(msg_id, hit[1])


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
        job_secret: bytes | None = None,
        private_jobs: bool = False,
        admin_uids: frozenset[int] = frozenset({0}),
    ):
        self.job = job
        self.driver = driver  # driver.Driver: migration decisions and actions (None: report only)
        if driver is not None and hasattr(driver.executor, "run_deferred"):
            driver.executor.defer_prelaunch = True  # started in _after_replies
        # Where rank reports go: the driver's decision state, or (report only) the same state, kept
        # by machine.apply alone.
        self._facts = driver if driver is not None else Facts(job.job_id, clock)
        self.owner_uid = os.getuid() if owner_uid is None else owner_uid
        self.munge_socket = munge_socket
        self.clock = clock
        self.wall = wall
        # rank.* must carry the job secret's MAC; None: a coordinator started by hand, unsigned.
        self.verifier = jobauth.JobVerifier(job_secret, wall=wall) if job_secret else None
        self.sealer = jobauth.ReplySealer(job_secret) if job_secret else None  # MACs the replies to ranks
        if self.verifier is None:
            log.warning("rank messages are not authenticated: no job secret (not started by the plugin)",
                        job_id=job.job_id)
        self.private_jobs = private_jobs  # Slurm's PrivateData hides jobs: status/events for owner/admins
        self.viewers = frozenset(admin_uids) | {self.owner_uid}
        self.ctx = context or zmq.Context.instance()
        self.sock, self.port = zmqio.bind_router(self.ctx, bind_address, port)
        self.counters: dict[str, int] = {}
        self._stop = threading.Event()
        self._signalled = False  # stop_from_signal: a plain flag, no lock
        self._later: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        # Other threads' news (an executor outcome, a health change, later()) wakes the serve loop
        # through this pipe at once: it waited for its poll's time-out (20 ms) before, and a
        # migration's standstill took five such waits, one per step.
        # Made by serve(), closed when it ends; the lock keeps a late wake() off a closed (and maybe
        # reused) descriptor. Reentrant: SIGTERM's handler (main.py) calls stop(), so wake(), in the
        # serve thread, which may hold it at that moment.
        self._wake_r = self._wake_w = -1
        self._wake_lock = threading.RLock()
        self._batch: _Batch | None = None  # the messages being served (serve loop), else None
        self.pace = Pace(clock)
        # Long polls parked (PARK_MAX_S): rank -> its poll; their due times, oldest first
        # (an entry whose rank was answered meanwhile, or parked again, is skipped).
        self._parked: dict[int, _Parked] = {}
        self._park_due: list[tuple[float, int, int]] = []  # (due, parked.seq, rank)
        self._park_seq = 0
        # Replies to ranks behind a node relay, per relay, sent as one bundle (wire.RELAY_BUNDLE) at
        # the end of each pass of the serve loop (_flush_bundles): a pause to 1,024 nodes x 8 ranks
        # leaves as 1,024 messages, not 8,192.
        self._bundles: dict[bytes, list[tuple[bytes, bytes]]] = {}
        self.handlers: dict[str, zmqio.Handler] = {
            "rank.register": self._on_register,
            "rank.progress": self._on_progress,
            "job.status": self._on_status,
            "job.events": self._on_events,
            "rank.armed": self._on_armed,
            "rank.quiesced": self._on_quiesced,
            "rank.resumed": self._on_resumed,
            "rank.checkpoint": self._on_checkpoint,
            "rank.exited": self._on_exited,
            "job.migrate": self._on_migrate,
            "job.snapshot": self._on_snapshot,
        }

    # --- authentication -----------------------------------------------------
    def _authenticate(self, msg: wire.Message) -> None:
        """Before any handler: rank.* by the job secret, job.status/events as PrivateData says."""
        if self._batch is not None:
            self._batch.msg_id = msg.id
        if msg.type.startswith("rank."):
            if self.verifier is not None:
                signed_ms = self.verifier.verify(msg)
                if self._batch is not None:  # its reply, whatever it says, is sealed for its sender and seq
                    self._batch.signed = (msg.sender, msg.seq)
                # How long after its rank signed it the request is handled (its wait in the
                # queues on both sides): counted when long, in job.status's counters.
                age_s = self.wall() - signed_ms / 1000.0
                for over in REQUEST_AGE_COUNTED_S:
                    if age_s < over:
                        break
                    key = f"rank_requests_handled_after_{over:g}s"
                    self.counters[key] = self.counters.get(key, 0) + 1
        elif msg.type in ("job.status", "job.events") and self.private_jobs:
            self._owner_or_admin(msg, "see")

    def _owner_or_admin(self, msg: wire.Message, what: str) -> auth.Identity:
        """The munge identity of ``msg``'s sender, who must own the job or be an admin."""
        ident = auth.verify(msg.auth, auth.request_digest(msg.type, msg.body, auth.job_target(self.job.job_id)),
                            self.munge_socket or auth.default_socket())
        if ident.uid not in self.viewers:
            raise auth.AuthFailure("forbidden", f"uid {ident.uid} does not own job {self.job.job_id} "
                                   f"(only its owner or an admin may {what} it)")
        return ident

    def note_slurm(self, available: bool, why: str = "") -> None:
        """slurmctld stopped (or resumed) answering: an event, and no migration starts meanwhile."""
        if available:
            self.job.record(self.wall(), "slurm.available", "slurmctld answers again: migrations are available")
        else:
            self.job.record(self.wall(), "slurm.unavailable",
                            f"slurmctld is unreachable ({why}): no migration starts until it answers; "
                            "training goes on", error=why)
        log.warning("slurmctld reachability changed", job_id=self.job.job_id, available=available, why=why)
        if self.driver is not None:
            self.driver.feed(ct.SlurmReachability(available, why))
            if self.driver.executor is not None:
                self.driver.executor.save_events()

    # --- handlers ------------------------------------------------------------
    def _check_job(self, body: dict[str, Any]) -> None:
        if body["job_id"] != self.job.job_id:
            raise NotFound(f"this coordinator serves job {self.job.job_id}, not {body['job_id']}")

    def _on_register(self, msg: wire.Message) -> dict[str, Any]:
        b = msg.body
        self._check_job(b)
        if not 0 <= b["rank"] < b["world_size"]:
            raise RemoteError("bad_request", f"rank {b['rank']} outside world size {b['world_size']}")
        world = self.state.world_size
        if world is not None and b["world_size"] != world:
            raise Conflict(f"world size {b['world_size']} differs from the job's {world}")
        prev = self.state.ranks.get(b["rank"])
        restored = b.get("restored") or ""
        if prev is None or prev.node != b["node"] or prev.pid != b["pid"] or restored:
            how = f", restored from snapshot {restored}" if restored else ""
            self.job.record(self.wall(), "rank.registered", f"rank {b['rank']} on {b['node']} (pid {b['pid']}{how})",
                            rank=b["rank"], node=b["node"], pid=b["pid"],
                            **({"restored": restored} if restored else {}))
            log.info("rank registered", job_id=self.job.job_id, rank=b["rank"], node=b["node"], pid=b["pid"])
            if (self.driver is not None and self.driver.executor is not None and prev is None
                    and len(self.state.ranks) + 1 == b["world_size"]):
                # Every rank is in: the log on disk says so, and its events are encoded now (once:
                # state.Event.encoded), not in the first pause's path (27 ms at 8,192 ranks).
                self.driver.executor.save_events()
        generation = b.get("generation") or 0
        self._feed(mc.RankRegistered(b["rank"], b["node"], b["world_size"], b["pid"], generation,
                                     b.get("task", -1), b.get("pinned") or "", b.get("restored") or ""))
        if b.get("rails") and not self.state.job_rails:  # the job's data rails: decide_reroute follows them
            self._feed(ct.JobRails(tuple(str(r) for r in b["rails"])))
        self._note_unprotected(b)
        if b.get("torch_override") and not self.job.torch_override:
            self.job.torch_override = b["torch_override"]
            log.warning("torch outside the tested range, patched on the site's word", job_id=self.job.job_id,
                        rank=b["rank"], why=b["torch_override"])
        return self._with_command(b["rank"], {"generation": generation})

    def _on_progress(self, msg: wire.Message) -> dict[str, Any]:
        b = msg.body
        if self.state.relaunch is not None and b["rank"] not in self.state.ranks:
            self._check_job(b)
            return {}  # a rank of the step being relaunched (ended by Slurm now): nothing to say to it
        self._rank(b)
        wait_s = min(max(float(b.get("wait_s") or 0.0), 0.0), PARK_MAX_S)
        self._feed(mc.RankProgress(b["rank"], b["collectives"], b["step"], b.get("node"),
                                   b.get("boundary", -1), b.get("boundary_step", -1), wait_s,
                                   *compute_figures(b)), decide=False)
        self._note_unprotected(b)
        return self._with_command(b["rank"], {}, wait_s=wait_s)

    # --- the decision state (driver) ------------------------------------------
    @property
    def state(self) -> CoordState:
        """The job's decision state: its ranks live there and nowhere else."""
        return self._facts.state

    def _feed(self, outcome, decide: bool = True) -> None:
        if decide or self._batch is not None:  # in a batch the driver decides once, at its end
            self._facts.feed(outcome)
        else:  # frequent progress reports: decided on the next tick
            self._facts.post(outcome)

    def _note_unprotected(self, b: dict[str, Any]) -> None:
        """A rank said it cannot be protected (wire field ``unprotected``): the first time for the
        job, one event, and the decision core learns it (no migration; a pause rolls back)."""
        why = b.get("unprotected")
        if not why or self.state.job_unprotected is not None:
            return
        # The event first: what the decision core does about it (a rollback) comes after it.
        self.job.record(self.wall(), "job.unprotected", mc.unprotected_text(b["rank"], why), rank=b["rank"],
                        why=why)
        log.warning("job unprotected", job_id=self.job.job_id, rank=b["rank"], why=why)
        self._feed(mc.RankUnprotected(b["rank"], why))
        if self.driver is not None and self.driver.executor is not None:
            self.driver.executor.save_events()

    def _with_command(self, rank: int, result: dict[str, Any], wait_s: float = 0.0) -> dict[str, Any]:
        result = {**result, "wait_max_s": PARK_MIN_S, **self.pace.hint(self.state.world_size)}
        # An authenticated message of this rank: a poll of it still parked was given up (its client
        # sends one request at a time), so it is answered now and never held twice.
        self._unpark(rank)
        if self._batch is not None:  # the command is added after the batch's decision (_reply_batch)
            self._batch.pending = (self._batch.msg_id, rank, result, wait_s)  # _on_progress bounds it
            return result
        ex = self.driver.executor if self.driver is not None else None
        cmd = ex.command_for(rank) if ex is not None else None
        if cmd is not None:
            result = {**result, "command": cmd}
        return result

    def _rank(self, b: dict[str, Any]) -> None:
        self._check_job(b)
        if b["rank"] not in self.state.ranks:
            raise NotFound(f"rank {b['rank']} has not registered with job {self.job.job_id}")

    def _on_armed(self, msg: wire.Message) -> dict[str, Any]:
        b = msg.body
        self._rank(b)
        if self.driver is not None and self.driver.executor is not None:
            self.driver.executor.acknowledge(b["rank"], wire.COMMAND_PAUSE, b["generation"], b["at"])
        self._note_unprotected(b)
        self._feed(mc.Armed(b["rank"], b["at"], b["generation"], b["accepted"], b["collectives"],
                            b.get("unprotected") or ""))
        return self._with_command(b["rank"], {})

    def _on_quiesced(self, msg: wire.Message) -> dict[str, Any]:
        b = msg.body
        self._rank(b)
        # debug, as "rank resumed": one line per rank per pause (and per resend) is thousands of
        # lines a move at scale, ~5 % of the coordinator's time at 8,192 ranks (cProfile); the
        # phases and their figures are in the events.
        log.debug("rank quiesced", rank=b["rank"], generation=b["generation"], collectives=b["collectives"],
                 hold=b["hold"], sockets=b["sockets"], drain_s=b["drain_s"])
        released = b.get("released_mb")
        self._feed(mc.Quiesced(b["rank"], b["generation"], b["collectives"], float(b.get("drain_s") or 0.0),
                               None if released is None else float(released)))
        return self._with_command(b["rank"], {})

    def _on_resumed(self, msg: wire.Message) -> dict[str, Any]:
        b = msg.body
        self._rank(b)
        if self.driver is not None and self.driver.executor is not None:
            self.driver.executor.acknowledge(b["rank"], wire.COMMAND_RESUME, b["generation"])
        log.debug("rank resumed", rank=b["rank"], generation=b["generation"], node=b["node"], moved=b["moved"],
                 rebuild_s=b["rebuild_s"], cancelled=b.get("cancelled", False))
        self._feed(mc.Resumed(b["rank"], b["generation"], b["node"], bool(b.get("cancelled", False)),
                              b["collectives"]))
        return self._with_command(b["rank"], {})

    def _on_exited(self, msg: wire.Message) -> dict[str, Any]:
        """A rank's process died on a live node; its task wrapper holds its exit while the reply
        says "hold" (decide_rank_death decides; machine.death_verdict answers)."""
        b = msg.body
        self._check_job(b)
        sig = b.get("signal")
        how = f"killed by signal {sig} ({_signal_name(sig)})" if sig else f"exit code {b['code']}"
        self._feed(mc.RankExited(b["rank"], b["node"], how, b.get("gpu", -1)))
        verdict = mc.death_verdict(self.state, b["rank"], b["node"])
        log.warning("rank exited", rank=b["rank"], node=b["node"], how=how, verdict=verdict)
        return {"verdict": verdict, "retry_s": DEATH_RETRY_S}

    def _on_checkpoint(self, msg: wire.Message) -> dict[str, Any]:
        """An application checkpoint of the job (torchpass.checkpoint) completed, failed or was
        loaded: an event; a completed one is the job's restore point (decide relaunches the job from
        it when a node is lost), a loaded one numbers the job's steps from its step.

        The path is the job's own (the ranks run as the job's user, as this coordinator does);
        nothing here reads or writes it."""
        b = msg.body
        self._rank(b)
        if b["outcome"] not in ("completed", "failed", "loaded"):
            raise RemoteError("bad_request", f"checkpoint outcome {b['outcome']!r} is not completed, failed or "
                                             "loaded")
        if b["outcome"] == "loaded":
            rv = self.state.ranks.get(b["rank"])
            self.job.record(self.wall(), "checkpoint.loaded", f"rank {b['rank']} loaded the application checkpoint "
                            f"of step {b['step']} ({b['path']}): the job goes on from there",
                            step=b["step"], path=b["path"])
            self._feed(mc.CheckpointLoaded(b["step"], rv.step if rv is not None else 0))
            return self._with_command(b["rank"], {})
        figures = {k: b[k] for k in ("bytes", "blocking_s", "write_s", "waited_s", "removed", "error") if k in b}
        if b["outcome"] == "completed":
            mb = (b.get("bytes") or 0) / 1e6
            text = (f"application checkpoint of step {b['step']} complete in {b['path']} ({mb:.1f} MB; training "
                    f"blocked {b.get('blocking_s', 0):.3f} s, written in {b.get('write_s', 0):.2f} s)")
        else:
            text = f"application checkpoint of step {b['step']} failed: {b.get('error', 'no reason given')}"
        self.job.record(self.wall(), f"checkpoint.{b['outcome']}", text, step=b["step"], path=b["path"], **figures)
        log.info("application checkpoint", outcome=b["outcome"], step=b["step"], path=b["path"], **figures)
        if b["outcome"] == "completed":  # the job's newest restore point: a lost node relaunches from it
            self._feed(mc.CheckpointCompleted(b["step"], b["path"]))
        if self.driver is not None and self.driver.executor is not None:
            self.driver.executor.save_events()
        return self._with_command(b["rank"], {})

    def _on_migrate(self, msg: wire.Message) -> dict[str, Any]:
        ident = self._owner_or_admin(msg, "migrate")
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

    def _on_snapshot(self, msg: wire.Message) -> dict[str, Any]:
        ident = self._owner_or_admin(msg, "snapshot")
        if self.driver is None:
            raise RemoteError("unavailable", f"the coordinator of job {self.job.job_id} runs without snapshots")
        stop = bool(msg.body.get("stop"))
        sid = self.driver.accept_snapshot(self.wall(), stop=stop)  # OperatorRejected carries the wire code
        then = ", then to stop the job (its nodes freed; tpassctl resume brings it back)" if stop else ""
        self.job.record(self.wall(), "snapshot.requested", f"snapshot {sid}: operator (uid {ident.uid}) asked for "
                        f"a snapshot of every rank{then}", snapshot=sid, trigger="operator", uid=ident.uid,
                        **({"stop": True} if stop else {}))
        self.driver.decide()
        return {"snapshot": sid}

    def _on_status(self, msg: wire.Message) -> dict[str, Any]:
        st = self.job.status(self.clock(), self.state)
        st["coordinator"] = {"pid": os.getpid(), "port": self.port, "counters": dict(self.counters),
                             "rank_auth": "job-secret" if self.verifier is not None else "none"}
        return st

    def _on_events(self, msg: wire.Message) -> dict[str, Any]:
        since = msg.body.get("since_seq") or 0
        return {"events": [e.as_dict() for e in self.job.events if e.seq > since]}

    # --- loop --------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()
        self.wake()

    def stop_from_signal(self) -> None:
        """stop() for a signal handler, which takes no lock: Python runs a handler in the main
        thread between two of its bytecodes, possibly inside Event.set() already. The plugin's
        SIGTERM to the process group and the supervisor's forwarded copy arrive together, and the
        second handler then waited forever on the Event's lock held by the first (one stop in
        four on a devcluster; the plugin's SIGKILL followed 5 s later, before the event log was
        saved or a companion allocation cancelled)."""
        self._signalled = True
        w = self._wake_w  # -1 once serve() ended; it sets -1 before closing the pipe
        if w >= 0:
            try:
                os.write(w, b"\0")
            except OSError:  # full: a wake-up is pending already
                pass

    def later(self, fn: Callable[[], None]) -> None:
        """Thread-safe: run ``fn`` in the serve thread (which alone touches the job and the driver)."""
        self._later.put(fn)
        self.wake()

    def wake(self) -> None:
        """Thread-safe: the serve loop looks at its queues now, not at its poll's time-out."""
        with self._wake_lock:
            if self._wake_w < 0:  # not serving: the queues are read when it starts
                return
            try:
                os.write(self._wake_w, b"\0")
            except OSError:  # full: a wake-up is pending already
                pass

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except OSError:  # empty
            pass

    def watch(self, check: Callable[[], bool], interval_s: float) -> threading.Thread:
        """Run ``check`` every ``interval_s`` in a thread of its own (a slurmctld query can take
        seconds: the serve loop must not wait for it); stop serving once it returns False."""

        def run() -> None:
            while not self._stop.is_set():
                try:
                    alive = check()
                except Exception:
                    log.exception("liveness check failed")
                    alive = True
                if not alive:
                    self.stop()
                    return
                self._stop.wait(interval_s)

        t = threading.Thread(target=run, name="job-liveness", daemon=True)
        t.start()
        return t

    def serve(self) -> None:
        """Serve until stop() (a watch() check that found the job gone calls it)."""
        with self._wake_lock:
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        set_waker = getattr(self.driver, "set_waker", None)
        if set_waker is not None:
            set_waker(self.wake)
        try:
            while not (self._stop.is_set() or self._signalled):
                ready = dict(poller.poll(self._poll_ms(100 if self.driver is None else 20)))
                if self._wake_r in ready:
                    self._drain_wake()
                if self.sock in ready:
                    self._serve_batch()
                else:
                    self._run_later()
                    self._pump()
                    self._answer_parked()
                    self._flush_bundles()
                    self._after_replies()
        finally:
            # The stop's start, in the log: the plugin kills the coordinator stop_timeout seconds
            # after its SIGTERM, and what follows must fit in them.
            log.info("coordinator stopping", signalled=self._signalled)
            self._stop.set()  # the watch() threads end too
            self._run_later()  # news that came with the end (the job's last events)
            if self.driver is not None:
                self.driver.close()
            parked = list(self._parked)
            for rank in parked:  # the parked polls get their answer without a command
                self._unpark(rank)
            self._flush_bundles()
            # Time for those answers to leave (at most 0.2 s; a peer gone meanwhile drops them).
            self.sock.close(linger=200 if parked else 0)
            if set_waker is not None:
                set_waker(None)
            with self._wake_lock:
                fds, (self._wake_r, self._wake_w) = (self._wake_r, self._wake_w), (-1, -1)
                for fd in fds:  # after the -1: a handler running in between writes to neither
                    os.close(fd)

    def _pump(self, force: bool = False) -> None:
        if self.driver is not None:
            try:
                self.driver.pump(force=force)
            except Exception:
                log.exception("driver error")

    def _serve_batch(self) -> None:
        """Read every message that is ready (up to BATCH_MAX), apply them all, decide once, then
        reply to each: a reply carries the command that decision gave its rank (as when each
        message was decided on by itself), at the cost of one decision per batch, not per message."""
        started = time.perf_counter()
        batch = _Batch()
        self._batch = batch
        if self.driver is not None:
            self.driver.begin_batch()
        news = getattr(self.driver, "health_news", None)
        try:
            for _ in range(BATCH_MAX):
                if len(batch.replies) >= BATCH_MAX:  # rank messages: a relay's bundle holds several
                    break
                if batch.replies and news is not None and news():
                    break  # decided on now; what else is queued is the next batch (which reads one at least)
                try:
                    parts = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(parts) == 3 and parts[1] == wire.RELAY_BUNDLE:  # [relay, mark, bundle]: a node's ranks
                    try:
                        items = wire.unpack_bundle(parts[2])
                    except ProtocolError:  # nobody to reply to: the relay's ranks time out and ask again
                        self.counters["dropped"] = self.counters.get("dropped", 0) + 1
                        continue
                    for ident, frame in items:
                        self._serve_one(batch, [parts[0], wire.RELAY_BUNDLE, ident], frame)
                    continue
                if len(parts) < 3 or parts[-2] != b"":  # not a REQ envelope: nobody to reply to
                    self.counters["dropped"] = self.counters.get("dropped", 0) + 1
                    continue
                self._serve_one(batch, parts[:-1], parts[-1])
        finally:
            self._batch = None
            if self.driver is not None:
                try:
                    self.driver.end_batch()
                except Exception:
                    log.exception("driver error")
        self._run_later()
        self._reply_batch(batch)
        self._answer_parked()
        self._flush_bundles()  # before what waits for the replies (_after_replies)
        self.pace.busy(time.perf_counter() - started)
        self._after_replies()

    def _serve_one(self, batch: _Batch, envelope: list[bytes], frame: bytes) -> None:
        batch.pending = batch.signed = None
        reply = zmqio.handle_frame(frame, self.handlers, authenticate=self._authenticate, counters=self.counters)
        batch.replies.append((envelope, reply, batch.pending, batch.signed))

    def _after_replies(self) -> None:
        """What a decision started that may wait until its replies are sent (executor.defer_prelaunch)."""
        run = getattr(self.driver.executor, "run_deferred", None) if self.driver is not None else None
        if run is not None:
            run()  # logs what fails, and goes on

    def _reply_batch(self, batch: _Batch) -> None:
        ex = self.driver.executor if self.driver is not None else None
        replies = _Replies()
        for envelope, reply, pending, signed in batch.replies:
            if pending is not None:
                msg_id, rank, result, park_s = pending
                cmd = ex.command_for(rank) if ex is not None else None
                if cmd is not None:  # the reply was encoded without it: once more, with it
                    reply = replies.encode(msg_id, result, cmd)
                elif park_s > 0:  # a long poll with nothing to say yet
                    self._park(rank, _Parked(envelope, msg_id, result, self.clock() + park_s, signed))
                    continue
            self._send(envelope, reply, signed)

    def _send(self, envelope: list[bytes], reply: bytes, signed: tuple[str, int] | None = None) -> None:
        if signed is not None and self.sealer is not None:
            reply = self.sealer.seal(signed[0], signed[1], reply)
        if len(envelope) == 3 and envelope[1] == wire.RELAY_BUNDLE:  # [relay, mark, identity]
            self._bundles.setdefault(envelope[0], []).append((envelope[2], reply))
            return
        try:
            self.sock.send_multipart(envelope + [reply], zmq.NOBLOCK)
        except zmq.Again:  # the peer's queue is full (it gave up): nothing to answer
            self.counters["reply_dropped"] = self.counters.get("reply_dropped", 0) + 1

    def _flush_bundles(self) -> None:
        """Send the replies gathered per node relay, one message per relay."""
        if not self._bundles:
            return
        bundles, self._bundles = self._bundles, {}
        for relay, items in bundles.items():
            if not zmqio.send_bundle(self.sock, items, to=relay):  # its queue is full: its ranks ask again
                self.counters["reply_dropped"] = self.counters.get("reply_dropped", 0) + len(items)

    # --- long polls (PARK_MAX_S) -------------------------------------------------------------
    def _park(self, rank: int, parked: _Parked) -> None:
        self._unpark(rank)
        self._park_seq += 1
        parked.seq = self._park_seq
        self._parked[rank] = parked
        heapq.heappush(self._park_due, (parked.due, parked.seq, rank))
        self.counters["long_polls"] = self.counters.get("long_polls", 0) + 1

    def _unpark(self, rank: int, cmd: dict[str, Any] | None = None, replies: _Replies | None = None) -> None:
        """Answer ``rank``'s parked poll, if any: with ``cmd``, else as it would have been at once."""
        parked = self._parked.pop(rank, None)
        if parked is not None:
            self._send(parked.envelope, (replies or _Replies()).encode(parked.msg_id, parked.result, cmd),
                       parked.signed)

    def _answer_parked(self) -> None:
        """After every decision: parked polls whose rank now has a command get it at once (a
        resume to every rank: one batch of replies); those parked for their wait_s get no command."""
        if not self._parked:
            return
        started, parked = time.perf_counter(), len(self._parked)
        ex = self.driver.executor if self.driver is not None else None
        replies = _Replies()
        if ex is not None:
            commands = getattr(ex, "commands", None)  # rank -> command: fewer than the parked, mostly
            ranks = ([r for r in commands if r in self._parked]
                     if isinstance(commands, dict) and len(commands) < len(self._parked) else list(self._parked))
            urgent = getattr(ex, "urgent", ())  # the held ranks of a pause: theirs first (a rank answered is unparked)
            if 0 < len(urgent) < len(ranks):
                for rank in urgent:
                    cmd = ex.command_for(rank) if rank in self._parked else None
                    if cmd is not None:
                        self._unpark(rank, cmd, replies)
                self._flush_bundles()  # their node's bundle leaves before the others are encoded
            kinds: set[str] = set()
            for rank in ranks:
                cmd = ex.command_for(rank)
                if cmd is not None:
                    self._unpark(rank, cmd, replies)
                    kinds.add(cmd.get("command", "?"))
            commanded = parked - len(self._parked)
            if commanded >= FANOUT_LOG_MIN:  # a pause or a resume to many ranks: its own part, for the record
                self._flush_bundles()
                log.info("command sent to parked polls", job_id=self.job.job_id, command="/".join(sorted(kinds)),
                         commanded=commanded, seconds=round(time.perf_counter() - started, 4))
        now = self.clock()
        while self._park_due and self._park_due[0][0] <= now:
            _, seq, rank = heapq.heappop(self._park_due)
            parked = self._parked.get(rank)
            if parked is not None and parked.seq == seq:
                self._unpark(rank, None, replies)
        if not self._parked:
            self._park_due.clear()  # entries of polls answered meanwhile

    def _poll_ms(self, idle_ms: int) -> int:
        """How long the serve loop may wait for a message: until the next parked poll is due."""
        if not self._park_due:
            return idle_ms
        return max(1, min(idle_ms, int((self._park_due[0][0] - self.clock()) * 1000) + 1))

    def _run_later(self) -> None:
        while not self._later.empty():
            try:
                self._later.get_nowait()()
            except Exception:
                log.exception("deferred call failed")


SLURM_UNAVAILABLE_AFTER_S = 15.0


def job_liveness_check(client, job_id: int, *, clock: Callable[[], float] = time.monotonic,
                       on_change: Callable[[bool, str], None] | None = None,
                       unavailable_after_s: float = SLURM_UNAVAILABLE_AFTER_S) -> Callable[[], bool]:
    """A tick that is False once slurmctld says the job has ended.

    slurmctld not answering is never the job ending, however long it lasts
    (the batch step's exit and the epilog stop the coordinator of a job that
    ends meanwhile). Once it has failed every query for
    ``unavailable_after_s``, ``on_change(False, why)`` is called (no
    migration starts); ``on_change(True, "")`` when it answers again.
    """
    failing_since: float | None = None
    down = False

    def tick() -> bool:
        nonlocal failing_since, down
        asked = clock()
        try:
            job = client.job(job_id)
        except (SlurmError, TorchpassError) as exc:
            now = clock()
            failing_since = asked if failing_since is None else failing_since  # a query may hang for long
            log.warning("cannot query slurm for the job", job_id=job_id, error=str(exc),
                        failing_s=round(now - failing_since, 1))
            if not down and now - failing_since >= unavailable_after_s:
                down = True
                if on_change is not None:
                    on_change(False, f"no answer for {now - failing_since:.0f} s: {exc}")
            return True
        failing_since = None
        if down:
            down = False
            if on_change is not None:
                on_change(True, "")
        if job is None or not job.active:
            log.info("job has ended; coordinator exits", job_id=job_id, state=job.state if job else "gone")
            return False
        return True

    return tick


def write_registration(state_dir: Path, job_id: int, info: dict[str, Any]) -> Path:
    """Record where this job's coordinator listens, for tpassctl on login nodes."""
    path = layout.coordinator_json(state_dir, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    # tpassctl finds it by the directory's name and owner (torchpass.jobdir), never by what it says;
    # readable by the job's owner and jobs/J's group (SlurmUser) only, whatever the umask.
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, layout.JOB_FILE_MODE)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), layout.JOB_FILE_MODE)
        f.write(json.dumps(info, indent=1))
    os.replace(tmp, path)
    return path
