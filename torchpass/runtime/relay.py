"""One connection per node to the coordinator: the node relay.

Every rank used to keep its own TCP connection to the job's coordinator. At 1,024 nodes × 8
ranks that is 8,192 connections, and libzmq keeps 28-52 KB of queues and buffers for each
(docs/benchmarks.md, "Why the RSS grows with the ranks"); a rank that timed out replaced its
connection, which added more. The ranks of a node now share one: the node's first rank (local
rank 0: ``LOCAL_RANK`` under torchrun, else ``SLURM_LOCALID``) runs a relay thread that binds a
ROUTER on a unix socket and forwards every frame, unchanged, over one DEALER to the coordinator;
the other ranks of the node connect to that socket instead of the coordinator.

The frames pass unchanged: a rank's request keeps its own signature (the job secret's HMAC,
checked by the coordinator as before), so the relay reads no secret and can forge nothing. What the
relay adds is the bundle (wire.RELAY_BUNDLE): the requests of the node's ranks that are ready
together (8 acknowledgments of one pause, within a few ms) go up as one message, each after its
rank's socket identity at the relay, and the coordinator answers them, and the long polls it had
parked for them, with one message per relay each time it replies (a pause to 1,024 nodes x 8 ranks
is 1,024 messages). The relay then hands each reply to its rank's socket. The coordinator parks a
rank's long poll by rank, as before, whatever connection it came on.

Where: ``DIR/job<J>.<step>-<node>.sock``, DIR = ``$TORCHPASS_RELAY_DIR`` or
``/tmp/torchpass-relay-<uid>``, a directory of the job's user with mode 0700 (checked before
every use: a directory another user made or can write is refused, and the ranks then connect to
the coordinator themselves). ``TORCHPASS_RELAY=0`` turns the relay off.

A rank that finds no relay (none listening on the socket), or whose requests through it timed out
twice running, talks to the coordinator itself, as before, and tries the relay again RELAY_RETRY_S
later. A rank
restored on another node (a migration's target) always talks to the coordinator itself.

CRIU: a held rank has no socket (control.py ``_hold``). The relay's host rank, told to hold, first
lets the relay forward the node's other ranks' ``rank.quiesced`` (they hold with it: a move takes
a whole node) and their answers (at most DRAIN_S), then stops the relay, which closes its sockets
and its context; after the hold, on the same node, it starts it again.
"""

from __future__ import annotations

import atexit
import os
import socket
import stat
import threading
import time

from torchpass.runtime.say import say

RELAY_ENV = "TORCHPASS_RELAY"  # "0": no relay (every rank connects to the coordinator itself)
RELAY_DIR_ENV = "TORCHPASS_RELAY_DIR"
# How long a held relay host waits for the node's other ranks to report quiesced through it.
DRAIN_S = 2.0
# A rank that went to the coordinator itself (no relay, or time-outs through it) tries the relay
# again after this long.
RELAY_RETRY_S = 30.0
# Requests through the relay in a row with no answer before a rank goes to the coordinator itself:
# one is mostly the coordinator late for many ranks at once (a pause's 8,192 acknowledgments), and
# a direct connection then only adds to its load; two, the relay may be stuck.
TIMEOUTS_BEFORE_DIRECT = 2
# How long a rank's first connection waits for its node's relay to listen before it connects to
# the coordinator itself.
FIRST_WAIT_S = 3.0
# A rank that sent nothing through the relay for this long is no longer waited for at a hold.
PEER_FORGET_S = 20.0
# Frames moved per socket per pass of the relay loop (then the other direction gets its turn).
BURST = 256
# After a rank's request, how long the relay waits for the node's other ranks' requests to go up
# in the same bundle (they acknowledge a pause together): at most, and with no new one.
LINGER_S = 0.002
LINGER_QUIET_S = 0.001


def relay_enabled(env=os.environ) -> bool:
    return env.get(RELAY_ENV, "1").strip().lower() not in ("0", "no", "false", "off")


def local_rank(env=os.environ) -> int | None:
    """The task's rank on its node: LOCAL_RANK under torchrun, else SLURM_LOCALID (None: neither)."""
    local = env.get("LOCAL_RANK")
    if local is None:
        local = env.get("SLURM_LOCALID")
    local = (local or "").strip()
    return int(local) if local.isdigit() else None


def is_node_leader(env=os.environ) -> bool:
    """Local rank 0 hosts the node's relay."""
    return local_rank(env) == 0


