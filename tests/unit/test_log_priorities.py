"""Under systemd each log line starts with its sd-daemon priority (torchpass/logs.py), so that
journald stores warnings and errors as such; elsewhere lines carry no prefix."""

from __future__ import annotations

import io
import json
import os

import structlog

from torchpass import logs


def _journal_env(f) -> dict[str, str]:
    st = os.fstat(f.fileno())
    return {logs.JOURNAL_STREAM: f"{st.st_dev}:{st.st_ino}"}


def _lines(path) -> list[str]:
    return path.read_text().splitlines()


def test_error_warning_and_info_lines_carry_3_4_and_6(tmp_path, monkeypatch):
    out = tmp_path / "journal"
    with open(out, "w") as f:
        monkeypatch.setattr(os, "environ", {**os.environ, **_journal_env(f)})
        logs.configure("debug", stream=f)
        log = structlog.get_logger("t")
        log.error("e", n=1)
        log.warning("w")
        log.info("i")
        log.debug("d")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("x")
        log.critical("c")
    lines = _lines(out)
    assert [ln[:3] for ln in lines] == ["<3>", "<4>", "<6>", "<7>", "<3>", "<2>"]
    first = json.loads(lines[0][3:])  # the rest of the line is the JSON it always was
    assert first["event"] == "e" and first["level"] == "error" and first["n"] == 1
    assert "ValueError: boom" in json.loads(lines[4][3:])["exception"]


def test_no_prefix_when_stdout_is_not_the_journals_stream(tmp_path, monkeypatch):
    """JOURNAL_STREAM inherited from a service (slurmd's children) with output to a file: no prefix."""
    other = open(tmp_path / "other", "w")
    out = tmp_path / "file"
    with open(out, "w") as f, other:
        monkeypatch.setattr(os, "environ", {**os.environ, **_journal_env(other)})
        assert not logs.journal_stream(f) and logs.journal_stream(other)
        logs.configure("info", stream=f)
        structlog.get_logger("t").error("e")
    assert _lines(out)[0].startswith("{")


def test_an_explicit_setting_wins_either_way(tmp_path, monkeypatch):
    monkeypatch.delenv(logs.JOURNAL_STREAM, raising=False)
    buf = io.StringIO()  # no file descriptor: never the journal's
    assert not logs.journal_stream(buf)
    logs.configure("info", stream=buf, journal_prefix=True)
    structlog.get_logger("t").warning("w")
    assert buf.getvalue().startswith('<4>{"event": "w"')
    out = tmp_path / "j"
    with open(out, "w") as f:
        monkeypatch.setattr(os, "environ", {**os.environ, **_journal_env(f)})
        logs.configure("info", stream=f, journal_prefix=False)
        structlog.get_logger("t").warning("w")
    assert _lines(out)[0].startswith("{")


def test_plain_lines_get_the_prefix_on_the_journal_only(tmp_path, monkeypatch):
    out = tmp_path / "j"
    with open(out, "w") as f:
        monkeypatch.setattr(os, "environ", {**os.environ, **_journal_env(f)})
        logs.say("tpassd: policy.toml: unknown key", stream=f)
        logs.say("tpassd: configuration OK", level="info", stream=f)
    assert _lines(out) == ["<3>tpassd: policy.toml: unknown key", "<6>tpassd: configuration OK"]
    buf = io.StringIO()
    logs.say("tpassd: x", stream=buf)
    assert buf.getvalue() == "tpassd: x\n"


def test_malformed_journal_stream_is_not_the_journal(tmp_path):
    with open(tmp_path / "f", "w") as f:
        for bad in ("", "12", "a:b", ":", "1:2:3"):
            assert not logs.journal_stream(f, {logs.JOURNAL_STREAM: bad})
