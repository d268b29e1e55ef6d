"""`tpassctl nodes` and `tpassctl inject`: node health from every tpassd, and fault drills.

Nodes come from Slurm (name and NodeAddr; the tpassd control port is 718
unless --control-port says otherwise) or from --endpoint NODE=tcp://HOST:PORT.
Every request is munge-authenticated (socket: --munge-socket,
TORCHPASS_MUNGE_SOCKET, MUNGE_SOCKET, or munge's default).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import click

from torchpass import auth, zmqio
from torchpass.drill_kinds import KINDS
from torchpass.errors import ConfigError, DependencyError, RemoteError, SlurmError, TorchpassError
from torchpass.slurm import client
from torchpass.tpassd_ports import tpassd_ports


def _parse_endpoints(values: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for v in values:
        node, sep, ep = v.partition("=")
        if not sep or not node or not ep.startswith("tcp://"):
            raise click.BadParameter(f"{v!r}: use NODE=tcp://HOST:PORT", param_hint="--endpoint")
        out[node] = ep
    return out


def discover(endpoints: tuple[str, ...], only: tuple[str, ...], control_port: int | None) -> dict[str, dict[str, Any]]:
    """node -> {"endpoint", "slurm_state"}."""
    explicit = _parse_endpoints(endpoints)
    found: dict[str, dict[str, Any]] = {n: {"endpoint": ep, "slurm_state": None} for n, ep in explicit.items()}
    if not explicit:
        if control_port is None:
            try:
                control_port = tpassd_ports().control_port
            except ConfigError as exc:
                raise click.ClickException(f"{exc}; or pass --control-port")
        try:
            for n in client().nodes():
                found[n.name] = {"endpoint": f"tcp://{n.address}:{control_port}", "slurm_state": "+".join(n.state)}
        except (SlurmError, DependencyError) as exc:
            raise click.ClickException(f"cannot list nodes from Slurm ({exc}); pass --endpoint NODE=tcp://HOST:PORT")
    if only:
        missing = sorted(set(only) - set(found))
        if missing:
            raise click.ClickException(f"unknown node(s) {', '.join(missing)}; known: {', '.join(sorted(found))}")
        found = {n: found[n] for n in only}
    return found


def _ask(node: str, endpoint: str, type_: str, body: dict[str, Any], munge_socket: str | None,
         timeout_s: float, retries: int = 1) -> dict[str, Any]:
    return zmqio.request(endpoint, type_, body, timeout_s=timeout_s, retries=retries,
                         auth=auth.credential_for(type_, body, node, munge_socket))


_UNKNOWN_CHECKPOINT = {"state": "unknown", "detail": "tpassd unreachable"}


def node_health(node: str, info: dict[str, Any], munge_socket: str | None, timeout_s: float) -> dict[str, Any]:
    row: dict[str, Any] = {"node": node, "endpoint": info["endpoint"], "slurm_state": info.get("slurm_state")}
    try:
        h = _ask(node, info["endpoint"], "tpassd.health", {}, munge_socket, timeout_s)
    except RemoteError as exc:
        return {**row, "state": "unknown", "reasons": [f"tpassd refused the request: {exc}"],
                "last_heartbeat_age_s": None, "components": {}, "checkpoint": _UNKNOWN_CHECKPOINT}
    except TorchpassError as exc:
        return {**row, "state": "unknown", "reasons": [str(exc)], "last_heartbeat_age_s": None, "components": {},
                "checkpoint": _UNKNOWN_CHECKPOINT}
    return {**row, "state": h.get("state", "unknown"), "reasons": list(h.get("reasons", [])),
            "last_heartbeat_age_s": h.get("heartbeat_age_s"), "incarnation": h.get("incarnation"),
            "checkpoint": h.get("checkpoint") or {"state": "unknown", "detail": "tpassd did not say"},
            "components": {c: v.get("state") for c, v in h.get("components", {}).items()}}


_common = [
    click.option("--endpoint", "endpoints", multiple=True, metavar="NODE=tcp://HOST:PORT",
                 help="Ask this tpassd instead of discovering nodes from Slurm (repeatable)."),
    click.option("--control-port", type=int, default=None,
                 help="tpassd control port on nodes discovered from Slurm "
                      "[default: control_port of tpassd's config, /etc/torchpass/tpassd.toml or "
                      "$TORCHPASS_TPASSD_CONFIG]."),
    click.option("--munge-socket", envvar="TORCHPASS_MUNGE_SOCKET", default=None,
                 help="munged socket (env TORCHPASS_MUNGE_SOCKET)."),
    click.option("--timeout", "timeout_s", type=float, default=1.0, show_default=True,
                 help="Seconds to wait for each tpassd."),
    click.option("--json", "as_json", is_flag=True, help="Print JSON."),
]


def common(fn):
    for opt in reversed(_common):
        fn = opt(fn)
    return fn


@click.command("nodes")
@click.option("--node", "only", multiple=True, help="Only this node (repeatable).")
@common
def nodes(only, endpoints, control_port, munge_socket, timeout_s, as_json):
    """Health of every node's tpassd: state, reasons, last heartbeat age.

    MIGRATION says whether the node can dump and restore ranks (ready: a
    usable CRIU >= 4.0; unavailable: why not, e.g. criu missing or too old).
    """
    found = discover(endpoints, only, control_port)
    with ThreadPoolExecutor(max_workers=min(32, max(1, len(found)))) as pool:
        rows = list(pool.map(lambda n: node_health(n, found[n], munge_socket, timeout_s), sorted(found)))
    if as_json:
        click.echo(json.dumps({"t": time.time(), "nodes": rows}, indent=2))
        return
    if not rows:
        click.echo("no nodes")
        return
    w = max(len(r["node"]) for r in rows)
    click.echo(f"{'NODE':<{w}}  {'STATE':<8}  {'HEARTBEAT':>9}  {'MIGRATION':<11}  REASONS")
    for r in rows:
        age = r["last_heartbeat_age_s"]
        age_s = "-" if age is None else f"{age:.1f}s"
        reasons = r["reasons"] + ([f"migration unavailable: {r['checkpoint']['detail']}"]
                                  if r["checkpoint"]["state"] == "unavailable" else [])
        click.echo(f"{r['node']:<{w}}  {r['state']:<8}  {age_s:>9}  {r['checkpoint']['state']:<11}  "
                   f"{'; '.join(reasons) or '-'}")


@click.command("inject")
@click.option("--node", required=True, help="Node whose tpassd runs the drill.")
@click.option("--fault", "kind", required=True, type=click.Choice(KINDS), help="Fault to simulate ('clear' heals).")
@click.option("--gpu", type=click.IntRange(min=0), default=None, help="GPU index (GPU faults; default 0).")
@click.option("--port", default=None, help="IB port: DEVICE/PORT (e.g. mlx5_0/1) or an index (default 0).")
@click.option("--count", type=click.IntRange(min=1), default=None, help="Error count for storm/CRC/flap faults.")
@common
def inject(node, kind, gpu, port, count, endpoints, control_port, munge_socket, timeout_s, as_json):
    """Fault drill: make NODE's fake GPUs / fixture IB ports show a fault.

    Needs root or the owner of a job on that node, and a tpassd with drills on
    (fake NVML provider): real hardware is never touched.
    """
    info = discover(endpoints, (node,), control_port)[node]
    body: dict[str, Any] = {"kind": kind}
    if gpu is not None:
        body["gpu"] = gpu
    if port is not None:
        body["port"] = port
    if count is not None:
        body["count"] = count
    try:
        res = _ask(node, info["endpoint"], "tpassd.drill", body, munge_socket, max(timeout_s, 2.0),
                   retries=0)  # a drill is not idempotent: never send it twice
    except RemoteError as exc:
        raise click.ClickException(f"{node} refused the drill: {exc.remote_message} ({exc.code})") from None
    if as_json:
        click.echo(json.dumps(res, indent=2))
    else:
        click.echo(f"{node}: {res['applied']}")
