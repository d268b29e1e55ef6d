"""The rank's link to the job's coordinator.

One background thread per rank (started from the patched
init_process_group, after the rank is PID 1 of its own PID namespace). It
speaks ZeroMQ request/reply (Lazy Pirate, torchpass.zmqio) with the
coordinator's ROUTER at TORCHPASS_COORDINATOR:

* ``rank.register`` once, then ``rank.progress`` every interval (every
  ``paused_interval_s`` while the group is paused, so the resume arrives soon);
  to a coordinator whose replies say ``wait_max_s``, each report is a long
  poll instead: it carries ``wait_s`` and the coordinator answers it the
  moment the rank has a command, else after wait_s, and the next report goes
  then. Running, wait_s is the report interval (so a pause reaches every
  rank as soon as it is decided, not in the reply to each rank's next
  report); paused, 80-100 % of wait_max_s (so that the ranks' polls do not
  come in waves; never past the pause's deadline). A report to send
  (``rank.armed``, ``rank.quiesced``, ``rank.resumed``) or stop() gives the
  wait up at once through a wake-up pipe (the connection stays; the late
  answer is dropped by its id);
* commands come back in the replies' ``result["command"]`` (see wire.py):
  ``pause`` arms the process group (acknowledged with ``rank.armed``),
  ``resume`` resumes it (acknowledged with ``rank.resumed`` once rebuilt);
* when the group has quiesced it sends ``rank.quiesced``; with a
  ``hold_file`` in the pause command it then destroys its ZeroMQ context
  (no socket, no I/O thread left: CRIU can dump the process) and waits,
  polling ``stat(hold_file)`` with short sleeps, until the file exists: after
  a restore on another node, or when the coordinator aborts the move. Then it
  opens a fresh context and goes on polling, which fetches the resume. A hold
  file that says ``restored ID`` woke a copy restored from whole-job snapshot
  ID after a lost node: it takes a new signing sender, registers again with
  ``restored: ID`` and waits, paused, for the resume of the relaunch.

* once the rank is unprotected (the job made a group the runtime cannot
  move, see ReconfigurablePG.note_native_groups) every ``rank.register`` /
  ``rank.progress`` carries ``unprotected`` (why), a pause is answered with
  ``rank.armed`` ``accepted: false`` plus ``unprotected`` (a pause it had
  already accepted is refused the same way), and the coordinator's cancel
  (``resume`` with the pause's generation) with ``rank.resumed``
  ``cancelled: true``: refused cleanly, never a rank waiting at T.

* never left paused (docs/coordinator.md, "Never left paused"): every pause
  carries ``deadline_s`` (D) and ``fallback`` (the resume in place the
  coordinator itself would send). A quiesced rank with no resume D seconds
  after it quiesced (wall clock: a restored copy must not trust another
  host's monotonic clock) applies ``fallback`` once and is unprotected from
  then on; a held copy first claims the rank with
  ``open(hold_file + ".claim", O_CREAT|O_EXCL)`` (the source copy at D, a
  restored copy at D + 60 s, so the source wins whenever it is alive; the
  loser exits 0 without touching the group). If the ranks of that resume do
  not all join within ``join_s``, each one says so in one line and exits 1:
  Slurm ends the job at once instead of at its time limit.
* replies are the coordinator's only when they carry the job secret's MAC
  for the try they answer (torchpass.jobauth, ``open_reply``): one without
  it, or with a wrong one, is dropped with one line and the request waits on
  for the real answer; training never stops for it. A pause's ``hold_file``
  is taken only at the path the layout gives this rank
  (STATE_DIR/jobs/J/hold/M.rankR under TORCHPASS_STATE_DIR): the hold file
  can point a restored copy at another coordinator and secret, so a pause
  naming any other path is refused as unprotected, in one line.
* a link with no answer for ``lost_after_s`` (30 s) notes
  STATE_DIR/jobs/J/coordinator.lost once for the whole job
  (torchpass.coordinator_lost): tpassctl status and events show it.

Requests go over one kept connection (torchpass.zmqio.Client, a DEALER
socket reopened only after a time-out): a TCP connect and handshake per
report cost the coordinator most of its time at thousands of ranks. A held
rank has none: the hold destroys the context, and the client makes a new
connection in the next context, after the restore or the abort.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import socket
import threading
import time
from collections import deque
from typing import Callable

from torchpass import layout
from torchpass.runtime import relay
from torchpass.runtime.pg import PauseListener, ReconfigurablePG, Rendezvous, count_sockets
from torchpass.runtime.release import release_allocator_caches
from torchpass.runtime.say import say
from torchpass.runtime.store import AGENT_DIR_ENV, HELD_MARKER

# The longest report interval a coordinator's backpressure hint can ask for (report_every_s).
MAX_HINT_S = 10.0
# The longest a coordinator's reply_within_s can make a request wait for its answer (a large job's
# fan-in: every rank acknowledging a pause at once); a coordinator that is gone is still noticed
# (coordinator.lost after COORDINATOR_LOST_S without an answer).
MAX_REPLY_HINT_S = 20.0
# A restored copy claims its rank this much later than the source copy would: the source wins
# whenever it is alive (docs/coordinator.md, "Never left paused").
RESTORED_CLAIM_DELAY_S = 60.0
# How long the ranks of a resume in place without the coordinator wait for each other (the pause
# command's join_s, the policy's rebuild_timeout_s, when it has one).
FALLBACK_JOIN_S = 120.0
# No answer from the coordinator for this long: it is lost (TORCHPASS_COORDINATOR_LOST_S).
COORDINATOR_LOST_S = 30.0
# How often a held rank looks for its hold file (one stat; the hold lasts the dump and restore).
HOLD_POLL_S = 0.005
# The fallback rendezvous' own keys on rank 0's store (beside the generations' gen<g>/ keys).
FALLBACK_KEY = "torchpass-fallback/gen{gen}"


def _netns_inode() -> int:
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0


def _listening_inodes(proc: str = "/proc") -> set[str]:
    """Socket inodes in LISTEN state in this network namespace (/proc/net/tcp, tcp6)."""
    found = set()
    for name in ("tcp", "tcp6"):
        try:
            with open(f"{proc}/net/{name}") as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) > 9 and cols[3] == "0A":  # TCP_LISTEN
                        found.add(cols[9])
        except OSError:
            pass
    return found


def serves_tcp(pid: int, proc: str = "/proc") -> bool:
    """Whether process ``pid`` holds a listening TCP socket (a TCPStore server, say)."""
    listening = _listening_inodes(proc)
    try:
        fds = os.listdir(f"{proc}/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(f"{proc}/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in listening:
            return True
    return False


def _parent_in_proc(proc: str = "/proc") -> int:
    """The parent's pid as ``proc`` numbers it. A rank is in a PID namespace of its own while /proc
    is the node's: os.getppid() is the namespace's number, /proc/self/stat has the node's."""
    try:
        with open(f"{proc}/self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return os.getppid()


# torchrun's agent serves a store that every node's agent (and the workers) connect to: it cannot
# move to another address, so neither can its node (docs/runtime.md, "torchrun").
AGENT_SERVES_WHY = ("torchrun's agent on this node serves a TCP store (its rendezvous or its workers' "
                    "bootstrap store) that the other nodes connect to")


def task_fields(env=os.environ) -> dict:
    """``task`` and ``pinned`` for rank.register: the rank wrapper's task (TORCHPASS_TASK, the key
    of its rank record) and, for a torchrun worker, whether its agent serves a store."""
    out: dict = {}
    task = env.get("TORCHPASS_TASK")
    if task and task.isdigit():
        out["task"] = int(task)
    if env.get("TORCHELASTIC_RUN_ID") is not None and serves_tcp(_parent_in_proc()):
        out["pinned"] = AGENT_SERVES_WHY
    return out


def _agent_marker(env=os.environ) -> tuple[str, str] | None:
    """(path, content) of this torchrun worker's hold marker for its agent (store.AgentHoldWatch):
    while every worker of the agent holds one, the agent closes its rendezvous connection, so the
    node's whole tree can be dumped. None outside torchrun."""
    d, local, world = env.get(AGENT_DIR_ENV), env.get("LOCAL_RANK"), env.get("LOCAL_WORLD_SIZE")
    if not d or not (local or "").isdigit() or not (world or "").isdigit():
        return None
    return os.path.join(d, HELD_MARKER.format(local_rank=int(local))), world


def _write_marker(path: str, content: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(content)
    except OSError as exc:  # the agent keeps its connection: the dump refuses, the move rolls back
        say(f"cannot tell torchrun's agent that this worker holds ({path}: {exc})")


class ControlLink(PauseListener):
    def __init__(
        self,
        pg: ReconfigurablePG,
        *,
        endpoint: str,
        job_id: int,
        rank: int,
        node: str | None = None,
        interval_s: float = 0.5,
        paused_interval_s: float = 0.02,
        request_timeout_s: float = 2.0,
        auth: str | None = None,
        state_dir: str | None = None,
        rank_dir: str | None = None,
        lost_after_s: float = COORDINATOR_LOST_S,
        claim_delay_s: float = RESTORED_CLAIM_DELAY_S,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
        exit: Callable[[int], None] = os._exit,
        relay_path: str | None = None,
        relay_host: bool = False,
    ):
        self.pg = pg
        self.endpoint = endpoint
        self.job_id = job_id
        self.rank = rank
        self._node = node
        self.interval_s = interval_s
        self.paused_interval_s = min(interval_s, paused_interval_s)
        # The coordinator's backpressure (issue 13): every reply may ask for longer intervals
        # (report_every_s, paused_every_s); the larger of ours and its own is used.
        self.hint_s = 0.0
        self.paused_hint_s = 0.0
        self.wait_max_s = 0.0  # the coordinator's wait_max_s: > 0 once it said it parks long polls
        self.reply_hint_s = 0.0  # the coordinator's reply_within_s: a request's answer may take this long
        self.request_timeout_s = request_timeout_s
        self.auth = auth
        self.replies_refused = 0  # replies dropped for a missing or wrong MAC
        self.hold_refused: str | None = None  # why a pause's hold file was refused (unprotected since)
        self._listen_refusals(auth)
        self._start_host = socket.gethostname()
        self._start_netns = _netns_inode()
        self._cv = threading.Condition()
        self._outbox: deque[tuple[str, dict]] = deque()
        # A long poll waits in zmq's poll on its socket and on this pipe: _post() and stop() write
        # a byte, so the poll is given up at once, with no wake-up while nothing happens. It lives
        # as long as the process: closed at stop(), its number could be reused by another file
        # while a training thread still writes to it.
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stop = False
        self._thread: threading.Thread | None = None
        self._ctx = None
        self._client = None  # zmqio.Client over self._ctx, made at the first request
        self._armed_reported: tuple[int, int, bool] | None = None
        self._hold_file: str | None = None
        self._holding = False
        self.registered = False
        self.restored: str | None = None  # the whole-job snapshot this copy was restored from
        self.errors = 0
        self.refused: Exception | None = None  # the last request's error reply, if it got one
        # Never left paused: the accepted pause (its deadline_s, fallback, join_s), when this rank
        # quiesced for it (wall clock), and why it resumed without the coordinator (then unprotected).
        self.state_dir = state_dir
        self.rank_dir = rank_dir  # the rank wrapper's record directory (the hand-off marker lives there)
        self.lost_after_s = lost_after_s
        self.claim_delay_s = claim_delay_s
        self.wall = wall
        self.clock = clock
        self._exit = exit
        self._pause: dict | None = None
        self._quiesced_wall: float | None = None
        self.fell_back: str | None = None
        self._rebuilt = threading.Event()
        self._failing_since: float | None = None
        self.lost_noted = False
        # Called before a held rank reports quiesced (it is about to be dumped): the job's
        # torchpass.checkpoint waits there for its background write, so no checkpoint file is
        # open in the image. Each may block; an exception is said and ignored.
        self.before_dump: list[Callable[[], object]] = []
        self._checkpoints_posted = 0  # rank.checkpoint reports posted, and answered by the coordinator
        self._checkpoints_told = 0
        # The node relay (torchpass/runtime/relay.py): its socket, whether this rank hosts it, the
        # relay thread while it runs, whether the current client goes through it, and when a rank
        # that talks to the coordinator itself tries the relay again.
        self.relay_path = relay_path
        self.relay_host = relay_host and relay_path is not None
        self._relay = None
        self._via_relay = False
        self._relay_retry_at = 0.0
        self._relay_waited = False
        self._relay_timeouts = 0  # requests through the relay in a row that got no answer
        pg.listener = self

    @classmethod
    def from_env(cls, pg: ReconfigurablePG, env=os.environ) -> "ControlLink":
        from torchpass.jobauth import signer_from_env  # None without TORCHPASS_JOB_SECRET (unsigned)

        link = cls(
            pg,
            endpoint=_tcp(env["TORCHPASS_COORDINATOR"]),
            job_id=int(env["TORCHPASS_JOB_ID"]),
            rank=pg.rank(),
            node=env.get("TORCHPASS_NODE") or env.get("SLURMD_NODENAME"),
            interval_s=float(env.get("TORCHPASS_PROGRESS_INTERVAL", "0.5")),
            paused_interval_s=float(env.get("TORCHPASS_PAUSED_POLL_INTERVAL", "0.02")),
            auth=signer_from_env(env),  # every rank.* request signed with the job secret
            state_dir=env.get("TORCHPASS_STATE_DIR") or None,
            rank_dir=env.get("TORCHPASS_RANK_STATE_DIR") or None,
            lost_after_s=float(env.get("TORCHPASS_COORDINATOR_LOST_S", COORDINATOR_LOST_S)),
            **_relay_args(env),
        )
        return link

    # -- identity ---------------------------------------------------------------
    @property
    def moved(self) -> bool:
        return _netns_inode() != self._start_netns or socket.gethostname() != self._start_host

    @property
    def node(self) -> str:
        if self._node and not self.moved:
            return self._node
        return socket.gethostname()

    # -- thread -----------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="torchpass-control", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)
        self._stop_relay()
        self._close()

    # -- the node relay ---------------------------------------------------------------
    def _start_relay(self) -> None:
        """The node's first rank, on the node it started on, hosts the relay."""
        if not self.relay_host or self._relay is not None or self.moved or self._stop:
            return
        directory = os.path.dirname(self.relay_path)
        if relay.private_dir(directory, create=True) is None:
            self.relay_host = False  # said why; the node's ranks connect to the coordinator themselves
            return
        relay.sweep_dead(directory)  # files of relays gone (killed, or their process ended with os._exit)
        r = relay.NodeRelay(self.relay_path, self.endpoint)
        if r.start():
            self._relay = r
        else:
            self.relay_host = False

    def _stop_relay(self, drain_s: float = 0.0) -> None:
        r, self._relay = self._relay, None
        if r is not None:
            r.stop(drain_s)

    def _use_relay(self) -> bool:
        """Whether the next connection goes through the node relay: one listens on its socket in a
        private directory, and this copy runs on the node it started on."""
        if self.relay_path is None or self.moved or self.clock() < self._relay_retry_at:
            return False
        ok = relay.available(self.relay_path)
        if not ok and not self._relay_waited and not self.relay_host:
            # The first connection: the node's first rank starts its relay as this rank starts
            # (both right after init_process_group); a direct connection made meanwhile would be
            # given up later, which costs the coordinator as much memory as keeping it.
            end = self.clock() + relay.FIRST_WAIT_S
            while not ok and not self._stop and self.clock() < end:
                time.sleep(0.05)
                ok = relay.available(self.relay_path)
        self._relay_waited = True
        if not ok:
            self._relay_retry_at = self.clock() + relay.RELAY_RETRY_S
        return ok

    def _open(self):
        import zmq

        if self._ctx is None:
            self._ctx = zmq.Context()
        return self._ctx

    def _close(self) -> None:
        if self._client is not None:
            self._client.close()  # the next request connects again, in the next context
            if self._via_relay:  # and chooses its way again: after a hold this copy may have moved
                self._client = None
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.destroy(linger=0)  # joins its I/O threads; their fds close

    def _request(self, type_: str, body: dict, *, expect_s: float = 0.0) -> dict | None:
        """``expect_s``: how long its answer may take, where the coordinator has not said
        (reply_within_s) yet."""
        from torchpass import zmqio
        from torchpass.errors import RemoteError, TorchpassError

        if self._client is None or (not self._via_relay and self.relay_path is not None
                                    and self.clock() >= self._relay_retry_at):
            via = self._use_relay()
            if self._client is None or via:
                if self._client is not None:
                    self._client.close()
                self._client = zmqio.Client(f"ipc://{self.relay_path}" if via else self.endpoint, retries=0,
                                            auth=self.auth, context=self._open)
                self._via_relay = via
        wait_s = body.get("wait_s") or 0.0  # a long poll: given up for a report to send, or stop()
        try:
            timeout_s = max(self.request_timeout_s, self.reply_hint_s or expect_s) + wait_s
            result = self._client.request(type_, body, timeout_s=timeout_s,
                                          abandon=self._wants_link if wait_s else None,
                                          wake_fd=self._wake_r if wait_s else None)
            if result is None:
                return None  # given up, not unanswered
        except TorchpassError as exc:
            self.refused = exc if isinstance(exc, RemoteError) else None  # answered, with an error
            if self.refused is None and self._via_relay:
                self._relay_timeouts += 1
                if self._relay_timeouts >= relay.TIMEOUTS_BEFORE_DIRECT:
                    # No answer through the node relay, twice running (once is mostly a
                    # coordinator that was late for many ranks at once): the next try goes to
                    # the coordinator itself.
                    self._client.close()
                    self._client, self._via_relay = None, False
                    self._relay_retry_at = self.clock() + relay.RELAY_RETRY_S
                    self._relay_timeouts = 0
            self.errors += 1
            if self.errors in (1, 10, 100) or self.errors % 1000 == 0:
                say(f"coordinator {self.endpoint} did not answer {type_} ({exc}); will keep trying")
            self._note_silence(str(exc))
            return None
        self.errors = 0
        self.refused = None
        self._failing_since = None
        self._relay_timeouts = 0
        return result

    def _note_silence(self, error: str) -> None:
        """No answer for lost_after_s: the first rank of the job to notice notes coordinator.lost."""
        now = self.clock()
        if self._failing_since is None:
            self._failing_since = now
        if self.lost_noted or now - self._failing_since < self.lost_after_s:
            return
        self.lost_noted = True
        from torchpass import coordinator_lost  # no torch, no zmq

        record = {"time": self.wall(), "rank": self.rank, "node": self.node, "error": error}
        try:
            if self.state_dir is None:
                raise OSError("TORCHPASS_STATE_DIR is not set")
            if not coordinator_lost.create(self.state_dir, self.job_id, record):
                return  # another rank noted it (and said so)
            where = ""
        except OSError as exc:
            where = f" (cannot note it in the state directory: {exc})"
        say(f"the coordinator does not answer; the job is unprotected{where}")

    def _base(self) -> dict:
        return {"job_id": self.job_id, "rank": self.rank}

    def _unprotected(self) -> dict:
        """``unprotected``: why this rank refuses pauses, in every report once it does."""
        why = self.pg.unprotected or self.fell_back or self.hold_refused
        return {"unprotected": why} if why else {}

    # -- replies and hold files from the coordinator only ------------------------------
    def _listen_refusals(self, auth) -> None:
        if hasattr(auth, "on_refused"):  # a jobauth.JobSigner: it checks every reply's MAC
            auth.on_refused = self._reply_refused

    def _reply_refused(self, why: str) -> None:
        """A reply without the job secret's MAC (control thread): dropped; said the 1st, 10th,
        100th and every 1000th time, so that a flood of them cannot flood the job's log."""
        self.replies_refused += 1
        n = self.replies_refused
        if n in (1, 10, 100) or n % 1000 == 0:
            say(f"rank {self.rank}: dropped a reply from {self.endpoint} ({why}; {n} so far): not the job's "
                "coordinator, or one with another secret; waiting for the real answer")

    def _hold_allowed(self, hold: str) -> str | None:
        """Why the pause's ``hold`` is refused (None: it is this rank's hold file in the layout,
        STATE_DIR/jobs/J/hold/M.rankR with M a valid id). Its contents can name the coordinator
        and secret a restored copy goes on with (_woken_from_snapshot), so it must lie where only
        this job's coordinator and root write."""
        if not self.state_dir:
            return f"the pause names hold file {hold!r}, but TORCHPASS_STATE_DIR is not set"
        p = os.path.normpath(hold) if isinstance(hold, str) and os.path.isabs(hold) else None
        want = layout.job_dir(self.state_dir, self.job_id) / layout.HOLD
        suffix = f".rank{self.rank}"
        name = os.path.basename(p) if p else ""
        if (p is None or p != hold or os.path.dirname(p) != str(want) or not name.endswith(suffix)
                or not layout.valid_snapshot_id(name[:-len(suffix)])
                or str(layout.hold_file(self.state_dir, self.job_id, name[:-len(suffix)], self.rank)) != p):
            return (f"the pause names hold file {hold!r}, not this rank's under {want} "
                    f"(M{suffix}): refused")
        return None

    def _run(self) -> None:
        try:
            self._start_relay()
            while not self._stop:
                if not self.registered:  # at the start, and again as a copy restored from a snapshot
                    self._register()
                    continue
                if self._expired():
                    self._expire()
                    continue
                with self._cv:
                    item = self._outbox.popleft() if self._outbox else None
                if item is not None:
                    type_, body = item
                    res = self._request(type_, body)
                    if res is None and type_ == "rank.checkpoint" and self.refused is not None:
                        # The coordinator answered that it will not take it (one older than the
                        # report): dropped, never resent, so it cannot hold up a pause's reports.
                        say(f"the coordinator refused a checkpoint report ({self.refused}); not resent")
                        with self._cv:
                            self._checkpoints_told += 1
                            self._cv.notify_all()
                        continue
                    if res is None:
                        with self._cv:
                            self._outbox.appendleft(item)  # resend after a pause
                        self._sleep(min(self.interval_s, 0.2))
                        continue
                    self._handle(res)
                    if type_ == "rank.checkpoint":
                        with self._cv:
                            self._checkpoints_told += 1
                            self._cv.notify_all()
                    if type_ == "rank.quiesced" and body["hold"]:
                        self._hold()
                    continue
                bstep, bcoll = getattr(self.pg, "boundary", (-1, -1))
                body = {**self._base(), "step": self.pg.steps, "collectives": self.pg.collectives, "node": self.node,
                        **self._unprotected()}
                if bstep >= 0:
                    body.update(boundary=bcoll, boundary_step=bstep)
                wait_s = self.long_poll_s()
                if wait_s:
                    body["wait_s"] = wait_s
                asked = self.clock()
                res = self._request("rank.progress", body)
                if res is not None:
                    self._handle(res)
                # A paused rank (quiesced at T, waiting for its resume) asks often:
                # the resume comes only in a reply, and every rank stands still
                # until the last one has it. Measured: up to one interval (0.5 s)
                # of every migration's pause went here. A long poll waited at the
                # coordinator instead: the next one goes at once (never two within
                # paused_interval_s, whatever the coordinator does; a running rank's
                # poll answered early with nothing to do waits out its report interval).
                if wait_s:
                    early = not self.pg.paused and not (isinstance(res, dict) and res.get("command"))
                    spacing = self.every_s() if early else self.paused_interval_s
                    self._sleep(spacing - (self.clock() - asked))
                else:
                    self._sleep(self.paused_every_s() if self.pg.paused else self.every_s())
        except Exception as exc:  # noqa: BLE001 - never take training down
            say(f"control link stopped ({type(exc).__name__}: {exc}); the rank cannot be migrated")
        finally:
            self._stop_relay()
            self._close()

    def _register(self) -> None:
        from torchpass import wire

        restored = {"restored": self.restored} if self.restored else {}
        # Every rank of the job registers at once: before the coordinator's first answer says how
        # long one may take (reply_within_s), expect what it would say for this job's size. With
        # 2 s, hundreds of 8,192 ranks gave up and registered again (issue 13, the harness).
        res = self._request(
            "rank.register",
            {**self._base(), "world_size": self.pg.size(), "node": self.node, "pid": os.getpid(),
             "generation": self.pg.generation, **self._unprotected(), **task_fields(), **restored},
            expect_s=wire.reply_within_s(self.pg.size()),
        )
        if res is not None:
            self.registered = True
            self._handle(res)
        else:
            self._sleep(self.interval_s)

    def every_s(self) -> float:
        """Seconds between progress reports: ours, or longer if the coordinator asks."""
        return max(self.interval_s, self.hint_s)

    def paused_every_s(self) -> float:
        """Seconds between polls while paused at T (never longer than between reports)."""
        return min(max(self.paused_interval_s, self.paused_hint_s), self.every_s())

    def long_poll_s(self) -> float:
        """The wait_s of this poll: 0 (a plain report) unless the coordinator parks polls.

        Running, the report interval: the report waits at the coordinator, which answers it at
        once with a command (a pause reaches every rank in one batch of replies, the moment it
        is decided, instead of in the reply to each rank's next report) or at the end of the
        interval, and the next report goes then. Paused, 80-100 % of wait_max_s, never past the
        pause's deadline, which the loop checks between requests."""
        if self.wait_max_s <= 0:
            return 0.0
        if not self.pg.paused:
            return round(self.every_s(), 3)
        wait = self.wait_max_s * random.uniform(0.8, 1.0)  # at most MAX_HINT_S (_pace)
        d = self.deadline()
        if d is not None:
            wait = min(wait, d - self.wall())
        return round(wait, 3) if wait >= self.paused_interval_s else 0.0

    def _wants_link(self) -> bool:
        """A long poll is given up: there is a report to send, or the link stops."""
        return self._stop or bool(self._outbox)

    def _pace(self, result: dict) -> None:
        """Take the reply's backpressure hints (bounded: a confused coordinator cannot silence us)."""
        for key, attr, cap in (("report_every_s", "hint_s", MAX_HINT_S),
                               ("paused_every_s", "paused_hint_s", MAX_HINT_S),
                               ("wait_max_s", "wait_max_s", MAX_HINT_S),
                               ("reply_within_s", "reply_hint_s", MAX_REPLY_HINT_S)):
            v = result.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0:
                setattr(self, attr, min(float(v), cap))

    def _sleep(self, seconds: float) -> None:
        with self._cv:
            if not self._stop and not self._outbox and seconds > 0:
                self._cv.wait(seconds)

    def _hold(self) -> None:
        """Close every socket and wait for the hold file (dump + restore happen now).

        At the pause's deadline with no hold file (the coordinator is gone) it
        leaves the wait still holding; the control loop then claims the rank.
        """
        path = self._hold_file
        # The node's other ranks hold with this one (a move takes a whole node): the relay first
        # forwards their rank.quiesced and its answers, then closes its sockets.
        self._stop_relay(drain_s=relay.DRAIN_S)
        self._close()
        self._holding = True
        marker = _agent_marker()
        try:
            if marker is not None:
                _write_marker(*marker)
            while not self._stop and path and not os.path.exists(path):
                if self._expired():
                    return
                # Short sleeps restart cleanly after a restore; and a restored rank wakes from
                # this loop while the source's kill runs: at 20 ms its wake-up could outlast the
                # kill and delay its resume.
                time.sleep(HOLD_POLL_S)
            self._hold_file = None  # released: the coordinator's decision stands, no claim
            if path:
                self._woken_from_snapshot(path)
        finally:
            self._holding = False
            self._start_relay()  # on the node it started on (not after a move)
            if marker is not None:
                try:
                    os.unlink(marker[0])
                except OSError:
                    pass  # a spare has no such directory: nothing to take back

    def _woken_from_snapshot(self, hold: str) -> None:
        """A copy restored from a whole-job snapshot after a lost node (its relaunch) is woken
        by a hold file that says so (``restored ID``, rankwrap's --restore-snapshot). The
        coordinator that took the snapshot had this rank registered in the step that is gone, so
        the copy registers again, naming the snapshot, and waits paused for the resume. Its pause
        deadline counts from now: the pause it quiesced for ended long ago (the snapshot's own
        resume), and the copy must not fall back to that rendezvous at once."""
        try:
            with open(hold, "rb") as f:
                lines = f.read(1024).decode(errors="replace").splitlines()
        except OSError:
            return
        said = lines[0].split() if lines else []
        if len(said) == 2 and said[0] == layout.RESTORED_WAKE:
            told = dict(line.split("=", 1) for line in lines[1:] if "=" in line)
            self._take_run(told.get("coordinator"), told.get("secret"))
            self.restored = said[1]
            self.registered = False
            self._armed_reported = None
            if self._quiesced_wall is not None:
                self._quiesced_wall = self.wall()

    def _take_run(self, endpoint: str | None, secret: str | None) -> None:
        """The coordinator and job secret of the run that restored this copy (a job stopped and
        resumed has new ones; after a lost node they are the same), and a new signing sender
        either way: the source copy went on signing past the image's counter."""
        if endpoint:
            self.endpoint = _tcp(endpoint)
            self._client = None  # the hold destroyed its context: the next request makes a new one
        if secret:
            from torchpass.jobauth import JobSigner, parse_secret

            try:
                self.auth = JobSigner(parse_secret(secret))
                self._listen_refusals(self.auth)
                self._client = None  # the next request's client signs with it
                return
            except Exception as exc:  # noqa: BLE001 - a bad secret: say so, keep the old signer
                say(f"rank {self.rank}: the restoring step's job secret is unusable ({exc}); keeping the image's")
        renew = getattr(self.auth, "renew", None)
        if renew is not None:
            renew()

    # -- never left paused ------------------------------------------------------------
    def deadline(self) -> float | None:
        """Wall-clock time at which this quiesced rank stops waiting for the coordinator (None: not due)."""
        p, q = self._pause, self._quiesced_wall
        if p is None or q is None:
            return None
        d = q + p["deadline_s"]
        if self._hold_file is not None and self.moved:
            d += self.claim_delay_s  # a restored copy: the source copy claims first
        return d

    def _expired(self) -> bool:
        d = self.deadline()
        return d is not None and self.wall() >= d

    def _expire(self) -> None:
        """No resume by the deadline: claim the rank if held, then resume in place (once)."""
        hold = self._hold_file
        if hold is not None and not os.path.exists(hold):
            won = self._claim(hold)
            if won is None:
                return self._exit(1)
            if not won:
                say(f"rank {self.rank}: another copy of this rank went on ({hold}.claim exists): this copy exits")
                return self._exit(0)
            if not self.moved:
                self._call_off_handoff()
        self._hold_file = None
        self._fall_back()

    def _call_off_handoff(self) -> None:
        """The source copy goes on where it is: call the hand-off off as a rollback's tpassd does
        (``op=abort``: marker "abort"; the rank record back to this copy if a restored copy had
        taken it), so that this copy's task wrapper reports its exit code instead of waiting for
        a moved rank's, and the restored copy's wrapper writes none (torchpass.checkpoint.rankwrap)."""
        rank_dir = self.rank_dir
        if not rank_dir:
            return
        from torchpass.checkpoint import safeio

        record = layout.rank_record(rank_dir, self.job_id, self.rank)
        try:
            dfd = os.open(record.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            say(f"rank {self.rank}: cannot call the move off in {record.parent} ({exc}); its task may wait "
                "for a moved copy")
            return
        try:
            try:
                rec = json.loads(safeio.read_regular(record.name, safeio.MAX_RECORD_BYTES, dir_fd=dfd))
            except (OSError, ValueError):
                rec = {}
            prev = rec.get("previous") if isinstance(rec, dict) else None
            if rec.get("restored_from") and isinstance(prev, dict) and prev.get("wrapper_pid"):
                safeio.write_at(dfd, record.name, json.dumps(prev).encode())
            safeio.write_at(dfd, layout.handoff(rank_dir, self.job_id, self.rank).name, b"abort\n")
        except OSError as exc:
            say(f"rank {self.rank}: cannot call the move off in {record.parent} ({exc}); its task may wait "
                "for a moved copy")
        finally:
            os.close(dfd)

    def _claim(self, hold: str) -> bool | None:
        """``hold_file.claim``, O_CREAT|O_EXCL on the shared state directory: exactly one copy gets it."""
        try:
            fd = os.open(hold + ".claim", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            return False
        except OSError as exc:
            say(f"rank {self.rank}: cannot claim the rank ({hold}.claim: {exc}); not resuming, so that no two "
                "copies of it go on")
            return None
        with os.fdopen(fd, "w") as f:
            f.write(f"{socket.gethostname()} {os.getpid()}\n")
        return True

    def _fall_back(self) -> None:
        """Apply the pause's ``fallback`` as if the coordinator had sent it; unprotected from now on."""
        p, self._pause, self._quiesced_wall = self._pause, None, None
        d = p["deadline_s"]
        self.fell_back = f"resumed in place without the coordinator (no resume in {d:g} s)"
        with self._cv:
            self._outbox.clear()  # what the coordinator never took (rank.quiesced) is moot now
        say(f"no resume from the coordinator in {d:g} s: resuming in place (the job is unprotected from now on)")
        fb = p["fallback"]
        gen, rv = int(fb["generation"]), Rendezvous(str(fb["master_addr"]), int(fb["master_port"]))
        self._rebuilt.clear()
        self.pg.resume(gen, rv)
        threading.Thread(target=self._watch_join, args=(gen, rv, p["join_s"]), name="torchpass-fallback",
                         daemon=True).start()

    def _watch_join(self, gen: int, rv: Rendezvous, join_s: float) -> None:
        """Every rank of the fallback must join within join_s; else one line and exit 1.

        Each rank sets its own key on rank 0's store (its own client, beside the
        rebuild's), so the line names who is missing: rank 0 itself when its
        store never answers.
        """
        import torch.distributed as dist

        end = self.clock() + join_s
        prefix = FALLBACK_KEY.format(gen=gen)
        store = None
        while not self._rebuilt.wait(0.2):
            left = end - self.clock()
            if left <= 0:
                break
            if store is None:
                try:
                    store = dist.TCPStore(rv.master_addr, rv.master_port, self.pg.size(), False,
                                          datetime.timedelta(seconds=max(0.5, min(2.0, left))),
                                          wait_for_workers=False)
                    store.set(f"{prefix}/rank{self.rank}", self.node)
                except Exception:  # noqa: BLE001 - rank 0's store is not up (yet)
                    store = None
        if self._rebuilt.is_set():
            return
        try:
            missing = ([r for r in range(self.pg.size()) if not store.check([f"{prefix}/rank{r}"])]
                       if store is not None else [0])
        except Exception:  # noqa: BLE001 - rank 0 went away meanwhile
            missing = [0]
        who = (f"rank(s) {', '.join(map(str, missing))} did not join within {join_s:g} s "
               "(the moved rank has no live copy)" if missing else f"the group did not rebuild within {join_s:g} s")
        say(f"rank {self.rank}: resume in place without the coordinator failed: {who}; the job cannot go on")
        self._exit(1)

    # -- commands -----------------------------------------------------------------
    def _handle(self, result: dict) -> None:
        if isinstance(result, dict):
            self._pace(result)
        cmd = result.get("command") if isinstance(result, dict) else None
        if not isinstance(cmd, dict):
            return
        kind = cmd.get("command")
        try:
            if kind == "pause":
                at, gen = int(cmd["at"]), int(cmd["generation"])
                hold = cmd.get("hold_file")
                if hold and self.hold_refused is None:
                    why = self._hold_allowed(hold)
                    if why is not None:  # refused with the pause, as an unprotected rank refuses it
                        self.hold_refused = f"{why}; the rank refuses pauses from now on"
                        say(f"rank {self.rank}: {self.hold_refused}")
                # Set before arming: the training thread may reach T (on_quiesced reads both) at once.
                before = self._hold_file, self._pause
                self._hold_file, self._pause = (str(hold) if hold else None), _pause_terms(cmd)
                # after a fallback, or a hold file refused: unprotected
                ok = self.fell_back is None and self.hold_refused is None and self.pg.arm(at, gen)
                if not ok:
                    self._hold_file, self._pause = before
                self._report_armed(at, gen, ok)
            elif kind == "resume":
                gen = int(cmd["generation"])
                rv = Rendezvous(str(cmd["master_addr"]), int(cmd["master_port"]))
                how = self.pg.resume(gen, rv)
                if how:  # the coordinator settled the pause: no deadline runs any more
                    self._pause = self._quiesced_wall = None
                if how == "cancelled":
                    self.on_resumed(self.pg, {"generation": self.pg.generation, "rebuild_s": 0.0,
                                              "cancelled": True})
                    self._hold_file = None
            elif kind not in (None, "none"):
                say(f"ignoring unknown coordinator command {kind!r}")
        except (KeyError, TypeError, ValueError) as exc:
            say(f"ignoring malformed coordinator command {cmd!r} ({exc})")

    def _report_armed(self, at: int, gen: int, ok: bool) -> None:
        key = (at, gen, ok)
        if key != self._armed_reported:
            self._armed_reported = key
            self._post("rank.armed", {**self._base(), "at": at, "generation": gen,
                                      "collectives": self.pg.collectives, "accepted": ok,
                                      **({} if ok else self._unprotected())})

    def _post(self, type_: str, body: dict) -> None:
        with self._cv:
            self._outbox.append((type_, body))
            self._cv.notify_all()
        self._wake()

    def _wake(self) -> None:
        """Give a long poll up now (see _wake_r)."""
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, InterruptedError):
            pass  # full: the poll wakes anyway

    def report_checkpoint(self, body: dict) -> None:
        """An application checkpoint completed or failed (torchpass.checkpoint, rank 0): tell the
        coordinator (``rank.checkpoint``; any thread)."""
        with self._cv:
            self._checkpoints_posted += 1
        self._post("rank.checkpoint", {**self._base(), **body})

    def checkpoints_told(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until the coordinator has answered every checkpoint report
        (torchpass.checkpoint's close(), before the rank exits)."""
        end = self.clock() + timeout
        with self._cv:
            while self._checkpoints_told < self._checkpoints_posted and not self._stop:
                left = end - self.clock()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.1))
            return self._checkpoints_told >= self._checkpoints_posted

    def _guard_dump(self) -> None:
        for guard in list(self.before_dump):
            try:
                guard()
            except Exception as exc:  # noqa: BLE001 - never take training down
                say(f"before the dump: {type(exc).__name__}: {exc}")

    # -- PauseListener (called from the pausing training thread) --------------------
    def on_quiesced(self, pg: ReconfigurablePG, info: dict) -> None:
        hold = self._hold_file is not None
        released: dict = {}
        if hold:
            t0 = self.clock()
            self._guard_dump()
            # after the guards: a checkpoint's finished write frees its buffers
            released = self._release_caches()
            info = {**info, "drain_s": float(info["drain_s"]) + (self.clock() - t0)}
        if self._pause is not None:
            self._quiesced_wall = self.wall()  # D counts from here
        self._post("rank.quiesced", {**self._base(), "generation": int(info["next_generation"]),
                                     "collectives": pg.collectives, "sockets": int(info["sockets"]),
                                     "drain_s": float(info["drain_s"]), "node": self.node, "pid": os.getpid(),
                                     "hold": hold, **released})

    def _release_caches(self) -> dict:
        """Free allocator caches before the dump (torchpass/runtime/release.py): the figure
        ``released_mb`` goes to the coordinator; a failure is said and ignored."""
        try:
            return {"released_mb": float(release_allocator_caches()["released_mb"])}
        except Exception as exc:  # noqa: BLE001 - never take training down
            say(f"before the dump, freeing allocator caches: {type(exc).__name__}: {exc}")
            return {}

    def on_resumed(self, pg: ReconfigurablePG, info: dict) -> None:
        self._rebuilt.set()
        self._armed_reported = None
        body = {**self._base(), "generation": pg.generation, "collectives": pg.collectives,
                "rebuild_s": float(info["rebuild_s"]), "node": self.node, "moved": self.moved}
        if info.get("cancelled"):
            body["cancelled"] = True
        self._post("rank.resumed", body)

    def on_unprotected(self, pg: ReconfigurablePG, reason: str, dropped: tuple[int, int] | None) -> None:
        # Called from the training thread. A pause it had accepted is refused
        # now: the coordinator cancels it (every report also says why).
        if dropped is not None:
            self._report_armed(dropped[0], dropped[1], False)


def _relay_args(env) -> dict:
    """relay_path and relay_host for ControlLink from the task's environment (no relay: {})."""
    node = env.get("TORCHPASS_NODE") or env.get("SLURMD_NODENAME") or socket.gethostname()
    if not relay.relay_enabled(env) or relay.local_rank(env) is None:
        return {}  # a task that knows no local rank knows no node relay host either
    path = relay.relay_path(relay.relay_dir(env), int(env["TORCHPASS_JOB_ID"]), env.get("SLURM_STEP_ID", "0"), node)
    return {"relay_path": path, "relay_host": relay.is_node_leader(env)}


def _tcp(endpoint: str) -> str:
    """TORCHPASS_COORDINATOR (ADDR:PORT, or a full ZeroMQ endpoint) as a ZeroMQ endpoint."""
    return endpoint if "://" in endpoint else f"tcp://{endpoint}"


def _pause_terms(cmd: dict) -> dict | None:
    """A pause command's deadline_s, fallback and join_s (None: an older coordinator sent none)."""
    fb = cmd.get("fallback")
    if (not isinstance(fb, dict) or cmd.get("deadline_s") is None
            or any(k not in fb for k in ("generation", "master_addr", "master_port"))):
        return None
    return {"deadline_s": float(cmd["deadline_s"]), "fallback": fb,
            "join_s": float(cmd.get("join_s") or FALLBACK_JOIN_S)}


__all__ = ["ControlLink", "count_sockets"]
