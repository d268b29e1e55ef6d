"""``tpassctl fleet audit``: validate nodes with ordinary Slurm jobs, then name the outliers.

1. Which nodes (``plan``, pure): idle nodes only; a node running a job is never touched; a drained
   idle node only as root, inside a maintenance reservation (``flags=maint,ignore_jobs``) that
   root creates for the audit's nodes and deletes after, the node resumed into it for the audit
   and drained again with its own reason after (so a repaired node is validated before an admin
   returns it to service); a node slurmctld does not hear is left out.
2. Per node, one node at a time: ``srun -w NODE`` runs the probe's compute check with the
   cluster's job Python (probe.py, passed as ``-c`` source: nothing is installed on the nodes),
   checked against ``probe.expected_checksum``; the probe also runs ``dcgmi diag -r 1``,
   ``ibstat`` and ``nvidia-smi nvlink -s`` where the binary exists ("absent" otherwise).
3. Links: one job step on every audited node, per data rail, each pair in turn (probe.py).
4. A second pass confirms before anything is named (``audit``): the nodes slower than
   ``CONFIRM_BAND`` x the fastest are measured again, each followed at once by the fastest node
   again, and the links again when a link looks bad; each node and pair keeps its best of both
   passes, and a node as fast as the fastest measured beside it is judged by that ratio. A slowed
   node or a limited rail is slow on both; a healthy node that shared its CPU with other work
   during one pass, or while the load lasted, is not.
5. ``outliers.judge`` names nodes and (node, rail) links; ``--drain`` drains the nodes it names
   with reason ``torchpass-audit: ...``; root appends the results to the fleet spool.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchpass.fleet import outliers, workload
from torchpass.fleet import records as R
from torchpass.slurm.base import NodeInfo

# workload.py's text, then probe.py's: the job-side program (never imported here: it loads torch)
# ("from __future__" lines dropped: they may only open a file)
PROBE_SOURCE = "\n".join(line for text in (Path(workload.__file__).read_text(),
                                           Path(workload.__file__).with_name("probe.py").read_text())
                         for line in text.splitlines() if not line.startswith("from __future__"))
IN_USE = ("ALLOCATED", "MIXED", "COMPLETING")
# ~0.4 s per repeat (numpy, one thread) on the development VM: long beside a 4 ms scheduler tick
COMPUTE_ARGS = {"n": 256, "iters": 40, "repeats": 3}
LINK_PORT = 29431
# A node this much slower than the fastest (compute), or a node whose best pair on a rail has less
# than 1/CONFIRM_BAND of the best pair's bandwidth, is measured a second time before the verdict.
# With 4 nodes, one healthy node slowed by a burst of load in the first pass widens the spread
# enough to hide a node at 5 % of a CPU (seen once in four devcluster audits at load average 8).
CONFIRM_BAND = 1.25
# What a probe's srun can end in: its step failed, timed out, or printed no result line.
PROBE_ERRORS = (RuntimeError, subprocess.TimeoutExpired, ValueError, KeyError)


@dataclass(frozen=True)
class Plan:
    audit: tuple[str, ...]  # the nodes the audit runs on
    drained: tuple[str, ...]  # those of them drained now (resumed into the reservation for the audit)
    skipped: dict[str, str]  # node -> why it is left out


def plan(nodes: list[NodeInfo], wanted: tuple[str, ...] | None, root: bool) -> Plan:
    """Pure: which nodes the audit may take."""
    audit, drained, skipped = [], [], {}
    for n in nodes:
        if wanted and n.name not in wanted:
            continue
        state = set(n.state)
        if n.not_answering:
            skipped[n.name] = "slurmctld does not hear it (" + "+".join(n.state) + ")"
        elif state & set(IN_USE):
            skipped[n.name] = "in use (" + "+".join(n.state) + "): the audit never runs beside a job"
        elif n.drained:
            if root:
                audit.append(n.name)
                drained.append(n.name)
            else:
                skipped[n.name] = "drained: only root audits it (through a maintenance reservation)"
        elif "IDLE" in state:
            audit.append(n.name)
        else:
            skipped[n.name] = "not idle (" + "+".join(n.state) + ")"
    for w in wanted or ():
        if w not in {n.name for n in nodes}:
            skipped[w] = "not a node of this cluster"
    return Plan(tuple(audit), tuple(drained), skipped)


def per_node_links(pairs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """measure -> node -> its best pair on the rail (the highest bandwidth, the lowest latency). Pure.
    A fault at one end of a link shows in every pair of that end, while a healthy node keeps one
    healthy partner as long as two nodes are healthy: with 4 nodes and 2 faulty, the median of a
    healthy node's 3 pairs is a faulty one (measured: no outlier found), its best pair is not."""
    out: dict[str, dict[str, float]] = {}
    for measure, best in (("bandwidth_bps", max), ("latency_s", min)):
        per: dict[str, list[float]] = {}
        for p in pairs:
            for n in (p["a"], p["b"]):
                per.setdefault(n, []).append(p[measure])
        out[measure] = {n: best(v) for n, v in per.items()}
    return out


