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

Where the link is: ``state``, a ``link_state.LinkState``, moved only through
``_enter``, which checks every move against ``link_state.TRANSITIONS`` (the
state diagram is drawn there). Its parts: ``coordinator_channel`` (one kept
connection, the node relay, the pacing hints, a coordinator gone silent),
``hold`` (the hold file's place and what it says), ``pause_fallback`` (never
left paused: claim, call the hand-off off, the fallback's join).
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from collections import deque
from typing import Callable

from torchpass import envnames, wire
from torchpass.runtime import hold as holdfile
from torchpass.runtime import relay
from torchpass.runtime.coordinator_channel import (  # noqa: F401 - MAX_HINT_S: the hints' bound, read by tests
    COORDINATOR_LOST_S,
    MAX_HINT_S,
    CoordinatorChannel,
    Pacing,
)
from torchpass.runtime.link_state import LinkState, check_transition
from torchpass.runtime.pause_fallback import RESTORED_CLAIM_DELAY_S, call_off_handoff, claim, pause_terms, watch_join
from torchpass.runtime.pg import PauseListener, ReconfigurablePG, Rendezvous, count_sockets
from torchpass.runtime.release import release_allocator_caches
from torchpass.runtime.say import say


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
    task = env.get(envnames.TASK)
    if task and task.isdigit():
        out["task"] = int(task)
    if env.get("TORCHELASTIC_RUN_ID") is not None and serves_tcp(_parent_in_proc()):
        out["pinned"] = AGENT_SERVES_WHY
    return out


class ControlLink(PauseListener):
    """The rank's control thread: registers, reports, takes commands, holds (see the module
    docstring); ``state`` says where it is (link_state.LinkState)."""

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
        self.job_id = job_id
        self.rank = rank
        # a torch outside the tested range that the site allowed (torch_range): why, in rank.register
        self.torch_override = ""
        self._node = node
        self._start_host = socket.gethostname()
        self._start_netns = _netns_inode()
        self.state_dir = state_dir
        self.rank_dir = rank_dir  # the rank wrapper's record directory (the hand-off marker lives there)
        self.claim_delay_s = claim_delay_s
        self.wall = wall
        self.clock = clock
        self._exit = exit
        self._state = LinkState.REGISTERING
        self._stopped_in = LinkState.REGISTERING  # the state stop() found (registered reads it)
        self._state_lock = threading.Lock()  # the control thread, the training thread and stop() move it
        self.pacing = Pacing(interval_s, paused_interval_s)
        self.channel = CoordinatorChannel(
            endpoint=endpoint, rank=rank, auth=auth, request_timeout_s=request_timeout_s, pacing=self.pacing,
            lost_after_s=lost_after_s, on_lost=self._note_lost, moved=lambda: self.moved,
            stopping=lambda: self._stop, clock=clock, relay_path=relay_path, relay_host=relay_host)
        self._cv = threading.Condition()
        self._outbox: deque[tuple[str, dict]] = deque()
        # A long poll waits in zmq's poll on its socket and on this pipe: _post() and stop() write
        # a byte, so the poll is given up at once, with no wake-up while nothing happens. It lives
        # as long as the process: closed at stop(), its number could be reused by another file
        # while a training thread still writes to it.
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread: threading.Thread | None = None
        self._armed_reported: tuple[int, int, bool] | None = None
        self.restored: str | None = None  # the whole-job snapshot this copy was restored from
        # Data beside the state. The accepted pause (its deadline_s, fallback, join_s) and its hold
        # file; when this rank quiesced for it (wall clock: D counts from there); why pauses are
        # refused since a hold file was refused, or since the rank resumed without the coordinator.
        self._hold_file: str | None = None
        self._pause: dict | None = None
        self._quiesced_wall: float | None = None
        self.hold_refused: str | None = None
        self.fell_back: str | None = None
        self._rebuilt = threading.Event()
        # Called before a held rank reports quiesced (it is about to be dumped): the job's
        # torchpass.checkpoint waits there for its background write, so no checkpoint file is
        # open in the image. Each may block; an exception is said and ignored.
        self.before_dump: list[Callable[[], object]] = []
        self._checkpoints_posted = 0  # rank.checkpoint reports posted, and answered by the coordinator
        self._checkpoints_told = 0
        pg.listener = self

    @classmethod
    def from_env(cls, pg: ReconfigurablePG, env=os.environ) -> "ControlLink":
        from torchpass.jobauth import signer_from_env  # None without TORCHPASS_JOB_SECRET (unsigned)

        link = cls(
            pg,
            endpoint=_tcp(env[envnames.COORDINATOR]),
            job_id=int(env[envnames.JOB_ID]),
            rank=pg.rank(),
            node=env.get(envnames.NODE) or env.get("SLURMD_NODENAME"),
            interval_s=float(env.get(envnames.PROGRESS_INTERVAL, "0.5")),
            paused_interval_s=float(env.get(envnames.PAUSED_POLL_INTERVAL, "0.02")),
            auth=signer_from_env(env),  # every rank.* request signed with the job secret
            state_dir=env.get(envnames.STATE_DIR) or None,
            rank_dir=env.get(envnames.RANK_STATE_DIR) or None,
            lost_after_s=float(env.get(envnames.COORDINATOR_LOST_S, COORDINATOR_LOST_S)),
            **_relay_args(env),
        )
        return link

    # -- state -------------------------------------------------------------------
    @property
    def state(self) -> LinkState:
        return self._state

    def _enter(self, new: LinkState) -> None:
        """Every move of ``state`` goes through here, checked against link_state.TRANSITIONS."""
        with self._state_lock:
            old = self._state
            if old is LinkState.STOPPED and new is not LinkState.STOPPED:
                return  # stop() wins over whatever a thread was about to do
            why = check_transition(old, new)
            if why is not None:
                say(f"rank {self.rank}: {why}")
            if new is LinkState.STOPPED and old is not LinkState.STOPPED:
                self._stopped_in = old
            self._state = new

    @property
    def registered(self) -> bool:
        """A ``rank.register`` was answered (and, for a restored copy, again since its wake)."""
        state = self._stopped_in if self._state is LinkState.STOPPED else self._state
        return state is not LinkState.REGISTERING

    @property
    def _stop(self) -> bool:
        return self._state is LinkState.STOPPED

    @property
    def _holding(self) -> bool:
        return self._state is LinkState.HOLDING

    def _after_pause_settled(self) -> LinkState:
        """Where the link goes once nothing holds it: quiesced while its pause's deadline runs."""
        return LinkState.QUIESCED if self._quiesced_wall is not None else LinkState.REPORTING

    # -- what the channel and pacing say, as callers read it ---------------------------
    endpoint = property(lambda self: self.channel.endpoint)
    auth = property(lambda self: self.channel.auth)
    errors = property(lambda self: self.channel.errors)
    refused = property(lambda self: self.channel.refused)
    replies_refused = property(lambda self: self.channel.replies_refused)
    lost_noted = property(lambda self: self.channel.lost_noted)
    request_timeout_s = property(lambda self: self.channel.request_timeout_s)
    wait_max_s = property(lambda self: self.pacing.wait_max_s)
    reply_hint_s = property(lambda self: self.pacing.reply_hint_s)
    interval_s = property(lambda self: self.pacing.interval_s)
    paused_interval_s = property(lambda self: self.pacing.paused_interval_s)

    def every_s(self) -> float:
        return self.pacing.every_s()

    def paused_every_s(self) -> float:
        return self.pacing.paused_every_s()

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
            self._enter(LinkState.STOPPED)
            self._cv.notify_all()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)
        self.channel.stop_relay()
        self.channel.close()

    def _request(self, type_: str, body: dict, *, expect_s: float = 0.0) -> dict | None:
        return self.channel.request(type_, body, expect_s=expect_s, abandon=lambda: self._wants_link(),
                                    wake_fd=self._wake_r)

    def _note_lost(self, error: str) -> None:
        """No answer for lost_after_s: the first rank of the job to notice notes coordinator.lost."""
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

    def _run(self) -> None:
        try:
            self.channel.start_relay()
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
                        self._forgotten()
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
                meter = getattr(self.pg, "meter", None)
                compute = meter.pending() if meter is not None else {}
                body.update(compute)  # the steps' compute times the coordinator has not had (fail-slow)
                wait_s = self.long_poll_s()
                if wait_s:
                    body["wait_s"] = wait_s
                asked = self.clock()
                res = self._request("rank.progress", body)
                if res is not None:
                    if compute:
                        meter.sent(compute["compute_step"])
                    self._handle(res)
                elif self._forgotten():
                    continue
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
            self.channel.stop_relay()
            self.channel.close()

    def _forgotten(self) -> bool:
        """The coordinator answered that this rank has not registered: one its supervisor started
        again after the last one died, which rebuilds its view from the ranks' registrations. The
        rank registers again (a paused rank stays paused: its resume comes in the answer). A rank
        that fell back stays unprotected and unregistered."""
        exc = self.refused
        if getattr(exc, "code", None) != "not_found" or self._state not in (LinkState.REPORTING, LinkState.QUIESCED):
            return False
        say("the coordinator does not know this rank (it was restarted): registering again")
        self._enter(LinkState.REGISTERING)
        return True

    def _register(self) -> None:
        restored = {"restored": self.restored} if self.restored else {}
        # Every rank of the job registers at once: before the coordinator's first answer says how
        # long one may take (reply_within_s), expect what it would say for this job's size. With
        # 2 s, hundreds of 8,192 ranks gave up and registered again (measured with the harness).
        res = self._request(
            "rank.register",
            {**self._base(), "world_size": self.pg.size(), "node": self.node, "pid": os.getpid(),
             "generation": self.pg.generation, **self._unprotected(), **task_fields(), **restored,
             **({"rails": list(self.pg.rails)} if self.pg.rails else {}),
             **({"torch_override": self.torch_override} if self.torch_override else {})},
            expect_s=wire.reply_within_s(self.pg.size()),
        )
        if res is not None:
            self._enter(self._after_pause_settled())
            self._handle(res)
        else:
            self._sleep(self.interval_s)

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
        wait = self.wait_max_s * random.uniform(0.8, 1.0)  # at most MAX_HINT_S (Pacing.take)
        d = self.deadline()
        if d is not None:
            wait = min(wait, d - self.wall())
        return round(wait, 3) if wait >= self.paused_interval_s else 0.0

    def _wants_link(self) -> bool:
        """A long poll is given up: there is a report to send, or the link stops."""
        return self._stop or bool(self._outbox)

    def _sleep(self, seconds: float) -> None:
        with self._cv:
            if not self._stop and not self._outbox and seconds > 0:
                self._cv.wait(seconds)

    # -- holding ----------------------------------------------------------------------
    def _hold(self) -> None:
        """Close every socket and wait for the hold file (dump + restore happen now).

        At the pause's deadline with no hold file (the coordinator is gone) it
        leaves the wait still holding; the control loop then claims the rank.
        """
        path = self._hold_file
        # The node's other ranks hold with this one (a move takes a whole node): the relay first
        # forwards their rank.quiesced and its answers, then closes its sockets.
        self.channel.stop_relay(drain_s=relay.DRAIN_S)
        self.channel.close()
        self._enter(LinkState.HOLDING)
        marker = holdfile.agent_marker()
        woken = False
        try:
            if marker is not None:
                holdfile.write_marker(*marker)
            while not self._stop and path and not os.path.exists(path):
                if self._expired():
                    return
                # Short sleeps restart cleanly after a restore; and a restored rank wakes from
                # this loop while the source's kill runs: at 20 ms its wake-up could outlast the
                # kill and delay its resume.
                time.sleep(holdfile.HOLD_POLL_S)
            self._hold_file = None  # released: the coordinator's decision stands, no claim
            if path:
                woken = self._woken_from_snapshot(path)
        finally:
            if self._state is LinkState.HOLDING:
                self._enter(LinkState.REGISTERING if woken else self._after_pause_settled())
            self.channel.start_relay()  # on the node it started on (not after a move)
            if marker is not None:
                try:
                    os.unlink(marker[0])
                except OSError:
                    pass  # a spare has no such directory: nothing to take back

    def _woken_from_snapshot(self, hold: str) -> bool:
        """A copy restored from a whole-job snapshot after a lost node (its relaunch) is woken
        by a hold file that says so (``restored ID``, rankwrap's --restore-snapshot). The
        coordinator that took the snapshot had this rank registered in the step that is gone, so
        the copy registers again, naming the snapshot, and waits paused for the resume. Its pause
        deadline counts from now: the pause it quiesced for ended long ago (the snapshot's own
        resume), and the copy must not fall back to that rendezvous at once. True when so."""
        wake = holdfile.restored_wake(hold)
        if wake is None:
            return False
        snapshot, told = wake
        endpoint = told.get("coordinator")
        self.channel.take_run(_tcp(endpoint) if endpoint else None, told.get("secret"))
        self.restored = snapshot
        self._armed_reported = None
        if self._quiesced_wall is not None:
            self._quiesced_wall = self.wall()
        return True

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
            won = claim(hold, self.rank)
            if won is None:
                return self._exit(1)
            if not won:
                say(f"rank {self.rank}: another copy of this rank went on ({hold}.claim exists): this copy exits")
                return self._exit(0)
            if not self.moved:
                call_off_handoff(self.rank_dir, self.job_id, self.rank)
        self._hold_file = None
        self._fall_back()

    def _fall_back(self) -> None:
        """Apply the pause's ``fallback`` as if the coordinator had sent it; unprotected from now on."""
        p, self._pause, self._quiesced_wall = self._pause, None, None
        d = p["deadline_s"]
        self.fell_back = f"resumed in place without the coordinator (no resume in {d:g} s)"
        self._enter(LinkState.FELL_BACK)
        with self._cv:
            self._outbox.clear()  # what the coordinator never took (rank.quiesced) is moot now
        say(f"no resume from the coordinator in {d:g} s: resuming in place (the job is unprotected from now on)")
        fb = p["fallback"]
        gen, rv = int(fb["generation"]), Rendezvous(str(fb["master_addr"]), int(fb["master_port"]))
        self._rebuilt.clear()
        self.pg.resume(gen, rv)
        threading.Thread(target=watch_join, args=(self.pg, self.rank, self.node, gen, rv, p["join_s"], self._rebuilt,
                                                  self.clock, self._exit),
                         name="torchpass-fallback", daemon=True).start()

    # -- commands -----------------------------------------------------------------
    def _handle(self, result: dict) -> None:
        if isinstance(result, dict):
            self.pacing.take(result)
        cmd = result.get("command") if isinstance(result, dict) else None
        if not isinstance(cmd, dict):
            return
        kind = cmd.get("command")
        try:
            if kind == wire.COMMAND_PAUSE:
                at, gen = int(cmd["at"]), int(cmd["generation"])
                hold = cmd.get("hold_file")
                if hold and self.hold_refused is None:
                    why = holdfile.hold_refusal(hold, self.state_dir, self.job_id, self.rank)
                    if why is not None:  # refused with the pause, as an unprotected rank refuses it
                        self.hold_refused = f"{why}; the rank refuses pauses from now on"
                        say(f"rank {self.rank}: {self.hold_refused}")
                # Set before arming: the training thread may reach T (on_quiesced reads both) at once.
                before = self._hold_file, self._pause
                self._hold_file, self._pause = (str(hold) if hold else None), pause_terms(cmd)
                # after a fallback, or a hold file refused: unprotected
                ok = self.fell_back is None and self.hold_refused is None and self.pg.arm(at, gen)
                if not ok:
                    self._hold_file, self._pause = before
                self._report_armed(at, gen, ok)
            elif kind == wire.COMMAND_RESUME:
                gen = int(cmd["generation"])
                rv = Rendezvous(str(cmd["master_addr"]), int(cmd["master_port"]))
                rails = cmd.get("rails")  # a reroute: rebuild on these data rails
                how = self.pg.resume(gen, rv, tuple(str(r) for r in rails)) if rails else self.pg.resume(gen, rv)
                if how:  # the coordinator settled the pause: no deadline runs any more
                    self._pause = self._quiesced_wall = None
                    if self._state is LinkState.QUIESCED:
                        self._enter(LinkState.REPORTING)
                if how == "cancelled":
                    self.on_resumed(self.pg, {"generation": self.pg.generation, "rebuild_s": 0.0,
                                              "cancelled": True})
                    self._hold_file = None
            elif kind not in (None, wire.COMMAND_NONE):
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
            if self._state in (LinkState.REGISTERING, LinkState.REPORTING):
                self._enter(LinkState.QUIESCED)
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
    node = env.get(envnames.NODE) or env.get("SLURMD_NODENAME") or socket.gethostname()
    if not relay.relay_enabled(env) or relay.local_rank(env) is None:
        return {}  # a task that knows no local rank knows no node relay host either
    path = relay.relay_path(relay.relay_dir(env), int(env[envnames.JOB_ID]), env.get("SLURM_STEP_ID", "0"), node)
    return {"relay_path": path, "relay_host": relay.is_node_leader(env)}


def _tcp(endpoint: str) -> str:
    """TORCHPASS_COORDINATOR (ADDR:PORT, or a full ZeroMQ endpoint) as a ZeroMQ endpoint."""
    return endpoint if "://" in endpoint else f"tcp://{endpoint}"


__all__ = ["ControlLink", "count_sockets"]
