"""Data rails of the devcluster and the link drills that act on them.

A node of a cluster brought up with ``--rails N`` has, beside its management interface
``eth0`` (Slurm, munge, tpassd, the coordinator and the rendezvous store: never pulled), N
data interfaces ``rail0..railN-1``. Rail r of every node is one end of a veth pair whose
other end sits on the cluster's bridge for that rail (``tp-NAME-rR``), as a NIC is cabled to
the rail's switch. The bridges carry no host address: the rails' private /24s
(``RAIL_SUBNET_BASE + r``) exist only inside the nodes' namespaces, so two clusters can use
the same rail addresses and no rail traffic can leave this machine.

A drill acts on both ends as a cable would:

- ``down``: the switch end goes down, so the node's end loses its carrier (admin up,
  NO-CARRIER: what a node sees of a pulled cable) and the switch port is down too;
  ``up`` brings the switch end back.
- ``rate=MBIT``: a tbf qdisc on both ends' egress (the node's sends and what it receives);
  ``rate=0`` removes it.
- ``loss=PCT``: an nftables ``numgen random`` drop rule in the node's namespace on the
  rail's input and output; ``loss=0`` removes it.
- ``delay=MS``: netem, where the kernel has sch_netem; this one has not and loads no
  modules, so the drill says so in one line.
- ``flap``: down and up ``times`` times, ``period_s`` apart.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from torchpass.errors import DevclusterError

MAX_RAILS = 4
# Rail r's addresses: 192.168.(RAIL_SUBNET_BASE + r).(10 + node index)/24, only inside the nodes.
RAIL_SUBNET_BASE = 100
NFT_TABLE = "torchpass_linkpass"
# tbf needs a burst of at least rate/HZ bytes (64 KiB: 5 Gbit/s at HZ=1000), and a
# latency bound so that a slowed rail queues, never drops, what the sender has in flight.
_TBF_BURST = "64kb"
_TBF_LATENCY = "400ms"

_ACTION_RE = re.compile(r"^(down|up|flap|clear|rate=\d+|loss=\d+(?:\.\d+)?|delay=\d+)$")


def rail_interface(rail: int) -> str:
    """The node's name of its data interface for ``rail`` (what tpassd's rails config and the
    runtime's TORCHPASS_DATA_RAILS name)."""
    return f"rail{rail}"


def rail_bridge(cluster: str, rail: int) -> str:
    return f"tp-{cluster}-r{rail}"


def rail_veth(cluster: str, node_index: int, rail: int) -> str:
    """The switch end of a node's rail (15 characters at most: IFNAMSIZ)."""
    return f"tp{cluster}{node_index}r{rail}"


def rail_address(rail: int, node_index: int) -> str:
    return f"192.168.{RAIL_SUBNET_BASE + rail}.{10 + node_index}"


@dataclass(frozen=True)
class LinkAction:
    """One parsed drill: ``kind`` is down, up, flap, clear, rate, loss or delay."""

    kind: str
    value: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LinkAction:
        text = text.strip().lower()
        if not _ACTION_RE.match(text):
            raise DevclusterError(f"link action {text!r} is not one of down, up, flap, clear, rate=MBIT, "
                                  "loss=PCT, delay=MS")
        kind, _, value = text.partition("=")
        action = cls(kind, float(value) if value else 0.0)
        if kind == "loss" and not 0 <= action.value <= 100:
            raise DevclusterError(f"loss={value} is not a percentage 0-100")
        return action


Runner = Callable[..., subprocess.CompletedProcess]


def _run(argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, input=stdin, capture_output=True, text=True)


