"""The rank's requests to its coordinator: one kept connection (torchpass.zmqio.Client, a DEALER
socket reopened only after a time-out), direct or through the node relay, signed with the job
secret; replies without its MAC dropped; the coordinator's pacing hints; a coordinator that has
not answered for ``lost_after_s`` reported once (``on_lost``).

A TCP connect and handshake per report cost the coordinator most of its time at thousands of
ranks, hence the kept connection. A held rank has none: ``close`` destroys the ZeroMQ context (no
socket, no I/O thread: CRIU can dump the process) and the next request connects again, in a new
context, after the restore or the abort.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from torchpass.runtime import relay
from torchpass.runtime.say import say

# The longest report interval a coordinator's backpressure hint can ask for (report_every_s).
MAX_HINT_S = 10.0
# The longest a coordinator's reply_within_s can make a request wait for its answer (a large job's
# fan-in: every rank acknowledging a pause at once); a coordinator that is gone is still noticed
# (coordinator.lost after COORDINATOR_LOST_S without an answer).
MAX_REPLY_HINT_S = 20.0
# No answer from the coordinator for this long: it is lost (TORCHPASS_COORDINATOR_LOST_S).
COORDINATOR_LOST_S = 30.0


class Pacing:
    """How often a rank reports and polls: its own intervals, or longer where the coordinator's
    replies ask (backpressure: report_every_s, paused_every_s; the larger is used), and the
    coordinator's long-poll and reply-time hints (wait_max_s, reply_within_s). Each hint is
    bounded: a confused coordinator cannot silence a rank."""

    def __init__(self, interval_s: float, paused_interval_s: float):
        self.interval_s = interval_s
        self.paused_interval_s = min(interval_s, paused_interval_s)
        self.hint_s = 0.0
        self.paused_hint_s = 0.0
        self.wait_max_s = 0.0  # the coordinator's wait_max_s: > 0 once it said it parks long polls
        self.reply_hint_s = 0.0  # the coordinator's reply_within_s: a request's answer may take this long

    def take(self, result: dict) -> None:
        """Take a reply's hints."""
        for key, attr, cap in (("report_every_s", "hint_s", MAX_HINT_S),
                               ("paused_every_s", "paused_hint_s", MAX_HINT_S),
                               ("wait_max_s", "wait_max_s", MAX_HINT_S),
                               ("reply_within_s", "reply_hint_s", MAX_REPLY_HINT_S)):
            v = result.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0:
                setattr(self, attr, min(float(v), cap))

    def every_s(self) -> float:
        """Seconds between progress reports: ours, or longer if the coordinator asks."""
        return max(self.interval_s, self.hint_s)

    def paused_every_s(self) -> float:
        """Seconds between polls while paused at T (never longer than between reports)."""
        return min(max(self.paused_interval_s, self.paused_hint_s), self.every_s())


