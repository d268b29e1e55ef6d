"""`tpassctl migrate JOBID --node NODE [--to NODE]`: a planned migration, asked of the job's coordinator.

Who drains NODE after the move (docs/tpassd.md, "Drains"): the job's
coordinator asks NODE's tpassd as the job's owner, which tpassd grants only
for a degraded or failed node, so the owner's request leaves a healthy node
in service. An admin (root or SlurmUser) migrating another user's job wants
the node out: tpassctl then asks NODE's tpassd itself, right after the
coordinator accepted the move, with the reason ``torchpass: operator request
(admin uid N)``; tpassd checks with munge that the requester is an admin.
"""

from __future__ import annotations

import json
import os
from typing import Any

import click

from torchpass import auth, zmqio
from torchpass.errors import AuthError, DependencyError, RemoteError, TorchpassError, UnreachableError
from torchpass.slurm.conf import job_privacy
from torchpass.tpassd_ports import tpassd_ports
from tpassctl.context import state_dir_option
from tpassctl.events_cmd import registration
from tpassctl.exit_codes import REMOTE_NOT_FOUND, CliError
from tpassctl.follow import Feed, PhaseReport, wait_for
from tpassctl.nodes_cmd import discover

DRAIN_TIMEOUT_S = 20.0  # tpassd's own scontrol call has a 15 s timeout
# --wait without SECONDS: the policy's phase deadlines add up to a few minutes for a rank of
# tens of GB (docs/coordinator.md); a move still going after this is stuck.
DEFAULT_WAIT_S = 900.0


def wait_option(what: str):
    """``--wait [SECONDS]``, the same on migrate, snapshot and resume."""
    return click.option(
        "--wait", "wait_s", type=click.FloatRange(min=0), is_flag=False, flag_value=DEFAULT_WAIT_S, default=None,
        metavar="[SECONDS]",
        help=f"Follow {what} until it ends (at most SECONDS, default {DEFAULT_WAIT_S:g}): the live phase on a "
             "terminal, one line per phase otherwise, JSON lines with --json. Exit 0: done; 1: failed or "
             "rolled back; 3: not done in time.")


def migration_phase(mid: str):
    """phase_of for wait_for: the phase of migration ``mid`` in job.status ("queued" while another
    migration is in flight)."""
    def phase_of(st: dict[str, Any] | None) -> tuple[str, float | None] | None:
        m = (st or {}).get("migration")
        if m and m.get("id") == mid:
            return str(m["phase"]), m.get("phase_age_s")
        return ("queued", None) if m else None
    return phase_of


def migration_ended(mid: str):
    def final(ev: dict[str, Any]) -> bool:
        data = ev.get("data") or {}
        return data.get("migration") == mid and ("outcome" in data or ev.get("kind") == "migration.rejected")
    return final


def wait_migration(state_dir, job_id: int, mid: str, wait_s: float, as_json: bool) -> None:
    """Follow migration ``mid`` to its end; exit 0 when it completed, else a CliError (1: failed or
    rolled back; 3: not ended within ``wait_s``)."""
    report = PhaseReport(as_json)
    ev = wait_for(Feed(state_dir, job_id), wait_s, report, mid, migration_phase(mid), migration_ended(mid))
    if ev is None:
        raise CliError(f"job {job_id}: migration {mid} did not end within {wait_s:g}s; follow it: "
                       f"tpassctl events {job_id} --follow", "timeout")
    outcome = str((ev.get("data") or {}).get("outcome") or "rejected")
    report.outcome(ev.get("message", ""), {"job_id": job_id, "id": mid, "outcome": outcome, "event": ev})
    if outcome != "completed":
        raise CliError(f"job {job_id}: migration {mid} {outcome.replace('_', ' ')}", "failed")


def auth_target(job_id: int) -> str:
    """What an operator's munge credential for a coordinator request names as its target."""
    return f"job:{job_id}"


@click.command()
@click.argument("job_id", type=click.IntRange(min=1))
@click.option("--node", required=True, help="The node whose ranks move (it is drained and released after).")
@click.option("--to", "to", default=None, help="The spare to move to [default: the policy's choice].")
@click.option("--endpoint", "endpoints", multiple=True, metavar="NODE=tcp://HOST:PORT",
              help="Admins: NODE's tpassd to ask for the drain [default: from Slurm and tpassd's configured port].")
