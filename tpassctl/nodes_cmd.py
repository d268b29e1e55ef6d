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

from torchpass import auth, envnames, zmqio
from torchpass.drill_kinds import KINDS
from torchpass.errors import ConfigError, DependencyError, RemoteError, SlurmError, TorchpassError
from torchpass.health_state import State
from torchpass.slurm import client
from torchpass.tpassd_ports import tpassd_ports
from tpassctl.context import state_dir_option
from tpassctl.exit_codes import CliError, finish
from tpassctl.table import table


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
                raise CliError(f"{exc}; or pass --control-port", "usage") from None
        try:
            for n in client().nodes():
                found[n.name] = {"endpoint": f"tcp://{n.address}:{control_port}", "slurm_state": "+".join(n.state)}
        except (SlurmError, DependencyError) as exc:
            raise CliError(f"cannot list nodes from Slurm ({exc}); pass --endpoint NODE=tcp://HOST:PORT",
                           "unreachable") from None
    if only:
        missing = sorted(set(only) - set(found))
        if missing:
            raise CliError(f"unknown node(s) {', '.join(missing)}; known: {', '.join(sorted(found))}", "not_found")
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
        return {**row, "state": "unknown", "reachable": True, "refused": True,
                "reasons": [f"tpassd refused the request: {exc}"],
                "last_heartbeat_age_s": None, "components": {}, "checkpoint": _UNKNOWN_CHECKPOINT}
    except TorchpassError as exc:
        return {**row, "state": "unknown", "reachable": False, "reasons": [str(exc)], "last_heartbeat_age_s": None,
                "components": {},
                "checkpoint": _UNKNOWN_CHECKPOINT}
    return {**row, "state": h.get("state", "unknown"), "reachable": True, "reasons": list(h.get("reasons", [])),
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
    click.option("--munge-socket", envvar=envnames.MUNGE_SOCKET, default=None,
                 help="munged socket (env TORCHPASS_MUNGE_SOCKET)."),
    click.option("--timeout", "timeout_s", type=float, default=1.0, show_default=True,
                 help="Seconds to wait for each tpassd."),
    click.option("--json", "as_json", is_flag=True, help="Print JSON."),
    state_dir_option,
]


def common(fn):
    for opt in reversed(_common):
        fn = opt(fn)
    return fn


STATES = tuple(str(v) for v in State)  # healthy, degraded, failed, unknown (worst last but one)
# --check's threshold: the node states that count as unhealthy
UNHEALTHY_AT = {"degraded": ("degraded", "failed"), "failed": ("failed",)}


def _states(_ctx, _param, value: str | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    got = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [v for v in got if v not in STATES]
    if bad or not got:
        raise click.BadParameter(f"{value!r}: a comma-separated list of {', '.join(STATES)}")
    return got


def verdict(rows: list[dict[str, Any]], check: str | None) -> CliError | None:
    """The failure a nodes listing ends with. --check: a node at or past the threshold is unhealthy
    (exit 1); else one whose health is not known (exit 3). Without --check: a tpassd that did not
    answer (exit 3) or refused (exit 1): an empty answer is not a healthy cluster."""
    if check is not None:
        sick = [r["node"] for r in rows if r["state"] in UNHEALTHY_AT[check]]
        if sick:
            return CliError(f"unhealthy (at or past {check}): {', '.join(sick)}", "unhealthy")
        unknown = [r["node"] for r in rows if r["state"] == "unknown"]
        if unknown:
            return CliError(f"health not known: {', '.join(unknown)}", "unknown")
        return None
    silent = [r["node"] for r in rows if r.get("reachable") is False]
    if silent:
        return CliError(f"no answer from the tpassd of {', '.join(silent)}", "unreachable")
    refused = [r["node"] for r in rows if r.get("refused")]
    if refused:
        return CliError(f"the tpassd of {', '.join(refused)} refused the request", "refused")
    return None


NODE_HEADERS = ("NODE", "STATE", "HEARTBEAT", "MIGRATION", "REASONS")
RAILS_HEADER = "RAILS"


def rail_states(components: dict[str, str]) -> dict[str, str]:
    """The node's Ethernet data rails (tpassd's ``rail:NAME`` components) -> their states."""
    return {c.split(":", 1)[1]: state for c, state in sorted(components.items()) if c.startswith("rail:")}


def rails_cell(rails: dict[str, str]) -> str:
    """'rail0 healthy, rail1 failed': a rail's state is the rail's own; the node's STATE is failed
    only when none is usable (docs/tpassd.md, rails)."""
    return ", ".join(f"{name} {state}" for name, state in rails.items()) or "-"


@click.command("nodes")
@click.option("--node", "only", multiple=True, help="Only this node (repeatable).")
@click.option("--state", "states", callback=_states, default=None, metavar="LIST",
              help=f"Only nodes in these states (comma-separated: {', '.join(STATES)}).")
@click.option("--check", type=click.Choice(tuple(UNHEALTHY_AT)), is_flag=False, flag_value="degraded", default=None,
              metavar="[=degraded|failed]",
              help="For NHC and scripts: exit 1 if a node is at or past this state (default degraded), "
                   "else 3 if a node's health is unknown, else 0.")
@common
def nodes(only, states, check, endpoints, control_port, munge_socket, timeout_s, as_json):
    """Health of every node's tpassd: state, reasons, last heartbeat age.

    MIGRATION says whether the node can dump and restore ranks (ready: a
    usable CRIU >= 4.0; unavailable: why not, e.g. criu missing or too old).
    RAILS (where nodes have data rails, tpassd's rails key) is each rail's
    state; a rail down fails the node only when no rail is usable.
    Exit 3 when a tpassd did not answer, 1 when one refused; with --check,
    1 when a node is unhealthy and 3 when one's health is not known.
    """
    found = discover(endpoints, only, control_port)
    with ThreadPoolExecutor(max_workers=min(32, max(1, len(found)))) as pool:
        rows = list(pool.map(lambda n: node_health(n, found[n], munge_socket, timeout_s), sorted(found)))
    if states is not None:
        rows = [r for r in rows if r["state"] in states]
    failure = verdict(rows, check)
    for r in rows:
        r["rails"] = rail_states(r.get("components", {}))
    # The RAILS column only where some node has data rails: the table stays as it was elsewhere.
    with_rails = any(r["rails"] for r in rows)
    if not as_json:
        if not rows:
            click.echo("no nodes")
        else:
            headers = NODE_HEADERS[:4] + ((RAILS_HEADER,) if with_rails else ()) + NODE_HEADERS[4:]
            for line in table(headers, [
                    (r["node"], r["state"],
                     None if r["last_heartbeat_age_s"] is None else f"{r['last_heartbeat_age_s']:.1f}s",
                     r["checkpoint"]["state"],
                     *((rails_cell(r["rails"]),) if with_rails else ()),
                     "; ".join(r["reasons"] + ([f"migration unavailable: {r['checkpoint']['detail']}"]
                                              if r["checkpoint"]["state"] == "unavailable" else [])))
                    for r in rows], right=("HEARTBEAT",)):
                click.echo(line)
    finish(as_json, {"t": time.time(), "nodes": rows}, failure)


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
        raise CliError(f"{node} refused the drill: {exc.remote_message} ({exc.code})", "refused") from None
    if as_json:
        click.echo(json.dumps(res, indent=2))
    else:
        click.echo(f"{node}: {res['applied']}")
