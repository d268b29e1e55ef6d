"""`tpassctl devcluster`: a real local Slurm cluster in network namespaces."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import click

from torchpass.devcluster import Devcluster, DevclusterSpec
from torchpass.devcluster.cluster import DEFAULT_BASE_DIR, DEFAULT_JOB_USERS
from torchpass.devcluster.gpus import parse_gpus
from torchpass.devcluster.rails import MAX_RAILS
from torchpass.errors import DevclusterError

name_option = click.option("--name", default="dev", show_default=True,
                           help="Cluster name (1-8 lowercase letters/digits).")
base_option = click.option("--base-dir", type=click.Path(path_type=Path, file_okay=False), default=DEFAULT_BASE_DIR,
                           show_default=True, help="Where cluster run directories live.")


@click.group()
def devcluster():
    """A local Slurm cluster on this machine: munged, slurmctld, one slurmd + tpassd per node.

    Each node is a network, UTS and mount namespace with its own address and
    hostname. Needs root and the system packages ('make deps'). 'crash' and
    'revive' drill a node lost outright (a power cut) and its return; 'slow'
    a node that only slows down; 'kill-gpu' a GPU that falls off the bus under a rank; 'link' a data
    rail pulled, flapping or degraded.
    """


@devcluster.command()
@name_option
@base_option
@click.option("--nodes", type=click.IntRange(1, 16), default=4, show_default=True)
@click.option("--subnet", default="10.77.0", show_default=True,
              help="First three octets of a private /24 for the nodes.")
@click.option("--no-tpassd", is_flag=True, help="Do not start a tpassd on each node.")
@click.option("--user", "users", multiple=True,
              help="An ordinary job user to create if missing (repeatable) [default: tpuser1, tpuser2].")
@click.option("--job-python", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Interpreter jobs run; every job user must be able to run it [default: the job venv, make jobvenv].")
@click.option("--cgroups", is_flag=True,
              help="Run Slurm's cgroup plugins as production clusters do: proctrack/cgroup, task/cgroup+affinity, "
                   "ConstrainCores, ConstrainRAMSpace (cgroup v1; each node its own cgroup subtree).")
@click.option("--rails", type=click.IntRange(0, MAX_RAILS), default=0, show_default=True,
              help="Data rails per node (rail0, rail1, ...), each on its own bridge, beside the management "
                   "network (eth0: Slurm, munge, tpassd, coordinator, rendezvous) that drills never pull.")
@click.option("--gpus", "gpu_counts", default=None, metavar="N|N,N,...",
              help="Fake GPUs as Slurm GRES: N on every node, or one count per node (2,2,2,1). Each node gets "
                   "its own char devices (a major no driver has), gres.conf File= lines and ConstrainDevices=yes; "
                   "its tpassd's fake NVML reports the same GPUs. Implies --cgroups.")
def up(name, base_dir, nodes, subnet, no_tpassd, users, job_python, cgroups, rails, gpu_counts):
    """Bring the cluster up (replacing any leftover of the same name)."""
    try:
        counts = parse_gpus(gpu_counts, nodes) if gpu_counts is not None else ()
    except DevclusterError as exc:
        raise click.BadParameter(str(exc), param_hint="--gpus") from None
    cgroups = cgroups or any(counts)
    c = Devcluster.up(DevclusterSpec(name=name, nodes=nodes, subnet=subnet, base_dir=base_dir, tpassd=not no_tpassd,
                                     job_users=tuple(users) or DEFAULT_JOB_USERS, job_python=job_python,
                                     cgroups=cgroups, rails=rails, gpus=counts))
    mode = " (Slurm cgroup plugins)" if cgroups else ""
    mode += f" with fake GPUs {','.join(map(str, counts))} (GRES, ConstrainDevices)" if any(counts) else ""
    mode += f" with {rails} data rail(s): {', '.join(c.spec.rail_interfaces)}" if rails else ""
    click.echo(f"devcluster {name!r} up{mode}: {', '.join(c.node_names)} on {subnet}.0/24")
    click.echo(f"job users: {', '.join(c.job_users)}; job Python: {c.job_python}")
    click.echo(f'use it with: eval "$(tpassctl devcluster env --name {name})"')


@devcluster.command()
@name_option
@base_option
def down(name, base_dir):
    """Stop every process and remove every namespace, link and file of the cluster."""
    Devcluster(DevclusterSpec(name=name, base_dir=base_dir)).down()
    click.echo(f"devcluster {name!r} down")


@devcluster.command()
@name_option
@base_option
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def status(name, base_dir, as_json):
    """Processes and Slurm node states of the cluster."""
    st = Devcluster.attach(name, base_dir).status()
    if as_json:
        click.echo(json.dumps(st, indent=1))
        return
    click.echo(f"devcluster {st['name']} ({st['run_dir']})")
    for role, p in sorted(st["processes"].items()):
        click.echo(f"  {role:<16} pid {p['pid']:<8} {'running' if p['alive'] else 'DEAD'}")
    for n in st["nodes"]:
        if "error" in n:
            click.echo(f"  slurm: {n['error']}")
        else:
            crashed = " (crashed: a drill)" if n["name"] in st.get("crashed", []) else ""
            click.echo(f"  {n['name']:<8} {n['address']:<12} {'+'.join(n['state'])}{crashed} {n.get('reason') or ''}")


def _node_drill(fn):
    """A drill on one NODE of a cluster: ``fn(cluster, node)`` returns (what --json prints, the line)."""

    @click.argument("node")
    @name_option
    @base_option
    @click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
    def command(node, name, base_dir, as_json):
        result, line = fn(Devcluster.attach(name, base_dir), node)
        click.echo(json.dumps({"node": node, **result}) if as_json else line)

    command.__doc__ = fn.__doc__
    return devcluster.command(fn.__name__)(command)


@_node_drill
def crash(c: Devcluster, node: str) -> tuple[dict, str]:
    """A power cut of NODE (a drill): its network goes down, then every process of it
    (slurmd, tpassd, job steps, ranks: whatever runs in its namespaces) is killed with
    SIGKILL at once. slurmctld marks it DOWN once it stops answering (SlurmdTimeout).
    'revive NODE' brings it back."""
    killed = c.crash(node)
    return {"killed": killed}, f"{node} crashed: network down, {len(killed)} processes killed"


@_node_drill
def revive(c: Devcluster, node: str) -> tuple[dict, str]:
    """Bring a crashed NODE back: network up, slurmd and tpassd started as at bring-up.
    slurmctld returns it to service when its slurmd registers (ReturnToService=2);
    a drain set meanwhile stays until 'scontrol update NodeName=NODE State=RESUME'."""
    c.revive(node)
    daemons = "slurmd and tpassd" if c.spec.tpassd else "slurmd"
    return {"revived": True}, f"{node} revived: {daemons} started; slurmctld returns it to service when it registers"


@devcluster.command("kill-gpu")
@click.argument("node")
@click.option("--gpu", type=click.IntRange(min=0), default=0, show_default=True, help="The GPU's index on NODE.")
@name_option
@base_option
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def kill_gpu(node, gpu, name, base_dir, as_json):
    """A GPU falls off the bus under a rank (a drill): NODE's fake GPU N reports Xid 79 and is
    lost to NVML (tpassd's xid79 drill), and the ranks of NODE whose SLURM_LOCALID is N are
    killed with SIGKILL, found by the pids their task wrappers recorded (never by name). Under
    srun torchrun: the task's workers whose LOCAL_RANK is N; their agent sees them die."""
    result = Devcluster.attach(name, base_dir).kill_gpu(node, gpu)
    if as_json:
        click.echo(json.dumps({"node": node, **result}))
        return
    ranks = ", ".join(f"job {k['job']} rank {k['rank']} (pid {k['pid']})" for k in result["killed"]) or "no rank"
    click.echo(f"{node} gpu{gpu}: {result['applied']}; killed {ranks}")


@devcluster.command()
@click.argument("node")
@click.option("--cpu", "cpu", required=True, metavar="PCT|clear",
              help="CPU quota in percent of one CPU (1-100; 100 or 'clear' lifts it).")
@click.option("--for", "for_s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Lift the quota again after this many seconds.")
@name_option
@base_option
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def slow(node, cpu, for_s, name, base_dir, as_json):
    """Slow NODE down (a fail-slow drill): its processes (everything running on it but its
    tpassd: slurmd and the steps it starts later too) get PCT % of one CPU, through a CPU cgroup of
    their own (cgroup v2 cpu.max, else v1 cpu.cfs_quota_us). '--cpu 100' or '--cpu clear' lifts it."""
    text = str(cpu).strip().lower()
    if text == "clear":
        pct = 100
    elif text.isdigit() and 1 <= int(text) <= 100:
        pct = int(text)
    else:
        raise click.BadParameter(f"{cpu!r} is not a percentage 1-100 or 'clear'", param_hint="--cpu")
    result = Devcluster.attach(name, base_dir).slow(node, pct, for_s)
    if as_json:
        click.echo(json.dumps({"node": node, **result}))
    elif pct >= 100:
        click.echo(f"{node}: CPU quota lifted ({result['processes']} processes)")
    else:
        until = f" for {for_s:g} s" if for_s else ""
        click.echo(f"{node} slowed to {pct} % of one CPU{until} ({result['processes']} processes, {result['cgroup']})")


@devcluster.command()
@click.argument("node")
@click.argument("action", metavar="down|up|flap|clear|rate=MBIT|loss=PCT|delay=MS")
@click.option("--rail", type=click.IntRange(0, MAX_RAILS - 1), required=True, help="The data rail (0 = rail0).")
@click.option("--times", type=click.IntRange(1, 100), default=5, show_default=True, help="flap: how many times.")
@click.option("--period", "period_s", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True,
              help="flap: seconds per down+up cycle.")
@name_option
@base_option
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def link(node, action, rail, times, period_s, name, base_dir, as_json):
    """A link drill on NODE's data rail, on both ends as a cable would: 'down' pulls it (switch port down,
    node end without carrier), 'up' plugs it back, 'flap' does both --times times, 'rate=MBIT' limits both
    directions (tc tbf; rate=0 lifts it), 'loss=PCT' drops that share of packets both ways (nftables numgen;
    loss=0 lifts it), 'delay=MS' needs the kernel's sch_netem, 'clear' undoes them all. The management
    network is never touched."""
    line = Devcluster.attach(name, base_dir).link(node, rail, action, times=times, period_s=period_s)
    click.echo(json.dumps({"node": node, "rail": rail, "action": action, "done": line}) if as_json else line)


@devcluster.command()
@name_option
@base_option
@click.option("--json", "as_json", is_flag=True, help="Print the variables as JSON.")
def env(name, base_dir, as_json):
    """Print shell exports so that sbatch/squeue/tpassctl talk to the cluster."""
    variables = Devcluster.attach(name, base_dir).env()
    if as_json:
        click.echo(json.dumps(variables, indent=1))
        return
    for k, v in variables.items():
        click.echo(f"export {k}={shlex.quote(v)}")
