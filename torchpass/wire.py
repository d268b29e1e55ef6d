"""The one wire schema: every message that crosses a torchpass socket.

Frames are UTF-8 JSON objects, at most MAX_FRAME_BYTES long. Two shapes:

* request / publication  ``{"v": 1, "type": T, "id": ID, "auth": CRED?,
  "seq": N?, "sender": S?, "body": {...}}``: ``type`` names an entry of
  BODIES below, whose field specs the body must match exactly (no missing
  required field, no unknown field, every value of its declared type).
* reply  ``{"v": 1, "type": "reply", "id": ID, "ok": true, "result": {...}}``
  or ``{"v": 1, "type": "reply", "id": ID, "ok": false,
  "error": {"code": CODE, "message": MSG}}`` with a code from ERROR_CODES.
  A coordinator's reply to a signed ``rank.*`` request ends with
  ``"auth": "job1:<hmac>"``, added after encoding: the job secret's MAC
  over the request's sender and seq and the reply's bytes before the field
  (torchpass.jobauth.ReplySealer; the rank drops a reply without it).

``auth`` carries one of two credentials, both bound to the request they
came with: a munge credential over ``auth.request_digest`` (tpassd's
requests, ``job.migrate``, and ``job.status`` / ``job.events`` when Slurm's
PrivateData hides jobs; torchpass/auth.py), or, on every ``rank.*`` request,
``"job1:<t_ms>:<hmac>"``: HMAC-SHA256 under the job's secret over the type,
id, ``sender``, ``seq``, t_ms and body, with ``sender`` a random id of the
signing process and ``seq`` its request counter (torchpass/jobauth.py).

``v`` is the schema version. A peer speaking another version gets an
``unsupported_version`` error, never a guess. Changing a body in a way an
old peer cannot read means bumping SCHEMA_VERSION.

Decoding never raises anything but ProtocolError, whatever the bytes, so a
server can always answer with an error reply and keep serving.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Any

from torchpass.errors import ProtocolError, RemoteError

SCHEMA_VERSION = 1
MAX_FRAME_BYTES = 1 << 20  # 1 MiB: the largest honest message is a node snapshot
# The node relay's bundle (torchpass/runtime/relay.py): the frames of several ranks of one
# node in one ZeroMQ message [RELAY_BUNDLE, pack_bundle(items)] each way (the coordinator's ROUTER
# adds and strips the relay's own identity in front). An item is a rank's socket identity at the
# relay and one whole request or reply of this schema, signed by its rank as when sent alone. One
# frame, not a frame per item: pyzmq sends and reads each frame by itself, and 8,192 replies in
# 18-frame messages took longer than the replies themselves (cProfile of the coordinator at 8,192 ranks).
RELAY_BUNDLE = b"torchpass.bundle/1"

# A fan-in: a pause or a resume makes every rank acknowledge at once (rank.armed,
# rank.quiesced, rank.resumed), and a job's start makes every rank register at once: 8,192
# requests at 8,192 ranks, which the coordinator answers at about FAN_IN_PER_S; the last waits
# world / FAN_IN_PER_S. So every rank.* reply says ``reply_within_s`` (reply_within_s() times the
# coordinator's pace factor): how long a request may wait for its answer; the rank waits the larger
# of it and its own time-out. Before its first answer a rank expects the same at factor 1: its
# rank.register is one of a job-wide fan-in too.
FAN_IN_PER_S = 2000.0
REPLY_WITHIN_MIN_S, REPLY_WITHIN_MAX_S = 2.0, 20.0


def reply_within_s(world: int, factor: float = 1.0) -> float:
    """How long a request of one of ``world`` ranks may wait for its answer in a fan-in."""
    return round(min(REPLY_WITHIN_MAX_S, REPLY_WITHIN_MIN_S + world / FAN_IN_PER_S * factor), 3)


_ITEM_HEAD = struct.Struct("!BI")  # identity length (a ZeroMQ identity is at most 255 bytes), frame length
BUNDLE_ITEM_OVERHEAD = _ITEM_HEAD.size


def pack_bundle(items: list[tuple[bytes, bytes]]) -> bytes:
    """The bundle of (identity, frame) items: per item its two lengths, then both."""
    out = bytearray()
    for ident, frame in items:
        out += _ITEM_HEAD.pack(len(ident), len(frame))
        out += ident
        out += frame
    return bytes(out)


def unpack_bundle(blob: bytes) -> list[tuple[bytes, bytes]]:
    """pack_bundle's items; ProtocolError for a bundle cut short or with an oversized frame."""
    items, at, end, head = [], 0, len(blob), _ITEM_HEAD.size
    view = memoryview(blob)
    while at < end:
        if end - at < head:
            raise ProtocolError("bundle cut short in an item's head")
        n_ident, n_frame = _ITEM_HEAD.unpack_from(blob, at)
        at += head
        if n_frame > MAX_FRAME_BYTES or end - at < n_ident + n_frame:
            raise ProtocolError("bundle cut short in an item, or an item over the frame limit")
        items.append((bytes(view[at:at + n_ident]), bytes(view[at + n_ident:at + n_ident + n_frame])))
        at += n_ident + n_frame
    return items

