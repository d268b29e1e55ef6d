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
import socket
import threading
import time

import torch.distributed as dist


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
    def set(self, key, value):
        return self._s().set(key, value)

    def get(self, key):
        return self._s().get(key)

    def add(self, key, value):
        return self._s().add(key, value)

    def compare_set(self, key, expected, desired):
        return self._s().compare_set(key, expected, desired)

    def delete_key(self, key):
        return self._s().delete_key(key)

    def num_keys(self):
        return self._s().num_keys()

    def check(self, keys):
        return self._s().check(keys)

    def wait(self, keys, timeout=None):
        if timeout is None:
            return self._s().wait(keys)
        return self._s().wait(keys, timeout)

    def append(self, key, value):
        return self._s().append(key, value)

    def multi_get(self, keys):
        return self._s().multi_get(keys)

    def multi_set(self, keys, values):
        return self._s().multi_set(keys, values)

    def clone(self):
        """An independent client of the current inner store (gloo asks for one for
        every new group; split_group and shrink_group too). It is not switched at a
        pause: a job with such groups is unprotected (ReconfigurablePG.note_native_groups)."""
        return self._s().clone()

    def has_extended_api(self):
        inner = self._inner
        return bool(inner is not None and inner.has_extended_api())
