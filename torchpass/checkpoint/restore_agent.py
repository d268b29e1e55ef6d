"""The root restore agent: restores a rank with root privileges inside its restore step.

An ordinary user's rank cannot be restored by the user (CRIU restores
credentials, namespaces and a PID 1 with CAP_SYS_ADMIN), and a tree restored
by tpassd would descend from tpassd, outside the restore step, with its exit
status lost. So the SPANK plugin, in the restore step's
``task_init_privileged`` (the coordinator's restore ``srun`` carries
``TORCHPASS_RESTORE_RANK=R``), makes the task a child subreaper and forks
this agent as root: ``tpass-restore-agent --job J --rank R
--task-pid TASK --uid UID --jobs-state-dir STATE_DIR (--generation G |
--snapshot ID)`` with a clean environment and no fd above 2 -- but only
after it took the restore token that tpassd wrote on this node for exactly
this restore (torchpass.checkpoint.restore_token, slurm_spank/token.h):
the token names J, R, UID, the step's job and the images (G, the dump's
generation, for a migration; ID, the whole-job snapshot, for a relaunch or a
stopped job), and the agent refuses a request for any other images
(``allowed_images``). UID (S_JOB_UID) and STATE_DIR come from Slurm and
plugstack.conf; J is the step's job (S_JOB_ID), or the rank's job named by
``TORCHPASS_RESTORE_JOB`` when the step runs in a companion allocation
(its token names both jobs; the snapshot must also be of a job of UID's,
below).

The user-side restore wrapper (``rankwrap.restore_via_agent``, the task)
writes ``rank{R}.restore-req.{AGENTPID}`` into the job's rank directory:
``{"images": PATH, "fds": {"1": N, "2": M}}`` (pipes it holds). The agent
trusts nothing in it that it does not check itself:

* the request is a regular file owned by the job's uid, read capped, the
  rank directory walked from STATE_DIR without following a symlink;
* PATH is ``layout.images_dir(ROOT, J, R, G)`` (a migration's dump) or
  ``layout.snapshot_images_dir(ROOT, J, ID, R)`` (rank R of whole-job snapshot
  ID, in a step relaunched from it) for this job and rank, and
  every directory on it, ``/`` included, is root-owned and writable by
  root alone (``safeio.open_root_owned_dir``): only tpassd can have
  written it;
* the manifest (tpassd's, root's) names this job and rank and the job's
  owner as UID, and the files' SHA-256 match it
  (checked while CRIU restores; a mismatch kills the restored tree before
  it may run);
* N and M must be write ends of anonymous pipes of the task: taken with
  pidfd_getfd on the task's pidfd and checked on the copy the agent holds
  (``task_pipes``), never reopened through ``/proc/TASK/fd/N``;
* the agent moves itself into the task's cgroups (``cgroup_join``: under
  proctrack/cgroup what task_init_privileged forks is not in the step's);

then it runs ``criu restore -d --pidfile ... --inherit-fd ...`` with a
timeout (``criu.RESTORE_TIMEOUT_S``), as the job's owner with criu.RESTORE_CAPS
(never DAC_OVERRIDE, DAC_READ_SEARCH or FOWNER), after every file the image
reopens was walked as the owner and found as dumped (criu_files); the
manifest must name the owner's ids for it (``criu_creds``). The pidfile is
this restore's own, in a root-only node-local directory
(``criu.RESTORE_PID_DIR``), and the pid in it must be a child of the task;
the agent acts on it through a pidfd alone (``pidfds.child_pidfd``), and
reads ``/proc/TASK`` only while the task's pidfd, checked live afterwards,
pins that number. The restored tree keeps the credentials in its image (the
user's uid, gids and groups; tpass-init's
CAP_SYS_ADMIN, the rank none), is reparented to the task (the subreaper),
hence stays in the restore step, and its exit status reaches Slurm through
the task. The result ``rank{R}.restore-res.{AGENTPID}`` (``{"pid", "rank_pid",
"restore_s", "meta"}`` or ``{"error"}``) is written O_EXCL|O_NOFOLLOW and
given to the job's uid. One audit line per request (``audit``): to syslog
(authpriv) where /dev/log exists, else to the step's stderr.

If the task exits first (a cancelled gate: the move was called off), the
agent exits 0.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchpass import __version__, layout
from torchpass.checkpoint import criu as criu_mod
from torchpass.checkpoint import gpu_map, pidfds, safeio
from torchpass.checkpoint.cgroup_join import join_cgroups_of
from torchpass.checkpoint.cuda import gpu_pair_table
from torchpass.checkpoint.manifest import read_manifest
from torchpass.errors import CheckpointError, TorchpassError

# How often the agent looks for its task's request. The whole job stands still from the moment the
# task writes it (the dump is done) until the restored rank runs: at 20 ms the wait added 10 ms on
# average; a poll is one stat.
POLL_S = 0.002
SYSLOG_SOCKET = "/dev/log"
MAX_REQUEST_BYTES = 64 << 10


request_file = layout.restore_request_file
result_file = layout.restore_result_file


class Refused(Exception):
    """A request the agent does not act on (one line: why)."""


def audit(**fields: Any) -> None:
    """One audit line: to syslog (authpriv: root's journal, not the job's output) where the node
    has one, else to the step's stderr (the devcluster's nodes have no /dev/log)."""
    line = "torchpass: restore agent audit " + " ".join(f"{k}={v}" for k, v in fields.items())
    if os.path.exists(SYSLOG_SOCKET):
        import syslog

        syslog.openlog("tpass-restore-agent", syslog.LOG_PID, syslog.LOG_AUTHPRIV)
        syslog.syslog(syslog.LOG_NOTICE, line)
        return
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def wait_request(state_dir: str, job: int, rank: int, uid: int, task_pidfd: int,
                 poll_s: float = POLL_S) -> tuple[int, dict[str, Any]] | None:
    """(rank directory fd, request) once the task wrote it; None when the task ended first. The
    directory, once there, stays open: each poll is then one stat."""
    parts = layout.rank_job_dir(layout.rank_records_dir(state_dir, job), job).relative_to(state_dir).parts
    name = request_file(Path("."), rank, os.getpid()).name
    dfd = -1
    try:
        while pidfds.alive(task_pidfd):
            if dfd < 0:
                try:
                    dfd = safeio.open_dir(state_dir, parts)
                except FileNotFoundError:
                    time.sleep(poll_s)
                    continue
                except OSError as exc:
                    raise Refused(f"job {job}'s rank directory: {exc}") from None
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                time.sleep(poll_s)
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                raise Refused(f"restore request {name} is not a regular file of uid {uid}; refused")
            try:
                req = json.loads(safeio.read_regular(name, MAX_REQUEST_BYTES, dir_fd=dfd, owner=uid))
            except (OSError, ValueError) as exc:
                raise Refused(f"restore request {name}: {exc}") from None
            if not isinstance(req, dict):
                raise Refused(f"restore request {name} is not an object; refused")
            found, dfd = dfd, -1
            return found, req
        return None
    finally:
        if dfd >= 0:
            os.close(dfd)


def check_images(images: Any, job: int, rank: int, uid: int) -> tuple[Path, dict[str, Any]]:
    """The snapshot path and its manifest (files present, sizes right), if it is job/rank's snapshot
    under a root-owned tree, of a job of ``uid``'s (tpassd writes the owner into the manifest);
    Refused otherwise."""
    if not isinstance(images, str) or not os.path.isabs(images):
        raise Refused(f"restore request: images {images!r} is not an absolute path; refused")
    parsed = layout.parse_images_dir(images, job, rank)
    whole = layout.parse_snapshot_images_dir(images, job, rank) if parsed is None else None
    if parsed is not None:
        path = layout.images_dir(parsed[0], job, rank, parsed[1])
    elif whole is not None:  # rank R of whole-job snapshot ID (a step relaunched from it)
        path = layout.snapshot_images_dir(whole[0], job, whole[1], rank)
    else:
        raise Refused(f"{images} is not a snapshot directory of rank {rank} of job {job} "
                      "(SNAPSHOT_DIR/jobJ/rankR.genG or SNAPSHOT_DIR/snapshots/jobJ/ID/rankR); refused")
    try:
        os.close(safeio.open_root_owned_dir(path))
    except OSError as exc:
        raise Refused(f"snapshot {path}: {exc}") from None
    try:
        manifest = read_manifest(path)
    except TorchpassError as exc:
        raise Refused(str(exc)) from None
    meta = manifest.get("meta") or {}
    if meta.get("job") != job or meta.get("rank") != rank:
        raise Refused(f"snapshot {path} holds job {meta.get('job')} rank {meta.get('rank')}, not job {job} "
                      f"rank {rank}; refused")
    if meta.get("uid") != uid:
        raise Refused(f"snapshot {path} is of a job of uid {meta.get('uid')}, not of uid {uid}; refused")
    # criu restores as the ids its dump ran with (criu.restore_creds): an ordinary user's snapshot
    # must have been dumped as that user, else criu would restore it as root.
    creds = meta.get("criu_creds")
    if uid != 0 and (not isinstance(creds, dict) or creds.get("uid") != uid):
        raise Refused(f"snapshot {path} was not dumped as uid {uid} (its manifest names no criu credentials of "
                      "the job's owner: an older tpassd's?); take a new snapshot; refused")
    return path, manifest


def allowed_images(images: Any, job: int, rank: int, generation: int | None, snapshot: str | None) -> None:
    """Refused unless ``images`` are the ones the plugin's token allows: rank ``rank`` of job ``job``'s
    dump of ``generation`` (a migration), or its part of whole-job snapshot ``snapshot``."""
    if not isinstance(images, str) or not os.path.isabs(images):
        raise Refused(f"restore request: images {images!r} is not an absolute path; refused")
    if generation is not None:
        parsed = layout.parse_images_dir(images, job, rank)
        if parsed is None or parsed[1] != generation:
            raise Refused(f"{images} is not the dump of generation {generation} of rank {rank} of job {job}, "
                          "the only images this restore step was set up for; refused")
        return
    whole = layout.parse_snapshot_images_dir(images, job, rank)
    if whole is None or whole[1] != snapshot:
        raise Refused(f"{images} is not rank {rank}'s part of snapshot {snapshot} of job {job}, the only images "
                      "this step was set up to restore; refused")


def task_pipes(task_pidfd: int, fds: Any, meta: dict[str, Any]) -> dict[int, str]:
    """Our fds on the task's pipes, for ``--inherit-fd`` (only where the manifest had a pipe).

    Each is taken with pidfd_getfd from the task's pidfd, then checked on the copy we hold: an
    anonymous pipe (fstat S_ISFIFO, and our own fd's link "pipe:[...]": not a FIFO on disk),
    opened write-only. Reopening ``/proc/TASK/fd/N`` after checking its link instead reopens, as
    root and by path, whatever N names at the second look: a task that swapped N between a pipe
    and an O_PATH fd of a root-only 0600 file got root an O_WRONLY fd on that file in 5 tries."""
    inherit: dict[int, str] = {}
    if not isinstance(fds, dict):
        return inherit
    try:
        for fd in (1, 2):
            key, n = criu_mod.pipe_key(meta.get(f"fd{fd}")), fds.get(str(fd))
            if not key or not isinstance(n, int) or isinstance(n, bool) or n < 0:
                continue
            try:
                ours = pidfds.getfd(task_pidfd, n)
            except OSError as exc:
                raise Refused(f"cannot take fd {n} of the restore task ({exc.strerror}); refused") from None
            inherit[ours] = key
            try:
                st, flags, link = os.fstat(ours), fcntl.fcntl(ours, fcntl.F_GETFL), os.readlink(f"/proc/self/fd/{ours}")
            except OSError as exc:
                raise Refused(f"fd {n} of the restore task: {exc.strerror}; refused") from None
            if not stat.S_ISFIFO(st.st_mode) or not link.startswith("pipe:"):
                raise Refused(f"fd {n} of the restore task is not a pipe; refused")
            if flags & os.O_ACCMODE != os.O_WRONLY:
                raise Refused(f"fd {n} of the restore task is not the write end of a pipe; refused")
    except BaseException:
        for ours in inherit:
            os.close(ours)
        raise
    return inherit


def gpu_pairs_for(meta: dict[str, Any], task: int, proc: str = "/proc",
                  inventory: Callable[[], gpu_map.GpuInventory] | None = None) -> list[tuple[str, str]]:
    """(source UUID, target UUID) for every GPU the image's manifest names (``gpu_uuids``, in
    local order: those its GPU state maps, or for a rank that holds none, those its task was
    allowed), onto the GPUs the restore step's devices cgroup allows, in local order (gpu_map).
    None named (a CPU rank, a stand-in for GPU state, or a manifest written before the dump
    recorded them): no pairs, the CUDA restore is as before. Fewer targets than sources, or a
    step allowed every GPU of a node that has more than it needs (no confinement): a one-line
    CheckpointError, before anything is restored."""
    source = meta.get("gpu_uuids")
    if not source:
        return []
    if not isinstance(source, list) or not all(isinstance(u, str) for u in source):
        raise CheckpointError(f"the manifest's gpu_uuids {source!r} is not a list of GPU UUIDs; restore refused")
    inv = (inventory or gpu_map.nvml_inventory)()
    minors = gpu_map.target_gpu_minors(task, proc, inv=inv)
    if len(minors) == len(inv.uuids) > len(source):
        raise CheckpointError(f"the restore step may open every GPU of the node ({len(minors)}) but the rank had "
                              f"{len(source)}: ConstrainDevices is off, and a GPU rank is not restored onto GPUs "
                              "root has not told apart")
    return gpu_pair_table(source, gpu_map.uuids_of(minors, inv.uuids))


def restore(task: int, req: dict[str, Any], job: int, rank: int, uid: int,
            task_pidfd: int | None = None,
            inventory: Callable[[], gpu_map.GpuInventory] | None = None) -> dict[str, Any]:
    """Restore what ``req`` names for the task ``task`` (its pidfd: ``task_pidfd``, held by the
    caller; opened here if None); the result's fields, or an exception (one line: why)."""
    if task_pidfd is None:
        task_pidfd = os.pidfd_open(task)
        try:
            return restore(task, req, job, rank, uid, task_pidfd, inventory)
        finally:
            os.close(task_pidfd)
    images, manifest = check_images(req.get("images"), job, rank, uid)
    meta = manifest.get("meta") or {}
    # Into the restore step's cgroups first, so that criu (--manage-cgroups=ignore) restores
    # the tree there: forked in task_init_privileged, we are not in them (cgroup_join).
    join_cgroups_of(task, pidfd=task_pidfd)
    # The restored process keeps its source environment (CUDA_VISIBLE_DEVICES too): only this
    # remap makes its device n the restore step's n-th GPU. Refused here, before criu runs.
    pairs = gpu_pairs_for(meta, task, inventory=inventory)
    inherit = task_pipes(task_pidfd, req.get("fds"), meta)
    try:
        c = criu_mod.find_criu(None)
        # criu writes the pid in a pidfile of this restore's own, root's and node-local; the pid
        # must be a child of the task (its subreaper), and is acted on through a pidfd alone
        pid, seconds = criu_mod.restore(c, images, inherit=inherit, checked=manifest, reaper=task,
                                        reaper_pidfd=task_pidfd)
    finally:
        for fd in inherit:
            os.close(fd)
    from torchpass.checkpoint.rankwrap import resume_cuda_of, wait_child_of

    try:
        restored = pidfds.child_pidfd(pid, task, task_pidfd)
    except OSError as exc:
        raise TorchpassError(f"restored rank {rank}: {exc}") from None
    try:
        rank_pid = wait_child_of(pid) if meta.get("init") else pid
        if not pidfds.alive(restored):  # what /proc said of its children was of another process
            raise TorchpassError(f"restored rank {rank} (pid {pid}) exited at once")
        if meta.get("gpu"):
            try:
                resume_cuda_of(pid, rank_pid, meta, pairs=pairs)
            except TorchpassError as exc:
                pidfds.kill_and_wait(restored)
                raise TorchpassError(f"restored rank {rank} but its CUDA state did not come back ({exc}); "
                                     "killed it") from None
    finally:
        os.close(restored)
    out = {"pid": pid, "rank_pid": rank_pid, "restore_s": round(seconds, 4), "meta": meta, "images": str(images)}
    if pairs:
        out["gpu_pairs"] = [list(p) for p in pairs]
    return out