# Stable error codes carried in error replies; clients switch on these.
ERROR_CODES = frozenset(
    {
        "bad_request",  # malformed frame, wrong field types, unknown fields
        "unsupported_version",  # v differs from SCHEMA_VERSION
        "unknown_type",  # no such message type
        "unauthenticated",  # missing, forged, replayed or expired credential
        "forbidden",  # authenticated, but this user may not do this
        "not_found",  # the job / rank / node / fault named does not exist here
        "conflict",  # valid request that the current state does not allow
        "unavailable",  # a dependency is missing (e.g. criu) or not ready
        "failed",  # the action was attempted and failed; message says why
        "timeout",  # the server gave up waiting for the action (its deadline); it may still finish
        "internal",  # a bug; details are in the server's log, not the reply
    }
)


@dataclass(frozen=True)
class F:
    """Field spec: the accepted Python types after JSON decoding."""

    types: tuple[type, ...]
    required: bool = True


def _f(*types: type, required: bool = True) -> F:
    return F(tuple(types), required)


INT = (int,)
NUM = (int, float)

# Message bodies, by type. Sections are owned by the component that serves
# the messages; keep each section's names prefixed with its component.
BODIES: dict[str, dict[str, F]] = {
    # --- rank runtime -> coordinator -------------------------------------
    # A rank announces itself when its process group is created.
    "rank.register": {
        "job_id": _f(int),
        "rank": _f(int),
        "world_size": _f(int),
        "node": _f(str),
        "pid": _f(int),
        "generation": _f(int, required=False),
        # present once the rank refuses every pause: why
        # (e.g. the job made a subgroup the runtime cannot move yet). The job
        # is then unprotected; it runs as without torchpass.
        "unprotected": _f(str, required=False),
        # (torchrun) the Slurm task the rank runs in: the key of its rank record, which
        # tpassd dumps (rankR.json, R = the task's RANK or SLURM_PROCID). Absent: the rank itself.
        # Several ranks share one task under torchrun (its workers are the task's children).
        "task": _f(int, required=False),
        # (torchrun) why the rank's node cannot move (e.g. torchrun's agent there
        # serves a TCP store that every node connects to); the rest of the job stays protected.
        "pinned": _f(str, required=False),
        # a copy of the rank restored from whole-job snapshot ID after a lost node
        # (the relaunch from a snapshot): it registers again, paused at the snapshot's pause
        # point, and waits for the coordinator's resume.
        "restored": _f(str, required=False),
        # a torch outside the runtime's tested range that the site allowed ($TORCHPASS_ALLOW_TORCH):
        # the rank's line saying so. The coordinator keeps the first (job.status torch_override).
        "torch_override": _f(str, required=False),
        # the data rails its inner group is built on (TORCHPASS_DATA_RAILS, in order): the rails the
        # coordinator reroutes the job over when one goes down. Absent: the job has no data rails.
        "rails": _f(list, required=False),
    },
    # Progress: step = optimizer steps seen, collectives = collectives issued.
    "rank.progress": {
        "job_id": _f(int),
        "rank": _f(int),
        "step": _f(int),
        "collectives": _f(int),
        "node": _f(str, required=False),
        "loss": _f(float, int, required=False),
        # collectives issued when optimizer step boundary_step ended (the
        # coordinator aligns the pause point T to step boundaries)
        "boundary": _f(int, required=False),
        "boundary_step": _f(int, required=False),
        "unprotected": _f(str, required=False),  # as in rank.register
        # (long poll) a paused rank's poll: the coordinator may hold the reply up to
        # this many seconds (at most its wait_max_s) until the rank has a command. Sent only to a
        # coordinator whose replies carry wait_max_s.
        "wait_s": _f(float, int, required=False),
        # The rank's compute time (s) of each optimizer step ended since its last answered report,
        # oldest first (at most 64; torchpass/runtime/compute_time.py): wall time with no
        # collective in flight. compute_step: the rank's step count at the last of them. The
        # coordinator's fail-slow rule compares them across nodes.
        "compute_s": _f(list, required=False),
        "compute_step": _f(int, required=False),
    },
    # The coordinator's reply to every rank.* message may carry, besides "command", the
    # backpressure hints "report_every_s" and "paused_every_s" (seconds): report (poll while
    # paused) no more often than that (torchpass.runtime.control); and "wait_max_s":
    # it parks a rank.progress carrying wait_s (a long poll) for up to that long.
    # --- tpassd (owner: tpassd; see docs/tpassd.md) ------------------------
    # Publications on tpassd's PUB socket, multipart [topic, frame] with the
    # topic equal to the type. Envelope: seq = per-publisher sequence number
    # (every publication), sender = node name. incarnation changes on every
    # daemon start (the seq restarts at 0 with it).
    "tpassd.sample": {
        "node": _f(str),
        "incarnation": _f(str),
        "t": _f(float, int),  # publisher's wall clock, seconds since the epoch
        "interval_s": _f(float, int),
        "state": _f(str),  # healthy | degraded | failed | unknown
        "reasons": _f(list),
        # component -> {"state", "reasons", "metrics": {name: value}}
        "components": _f(dict),
        # collector -> {"ok", "duration_s", "error"}
        "collectors": _f(dict),
    },
    # One per component whose state changed; component "node" for the node.
    "tpassd.event": {
        "node": _f(str),
        "incarnation": _f(str),
        "t": _f(float, int),
        "component": _f(str),
        "state": _f(str),
        "previous": _f(str),
        "reasons": _f(list),
        "node_state": _f(str),
        "prev_event_seq": _f(int),  # seq of the previous event (-1: none): gap detection
    },
    "tpassd.heartbeat": {
        "node": _f(str),
        "incarnation": _f(str),
        "t": _f(float, int),
        "interval_s": _f(float, int),
        "state": _f(str),
        "last_event_seq": _f(int),
        "uptime_s": _f(float, int),
    },
    # Requests to tpassd's control (ROUTER) socket; all need `auth`.
    "tpassd.health": {},  # current health + seq: the late joiner's snapshot
    "tpassd.status": {},  # health plus collectors, counters, config summary
    # Fault drill (fake NVML provider / fixture IB tree only): root or the
    # owner of a job on the node.
    "tpassd.drill": {
        "kind": _f(str),
        "gpu": _f(int, required=False),
        "port": _f(str, required=False),
        "count": _f(int, required=False),
    },
    # --- coordinator -> rank runtime (pause / resume; torchpass/runtime) -----
    # The command names are COMMAND_PAUSE and COMMAND_RESUME (RANK_COMMANDS, below the schema).
    # The coordinator sends commands in the *result* of its reply to any
    # rank.* request (register, progress, armed, quiesced, resumed), as
    # result["command"]; it repeats a command on every reply until the rank
    # acknowledges it, and the rank treats repeats as no-ops:
    #   {"command": "pause", "at": T, "generation": g, "hold_file": PATH?,
    #    "deadline_s": D, "fallback": {resume command}, "join_s": J}
    #       stop with exactly T collectives issued, tear down, rebuild as
    #       generation g (> current). With hold_file: after rank.quiesced,
    #       close every socket and wait until PATH exists (it is being dumped).
    #       Acknowledged by rank.armed. No resume within D s (wall clock) of
    #       quiescing: apply fallback once (a held copy first claims
    #       PATH.claim); a fallback group not rebuilt within J s fails the
    #       rank with one line (docs/coordinator.md, "Never left paused").
    #   {"command": "resume", "generation": g, "master_addr": A, "master_port": P, "rails": [R...]?}
    #       rebuild as generation g with the rendezvous store at A:P (rank 0
    #       serves it); with rails (a reroute), build the inner groups on those
    #       data rails, the same list on every rank. Sent before the ranks have torn down, it cancels the
    #       pause (all ranks agree on cancel-or-go through the store); the
    #       rank adopts g without a rebuild. Acknowledged by rank.resumed
    #       (generation g, cancelled true for a cancel).
    # The reports below are rank -> coordinator requests.
    "rank.armed": {
        "job_id": _f(int),
        "rank": _f(int),
        "at": _f(int),
        "generation": _f(int),
        "collectives": _f(int),
        "accepted": _f(bool),  # False: already past T (or stale generation); pick another T
        # with accepted False: the rank is unprotected and
        # refuses every pause (no other T will do): cancel the pause.
        "unprotected": _f(str, required=False),
    },
    "rank.quiesced": {
        "job_id": _f(int),
        "rank": _f(int),
        "generation": _f(int),  # the generation it will rebuild as
        "collectives": _f(int),  # == T
        "sockets": _f(int),  # sockets the process still holds (the control link's included)
        "drain_s": _f(float, int),
        "node": _f(str),
        "pid": _f(int),  # pid as seen from the node (host pid namespace when known)
        "hold": _f(bool),  # True: it now closes its link and waits for hold_file
        # a held rank: resident memory its allocator caches gave back before the dump
        "released_mb": _f(float, int, required=False),
    },
    "rank.resumed": {
        "job_id": _f(int),
        "rank": _f(int),
        "generation": _f(int),
        "collectives": _f(int),
        "rebuild_s": _f(float, int),
        "node": _f(str),
        "moved": _f(bool),  # its network namespace or hostname changed since start
        "cancelled": _f(bool, required=False),  # the pause was cancelled: nothing rebuilt
    },
    # The rank's task wrapper (torchpass.checkpoint.rankwrap) saw the rank's process end with an
    # exit code other than 0 or a signal, on a node that is up, and holds its own exit until the
    # coordinator decided (decide_rank_death). Asked again while the reply says "hold".
    # Reply result: {"verdict": "hold"|"exit", "retry_s": S}.
    "rank.exited": {
        "job_id": _f(int),
        "rank": _f(int),
        "node": _f(str),
        "code": _f(int),  # shell-style: 128+S for signal S
        "signal": _f(int, required=False),  # the signal that ended it
        "gpu": _f(int, required=False),  # the task's SLURM_LOCALID
    },
    # An application checkpoint (torchpass.checkpoint) completed or failed: rank 0
    # says so once the checkpoint's .metadata and torchpass.json are written (or it gave up).
    # The coordinator records checkpoint.completed / checkpoint.failed.
    "rank.checkpoint": {
        "job_id": _f(int),
        "rank": _f(int),
        "outcome": _f(str),  # "completed", "failed", or "loaded" (the job went on from it)
        "step": _f(int),
        "path": _f(str),  # the checkpoint's directory (DCP format), as the ranks see it
        "bytes": _f(int, required=False),
        "blocking_s": _f(float, int, required=False),  # training stood still for the copy and the plan
        "write_s": _f(float, int, required=False),  # the background part, to the checkpoint complete
        "waited_s": _f(float, int, required=False),  # of blocking_s: waiting for the previous save
        "removed": _f(list, required=False),  # steps retention removed
        "error": _f(str, required=False),
    },
    # --- anyone -> coordinator ---------------------------------------------
    "job.status": {},
    "job.events": {"since_seq": _f(int, required=False)},
    # --- operator -> coordinator (tpassctl migrate; torchpass/coordinator) ---
    # Planned migration of every rank on `node`, to the spare `to` when given.
    # Reply result: {"migration": ID, "node": N, "to": T|None, "queued_behind": [IDs]}.
    # Errors: not_found (node not in the job / `to` not a spare), conflict
    # (already queued or in flight, spare not free, ranks missing),
    # bad_request (to == node).
    "job.migrate": {"node": _f(str), "to": _f(str, required=False)},
    # --- operator -> coordinator: whole-job snapshot (tpassctl snapshot) -----------------
    # Snapshot every rank, leaving the job running; the owner or an admin, proven by
    # munge (as job.migrate). Reply result: {"snapshot": ID}; follow it with job.events
    # (snapshot.completed / snapshot.failed). Errors: conflict (a migration or another
    # snapshot in flight, ranks missing, job unprotected), unavailable, forbidden.
    "job.snapshot": {"stop": _f(bool, required=False)},  # --stop: hold the job once it is saved
    # --- coordinator -> tpassd (checkpoint; torchpass/checkpoint/service.py) ------
    # munge-authenticated for the node; allowed for root or the job's owner
    # (the uid Slurm records for job_id). rank_dir: optional; tpassd derives the
    # job's rank directory itself (STATE_DIR/jobs/J/ranks) and refuses any other
    # (forbidden); images: must be SNAPSHOT_DIR/jobJ/rankR.genG under root-owned
    # directories (forbidden otherwise).
    #   op "dump":  CRIU-dump the quiesced rank, leaving it running (paused);
    #               result {images, checksum, bytes, criu_dump_s, total_s, pid}
    #   op "kill":  SIGKILL the source copy `pid` (after every restore succeeded), discard
    #               the rank's images on this node; result {killed, discarded_mb}. `tasks`
    #               [[rank, pid], ...]: the node's other source copies of the move, each
    #               checked before any is killed, all killed at once; result also `tasks`
    #               (one {rank, pid, killed, discarded_mb} each)
    #   op "abort": the move is off: hand-off marker "abort", images discarded
    # Whole-job snapshots (torchpass.checkpoint.job_snapshots), `snapshot` = its id:
    #   op "snap":    dump the held rank into SNAPSHOT_DIR/snapshots/jobJ/ID/rankR (no hand-off marker);
    #                 result as dump
    #   op "commit":  (rank 0: any) verify `parts` [{rank, node, images, checksum}], write the job manifest,
    #                 keep the newest `keep`; result {manifest, bytes, removed}
    #   op "discard": remove this node's part of a failed snapshot; op "delete": remove a committed one
    #                 (root, the job's owner, or the uid its manifest records)
    "tpassd.snapshot": {
        "job_id": _f(int),
        "rank": _f(int),
        "op": _f(str),
        "rank_dir": _f(str, required=False),
        "generation": _f(int, required=False),
        "pid": _f(int, required=False),
        "snapshot": _f(str, required=False),
        "step": _f(int, required=False),
        "collectives": _f(int, required=False),
        "keep": _f(int, required=False),
        "parts": _f(list, required=False),
        "tasks": _f(list, required=False),
    },
    #   op "verify":  the target can read `images` and its manifest matches `checksum`
    #   op "abort":   kill what was restored from `images` on this node (best effort)
    #   op "prepare": write the restore token that lets the SPANK plugin start its root restore agent
    #                 for one restore on this node (torchpass.checkpoint.restore_token), `kind`:
    #                 "migration" (rank `rank` of a move, its dump `generation`; `alloc`: the job the
    #                 restore step runs in when not job_id, a companion allocation of the same owner),
    #                 "snapshot" (a step relaunched from whole-job snapshot `snapshot`) or "stopped"
    #                 (step `step` of a stopped job, from `snapshot`); the snapshot must be committed
    #                 (its manifest root's, of the job's owner). Result {node, kind, token, ttl_s}.
    "tpassd.restore": {
        "job_id": _f(int),
        "rank": _f(int),
        "op": _f(str),
        "images": _f(str, required=False),
        "checksum": _f(str, required=False),
        "rank_dir": _f(str, required=False),
        "kind": _f(str, required=False),
        "alloc": _f(int, required=False),
        "generation": _f(int, required=False),
        "snapshot": _f(str, required=False),
        "step": _f(int, required=False),
    },
    # --- coordinator -> tpassd: drain this node (tpassd/daemon.py) -----------
    # slurmctld lets only root and SlurmUser drain, so a job's coordinator asks
    # the bad node's own tpassd (root). Granted to root and SlurmUser always;
    # to anyone else only when tpassd's own health view says the node is
    # degraded or failed and slurmctld says the requester owns job_id, running
    # on this node. `reason` must start with "torchpass: ". Refusals:
    # forbidden / conflict. Result: {"node", "reason", "health"}.
    # `node`: drain that node instead, a node of the job lost outright (its own
    # tpassd died with it). This node's tpassd is the witness: granted to root
    # and SlurmUser; to anyone else only when slurmctld says the requester owns
    # job_id, running on this node and on `node`, and that it no longer hears
    # `node` (NOT_RESPONDING or DOWN). Result: {"node", "reason", "health",
    # "witness", "slurm_state"}; health is "unknown" (no tpassd to ask).
    "tpassd.drain": {
        "job_id": _f(int),
        "reason": _f(str),
        "node": _f(str, required=False),
    },
    # --- coordinator -> tpassd: account for the job in Slurm (tpassd/accounting.py) -----------
    # After each migration, snapshot, reroute or relaunch. tpassd (root) rebuilds the job's
    # "torchpass: ..." part from the job's events.json (read through safeio, counted, never copied
    # as text: torchpass/accounting.py) and writes it into the job's accounting_field
    # (AdminComment), keeping the other parts. Granted to root, SlurmUser and the job's owner, for
    # a job slurmctld says runs on this node. Result: {"job_id", "field", "value", "changed"}.
    "tpassd.account": {
        "job_id": _f(int),
    },
    # --- coordinator -> its batch host's tpassd: the job's summary for Prometheus ------
    # Every every_s seconds (torchpass/job_metrics.py, which also checks the nested objects,
    # rejects unknown keys and caps the body at 4 KiB). Root or the job's owner (Slurm's word);
    # tpassd keeps it in memory only and serves it on /metrics. Result: {"node", "jobs"}.
    "tpassd.job_metrics": {
        "job_id": _f(int),
        "every_s": _f(float, int),
        "ranks_registered": _f(int),
        "ranks_expected": _f(int),
        "oldest_report_age_s": _f(float, int),
        "unprotected": _f(bool),
        "migrations": _f(dict),  # outcome -> count
        "snapshots": _f(dict),  # outcome -> count
        "pauses": _f(dict),  # kind -> {"buckets": [cumulative counts], "count", "sum_s"}
    },
}

