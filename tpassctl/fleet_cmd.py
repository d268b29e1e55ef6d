"""`tpassctl fleet`: audit the nodes, merge the fleet's history, rank suspect nodes (docs/fleet.md)."""

from __future__ import annotations

import json
import os
import pwd
import sqlite3
import sys
import time
from pathlib import Path

import click

from torchpass import envnames
from torchpass.errors import SlurmError
from torchpass.fleet import audit as A
from torchpass.fleet import records as R
from torchpass.fleet import report as F
from torchpass.fleet.ingest import WriterLock, ingest
from torchpass.fleet.store import DEFAULT_STORE, Retention, SqliteStore
from torchpass.slurm import client
from torchpass.slurm.conf import job_privacy
from tpassctl.context import state_dir_option
from tpassctl.exit_codes import CliError
from tpassctl.table import table

store_option = click.option("--store", "store_path", type=click.Path(path_type=Path, dir_okay=False),
                            default=DEFAULT_STORE, show_default=True, help="The fleet history (SQLite).")


@click.group()
def fleet():
    """Audit the fleet's nodes and links, and keep and rank its history (docs/fleet.md)."""


def _say():
    """Progress goes to stderr (with the seconds since the start), so --json keeps stdout one JSON object."""
    t0 = time.monotonic()
    return lambda line: click.echo(f"fleet audit: {time.monotonic() - t0:6.1f}s {line}", err=True)


def _scontrol(*args: str) -> None:
    import subprocess
    p = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        raise SlurmError(f"scontrol {' '.join(args[:2])} failed: {p.stderr.strip() or p.stdout.strip()}")


@fleet.command("audit")
@click.option("--nodes", "nodes_csv", default="", help="Comma-separated nodes [default: every idle node].")
@click.option("--rails", default=None, help="Data rail interfaces to check, comma-separated "
                                            "[default: $TORCHPASS_DATA_RAILS; none: links not checked].")
@click.option("--job-python", default=None, help="The interpreter on the nodes [default: $TORCHPASS_JOB_PYTHON, "
                                                 "else python3].")
@click.option("--backend", type=click.Choice(["gloo"]), default="gloo", show_default=True,
              help="Process group of the link check (NCCL on GPU nodes: the same pairs; not built yet).")
@click.option("--drain", is_flag=True, help="Drain the nodes the audit names (reason 'torchpass-audit: ...').")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@state_dir_option
@click.pass_obj
def audit_cmd(obj, nodes_csv, rails, job_python, backend, drain, as_json):
    """Validate idle nodes with ordinary Slurm jobs and name the outliers: a compute check per node
    (one node at a time, timed and its result checked), bandwidth and latency of every pair per
    data rail (gloo), dcgmi/ibstat/nvlink where present. Drained nodes are audited only by root,
    inside a maintenance reservation, and drained again after. Exit 1 when a node or link is named."""
    root = os.geteuid() == 0
    say = _say()
    slurm = client()
    wanted = tuple(n for n in nodes_csv.split(",") if n) or None
    infos = slurm.nodes()
    p = A.plan(infos, wanted, root)
    for n, why in sorted(p.skipped.items()):
        say(f"{n}: skipped: {why}")
    if not p.audit:
        raise CliError("no node to audit (none idle)", "refused")
    rails_t = tuple(r for r in (rails if rails is not None else os.environ.get(envnames.DATA_RAILS, "")).split(",")
                    if r)
    py = job_python or os.environ.get(envnames.JOB_PYTHON) or "python3"
    reservation = None
    reasons = {n.name: n.reason for n in infos}
    if root:
        reservation = f"torchpass-audit-{os.getpid()}"
        _scontrol("create", "reservation", f"ReservationName={reservation}", "StartTime=now", "Duration=60",
                  "Users=root", f"Nodes={','.join(p.audit)}", "Flags=maint,ignore_jobs")
        say(f"reservation {reservation} on {', '.join(p.audit)}")
    try:
        for n in p.drained:
            _scontrol("update", f"NodeName={n}", "State=RESUME")
        runner = A.Runner(py, rails_t, dict(os.environ), say, reservation=reservation)
        addresses = {n.name: n.address for n in infos}
        res = A.audit(p, runner, addresses)
    finally:
        for n in p.drained:  # back to drained with its own reason; --drain below may replace it
            reason = reasons.get(n) or "drained before the audit"
            _scontrol("update", f"NodeName={n}", "State=DRAIN", f"Reason={reason}")
        if reservation:
            _scontrol("delete", f"ReservationName={reservation}")
    v = res.verdict
    if drain and v is not None:
        for n, outs in v.nodes.items():
            res.drained[n] = A.reason_for(outs)
            slurm.drain(n, res.drained[n])
        for (n, rail), outs in v.links.items():
            if n not in res.drained:
                res.drained[n] = A.reason_for(outs).replace("torchpass-audit: ", f"torchpass-audit: {rail} ")
                slurm.drain(n, res.drained[n])
    if root:
        try:
            ap = R.SpoolAppender(R.spool_dir(obj.state_dir), f"audit-{os.uname().nodename.split('.')[0]}")
            for rec in res.records(time.time()):
                ap.append(rec)
        except OSError as exc:
            res.notes.append(f"results not spooled: {exc}")
    named = bool(v and (v.nodes or v.links))
    if as_json:
        click.echo(json.dumps(res.as_dict(), indent=1))
    else:
        rows = [[n, f"{c.get('seconds', 0):.3f}", c.get("engine", "?"),
                 "FAILED" if n in res.failed else "ok"] for n, c in sorted(res.compute.items())]
        click.echo("\n".join(table(["node", "compute_s", "engine", "checksum"], rows)))
        for n, outs in sorted((v.nodes if v else {}).items()):
            click.echo(f"NODE {n}: {A.reason_for(outs).removeprefix('torchpass-audit: ')}")
        for (n, rail), outs in sorted((v.links if v else {}).items()):
            click.echo(f"LINK {n} {rail}: {A.reason_for(outs).removeprefix('torchpass-audit: ')}")
        if not named:
            click.echo(f"no outlier among {len(p.audit)} node(s)")
        for note in res.notes:
            click.echo(f"note: {note}")
        click.echo(f"audit took {res.seconds:.1f} s")
    sys.exit(1 if named else 0)


