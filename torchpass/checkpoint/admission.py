"""Who may ask tpassd's checkpoint service, and the one audit line each request leaves.

A request is admitted in this order, so that a refused one costs no Slurm work beyond the one
owner lookup: its job and rank are integers (they make every path); the requester is root or the
job's owner as slurmctld records it (the lookup tpassd's control server cached at admission,
tpassd/control.py); only then is slurmd asked for the job's pids on this node, and only for an
op that pins a process. Every process the service acts on is pinned here (procs.pin: the job's on
this node per Slurm, the owner's, the expected parent's child, in tpassd's namespaces for a dump).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from torchpass import auth, wire
from torchpass.checkpoint import procs
from torchpass.checkpoint.node_settings import NodeSettings
from torchpass.errors import RemoteError, TorchpassError

audit_log = structlog.get_logger("tpassd.audit")

# (request, op) that pin a process of the job, and so need its pids from slurmd.
PINNING_OPS = frozenset({("snapshot", "dump"), ("snapshot", "kill"), ("snapshot", "snap"), ("restore", "abort")})


class Asking:
    """One question asked in a thread of its own; ``answer()`` waits for it (its error re-raised)."""

    def __init__(self, ask: Callable[[int], set[int]], job_id: int):
        self._value: set[int] = set()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._ask, args=(ask, job_id), name="tpassd-slurm-question",
                                        daemon=True)
        self._thread.start()

    def _ask(self, ask: Callable[[int], set[int]], job_id: int) -> None:
        try:
            self._value = ask(job_id)
        except BaseException as exc:  # noqa: BLE001 - every one, SystemExit too, is re-raised by answer()
            # in the thread that waits: one let out here would end this thread, and answer() would return no pids.
            self._error = exc

    def answer(self) -> set[int]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class Audit:
    """The one audit line of a request: filled in as the request goes, logged at its end."""

    def __init__(self, ident: auth.Identity, action: str, body: dict[str, Any]):
        self.fields: dict[str, Any] = {"requester_uid": ident.uid, "job_id": body.get("job_id"),
                                       "rank": body.get("rank"), "pid": None, "action": action}
        # What Slurm said of the job in this request. Each question takes 6-14 ms while a migrating
        # job stands still, so a request asks each once: the owner (slurmctld) as its authorization
        # heard it (None: not asked, root's request), and, for a request that pins a process, the
        # job's pids on this node (slurmd), asked once the request is authorized.
        self.owner: int | None = None
        self.pids: Asking | None = None

    def __enter__(self) -> "Audit":
        return self

    def __exit__(self, typ, exc, _tb) -> None:
        outcome = "ok" if exc is None else getattr(exc, "code", None) or "failed"
        audit_log.info("privileged action", outcome=outcome, **self.fields,
                       **({"error": str(exc)} if exc is not None else {}))


# authorize(ident, job_id, op): the job's owner when Slurm was asked, None for root; raises AuthFailure
Authorizer = Callable[[auth.Identity, int, str], "int | None"]
Handler = Callable[[dict[str, Any], Audit], dict[str, Any]]


class Admission:
    def __init__(self, settings: NodeSettings):
        self.settings = settings

    def owner_of(self, job_id: int) -> int:
        """The job's owner as slurmctld records it (RemoteError when Slurm cannot say)."""
        try:
            owner = self.settings.job_owner(job_id)
        except TorchpassError as exc:
            raise RemoteError("unavailable", f"cannot ask Slurm who owns job {job_id} ({exc})") from None
        if owner is None or owner < 0:
            raise RemoteError("not_found", f"job {job_id} is not known to Slurm")
        return owner

    def authorize(self, ident: auth.Identity, job_id: int, _op: str = "") -> int | None:
        """Root, or the job's owner; returns the owner when Slurm was asked (None for root)."""
        if ident.uid == 0:
            return None
        owner = self.owner_of(job_id)
        if owner != ident.uid:
            raise auth.AuthFailure("forbidden", f"uid {ident.uid} does not own job {job_id}")
        return owner

    def audited(self, kind: str, msg: wire.Message, ident: auth.Identity, handler: Handler,
                authorize: Authorizer | None = None) -> dict[str, Any]:
        """Authorize (``authorize``, default: root or the job's owner), run ``handler(body, audit)``,
        and leave the request's one audit line."""
        b = msg.body
        with Audit(ident, f"{kind}.{b.get('op')}", b) as act:
            # job and rank make every path: integers only (the wire checks too)
            if not all(isinstance(b.get(k), int) and not isinstance(b[k], bool) and b[k] >= 0
                       for k in ("job_id", "rank")):
                raise RemoteError("bad_request", f"{kind}: job_id and rank must be non-negative integers")
            act.owner = (authorize or self.authorize)(ident, b["job_id"], str(b.get("op")))
            # slurmd is asked for the job's pids only for an authorized request: a refused one costs
            # no scontrol listpids (the owner comes from tpassd's admission cache, no second call)
            if (kind, b.get("op")) in PINNING_OPS:
                act.pids = Asking(self.settings.job_pids, b["job_id"])
            return handler(b, act)

    def job_view(self, job_id: int, act: Audit | None = None) -> tuple[set[int], int]:
        """What Slurm says of the job: its pids on this node (slurmd), its owner (slurmctld); what
        the request ``act`` asked already is not asked again, and the rest is asked at once."""
        pids = act.pids if act is not None and act.pids is not None else Asking(self.settings.job_pids, job_id)
        owner = act.owner if act is not None and act.owner is not None else self.owner_of(job_id)
        return pids.answer(), owner

    def pin(self, job_id: int, pid: Any, *, parent: int | None = None, dump: bool = False,
            view: tuple[set[int], int] | None = None, act: Audit | None = None) -> procs.Pinned:
        """``pid`` checked and pinned by a pidfd (procs.pin); RemoteError when it is not the job's."""
        pids, owner = view or self.job_view(job_id, act)
        return procs.pin(pid, job_id=job_id, job_pids=pids, owner=owner, parent=parent, same_namespaces=dump,
                         proc=self.settings.proc)

    def pin_unless_gone(self, job_id: int, pid: int, *, parent: int | None = None, act: Audit | None = None
                        ) -> procs.Pinned | None:
        """The checked, pinned process; None if it is gone (RemoteError if it is not the job's).
        ``act``: the request, with what it asked Slurm already."""
        if not Path(f"{self.settings.proc}/{pid}").exists():
            return None
        try:
            return self.pin(job_id, pid, parent=parent, act=act)
        except RemoteError as exc:
            if exc.code == "not_found":  # it died since
                return None
            raise


__all__ = ["Admission", "Asking", "Audit", "PINNING_OPS"]
