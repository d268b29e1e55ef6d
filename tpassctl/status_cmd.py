"""`tpassctl status`: every running torchpass job, its coordinator and ranks."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click

from torchpass import auth, coordinator_lost, layout, zmqio
from torchpass.errors import DependencyError, RemoteError, SlurmError, TorchpassError, UnreachableError
from torchpass.slurm import client


def discover_coordinators(state_dir: Path) -> dict[int, dict[str, Any]]:
    """Registrations under STATE_DIR/jobs/*/coordinator.json, by job id.

    A registration counts only if the file belongs to the uid it claims: the
    state directory is shared and world-writable, so anyone could drop a file.
    """
    jobs_dir = layout.jobs_dir(state_dir)
    if not state_dir.is_dir():
        raise click.ClickException(
            f"no torchpass state directory at {state_dir}; pass --state-dir or set TORCHPASS_STATE_DIR "
            "(for the devcluster: eval \"$(tpassctl devcluster env)\")"
        )
    found: dict[int, dict[str, Any]] = {}
    if not jobs_dir.is_dir():
        return found
    for path in jobs_dir.glob(f"*/{layout.COORDINATOR_JSON}"):
        try:
            info = json.loads(path.read_text())
            owner = path.stat().st_uid
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(info, dict) or info.get("uid") != owner or not isinstance(info.get("job_id"), int):
            continue
        found[info["job_id"]] = info
    return found


def collect(state_dir: Path, job_id: int | None, timeout_s: float) -> list[dict[str, Any]]:
    registrations = discover_coordinators(state_dir)
    slurm_jobs: dict[int, Any] = {}
    slurm_error = None
    try:
        for j in client().jobs(states=("RUNNING", "COMPLETING")):
            slurm_jobs[j.job_id] = j
    except (SlurmError, DependencyError) as exc:
        slurm_error = str(exc)
    if job_id is not None:
        if job_id not in registrations:
            raise click.ClickException(
                f"job {job_id} has no torchpass coordinator registered in {state_dir}"
                " (not a --torchpass job, not running, or a different state dir)"
            )
        registrations = {job_id: registrations[job_id]}
    rows = []
    for jid in sorted(registrations):
        info = registrations[jid]
        sj = slurm_jobs.get(jid)
        if slurm_error is None and sj is None and job_id is None:
            continue  # a leftover registration of a job that has ended
        if sj is not None and sj.user_id != info["uid"] and info["uid"] != 0:
            continue  # registered by someone who does not own the job
        row: dict[str, Any] = {
            "job_id": jid,
            "slurm_state": sj.state if sj else None,
            "nodes": list(sj.nodes) if sj else None,
            "user": sj.user if sj else None,
            "coordinator": {"endpoint": info.get("endpoint"), "pid": info.get("pid"), "host": info.get("host")},
        }
        try:
            st = zmqio.request(info["endpoint"], "job.status", {}, timeout_s=timeout_s, retries=1,
                               auth=auth.optional_credential_for("job.status", {}, auth.job_target(jid)))
            row["reachable"] = True
            row.update({k: st[k] for k in ("world_size", "registered_ranks", "min_step", "max_step",
                                           "ranks", "spares", "policy", "migration", "snapshot",
                                           "last_migration") if k in st})
            # "unprotected": why the runtime cannot protect the job (None: it can)
            row["unprotected"] = st.get("unprotected")
            row["protected"] = not st.get("unprotected")
        except (UnreachableError, TorchpassError) as exc:
            row["reachable"] = False
            row["error"] = str(exc)
            if isinstance(exc, RemoteError):
                row["error_code"] = exc.code
            # Slurm runs the job but its coordinator does not answer: it died, and nothing moves the job.
            lost = isinstance(exc, UnreachableError) and sj is not None and sj.state == "RUNNING"
            row["coordinator_lost"] = lost
            row["protected"] = False if lost else None  # None: not known
        # A rank's note that its link had no answer (torchpass.coordinator_lost): the coordinator is
        # lost even if it still answers us (the ranks cannot reach it), and even if Slurm cannot say.
        note = coordinator_lost.read(state_dir, jid)
        if note is not None:
            row.update(coordinator_lost=True, protected=False, lost=note)
            row.setdefault("error", coordinator_lost.message(note))
        rows.append(row)
    if slurm_error:
        for r in rows:
            r["slurm_error"] = slurm_error
    return rows