@fleet.command("ingest")
@store_option
@click.option("--retention-days", type=click.FloatRange(min=0, min_open=True), default=Retention.days,
              show_default=True)
@click.option("--max-rows", type=click.IntRange(min=1), default=Retention.max_rows, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@state_dir_option
@click.pass_obj
def ingest_cmd(obj, store_path, retention_days, max_rows, as_json):
    """Merge the spool (tpassd, audits) and the jobs' event logs into the store: the one writer
    (root; an flock on STORE.lock keeps it to one)."""
    if os.geteuid() != 0:
        raise CliError("fleet ingest is root's: it reads the spool and the jobs' event logs", "refused")
    with WriterLock(store_path):
        store = SqliteStore(store_path)
        res = ingest(store, obj.state_dir, time.time(), Retention(retention_days, max_rows))
        store.close()
    click.echo(json.dumps(res.as_dict()) if as_json else
               f"ingested {res.spooled} spooled and {res.job_records} job record(s); "
               f"{res.refused_lines} line(s) refused, {res.pruned} pruned")


@fleet.command("report")
@store_option
@click.option("--since", type=click.FloatRange(min=0), default=None,
              help="Only records of the last this many hours [default: all kept].")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Also draw each node's events on a timeline into this PNG (the plot extra).")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@state_dir_option
@click.pass_obj
def report_cmd(obj, store_path, since, plot_path, as_json):
    """Rank suspect nodes by the score of docs/fleet.md (audit outliers, health events, ranks moved
    off, jobs affected). Run as root it ingests first. With PrivateData=jobs only root and SlurmUser
    see every record; others see their own jobs' records and the nodes those ran on."""
    uid = os.geteuid()
    if uid == 0:
        with WriterLock(store_path):
            store = SqliteStore(store_path)
            ingest(store, obj.state_dir, time.time())
    else:
        try:
            store = SqliteStore(store_path, readonly=True)
        except (OSError, sqlite3.Error, R.FleetError) as exc:  # an unreadable file, the usual one
            raise CliError(f"cannot read the fleet history {store_path} ({exc}); with PrivateData=jobs it is "
                           "root's (ask an admin)", "refused") from None
    private, admins = job_privacy()
    viewer = F.viewer_for(uid, pwd.getpwuid(uid).pw_name, private, admins)
    recs = F.visible(store.records(None if since is None else time.time() - since * 3600), viewer)
    store.close()
    ranked = F.rank(recs)
    if plot_path is not None:
        from torchpass.fleet import plot
        plot.draw(recs, [s.node for s in ranked], plot_path)
    if as_json:
        click.echo(json.dumps({"nodes": [s.as_dict() for s in ranked], "records": len(recs),
                               "sees_all": viewer.sees_all}, indent=1))
        return
    rows = [[s.node, s.score, s.audit_outliers, s.rail_outliers, s.failed, s.degraded, s.migrations_out,
             s.ranks_moved, len(s.jobs)] for s in ranked]
    click.echo("\n".join(table(["node", "score", "audit", "rail", "failed", "degraded", "migr_out", "ranks_moved",
                                "jobs"], rows)))
    if plot_path is not None:
        click.echo(f"timeline: {plot_path}")
