"""Health rules: readings + history -> one state and reasons per component.

Pure apart from the history the engine keeps between samples; the clock is
the ``now`` argument (tests move it by hand). Counter rules look at the
increase of a counter over a window; a counter that goes down was reset
(driver reload, counter clear) and its new value counts as new errors.

Outcomes per component: healthy / degraded / failed / unknown. A check that
could not run makes its component unknown (never healthy, never failed)
unless another check found a real problem; the node's state is the worst of
its components (failed > degraded > unknown > healthy).

Data rails (tpassd.toml ``rails``) are the exception: a job reroutes around a rail, so a rail's
verdict is published but leaves the node's state alone, until no listed rail is usable (every
one ``failed``: down) and the node is ``failed``. While rails are listed, IB ports they do not
name are published and ignored; an HCA port in Ethernet mode (RoCE: ``link_layer`` Ethernet)
that goes down degrades, never fails, the node, since the host's IP traffic has other routes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from torchpass.health_state import State, severity, worst
from tpassd.collectors.base import CollectorResult, ComponentReading
from tpassd.collectors.eth_rails import COUNTERS as RAIL_COUNTERS
from tpassd.collectors.ib_sysfs import COUNTERS as IB_COUNTERS
from tpassd.nvml_provider import HW_SLOWDOWN_MASK
from tpassd.policy import Policy

GPU_COUNTERS = ("ecc_sbe_volatile", "nvlink_crc_errors", "nvlink_replay_errors",
                "nvlink_recovery_errors", "pcie_replay")


@dataclass(frozen=True)
class Verdict:
    state: State
    reasons: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"state": self.state.value, "reasons": list(self.reasons)}


HEALTHY_VERDICT = Verdict(State.HEALTHY, ())


class _Findings:
    def __init__(self) -> None:
        self.items: list[tuple[State, str]] = []

    def add(self, state: State | str, reason: str) -> None:
        self.items.append((State(state), reason))

    def verdict(self) -> Verdict:
        if not self.items:
            return HEALTHY_VERDICT
        state = worst(s for s, _ in self.items)
        ordered = sorted(self.items, key=lambda it: -severity(it[0]))
        return Verdict(state, tuple(r for _, r in ordered))


@dataclass
class _History:
    """Per component: last counter values and the non-zero increases with times."""

    last: dict[str, int] = field(default_factory=dict)
    increases: dict[str, deque] = field(default_factory=dict)
    xids: deque = field(default_factory=deque)  # (t, code)
    slowdown_since: float | None = None
    links_seen_up: set = field(default_factory=set)

    def observe(self, key: str, value: Any, now: float) -> None:
        if not isinstance(value, int) or isinstance(value, bool):
            return
        prev = self.last.get(key)
        self.last[key] = value
        if prev is None:
            return  # a baseline, not new errors
        inc = value - prev if value >= prev else value
        if inc > 0:
            self.increases.setdefault(key, deque()).append((now, inc))

    def increase(self, key: str, now: float, window_s: float) -> int:
        dq = self.increases.get(key)
        if not dq:
            return 0
        return sum(inc for t, inc in dq if t > now - window_s)

    def prune(self, now: float, keep_s: float, xid_hold_s: float) -> None:
        for dq in self.increases.values():
            while dq and dq[0][0] <= now - keep_s:
                dq.popleft()
        while self.xids and self.xids[0][0] <= now - xid_hold_s:
            self.xids.popleft()


def _unknown_checks(f: _Findings, comp: str, r: ComponentReading) -> None:
    for check, err in sorted(r.failed_checks().items()):
        f.add(State.UNKNOWN, f"{comp}: {check} check failed: {err}")


def gpu_verdict(comp: str, r: ComponentReading, h: _History, now: float, p: Policy) -> Verdict:
    f = _Findings()
    m = r.metrics
    # Xids seen within the hold window (already recorded into h by the engine).
    seen: dict[int, float] = {}
    for t, code in h.xids:
        seen[code] = max(seen.get(code, t), t)
    # Reasons are stable text (no "N s ago"): an event goes out when they change.
    for code in sorted(seen):
        what = XID_TEXT.get(code, "see the NVIDIA Xid catalog")
        if code in p.xid.failed:
            f.add(State.FAILED, f"{comp}: Xid {code} ({what}) within the last {p.xid.hold_s:g} s")
        elif code in p.xid.degraded:
            f.add(State.DEGRADED, f"{comp}: Xid {code} ({what}) within the last {p.xid.hold_s:g} s")
    if r.lost:
        f.add(State.FAILED, f"{comp}: GPU is lost (NVML_ERROR_GPU_IS_LOST): fell off the bus or hung")
        return f.verdict()
    dbe = m.get("ecc_dbe_volatile")
    if isinstance(dbe, int) and dbe > 0:
        f.add(p.ecc.dbe_volatile_severity,
              f"{comp}: {dbe} uncorrectable (double-bit) ECC error(s) since the driver loaded")
    if p.ecc.sbe_storm_count > 0:
        n = h.increase("ecc_sbe_volatile", now, p.ecc.window_s)
        if n >= p.ecc.sbe_storm_count:
            f.add(State.DEGRADED, f"{comp}: SBE ECC storm: {n} correctable ECC errors in the last "
                                  f"{p.ecc.window_s:g} s (threshold {p.ecc.sbe_storm_count})")
    if m.get("remap_failure"):
        f.add(p.ecc.remap_failure_severity, f"{comp}: row remapping failed (no spare rows): RMA")
    if m.get("remap_pending"):
        f.add(p.ecc.remap_pending_severity, f"{comp}: row remap pending: reset the GPU to apply it")
    if m.get("retired_pages_pending"):
        f.add(p.ecc.retired_pending_severity, f"{comp}: page retirement pending: reset the GPU to apply it")
    retired = (m.get("retired_pages_sbe") or 0) + (m.get("retired_pages_dbe") or 0)
    if p.ecc.retired_pages_failed > 0 and retired >= p.ecc.retired_pages_failed:
        f.add(State.FAILED, f"{comp}: {retired} retired pages (limit {p.ecc.retired_pages_failed}): RMA")
    for key, limit, what in (
        ("nvlink_crc_errors", p.nvlink.crc_errors_per_window, "NVLink CRC errors"),
        ("nvlink_replay_errors", p.nvlink.replay_errors_per_window, "NVLink replay errors"),
        ("nvlink_recovery_errors", p.nvlink.recovery_errors_per_window, "NVLink recoveries"),
    ):
        if limit > 0:
            n = h.increase(key, now, p.nvlink.window_s)
            if n >= limit:
                f.add(State.DEGRADED, f"{comp}: {n} {what} in the last {p.nvlink.window_s:g} s (threshold {limit})")
    for link in sorted(h.links_seen_up):
        if m.get(f"nvlink.{link}.active") == 0:
            f.add(p.nvlink.link_down_severity, f"{comp}: NVLink {link} went down")
    if p.pcie.replays_per_window > 0:
        n = h.increase("pcie_replay", now, p.pcie.window_s)
        if n >= p.pcie.replays_per_window:
            f.add(State.DEGRADED, f"{comp}: {n} PCIe replays in the last {p.pcie.window_s:g} s "
                                  f"(threshold {p.pcie.replays_per_window})")
    if h.slowdown_since is not None and now - h.slowdown_since >= p.thermal.hw_slowdown_min_s:
        f.add(State.DEGRADED, f"{comp}: hardware clock slowdown for over {p.thermal.hw_slowdown_min_s:g} s "
                              f"(throttle reasons 0x{m.get('throttle_reasons', 0):x})")
    temp = m.get("temperature_c")
    if (p.thermal.temperature_c_degraded > 0 and isinstance(temp, (int, float))
            and temp >= p.thermal.temperature_c_degraded):
        f.add(State.DEGRADED, f"{comp}: temperature {temp:g} C (threshold {p.thermal.temperature_c_degraded:g})")
    _unknown_checks(f, comp, r)
    return f.verdict()


def ib_verdict(comp: str, r: ComponentReading, h: _History, now: float, p: Policy) -> Verdict:
    f = _Findings()
    m = r.metrics
    if comp == "ib":  # the "fewer ports than expected" pseudo-component
        f.add(p.ib.link_down_severity, f"ib: {m.get('ports_found')} InfiniBand port(s) found, "
                                       f"{m.get('ports_expected')} expected")
        return f.verdict()
    # A RoCE port down degrades at most: the node's IP traffic has other routes.
    down_severity = State.DEGRADED if m.get("link_layer") == "Ethernet" else State(p.ib.link_down_severity)
    if "state" in m and m["state"].upper() != "ACTIVE":
        f.add(down_severity, f"{comp}: link state {m['state_code']}: {m['state']} (expected ACTIVE)")
    if "phys_state" in m and m["phys_state"] != "LinkUp":
        f.add(down_severity,
              f"{comp}: physical state {m['phys_state_code']}: {m['phys_state']} (expected LinkUp)")
    if p.ib.flap_count > 0:
        n = h.increase("link_downed", now, p.ib.window_s)
        if n >= p.ib.flap_count:
            f.add(State.DEGRADED, f"{comp}: link flapping: went down {n} times in the last {p.ib.window_s:g} s "
                                  f"(threshold {p.ib.flap_count})")
    for counter in IB_COUNTERS:
        limit = getattr(p.ib, f"{counter}_per_window", 0)
        if counter in ("link_downed", "port_xmit_wait") or limit <= 0:
            continue
        n = h.increase(counter, now, p.ib.window_s)
        if n >= limit:
            f.add(State.DEGRADED, f"{comp}: {n} new {counter} in the last {p.ib.window_s:g} s (threshold {limit})")
    _unknown_checks(f, comp, r)
    return f.verdict()


def rail_verdict(comp: str, r: ComponentReading, h: _History, now: float, p: Policy) -> Verdict:
    """An Ethernet data rail: ``failed`` (unusable) when its link is not up, ``degraded`` when it
    flaps or counts errors, as the IB rules judge a port."""
    f = _Findings()
    m = r.metrics
    rp = p.rail
    # "unknown": a driver that does not track operstate (lo, dummy) while it is up, as `ip link` shows.
    if "operstate" in m and m["operstate"] not in ("up", "unknown"):
        f.add(State.FAILED, f"{comp}: link {m['operstate']} (expected up)")
    if rp.flap_count > 0:
        n = h.increase("link_downed", now, rp.window_s)
        if n >= rp.flap_count:
            f.add(State.DEGRADED, f"{comp}: link flapping: carrier lost {n} times in the last {rp.window_s:g} s "
                                  f"(threshold {rp.flap_count})")
    for what, keys, limit in (("errors", ("rx_errors", "tx_errors"), rp.errors_per_window),
                              ("drops", ("rx_dropped", "tx_dropped"), rp.drops_per_window)):
        if limit > 0:
            n = sum(h.increase(k, now, rp.window_s) for k in keys)
            if n >= limit:
                f.add(State.DEGRADED, f"{comp}: {n} new {what} in the last {rp.window_s:g} s (threshold {limit})")
    _unknown_checks(f, comp, r)
    return f.verdict()


def host_verdict(comp: str, r: ComponentReading, h: _History, now: float, p: Policy) -> Verdict:
    f = _Findings()
    m = r.metrics
    hp = p.host
    avail = m.get("mem_available_percent")
    if hp.mem_available_percent_degraded > 0 and avail is not None and avail < hp.mem_available_percent_degraded:
        f.add(State.DEGRADED, f"host: memory pressure: {avail:.1f}% available "
                              f"(threshold {hp.mem_available_percent_degraded:g}%)")
    swap = m.get("swap_used_percent")
    if hp.swap_used_percent_degraded > 0 and swap is not None and swap >= hp.swap_used_percent_degraded:
        f.add(State.DEGRADED, f"host: {swap:.1f}% of swap used (threshold {hp.swap_used_percent_degraded:g}%)")
    if hp.disk_free_gb_degraded > 0:
        i = 0
        while f"disk.{i}.free_bytes" in m or f"disk.{i}.path" in m:
            free = m.get(f"disk.{i}.free_bytes")
            if free is not None and free < hp.disk_free_gb_degraded * 1e9:
                f.add(State.DEGRADED, f"host: {free / 1e9:.1f} GB free in {m[f'disk.{i}.path']} "
                                      f"(threshold {hp.disk_free_gb_degraded:g} GB)")
            i += 1
    lpc = m.get("load1_per_cpu")
    if hp.load_per_cpu_degraded > 0 and lpc is not None and lpc >= hp.load_per_cpu_degraded:
        f.add(State.DEGRADED, f"host: load {lpc:.2f} per CPU (threshold {hp.load_per_cpu_degraded:g})")
    _unknown_checks(f, comp, r)
    return f.verdict()


VERDICTS = {"gpu": gpu_verdict, "ib": ib_verdict, "rail": rail_verdict, "host": host_verdict}


def rail_component(rail: str) -> str:
    """tpassd.toml's name of a rail -> its component: ``ib:mlx5_0/1`` is an IB port (ib_sysfs),
    anything else an Ethernet interface (eth_rails)."""
    return rail if rail.startswith("ib:") else f"rail:{rail}"


XID_TEXT = {
    48: "double-bit ECC error",
    63: "ECC page retirement or row remap recorded",
    64: "ECC page retirement or row remap failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}


@dataclass
class NodeHealth:
    state: State
    reasons: tuple[str, ...]
    components: dict[str, Verdict]


class RuleEngine:
    """Keeps per-component history between samples and applies the rules."""

    def __init__(self, policy: Policy, rails: tuple[str, ...] = ()):
        self.policy = policy
        self.rails = tuple(rail_component(r) for r in rails)
        self._hist: dict[str, _History] = {}
        self._known: dict[str, set[str]] = {}  # collector -> components it reported last
        self._kinds: dict[str, str] = {}

    def forget(self, components: list[str] | None = None) -> None:
        """Drop history (windows, Xids, slowdowns) of these components, or all."""
        if components is None:
            self._hist.clear()
        else:
            for c in components:
                self._hist.pop(c, None)

    def evaluate(self, now: float, results: list[CollectorResult]) -> NodeHealth:
        p = self.policy
        verdicts: dict[str, Verdict] = {}
        for res in results:
            if not res.ok:
                known = self._known.get(res.name) or {_collector_component(res.name)}
                for comp in sorted(known):
                    verdicts[comp] = Verdict(State.UNKNOWN, (f"{comp}: collector {res.name} failed: {res.error}",))
                continue
            self._known[res.name] = set(res.components)
            for comp, reading in res.components.items():
                h = self._hist.setdefault(comp, _History())
                self._record(comp, reading, h, now)
                h.prune(now, p.max_window_s(), p.xid.hold_s)
                fn = VERDICTS.get(reading.kind)
                if fn is None:
                    verdicts[comp] = Verdict(State.UNKNOWN, (f"{comp}: no rules for kind {reading.kind!r}",))
                else:
                    verdicts[comp] = fn(comp, reading, h, now, p)
        node_verdicts = {c: v for c, v in verdicts.items() if not self._off_node_state(c)}
        # Only rails reported, and (below) one is usable: nothing else is known bad.
        state = worst(v.state for v in node_verdicts.values()) if node_verdicts else (
            State.HEALTHY if verdicts else State.UNKNOWN)
        reasons: list[str] = []
        for v in sorted(node_verdicts.values(), key=lambda v: -severity(v.state)):
            if v.state != State.HEALTHY:
                reasons.extend(v.reasons)
        if self.rails:
            # A rail with no verdict this tick (its collector failed) is not known down: usable.
            down = [c for c in self.rails if c in verdicts and verdicts[c].state == State.FAILED]
            if len(down) == len(self.rails):
                state = State.FAILED
                reasons.insert(0, f"no usable data rail left: {', '.join(down)} down")
                for c in down:
                    reasons.extend(verdicts[c].reasons)
        if not verdicts:
            reasons = ["no collector reported any component"]
        return NodeHealth(state, tuple(reasons), verdicts)

    def _off_node_state(self, comp: str) -> bool:
        """Published but not part of the node's state: a listed rail (judged together, above),
        or, while rails are listed, an IB port none of them names."""
        if not self.rails:
            return False
        return comp in self.rails or comp.startswith("ib:") or comp.startswith("rail:")

    @staticmethod
    def _record(comp: str, r: ComponentReading, h: _History, now: float) -> None:
        m = r.metrics
        counters = {"gpu": GPU_COUNTERS, "ib": IB_COUNTERS, "rail": RAIL_COUNTERS}.get(r.kind, ())
        for key in counters:
            if key in m:
                h.observe(key, m[key], now)
        for ev in r.events:
            if ev.get("kind") == "xid":
                h.xids.append((now, int(ev["xid"])))
        if r.kind == "gpu":
            tr = m.get("throttle_reasons")
            if isinstance(tr, int) and tr & HW_SLOWDOWN_MASK:
                if h.slowdown_since is None:
                    h.slowdown_since = now
            elif tr is not None:
                h.slowdown_since = None
            for key, value in m.items():
                if key.startswith("nvlink.") and key.endswith(".active") and value:
                    h.links_seen_up.add(int(key.split(".")[1]))


def _collector_component(name: str) -> str:
    return {"nvml": "gpu", "ib_sysfs": "ib", "eth_rails": "rail", "host": "host"}.get(name, name)