# The coordinator -> rank commands (the "command" field of a reply's result["command"]), defined
# here only: the coordinator's executor gives them (coordinator/rank_commands.py,
# migration_actions.py), the rank's control link carries them out (runtime/control.py).
COMMAND_PAUSE = "pause"
COMMAND_RESUME = "resume"
COMMAND_NONE = "none"  # no command
RANK_COMMANDS = (COMMAND_PAUSE, COMMAND_RESUME)


@dataclass(frozen=True)
class Message:
    type: str
    body: dict[str, Any]
    id: str = ""
    auth: str | None = None
    seq: int | None = None
    sender: str | None = None


@dataclass(frozen=True)
class Reply:
    id: str
    ok: bool
    result: dict[str, Any] = field(default_factory=dict)
    code: str | None = None
    message: str | None = None

    def unwrap(self) -> dict[str, Any]:
        """The result of a successful reply; RemoteError otherwise."""
        if not self.ok:
            raise RemoteError(self.code or "internal", self.message or "error reply")
        return self.result


_ids = itertools.count(1)
_id_prefix = f"{os.getpid():x}-"


def new_id() -> str:
    return f"{_id_prefix}{next(_ids)}"


def _check_json_value(value: Any) -> None:
    # json.loads accepts NaN/Infinity; they are not JSON and break peers.
    if isinstance(value, float) and not math.isfinite(value):
        raise ProtocolError("non-finite number in message")


