"""The task wrapper's report of its rank's death, and the hold of its own exit until the coordinator decided.

When the rank's process ends with an exit code other than 0 or a signal (a GPU
off the bus, an uncorrectable ECC error, an NCCL or gloo abort, a bug in the
script), the wrapper (rankwrap.launch) sends ``rank.exited`` to the job's
coordinator at once and asks again every ``retry_s`` while the reply says
``hold``. The coordinator (decide_rank_death) either relaunches the step (its
end kills this wrapper: SIGTERM, which is left at its default action here) or
answers ``exit``: the wrapper then ends as its rank did, as without torchpass.
Holding keeps srun, and slurmstepd's KillOnBadExit, from seeing any task fail
before the coordinator decided.

It never holds a job hostage: no coordinator (not a --torchpass step, or no
endpoint) means no report; a coordinator that does not answer for
``SILENT_S`` or a hold longer than ``HOLD_MAX_S`` ends the hold.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from torchpass import envnames

# The longest a wrapper holds its exit: the coordinator decides within death_event_window_s
# (10 s by default) of the death, and a relaunch ends the step within seconds of its decision.
HOLD_MAX_S = 120.0
# No answer from the coordinator for this long: it is gone; exit as the rank did.
SILENT_S = 10.0
REQUEST_TIMEOUT_S = 2.0


def _endpoint(env: Mapping[str, str]) -> str:
    ep = env.get(envnames.COORDINATOR) or ""
    return ep if not ep or "://" in ep else f"tcp://{ep}"


def report_body(env: Mapping[str, str], rank: str, result: int) -> dict[str, Any] | None:
    """The ``rank.exited`` body for ``result`` (Relay.wait's: -S for signal S), or None when there is
    nothing to report (a clean exit, or no job id or rank)."""
    job = env.get(envnames.JOB_ID) or env.get("SLURM_JOB_ID") or ""
    if result == 0 or not job.isdigit() or not rank.isdigit():
        return None
    body: dict[str, Any] = {"job_id": int(job), "rank": int(rank), "node": socket.gethostname(),
                            "code": 128 - result if result < 0 else result}
    if result < 0:
        body["signal"] = -result
    local = env.get("SLURM_LOCALID") or ""
    if local.isdigit():
        body["gpu"] = int(local)
    return body


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise ConnectionError("the coordinator closed the connection")
        buf += got
    return buf


def _recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    """One ZMTP 3 frame: (flags, body)."""
    flags = _recv_exact(sock, 1)[0]
    size = int.from_bytes(_recv_exact(sock, 8 if flags & 0x02 else 1), "big")
    return flags, _recv_exact(sock, size)


def _frame_bytes(body: bytes, more: bool = False, command: bool = False) -> bytes:
    flags = (0x01 if more else 0) | (0x04 if command else 0)
    if len(body) > 255:
        return bytes([flags | 0x02]) + len(body).to_bytes(8, "big") + body
    return bytes([flags, len(body)]) + body


def zmtp_request(endpoint: str, frame: bytes, timeout_s: float) -> bytes:
    """One request over ZMTP 3.0 (NULL mechanism) as a DEALER that frames it as REQ does
    ([empty, frame]), and the reply's last frame. Plain blocking TCP: the task wrapper may not
    start a thread (pthread_create fails with EINVAL in a process whose children go to another
    PID namespace, which the SPANK plugin made it), and libzmq aborts the process on that."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.settimeout(timeout_s)
        sock.sendall(b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + bytes(32))
        greeting = _recv_exact(sock, 64)
        if greeting[0] != 0xFF or greeting[10] < 3:
            raise ConnectionError("the coordinator does not speak ZMTP 3")
        ready = b"\x05READY" + b"\x0bSocket-Type" + len(b"DEALER").to_bytes(4, "big") + b"DEALER"
        sock.sendall(_frame_bytes(ready, command=True))
        while True:  # the peer's READY
            flags, _body = _recv_frame(sock)
            if flags & 0x04:
                break
        sock.sendall(_frame_bytes(b"", more=True) + _frame_bytes(frame))
        parts: list[bytes] = []
        while True:
            flags, body = _recv_frame(sock)
            if flags & 0x04:
                continue
            parts.append(body)
            if not flags & 0x01:
                return parts[-1]


def _zmtp_requester(endpoint: str, signer: Any) -> Callable[[str, dict[str, Any]], dict[str, Any]]:
    from torchpass import zmqio
    from torchpass.errors import UnreachableError

    def request(type_: str, body: dict[str, Any]) -> dict[str, Any]:
        id_, frame, opener = zmqio._frame(type_, body, signer)
        try:
            raw = zmtp_request(endpoint, frame, REQUEST_TIMEOUT_S)
        except (OSError, ValueError) as exc:
            raise UnreachableError(f"no reply from {endpoint} to {type_}: {exc}") from None
        reply = zmqio._reply_to(raw, id_, opener)
        if reply is None:
            raise UnreachableError(f"no valid reply from {endpoint} to {type_}")
        return reply.unwrap()

    return request


def hold_exit(rank: str, result: int, env: Mapping[str, str] = os.environ, *,
              request: Callable[..., dict[str, Any]] | None = None, clock: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], None] = time.sleep, say: Callable[[str], None] = lambda _m: None) -> str:
    """Report the death and hold until the coordinator says exit. Returns why the hold ended:
    "clean" (nothing to report), "no coordinator", "exit" (the coordinator's verdict), "silent"
    (no answer for SILENT_S), "expired" (HOLD_MAX_S)."""
    body = report_body(env, rank, result)
    endpoint = _endpoint(env)
    if body is None:
        return "clean"
    if not endpoint:
        return "no coordinator"
    if request is None:
        from torchpass.jobauth import signer_from_env

        request = _zmtp_requester(endpoint, signer_from_env(env))
    # The step's end (a relaunch) sends SIGTERM: it must end this wrapper now, not be forwarded to
    # a rank that is gone (the wrapper would wait for slurmstepd's SIGKILL, KillWait later).
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)
    from torchpass.errors import TorchpassError

    start = last_answer = clock()
    held = False
    while clock() - start < HOLD_MAX_S:
        try:
            res = request("rank.exited", body)
        except TorchpassError as exc:
            if clock() - last_answer >= SILENT_S:
                say(f"rank {rank}: the coordinator did not answer ({exc}); exiting as the rank did")
                return "silent"
            sleep(0.5)
            continue
        last_answer = clock()
        if res.get("verdict") != "hold":
            return "exit"
        if not held:
            how = f"signal {body['signal']}" if "signal" in body else f"exit {body['code']}"
            say(f"rank {rank} ended ({how}); its task waits for the coordinator's decision")
            held = True
        retry = res.get("retry_s")
        sleep(min(max(float(retry), 0.05), 2.0) if isinstance(retry, (int, float)) else 0.5)
    say(f"rank {rank}: no decision from the coordinator in {HOLD_MAX_S:g} s; exiting as the rank did")
    return "expired"


__all__ = ["hold_exit", "report_body", "HOLD_MAX_S", "SILENT_S"]
