"""The real coordinator at 512 ranks (bench/bench_coordinator.py, shortened): every report answered.

The harness starts the real ``tpass-coordinator`` process (as the SPANK plugin
does, Slurm replaced by stand-in commands on its PATH) against 512 simulated
ranks speaking the rank protocol (signed with the job secret, the ranks of a node sharing one kept
connection as the runtime's node relay forwards them, 2 s time-out) and 65 simulated tpassds, then injects two
node faults. It needs no devcluster and takes about a minute.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RANKS = 512

pytestmark = pytest.mark.integration

# Without batched decisions and paced ranks (2026-12-03, load average 2-3) the coordinator answered 528 of the
# 1,024 reports/s wanted, and 551 requests timed out during the pauses. Now it decides once per
# batch of messages and paces the ranks (report_every_s): see docs/benchmarks.md.
# It measures the coordinator's throughput on this machine's cores and needs no devcluster: the
# host tier runs it alone. Beside two devclusters' training jobs it answered 785 of the 1,024
# reports/s wanted (819 needed).
@pytest.mark.host
@pytest.mark.timeout(180)
def test_every_rank_report_is_answered_at_512_ranks(tmp_path):
    out = tmp_path / "coordinator.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "bench_coordinator.py"), "--sizes", str(RANKS), "--trials", "2",
         "--warmup-s", "2", "--steady-s", "10", "--register-timeout-s", "20", "--trial-timeout-s", "12",
         "--size-timeout-s", "50", "--out", str(out), "--plot", ""],
        capture_output=True, text=True, timeout=170, cwd=tmp_path,
    )
    if proc.returncode != 0:  # the harness itself failed: never an expected failure
        pytest.fail(f"bench_coordinator.py exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    (row,) = json.loads(out.read_text())["sizes"]
    summary = {k: row.get(k) for k in ("registered", "replies_per_s", "wanted_per_s", "asked_per_s",
                                       "replies_fraction", "replies_fraction_all", "timeouts_total",
                                       "error_replies_total", "progress_p99_ms", "trials_complete", "status_p99_ms",
                                       "coordinator_log_errors")}
    assert row["registered"] == RANKS, summary
    assert row["trials"] == 2 and row["trials_complete"] == 2, summary  # every rank paused and resumed
    # Every request every rank sent was answered, without an error, within its 2 s.
    assert row["timeouts_total"] == 0 and row["error_replies_total"] == 0, summary
    assert row["replies_fraction_all"] == 1.0, summary
    # ... and in time for the next one. A rank reports 0.5 s after each reply (or as often as the
    # coordinator's backpressure asks, report_every_s, which at 512 ranks must not halve the rate),
    # so the most it can send is one report per 0.5 s + round trip: 80 % of that allows a round
    # trip of 0.125 s on average, and no reply may take half the 2 s time-out (a long poll's reply:
    # half of it beyond the wait the report asked for).
    assert row["asked_per_s"] >= 0.5 * row["wanted_per_s"], summary
    assert row["replies_per_s"] >= 0.8 * min(row["wanted_per_s"], row["asked_per_s"]), summary
    assert row["progress_p99_ms"] < 1000, summary
    assert row["coordinator_log_errors"] == 0, row.get("coordinator_log_error_first")