def write_result(dfd: int, rank: int, uid: int, out: dict[str, Any]) -> None:
    name = result_file(Path("."), rank, os.getpid()).name
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
    try:
        os.write(fd, json.dumps(out).encode())
        os.fchown(fd, uid, -1)
    finally:
        os.close(fd)


def main(job: int | None, rank: int | None, task: int | None, uid: int | None, state_dir: str | None,
         generation: int | None = None, snapshot: str | None = None, gpu_inventory: str | None = None) -> int:
    if None in (job, rank, task, uid, state_dir) or not os.path.isabs(state_dir or "") \
            or (generation is None) == (snapshot is None):
        sys.stderr.write("torchpass: restore agent: needs --job --rank --task-pid --uid --jobs-state-dir and one "
                         "of --generation --snapshot\n")
        return 2
    if os.getppid() != task:
        sys.stderr.write(f"torchpass: restore agent: my parent is not the task {task}; exiting\n")
        return 2
    try:
        pidfd = os.pidfd_open(task)
    except OSError:
        return 0
    if os.getppid() != task:  # it exited in between (we were reparented): the pidfd may be another's
        os.close(pidfd)
        return 0
    fields = {"requester_uid": uid, "job_id": job, "rank": rank, "action": "restore"}
    dfd = -1
    try:
        got = wait_request(state_dir, job, rank, uid, pidfd)
        if got is None:
            return 0  # the step ended at its gate: nothing to restore
        dfd, req = got
        try:
            allowed_images(req.get("images"), job, rank, generation, snapshot)
            out = restore(task, req, job, rank, uid, pidfd, gpu_map.inventory_loader(gpu_inventory))
            audit(**fields, pid=out["pid"], images=out["images"], outcome="ok")
        except (Refused, TorchpassError, OSError) as exc:
            out = {"error": str(exc)}
            audit(**fields, pid=None, images=req.get("images"), outcome="refused" if isinstance(exc, Refused)
                  else "failed", error=json.dumps(str(exc)))
        write_result(dfd, rank, uid, out)
        return 0 if "error" not in out else 1
    except Refused as exc:
        audit(**fields, pid=None, outcome="refused", error=json.dumps(str(exc)))
        return 1
    finally:
        os.close(pidfd)
        if dfd >= 0:
            os.close(dfd)


