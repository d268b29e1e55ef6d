"""The audit's job-side probe, run as the audit runs it (``python -c`` source): its checksum is
the one the audit expects, and it says "absent" for the hardware tools this host lacks."""

from __future__ import annotations

import json
import subprocess
import sys

from torchpass.fleet import audit as A
from torchpass.fleet import workload


def test_the_probe_computes_the_checksum_the_audit_expects():
    out = subprocess.run([sys.executable, "-c", A.PROBE_SOURCE, "compute", "--n=32", "--iters=7", "--repeats=2"],
                         capture_output=True, text=True, timeout=60, check=True)
    got = json.loads(out.stdout)
    assert got["checksum"] == workload.expected_checksum(32, 7)
    assert got["tools"]["dcgmi"] in ("absent",) or isinstance(got["tools"]["dcgmi"], dict)
