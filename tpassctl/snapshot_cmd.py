"""`tpassctl snapshot JOBID` and `tpassctl snapshots [JOBID] [--delete ID]`: whole-job snapshots.

``snapshot`` asks the job's coordinator (munge: the job's owner or an
admin) to save every rank and leave the job running; it prints the
snapshot's id at once, and ``--wait`` follows the job's events until the
snapshot completed or failed. ``snapshots`` lists the job manifests
that root (tpassd) wrote in STATE_DIR/jobs/J/snapshots: that directory
is root's, readable by the owner's group only, and only manifests owned by
root whose recorded uid is the caller's (any, for an admin) are shown, so
another user sees none. ``--delete ID`` asks a tpassd (the one that wrote
the manifest) to remove the snapshot as root; it checks the caller too.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import select
import signal
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from torchpass import auth, jobdir, layout, zmqio
from torchpass.checkpoint import job_manifest, safeio
from torchpass.errors import AuthError, DependencyError, RemoteError, TorchpassError, UnreachableError
from torchpass.slurm.conf import job_privacy
from torchpass.tpassd_ports import tpassd_ports
from tpassctl.context import state_dir_option
from tpassctl.events_cmd import registration
from tpassctl.exit_codes import REMOTE_NOT_FOUND, CliError
from tpassctl.follow import Feed, PhaseReport, saved_events, wait_for
from tpassctl.migrate_cmd import auth_target, wait_option
from tpassctl.nodes_cmd import discover
from tpassctl.status_cmd import no_state_dir, visible_job
from tpassctl.table import table

SNAPSHOT_EVENTS = ("snapshot.completed", "snapshot.failed")
# --stop: the snapshot is complete and the job being held (job.stopping), or it went on (the others)
STOP_EVENTS = ("job.stopping", "job.stop_failed", "snapshot.failed")


def _ask(job_id: int, endpoint: str, type_: str, body: dict[str, Any], target: str, timeout_s: float,
         who: str) -> dict[str, Any]:
    """One authenticated request, not retried (it is not idempotent); one-line CliError on failure."""
    try:
        return zmqio.request(endpoint, type_, body, timeout_s=timeout_s, retries=0,
                             auth=auth.credential_for(type_, body, target))
    except UnreachableError:
        raise CliError(f"job {job_id}: {who} at {endpoint} did not answer within {timeout_s:g}s",
                       "unreachable") from None
    except (AuthError, DependencyError) as exc:
        raise CliError(f"job {job_id}: cannot authenticate to {who}: {exc}", "refused") from None
    except RemoteError as exc:
        raise CliError(f"job {job_id}: {exc.remote_message} ({exc.code})",
                       "not_found" if exc.code in REMOTE_NOT_FOUND else "refused") from None


@click.command()
@click.argument("job_id", type=click.IntRange(min=1))
@click.option("--stop", is_flag=True,
              help="Then stop the job: it is requeued and held under its job id, its nodes free for other "
                   "jobs, until `tpassctl resume JOB_ID` restores every rank from this snapshot.")
@wait_option("the snapshot")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0.05), default=5.0, show_default=True,
              help="Seconds to wait for the coordinator's answer.")
@state_dir_option
@click.pass_obj
def snapshot(obj, job_id, stop, wait_s, as_json, timeout_s):
    """Save every rank of JOB_ID (CRIU, all ranks paused at one collective), leaving it running.

    Only the job's owner or an admin may ask (munge). Training stands still only
    while the ranks are dumped; follow it with `tpassctl events JOB_ID` or --wait,
    list the snapshots with `tpassctl snapshots JOB_ID`. With --stop the ranks do not
    resume: the job is held (Slurm: requeued, held) and its nodes freed, until
    `tpassctl resume JOB_ID` (docs/coordinator.md, "Snapshots").
    """
    info = registration(obj.state_dir, job_id)
    body = {"stop": True} if stop else {}
    res = _ask(job_id, info["endpoint"], "job.snapshot", body, auth_target(job_id), timeout_s, "the coordinator")
    sid = res.get("snapshot")
    out: dict[str, Any] = {"job_id": job_id, "snapshot": sid, "stop": stop}
    if wait_s is None:
        if as_json:
            click.echo(json.dumps(out, indent=1))
        else:
            click.echo(f"snapshot {sid} of job {job_id} started{', then the job stops' if stop else ''}; "
                       f"follow it: tpassctl events {job_id}")
        return
    click.echo(json.dumps(out) if as_json else f"snapshot {sid} of job {job_id} started"
               f"{', then the job stops' if stop else ''}")
    wait_snapshot(obj.state_dir, job_id, sid, stop, wait_s, as_json)


def snapshot_phase(sid: str):
    """phase_of for wait_for: the phase of snapshot ``sid`` in job.status."""
    def phase_of(st: dict[str, Any] | None) -> tuple[str, float | None] | None:
        s = (st or {}).get("snapshot")
        return (str(s["phase"]), s.get("phase_age_s")) if s and s.get("id") == sid else None
    return phase_of


def wait_snapshot(state_dir: Path, job_id: int, sid: str, stop: bool, wait_s: float, as_json: bool) -> None:
    """Follow snapshot ``sid`` to its end: exit 0 once complete (with --stop: once the job is being
    held), else a CliError (1: failed, or not stopped; 3: not done within ``wait_s``)."""
    kinds, done = (STOP_EVENTS, "job.stopping") if stop else (SNAPSHOT_EVENTS, "snapshot.completed")
    report = PhaseReport(as_json)
    feed = Feed(state_dir, job_id)
    ev = wait_for(feed, wait_s, report, sid, snapshot_phase(sid),
                  lambda e: e.get("kind") in kinds and (e.get("data") or {}).get("snapshot") == sid)
    if ev is None:
        if feed.ended:
            raise CliError(f"job {job_id} ended before snapshot {sid} completed")
        raise CliError(f"job {job_id}: snapshot {sid} did not complete within {wait_s:g}s", "timeout")
    outcome = "completed" if ev["kind"] == done else "failed" if ev["kind"] == "snapshot.failed" else "not_stopped"
    report.outcome(ev.get("message", ""), {"job_id": job_id, "id": sid, "snapshot": sid, "stop": stop,
                                          "outcome": outcome, "event": ev})
    if outcome == "failed":
        raise CliError(f"job {job_id}: snapshot {sid} failed")
    if outcome == "not_stopped":
        raise CliError(f"job {job_id}: snapshot {sid} completed but the job could not be stopped; it runs on")


def list_snapshots(state_dir: Path, job_id: int | None = None, uid: int | None = None,
                   now: float | None = None) -> list[dict[str, Any]]:
    """The snapshots ``uid`` may see (its own; every one for an admin), oldest first per job."""
    uid = os.getuid() if uid is None else uid
    admin = uid in job_privacy()[1]
    now = time.time() if now is None else now
    try:
        jobs = [job_id] if job_id is not None else jobdir.job_names(state_dir)
    except OSError as exc:
        raise CliError(str(exc)) from None
    rows = []
    for j in jobs:
        try:  # jobs/J is its owner's: no symlink followed below it
            dfd = safeio.open_dir(state_dir, layout.snapshot_manifests_dir(".", j).parts)
        except OSError:
            continue  # none, or not ours to read
        try:
            found = job_manifest.read_all(dfd, j)
        except OSError:
            found = []
        finally:
            os.close(dfd)
        for m in found:
            if not admin and m.get("uid") != uid:
                continue
            rows.append({"job_id": j, "snapshot": m["snapshot"], "step": m.get("step"), "bytes": m.get("bytes"),
                         "age_s": round(max(0.0, now - float(m.get("created") or now)), 1),
                         "created": m.get("created"), "ranks": m.get("world_size"), "nodes": m.get("nodes"),
                         "generation": m.get("generation"), "collectives": m.get("collectives"),
                         "written_by": m.get("written_by"),
                         "manifest": str(layout.snapshot_manifest(state_dir, j, m["snapshot"]))})
    return rows


def _age(s: float) -> str:
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.1f}h"


@click.command()
@click.argument("job_id", type=click.IntRange(min=1), required=False)
@click.option("--delete", "delete_id", default=None, metavar="ID",
              help="Delete snapshot ID of JOB_ID (its images and manifest; as root, by the tpassd that wrote it).")
@click.option("--endpoint", "endpoints", multiple=True, metavar="NODE=tcp://HOST:PORT",
              help="With --delete: the tpassd to ask [default: from Slurm and tpassd's configured port].")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0.05), default=30.0, show_default=True,
              help="With --delete: seconds to wait for tpassd.")
@state_dir_option
@click.pass_obj
def snapshots(obj, job_id, delete_id, endpoints, as_json, timeout_s):
    """List the whole-job snapshots of JOB_ID (or of every job) you may see: id, step, size, age.

    Only the job's owner (or an admin) sees them. A policy keeps the newest
    snapshot_keep (default 2) of a job; older ones are removed when a new one
    completes. --delete ID removes one now.
    """
    if not obj.state_dir.is_dir():
        raise no_state_dir(obj.state_dir)
    if job_id is not None:
        os.close(visible_job(obj.state_dir, job_id)[0])  # the owner's or an admin's: else the one line
    rows = list_snapshots(obj.state_dir, job_id)
    if delete_id is not None:
        if job_id is None:
            raise click.UsageError("--delete needs the JOB_ID")
        row = next((r for r in rows if r["snapshot"] == delete_id), None)
        if row is None:
            raise CliError(f"job {job_id} has no snapshot {delete_id} that you may see "
                           "(tpassctl snapshots JOB_ID lists them)", "not_found")
        node = row["written_by"]
        try:
            ep = discover(endpoints, (node,), tpassd_ports().control_port)[node]["endpoint"]
        except (KeyError, TorchpassError) as exc:
            raise CliError(f"job {job_id}: cannot find {node}'s tpassd ({exc}); pass --endpoint") from None
        body = {"job_id": job_id, "rank": 0, "op": "delete", "snapshot": delete_id}
        res = _ask(job_id, ep, "tpassd.snapshot", body, node, timeout_s, f"{node}'s tpassd")
        if as_json:
            click.echo(json.dumps({"job_id": job_id, **res}, indent=1))
        else:
            click.echo(f"snapshot {delete_id} of job {job_id} deleted ({res.get('freed_mb', 0)} MB freed)")
        return
    if as_json:
        click.echo(json.dumps({"snapshots": rows}, indent=1))
        return
    if not rows:
        click.echo("no snapshots" + (f" of job {job_id}" if job_id else "") + " that you may see")
        return
    for line in table(("JOBID", "SNAPSHOT", "STEP", "SIZE", "AGE", "RANKS"),
                      [(r["job_id"], r["snapshot"], r["step"], f"{(r['bytes'] or 0) / 1e6:.1f} MB", _age(r["age_s"]),
                        r["ranks"]) for r in rows], right=("JOBID", "STEP", "SIZE", "AGE", "RANKS")):
        click.echo(line)


KEEP_OUTPUT_TIMEOUT_S = 300.0  # copying the job's output file; a NFS server that stopped answering ends it


def _copy_output(src: str, state_dir: Path, job_id: int, name: str, uid: int) -> str | None:
    """Copy ``src``, a regular file of ``uid``, to STATE_DIR/jobs/J/``name`` through a fresh
    O_EXCL|O_NOFOLLOW file of a random name, renamed over ``name``: a FIFO, a symlink or a
    file planted at any name in the job's directory is never opened. Why not, or None."""
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return f"cannot read {src}: {exc.strerror}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            return f"{src} is not a regular file of the job's owner (uid {uid})"
        dfd = safeio.open_dir(state_dir, (layout.JOBS, str(job_id)))
        try:
            tmp = f".{name}.{secrets.token_hex(8)}.tmp"
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                          layout.JOB_FILE_MODE, dir_fd=dfd)
            try:
                try:
                    while chunk := os.read(fd, 1 << 20):
                        view = memoryview(chunk)
                        while view:
                            view = view[os.write(out, view):]
                finally:
                    os.close(out)
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except OSError:
                    pass
                raise
        finally:
            os.close(dfd)
        return None
    except OSError as exc:
        return f"cannot copy {src} to {layout.job_dir(state_dir, job_id) / name}: {exc}"
    finally:
        os.close(fd)


