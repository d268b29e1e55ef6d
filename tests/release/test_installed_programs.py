"""From the installed wheel: every program's --help and --version, the package data the docs name,
and the plugin and tpass-init as `make install` left them."""

from __future__ import annotations

import filecmp
import re
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import torchpass
import tpassctl
import tpassd

pytestmark = pytest.mark.host  # runs the tpass-* programs and tpassd

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PROGRAMS = sorted(PYPROJECT["project"]["scripts"])
VERSION = PYPROJECT["project"]["version"]


def test_the_packages_come_from_the_venv_not_the_checkout():
    for pkg in (torchpass, tpassd, tpassctl):
        where = Path(pkg.__file__).resolve()
        assert where.is_relative_to(Path(sys.prefix).resolve()) and not where.is_relative_to(REPO), where
    assert torchpass.__version__ == VERSION


@pytest.mark.parametrize("program", PROGRAMS)
def test_every_program_answers_help_and_version(program):
    exe = BIN / program
    assert exe.is_file(), f"{program} is not installed in {BIN}"
    helped = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60, cwd="/")
    assert helped.returncode == 0 and re.search(r"^usage:", helped.stdout, re.I | re.M), helped.stderr[-2000:]
    versioned = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60, cwd="/")
    assert versioned.returncode == 0, versioned.stderr[-2000:]
    assert re.fullmatch(rf"{re.escape(program)},? (version )?{re.escape(VERSION)}", versioned.stdout.strip())


def test_the_package_data_is_installed_and_contrib_is_the_checkouts():
    root = Path(torchpass.__file__).parent
    assert (root / "runtime" / "boot" / "sitecustomize.py").is_file()
    assert (Path(tpassd.__file__).parent / "policy_default.toml").is_file()
    compared = filecmp.dircmp(REPO / "contrib", root / "contrib", ignore=["__pycache__"])
    assert not (compared.left_only or compared.right_only or compared.diff_files), compared.report()
    # tpassd reads its installed default policy: --check-config prints it
    proc = subprocess.run([str(BIN / "tpassd"), "--check-config", "--config", str(root / "contrib" /
                           "tpassd.toml.example"), "--nvml-provider", "none"], capture_output=True, text=True,
                          timeout=60, cwd="/")
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_make_install_left_the_plugin_and_tpass_init_root_owned_and_of_this_version(plugin_dir):
    for name in ("torchpass.so", "tpass-init"):
        st = (plugin_dir / name).lstat()
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o755 and st.st_uid == 0, name
    found = re.findall(rb"torchpass (\S+), built for Slurm", (plugin_dir / "torchpass.so").read_bytes())
    assert found == [VERSION.encode()], found
