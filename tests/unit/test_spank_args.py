"""The SPANK plugin's C parser tests (slurm_spank/tests/test_args.c) and its
exported-symbol check, run through the plugin's own Makefile.

Needs gcc, make and the Slurm headers (libslurm-dev), which `make deps`
installs; a missing one is a failure, not a skip.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

SPANK_DIR = Path(__file__).resolve().parents[2] / "slurm_spank"


def _make(*targets: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", "-C", str(SPANK_DIR), *targets], capture_output=True, text=True,
                          timeout=300)


def test_c_parser_unit_tests_pass():
    proc = _make("test")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"make -C slurm_spank test failed:\n{out[-4000:]}"
    m = re.search(r"(\d+) checks, (\d+) failed", out)
    assert m, f"no summary line from test_args:\n{out[-2000:]}"
    checks, failed = int(m.group(1)), int(m.group(2))
    assert failed == 0
    assert checks >= 150, f"only {checks} checks ran"
    assert "exports ok" in out


def test_plugin_exports_only_the_spank_interface():
    assert _make("torchpass.so").returncode == 0
    proc = subprocess.run(["nm", "-D", "--defined-only", str(SPANK_DIR / "torchpass.so")], capture_output=True,
                          text=True, check=True)
    names = {line.split()[-1] for line in proc.stdout.splitlines() if line.strip()}
    assert {"slurm_spank_init", "slurm_spank_init_post_opt", "slurm_spank_user_init", "slurm_spank_task_init",
            "slurm_spank_task_init_privileged", "slurm_spank_exit", "slurm_spank_job_epilog", "plugin_name",
            "plugin_type", "plugin_version", "spank_plugin_version"} <= names
    leaked = sorted(n for n in names if not re.match(r"^(slurm_spank_|plugin_|spank_plugin_version$)", n))
    assert leaked == [], f"torchpass.so exports internal symbols: {leaked}"
    strings = subprocess.run(["strings", str(SPANK_DIR / "torchpass.so")], capture_output=True, text=True,
                             check=True).stdout
    assert "[torchpass]" in strings  # option help starts with the tag


def test_every_log_line_is_prefixed():
    """Logging goes through tpass_error/info/verbose/debug, which add 'tpass: '."""
    for src in SPANK_DIR.glob("*.c"):
        text = src.read_text()
        if src.name == "common.c":
            continue
        direct = re.findall(r"\bslurm_(?:error|info|verbose|debug\d?|spank_log)\s*\(", text)
        assert not direct, f"{src.name} logs without the 'tpass: ' prefix: {direct}"
