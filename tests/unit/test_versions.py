"""One version, pyproject.toml's: every program's --version, the Python package's and the SPANK
plugin's (the Makefile passes it as -DTPASS_VERSION; slurmd logs it once with the Slurm release the
plugin was built for, which is how an admin tells a plugin not rebuilt at a Slurm upgrade)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import torchpass

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PROGRAMS = ("tpassd", "tpassctl", "tpass-coordinator", "tpass-rankwrap", "tpass-restore-agent")


def pyproject_version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def test_every_console_script_is_checked():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert sorted(scripts) == sorted(PROGRAMS)


def test_the_package_reports_pyprojects_version():
    assert torchpass.__version__ == pyproject_version()


@pytest.mark.parametrize("program", PROGRAMS)
def test_every_program_reports_pyprojects_version(program):
    proc = subprocess.run([str(BIN / program), "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = (proc.stdout + proc.stderr).strip()
    assert re.fullmatch(rf"{re.escape(program)},? (version )?{re.escape(pyproject_version())}", out), out


def test_the_plugin_carries_pyprojects_version_and_the_slurm_release_it_was_built_for():
    proc = subprocess.run(["make", "-s", "-C", str(REPO / "slurm_spank"), "torchpass.so"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = re.findall(rb"torchpass (\S+), built for Slurm %d\.%02d\.%d",
                       (REPO / "slurm_spank" / "torchpass.so").read_bytes())
    assert found == [pyproject_version().encode()], found