@dataclass
class AuditResult:
    plan: Plan
    compute: dict[str, dict[str, Any]] = field(default_factory=dict)
    links: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    verdict: outliers.Verdict | None = None
    drained: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"nodes": list(self.plan.audit), "skipped": self.plan.skipped, "compute": self.compute,
                "links": self.links, "failed": self.failed,
                "verdict": self.verdict.as_dict() if self.verdict else None, "drained": self.drained,
                "notes": self.notes, "seconds": round(self.seconds, 1)}

    def records(self, now: float) -> list[dict[str, Any]]:
        v = self.verdict
        out = []
        for n in self.plan.audit:
            named = v is not None and n in v.nodes
            out.append(R.record("audit.node", n, now, outlier=named,
                                compute_s=self.compute.get(n, {}).get("seconds"),
                                why=[o.measure for o in v.nodes[n]] if named else []))
        for rail, pairs in self.links.items():
            for n, _ in per_node_links(pairs)["bandwidth_bps"].items():
                m = per_node_links(pairs)
                out.append(R.record("audit.rail", n, now, rail=rail, outlier=v is not None and (n, rail) in v.links,
                                    bandwidth_bps=m["bandwidth_bps"][n], latency_s=m["latency_s"][n]))
        return out


def reason_for(outs: list[outliers.Outlier]) -> str:
    parts = []
    for o in outs:
        if o.measure.startswith("failed"):
            parts.append(o.measure)
        else:
            parts.append(f"{o.measure} {o.value:.3g} vs fleet median {o.median:.3g}")
    return "torchpass-audit: " + "; ".join(parts)


