"""bench/bench_coordinator.py's defaults: the harness speaks as the rank runtime does."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_coordinator.py"


def _harness():
    spec = importlib.util.spec_from_file_location("bench_coordinator", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_default_connection_is_the_node_relays_and_the_earlier_ones_stay_available():
    # torchpass.runtime.control sends every request through its node's relay, one connection per
    # node (torchpass.runtime.relay), and the relay's constants are the harness's.
    h = _harness()
    parser = h.arg_parser()
    assert parser.parse_args([]).connection == "relay"
    for c in ("persistent", "per-request", "both", "per-node-ab"):
        assert parser.parse_args(["--connection", c]).connection == c
    from torchpass.runtime import relay

    assert h.RELAY_RETRY_S == relay.RELAY_RETRY_S
    assert h.TIMEOUTS_BEFORE_DIRECT == relay.TIMEOUTS_BEFORE_DIRECT


def test_paused_ranks_long_poll_by_default_and_the_old_polling_stays_available():
    # torchpass.runtime.control long-polls while paused (wait_s).
    parser = _harness().arg_parser()
    assert parser.parse_args([]).paused_poll == "long"
    assert parser.parse_args(["--paused-poll", "both"]).paused_poll == "both"
    assert parser.parse_args(["--paused-poll", "short"]).paused_poll == "short"


def test_running_ranks_long_poll_by_default_as_the_runtime_does():
    # torchpass.runtime.control's reports are long polls of the report interval while running too.
    h = _harness()
    parser = h.arg_parser()
    assert parser.parse_args([]).running_poll == "long"
    assert parser.parse_args(["--running-poll", "both"]).running_poll == "both"
    # After a running long poll the next report goes when the interval is over, at once if the
    # coordinator parked it that long, and a pause's early answer is followed at once.
    rk = h.SimRank(0, "n0", None, 0.0)
    assert rk.every() == h.PROGRESS_INTERVAL_S
    body = {"wait_s": rk.every()}
    assert h.LoadGen._next_poll(rk, body, 0.0, h.PROGRESS_INTERVAL_S) == 0.0
    assert h.LoadGen._next_poll(rk, body, 0.0, 0.1) == h.PROGRESS_INTERVAL_S - 0.1
    assert h.LoadGen._next_poll(rk, body, 0.0, 0.1, commanded=True) == 0.0
    assert h.LoadGen._next_poll(rk, {}, 0.0, 0.1) == h.PROGRESS_INTERVAL_S
