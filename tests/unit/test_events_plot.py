"""`tpassctl events JOB --plot`: the Gantt bars from a real migration's saved events.

tests/unit/golden/migration_events.json is the events.json a devcluster job's coordinator saved
(tests/integration/test_cli_scripts.py's job: an operator's move of node2 rolled back by a
restore-fail drill on the spare, then a move of node3 that completed).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from torchpass import layout
from tpassctl import gantt
from tpassctl.cli import cli

EVENTS = json.loads((Path(__file__).parent / "golden" / "migration_events.json").read_text())
END = {e["data"]["migration"]: e for e in EVENTS if e["kind"] in ("migration.rolled_back", "migration.completed")}


def _of(bars, mid):
    return [b for b in bars if b.operation.startswith(f"{mid} ")]


def test_bars_follow_the_phases_in_order_end_to_end_from_the_start():
    bars = gantt.bars(EVENTS)
    assert [b.operation for b in bars][::len(bars) - 1] == ["m1 node2 -> node4 (rolled_back)",
                                                          "m2 node3 -> node4 (completed)"]
    # migration.resumed carries the durations so far but no total: not an operation of its own
    assert {b.operation.split()[0] for b in bars} == {"m1", "m2"}
    m1, m2 = _of(bars, "m1"), _of(bars, "m2")
    assert [b.phase for b in m1] == ["spare", "pause", "dump", "transfer", "restore", "rollback", "paused"]
    assert [b.phase for b in m2] == ["spare", "pause", "dump", "transfer", "restore", "kill_source", "rebuild",
                                     "drain", "shrink", "paused"]
    for mid, ops in (("m1", m1), ("m2", m2)):
        end, d = END[mid]["time"], END[mid]["data"]["phase_durations"]
        phases = [b for b in ops if b.phase != "paused"]
        assert phases[0].start == pytest.approx(end - d["total"], abs=1e-6)  # the start: the end less total
        for a, b in zip(phases, phases[1:]):
            assert b.start == pytest.approx(a.start + a.duration, abs=1e-9)  # end to end
        assert [b.duration for b in phases] == [d[b.phase] for b in phases]
        # the phases' sum is the total: no gap between them longer than the rounding (ms)
        assert phases[-1].start + phases[-1].duration == pytest.approx(end, abs=0.005)


def test_the_ranks_stood_still_from_the_last_rank_at_T_to_the_release():
    """The pause bar ends where the ranks were let go (the rollback's end, the rebuild's end); in
    this real run it then starts where the pause phase ended (every rank at T), within 5 ms."""
    bars = gantt.bars(EVENTS)
    for mid, releasing in (("m1", "rollback"), ("m2", "rebuild")):
        ops = {b.phase: b for b in _of(bars, mid)}
        paused, release, pause = ops["paused"], ops[releasing], ops["pause"]
        assert paused.duration == END[mid]["data"]["phase_durations"]["paused"]
        assert paused.start + paused.duration == pytest.approx(release.start + release.duration, abs=1e-9)
        assert paused.start == pytest.approx(pause.start + pause.duration, abs=0.005)


@pytest.mark.host  # a root-owned STATE_DIR/jobs, and scontrol asked whose job 21 is
def test_events_plot_writes_a_png_of_the_saved_log(tmp_path, monkeypatch):
    import matplotlib  # noqa: F401 - the [plot] extra, installed by `make test`: missing it must fail here

    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "missing-slurm.conf"))  # scontrol fails fast
    state = tmp_path / "state"
    (state / "jobs" / "21").mkdir(parents=True)
    layout.events_json(state, 21).write_text(json.dumps(EVENTS))
    out = tmp_path / "m.png"
    res = CliRunner().invoke(cli, ["--state-dir", str(state), "events", "21", "--plot", str(out)])
    assert res.exit_code == 0, res.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert res.output.strip() == f"{out}: 2 migration(s) and snapshot(s) of job 21, phase by phase"
    layout.events_json(state, 21).write_text(json.dumps(EVENTS[:5]))  # before any migration ended
    res = CliRunner().invoke(cli, ["--state-dir", str(state), "events", "21", "--plot", str(out), "--json"])
    assert res.exit_code == 4 and json.loads(res.output)["error"]["code"] == "not_found", res.output
