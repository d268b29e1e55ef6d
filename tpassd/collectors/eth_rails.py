"""Ethernet data rails: link state and error counters of the interfaces named in ``rails``.

Read in tpassd's own network namespace, never from /sys: a devcluster node shares the host's
/sys, whose class/net lists the host's interfaces, not the node's. The counters come from
``PROCFS_ROOT/net/dev`` (a per-namespace file: /proc/net is /proc/self/net), the link state
from netlink (RTM_GETLINK: IFLA_OPERSTATE and IFLA_CARRIER_DOWN_COUNT, the kernel's count of
carrier losses, which flap counting uses as the IB rules use ``link_downed``). Both sources
are parameters, so tests run on fixture files and a fixed link table.

Component ``rail:NAME``, kind ``rail``. A rail the node lacks is a failed check (unknown),
never a healthy link; tpassd refuses to start when a configured rail is missing
(``missing_rails``).
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tpassd.collectors.base import Collector, ComponentReading

# /proc/net/dev columns after "NAME:" (Linux net/core/net-procfs.c dev_seq_printf_stats).
_RX = ("rx_bytes", "rx_packets", "rx_errors", "rx_dropped", "rx_fifo", "rx_frame", "rx_compressed", "rx_multicast")
_TX = ("tx_bytes", "tx_packets", "tx_errors", "tx_dropped", "tx_fifo", "tx_colls", "tx_carrier", "tx_compressed")
COUNTERS = ("rx_errors", "tx_errors", "rx_dropped", "tx_dropped", "link_downed")
BYTES = ("rx_bytes", "tx_bytes")


def component_name(interface: str) -> str:
    return f"rail:{interface}"


@dataclass(frozen=True)
class LinkInfo:
    operstate: str  # "up", "down", "lowerlayerdown", ... (RFC 2863, as `ip link` prints it)
    carrier_down_count: int | None  # None: the kernel does not report it (before 4.16)


def parse_net_dev(text: str) -> dict[str, dict[str, int]]:
    """/proc/net/dev -> {interface: {counter: value}}."""
    out: dict[str, dict[str, int]] = {}
    for line in text.splitlines()[2:]:
        name, sep, rest = line.partition(":")
        if not sep:
            continue
        values = [int(v) for v in rest.split()]
        out[name.strip()] = dict(zip(_RX + _TX, values, strict=False))
    return out


# RFC 2863 operstates in the kernel's numbering (include/uapi/linux/if.h IF_OPER_*).
_OPERSTATES = ("unknown", "notpresent", "down", "lowerlayerdown", "testing", "dormant", "up")
_RTM_GETLINK, _RTM_NEWLINK, _NLMSG_DONE, _NLMSG_ERROR = 18, 16, 3, 2
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_IFLA_IFNAME, _IFLA_OPERSTATE, _IFLA_CARRIER_DOWN_COUNT = 3, 16, 48


def parse_links(messages: bytes) -> dict[str, LinkInfo]:
    """RTM_NEWLINK messages of a dump -> {interface: LinkInfo}. Pure: tests feed it bytes."""
    out: dict[str, LinkInfo] = {}
    off = 0
    while off + 16 <= len(messages):
        length, mtype = struct.unpack_from("=IH", messages, off)
        if length < 16:
            break
        if mtype == _RTM_NEWLINK:
            name, oper, downs = None, "unknown", None
            attr = off + 16 + 16  # nlmsghdr, ifinfomsg
            while attr + 4 <= off + length:
                alen, atype = struct.unpack_from("=HH", messages, attr)
                if alen < 4:
                    break
                payload = messages[attr + 4:attr + alen]
                atype &= 0x3FFF  # NLA_F_NESTED / NLA_F_NET_BYTEORDER
                if atype == _IFLA_IFNAME:
                    name = payload.split(b"\0", 1)[0].decode(errors="replace")
                elif atype == _IFLA_OPERSTATE and payload:
                    oper = _OPERSTATES[payload[0]] if payload[0] < len(_OPERSTATES) else "unknown"
                elif atype == _IFLA_CARRIER_DOWN_COUNT and len(payload) >= 4:
                    downs = struct.unpack_from("=I", payload)[0]
                attr += (alen + 3) & ~3
            if name is not None:
                out[name] = LinkInfo(oper, downs)
        off += (length + 3) & ~3
    return out


def netlink_links() -> dict[str, LinkInfo]:
    """Every interface of this network namespace, from one RTM_GETLINK dump."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as sock:
        sock.settimeout(2.0)
        sock.bind((0, 0))
        req = struct.pack("=IHHII", 32, _RTM_GETLINK, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0) + struct.pack(
            "=BxHiII", socket.AF_UNSPEC, 0, 0, 0, 0)
        sock.send(req)
        links: dict[str, LinkInfo] = {}
        while True:
            data = sock.recv(65536)
            links.update(parse_links(data))
            off, done = 0, False
            while off + 16 <= len(data):
                length, mtype = struct.unpack_from("=IH", data, off)
                if mtype == _NLMSG_ERROR:
                    err = -struct.unpack_from("=i", data, off + 16)[0]
                    raise OSError(err, f"netlink RTM_GETLINK: {os.strerror(err)}")
                if mtype == _NLMSG_DONE or length < 16:
                    done = True
                    break
                off += (length + 3) & ~3
            if done:
                return links


class EthRailCollector(Collector):
    name = "eth_rails"
    kind = "rail"

    def __init__(self, interfaces: tuple[str, ...], procfs_root: Path = Path("/proc"),
                 links: Callable[[], dict[str, LinkInfo]] = netlink_links):
        self.interfaces = tuple(interfaces)
        self.procfs_root = Path(procfs_root)
        self._links = links

    def missing_rails(self) -> list[str]:
        """Configured rails this namespace has no interface for."""
        present = self._links()
        return [i for i in self.interfaces if i not in present]

    def collect(self, now: float) -> dict[str, ComponentReading]:
        path = self.procfs_root / "net" / "dev"
        try:
            counters: dict[str, dict[str, int]] | None = parse_net_dev(path.read_text())
            counters_error = None
        except (OSError, ValueError) as exc:
            counters, counters_error = None, f"cannot read {path}: {exc}"
        links = self._links()
        out: dict[str, ComponentReading] = {}
        for iface in self.interfaces:
            r = ComponentReading(kind="rail")
            m = r.metrics
            m["interface"] = iface
            link = links.get(iface)
            if link is None:
                r.checks["operstate"] = f"no interface {iface} in this network namespace"
            else:
                r.checks["operstate"] = None
                m["operstate"] = link.operstate
                if link.carrier_down_count is not None:
                    m["link_downed"] = link.carrier_down_count
            if counters is None:
                r.checks["counters"] = counters_error
            elif iface not in counters:
                r.checks["counters"] = f"{iface} is not in {path}"
            else:
                r.checks["counters"] = None
                c = counters[iface]
                for key in (*BYTES, "rx_errors", "tx_errors", "rx_dropped", "tx_dropped"):
                    m[key] = c[key]
            out[component_name(iface)] = r
        return out
