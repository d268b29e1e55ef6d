"""`tpassctl migrate JOBID --node NODE [--to NODE]`: a planned migration, asked of the job's coordinator."""

from __future__ import annotations

import json

import click

from torchpass import auth, zmqio
from torchpass.errors import AuthError, DependencyError, RemoteError, UnreachableError
from tpassctl.events_cmd import registration


def auth_target(job_id: int) -> str:
    """What an operator's munge credential for a coordinator request names as its target."""
    return f"job:{job_id}"


@click.command()
@click.argument("job_id", type=click.IntRange(min=1))
@click.option("--node", required=True, help="The node whose ranks move (it is drained and released after).")
@click.option("--to", "to", default=None, help="The spare to move to [default: the policy's choice].")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0.05), default=5.0, show_default=True,
              help="Seconds to wait for the coordinator's answer.")
@click.pass_obj
def migrate(obj, job_id, node, to, as_json, timeout_s):
    """Move every rank of JOB_ID on NODE to a spare, without stopping the job.

    The coordinator queues the move behind any migration in flight and
    prints its id; follow it with `tpassctl events JOB_ID`. The request is
    authenticated with munge (the job's owner or root).
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
    if as_json:
        click.echo(json.dumps({"job_id": job_id, "migration": mid, "node": res.get("node", node),
                               "to": res.get("to", to), "queued_behind": res.get("queued_behind", [])}, indent=1))
        return
    where = f" to {res.get('to') or to}" if (res.get("to") or to) else ""
    queued = res.get("queued_behind") or []
    after = f", queued behind {', '.join(queued)}" if queued else ""
    click.echo(f"migration {mid} of {node}{where} accepted for job {job_id}{after}; follow it: tpassctl events {job_id}")
