"""`tpassctl events [JOBID]`: a job's torchpass event log (migrations with phase durations)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import click

from torchpass import auth, coordinator_lost, jobdir, layout, zmqio
from torchpass.errors import RemoteError, TorchpassError, UnreachableError
from tpassctl.status_cmd import discover_coordinators, exit_if_refused, job_registration, visible_job

# The order phases happen in (docs/coordinator.md); unknown keys follow, sorted.
# The saved log holds at most 10,000 events (state.EVENTS_KEPT; per-rank ones go first).
SAVED_EVENTS_MAX_BYTES = 64 * 1024 * 1024
PHASE_ORDER = ("detect", "spare", "pause", "dump", "transfer", "restore", "kill_source", "rebuild", "rollback",
               "drain", "shrink", "paused", "total")


def registration(state_dir: Path, job_id: int) -> dict[str, Any]:
    """The coordinator registration of ``job_id`` if the caller may see the job; a one-line
    ClickException otherwise (status_cmd.job_registration)."""
    return job_registration(state_dir, job_id)


def format_durations(durations: dict[str, Any]) -> str:
    keys = [k for k in PHASE_ORDER if k in durations] + sorted(k for k in durations if k not in PHASE_ORDER)
    return "  ".join(f"{k} {float(durations[k]):.2f}s" for k in keys
                     if isinstance(durations[k], (int, float)) and not isinstance(durations[k], bool))


def fetch(job_id: int, info: dict[str, Any], since_seq: int, timeout_s: float) -> dict[str, Any]:
    row: dict[str, Any] = {"job_id": job_id, "endpoint": info.get("endpoint")}
    body = {"since_seq": since_seq} if since_seq else {}
    try:
        res = zmqio.request(info["endpoint"], "job.events", body, timeout_s=timeout_s, retries=1,
                            auth=auth.optional_credential_for("job.events", body, auth.job_target(job_id)))
        row["reachable"] = True
        row["events"] = res.get("events", [])
    except UnreachableError as exc:
        row.update(reachable=False, error=f"coordinator unreachable: {exc}", events=[])
    except TorchpassError as exc:
        row.update(reachable=True, error=str(exc), events=[])
        if isinstance(exc, RemoteError):
            row["error_code"] = exc.code
    return row


def saved_events(state_dir: Path, job_id: int) -> dict[str, Any] | None:
    """The event log a finished job's coordinator left in STATE_DIR/jobs/J/events.json.

    Trusted only if the file belongs to the owner of jobs/J (made by the root plugin for the
    job's user) and is a plain file of one link, read without following a link (torchpass.jobdir).
    """
    try:
        fd, owner = jobdir.open_job_dir(state_dir, job_id)
    except OSError:
        return None
    try:
        events = jobdir.read_json(fd, layout.EVENTS_JSON, owner, SAVED_EVENTS_MAX_BYTES)
    finally:
        os.close(fd)
    if not isinstance(events, list):
        return None
    return {"job_id": job_id, "endpoint": None, "reachable": False, "saved": str(layout.events_json(state_dir, job_id)),
            "events": [e for e in events if isinstance(e, dict)]}


def with_lost_note(state_dir: Path, row: dict[str, Any]) -> dict[str, Any]:
    """Add the event ``coordinator.lost`` from a rank's note (the coordinator could not record it)."""
    note = coordinator_lost.read(state_dir, row["job_id"])
    if note is not None:
        last = max((int(e.get("seq", 0) or 0) for e in row["events"]), default=0)
        row["events"] = [*row["events"], coordinator_lost.as_event(note, last + 1)]
    return row


def _when(t: Any) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(t)))
    except (TypeError, ValueError, OverflowError, OSError):
        return "?"


@click.command()
@click.argument("job_id", type=click.IntRange(min=1), required=False)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--since", "since_seq", type=click.IntRange(min=0), default=0, show_default=True,
              help="Only events with a sequence number above this.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0.05), default=1.0, show_default=True,
              help="Seconds to wait for each coordinator.")
@click.pass_obj
def events(obj, job_id, as_json, since_seq, timeout_s):
    """Show the event log of JOB_ID's coordinator (or of every registered job you may see).

    A job whose coordinator has ended is read from the event log it saved
    in the state directory. Only the job's owner, root and SlurmUser see it,
    running or ended; anyone else gets one line, the same as for a job id
    with no torchpass job. One line per event: time, kind, message;
    migrations also show how long each phase took (detect, spare, pause, dump, transfer, restore,
    kill_source, rebuild, drain, shrink). "pause" runs from the pause
    command until the last rank reached the pause point T: the ranks train
    on meanwhile. "paused" is the time training stood still: from the last
    rank reaching T to the end of the rebuild (or rollback).
    """
    if job_id is not None:
        # Only the job's owner or an admin: anyone else gets the one refusal line (status_cmd).
        fd, owner = visible_job(obj.state_dir, job_id)
        try:
            info = jobdir.registration(fd, job_id, owner)
        finally:
            os.close(fd)
        # A running job answers through its coordinator; a finished one (or one
        # whose coordinator is gone) from the log its coordinator saved.
        saved = saved_events(obj.state_dir, job_id)
        if info is not None:
            rows = [fetch(job_id, info, since_seq, timeout_s)]
            if not rows[0]["reachable"]:
                if saved is None and coordinator_lost.read(obj.state_dir, job_id) is None:
                    raise click.ClickException(f"job {job_id}: {rows[0]['error']}")
                rows = [saved or rows[0]]  # a lost coordinator that saved nothing: its note only
        elif saved is not None:
            rows = [saved]
        else:
            raise click.ClickException(
                f"job {job_id} has no torchpass coordinator registered in {obj.state_dir} and no saved "
                "event log (not a --torchpass job, or a different --state-dir)")
        for row in rows:
            with_lost_note(obj.state_dir, row)
            if row.get("saved") or since_seq:
                row["events"] = [e for e in row["events"] if int(e.get("seq", 0) or 0) > since_seq]
    else:
        regs = discover_coordinators(obj.state_dir)
        rows = [with_lost_note(obj.state_dir, fetch(j, regs[j], since_seq, timeout_s)) for j in sorted(regs)]
    if as_json:
        click.echo(json.dumps({"jobs": rows}, indent=1))
        exit_if_refused(job_id, rows)
        return
    if not rows:
        click.echo("no torchpass coordinators registered")
        return
    for row in rows:
        if job_id is None:
            click.echo(f"job {row['job_id']}  coordinator {row['endpoint']}")
        elif row.get("saved"):
            click.echo(f"job {row['job_id']} (coordinator gone; saved log {row['saved']})")
        if row.get("error"):
            click.echo(f"  ERROR: {row['error']}")
            if not row["events"]:  # a lost coordinator's note still shows below
                continue
        if not row["events"]:
            click.echo("  no events")
            continue
        width = max(len(str(e.get("kind", ""))) for e in row["events"])
        for e in row["events"]:
            click.echo(f"{_when(e.get('time'))}  {str(e.get('kind', '')):<{width}}  {e.get('message', '')}")
            data = e.get("data") or {}
            if isinstance(data.get("phase_durations"), dict) and data["phase_durations"]:
                click.echo(f"{'':19}  {'':<{width}}  phases: {format_durations(data['phase_durations'])}")
    exit_if_refused(job_id, rows)