class CoordinatorChannel:
    """Requests and replies with the coordinator, over one kept connection."""

    def __init__(self, *, endpoint: str, rank: int, auth, request_timeout_s: float, pacing: Pacing,
                 lost_after_s: float, on_lost: Callable[[str], None], moved: Callable[[], bool],
                 stopping: Callable[[], bool], clock: Callable[[], float],
                 relay_path: str | None = None, relay_host: bool = False):
        self.endpoint = endpoint
        self.rank = rank
        self.request_timeout_s = request_timeout_s
        self.pacing = pacing
        self.lost_after_s = lost_after_s
        self._on_lost = on_lost
        self._moved = moved
        self._stopping = stopping
        self.clock = clock
        self.auth = auth
        self.replies_refused = 0  # replies dropped for a missing or wrong MAC
        self._listen_refusals(auth)
        self.errors = 0  # requests in a row with no answer
        self.refused: Exception | None = None  # the last request's error reply, if it got one
        self._failing_since: float | None = None
        self.lost_noted = False
        self._ctx = None
        self.client = None  # zmqio.Client over self._ctx, made at the first request
        # The node relay (torchpass/runtime/relay.py): its socket, whether this rank hosts it, the
        # relay thread while it runs, whether the current client goes through it, and when a rank
        # that talks to the coordinator itself tries the relay again.
        self.relay_path = relay_path
        self.relay_host = relay_host and relay_path is not None
        self.relay = None
        self.via_relay = False
        self._relay_retry_at = 0.0
        self._relay_waited = False
        self._relay_timeouts = 0  # requests through the relay in a row that got no answer

    # -- replies from the coordinator only ---------------------------------------------
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

    def take_run(self, endpoint: str | None, secret: str | None) -> None:
        """The coordinator and job secret of the run that restored this copy (a job stopped and
        resumed has new ones; after a lost node they are the same), and a new signing sender
        either way: the source copy went on signing past the image's counter."""
        if endpoint:
            self.endpoint = endpoint
            self.client = None  # the hold destroyed its context: the next request makes a new one
        if secret:
            from torchpass.jobauth import JobSigner, parse_secret

            try:
                self.auth = JobSigner(parse_secret(secret))
                self._listen_refusals(self.auth)
                self.client = None  # the next request's client signs with it
                return
            except Exception as exc:  # noqa: BLE001 - a bad secret: say so, keep the old signer
                say(f"rank {self.rank}: the restoring step's job secret is unusable ({exc}); keeping the image's")
        renew = getattr(self.auth, "renew", None)
        if renew is not None:
            renew()

    # -- the node relay ---------------------------------------------------------------
    def start_relay(self) -> None:
        """The node's first rank, on the node it started on, hosts the relay."""
        if not self.relay_host or self.relay is not None or self._moved() or self._stopping():
            return
        directory = os.path.dirname(self.relay_path)
        if relay.private_dir(directory, create=True) is None:
            self.relay_host = False  # said why; the node's ranks connect to the coordinator themselves
            return
        relay.sweep_dead(directory)  # files of relays gone (killed, or their process ended with os._exit)
        r = relay.NodeRelay(self.relay_path, self.endpoint)
        if r.start():
            self.relay = r
        else:
            self.relay_host = False

    def stop_relay(self, drain_s: float = 0.0) -> None:
        r, self.relay = self.relay, None
        if r is not None:
            r.stop(drain_s)

    def _use_relay(self) -> bool:
        """Whether the next connection goes through the node relay: one listens on its socket in a
        private directory, and this copy runs on the node it started on."""
        if self.relay_path is None or self._moved() or self.clock() < self._relay_retry_at:
            return False
        ok = relay.available(self.relay_path)
        if not ok and not self._relay_waited and not self.relay_host:
            # The first connection: the node's first rank starts its relay as this rank starts
            # (both right after init_process_group); a direct connection made meanwhile would be
            # given up later, which costs the coordinator as much memory as keeping it.
            end = self.clock() + relay.FIRST_WAIT_S
            while not ok and not self._stopping() and self.clock() < end:
                time.sleep(0.05)
                ok = relay.available(self.relay_path)
        self._relay_waited = True
        if not ok:
            self._relay_retry_at = self.clock() + relay.RELAY_RETRY_S
        return ok

    # -- the connection -----------------------------------------------------------------
    def _open(self):
        import zmq

        if self._ctx is None:
            self._ctx = zmq.Context()
        return self._ctx

    def close(self) -> None:
        """No socket, no ZeroMQ I/O thread left (the next request connects again)."""
        if self.client is not None:
            self.client.close()  # the next request connects again, in the next context
            if self.via_relay:  # and chooses its way again: after a hold this copy may have moved
                self.client = None
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.destroy(linger=0)  # joins its I/O threads; their fds close

    def request(self, type_: str, body: dict, *, expect_s: float = 0.0,
                abandon: Callable[[], bool] | None = None, wake_fd: int | None = None) -> dict | None:
        """The reply's result, or None (no answer, an error reply: ``refused``, or a long poll given
        up). ``expect_s``: how long its answer may take, where the coordinator has not said
        (reply_within_s) yet. A long poll (``wait_s`` in ``body``) is given up when ``abandon()``
        turns true, woken through ``wake_fd``."""
        from torchpass import zmqio
        from torchpass.errors import RemoteError, TorchpassError

        if self.client is None or (not self.via_relay and self.relay_path is not None
                                   and self.clock() >= self._relay_retry_at):
            via = self._use_relay()
            if self.client is None or via:
                if self.client is not None:
                    self.client.close()
                self.client = zmqio.Client(f"ipc://{self.relay_path}" if via else self.endpoint, retries=0,
                                           auth=self.auth, context=self._open)
                self.via_relay = via
        wait_s = body.get("wait_s") or 0.0  # a long poll: given up for a report to send, or stop()
        try:
            timeout_s = max(self.request_timeout_s, self.pacing.reply_hint_s or expect_s) + wait_s
            result = self.client.request(type_, body, timeout_s=timeout_s,
                                         abandon=abandon if wait_s else None,
                                         wake_fd=wake_fd if wait_s else None)
            if result is None:
                return None  # given up, not unanswered
        except TorchpassError as exc:
            self.refused = exc if isinstance(exc, RemoteError) else None  # answered, with an error
            if self.refused is None and self.via_relay:
                self._relay_timeouts += 1
                if self._relay_timeouts >= relay.TIMEOUTS_BEFORE_DIRECT:
                    # No answer through the node relay, twice running (once is mostly a
                    # coordinator that was late for many ranks at once): the next try goes to
                    # the coordinator itself.
                    self.client.close()
                    self.client, self.via_relay = None, False
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
        """No answer for lost_after_s: ``on_lost`` once."""
        now = self.clock()
        if self._failing_since is None:
            self._failing_since = now
        if self.lost_noted or now - self._failing_since < self.lost_after_s:
            return
        self.lost_noted = True
        self._on_lost(error)


__all__ = ["COORDINATOR_LOST_S", "CoordinatorChannel", "MAX_HINT_S", "MAX_REPLY_HINT_S", "Pacing"]