class RailLinks:
    """The link drills of one cluster. ``ns_argv(node)`` enters the node's namespaces;
    ``run`` is the command runner (tests record commands through it)."""

    def __init__(self, cluster: str, node_index: Callable[[str], int], ns_argv: Callable[[str], list[str]],
                 rails: int, run: Runner = _run, sleep: Callable[[float], None] = time.sleep):
        self.cluster = cluster
        self.node_index = node_index
        self.ns_argv = ns_argv
        self.rails = rails
        self._run = run
        self._sleep = sleep

    def _check(self, argv: list[str]) -> subprocess.CompletedProcess:
        proc = self._run(argv)
        if proc.returncode != 0:
            err = " ".join((proc.stderr or proc.stdout or "").split())[:300]
            raise DevclusterError(f"'{' '.join(argv)}' failed: {err}")
        return proc

    def act(self, node: str, rail: int, action: LinkAction, *, times: int = 5, period_s: float = 2.0) -> str:
        """Apply ``action`` to ``node``'s ``rail``; returns one line saying what was done."""
        if not 0 <= rail < self.rails:
            raise DevclusterError(f"devcluster {self.cluster!r} has {self.rails} data rail(s); "
                                  f"--rail {rail} is not one" + ("" if self.rails else " (bring it up with --rails N)"))
        i = self.node_index(node)
        switch_end, node_end = rail_veth(self.cluster, i, rail), rail_interface(rail)
        inside = self.ns_argv(node)
        if action.kind == "down":
            self._check(["ip", "link", "set", switch_end, "down"])
            return f"{node} {node_end}: down (cable pulled: switch port down, node end without carrier)"
        if action.kind == "up":
            self._check(["ip", "link", "set", switch_end, "up"])
            return f"{node} {node_end}: up"
        if action.kind == "flap":
            if times < 1 or period_s <= 0:
                raise DevclusterError("a flap needs --times >= 1 and --period > 0")
            for _ in range(times):
                self._check(["ip", "link", "set", switch_end, "down"])
                self._sleep(period_s / 2)
                self._check(["ip", "link", "set", switch_end, "up"])
                self._sleep(period_s / 2)
            return f"{node} {node_end}: flapped {times} times, {period_s:g} s apart"
        if action.kind == "rate":
            self._set_rate(inside, node_end, switch_end, action.value)
            return (f"{node} {node_end}: rate limit removed" if action.value == 0
                    else f"{node} {node_end}: limited to {action.value:g} Mbit/s both ways")
        if action.kind == "loss":
            self._set_loss(inside, node_end, action.value)
            return (f"{node} {node_end}: loss removed" if action.value == 0
                    else f"{node} {node_end}: {action.value:g} % of packets dropped both ways")
        if action.kind == "delay":
            return self._set_delay(inside, node_end, switch_end, action.value, node)
        # clear: everything back as at bring-up
        self._check(["ip", "link", "set", switch_end, "up"])
        self._set_rate(inside, node_end, switch_end, 0)
        self._set_loss(inside, node_end, 0)
        return f"{node} {node_end}: up, no rate limit, no loss"

    def _set_rate(self, inside: list[str], node_end: str, switch_end: str, mbit: float) -> None:
        for prefix, dev in ((inside, node_end), ([], switch_end)):
            # `del` of an absent root qdisc fails ("no qdisc"): the rail has none, as wanted.
            self._run([*prefix, "tc", "qdisc", "del", "dev", dev, "root"])
            if mbit > 0:
                self._check([*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit:g}mbit",
                             "burst", _TBF_BURST, "latency", _TBF_LATENCY])

    def _set_loss(self, inside: list[str], node_end: str, pct: float) -> None:
        nft = [*inside, "nft"]
        self._run([*nft, "delete", "table", "inet", f"{NFT_TABLE}_{node_end}"])
        if pct <= 0:
            return
        # numgen counts in whole percent per packet; 0.5 % rounds to 1 in 100 (at least one).
        keep_below = max(1, round(pct))
        table = f"{NFT_TABLE}_{node_end}"
        rules = (
            f"table inet {table} {{\n"
            f"  chain out {{ type filter hook output priority 0; oifname \"{node_end}\" "
            f"numgen random mod 100 < {keep_below} drop; }}\n"
            f"  chain in {{ type filter hook input priority 0; iifname \"{node_end}\" "
            f"numgen random mod 100 < {keep_below} drop; }}\n"
            f"}}\n"
        )
        proc = self._run([*nft, "-f", "-"], stdin=rules)
        if proc.returncode != 0:
            err = " ".join((proc.stderr or proc.stdout or "").split())[:300]
            raise DevclusterError(f"nft could not add the loss rules on {node_end}: {err}")

    def _set_delay(self, inside: list[str], node_end: str, switch_end: str, ms: float, node: str) -> str:
        proc = self._run([*inside, "tc", "qdisc", "replace", "dev", node_end, "root", "netem", "delay", f"{ms:g}ms"])
        if proc.returncode != 0:
            if "unknown" in (proc.stderr or "").lower():
                raise DevclusterError("delay=MS needs the kernel's sch_netem, which this kernel lacks "
                                      "(and it loads no modules); use rate=MBIT or loss=PCT")
            self._check([*inside, "tc", "qdisc", "replace", "dev", node_end, "root", "netem", "delay", f"{ms:g}ms"])
        self._check(["tc", "qdisc", "replace", "dev", switch_end, "root", "netem", "delay", f"{ms:g}ms"])
        return f"{node} {node_end}: {ms:g} ms delay both ways"
