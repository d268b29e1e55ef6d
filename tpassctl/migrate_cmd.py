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
from tpassctl.events_cmd import registration
from tpassctl.nodes_cmd import discover

DRAIN_TIMEOUT_S = 20.0  # tpassd's own scontrol call has a 15 s timeout


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
@click.pass_obj
def migrate(obj, job_id, node, to, endpoints, no_drain, as_json, timeout_s):
    """Move every rank of JOB_ID on NODE to a spare, without stopping the job.

    The coordinator queues the move behind any migration in flight and
    prints its id; follow it with `tpassctl events JOB_ID`. The request is
    authenticated with munge (the job's owner or root). An admin's move
    of another user's job also drains NODE (not with --no-drain).
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
        raise click.ClickException(
            f"job {job_id}: coordinator at {ep} did not answer within {timeout_s:g}s; "
            f"is the job still running? (tpassctl status {job_id})"
        ) from None
    except (AuthError, DependencyError) as exc:
        raise click.ClickException(f"job {job_id}: cannot authenticate to the coordinator: {exc}") from None
    except RemoteError as exc:
        if exc.code == "unknown_type":
            raise click.ClickException(
                f"job {job_id}: its coordinator does not support migrate (started by an older torchpass)"
            ) from None
        raise click.ClickException(f"job {job_id}: {exc.remote_message}") from None
    mid = res.get("migration")
    drained = admin_drain(job_id, node, endpoints) if not no_drain and admin_moves_others_job(info) else None
    if as_json:
        out = {"job_id": job_id, "migration": mid, "node": res.get("node", node),
               "to": res.get("to", to), "queued_behind": res.get("queued_behind", [])}
        if drained is not None:
            out["drain"] = drained
        click.echo(json.dumps(out, indent=1))
        return
    where = f" to {res.get('to') or to}" if (res.get("to") or to) else ""
    queued = res.get("queued_behind") or []
    after = f", queued behind {', '.join(queued)}" if queued else ""
    click.echo(f"migration {mid} of {node}{where} accepted for job {job_id}{after};"
               f" follow it: tpassctl events {job_id}")
    if drained is not None and drained.get("error"):
        click.echo(f"warning: {node} not drained: {drained['error']}", err=True)
    elif drained is not None:
        click.echo(f"{node} drained in Slurm: {drained['reason']}")


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
