"""`tpassctl events [JOBID]`: a job's torchpass event log (migrations with phase durations)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import click

from torchpass import auth, coordinator_lost, jobdir, zmqio
from torchpass.errors import RemoteError, TorchpassError, UnreachableError
from tpassctl import gantt
from tpassctl.context import state_dir_option
from tpassctl.exit_codes import CliError, finish
from tpassctl.follow import POLL_S, Feed, saved_events
from tpassctl.status_cmd import discover_coordinators, job_registration, refusal, starting_job_of_caller, visible_job

# The order phases happen in (docs/coordinator.md); unknown keys follow, sorted.
PHASE_ORDER = ("detect", "spare", "pause", "dump", "transfer", "restore", "kill_source", "rebuild", "rollback",
               "drain", "shrink", "paused", "total")


def registration(state_dir: Path, job_id: int) -> dict[str, Any]:
    """The coordinator registration of ``job_id`` if the caller may see the job; a one-line
    CliError otherwise (status_cmd.job_registration)."""
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


def event_lines(e: dict[str, Any], width: int) -> list[str]:
    lines = [f"{_when(e.get('time'))}  {str(e.get('kind', '')):<{width}}  {e.get('message', '')}"]
    data = e.get("data") or {}
    if isinstance(data.get("phase_durations"), dict) and data["phase_durations"]:
        lines.append(f"{'':19}  {'':<{width}}  phases: {format_durations(data['phase_durations'])}")
    return lines


FOLLOW_KIND_WIDTH = 22  # "migration.rolled_back": the kinds line up while they arrive one by one


def await_job_dir(state_dir: Path, job_id: int) -> None:
    """--follow of a job just submitted: the plugin makes STATE_DIR/jobs/J when the job's batch step
    starts, so a job of the caller's that Slurm holds pending (or is starting) has no directory
    yet. Wait for it while Slurm says so; any other job gets the one not-found line at once
    (another user's job included: Slurm names its owner, so nothing leaks)."""
    while True:
        try:
            os.close(visible_job(state_dir, job_id)[0])
            return
        except CliError as exc:
            if exc.code != "not_found" or not starting_job_of_caller(job_id):
                raise
        time.sleep(POLL_S)


def follow(state_dir: Path, job_id: int, since_seq: int, as_json: bool, timeout_s: float) -> None:
    """Print the job's events as they come, until the job ends (its coordinator gone and its saved
    log read to the end); one JSON object per line under --json."""
    feed = Feed(state_dir, job_id, seq=since_seq, timeout_s=max(timeout_s, 1.0))
    while True:
        for e in feed.poll():
            if as_json:
                click.echo(json.dumps(e))
            else:
                for line in event_lines(e, FOLLOW_KIND_WIDTH):
                    click.echo(line)
        if feed.ended:
            return
        time.sleep(POLL_S)


def plot(job_id: int, evs: list[dict[str, Any]], path: Path, as_json: bool) -> None:
    found = gantt.bars(evs)
    if not found:
        raise CliError(f"job {job_id}: no migration or snapshot has ended yet (nothing to plot)", "not_found")
    gantt.draw(job_id, found, path)
    ops = len({b.operation for b in found})
    if as_json:
        click.echo(json.dumps({"job_id": job_id, "plot": str(path), "bars": [vars(b) for b in found]}, indent=1))
    else:
        click.echo(f"{path}: {ops} migration(s) and snapshot(s) of job {job_id}, phase by phase")


@click.command()
@click.argument("job_id", type=click.IntRange(min=1), required=False)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON (with --follow: one event a line).")
@click.option("--since", "since_seq", type=click.IntRange(min=0), default=0, show_default=True,
              help="Only events with a sequence number above this.")
@click.option("-f", "--follow", "follow_on", is_flag=True,
              help="Keep printing JOB_ID's events as they come; end when the job ends.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0.05), default=1.0, show_default=True,
              help="Seconds to wait for each coordinator.")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path, dir_okay=False), default=None, metavar="FILE.png",
              help="Draw JOB_ID's migrations and snapshots, phase by phase, with the time the ranks stood still "
                   "(needs matplotlib: pip install 'torchpass[plot]').")
@state_dir_option
@click.pass_obj
def events(obj, job_id, as_json, since_seq, follow_on, timeout_s, plot_path):
    """Show the event log of JOB_ID's coordinator (or of every registered job you may see).

    A job whose coordinator has ended is read from the event log it saved
    in the state directory. Only the job's owner, root and SlurmUser see it,
    running or ended; anyone else gets one line (exit 4), the same as for a job id
    with no torchpass job. One line per event: time, kind, message;
    migrations also show how long each phase took (detect, spare, pause, dump, transfer, restore,
    kill_source, rebuild, drain, shrink). "pause" runs from the pause
    command until the last rank reached the pause point T: the ranks train
    on meanwhile. "paused" is the time training stood still: from the last
    rank reaching T to the end of the rebuild (or rollback). --follow prints
    new events as they come and ends when the job ends. --plot draws each
    migration's and snapshot's phases (a Gantt chart) with the ranks' pause.
    """
    if (follow_on or plot_path) and job_id is None:
        raise click.UsageError(f"{'--follow' if follow_on else '--plot'} needs a JOB_ID")
    if follow_on:
        await_job_dir(obj.state_dir, job_id)  # the owner's or an admin's: else the one line
        follow(obj.state_dir, job_id, since_seq, as_json, timeout_s)
        return
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
                    raise CliError(f"job {job_id}: {rows[0]['error']}", "unreachable")
                rows = [saved or rows[0]]  # a lost coordinator that saved nothing: its note only
        elif saved is not None:
            rows = [saved]
        else:
            raise CliError(
                f"job {job_id} has no torchpass coordinator registered in {obj.state_dir} and no saved "
                "event log (not a --torchpass job, or a different --state-dir)", "not_found")
        for row in rows:
            with_lost_note(obj.state_dir, row)
            if row.get("saved") or since_seq:
                row["events"] = [e for e in row["events"] if int(e.get("seq", 0) or 0) > since_seq]
    else:
        regs = discover_coordinators(obj.state_dir)
        rows = [with_lost_note(obj.state_dir, fetch(j, regs[j], since_seq, timeout_s)) for j in sorted(regs)]
    failure = refusal(job_id, rows)
    if plot_path is not None and failure is None:
        plot(job_id, rows[0]["events"], plot_path, as_json)
        return
    if as_json:
        finish(True, {"jobs": rows}, failure)
        return
    if not rows:
        click.echo("no torchpass coordinators registered")
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
            for line in event_lines(e, width):
                click.echo(line)
    finish(False, {}, failure)