def activity_lines(row: dict[str, Any]) -> list[str]:
    """What the coordinator is doing to the job (job.status's migration, snapshot, last_migration)."""
    lines = []
    m, s, last = row.get("migration"), row.get("snapshot"), row.get("last_migration")
    if m:
        lines.append(f"migrating {m['node']} -> {m['target'] or '(no spare yet)'} ({m['id']}): "
                     f"{m['phase']} for {m['phase_age_s']:.1f}s, {m['age_s']:.1f}s in all")
    if s:
        lines.append(f"snapshot {s['id']} ({s['trigger']}): {s['phase']} for {s['phase_age_s']:.1f}s")
    if last and not m:
        lines.append(f"last migration {last['id']}: {last['node']} -> {last['target'] or '-'} {last['outcome']}")
    return lines


REFUSED_CODES = ("forbidden", "unauthenticated")


def exit_if_refused(job_id: int | None, rows: list[dict[str, Any]]) -> None:
    """A question about one job that its coordinator refused ends with exit status 1 and one line on
    stderr, after the (JSON or text) output: scripts must not take a refusal for an answer. A listing
    of every job keeps exit status 0, with the refusal in that job's entry."""
    if job_id is None:
        return
    for row in rows:
        if row.get("error_code") in REFUSED_CODES:
            click.echo(f"Error: job {job_id}: {row['error']}; only the job's owner or an admin can see it",
                       err=True)
            raise click.exceptions.Exit(1)


@click.command()
@click.argument("job_id", type=click.IntRange(min=1), required=False)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0.05), default=1.0, show_default=True,
              help="Seconds to wait for each coordinator.")
@click.pass_obj
def status(obj, job_id, as_json, timeout_s):
    """Show running torchpass jobs: coordinator, ranks, node and last step of each.

    Lists every job with a registered coordinator that Slurm reports running
    (or only JOB_ID), and for each rank the time since its last report. A job
    the runtime cannot protect shows UNPROTECTED and why; a running job whose
    coordinator does not answer shows "coordinator LOST" (nothing migrates it).
    A migration or whole-job snapshot in flight shows its phase and for how
    long it has been in it, and the last migration how it ended.
    """
    rows = collect(obj.state_dir, job_id, timeout_s)
    if as_json:
        click.echo(json.dumps({"jobs": rows}, indent=1))
        exit_if_refused(job_id, rows)
        return
    if not rows:
        click.echo("no running torchpass jobs")
        return
    for row in rows:
        steps = "-" if row.get("min_step") is None else f"{row['min_step']}..{row['max_step']}"
        ranks = f"{row.get('registered_ranks', '?')}/{row.get('world_size') or '?'}"
        if row.get("coordinator_lost"):
            why = coordinator_lost.message(row["lost"]) if row.get("lost") else row["error"]
            reach = f"  coordinator LOST: the job is unprotected (no migrations): {why}"
        elif not row["reachable"]:
            reach = f"  UNREACHABLE: {row['error']}"
        else:
            reach = f"  UNPROTECTED: {row['unprotected']}" if row.get("unprotected") else ""
        click.echo(
            f"job {row['job_id']}  {row['slurm_state'] or '?'}  coordinator {row['coordinator']['endpoint']}"
            f" (pid {row['coordinator']['pid']} on {row['coordinator']['host']})  ranks {ranks}  step {steps}{reach}"
        )
        for line in activity_lines(row):
            click.echo(f"  {line}")
        for r in row.get("ranks", []):
            click.echo(f"  rank {r['rank']:>3}  {r['node']:<12} pid {r['pid']:<8} step {r['step']:<7}"
                       f" gen {r['generation']}  last report {r['last_report_age_s']:.1f}s ago")
    exit_if_refused(job_id, rows)
