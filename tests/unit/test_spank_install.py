"""`make -C slurm_spank install` installs what a node needs, as the plugin needs it: torchpass.so and
tpass-init, 0755, root's and writable by no one else (the plugin runs tpass-init only then; without
it no ordinary user's rank gets its PID namespace, and none can migrate). `-Werror` applies only
with WERROR=1, so a site's newer compiler's new warning does not fail its build.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

SPANK_DIR = Path(__file__).resolve().parents[2] / "slurm_spank"


# What a calling make passes down (`make test WERROR=1` puts WERROR=1 in MAKEFLAGS): the builds
# here must see only the variables each test gives.
_MAKE_ENV_DROPPED = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "WERROR")


def _make(*args: str, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in _MAKE_ENV_DROPPED}
    return subprocess.run(["make", "-s", "-C", str(SPANK_DIR), *args], capture_output=True, text=True,
                          timeout=300, env=env, **kw)


def test_install_puts_the_plugin_and_tpass_init_root_owned_and_writable_by_root_alone(tmp_path):
    proc = _make("install", f"DESTDIR={tmp_path}", "PREFIX=/usr")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    libdir = tmp_path / "usr" / "lib" / "slurm"
    installed = sorted(p.name for p in libdir.iterdir())
    assert installed == ["torchpass.so", "tpass-init"], installed
    for name in installed:
        st = (libdir / name).lstat()
        assert stat.S_ISREG(st.st_mode), name
        assert stat.S_IMODE(st.st_mode) == 0o755, (name, oct(st.st_mode))
        assert (st.st_uid, st.st_gid) == (0, 0), (name, st.st_uid, st.st_gid)
        assert not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH), name
        # the installed copy is the built one, not an empty or stale file
        assert (libdir / name).read_bytes() == (SPANK_DIR / name).read_bytes(), name
    assert os.access(libdir / "tpass-init", os.X_OK)


def _compile_lines(*args: str) -> list[str]:
    """The compiler commands a full rebuild of torchpass.so would run (make -n -B: nothing is built)."""
    proc = _make("-n", "-B", "torchpass.so", "tpass-init", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [line for line in proc.stdout.splitlines() if " -c " in line or "tpass_init.c" in line]


def test_werror_only_with_werror_1():
    default = _compile_lines()
    assert default and not any("-Werror" in line for line in default), default[:2]
    strict = _compile_lines("WERROR=1")
    assert strict and all("-Werror" in line for line in strict), strict[:2]
    assert not any("-Werror" in line for line in _compile_lines("WERROR=0"))