class Runner:
    """Runs the audit's Slurm steps. ``run`` is subprocess.run-shaped (a seam for tests)."""

    def __init__(self, job_python: str, rails: tuple[str, ...], env: dict[str, str], progress: Callable[[str], None],
                 reservation: str | None = None, timeout_s: float = 300.0, run=subprocess.run):
        self.job_python, self.rails, self.env, self.say = job_python, rails, env, progress
        self.reservation, self.timeout_s, self.run = reservation, timeout_s, run

    def _srun(self, nodes: tuple[str, ...], args: list[str]) -> list[dict[str, Any]]:
        """Every task's JSON line."""
        argv = ["srun", "-N", str(len(nodes)), "-n", str(len(nodes)), "--ntasks-per-node=1", "-w", ",".join(nodes),
                "-J", "torchpass-audit", "-t", "10", "--quiet"]
        if self.reservation:
            argv.append(f"--reservation={self.reservation}")
        argv += [self.job_python, "-c", PROBE_SOURCE, *args]
        proc = self.run(argv, capture_output=True, text=True, timeout=self.timeout_s, env=self.env)
        if proc.returncode != 0:
            raise RuntimeError(f"srun exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
        lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if len(lines) != len(nodes):
            raise RuntimeError(f"{len(lines)} of {len(nodes)} probes answered: {proc.stderr.strip()[-300:]}")
        return lines

    def compute(self, node: str) -> dict[str, Any]:
        args = [f"--{k}={v}" for k, v in COMPUTE_ARGS.items()]
        return self._srun((node,), ["compute", *args])[0]

    def links(self, nodes: tuple[str, ...], master: str) -> dict[str, list[dict[str, Any]]]:
        """rail -> every pair (each task prints the pairs it led)."""
        out: dict[str, list[dict[str, Any]]] = {r: [] for r in self.rails}
        for task in self._srun(nodes, ["links", "--rails", ",".join(self.rails), "--master", master,
                                       "--port", str(LINK_PORT)]):
            for rail, pairs in task["rails"].items():
                out[rail].extend(pairs)
        return out


def audit(p: Plan, runner: Runner, addresses: dict[str, str]) -> AuditResult:
    """Run the checks on the planned nodes and judge them."""
    t0 = time.monotonic()
    res = AuditResult(p)
    for i, node in enumerate(p.audit, 1):
        runner.say(f"[{i}/{len(p.audit)}] {node}: compute check")
        try:
            got = runner.compute(node)
            want = workload.expected_checksum(got["n"], got["iters"])
            res.compute[node] = got
            if got["checksum"] != want:
                res.failed[node] = f"compute checksum {got['checksum']} != {want}"
            runner.say(f"[{i}/{len(p.audit)}] {node}: {got['seconds']:.3f} s ({got['engine']}), "
                       f"checksum {'ok' if node not in res.failed else 'WRONG'}")
        except PROBE_ERRORS as exc:
            res.failed[node] = f"compute check: {str(exc)[:200]}"
            runner.say(f"[{i}/{len(p.audit)}] {node}: FAILED {exc}")
    _confirm_compute(res, runner)
    # A node slow on compute is named already, and slows every pair it is in: left out of the link check.
    compute_s = {n: c["seconds"] for n, c in res.compute.items() if n not in res.failed}
    slow = {o.key for o in outliers.outliers(compute_s, "compute_s")}
    link_nodes = tuple(n for n in p.audit if n not in res.failed and n not in slow)
    if slow:
        res.notes.append(f"left out of the link check (slow on compute): {', '.join(sorted(slow))}")
    if runner.rails and len(link_nodes) >= 2:
        runner.say(f"links: {len(link_nodes)} nodes, rails {', '.join(runner.rails)}, every pair in turn")
        try:
            res.links = runner.links(link_nodes, addresses.get(link_nodes[0], link_nodes[0]))
        except PROBE_ERRORS as exc:
            res.notes.append(f"link check failed: {str(exc)[:300]}")
            runner.say(f"links: FAILED {exc}")
        if res.links and _links_suspect(res.links):
            runner.say("links: a link looks slow; every pair again, each keeps its best")
            try:
                res.links = best_pairs(res.links, runner.links(link_nodes, addresses.get(link_nodes[0],
                                                                                          link_nodes[0])))
                res.notes.append("links measured twice (one looked slow): each pair's best is judged")
            except PROBE_ERRORS as exc:
                res.notes.append(f"link check's second pass failed (first pass judged): {str(exc)[:300]}")
    elif not runner.rails:
        res.notes.append("no data rails named (--rails or $TORCHPASS_DATA_RAILS): links not checked")
    links = {rail: per_node_links(pairs) for rail, pairs in res.links.items()}
    res.verdict = outliers.judge(compute_s, links, res.failed)
    res.seconds = time.monotonic() - t0
    return res


def _confirm_compute(res: AuditResult, runner: Runner) -> None:
    """Measure again the nodes slower than CONFIRM_BAND x the fastest, each followed at once by the
    fastest node again (its reference); each keeps its best time.

    Nodes that share their CPUs with other work (a devcluster's nodes share one machine; a real
    node may run a daemon's burst) are slow in a pass because of the load, not of the node, and a
    load that lasts makes both passes slow. The reference, measured right after, meets the same
    load: a node within CONFIRM_BAND of it is judged at the fastest node's first-pass time scaled
    by their ratio (``seconds``; the raw passes stay in ``passes_s`` and ``reference``). A node
    slowed for real stays slow against the reference."""
    times = {n: c["seconds"] for n, c in res.compute.items() if n not in res.failed}
    if len(times) < 3:
        return
    ref = min(sorted(times), key=times.__getitem__)  # the fastest node
    fastest = times[ref]
    again = [n for n, t in sorted(times.items()) if t > CONFIRM_BAND * fastest]
    for node in again:
        runner.say(f"{node}: {times[node]:.3f} s against the fastest {fastest:.3f} s: compute check again")
        try:
            got = runner.compute(node)
        except PROBE_ERRORS as exc:
            res.notes.append(f"{node}: second compute check failed (first pass judged): {str(exc)[:200]}")
            continue
        if got["checksum"] != workload.expected_checksum(got["n"], got["iters"]):
            res.failed[node] = f"compute checksum {got['checksum']} on the second pass"
        first = res.compute[node]
        best = dict(got if got["seconds"] < first["seconds"] else first)
        best["passes_s"] = [first["seconds"], got["seconds"]]
        try:
            ref_s = runner.compute(ref)["seconds"]
        except PROBE_ERRORS as exc:
            res.notes.append(f"{node}: its reference {ref} could not be measured again (passes judged): "
                             f"{str(exc)[:200]}")
            ref_s = None
        if ref_s:
            best["reference"] = {"node": ref, "seconds": ref_s}
            runner.say(f"{node}: {got['seconds']:.3f} s, then {ref} {ref_s:.3f} s beside it")
            if got["seconds"] <= CONFIRM_BAND * ref_s:
                best["seconds"] = min(best["seconds"], fastest * got["seconds"] / ref_s)
        res.compute[node] = best
    if again:
        res.notes.append(f"compute measured twice on {', '.join(again)} (slower than {CONFIRM_BAND:g}x the "
                         f"fastest in the first pass), each beside the fastest ({ref}) again: each keeps its "
                         "best, or its time against the fastest's when as fast as it then")


def _links_suspect(links: dict[str, list[dict[str, Any]]]) -> bool:
    """Any node's best pair on a rail under 1/CONFIRM_BAND of that rail's best pair, or a named link."""
    per_rail = {rail: per_node_links(pairs) for rail, pairs in links.items() if pairs}
    if outliers.judge({}, per_rail).links:
        return True
    for measures in per_rail.values():
        bw = measures.get("bandwidth_bps") or {}
        if bw and min(bw.values()) * CONFIRM_BAND < max(bw.values()):
            return True
    return False


def best_pairs(first: dict[str, list[dict[str, Any]]],
               second: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """rail -> pairs, each pair with the higher bandwidth and the lower latency of two passes. Pure."""
    out: dict[str, list[dict[str, Any]]] = {}
    for rail in first.keys() | second.keys():
        by_pair: dict[tuple[str, str], dict[str, Any]] = {}
        for p in [*first.get(rail, []), *second.get(rail, [])]:
            key = tuple(sorted((p["a"], p["b"])))
            have = by_pair.get(key)
            if have is None:
                by_pair[key] = dict(p)
            else:
                have["bandwidth_bps"] = max(have["bandwidth_bps"], p["bandwidth_bps"])
                have["latency_s"] = min(have["latency_s"], p["latency_s"])
        out[rail] = [by_pair[k] for k in sorted(by_pair)]
    return out
