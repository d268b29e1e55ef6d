"""`tpassctl status`: every running torchpass job, its coordinator and ranks."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import click

from torchpass import auth, coordinator_lost, jobdir, layout, zmqio
from torchpass.errors import DependencyError, RemoteError, SlurmError, TorchpassError, UnreachableError
from torchpass.slurm import client
from torchpass.slurm.conf import job_privacy


def no_state_dir(state_dir: Path) -> click.ClickException:
    return click.ClickException(
        f"no torchpass state directory at {state_dir}; pass --state-dir or set TORCHPASS_STATE_DIR "
        "(for the devcluster: eval \"$(tpassctl devcluster env)\")"
    )


def not_visible(state_dir: Path, job_id: int) -> click.ClickException:
    """The one refusal for a job the caller may not see: the same line whether the job is another
    user's, running or ended, or does not exist, so the answer tells nothing about other users' jobs."""
    return click.ClickException(
        f"job {job_id}: no torchpass job of yours with this id in {state_dir} (only its owner or an "
        "admin can see a job; check the id and --state-dir)"
    )


def _slurm_owner(job_id: int) -> int | None:
    """The uid Slurm records for ``job_id``; None when Slurm does not know it (or cannot say)."""
    try:
        job = client().job(job_id)
    except (SlurmError, DependencyError, TorchpassError):
        return None
    return None if job is None else job.user_id


def visible_job(state_dir: Path, job_id: int, uid: int | None = None) -> tuple[int, int]:
    """(directory fd, owner uid) of STATE_DIR/jobs/JOB_ID when the caller may see the job: its
    owner (the owner of the directory, which only root makes) or an admin (root, SlurmUser).
    While Slurm knows the job, its owner there must be the directory's. Otherwise the one
    not_visible line. Close the fd."""
    if not state_dir.is_dir():
        raise no_state_dir(state_dir)
    uid = os.getuid() if uid is None else uid
    try:
        fd, owner = jobdir.open_job_dir(state_dir, job_id)
    except (FileNotFoundError, PermissionError, NotADirectoryError):
        raise not_visible(state_dir, job_id) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise not_visible(state_dir, job_id) from None
        raise click.ClickException(str(exc)) from None
    if uid != owner and uid not in job_privacy()[1]:
        os.close(fd)
        raise not_visible(state_dir, job_id)
    slurm_owner = _slurm_owner(job_id)
    if slurm_owner is not None and slurm_owner != owner:
        os.close(fd)
        raise click.ClickException(
            f"job {job_id}: {layout.job_dir(state_dir, job_id)} belongs to uid {owner} but Slurm says the job "
            f"is uid {slurm_owner}'s (a directory left by an earlier job {job_id}?); refused")
    return fd, owner


def discover_coordinators(state_dir: Path, uid: int | None = None) -> dict[int, dict[str, Any]]:
    """The registrations (STATE_DIR/jobs/J/coordinator.json) of the jobs the caller may see, by job id.

    A registration is keyed by the name of its directory and belongs to the directory's owner:
    jobs/ is root's alone and the SPANK plugin (root) makes jobs/J for job J's user. A file that
    names another job or another uid changes nothing. Slurm's agreement is checked by the caller.
    """
    if not state_dir.is_dir():
        raise no_state_dir(state_dir)
    uid = os.getuid() if uid is None else uid
    admin = uid in job_privacy()[1]
    try:
        names = jobdir.job_names(state_dir)
    except OSError as exc:
        raise click.ClickException(str(exc)) from None
    found: dict[int, dict[str, Any]] = {}
    for jid in names:
        try:
            fd, owner = jobdir.open_job_dir(state_dir, jid)
        except OSError:
            continue  # not ours to read, or gone meanwhile
        try:
            if owner != uid and not admin:
                continue
            info = jobdir.registration(fd, jid, owner)
        finally:
            os.close(fd)
        if info is not None:
            found[jid] = info
    return found


def job_registration(state_dir: Path, job_id: int) -> dict[str, Any]:
    """The coordinator registration of ``job_id``, a job the caller may see (visible_job); a
    one-line ClickException when it has none (ended, or not a --torchpass job)."""
    fd, owner = visible_job(state_dir, job_id)
    try:
        info = jobdir.registration(fd, job_id, owner)
    finally:
        os.close(fd)
    if info is None:
        raise click.ClickException(
            f"job {job_id} has no torchpass coordinator registered in {state_dir}"
            " (not a --torchpass job, not running, or a different --state-dir)"
        )
    return info


def collect(state_dir: Path, job_id: int | None, timeout_s: float) -> list[dict[str, Any]]:
    registrations = ({job_id: job_registration(state_dir, job_id)} if job_id is not None
                     else discover_coordinators(state_dir))
    slurm_jobs: dict[int, Any] = {}
    slurm_error = None
    try:
        for j in client().jobs(states=("RUNNING", "COMPLETING")):
            slurm_jobs[j.job_id] = j
    except (SlurmError, DependencyError) as exc:
        slurm_error = str(exc)
    rows = []
    for jid in sorted(registrations):
        info = registrations[jid]
        sj = slurm_jobs.get(jid)
        if slurm_error is None and sj is None and job_id is None:
            continue  # a leftover registration of a job that has ended
        if sj is not None and sj.user_id != info["uid"]:
            continue  # a directory left by an earlier job of this id: Slurm says whose job it is
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
                                           "last_migration", "torch_override") if k in st})
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
    (or only JOB_ID), and for each rank the time since its last report. You see
    your own jobs; root and SlurmUser see every job. Another user's job, or a
    job id with no torchpass job, gets one and the same line. A job
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
