"""Fail-slow: a node whose ranks compute consistently slower than their peers gets a planned move.

Synchronous training runs at the pace of its slowest rank, so a node that only slows down (a
GPU clocked down, a CPU under another tenant's load) holds every step back while every health
check passes. Each rank reports its compute time per optimizer step (runtime/compute_time.py:
wall time with no collective in flight; the wait for a slow peer is not compute, so only the
slow rank's figures grow). The rule, pure and clock-injected like the rest of the core::

    every rank has figures for the newest W x K steps (W = failslow_window_steps, K = failslow_windows)
      for each of the K windows of W steps (aligned by step, the same steps on every rank):
        rank figure  = median of its measured steps in the window (a one-off slow step is ignored)
        node figure  = its slowest rank's figure
        peers        = median of the figures of the ranks on every other node
        slow in the window: node >= failslow_ratio x peers  and  node - peers >= failslow_min_excess_s
      slow: slow in all K windows                                   -> CoordState.slow[node] (since)
    found slow continuously for failslow_sustain_s (coordinator clock) -> a FAILSLOW candidate:
      the same planned migration to a spare as a degrading node's (decide_migration.candidates)

The guards: the median within a window ignores one-off slow steps; K windows in a row and the
sustain time ignore a slowdown shorter than that; comparing with the peers' median ignores a
slowdown of the whole job (every rank slower: no node stands out); the absolute excess ignores
steps so short that a scheduler's noise alone makes a ratio. ``failslow.detected`` (at the
decision) says what was measured against what. ``track`` looks again at most every CHECK_S of
coordinator time, once a new window has ended on every rank: W x K figures per rank, over every
rank.
"""

from __future__ import annotations

from dataclasses import replace

from torchpass.coordinator.model import CoordState, RankView, SlowWatch
from torchpass.coordinator.policy import CoordinatorPolicy

CHECK_S = 1.0  # seconds of coordinator time between two evaluations
EXACT_PEERS = 64  # nodes up to which a node's peers' median leaves its own ranks out exactly


def median(values) -> float:
    """statistics.median without its checks: ~3x faster on the 10 figures of a window, which the
    rule takes for every rank and window."""
    s = sorted(values)
    n = len(s)
    m = n // 2
    return s[m] if n % 2 else (s[m - 1] + s[m]) / 2


def compute_figures(body: dict) -> tuple[tuple[float, ...], int]:
    """A rank.progress body's ``compute_s`` and ``compute_step`` as RankProgress takes them: each
    figure a finite number of seconds, or -1 for a step that was not measured; anything else (a
    peer's bug) drops the report's figures, never the report."""
    values, step = body.get("compute_s"), body.get("compute_step")
    if not isinstance(values, list) or not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return (), -1
    if len(values) > 64 or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                   and (v == -1 or 0 <= v < 86400) for v in values):
        return (), -1
    return tuple(float(v) for v in values), step


def _windows(rv: RankView, last: int, w: int, k: int) -> list[float] | None:
    """The rank's median compute per step in each of the k windows of w steps that end at step
    ``last`` (oldest first); None if it lacks figures for them or measured fewer than half the
    steps of one of them (it paused)."""
    end = len(rv.compute) - (rv.compute_step - last)
    start = end - w * k
    if start < 0 or end > len(rv.compute):
        return None
    out = []
    for i in range(k):
        measured = [v for v in rv.compute[start + i * w:start + (i + 1) * w] if v >= 0]
        if 2 * len(measured) < w:
            return None
        out.append(median(measured))
    return out