def _as_user(uid: int, fn: Callable[[], str | None], timeout_s: float) -> str | None:
    """``fn()`` in a child that is ``uid`` alone (its groups, its gid: setgroups, setresgid,
    setresuid), so that root touches nothing of a user's with root's rights. Its result, or why not."""
    try:
        pw = pwd.getpwuid(uid)
        groups = os.getgrouplist(pw.pw_name, pw.pw_gid)
    except (KeyError, OSError) as exc:
        return f"cannot find the job's owner (uid {uid}) to copy as: {exc}"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.close(r)
            os.setgroups(groups)
            os.setresgid(pw.pw_gid, pw.pw_gid, pw.pw_gid)
            os.setresuid(uid, uid, uid)
            why = fn()
            os.write(w, json.dumps({"why": why}).encode())
            code = 0
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, never raised past fork
            try:
                os.write(w, json.dumps({"why": f"as uid {uid}: {exc}"}).encode())
            except BaseException:  # noqa: BLE001
                pass
        finally:
            os._exit(code)
    os.close(w)
    try:
        deadline = time.monotonic() + timeout_s
        data = b""
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                return f"copying as uid {uid} took more than {timeout_s:g}s; stopped"
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    try:
        return json.loads(data)["why"]
    except (ValueError, KeyError, TypeError):
        return f"copying as uid {uid} ended without an answer"


