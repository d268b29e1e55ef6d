"""What tpassd's checkpoint requests do: ``tpassd.snapshot`` and ``tpassd.restore``.

The job's coordinator asks the source node's tpassd to CRIU-dump a quiesced
rank (leaving it running, paused, so that a later failure can resume it in
place), to kill that source copy once every restore succeeded, or to mark
the hand-off aborted; and the target node's tpassd to check a snapshot
before the restore step runs, or to kill what a failed move restored.

The privilege boundary (tpassd is root; the rank record and the rank
directory belong to the job user). tpassd acts only on what it verifies
itself (docs/migration-internals.md, "Privilege boundary"):

* Who may ask: root, or the uid Slurm records as the job's owner.
* Paths: the rank directory is ``layout.rank_records_dir(STATE_DIR, J)``
  (tpassd's own state directory); snapshot images are
  ``layout.images_dir(ROOT, J, R, G)`` under this tpassd's snapshot_dir or
  another directory tree owned by root alone. A request that names another
  rank directory, or images elsewhere, is refused (``forbidden``).
* Processes: a pid named by the rank record or the request is acted on only
  if Slurm lists it for the job on this node, it runs as the job's owner,
  the rank's parent is the wrapper, and (for a dump) both share tpassd's
  mount and user namespaces; pinned by a pidfd (torchpass.checkpoint.procs).
* Files in the user's directory are read capped, never a FIFO or device,
  and written with O_NOFOLLOW|O_EXCL then renamed (torchpass.checkpoint.safeio).
* criu runs in tpassd's mount namespace (entering only the wrapper's
  network and UTS namespaces), executed from a file descriptor, with a
  timeout; scontrol too has a timeout.
* Every request leaves one audit line (logger ``tpassd.audit``): requester
  uid, job, rank, pid, action, outcome.

tpassd/checkpoint_handlers.py registers ``CheckpointService.snapshot`` and
``CheckpointService.restore`` on tpassd's control server. Paths come from
torchpass.layout; the snapshot checksum from torchpass.checkpoint.manifest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from torchpass import auth, jobdir, layout, slurm, wire
from torchpass.checkpoint import criu as criu_mod
from torchpass.checkpoint import job_manifest, procs, restore_token, safeio
from torchpass.checkpoint.cuda import CudaCheckpoint
from torchpass.checkpoint.manifest import checksum_of, read_manifest_bytes
from torchpass.errors import CheckpointError, RemoteError, TorchpassError

log = structlog.get_logger("tpassd.checkpoint")
audit_log = structlog.get_logger("tpassd.audit")


def _keep(body: dict[str, Any]) -> int:
    """A request's ``keep`` (the job's retention: the snapshots kept), 1 when absent or not a count."""
    keep = body.get("keep")
    return keep if isinstance(keep, int) and not isinstance(keep, bool) and keep >= 1 else 1


def _job_owner(job_id: int) -> int | None:
    info = slurm.client().job(job_id)
    return None if info is None else info.user_id


def maps_nvidia_device(pid: int, proc: str = "/proc") -> bool:
    """True if ``pid`` maps an NVIDIA device file (a CUDA context): its GPU state must be checkpointed."""
    try:
        with open(f"{proc}/{pid}/maps") as f:
            return any("/dev/nvidia" in line for line in f)
    except OSError:
        return False


# tpassd.snapshot ops of whole-job snapshots (issue 12; CheckpointService._job_snapshot).
JOB_SNAPSHOT_OPS = ("snap", "commit", "discard", "delete")


_JOB_ID = re.compile(r"[0-9]{1,12}")  # layout.job_dir's name


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
        except BaseException as exc:  # re-raised in the thread that waits for the answer
            self._error = exc

    def answer(self) -> set[int]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


# op=kill's ``tasks``: a node's other source copies of one move (one srun task per GPU: 8 on
# most GPU nodes; a CPU job may run one per core).
MAX_KILL_TASKS = 1024
# (request, op) that pin a process of the job, and so need its pids from slurmd.
PINNING_OPS = frozenset({("snapshot", "dump"), ("snapshot", "kill"), ("snapshot", "snap"), ("restore", "abort")})


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


class CheckpointService:
    def __init__(self, snapshot_dir: str | os.PathLike, node: str, *, state_dir: str | os.PathLike | None = None,
                 criu_binary: str | None = None, job_owner: Callable[[int], int | None] = _job_owner,
                 job_pids: Callable[[int], set[int]] = procs.slurm_job_pids, proc: str = "/proc",
                 restore_fault: Callable[[], bool] | None = None, kill_fault: Callable[[], bool] | None = None,
                 gpu_in_use: Callable[[int], bool] | None = None, cuda_loader: Callable[[], Any] | None = None,
                 dump_timeout_s: float = criu_mod.DUMP_TIMEOUT_S,
                 image_estimate: Callable[[int], int] = criu_mod.image_estimate, keep_free_bytes: int = 0,
                 wall: Callable[[], float] = time.time, owner_gid: Callable[[int], int] | None = None,
                 restore_tokens: str | os.PathLike = layout.RESTORE_TOKENS, token_owner: int = 0):
        self.snapshot_dir = Path(snapshot_dir)
        # The job state directory (STATE_DIR, whose jobs/J/ranks is the job's rank
        # directory): the only place tpassd looks for rank records.
        self.state_dir = None if state_dir is None else Path(state_dir)
        # Does the rank hold GPU state (then the driver must move it to host
        # memory before CRIU can dump)? Injectable for tests on GPU-less machines.
        self.gpu_in_use = gpu_in_use or (lambda pid: maps_nvidia_device(pid, self.proc))
        self.cuda_loader = cuda_loader
        self.node = node
        self.criu_binary = criu_binary
        self.job_owner = job_owner
        # The job's processes on this node, as Slurm tracks them (scontrol listpids).
        self.job_pids = job_pids
        self.proc = proc
        self.dump_timeout_s = dump_timeout_s
        # How many bytes a dump of a tree will write (checked against snapshot_dir's free
        # space before anything moves, and again right before CRIU, after a CUDA suspend
        # brought the GPU state into host memory). Injectable: tests make it miss.
        self.image_estimate = image_estimate
        # Whole-job snapshots (issue 12) leave at least this much free on snapshot_dir: tpassd's own
        # free-space health rule (disk_free_gb_degraded) must not trip because of a snapshot.
        self.keep_free_bytes = keep_free_bytes
        # Site limits on complete whole-job snapshots (tpassd.toml snapshot_quota_gb, snapshot_max_age_h):
        # bytes per user over all their jobs, checked at commit; age after which expire_snapshots removes
        # one. 0: none.
        self.snapshot_quota_bytes = 0
        self.snapshot_max_age_s = 0.0
        self.wall = wall  # the job manifest's created time
        # The group that may read a job's manifests: the owner's primary group if it is a user-private
        # group; None: no group, the owner reads them through an ACL entry (jobdir.share_with_owner).
        self.owner_gid = owner_gid or jobdir.private_group
        # The restore-fail fault drill (tpassd/drills.py): True once when armed.
        self.restore_fault = restore_fault or (lambda: False)
        # The kill-fail drill: True once when armed; the next op=kill is refused.
        self.kill_fault = kill_fault or (lambda: False)
        self._discarding: list[threading.Thread] = []  # image removals running after their reply (_discard)
        # Restore tokens (op=prepare): TOKENS/NODE, root's 0700 (token_owner: tests run unprivileged).
        self.restore_tokens = Path(restore_tokens)
        self.token_owner = token_owner

    # -- authorization ---------------------------------------------------------
    def owner_of(self, job_id: int) -> int:
        """The job's owner as slurmctld records it (RemoteError when Slurm cannot say)."""
        try:
            owner = self.job_owner(job_id)
        except TorchpassError as exc:
            raise RemoteError("unavailable", f"cannot ask Slurm who owns job {job_id} ({exc})") from None
        if owner is None or owner < 0:
            raise RemoteError("not_found", f"job {job_id} is not known to Slurm")
        return owner

    def authorize(self, ident: auth.Identity, job_id: int) -> int | None:
        """Root, or the job's owner; returns the owner when Slurm was asked (None for root)."""
        if ident.uid == 0:
            return None
        owner = self.owner_of(job_id)
        if owner != ident.uid:
            raise auth.AuthFailure("forbidden", f"uid {ident.uid} does not own job {job_id}")
        return owner

    def _job_view(self, job_id: int, act: Audit | None = None) -> tuple[set[int], int]:
        """What Slurm says of the job: its pids on this node (slurmd), its owner (slurmctld); what
        the request ``act`` asked already is not asked again, and the rest is asked at once."""
        pids = act.pids if act is not None and act.pids is not None else Asking(self.job_pids, job_id)
        owner = act.owner if act is not None and act.owner is not None else self.owner_of(job_id)
        return pids.answer(), owner

    def _pin(self, job_id: int, pid: Any, *, parent: int | None = None, dump: bool = False,
             view: tuple[set[int], int] | None = None, act: Audit | None = None) -> procs.Pinned:
        pids, owner = view or self._job_view(job_id, act)
        return procs.pin(pid, job_id=job_id, job_pids=pids, owner=owner, parent=parent, same_namespaces=dump,
                         proc=self.proc)

    # -- paths ---------------------------------------------------------------------
    def rank_dir(self, job_id: int) -> Path:
        if self.state_dir is None:
            raise RemoteError("unavailable", f"tpassd on {self.node} has no state_dir: it cannot find rank records")
        return layout.rank_records_dir(self.state_dir, job_id)

    def _check_rank_dir(self, b: dict[str, Any], job_id: int) -> None:
        """A request may name the rank directory only as tpassd derives it itself."""
        asked = b.get("rank_dir")
        if asked and os.path.normpath(asked) != str(self.rank_dir(job_id)):
            raise RemoteError("forbidden", f"rank_dir {asked} is not job {job_id}'s rank directory "
                                           f"({self.rank_dir(job_id)}); refused")

    def _open_rank_dir(self, job_id: int) -> int | None:
        """RANK_DIR/jobJ (the user's), walked from STATE_DIR without following a symlink; None if absent."""
        parts = layout.rank_job_dir(self.rank_dir(job_id), job_id).relative_to(self.state_dir).parts
        try:
            return safeio.open_dir(self.state_dir, parts)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise RemoteError("forbidden", f"job {job_id}'s rank directory: {exc}") from None

    def _read_record(self, dfd: int, job_id: int, rank: int) -> dict[str, Any]:
        name = layout.rank_record(".", job_id, rank).name
        try:
            rec = json.loads(safeio.read_regular(name, safeio.MAX_RECORD_BYTES, dir_fd=dfd))
        except (OSError, ValueError) as exc:
            raise RemoteError("not_found", f"rank {rank} of job {job_id} does not run under rankwrap here "
                                           f"(its rank record: {exc}); it cannot be snapshotted") from None
        if not isinstance(rec, dict):
            raise RemoteError("not_found", f"rank {rank} of job {job_id}: its rank record is not an object")
        return rec

    def _open_images(self, job_id: int, rank: int, images: str) -> tuple[Path, int]:
        """(IMAGES, its directory fd) when ``images`` is layout.images_dir(ROOT, J, R, G) under this
        tpassd's snapshot_dir or a directory tree owned by root alone; RemoteError forbidden otherwise."""
        parsed = layout.parse_images_dir(images, job_id, rank) if os.path.isabs(images) else None
        if parsed is None:
            raise RemoteError("forbidden", f"{images} is not a snapshot directory of rank {rank} of job {job_id} "
                                           "(SNAPSHOT_DIR/jobJ/rankR.genG); refused")
        return self._open_dir_of(parsed[0], layout.images_dir(parsed[0], job_id, rank, parsed[1]))

    @staticmethod
    def _write(dfd: int, path: Path, text: str) -> None:
        safeio.write_at(dfd, path.name, text.encode())

    # -- tpassd.snapshot -------------------------------------------------------
    def _audited(self, kind: str, handler: Callable[[dict[str, Any], Audit], dict[str, Any]],
                 msg: wire.Message, ident: auth.Identity) -> dict[str, Any]:
        """Authorize, run ``handler(body, audit)``, and leave the request's one audit line."""
        b = msg.body
        with Audit(ident, f"{kind}.{b.get('op')}", b) as act:
            # job and rank make every path: integers only (the wire checks too)
            if not all(isinstance(b.get(k), int) and not isinstance(b[k], bool) and b[k] >= 0
                       for k in ("job_id", "rank")):
                raise RemoteError("bad_request", f"{kind}: job_id and rank must be non-negative integers")
            if kind == "snapshot" and b.get("op") in JOB_SNAPSHOT_OPS:
                act.owner = self.authorize_snapshot(ident, b["job_id"], b["op"])
            else:
                act.owner = self.authorize(ident, b["job_id"])
            # slurmd is asked for the job's pids only for an authorized request: a refused one costs
            # no scontrol listpids (the owner comes from tpassd's admission cache, no second call)
            if (kind, b.get("op")) in PINNING_OPS:
                act.pids = Asking(self.job_pids, b["job_id"])
            return handler(b, act)

    def snapshot(self, msg: wire.Message, ident: auth.Identity) -> dict[str, Any]:
        return self._audited("snapshot", self._snapshot, msg, ident)

    def _snapshot(self, b: dict[str, Any], act: Audit) -> dict[str, Any]:
        job_id, rank, op = b["job_id"], b["rank"], b["op"]
        self._check_rank_dir(b, job_id)
        if op == "dump":
            marker = layout.handoff(self.rank_dir(job_id), job_id, rank)
            return self._dump(job_id, rank, int(b.get("generation") or 0), marker, act)
        if op in JOB_SNAPSHOT_OPS:
            return self._job_snapshot(b, op, act)
        if op == "kill":
            return self._kill_op(b, act)
        if op == "abort":
            dfd = self._open_rank_dir(job_id)
            if dfd is not None:
                try:
                    self._write(dfd, layout.handoff(self.rank_dir(job_id), job_id, rank), "abort\n")
                finally:
                    os.close(dfd)
            # The move is off and the rank resumes here: a later move dumps anew.
            return {"node": self.node, "rank": rank, "marker": "abort", "discarded_mb": self._discard(job_id, rank)}
        raise RemoteError("bad_request", f"unknown op {op!r} for tpassd.snapshot; allowed: dump, kill, abort, "
                                         f"{', '.join(JOB_SNAPSHOT_OPS)}")

    def _kill_op(self, b: dict[str, Any], act: Audit) -> dict[str, Any]:
        """op=kill: the source copies ``rank``/``pid`` and ``tasks`` of one move on this node."""
        job_id, rank = b["job_id"], b["rank"]
        copies = self._kill_targets(b)
        act.fields["pid"] = copies[0][1]
        if len(copies) > 1:
            act.fields["tasks"] = [list(c) for c in copies[1:]]
        # Every copy is checked (pinned) before any is killed: a refusal leaves them all
        # paused, so the coordinator's rollback resumes the job where it stood.
        pinned: list[tuple[int, int, procs.Pinned | None]] = []
        try:
            for r, pid in copies:
                pinned.append((r, pid, self._pin_unless_gone(job_id, pid, act=act)))
            if self.kill_fault():
                log.warning("fault drill kill-fail: refusing to kill the source copy", job_id=job_id,
                            ranks=[r for r, _ in copies], pids=[pid for _, pid in copies])
                which = (f"the source copy of rank {rank} (pid {copies[0][1]}) was" if len(copies) == 1 else
                         f"the source copies of ranks {', '.join(str(r) for r, _ in copies)} were")
                raise RemoteError("failed", f"fault drill kill-fail on {self.node}: {which} not killed")
        except BaseException:
            for _, _, p in pinned:
                if p is not None:
                    p.close()
            raise
        killed = self._kill_all_pinned(job_id, pinned)
        # Every restore succeeded before the coordinator asks for this kill:
        # the images are not needed any more.
        for out in killed:
            out["discarded_mb"] = self._discard(job_id, out["rank"])
        if len(killed) > 1:
            killed[0]["tasks"] = killed[1:]
        return killed[0]

    def _discard(self, job_id: int, rank: int) -> float:
        """Remove this node's snapshots of the rank (MB freed). Without this every
        move left its images (hundreds of MB to GB per rank) in snapshot_dir for good.

        Each images directory is renamed out of the rank's names at once (``.discard-...`` in
        the same job directory: nothing finds it as an image any more, and a later dump of the
        rank makes a directory of its own) and removed by a thread after the reply: the kill
        that asks for it is the last step before every rank resumes, and removing a 2.2 GB image
        took 0.19 s of that standstill (issue 13). What a tpassd that stops meanwhile leaves is
        inside SNAPSHOT_DIR/jobJ, which the job's sweep removes."""
        freed = 0
        job_dir = layout.snapshot_job_dir(self.snapshot_dir, job_id)
        doomed = []
        for d in layout.images_dirs(self.snapshot_dir, job_id, rank):
            if d.is_dir() and not d.is_symlink():
                freed += sum(f.stat().st_size for f in d.iterdir() if f.is_file() and not f.is_symlink())
                trash = d.with_name(f".discard-{d.name}-{os.urandom(4).hex()}")
                try:
                    os.rename(d, trash)
                    doomed.append(trash)
                except OSError:  # removed here and now, as before
                    shutil.rmtree(d, ignore_errors=True)

        def remove() -> None:
            for trash in doomed:
                shutil.rmtree(trash, ignore_errors=True)
            try:
                job_dir.rmdir()  # only when empty: other ranks of the job may still have images here
            except OSError:
                pass

        if doomed:
            t = threading.Thread(target=remove, name=f"discard-job{job_id}-rank{rank}", daemon=True)
            self._discarding = [x for x in self._discarding if x.is_alive()] + [t]
            t.start()
        else:
            remove()
        if freed:
            log.info("snapshot images discarded", job_id=job_id, rank=rank, mb=round(freed / 1e6, 1))
        return round(freed / 1e6, 1)

    def wait_discarded(self, timeout_s: float = 30.0) -> bool:
        """True once every image removal started by _discard has finished (for tests)."""
        deadline = time.monotonic() + timeout_s
        for t in list(self._discarding):
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._discarding)

    def _dump(self, job_id: int, rank: int, generation: int, marker: Path, act: Audit,
              snapshot: str | None = None, keep: int = 1) -> dict[str, Any]:
        """Dump the rank: for a migration (``marker``: the hand-off marker says moving / moved /
        abort), or into whole-job snapshot ``snapshot`` (no marker: nothing moves)."""
        dfd = self._open_rank_dir(job_id)
        if dfd is None:
            raise RemoteError("not_found", f"rank {rank} of job {job_id} does not run under rankwrap here "
                                           f"(no {marker.parent}); it cannot be snapshotted")
        try:
            rec = self._read_record(dfd, job_id, rank)
            # "pid": the root of the tree to dump (the PID namespace's init that the plugin
            # made, or the rank itself when it is PID 1); "rank_pid": the rank, the init's child.
            pid, wrapper = rec.get("pid"), rec.get("wrapper_pid")
            rank_pid = rec.get("rank_pid", pid)
            act.fields["pid"] = pid
            if rec.get("node") not in (None, self.node):
                raise RemoteError("not_found", f"rank {rank} of job {job_id} (pid {pid}) does not run on {self.node}")
            # Slurm's and the kernel's word, not the record's: the wrapper is the job's,
            # the tree's root its child, the rank the root's child (or the root itself);
            # all in tpassd's own namespaces.
            view = self._job_view(job_id, act)
            with self._pin(job_id, wrapper, dump=True, view=view) as w, \
                    self._pin(job_id, pid, parent=wrapper, dump=True, view=view) as p:
                if rank_pid == pid:
                    return self._dump_pinned(job_id, rank, generation, marker, dfd, p, w, p, view[1], snapshot, keep)
                with self._pin(job_id, rank_pid, parent=pid, dump=True, view=view) as r:
                    return self._dump_pinned(job_id, rank, generation, marker, dfd, p, w, r, view[1], snapshot, keep)
        finally:
            os.close(dfd)

    def _dump_pinned(self, job_id: int, rank: int, generation: int, marker: Path, dfd: int,
                     p: procs.Pinned, w: procs.Pinned, r: procs.Pinned, owner: int,
                     snapshot: str | None = None, keep: int = 1) -> dict[str, Any]:
        pid = r.pid  # the rank: its GPU state, its stdout/stderr
        try:
            c = criu_mod.find_criu(self.criu_binary)
        except TorchpassError as exc:
            raise RemoteError("unavailable", str(exc)) from None
        estimate = self.image_estimate
        if snapshot is None:
            images = layout.images_dir(self.snapshot_dir, job_id, rank, generation)
            criu_mod.make_private_dir(layout.snapshot_job_dir(self.snapshot_dir, job_id))
        else:
            images = layout.snapshot_images_dir(self.snapshot_dir, job_id, snapshot, rank)
            criu_mod.make_private_dir(images.parent)
            # A snapshot must not take the disk below tpassd's own free-space rule (the node would
            # turn degraded and its ranks would be moved away): it needs the image plus that reserve.
            estimate = lambda pid_: self.image_estimate(pid_) + self.keep_free_bytes  # noqa: E731
            marker = None
        who = f"rank {rank}"
        if snapshot is not None:
            # The quota is checked again, exactly, at the commit; here, before anything is written, a
            # rank that alone would take its owner past it (its tree's resident memory, the image's
            # usual size) is refused, so that an owner over quota does not fill the shared directory.
            self._check_quota(owner, job_id, snapshot, self.image_estimate(p.pid), keep, part=rank)
        # A full image disk refuses the move before the rank is touched (no marker, no CUDA).
        criu_mod.check_space(who, self.snapshot_dir, estimate(p.pid))
        # Every process of the tree that holds GPU state: the rank itself, or under torchrun the
        # agent's workers (the agent is the task's main process and holds none).
        holders = self._gpu_holders(p.pid)
        gpu = bool(holders)
        cuda = None
        if gpu:
            try:
                cuda = (self.cuda_loader or CudaCheckpoint.load)()
            except TorchpassError as exc:
                raise RemoteError("unavailable", f"rank {rank} of job {job_id} holds GPU state but this node "
                                                 f"cannot checkpoint CUDA: {exc}") from None
        t0 = time.monotonic()
        if marker is not None:
            self._write(dfd, marker, "moving\n")
        suspended: list[int] = []
        try:
            if not (p.alive() and w.alive() and r.alive()):
                raise CheckpointError(f"rank {rank} of job {job_id} (pid {pid}) exited before its dump")
            if cuda is not None:
                # The runtime destroyed its NCCL communicators at the pause; the driver
                # now moves the GPU state into host memory so CRIU dumps it with the rest.
                for q in holders:
                    suspended.append(q)  # before the call: a suspend that failed half way is resumed too
                    cuda.suspend(q)
            entered = procs.foreign_namespaces(w.pid, self.proc, procs.ENTERED_NAMESPACES)
            # An ordinary user's tree is dumped with the user's ids (criu_mod.owner_creds says why).
            creds = criu_mod.owner_creds(p.pid, self.proc) if owner != 0 else None
            res = criu_mod.dump(c, p.pid, images, timeout_s=self.dump_timeout_s, net_of=w.pid if entered else None,
                                fds_of=pid, creds=creds, who=who, space_root=self.snapshot_dir,
                                estimate=estimate,
                                meta={"job": job_id, "rank": rank, "generation": generation, "node": self.node,
                                      "gpu": gpu, "init": p.pid != pid, "uid": owner,
                                      # their pids as the restore gives them back (the task's PID namespace)
                                      **({"gpu_pids": [procs.ns_pid(q, self.proc) for q in holders]} if gpu else {}),
                                      **({"snapshot": snapshot} if snapshot else {})})
        except BaseException as exc:
            # Aborted (criu failed, timed out, the disk filled, the suspend failed half way):
            # the GPU state goes back first, and only then does the marker call the move
            # off, so nothing resumes the rank while CUDA still holds it locked.
            stuck = self._resume_cuda(cuda, job_id, rank, suspended)
            if marker is not None:
                self._write(dfd, marker, "abort\n")
            if stuck and isinstance(exc, TorchpassError):
                raise CheckpointError(f"{exc}; and rank {rank}'s CUDA state was not given back ({stuck}): it "
                                      "cannot resume, cancel the job") from None
            raise
        # The source copy stays alive (held) until the move commits: give it its GPU
        # state back, so that a later rollback can resume it in place.
        cuda_error = self._resume_cuda(cuda, job_id, rank, suspended)
        if marker is not None:
            self._write(dfd, marker, "moved\n")
        out = {"images": str(res.images), "checksum": checksum_of(read_manifest_bytes(res.images)),
               "bytes": res.bytes, "criu_dump_s": round(res.seconds, 4), "total_s": round(time.monotonic() - t0, 4),
               "pid": p.pid, "wrapper_pid": w.pid, "node": self.node}
        if cuda_error:
            out["cuda_resume_error"] = cuda_error
        log.info("rank dumped (left running)", job_id=job_id, rank=rank, images=out["images"],
                 mb=round(res.bytes / 1e6, 1), dump_s=out["criu_dump_s"])
        return out

    def _gpu_holders(self, root: int) -> list[int]:
        """The processes of ``root``'s tree that hold GPU state, parents first."""
        return [q for q in criu_mod.tree_pids(root, self.proc) if self.gpu_in_use(q)]

    @staticmethod
    def _resume_cuda(cuda: Any, job_id: int, rank: int, pids: list[int]) -> str | None:
        """Restore and unlock each process's CUDA state, whatever state a suspend left it in; the
        errors, if any (every process is tried: one that failed does not keep the others locked)."""
        errors = []
        for pid in pids:
            try:
                cuda.resume(pid)
            except CheckpointError as exc:
                log.error("CUDA state of the source copy not resumed", job_id=job_id, rank=rank, pid=pid,
                          error=str(exc))
                errors.append(str(exc))
        return "; ".join(errors) or None

    def _pin_unless_gone(self, job_id: int, pid: int, *, parent: int | None = None, act: Audit | None = None
                         ) -> procs.Pinned | None:
        """The checked, pinned process; None if it is gone (RemoteError if it is not the job's).
        ``act``: the request, with what it asked Slurm already."""
        if not Path(f"{self.proc}/{pid}").exists():
            return None
        try:
            return self._pin(job_id, pid, parent=parent, act=act)
        except RemoteError as exc:
            if exc.code == "not_found":  # it died since
                return None
            raise

    def _tree_identities(self, pid: int) -> list[tuple[int, int]]:
        """(pid, start time) of every process of the tree rooted at ``pid`` now (those still there)."""
        out = []
        for p in criu_mod.tree_pids(pid, self.proc):
            try:
                out.append((p, procs.read_stat(p, self.proc).start))
            except (OSError, ValueError, IndexError):
                continue
        return out

    @staticmethod
    def _kill_targets(b: dict[str, Any]) -> list[tuple[int, int]]:
        """(rank, pid) of every source copy an op=kill names: ``rank``/``pid``, then ``tasks``."""
        pid, more = b.get("pid"), b.get("tasks") or []
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
            raise RemoteError("bad_request", "op kill needs the source copy's pid")
        if (not isinstance(more, list) or len(more) > MAX_KILL_TASKS
                or not all(isinstance(t, list) and len(t) == 2
                           and all(isinstance(x, int) and not isinstance(x, bool) for x in t)
                           and t[0] >= 0 and t[1] > 1 for t in more)):
            raise RemoteError("bad_request", f"op kill: tasks must be a list of at most {MAX_KILL_TASKS} "
                                             "[rank, pid] pairs of the node's other source copies")
        copies = [(b["rank"], pid), *((r, p) for r, p in more)]
        if len({r for r, _ in copies}) != len(copies) or len({p for _, p in copies}) != len(copies):
            raise RemoteError("bad_request", "op kill names a rank or a pid twice")
        return copies

    def _kill_pinned(self, job_id: int, rank: int, pid: int, pinned: procs.Pinned | None) -> dict[str, Any]:
        return self._kill_all_pinned(job_id, [(rank, pid, pinned)])[0]

    def _kill_all_pinned(self, job_id: int, copies: list[tuple[int, int, procs.Pinned | None]]
                         ) -> list[dict[str, Any]]:
        """SIGKILL every pinned source copy at once, then wait until none can run its own code
        (one wait for all: a node's 8 tasks cost one kill's time, not 8). Closes the pins."""
        out = {r: {"node": self.node, "rank": r, "pid": pid, "killed": False} for r, pid, _ in copies}
        dying: list[tuple[int, int, procs.Pinned, list[tuple[int, int]]]] = []
        try:
            for r, pid, pinned in copies:
                if pinned is None:
                    continue
                before = self._tree_identities(pid)
                if pinned.kill(signal.SIGKILL):
                    dying.append((r, pid, pinned, before))
                    out[r]["killed"] = True
            # Done once no process of a tree can run its own code again: the tree's root is a PID
            # namespace's init, whose death kills every process in the namespace. The kernel then
            # frees their memory, which took 55-120 ms for a 2.2 GB rank here (and grows with it:
            # seconds on a GPU node) while every rank of the job stood still waiting for this reply;
            # nothing needs it to have finished (the source node is drained next).
            deadline = time.monotonic() + 5.0
            while dying and time.monotonic() < deadline:
                dying = [d for d in dying if not self._tree_dead(d[1], d[2], d[3])]
                if dying:
                    time.sleep(0.002)  # every rank stands still until this reply
        finally:
            for _, _, pinned in copies:
                if pinned is not None:
                    pinned.close()
        for r, pid, _ in copies:
            if out[r]["killed"]:
                log.info("source copy killed", job_id=job_id, rank=r, pid=pid)
        return [out[r] for r, _, _ in copies]

    def _tree_dead(self, pid: int, pinned: procs.Pinned, before: list[tuple[int, int]]) -> bool:
        """True once no process of the killed tree rooted at ``pid`` can run its own code."""
        if not pinned.alive():
            return True
        try:  # a zombie awaiting its wrapper counts as gone
            if procs.read_stat(pid, self.proc).state == "Z":
                return True
        except (OSError, ValueError, IndexError):
            return True
        return (all(procs.dying(p, start, self.proc) for p, start in before)
                and all(procs.dying(p, None, self.proc) for p in criu_mod.tree_pids(pid, self.proc)))

    def _corrupt_for_drill(self, images: Path, dfd: int, manifest: dict[str, Any]) -> None:
        """The restore-fail drill: flip one byte in the middle of the largest image file.

        Done after the verify passed (it checks sizes and the manifest, not every
        file's SHA-256), so the coordinator goes on to the restore, whose full
        check (run while CRIU restores) refuses the image and kills the restored copy
        before it may run: the real failed-restore path.
        """
        files = {n: f.get("size", 0) for n, f in manifest.get("files", {}).items() if f.get("size", 0) > 0}
        if not files:
            log.warning("restore-fail drill: snapshot has no image data to corrupt", images=str(images))
            return
        name = max(files, key=lambda n: (files[n], n))
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:
            off = files[name] // 2
            b = os.pread(fd, 1, off)
            os.pwrite(fd, bytes([b[0] ^ 0xFF]), off)
        finally:
            os.close(fd)
        log.warning("fault drill restore-fail: corrupted a verified snapshot; its restore will fail",
                    images=str(images), file=name, offset=off)

    # -- whole-job snapshots (tpassctl snapshot; issue 12) ------------------------------------
    # op "snap":    dump the held rank into SNAPSHOT_DIR/snapshots/jobJ/ID/rankR (no hand-off marker)
    # op "commit":  (rank 0's tpassd) verify every rank's images, write the job manifest
    #               STATE_DIR/jobs/J/snapshots/ID.json (root's, group the owner's, 0640), keep the newest `keep`
    # op "discard": remove this snapshot_dir's part of a snapshot that failed (no manifest was written)
    # op "delete":  remove a committed snapshot (its images on every node's snapshot_dir, then its manifest)
    def _job_snapshot(self, b: dict[str, Any], op: str, act: Audit) -> dict[str, Any]:
        job_id, snap = b["job_id"], b.get("snapshot")
        if not isinstance(snap, str) or not layout.valid_snapshot_id(snap):
            raise RemoteError("bad_request", f"op {op} needs a snapshot id (letters, digits, '-', '_'); got {snap!r}")
        act.fields["snapshot"] = snap
        if op == "snap":
            marker = layout.handoff(self.rank_dir(job_id), job_id, b["rank"])  # named in errors only: never written
            out = self._dump(job_id, b["rank"], int(b.get("generation") or 0), marker, act, snapshot=snap,
                             keep=_keep(b))
            return {**out, "snapshot": snap}
        if op == "commit":
            return self._commit(job_id, snap, b, act.owner)
        if op == "discard":
            if self.state_dir is not None and layout.snapshot_manifest(self.state_dir, job_id, snap).exists():
                raise RemoteError("conflict", f"snapshot {snap} of job {job_id} is complete (it has a manifest); "
                                              "delete it instead (tpassctl snapshots JOBID --delete ID)")
            return {"node": self.node, "snapshot": snap,
                    "discarded_mb": round(self._remove_snapshot_images(self.snapshot_dir, job_id, snap) / 1e6, 1)}
        return self._delete_snapshot(job_id, snap)

    def _snapshot_part(self, job_id: int, snap: str, part: Any) -> dict[str, Any]:
        """One rank's part, checked: its images are that rank's of this snapshot under root-owned
        directories, its root-written manifest matches the checksum; the sizes are the manifest's."""
        if not isinstance(part, dict) or not isinstance(part.get("rank"), int) or isinstance(part["rank"], bool) \
                or not isinstance(part.get("images"), str):
            raise RemoteError("bad_request", f"snapshot {snap}: a part is not {{rank, node, images, checksum}}")
        rank, images = part["rank"], part["images"]
        parsed = layout.parse_snapshot_images_dir(images, job_id, rank) if os.path.isabs(images) else None
        if parsed is None or parsed[1] != snap:
            raise RemoteError("forbidden", f"{images} is not rank {rank}'s directory of snapshot {snap} of job "
                                           f"{job_id}; refused")
        path, dfd = self._open_dir_of(parsed[0], layout.snapshot_images_dir(parsed[0], job_id, snap, rank))
        try:
            manifest, _ = self._check_images(job_id, rank, path, dfd, part.get("checksum"))
        finally:
            os.close(dfd)
        meta = manifest.get("meta") or {}
        if meta.get("rank") != rank or meta.get("snapshot") != snap:
            raise RemoteError("forbidden", f"snapshot {path} is not rank {rank}'s of snapshot {snap}")
        size = sum(int((f or {}).get("size") or 0) for f in manifest["files"].values())
        return {"rank": rank, "node": str(meta.get("node") or part.get("node") or ""), "images": str(path),
                "checksum": part.get("checksum"), "bytes": size}

    def _open_dir_of(self, root: Path, path: Path) -> tuple[Path, int]:
        """A directory fd for ``path`` under this tpassd's snapshot_dir (walked without following a
        symlink) or under a directory tree owned by root alone (another node's snapshot_dir)."""
        try:
            if root == self.snapshot_dir:
                return path, safeio.open_dir(self.snapshot_dir, path.relative_to(self.snapshot_dir).parts)
            return path, safeio.open_root_owned_dir(path)
        except FileNotFoundError:
            raise RemoteError("failed", f"{self.node} cannot read snapshot {path} (it does not exist)") from None
        except OSError as exc:
            raise RemoteError("forbidden", f"snapshot {path}: {exc}") from None

    def _manifests_dir(self, job_id: int, create_for: int | None = None) -> int | None:
        """STATE_DIR/jobs/J/snapshots, root's with the owner's group (made for uid ``create_for``
        when missing); None when absent. A directory there that root does not own is refused."""
        if self.state_dir is None:
            raise RemoteError("unavailable", f"tpassd on {self.node} has no state_dir: it cannot keep job manifests")
        parts = layout.snapshot_manifests_dir(self.state_dir, job_id).relative_to(self.state_dir).parts
        try:
            jfd = safeio.open_dir(self.state_dir, parts[:-1])
        except FileNotFoundError:
            if create_for is None:
                return None
            raise RemoteError("failed", f"job {job_id} has no state directory on {self.node}") from None
        except OSError as exc:
            raise RemoteError("forbidden", f"job {job_id}'s state directory: {exc}") from None
        try:
            if create_for is not None:
                try:
                    os.mkdir(parts[-1], 0o750, dir_fd=jfd)
                except FileExistsError:
                    pass
            try:
                fd = os.open(parts[-1], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=jfd)
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise RemoteError("forbidden", f"job {job_id}'s snapshot manifests: {exc}") from None
            st = os.fstat(fd)
            if st.st_uid != 0:
                os.close(fd)
                raise RemoteError("forbidden", f"{layout.snapshot_manifests_dir(self.state_dir, job_id)} is not "
                                               "root's (someone else made it); remove it")
            if create_for is not None:
                self._share_with_owner(fd, create_for, directory=True)
            return fd
        finally:
            os.close(jfd)

    def _share_with_owner(self, fd: int, uid: int, *, directory: bool) -> None:
        """The manifests (and their directory) are readable by the job's owner only: a group reads
        them only when it is the owner's private group."""
        why = jobdir.share_with_owner(fd, uid, self.owner_gid(uid), directory=directory)
        if why:
            log.warning("a job manifest its owner cannot read", uid=uid, why=why)

    def _commit(self, job_id: int, snap: str, b: dict[str, Any], owner: int | None = None) -> dict[str, Any]:
        owner = self.owner_of(job_id) if owner is None else owner
        parts = b.get("parts")
        if not isinstance(parts, list) or not parts:
            raise RemoteError("bad_request", f"commit of snapshot {snap}: no parts")
        checked = sorted((self._snapshot_part(job_id, snap, p) for p in parts), key=lambda p: p["rank"])
        if len({p["rank"] for p in checked}) != len(checked):
            raise RemoteError("bad_request", f"commit of snapshot {snap}: a rank is named twice")
        keep = _keep(b)
        self._check_quota(owner, job_id, snap, sum(p["bytes"] for p in checked), keep)
        manifest = job_manifest.build(job_id=job_id, snapshot=snap, uid=owner, created=self.wall(),
                                      step=b.get("step"), generation=b.get("generation"),
                                      collectives=b.get("collectives"), parts=checked, written_by=self.node)
        dfd = self._manifests_dir(job_id, create_for=owner)
        assert dfd is not None
        try:
            name = layout.snapshot_manifest(".", job_id, snap).name
            safeio.write_at(dfd, name, job_manifest.encode(manifest), mode=0o600)
            mfd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            try:
                self._share_with_owner(mfd, owner, directory=False)
            finally:
                os.close(mfd)
            self._write_record(job_id, snap, manifest)
            removed = self._retain(job_id, dfd, keep, snap)
        finally:
            os.close(dfd)
        path = layout.snapshot_manifest(self.state_dir, job_id, snap)
        log.info("job snapshot committed", job_id=job_id, snapshot=snap, mb=round(manifest["bytes"] / 1e6, 1),
                 manifest=str(path), removed=removed)
        return {"node": self.node, "snapshot": snap, "manifest": str(path), "bytes": manifest["bytes"],
                "removed": removed}

    # -- the root-only records of committed snapshots ------------------------------------
    # STATE_DIR/jobs/J belongs to the job's owner, who may rename jobs/J/snapshots and so hide their
    # snapshots from the quota and the expiry. The committing tpassd also keeps a copy of each job
    # manifest in SNAPSHOT_DIR/snapshots/jobJ/ID.json (root's alone, beside the images); the quota and
    # the expiry count those, and the manifests in STATE_DIR only where no copy exists (older commits).
    def _records_dir(self, job_id: int, create: bool = False) -> int | None:
        parts = layout.snapshot_tree(self.snapshot_dir, job_id).relative_to(self.snapshot_dir).parts
        try:
            if create:
                base = safeio.open_dir(self.snapshot_dir, ())
                try:
                    for i, part in enumerate(parts):
                        try:
                            os.mkdir(part, 0o700, dir_fd=base)
                        except FileExistsError:
                            pass
                        nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=base)
                        os.close(base)
                        base = nxt
                    return base
                except BaseException:
                    os.close(base)
                    raise
            return safeio.open_dir(self.snapshot_dir, parts)
        except FileNotFoundError:
            return None

    def _write_record(self, job_id: int, snap: str, manifest: dict[str, Any]) -> None:
        dfd = self._records_dir(job_id, create=True)
        try:
            safeio.write_at(dfd, layout.snapshot_manifest(".", job_id, snap).name, job_manifest.encode(manifest),
                            mode=0o600)
        finally:
            os.close(dfd)

    def _remove_record(self, job_id: int, snap: str) -> None:
        try:
            dfd = self._records_dir(job_id)
        except OSError:
            return
        if dfd is None:
            return
        try:
            os.unlink(layout.snapshot_manifest(".", job_id, snap).name, dir_fd=dfd)
        except FileNotFoundError:
            pass
        finally:
            os.close(dfd)
        try:  # the job's tree, once nothing of it is left
            os.rmdir(layout.snapshot_tree(self.snapshot_dir, job_id))
        except OSError:
            pass

    def _each_jobs_records(self) -> dict[int, list[dict[str, Any]]]:
        """The root-only records under this tpassd's SNAPSHOT_DIR/snapshots, job by job."""
        top = Path(self.snapshot_dir) / layout.SNAPSHOTS
        try:
            names = os.listdir(top)
        except OSError:
            return {}
        out: dict[int, list[dict[str, Any]]] = {}
        for name in names:
            m = re.fullmatch(r"job([0-9]{1,12})", name)
            if m is None:
                continue
            job_id = int(m.group(1))
            try:
                dfd = self._records_dir(job_id)
            except OSError:
                continue
            if dfd is None:
                continue
            try:
                found = job_manifest.read_all(dfd, job_id)
            except OSError:
                continue
            finally:
                os.close(dfd)
            if found:
                out[job_id] = found
        return out

    def _each_jobs_manifests(self) -> list[tuple[int, list[dict[str, Any]]]]:
        """Every job's complete snapshots, job by job: the root-only records in SNAPSHOT_DIR, and the
        root-written manifests under STATE_DIR that have no record (committed before the records)."""
        records = self._each_jobs_records()
        merged = {j: list(found) for j, found in records.items()}
        for job_id, found in self._each_state_dir_manifests():
            have = {m["snapshot"] for m in merged.get(job_id, [])}
            extra = [m for m in found if m["snapshot"] not in have]
            if extra:
                merged[job_id] = sorted(merged.get(job_id, []) + extra,
                                        key=lambda m: (float(m.get("created") or 0), str(m["snapshot"])))
        return sorted(merged.items())

    def _each_state_dir_manifests(self) -> list[tuple[int, list[dict[str, Any]]]]:
        """Every job's complete snapshots under STATE_DIR (root-written manifests only), job by job."""
        if self.state_dir is None:
            return []
        try:
            names = os.listdir(layout.jobs_dir(self.state_dir))
        except OSError:
            return []
        out = []
        for name in names:
            if not _JOB_ID.fullmatch(name):
                continue
            job_id = int(name)
            try:
                dfd = self._manifests_dir(job_id)
            except RemoteError:
                continue  # not root's: nothing of a complete snapshot there
            if dfd is None:
                continue
            try:
                out.append((job_id, job_manifest.read_all(dfd, job_id)))
            finally:
                os.close(dfd)
        return out

    def _check_quota(self, owner: int, job_id: int, snap: str, new_bytes: int, keep: int,
                     part: int | None = None) -> None:
        """Refuse the commit (RemoteError conflict: the coordinator then discards the images) when the
        owner's complete snapshots, with this one in and the job's oldest gone by retention, would
        exceed snapshot_quota_bytes. ``part``: a rank's dump, before it is written (``new_bytes``: its
        estimate, the rank alone)."""
        if self.snapshot_quota_bytes <= 0:
            return
        used = 0
        for jid, found in self._each_jobs_manifests():
            mine = [m for m in found if m.get("uid") == owner and m.get("snapshot") != snap]
            if jid == job_id:  # _retain keeps the newest `keep`, this one among them
                mine = mine[max(0, len(mine) + 1 - keep):]
            used += sum(int(m.get("bytes") or 0) for m in mine)
        if used + new_bytes > self.snapshot_quota_bytes:
            what = (f"snapshot {snap} of job {job_id}" if part is None
                    else f"rank {part} alone of snapshot {snap} of job {job_id} (estimated)")
            raise RemoteError("conflict", f"{what} ({new_bytes / 1e9:.2f} GB) would bring "
                                          f"uid {owner}'s snapshots to {(used + new_bytes) / 1e9:.2f} GB, over this "
                                          f"cluster's quota of {self.snapshot_quota_bytes / 1e9:g} GB per user "
                                          "(tpassd snapshot_quota_gb); delete older ones (tpassctl snapshots "
                                          "JOBID --delete ID) or ask your administrator")

    def expire_snapshots(self) -> list[str]:
        """Remove the complete snapshots this tpassd committed that are older than snapshot_max_age_s
        (tpassd's sweep calls it); "JOB/ID" of each removed. One tpassd per snapshot: its writer."""
        if self.snapshot_max_age_s <= 0:
            return []
        cutoff = self.wall() - self.snapshot_max_age_s
        gone = []
        for job_id, found in self._each_jobs_manifests():
            old = [m for m in found if m.get("written_by") == self.node and float(m.get("created") or 0) < cutoff]
            if not old:
                continue
            try:  # one job's trouble must not stop the others' expiry
                try:
                    dfd = self._manifests_dir(job_id)
                except RemoteError:
                    dfd = None  # not root's any more: the record and the images still go
                try:
                    for m in old:
                        self._remove_snapshot(job_id, m, dfd)
                        gone.append(f"{job_id}/{m['snapshot']}")
                finally:
                    if dfd is not None:
                        os.close(dfd)
            except Exception as exc:  # noqa: BLE001
                log.exception("expiry of one job's snapshots failed; the others go on", job_id=job_id,
                              error=str(exc))
        if gone:
            log.info("expired snapshots removed", snapshots=gone, max_age_h=round(self.snapshot_max_age_s / 3600, 2))
        return gone

    def _retain(self, job_id: int, dfd: int, keep: int, newest: str) -> list[str]:
        """Remove all but the newest ``keep`` complete snapshots of the job (oldest first); their ids."""
        found = job_manifest.read_all(dfd, job_id)
        old = [m for m in found if m["snapshot"] != newest][:max(0, len(found) - keep)]
        for m in old:
            self._remove_snapshot(job_id, m, dfd)
        return [m["snapshot"] for m in old]

    def _remove_snapshot(self, job_id: int, manifest: dict[str, Any], dfd: int | None) -> int:
        """Remove one committed snapshot: every rank's images (each where the manifest says, checked
        against the layout), then the manifest itself. Bytes freed."""
        snap = manifest["snapshot"]
        freed = 0
        roots = set()
        for part in manifest.get("ranks") or []:
            parsed = layout.parse_snapshot_images_dir(str(part.get("images", "")), job_id, part.get("rank"))
            if parsed is not None and parsed[1] == snap:
                roots.add(parsed[0])
        for root in sorted(roots):
            freed += self._remove_snapshot_images(root, job_id, snap)
        self._remove_record(job_id, snap)
        if dfd is not None:
            try:
                os.unlink(layout.snapshot_manifest(".", job_id, snap).name, dir_fd=dfd)
            except FileNotFoundError:
                pass
        log.info("job snapshot removed", job_id=job_id, snapshot=snap, mb=round(freed / 1e6, 1))
        return freed

    def _remove_snapshot_images(self, root: Path, job_id: int, snap: str) -> int:
        """Remove ROOT/snapshots/jobJ/ID (root-owned trees only: never through a user's directory)."""
        d = layout.snapshot_tree(root, job_id) / snap
        try:
            fd = safeio.open_dir(self.snapshot_dir, d.relative_to(self.snapshot_dir).parts) \
                if root == self.snapshot_dir else safeio.open_root_owned_dir(d)
        except (OSError, ValueError):
            return 0  # not there (or not root's): nothing of ours to remove
        os.close(fd)
        freed = sum(f.stat().st_size for f in d.rglob("*") if f.is_file() and not f.is_symlink())
        shutil.rmtree(d, ignore_errors=True)
        for parent in (d.parent, d.parent.parent):
            try:
                parent.rmdir()  # only when empty
            except OSError:
                break
        return freed

    def _delete_snapshot(self, job_id: int, snap: str) -> dict[str, Any]:
        dfd = self._manifests_dir(job_id)
        if dfd is None:
            raise RemoteError("not_found", f"job {job_id} has no snapshots")
        try:
            found = {m["snapshot"]: m for m in job_manifest.read_all(dfd, job_id)}
            if snap not in found:
                have = ", ".join(found) or "none"
                raise RemoteError("not_found", f"job {job_id} has no snapshot {snap} (its snapshots: {have})")
            freed = self._remove_snapshot(job_id, found[snap], dfd)
        finally:
            os.close(dfd)
        return {"node": self.node, "snapshot": snap, "deleted": True, "freed_mb": round(freed / 1e6, 1)}

    def authorize_snapshot(self, ident: auth.Identity, job_id: int, op: str) -> int | None:
        """Root or the job's owner; for op delete also the owner a job manifest records (root wrote
        it), so that a snapshot can be deleted after Slurm forgot the job. Returns the owner when
        Slurm was asked, as ``authorize``."""
        if ident.uid == 0:
            return None
        if op == "delete" and self.state_dir is not None:
            dfd = self._manifests_dir(job_id)
            if dfd is not None:
                try:
                    uids = {m.get("uid") for m in job_manifest.read_all(dfd, job_id)}
                finally:
                    os.close(dfd)
                if uids and uids <= {ident.uid}:
                    return None  # the manifests' word, not Slurm's: nothing is pinned on it
                if uids:
                    raise auth.AuthFailure("forbidden", f"uid {ident.uid} does not own job {job_id}'s snapshots")
        return self.authorize(ident, job_id)

    # -- tpassd.restore ----------------------------------------------------------
    def restore(self, msg: wire.Message, ident: auth.Identity) -> dict[str, Any]:
        return self._audited("restore", self._restore, msg, ident)

    def _restore(self, b: dict[str, Any], act: Audit) -> dict[str, Any]:
        job_id, rank, op = b["job_id"], b["rank"], b["op"]
        if op == "prepare":
            return self._prepare(b, act)
        if op in ("verify", "abort") and not isinstance(b.get("images"), str):
            raise RemoteError("bad_request", f"op {op} of tpassd.restore needs images (a path)")
        if op == "verify":
            images, dfd = self._open_images(job_id, rank, b["images"])
            try:
                return self._verify(job_id, rank, images, dfd, b.get("checksum"))
            finally:
                os.close(dfd)
        if op == "abort":
            self._check_rank_dir(b, job_id)
            if layout.parse_images_dir(b["images"], job_id, rank) is None:
                raise RemoteError("forbidden", f"{b['images']} is not a snapshot directory of rank {rank} of job "
                                               f"{job_id}; refused")
            return self._abort_restored(job_id, rank, b["images"], act)
        raise RemoteError("bad_request", f"unknown op {op!r} for tpassd.restore; allowed: verify, abort, prepare")

    @staticmethod
    def _count(b: dict[str, Any], key: str, required: bool) -> int | None:
        v = b.get(key)
        if v is None and not required:
            return None
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2 ** 32 - 1:
            raise RemoteError("bad_request", f"op prepare: {key} must be a non-negative integer, got {v!r}")
        return v

    def _prepare(self, b: dict[str, Any], act: Audit) -> dict[str, Any]:
        """op=prepare: write the token that lets the SPANK plugin on this node start the root restore
        agent for one restore (torchpass.checkpoint.restore_token). The requester owns the job (or is
        root: _audited asked Slurm); a companion allocation the step runs in has the same owner; a
        snapshot restore names a committed snapshot of the job (its manifest root's, of that owner)."""
        job_id, rank, kind = b["job_id"], b["rank"], b.get("kind")
        if kind not in layout.TOKEN_KINDS:
            raise RemoteError("bad_request", f"op prepare: kind {kind!r} is not one of {', '.join(layout.TOKEN_KINDS)}")
        act.fields["kind"] = kind
        owner = act.owner if act.owner is not None else self.owner_of(job_id)
        alloc = self._count(b, "alloc", False)
        alloc = job_id if alloc is None else alloc
        if alloc != job_id and self.owner_of(alloc) != owner:
            raise RemoteError("forbidden", f"job {alloc} is not of job {job_id}'s owner (uid {owner}); no restore "
                                           f"of job {job_id} runs in it")
        step = self._count(b, "step", False)
        generation, snap = None, None
        if kind == "migration":
            generation = self._count(b, "generation", True)
            act.fields["generation"] = generation
        else:
            snap = b.get("snapshot")
            if not isinstance(snap, str) or not layout.valid_snapshot_id(snap):
                raise RemoteError("bad_request", f"op prepare: a {kind} restore needs a snapshot id, got {snap!r}")
            act.fields["snapshot"] = snap
            dfd = self._manifests_dir(job_id)
            if dfd is None:
                raise RemoteError("not_found", f"job {job_id} has no snapshots; nothing to restore")
            try:
                found = {m["snapshot"]: m for m in job_manifest.read_all(dfd, job_id)}
            finally:
                os.close(dfd)
            if snap not in found:
                raise RemoteError("not_found", f"job {job_id} has no committed snapshot {snap}; nothing to restore")
            if found[snap].get("uid") != owner:
                raise RemoteError("forbidden", f"snapshot {snap} of job {job_id} is of uid {found[snap].get('uid')}, "
                                               f"not of the job's owner (uid {owner}); refused")
        try:
            path = restore_token.write_token(self.restore_tokens, self.node, kind=kind, job=job_id, alloc=alloc,
                                             uid=owner, rank=rank, generation=generation, snapshot=snap,
                                             step=step if kind == "stopped" else None, now=self.wall(),
                                             owner=self.token_owner)
        except (OSError, ValueError) as exc:
            raise RemoteError("failed", f"{self.node} cannot write the restore token: {exc}") from None
        return {"node": self.node, "kind": kind, "token": path.name, "ttl_s": layout.RESTORE_TOKEN_TTL_S}

    def _verify(self, job_id: int, rank: int, images: Path, dfd: int, want: str | None) -> dict[str, Any]:
        manifest, files = self._check_images(job_id, rank, images, dfd, want)
        if self.restore_fault():
            self._corrupt_for_drill(images, dfd, manifest)
        return {"node": self.node, "rank": rank, "files": len(files)}

    def _check_images(self, job_id: int, rank: int, images: Path, dfd: int, want: str | None
                      ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(manifest, its files) of the images in ``dfd``: readable, matching ``want``, every file there
        at its recorded size, the job's; RemoteError otherwise."""
        try:
            raw = read_manifest_bytes(images, dir_fd=dfd)
            manifest = json.loads(raw)
            files = manifest["files"]
            if not isinstance(files, dict):
                raise ValueError("its files are not a mapping")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise RemoteError("failed", f"{self.node} cannot read snapshot {images} ({exc})") from None
        if want and checksum_of(raw) != want:
            raise RemoteError("failed", f"snapshot {images} on {self.node} does not match its checksum")
        for n, f in files.items():
            try:
                st = os.stat(n, dir_fd=dfd, follow_symlinks=False) if "/" not in n else None
            except OSError:
                st = None
            if st is None or not stat.S_ISREG(st.st_mode) or st.st_size != (f or {}).get("size"):
                raise RemoteError("failed", f"snapshot {images} on {self.node}: {n} missing or incomplete")
        if (manifest.get("meta") or {}).get("job") != job_id:
            raise RemoteError("forbidden", f"snapshot {images} is not one of job {job_id}")
        return manifest, files

    def _abort_restored(self, job_id: int, rank: int, images: str, act: Audit) -> dict[str, Any]:
        nothing = {"node": self.node, "rank": rank, "killed": False}
        dfd = self._open_rank_dir(job_id)
        if dfd is None:
            return nothing
        try:
            try:
                rec = self._read_record(dfd, job_id, rank)
            except RemoteError:
                return nothing
            if rec.get("restored_from") != images or rec.get("node") != self.node:
                return nothing
            pid, wrapper = rec.get("pid"), rec.get("wrapper_pid")
            act.fields["pid"] = pid
            if not isinstance(pid, int) or not isinstance(wrapper, int):
                raise RemoteError("forbidden", f"rank {rank} of job {job_id}: its rank record names no pids")
            # The rank is the copy this move started from again: put its record back
            # *before* the kill, so that the aborted copy's wrapper, when its rank dies,
            # sees it is no longer the rank and writes no exit code (the rank's first
            # task wrapper would report that 137 to srun), and a later move finds the
            # rank where it runs. No saved record (a wrapper older than "previous"):
            # the record says the copy was aborted, which the wrapper also honours.
            # The pid is checked first (the job's, the wrapper's child); a copy already
            # gone is no reason to leave the record naming it.
            pinned = self._pin_unless_gone(job_id, pid, parent=wrapper, act=act)
            prev = rec.get("previous")
            restored_prev = isinstance(prev, dict) and prev.get("wrapper_pid")
            record = layout.rank_record(self.rank_dir(job_id), job_id, rank)
            try:
                self._write(dfd, record, json.dumps(prev if restored_prev else {**rec, "aborted": True}))
            except BaseException:
                if pinned is not None:
                    pinned.close()
                raise
            out = self._kill_pinned(job_id, rank, pid, pinned)
            out["record"] = "previous" if restored_prev else "aborted"
            log.info("restored copy aborted; rank record back to the copy the move started from",
                     job_id=job_id, rank=rank, images=images, record_now=out["record"],
                     node_now=(prev or {}).get("node") if isinstance(prev, dict) else None)
            return out
        finally:
            os.close(dfd)


__all__ = ["CheckpointService", "JOB_SNAPSHOT_OPS", "maps_nvidia_device"]