def evaluate(st: CoordState, policy: CoordinatorPolicy) -> dict[str, SlowWatch]:
    """The nodes slow in every window now (``since`` left 0: ``track`` sets it)."""
    w, k = policy.failslow_window_steps, policy.failslow_windows
    nodes = st.rank_nodes()
    if policy.failslow_ratio <= 0 or len(nodes) < 2 or not st.all_registered():
        return {}
    last = newest_window_end(st, w)
    if last < 0:
        return {}
    per_rank: dict[int, list[float]] = {}
    for r, rv in st.ranks.items():
        figures = _windows(rv, last, w, k)
        if figures is None:
            return {}  # a rank without the figures: the steps cannot be compared yet
        per_rank[r] = figures
    # The peers' median per node and window: exact (every other node's ranks) up to EXACT_PEERS
    # nodes; above, the median of every rank, which one node's few ranks shift by a rank or two
    # (the exact one, a pass over every rank per node, is quadratic: 1,024 nodes x 8,192 ranks).
    everyone = [median(per_rank[r][i] for r in per_rank) for i in range(k)] if len(nodes) > EXACT_PEERS else []
    found: dict[str, SlowWatch] = {}
    for node, ranks in nodes.items():
        newest: tuple[float, float, float] | None = None
        for i in range(k):
            node_s = max(per_rank[r][i] for r in ranks)
            peers_s = everyone[i] if everyone else median(per_rank[r][i] for n, rs in nodes.items() if n != node
                                                          for r in rs)
            if not (node_s >= policy.failslow_ratio * peers_s and node_s - peers_s >= policy.failslow_min_excess_s):
                break
            newest = (node_s / peers_s if peers_s > 0 else float("inf"), node_s, peers_s)
        else:
            if newest is not None:
                ratio, node_s, peers_s = newest
                found[node] = SlowWatch(node, 0.0, round(min(ratio, 1e6), 3), round(node_s, 4), round(peers_s, 4),
                                        w, k, last, tuple(ranks))
    return found


def newest_window_end(st: CoordState, w: int) -> int:
    """The newest step every rank has a figure for, rounded down to a multiple of ``w``: the
    windows end on the same steps from one evaluation to the next, so a window is judged once
    (-1: some rank has none)."""
    last = min((rv.compute_step for rv in st.ranks.values()), default=-1)
    return -1 if last < w else last // w * w


def track(st: CoordState, now: float, policy: CoordinatorPolicy) -> CoordState:
    """``st`` with ``slow`` brought up to date: at most every CHECK_S, and only once a new window of
    steps has ended on every rank (an evaluation at 8,192 ranks, 1,024 nodes, took 56-75 ms of the serve thread on
    the 2-core development VM). A node found slow keeps the time it was first found so while it
    stays slow; one found not slow is dropped."""
    if policy.failslow_ratio <= 0:
        return replace(st, slow={}, slow_checked=None) if st.slow else st
    if st.slow_checked is not None and now - st.slow_checked[0] < CHECK_S:
        return st
    end = newest_window_end(st, policy.failslow_window_steps)
    if st.slow_checked is not None and end == st.slow_checked[1]:
        return st.carry_views(replace(st, slow_checked=(now, end)))
    found = evaluate(st, policy)
    slow = {node: replace(watch, since=st.slow[node].since if node in st.slow else now)
            for node, watch in found.items()}
    return st.carry_views(replace(st, slow=slow, slow_checked=(now, end)))


def due(st: CoordState, now: float, policy: CoordinatorPolicy) -> list[SlowWatch]:
    """Nodes found slow for failslow_sustain_s: each is due a planned migration."""
    return [w for w in st.slow.values() if now - w.since >= policy.failslow_sustain_s]


def reason(w: SlowWatch) -> str:
    """The migration's reason, as events and `tpassctl status` show it."""
    return (f"fail-slow: compute {w.ratio:g}x the peers' median ({w.node_s * 1000:.1f} ms against "
            f"{w.peers_s * 1000:.1f} ms per step, {w.windows} windows of {w.window_steps} steps)")


def detected_data(w: SlowWatch, now: float) -> dict:
    """The ``failslow.detected`` event's data: what was measured against what."""
    return {"node": w.node, "ratio": w.ratio, "node_compute_s": w.node_s, "peers_median_s": w.peers_s,
            "window_steps": w.window_steps, "windows": w.windows, "last_step": w.last_step,
            "ranks": list(w.ranks), "slow_for_s": round(now - w.since, 3)}
