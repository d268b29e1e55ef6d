"""`make gpu-check` on a machine without a GPU says so in one line and stops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(any(p.name[6:].isdigit() for p in Path("/dev").glob("nvidia*")), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py")], capture_output=True, text=True,
                       env=dict(os.environ, OUT=str(tmp_path)), timeout=60)
    assert r.returncode == 3
    assert r.stdout.splitlines() == ["gpu-check: no GPU on this machine (no /dev/nvidia<N>): nothing to check"]
    assert [json.loads(line)["status"] for line in (tmp_path / "checks.jsonl").read_text().splitlines()] == ["absent"]

