"""tpassctl's shared pieces without a peer: where the state directory comes from, --state-dir after
the subcommand, the table printer, and how a --wait shows phases (a TTY, lines, JSON lines)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tpassctl import follow
from tpassctl.cli import cli
from tpassctl.context import DEFAULT_STATE_DIR, resolve_state_dir
from tpassctl.exit_codes import CliError
from tpassctl.table import table


def _conf(tmp_path: Path, text: str) -> dict[str, str]:
    conf = tmp_path / "tpassd.toml"
    conf.write_text(text)
    return {"TORCHPASS_TPASSD_CONFIG": str(conf)}


def test_state_dir_precedence_flag_env_tpassd_toml_default(tmp_path):
    env = _conf(tmp_path, 'state_dir = "/shared/torchpass"\ncontrol_port = 718\n')
    assert resolve_state_dir(Path("/f"), {**env, "TORCHPASS_STATE_DIR": "/e"}) == (Path("/f"), "--state-dir")
    assert resolve_state_dir(None, {**env, "TORCHPASS_STATE_DIR": "/e"}) == (Path("/e"), "TORCHPASS_STATE_DIR")
    assert resolve_state_dir(None, env) == (Path("/shared/torchpass"), str(tmp_path / "tpassd.toml"))
    no_key = _conf(tmp_path, "control_port = 718\n")
    assert resolve_state_dir(None, no_key) == (DEFAULT_STATE_DIR, "default")
    missing = {"TORCHPASS_TPASSD_CONFIG": str(tmp_path / "none.toml")}
    assert resolve_state_dir(None, missing) == (DEFAULT_STATE_DIR, "default")


@pytest.mark.parametrize("text,why", [("state_dir = 'relative/dir'\n", "must be an absolute path"),
                                      ("state_dir = [\n", "is not valid TOML")])
def test_a_bad_state_dir_in_tpassd_toml_is_a_usage_error_not_a_silent_default(tmp_path, text, why):
    with pytest.raises(CliError) as exc:
        resolve_state_dir(None, _conf(tmp_path, text))
    assert exc.value.code == "usage" and exc.value.exit_code == 2 and why in exc.value.format_message()


@pytest.mark.parametrize("where", ["before", "after"])
def test_state_dir_is_taken_before_or_after_the_subcommand(tmp_path, monkeypatch, where):
    monkeypatch.delenv("TORCHPASS_STATE_DIR", raising=False)
    monkeypatch.setenv("TORCHPASS_TPASSD_CONFIG", str(tmp_path / "none.toml"))
    missing = str(tmp_path / "nowhere")
    argv = ["--state-dir", missing, "status"] if where == "before" else ["status", "--state-dir", missing]
    res = CliRunner().invoke(cli, argv)
    assert res.exit_code == 2 and f"no torchpass state directory at {missing}" in res.output, res.output


def test_the_state_dir_of_tpassd_toml_is_used_when_nothing_names_one(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHPASS_STATE_DIR", raising=False)
    monkeypatch.setenv("TORCHPASS_TPASSD_CONFIG", _conf(tmp_path, f'state_dir = "{tmp_path}/from-toml"\n')[
        "TORCHPASS_TPASSD_CONFIG"])
    res = CliRunner().invoke(cli, ["status", "--json"])
    assert res.exit_code == 2, res.output
    message = json.loads(res.output)["error"]["message"]
    assert message.startswith(f"no torchpass state directory at {tmp_path}/from-toml"), message


def test_table_aligns_columns_under_headers():
    lines = table(("RANK", "NODE", "HOST PID"), [(0, "node1", 4242), (10, "n2", None)], right=("RANK", "HOST PID"))
    assert lines == ["RANK  NODE   HOST PID",
                     "   0  node1      4242",
                     "  10  n2            -"]
    with pytest.raises(ValueError):
        table(("A", "B"), [(1,)])


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


class _Feed:
    """A job's feed as follow.Feed gives it: job.status answers in turn, then the end event."""

    def __init__(self, phases: list[str], end: dict):
        self.job_id, self.ended = 7, False
        self.phases, self.end = list(phases), end

    def poll(self):
        return [self.end] if not self.phases else []

    def status(self):
        return {"migration": {"id": "m1", "phase": self.phases.pop(0), "phase_age_s": 0.5}} if self.phases else None


PHASES = ["pause", "pause", "dump", "restore", "restore", "rebuild"]
END = {"seq": 9, "kind": "migration.completed", "message": "m1: moved", "data": {"migration": "m1",
                                                                              "outcome": "completed"}}


def _wait(report, feed, wait_s=60.0):
    from tpassctl.migrate_cmd import migration_ended, migration_phase

    clock = _Clock()
    return follow.wait_for(feed, wait_s, report, "m1", migration_phase("m1"), migration_ended("m1"),
                           clock=clock, sleep=clock.sleep)


def test_wait_prints_one_line_per_phase_when_not_a_tty():
    out = io.StringIO()
    ev = _wait(follow.PhaseReport(False, out, tty=False), _Feed(PHASES, END))
    assert ev is END
    assert out.getvalue().splitlines() == ["m1: pause", "m1: dump", "m1: restore", "m1: rebuild"]


def test_wait_rewrites_one_live_line_on_a_tty():
    out = io.StringIO()
    report = follow.PhaseReport(False, out, tty=True)
    _wait(report, _Feed(PHASES, END))
    report.outcome("m1: moved", {})
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\r\x1b[2Km1: moved\n")
    assert "\r\x1b[2Km1: dump (0.5s)" in text


def test_wait_prints_json_lines_under_json_and_times_out():
    out = io.StringIO()
    _wait(follow.PhaseReport(True, out), _Feed(PHASES, END))
    assert [json.loads(ln)["phase"] for ln in out.getvalue().splitlines()] == ["pause", "dump", "restore", "rebuild"]
    never = _Feed(["pause"] * 1000, END)
    assert _wait(follow.PhaseReport(True, io.StringIO()), never, wait_s=2.0) is None  # the caller exits 3
