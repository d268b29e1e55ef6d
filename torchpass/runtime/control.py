"""The rank's link to the job's coordinator.

One background thread per rank (started from the patched
init_process_group, after the rank is PID 1 of its own PID namespace). It
speaks ZeroMQ request/reply (Lazy Pirate, torchpass.zmqio) with the
coordinator's ROUTER at TORCHPASS_COORDINATOR:

* ``rank.register`` once, then ``rank.progress`` every interval (every
  ``paused_interval_s`` while the group is paused, so the resume arrives soon);
* commands come back in the replies' ``result["command"]`` (see wire.py):
  ``pause`` arms the process group (acknowledged with ``rank.armed``),
  ``resume`` resumes it (acknowledged with ``rank.resumed`` once rebuilt);
* when the group has quiesced it sends ``rank.quiesced``; with a
  ``hold_file`` in the pause command it then destroys its ZeroMQ context
  (no socket, no I/O thread left: CRIU can dump the process) and waits,
  polling ``stat(hold_file)`` with short sleeps, until the file exists: after
  a restore on another node, or when the coordinator aborts the move. Then it
  opens a fresh context and goes on polling, which fetches the resume.

* once the rank is unprotected (the job made a group the runtime cannot
  move, see ReconfigurablePG.note_native_groups) every ``rank.register`` /
  ``rank.progress`` carries ``unprotected`` (why), a pause is answered with
  ``rank.armed`` ``accepted: false`` plus ``unprotected`` (a pause it had
  already accepted is refused the same way), and the coordinator's cancel
  (``resume`` with the pause's generation) with ``rank.resumed``
  ``cancelled: true``: refused cleanly, never a rank waiting at T.

Every request is sent with its own short-lived socket, so between requests
the link holds no TCP connection either.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import deque

from torchpass.runtime.pg import PauseListener, ReconfigurablePG, Rendezvous, count_sockets
from torchpass.runtime.say import say

# The longest report interval a coordinator's backpressure hint can ask for (report_every_s).
MAX_HINT_S = 10.0


def _netns_inode() -> int:
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0


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
        self.request_timeout_s = request_timeout_s
        self.auth = auth
        self._start_host = socket.gethostname()
        self._start_netns = _netns_inode()
        self._cv = threading.Condition()
        self._outbox: deque[tuple[str, dict]] = deque()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._ctx = None
        self._armed_reported: tuple[int, int, bool] | None = None
        self._hold_file: str | None = None
        self._holding = False
        self.registered = False
        self.errors = 0
        pg.listener = self

    @classmethod
    def from_env(cls, pg: ReconfigurablePG, env=os.environ) -> "ControlLink":
        from torchpass.jobauth import signer_from_env  # None without TORCHPASS_JOB_SECRET (unsigned)

        endpoint = env["TORCHPASS_COORDINATOR"]
        if "://" not in endpoint:
            endpoint = f"tcp://{endpoint}"
        link = cls(
            pg,
            endpoint=endpoint,
            job_id=int(env["TORCHPASS_JOB_ID"]),
            rank=pg.rank(),
            node=env.get("TORCHPASS_NODE") or env.get("SLURMD_NODENAME"),
            interval_s=float(env.get("TORCHPASS_PROGRESS_INTERVAL", "0.5")),
            paused_interval_s=float(env.get("TORCHPASS_PAUSED_POLL_INTERVAL", "0.02")),
            auth=signer_from_env(env),  # every rank.* request signed with the job secret
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
        if self._thread is not None:
            self._thread.join(timeout)
        self._close()

    def _open(self):
        import zmq

        if self._ctx is None:
            self._ctx = zmq.Context()
        return self._ctx

    def _close(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.destroy(linger=0)  # joins its I/O threads; their fds close

    def _request(self, type_: str, body: dict) -> dict | None:
        from torchpass import zmqio
        from torchpass.errors import TorchpassError

        try:
            result = zmqio.request(
                self.endpoint, type_, body, timeout_s=self.request_timeout_s, retries=0,
                auth=self.auth, context=self._open(),
            )
        except TorchpassError as exc:
            self.errors += 1
            if self.errors in (1, 10, 100) or self.errors % 1000 == 0:
                say(f"coordinator {self.endpoint} did not answer {type_} ({exc}); will keep trying")
            return None
        self.errors = 0
        return result

    def _base(self) -> dict:
        return {"job_id": self.job_id, "rank": self.rank}

    def _unprotected(self) -> dict:
        """``unprotected``: why this rank refuses pauses, in every report once it does."""
        why = self.pg.unprotected
        return {"unprotected": why} if why else {}

    def _run(self) -> None:
        try:
            while not self._stop and not self.registered:
                res = self._request(
                    "rank.register",
                    {**self._base(), "world_size": self.pg.size(), "node": self.node, "pid": os.getpid(),
                     "generation": self.pg.generation, **self._unprotected()},
                )
                if res is not None:
                    self.registered = True
                    self._handle(res)
                else:
                    self._sleep(self.interval_s)
            while not self._stop:
                with self._cv:
                    item = self._outbox.popleft() if self._outbox else None
                if item is not None:
                    type_, body = item
                    res = self._request(type_, body)
                    if res is None:
                        with self._cv:
                            self._outbox.appendleft(item)  # resend after a pause
                        self._sleep(min(self.interval_s, 0.2))
                        continue
                    self._handle(res)
                    if type_ == "rank.quiesced" and body["hold"]:
                        self._hold()
                    continue
                bstep, bcoll = getattr(self.pg, "boundary", (-1, -1))
                body = {**self._base(), "step": self.pg.steps, "collectives": self.pg.collectives, "node": self.node,
                        **self._unprotected()}
                if bstep >= 0:
                    body.update(boundary=bcoll, boundary_step=bstep)
                res = self._request("rank.progress", body)
                if res is not None:
                    self._handle(res)
                # A paused rank (quiesced at T, waiting for its resume) asks often:
                # the resume comes only in a reply, and every rank stands still
                # until the last one has it. Measured: up to one interval (0.5 s)
                # of every migration's pause went here.
                self._sleep(self.paused_every_s() if self.pg.paused else self.every_s())
        except Exception as exc:  # noqa: BLE001 - never take training down
            say(f"control link stopped ({type(exc).__name__}: {exc}); the rank cannot be migrated")
        finally:
            self._close()

    def every_s(self) -> float:
        """Seconds between progress reports: ours, or longer if the coordinator asks."""
        return max(self.interval_s, self.hint_s)

    def paused_every_s(self) -> float:
        """Seconds between polls while paused at T (never longer than between reports)."""
        return min(max(self.paused_interval_s, self.paused_hint_s), self.every_s())

    def _pace(self, result: dict) -> None:
        """Take the reply's backpressure hints (bounded: a confused coordinator cannot silence us)."""
        for key, attr in (("report_every_s", "hint_s"), ("paused_every_s", "paused_hint_s")):
            v = result.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0:
                setattr(self, attr, min(float(v), MAX_HINT_S))

    def _sleep(self, seconds: float) -> None:
        with self._cv:
            if not self._stop and not self._outbox:
                self._cv.wait(seconds)

    def _hold(self) -> None:
        """Close every socket and wait for the hold file (dump + restore happen now)."""
        path = self._hold_file
        self._close()
        self._holding = True
        try:
            while not self._stop and path and not os.path.exists(path):
                time.sleep(0.02)  # short sleeps restart cleanly after a restore
        finally:
            self._holding = False
            self._hold_file = None

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
                ok = self.pg.arm(at, gen)
                if ok:
                    self._hold_file = str(hold) if hold else None
                self._report_armed(at, gen, ok)
            elif kind == "resume":
                gen = int(cmd["generation"])
                rv = Rendezvous(str(cmd["master_addr"]), int(cmd["master_port"]))
                if self.pg.resume(gen, rv) == "cancelled":
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

    # -- PauseListener (called from the pausing training thread) --------------------
    def on_quiesced(self, pg: ReconfigurablePG, info: dict) -> None:
        hold = self._hold_file is not None
        self._post("rank.quiesced", {**self._base(), "generation": int(info["next_generation"]),
                                     "collectives": pg.collectives, "sockets": int(info["sockets"]),
                                     "drain_s": float(info["drain_s"]), "node": self.node, "pid": os.getpid(),
                                     "hold": hold})

    def on_resumed(self, pg: ReconfigurablePG, info: dict) -> None:
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


__all__ = ["ControlLink", "count_sockets"]