def cli(argv: list[str] | None = None) -> int:
    """``tpass-restore-agent``: the plugin's root restore agent, a program of its own (the user-side
    rank wrapper never imports it). Its arguments come from the plugin alone (Slurm's job and
    uid, plugstack.conf's state_dir, the restore token's generation or snapshot)."""
    import argparse

    ap = argparse.ArgumentParser(prog="tpass-restore-agent",
                                 description="torchpass's root restore agent; the SPANK plugin starts it in a "
                                             "restore step for which it took a restore token")
    ap.add_argument("--version", action="version", version=f"tpass-restore-agent {__version__}")
    ap.add_argument("--job", type=int, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--task-pid", type=int, required=True)
    ap.add_argument("--uid", type=int, required=True)
    ap.add_argument("--jobs-state-dir", required=True)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--generation", type=int, help="restore only the dump of this generation (a migration)")
    which.add_argument("--snapshot", help="restore only from this whole-job snapshot")
    ap.add_argument("--gpu-inventory", help="the node's GPUs from this root-owned file (plugstack.conf "
                                            "gpu_inventory=), not from NVML")
    args = ap.parse_args(argv)
    if args.gpu_inventory is not None and not os.path.isabs(args.gpu_inventory):
        ap.error("--gpu-inventory must be an absolute path")
    return main(args.job, args.rank, args.task_pid, args.uid, args.jobs_state_dir, args.generation, args.snapshot,
                args.gpu_inventory)


if __name__ == "__main__":
    sys.exit(cli())