def _dump(obj: dict[str, Any]) -> bytes:
    try:
        data = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"message is not JSON-serialisable: {exc}") from None
    if len(data) > MAX_FRAME_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_FRAME_BYTES}")
    return data


def _load(frame: bytes) -> dict[str, Any]:
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError("frame is not bytes")
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        obj = json.loads(bytes(frame).decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"frame is not UTF-8 JSON: {type(exc).__name__}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("frame is not a JSON object")
    v = obj.get("v")
    if v != SCHEMA_VERSION or isinstance(v, bool):
        raise ProtocolError(f"unsupported schema version {v!r}, this peer speaks {SCHEMA_VERSION}")
    return obj


def _reject_constant(name: str):
    raise ValueError(f"non-finite number {name}")


def _validate_body(type_: str, body: Any) -> dict[str, Any]:
    spec = BODIES.get(type_)
    if spec is None:
        raise ProtocolError(f"unknown message type {type_!r}")
    if not isinstance(body, dict):
        raise ProtocolError(f"{type_}: body is not an object")
    unknown = sorted(set(body) - set(spec))
    if unknown:
        raise ProtocolError(f"{type_}: unknown field(s) {', '.join(map(str, unknown))}")
    for name, fs in spec.items():
        if name not in body or body[name] is None:
            if fs.required:
                raise ProtocolError(f"{type_}: missing field {name!r}")
            continue
        value = body[name]
        # bool is an int subclass in Python; never accept it for a number.
        if isinstance(value, bool) and bool not in fs.types:
            raise ProtocolError(f"{type_}: field {name!r} must be {_names(fs.types)}, got bool")
        if not isinstance(value, fs.types):
            raise ProtocolError(
                f"{type_}: field {name!r} must be {_names(fs.types)}, got {type(value).__name__}"
            )
        _check_json_value(value)
    return body


def _names(types: tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in types)


def encode(
    type_: str,
    body: dict[str, Any] | None = None,
    *,
    id: str | None = None,
    auth: str | None = None,
    seq: int | None = None,
    sender: str | None = None,
) -> bytes:
    body = _validate_body(type_, dict(body or {}))
    obj: dict[str, Any] = {"v": SCHEMA_VERSION, "type": type_, "id": id or new_id(), "body": body}
    if auth is not None:
        obj["auth"] = auth
    if seq is not None:
        obj["seq"] = seq
    if sender is not None:
        obj["sender"] = sender
    return _dump(obj)


def decode(frame: bytes) -> Message:
    """Decode and validate a request or publication; ProtocolError otherwise."""
    obj = _load(frame)
    type_ = obj.get("type")
    if not isinstance(type_, str):
        raise ProtocolError("missing or non-string 'type'")
    if type_ == "reply":
        raise ProtocolError("a reply was sent where a request was expected")
    allowed = {"v", "type", "id", "auth", "seq", "sender", "body"}
    extra = sorted(set(obj) - allowed)
    if extra:
        raise ProtocolError(f"unknown envelope field(s) {', '.join(map(str, extra))}")
    id_ = obj.get("id", "")
    auth = obj.get("auth")
    seq = obj.get("seq")
    sender = obj.get("sender")
    if not isinstance(id_, str) or len(id_) > 128:
        raise ProtocolError("'id' must be a string of at most 128 characters")
    if auth is not None and not isinstance(auth, str):
        raise ProtocolError("'auth' must be a string")
    if seq is not None and (not isinstance(seq, int) or isinstance(seq, bool) or seq < 0):
        raise ProtocolError("'seq' must be a non-negative integer")
    if sender is not None and not isinstance(sender, str):
        raise ProtocolError("'sender' must be a string")
    body = _validate_body(type_, obj.get("body", {}))
    return Message(type_, body, id_, auth, seq, sender)


def peek_id(frame: bytes) -> str:
    """Best-effort request id of a frame that failed to decode, for the error reply."""
    try:
        obj = json.loads(bytes(frame[:MAX_FRAME_BYTES]).decode("utf-8"))
        id_ = obj.get("id", "") if isinstance(obj, dict) else ""
        return id_ if isinstance(id_, str) and len(id_) <= 128 else ""
    except Exception:  # noqa: BLE001 - any garbage simply has no id
        return ""


def encode_ok(id: str, result: dict[str, Any] | None = None) -> bytes:
    return _dump({"v": SCHEMA_VERSION, "type": "reply", "id": id, "ok": True, "result": result or {}})


def encode_result(result: dict[str, Any]) -> bytes:
    """A reply's result on its own, for encode_ok_raw: a fan-out encodes one result once for many
    replies (the coordinator's pause and resume to every rank)."""
    return _dump(result)


def encode_ok_raw(id: str, result: bytes) -> bytes:
    """encode_ok with the result already encoded by encode_result: the same reply, without encoding
    the result again for each request it answers."""
    data = b'{"v":%d,"type":"reply","id":%s,"ok":true,"result":%s}' % (
        SCHEMA_VERSION, json.encoder.encode_basestring_ascii(id).encode(), result)
    if len(data) > MAX_FRAME_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_FRAME_BYTES}")
    return data


def encode_error(id: str, code: str, message: str) -> bytes:
    if code not in ERROR_CODES:
        raise ValueError(f"unknown error code {code!r}")
    # Messages are one line for the user; never a traceback.
    line = " ".join(str(message).split())[:500]
    return _dump(
        {
            "v": SCHEMA_VERSION,
            "type": "reply",
            "id": id,
            "ok": False,
            "error": {"code": code, "message": line},
        }
    )


def decode_reply(frame: bytes) -> Reply:
    obj = _load(frame)
    if obj.get("type") != "reply":
        raise ProtocolError("expected a reply")
    id_ = obj.get("id", "")
    ok = obj.get("ok")
    if not isinstance(ok, bool) or not isinstance(id_, str):
        raise ProtocolError("reply lacks a boolean 'ok' or a string 'id'")
    if ok:
        result = obj.get("result", {})
        if not isinstance(result, dict):
            raise ProtocolError("reply 'result' is not an object")
        return Reply(id_, True, result)
    err = obj.get("error")
    if not isinstance(err, dict) or not isinstance(err.get("code"), str):
        raise ProtocolError("error reply lacks error.code")
    return Reply(id_, False, {}, err["code"], str(err.get("message", "")))
