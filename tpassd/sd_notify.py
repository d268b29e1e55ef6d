"""The sd_notify protocol (sd_notify(3)), spoken directly: one AF_UNIX datagram per message.

systemd (``Type=notify``) passes the path of its socket in ``$NOTIFY_SOCKET`` (a leading ``@``
names an abstract socket) and, with ``WatchdogSec=``, the watchdog period in ``$WATCHDOG_USEC``
(for ``$WATCHDOG_PID`` only, when set). A message is newline-separated ``KEY=value`` lines:

  READY=1      tpassd's sockets are bound and its control thread answers (systemd starts the
               units ordered after tpassd, and ``systemctl start`` returns, only then)
  RELOADING=1  a SIGHUP re-reads the policy (with MONOTONIC_USEC=, as systemd >= 253 asks);
               READY=1 ends it
  STOPPING=1   SIGTERM received, shutting down
  WATCHDOG=1   health samples still flow (``SampleWatchdog``): systemd kills and restarts a
               tpassd whose sampler is stuck once no ping came for ``WatchdogSec=``
  STATUS=...   one line that ``systemctl status tpassd`` shows

Without ``$NOTIFY_SOCKET`` (not under systemd, or another ``Type=``) every call does nothing.
The variables are removed from the environment once read, as ``sd_notify(unset_environment=1)``
does, so criu, scontrol and the other children do not inherit them.

No libsystemd: the protocol is one ``sendto`` and tpassd's root venv gains no dependency.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, MutableMapping

import structlog

log = structlog.get_logger("tpassd")

NOTIFY_SOCKET = "NOTIFY_SOCKET"
WATCHDOG_USEC = "WATCHDOG_USEC"
WATCHDOG_PID = "WATCHDOG_PID"


def _address(value: str) -> str | bytes | None:
    """The socket address ``$NOTIFY_SOCKET`` names: a path, or an abstract name (``@``: NUL).
    None for anything else (systemd >= 254 also allows ``vsock:``, which tpassd never gets)."""
    if value.startswith("/"):
        return value
    if value.startswith("@") and len(value) > 1:
        return b"\0" + value[1:].encode()
    return None


class Notifier:
    """Sends sd_notify messages to the socket ``$NOTIFY_SOCKET`` names (none: does nothing)."""

    def __init__(self, address: str | bytes | None):
        self.address = address
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        if address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @classmethod
    def from_environment(cls, environ: MutableMapping[str, str] | None = None) -> Notifier:
        env = os.environ if environ is None else environ
        value = env.pop(NOTIFY_SOCKET, "")
        address = _address(value) if value else None
        if value and address is None:
            log.warning("NOTIFY_SOCKET names no unix socket; not notifying systemd", notify_socket=value)
        return cls(address)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, **fields: object) -> bool:
        """One message (``send(READY=1, STATUS="...")``); True when it was sent. A failed send is
        logged, never raised: a lost notification must not stop the daemon."""
        if self._sock is None:
            return False
        text = "\n".join(f"{k}={v}" for k, v in fields.items()) + "\n"
        with self._lock:
            try:
                self._sock.sendto(text.encode(), self.address)
                return True
            except OSError as exc:
                log.warning("cannot notify systemd", message=text.strip(), error=str(exc))
                return False

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def watchdog_period_s(environ: MutableMapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """systemd's watchdog period (``WatchdogSec=``) in seconds, or None when the watchdog is off
    or meant for another process (sd_watchdog_enabled(3)). Removes both variables."""
    env = os.environ if environ is None else environ
    usec, owner = env.pop(WATCHDOG_USEC, ""), env.pop(WATCHDOG_PID, "")
    try:
        period = int(usec) / 1e6
    except ValueError:
        return None
    if period <= 0:
        return None
    if owner:
        try:
            if int(owner) != (os.getpid() if pid is None else pid):
                return None
        except ValueError:
            return None
    return period


def samples_flow(now: float, last_tick_end: float | None, started: float, stale_after_s: float) -> bool:
    """Whether the sampler is alive: its last tick ended (or, before the first, the daemon
    started) at most ``stale_after_s`` ago. All times on one monotonic clock."""
    since = started if last_tick_end is None else last_tick_end
    return now - since <= stale_after_s


class SampleWatchdog:
    """Pings ``WATCHDOG=1`` every half period (sd_watchdog_enabled(3) advises it) while health
    samples flow, and stops pinging when they do not.

    The ping runs on a thread of its own, not on the sampler: then the watchdog judges the
    sampler from outside, and ``interval_s`` may be longer than ``WatchdogSec=``. The sampler is
    stuck when no tick ended for ``stale_after_s``: one tick lasts at most
    ``collector_timeout_s`` (a hung collector counts as unknown, it does not hold the tick) and
    they start ``interval_s`` apart, so ``2 * interval_s + collector_timeout_s`` is never reached
    by a sampler that runs. systemd then kills tpassd ``WatchdogSec=`` after the last ping.
    """

    def __init__(self, notifier: Notifier, period_s: float, stale_after_s: float,
                 last_tick_end: Callable[[], float | None], clock: Callable[[], float] = time.monotonic):
        self.notifier = notifier
        self.every_s = period_s / 2
        self.stale_after_s = stale_after_s
        self._last_tick_end = last_tick_end
        self._clock = clock
        self._started = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.flowing = True  # what the last check found: a change is logged once

    def check(self) -> bool:
        """One check: ping if samples flow. Returns whether it pinged."""
        flowing = samples_flow(self._clock(), self._last_tick_end(), self._started, self.stale_after_s)
        if flowing != self.flowing:
            if flowing:
                log.info("health samples flow again; watchdog pings resume")
            else:
                log.error("no health sample for too long; watchdog pings stop (systemd restarts tpassd "
                          "after WatchdogSec)", stale_after_s=self.stale_after_s)
            self.flowing = flowing
        return flowing and self.notifier.send(WATCHDOG=1)

    def start(self) -> SampleWatchdog:
        self._thread = threading.Thread(target=self._run, name="tpassd-watchdog", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.check()
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
