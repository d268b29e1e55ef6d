"""tpassd's PUB side (the ZeroMQ guide's Clone pattern, server half).

Every publication is a two-frame message [topic, frame] with topic = the
message type, an envelope ``seq`` that counts this publisher's publications
(restarting at 0 with a new ``incarnation``) and ``sender`` = node name.
Events carry ``prev_event_seq`` and heartbeats ``last_event_seq`` so a
subscriber that takes only events and heartbeats still sees a gap.

The health state store is updated under a lock in the same step that
assigns the seq, so ``snapshot()`` (served to late joiners by the control
thread) is always consistent with "every event up to seq N applied".
"""

from __future__ import annotations

import threading
import time
from typing import Any

import zmq

from torchpass import wire


class Publisher:
    def __init__(self, ctx: zmq.Context, address: str, port: int, node: str, incarnation: str,
                 interval_s: float):
        self.node = node
        self.incarnation = incarnation
        self.interval_s = interval_s
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 10000)
        # Anything a peer sends to a PUB socket is a subscription; cap its size.
        self.sock.setsockopt(zmq.MAXMSGSIZE, 4096)
        if port:
            self.sock.bind(f"tcp://{address}:{port}")
            self.port = port
        else:
            self.port = self.sock.bind_to_random_port(f"tcp://{address}", min_port=20000, max_port=60000)
        self._lock = threading.Lock()
        self._seq = -1
        self._last_event_seq = -1
        self._state: dict[str, Any] = {"state": "unknown", "reasons": ["starting"], "components": {}}
        self.sent = {"tpassd.sample": 0, "tpassd.event": 0, "tpassd.heartbeat": 0}
        self._last_heartbeat: float | None = None  # time.monotonic()

    # Called only from the sampler thread (the socket's one user).
    def _send(self, type_: str, body: dict[str, Any], update=None) -> int:
        with self._lock:
            self._seq += 1
            seq = self._seq
            if update is not None:
                update(seq)
        frame = wire.encode(type_, body, seq=seq, sender=self.node)
        self.sock.send_multipart([type_.encode(), frame])
        self.sent[type_] += 1
        return seq

    def sample(self, body: dict[str, Any]) -> int:
        return self._send("tpassd.sample", body)

    def event(self, t: float, component: str, state: str, previous: str, reasons: list[str],
              node_state: str, node_reasons: list[str], components: dict[str, Any]) -> int:
        with self._lock:
            prev = self._last_event_seq
        body = {"node": self.node, "incarnation": self.incarnation, "t": t, "component": component,
                "state": state, "previous": previous, "reasons": list(reasons), "node_state": node_state,
                "prev_event_seq": prev}

        def update(seq: int) -> None:
            self._last_event_seq = seq
            self._state = {"state": node_state, "reasons": list(node_reasons),
                           "components": {k: dict(v) for k, v in components.items()}}

        return self._send("tpassd.event", body, update)

    def heartbeat(self, t: float, uptime_s: float) -> int:
        with self._lock:
            state, last = self._state["state"], self._last_event_seq
            self._last_heartbeat = time.monotonic()
        return self._send("tpassd.heartbeat", {
            "node": self.node, "incarnation": self.incarnation, "t": t, "interval_s": self.interval_s,
            "state": state, "last_event_seq": last, "uptime_s": round(uptime_s, 3)})

    def snapshot(self) -> dict[str, Any]:
        """The late joiner's view: apply events with seq > this seq after it."""
        with self._lock:
            return {"node": self.node, "incarnation": self.incarnation, "seq": self._seq,
                    "last_event_seq": self._last_event_seq, "interval_s": self.interval_s,
                    "state": self._state["state"], "reasons": list(self._state["reasons"]),
                    "components": {k: dict(v) for k, v in self._state["components"].items()},
                    # on this daemon's own clock, so no clock skew between hosts
                    "heartbeat_age_s": None if self._last_heartbeat is None
                    else round(time.monotonic() - self._last_heartbeat, 3)}

    def close(self) -> None:
        self.sock.close(linger=0)
