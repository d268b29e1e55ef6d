"""The SPANK plugin's state-directory names (slurm_spank/layout.h) agree with
torchpass.layout, and the plugin's C files spell none of them themselves."""

from __future__ import annotations

import re
from pathlib import Path

from torchpass import layout

SPANK_DIR = Path(__file__).resolve().parents[2] / "slurm_spank"
DEFINE = re.compile(r'^#define\s+TPASS_LAYOUT_([A-Z0-9_]+)\s+"([^"\\]*)"\s*$', re.M)


def c_layout() -> dict[str, str]:
    return dict(DEFINE.findall((SPANK_DIR / "layout.h").read_text()))


def string_literals(c_source: str) -> list[str]:
    """The string literals of a C file, comments removed."""
    no_comments = re.sub(r"/\*.*?\*/|//[^\n]*", " ", c_source, flags=re.S)
    return re.findall(r'"((?:[^"\\\n]|\\.)*)"', no_comments)


def test_every_c_layout_name_equals_the_python_one():
    names = c_layout()
    assert {"JOBS", "COORDINATOR_PID", "COORDINATOR_LOG", "HOSTFILE"} <= names.keys(), names
    for name, value in names.items():
        assert hasattr(layout, name), f"layout.h defines TPASS_LAYOUT_{name} but torchpass.layout has no {name}"
        assert getattr(layout, name) == value, (
            f"TPASS_LAYOUT_{name} is {value!r} in layout.h but torchpass.layout.{name} is {getattr(layout, name)!r}")


MODE = re.compile(r'^#define\s+TPASS_LAYOUT_([A-Z0-9_]+)\s+(0[0-7]*)\s*$', re.M)


def test_every_c_layout_mode_equals_the_python_one():
    modes = dict(MODE.findall((SPANK_DIR / "layout.h").read_text()))
    assert {"JOBS_DIR_MODE", "JOB_DIR_MODE", "JOB_FILE_MODE", "JOB_UMASK"} <= modes.keys(), modes
    for name, value in modes.items():
        assert getattr(layout, name) == int(value, 8), (
            f"TPASS_LAYOUT_{name} is {value} in layout.h but torchpass.layout.{name} is {getattr(layout, name):o}")


def test_no_c_file_spells_a_layout_name():
    values = set(c_layout().values())
    offenders = []
    for src in sorted(SPANK_DIR.glob("*.c")):
        for literal in string_literals(src.read_text()):
            # a path component of a literal such as "%s/jobs/%u"
            if values & set(literal.split("/")):
                offenders.append(f"{src.name}: \"{literal}\"")
    assert offenders == [], f"use the TPASS_LAYOUT_* names of layout.h instead: {offenders}"


def test_the_checks_see_a_spelled_name():
    """The literal scan finds a layout name inside a path and ignores comments."""
    assert string_literals('/* "jobs" */ x = "%s/jobs/%u";') == ["%s/jobs/%u"]
    assert "jobs" in "%s/jobs/%u".split("/")


def test_the_restore_token_names_and_lifetime_agree():
    """The plugin (token.c) and tpassd (torchpass.checkpoint.restore_token) meet in one directory."""
    names = c_layout()
    assert names["RESTORE_TOKENS"] == layout.RESTORE_TOKENS and names["TOKEN_SUFFIX"] == layout.TOKEN_SUFFIX
    ttl = re.search(r"^#define\s+TPASS_RESTORE_TOKEN_TTL_S\s+(\d+)\s*$", (SPANK_DIR / "layout.h").read_text(), re.M)
    assert ttl and int(ttl.group(1)) == layout.RESTORE_TOKEN_TTL_S
    token_c = (SPANK_DIR / "token.c").read_text()
    for kind in layout.TOKEN_KINDS:
        assert f'"{kind}"' in token_c or kind == layout.STOPPED, kind
    assert layout.restore_token("/t", "n", 7, "migration", rank=2).name == "job7.rank2.token"
    assert '"job%u.rank%u" TPASS_LAYOUT_TOKEN_SUFFIX' in token_c
    assert '"job%u.%s.step%u" TPASS_LAYOUT_TOKEN_SUFFIX' in token_c