@click.option("--no-drain", is_flag=True,
              help="Admins: leave NODE in service (by default an admin's move of another user's job drains it).")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0.05), default=5.0, show_default=True,
              help="Seconds to wait for the coordinator's answer.")
@wait_option("the migration")
@state_dir_option
@click.pass_obj
def migrate(obj, job_id, node, to, endpoints, no_drain, as_json, timeout_s, wait_s):
    """Move every rank of JOB_ID on NODE to a spare, without stopping the job.

    The coordinator queues the move behind any migration in flight and
    prints its id; follow it with `tpassctl events JOB_ID` or --wait. The
    request is authenticated with munge (the job's owner or root). An
    admin's move of another user's job also drains NODE (not with --no-drain).
    """
    info = registration(obj.state_dir, job_id)
    body = {"node": node}
    if to is not None:
        body["to"] = to
    ep = info["endpoint"]
    try:
        # Not idempotent: no retry (a lost reply must not queue the move twice).
        res = zmqio.request(ep, "job.migrate", body, timeout_s=timeout_s, retries=0,
                            auth=auth.credential_for("job.migrate", body, auth_target(job_id)))
    except UnreachableError:
        raise CliError(
            f"job {job_id}: coordinator at {ep} did not answer within {timeout_s:g}s; "
            f"is the job still running? (tpassctl status {job_id})", "unreachable") from None
    except (AuthError, DependencyError) as exc:
        raise CliError(f"job {job_id}: cannot authenticate to the coordinator: {exc}", "refused") from None
    except RemoteError as exc:
        if exc.code == "unknown_type":
            raise CliError(
                f"job {job_id}: its coordinator does not support migrate (started by an older torchpass)") from None
        raise CliError(f"job {job_id}: {exc.remote_message}",
                       "not_found" if exc.code in REMOTE_NOT_FOUND else "refused") from None
    mid = res.get("migration")
    drained = admin_drain(job_id, node, endpoints) if not no_drain and admin_moves_others_job(info) else None
    queued = res.get("queued_behind") or []
    if as_json:
        out = {"job_id": job_id, "migration": mid, "node": res.get("node", node),
               "to": res.get("to", to), "queued_behind": queued}
        if drained is not None:
            out["drain"] = drained
        click.echo(json.dumps(out) if wait_s is not None else json.dumps(out, indent=1))
        if wait_s is not None:
            wait_migration(obj.state_dir, job_id, mid, wait_s, as_json)
        return
    where = f" to {res.get('to') or to}" if (res.get("to") or to) else ""
    after = f", queued behind {', '.join(queued)}" if queued else ""
    click.echo(f"migration {mid} of {node}{where} accepted for job {job_id}{after};"
               f" follow it: tpassctl events {job_id}")
    if drained is not None and drained.get("error"):
        click.echo(f"warning: {node} not drained: {drained['error']}", err=True)
    elif drained is not None:
        click.echo(f"{node} drained in Slurm: {drained['reason']}")
    if wait_s is not None:
        wait_migration(obj.state_dir, job_id, mid, wait_s, as_json)


def admin_moves_others_job(registration: dict[str, Any], uid: int | None = None) -> bool:
    """The caller is an admin (root, SlurmUser) and the job is not its own. The job's owner is
    the uid of its coordinator registration, which counts only when the file belongs to that uid
    (tpassctl.status_cmd.discover_coordinators): no user can make a file root or SlurmUser owns."""
    uid = os.getuid() if uid is None else uid
    return uid in job_privacy()[1] and registration.get("uid") != uid


def admin_drain(job_id: int, node: str, endpoints: tuple[str, ...] = ()) -> dict[str, Any]:
    """Ask NODE's tpassd to drain it for an admin: {"node", "reason", "health"} or {"node", "error"}."""
    reason = f"torchpass: operator request (admin uid {os.getuid()})"
    body = {"job_id": job_id, "reason": reason}
    try:
        ep = discover(endpoints, (node,), tpassd_ports().control_port)[node]["endpoint"]
        return zmqio.request(ep, "tpassd.drain", body, timeout_s=DRAIN_TIMEOUT_S, retries=0,
                             auth=auth.credential_for("tpassd.drain", body, node))
    except RemoteError as exc:
        return {"node": node, "error": f"its tpassd refused the drain: {exc.remote_message} ({exc.code})"}
    except (TorchpassError, click.ClickException) as exc:
        msg = exc.format_message() if isinstance(exc, click.ClickException) else str(exc)
        return {"node": node, "error": f"{msg}; drain it with scontrol"}