def keep_output(src: str, state_dir: Path, job_id: int, name: str, uid: int,
                timeout_s: float = KEEP_OUTPUT_TIMEOUT_S) -> str | None:
    """Copy the job's output file ``src`` to STATE_DIR/jobs/J/``name`` (the plugin writes it back when
    the resumed batch step starts: Slurm truncates the file then), as the job's user ``uid``: root
    (an admin's resume) drops to the user in a child first. Why not, or None when copied."""
    if os.geteuid() == 0 and uid != 0:
        return _as_user(uid, lambda: _copy_output(src, state_dir, job_id, name, uid), timeout_s)
    return _copy_output(src, state_dir, job_id, name, uid)


@click.command()
@click.argument("job_id", type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@wait_option("the restore")
@state_dir_option
@click.pass_obj
def resume(obj, job_id, as_json, wait_s):
    """Bring back JOB_ID, stopped with `tpassctl snapshot --stop`, on any free nodes of its partition.

    Slurm starts it again under the same job id; its batch script runs from the top
    and the srun that was stopped restores every rank from the snapshot, which goes
    on at the step it stopped at. What the job printed before the stop stays in its
    output file (copied as the job's user, also when an admin resumes it). Only the
    job's owner or an admin (Slurm checks the release). --wait follows it until
    every rank is restored and resumed (exit 0), or the restore failed (exit 1).
    """
    from torchpass.coordinator.stopped import read_stopped
    from torchpass.slurm import client

    os.close(visible_job(obj.state_dir, job_id)[0])  # the owner's or an admin's: else the one refusal line
    try:
        stopped = read_stopped(obj.state_dir, job_id)
    except TorchpassError as exc:
        raise CliError(f"job {job_id}: {exc}") from None
    if stopped is None:
        raise CliError(f"job {job_id} was not stopped by torchpass (no "
                       f"{layout.stopped_file(obj.state_dir, job_id)}); nothing to resume", "refused")
    slurm = client()
    try:
        job = slurm.job(job_id)
    except TorchpassError as exc:
        raise CliError(f"job {job_id}: cannot ask slurmctld ({exc})", "unreachable") from None
    if job is None:  # PrivateData=jobs hides another user's job
        raise CliError(f"slurmctld shows you no job {job_id} (it ended, or it is not yours to see): only "
                       "its owner or an admin may resume it", "not_found")
    if job.state != "PENDING":
        raise CliError(f"job {job_id} is {job.state}, not stopped and held; nothing to resume", "refused")
    if os.getuid() not in (0, job.user_id) and os.getuid() not in job_privacy()[1]:
        raise CliError(f"job {job_id} is {job.user}'s: only its owner or an admin may resume it", "not_found")
    if not layout.snapshot_manifest(obj.state_dir, job_id, stopped["snapshot"]).exists():
        raise CliError(f"job {job_id}: snapshot {stopped['snapshot']} it was stopped with is gone "
                       "(deleted, or past the age limit); it cannot be restored", "not_found")
    notes = []
    for src, name in ((job.output, layout.STOPPED_OUT),
                      (job.error if job.error and job.error != job.output else "", layout.STOPPED_ERR)):
        why = keep_output(src, obj.state_dir, job_id, name, job.user_id) if src else None
        if why:
            notes.append(f"its output before the stop is not kept: {why}")
    saved = saved_events(obj.state_dir, job_id)
    seq_before = max((int(e.get("seq", 0) or 0) for e in saved["events"]), default=0) if saved else 0
    try:
        slurm.release(job_id)
    except TorchpassError as exc:
        raise CliError(f"job {job_id}: slurmctld would not release it ({exc})", "refused") from None
    out = {"job_id": job_id, "snapshot": stopped["snapshot"], "step": stopped["snapshot_step"], "notes": notes}
    if as_json:
        click.echo(json.dumps(out) if wait_s is not None else json.dumps(out, indent=1))
    else:
        for n in notes:
            click.echo(f"tpassctl: job {job_id}: {n}", err=True)
        click.echo(f"job {job_id} released: once Slurm starts it, every rank is restored from snapshot "
                   f"{stopped['snapshot']} (step {stopped['snapshot_step']}); follow it: tpassctl events {job_id}")
    if wait_s is not None:
        wait_resume(obj.state_dir, job_id, stopped["snapshot"], seq_before, wait_s, as_json)


# The resumed run's coordinator carries the stopped run's event log on (its seq too): these end a resume.
RESUME_DONE = "job.resumed"
RESUME_FAILED = ("job.restore_missed", "job.relaunch_failed")


def resume_phase(st: dict[str, Any] | None) -> tuple[str, float | None]:
    """phase_of for wait_for: starting (Slurm has not started it, or its coordinator is not up),
    restoring (ranks registering from the snapshot), resuming (all back; told to go on)."""
    if st is None:
        return "starting", None
    world, registered = st.get("world_size") or 0, st.get("registered_ranks") or 0
    return ("resuming" if world and registered >= world else "restoring"), None


def wait_resume(state_dir: Path, job_id: int, sid: str, seq_before: int, wait_s: float, as_json: bool) -> None:
    """Follow the released job until every rank is restored from ``sid`` and resumed (exit 0), the
    restore failed or the job ended first (1), or ``wait_s`` passed (3)."""
    report = PhaseReport(as_json)
    feed = Feed(state_dir, job_id, seq=seq_before)
    ev = wait_for(feed, wait_s, report, sid, resume_phase,
                  lambda e: e.get("kind") == RESUME_DONE or e.get("kind") in RESUME_FAILED)
    if ev is None:
        if feed.ended:
            raise CliError(f"job {job_id} ended before its ranks were restored from snapshot {sid}")
        raise CliError(f"job {job_id}: not every rank was restored from snapshot {sid} and resumed within "
                       f"{wait_s:g}s", "timeout")
    outcome = "resumed" if ev["kind"] == RESUME_DONE else "failed"
    report.outcome(ev.get("message", ""), {"job_id": job_id, "id": sid, "outcome": outcome, "event": ev})
    if outcome != "resumed":
        raise CliError(f"job {job_id}: {ev.get('message', ev['kind'])}")


__all__ = ["list_snapshots", "resume", "snapshot", "snapshots"]