def relay_dir(env=os.environ, uid: int | None = None) -> str:
    uid = os.getuid() if uid is None else uid
    return env.get(RELAY_DIR_ENV) or f"/tmp/torchpass-relay-{uid}"


def private_dir(path: str, *, create: bool, uid: int | None = None) -> str | None:
    """``path`` if it is a directory of ``uid`` that nobody else can write or list (made, 0700, when
    ``create``); None (and why, on stderr once per caller) otherwise."""
    uid = os.getuid() if uid is None else uid
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            say(f"no node relay: cannot make {path} ({exc}); every rank connects to the coordinator itself")
            return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        if create:
            say(f"no node relay: {path} is not a directory of uid {uid} with mode 0700; "
                "every rank connects to the coordinator itself (set TORCHPASS_RELAY_DIR to another one)")
        return None
    return path


def relay_path(directory: str, job_id: int, step: str, node: str) -> str:
    return os.path.join(directory, f"job{job_id}.{step}-{node}.sock")


def available(path: str) -> bool:
    """A relay a rank may use: its socket in a private directory, and someone listening on it."""
    return private_dir(os.path.dirname(path), create=False) is not None and listening(path)


def listening(path: str) -> bool:
    """Someone accepts connections on the unix socket ``path`` (a file left by a relay that is gone
    refuses them)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(0.2)
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


# A socket file nobody listens on is swept by the next relay host of the user on that node, once
# it is this old (a relay's file exists a moment before it listens). A process that exits without
# its atexit handlers (os._exit: examples/ do, torch 2.13 may abort at exit) or is killed leaves one.
SWEEP_AFTER_S = 60.0
SWEEP_MAX = 256  # files looked at per start


def sweep_dead(directory: str, *, wall=time.time, older_s: float = SWEEP_AFTER_S) -> int:
    """Remove the relay socket files in the user's private ``directory`` that nobody listens on
    any more (only those older than ``older_s``); returns how many went."""
    removed = 0
    try:
        entries = list(os.scandir(directory))[:SWEEP_MAX]
    except OSError:
        return 0
    for entry in entries:
        if not entry.name.endswith(".sock"):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISSOCK(st.st_mode) or wall() - st.st_mtime < older_s or listening(entry.path):
                continue
            if os.lstat(entry.path).st_ino == st.st_ino:
                os.unlink(entry.path)
                removed += 1
        except OSError:
            continue
    return removed


class NodeRelay:
    """The relay thread: a ROUTER on ``ipc://path`` forwarding to one DEALER on ``upstream``.

    ``start()`` binds (False, and why on stderr, when it cannot); ``stop(drain_s)`` ends it, after
    at most ``drain_s`` in which it waits for every rank it forwarded for to have its
    ``rank.quiesced`` with ``hold`` answered; it returns once its sockets and context are closed.
    """

    def __init__(self, path: str, upstream: str, *, clock=time.monotonic):
        self.path = path
        self.upstream = upstream
        self.clock = clock
        self._thread: threading.Thread | None = None
        self._ctx = None
        self._router = None
        self._dealer = None
        self._wake_r = self._wake_w = -1
        self._inode = 0  # of the socket file this relay bound: removed at the end only if still its own
        self._stopping = False
        self._drain_until = 0.0
        self.forwarded = 0  # rank frames, both ways (tests)
        self.dropped = 0
        # rank -> when it last sent through the relay; the ranks whose hold was answered; the
        # request ids of the rank.quiesced (hold) on their way, with their ranks.
        self._peers: dict[int, float] = {}
        self._held: set[int] = set()
        self._quiescing: dict[str, int] = {}
        self.error: str | None = None

    # -- control (from the rank's control thread) ------------------------------------------------
    def start(self) -> bool:
        import zmq

        ctx = zmq.Context(io_threads=1)
        try:
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(f"ipc://{self.path}")
            os.chmod(self.path, 0o600)
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.upstream)
        except (zmq.ZMQError, OSError) as exc:
            ctx.destroy(linger=0)
            say(f"no node relay at {self.path} ({exc}); every rank connects to the coordinator itself")
            return False
        self._ctx, self._router, self._dealer = ctx, router, dealer
        self._inode = os.stat(self.path).st_ino
        # A training process usually exits with this thread still running (a daemon: never
        # stopped): its socket file would stay in the user's relay directory, one per job step.
        atexit.register(self._remove_socket)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="torchpass-relay", daemon=True)
        self._thread.start()
        return True

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, drain_s: float = 0.0, timeout_s: float = 5.0) -> None:
        if self._thread is None:
            return
        self._drain_until = self.clock() + drain_s
        self._stopping = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        self._thread.join(drain_s + timeout_s)
        self._thread = None
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1

    # -- the loop (its own thread) ----------------------------------------------------------------
    def _drained(self) -> bool:
        if self.clock() >= self._drain_until:
            return True
        now = self.clock()
        waiting = {r for r, seen in self._peers.items() if now - seen < PEER_FORGET_S}
        return waiting <= self._held

    def _note_up(self, frame: bytes) -> None:
        from torchpass import wire

        try:
            msg = wire.decode(frame)
        except Exception:  # noqa: BLE001 - the coordinator says what is wrong with it
            return
        rank = msg.body.get("rank")
        if not isinstance(rank, int):
            return
        self._peers[rank] = self.clock()
        if msg.type == "rank.quiesced" and msg.body.get("hold"):
            if len(self._quiescing) >= 4 * BURST:  # answers that never came (ranks that went direct)
                self._quiescing.clear()
            self._quiescing[msg.id] = rank
        elif msg.type == "rank.resumed":
            self._held.discard(rank)

    def _note_down(self, frame: bytes) -> None:
        if not self._quiescing:
            return
        from torchpass import wire

        rank = self._quiescing.pop(wire.peek_id(frame), None)
        if rank is not None:
            self._held.add(rank)

    def _run(self) -> None:
        import zmq

        router, dealer = self._router, self._dealer
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(dealer, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while True:
                if self._stopping and self._drained():
                    break
                timeout_ms = 100 if not self._stopping else max(1, int((self._drain_until - self.clock()) * 1000))
                ready = dict(poller.poll(timeout_ms))
                if self._wake_r in ready:
                    try:
                        os.read(self._wake_r, 64)
                    except OSError:
                        pass
                if router in ready:
                    self._up(router, dealer)
                if dealer in ready:
                    self._down(dealer, router)
        except Exception as exc:  # noqa: BLE001 - never take training down; the ranks go direct
            self.error = f"{type(exc).__name__}: {exc}"
            say(f"node relay stopped ({self.error}); the node's ranks connect to the coordinator themselves")
        finally:
            for sock in (router, dealer):
                sock.close(linger=0)
            self._ctx.term()
            self._ctx = self._router = self._dealer = None
            self._remove_socket()
            atexit.unregister(self._remove_socket)

    def _remove_socket(self) -> None:
        """No rank connects to a relay that is gone: its socket file goes, if it is still the one
        this relay bound (a relay started since on the same path, another copy's, keeps its own)."""
        try:
            if os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        except OSError:
            pass

    def _up(self, router, dealer) -> None:
        """The ranks' requests that are ready, and those that follow within LINGER_S, as one bundle."""
        import zmq

        from torchpass import zmqio

        items: list[tuple[bytes, bytes]] = []
        end = self.clock() + LINGER_S
        while len(items) < BURST:
            try:
                parts = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                # More may come: the node's other ranks, unless every rank it knows has sent one.
                if len(items) >= len(self._peers) or self.clock() >= end:
                    break
                if not router.poll(int(LINGER_QUIET_S * 1000) or 1):
                    break
                continue
            if len(parts) != 3 or parts[1] != b"":  # [identity, "", frame]: a REQ envelope
                self.dropped += 1
                continue
            self._note_up(parts[2])
            items.append((parts[0], parts[2]))
        if not items:
            return
        if zmqio.send_bundle(dealer, items):
            self.forwarded += len(items)
        else:  # the coordinator's queue is full: the ranks ask again
            self.dropped += len(items)

    def _down(self, dealer, router) -> None:
        """The coordinator's replies, each to its rank's socket (a rank gone meanwhile: dropped)."""
        import zmq

        from torchpass import wire
        from torchpass.errors import ProtocolError

        for _ in range(BURST):
            try:
                parts = dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                if len(parts) != 2 or parts[0] != wire.RELAY_BUNDLE:
                    raise ProtocolError("not a bundle")
                items = wire.unpack_bundle(parts[1])
            except ProtocolError:
                self.dropped += 1
                continue
            for ident, reply in items:
                self._note_down(reply)
                try:
                    router.send_multipart([ident, b"", reply], zmq.NOBLOCK)
                    self.forwarded += 1
                except zmq.ZMQError:
                    self.dropped += 1


__all__ = ["NodeRelay", "available", "is_node_leader", "listening", "local_rank", "private_dir", "relay_dir",
           "relay_enabled", "relay_path"]
