"""A switchable c10d store: one Python ``dist.Store`` object whose inner
TCPStore can be closed (no socket left) and reopened at another address.

``init_process_group`` keeps the store it was given in its maps for the life
of the process group, so the store object it sees must outlive every
generation of the inner group; its *connection* must not. This class is that
object. Each generation of the inner group reaches it through
``PrefixStore(f"gen{g}", switchable)``, so keys of different generations
never mix.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time

import torch.distributed as dist

from torchpass import envnames


class StoreClosedError(RuntimeError):
    """The store is closed (the rank is paused); no rendezvous is possible."""


def wait_listening(host: str, port: int, deadline_s: float) -> None:
    """Poll until ``host:port`` accepts a TCP connection (or the deadline passes).

    TCPStore clients that arrive before the server listens back off for
    0.3-0.75 s; a fast probe first avoids that. Every probe socket is closed
    at once.
    """
    end = time.monotonic() + deadline_s
    delay = 0.005
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() >= end:
                return  # let TCPStore produce its own, clearer error
            time.sleep(delay)
            delay = min(delay * 1.5, 0.05)


def open_tcp_store(
    host: str, port: int, world_size: int, is_master: bool, timeout: datetime.timedelta
) -> dist.TCPStore:
    if not is_master:
        wait_listening(host, port, timeout.total_seconds())
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master,
        timeout,
        wait_for_workers=False,
        multi_tenant=False,
    )


class SwitchableStore(dist.Store):
    """Forwards every store call to the current inner store, if open."""

    def __init__(self, inner: dist.Store | None = None):
        super().__init__()
        self._lock = threading.Lock()
        self._inner = inner

    # -- switching -----------------------------------------------------------
    def switch(self, inner: dist.Store) -> None:
        with self._lock:
            self._inner = inner

    def close(self) -> None:
        """Drop the inner store: its client (and, on the master, server) sockets close."""
        with self._lock:
            self._inner = None

    @property
    def is_open(self) -> bool:
        return self._inner is not None

    def _s(self) -> dist.Store:
        inner = self._inner
        if inner is None:
            raise StoreClosedError("torchpass: the rendezvous store is closed while the rank is paused")
        return inner

    # -- dist.Store API (names as the C++ trampoline looks them up) -----------
    def _call(self, name: str, *args):
        return getattr(self._s(), name)(*args)

    def set(self, key, value):
        return self._call("set", key, value)

    def get(self, key):
        return self._call("get", key)

    def add(self, key, value):
        return self._call("add", key, value)

    def compare_set(self, key, expected, desired):
        return self._call("compare_set", key, expected, desired)

    def delete_key(self, key):
        return self._call("delete_key", key)

    def num_keys(self):
        return self._call("num_keys")

    def check(self, keys):
        return self._call("check", keys)

    def wait(self, keys, timeout=None):
        if timeout is None:
            return self._call("wait", keys)
        return self._call("wait", keys, timeout)

    def append(self, key, value):
        return self._call("append", key, value)

    def multi_get(self, keys):
        return self._call("multi_get", keys)

    def multi_set(self, keys, values):
        return self._call("multi_set", keys, values)

    def clone(self):
        """An independent client of the current inner store (gloo asks for one for
        every new group; split_group and shrink_group too). It is not switched at a
        pause: a job with such groups is unprotected (ReconfigurablePG.note_native_groups)."""
        return self._s().clone()

    def has_extended_api(self):
        inner = self._inner
        return bool(inner is not None and inner.has_extended_api())


class ReconnectingStore(SwitchableStore):
    """The rendezvous store of torchrun's agent: a client that lets go of its connection while the
    agent's node is dumped, and opens a new one after.

    The agent is not a rank and hears nothing from the coordinator: its workers tell it
    (``AgentHoldWatch``). ``hold()`` waits for the calls in flight, then drops the client (its
    sockets close: CRIU dumps no TCP connection) and makes every later call wait; ``release()``
    lets them go on, and the first one connects again, from wherever the agent now runs (a
    restore on the spare, or the same node when the move was called off). Any other error is
    torch's, unchanged: at the end of a job the store's host leaves first, and the other agents
    must see that as they would without torchpass (a reconnect there would wait a minute per try).
    """

    def __init__(self, opener, inner: dist.Store | None = None):
        super().__init__(inner if inner is not None else opener())
        self._opener = opener
        self._cv = threading.Condition(self._lock)
        self._held = False
        self._busy = 0
        self.reconnects = 0

    # -- the hold ---------------------------------------------------------------
    def hold(self, timeout_s: float = 30.0) -> bool:
        """Close the connection once no call is in flight (at most ``timeout_s``); True if closed."""
        with self._cv:
            self._held = True
            if not self._cv.wait_for(lambda: self._busy == 0, timeout_s):
                return False
            self._inner = None  # the client's sockets close here
            return True

    def release(self) -> None:
        with self._cv:
            self._held = False
            self._cv.notify_all()

    @property
    def held(self) -> bool:
        return self._held

    # -- calls ------------------------------------------------------------------
    def _enter(self) -> dist.Store:
        with self._cv:
            self._cv.wait_for(lambda: not self._held)
            if self._inner is None:
                self._inner = self._opener()
                self.reconnects += 1
            self._busy += 1
            return self._inner

    def _leave(self) -> None:
        with self._cv:
            self._busy -= 1
            self._cv.notify_all()

    def _call(self, name: str, *args):
        inner = self._enter()
        try:
            return getattr(inner, name)(*args)
        finally:
            self._leave()

    def clone(self):
        return self._call("clone")

    def has_extended_api(self):
        return True  # a TCPStore's (asked while held too)


# The agent's directory of hold markers, in its workers' environment (they inherit it).
AGENT_DIR_ENV = envnames.AGENT_DIR
HELD_MARKER = "held.{local_rank}"  # a held worker's marker; its content: LOCAL_WORLD_SIZE


class AgentHoldWatch:
    """In torchrun's agent: hold its store while every one of its workers is held.

    A worker told to hold (its node is being moved: control.py ``_hold``) writes
    ``DIR/held.<LOCAL_RANK>`` before it waits, and removes it when it goes on. The watch looks
    every ``interval_s`` for ``held.0``, ``held.1``, ... up to the workers' count (one stat when
    nothing is held): all there, it holds the store (the tree then has no socket, so tpassd's
    dump can go on); one gone, it releases it. DIR is on the node's own disk (``$TMPDIR``): on a
    spare it does not exist, so a restored agent releases at once.
    """

    def __init__(self, store: ReconnectingStore, directory: str, interval_s: float = 0.05):
        self.store = store
        self.dir = directory
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchpass-agent-hold", daemon=True)

    def start(self) -> "AgentHoldWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def all_held(self) -> bool:
        first = os.path.join(self.dir, HELD_MARKER.format(local_rank=0))
        try:
            with open(first) as f:
                want = int(f.read().strip() or 0)
        except (OSError, ValueError):
            return False
        return want > 0 and all(os.path.exists(os.path.join(self.dir, HELD_MARKER.format(local_rank=i)))
                                for i in range(1, want))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            held = self.all_held()
            if held and not self.store.held:
                self.store.hold()
            elif not held and self.store.held:
                self.store.release()
