"""Helpers shared by the live-migration integration tests: submit the plain DDP
example under --torchpass, read its per-step losses, wait for the job's end."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train_ddp.py"
TPASSCTL = [str(Path(sys.executable).parent / "tpassctl")]
ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING"}


def run(argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, **kw)


def submit(job_dir: Path, tag: str, steps: int, nodes: int, torchpass: str = "spares=1") -> int:
    """sbatch examples/train_ddp.py (1M parameters, one rank per training node); the job id."""
    script = job_dir / f"{tag}.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f"srun {sys.executable} {TRAIN} --steps {steps} --params 1M --sleep 0.05\n"
    )
    proc = run(["sbatch", "--parsable", f"-N{nodes}", "--ntasks-per-node=1", f"--torchpass={torchpass}",
                "-o", str(job_dir / f"{tag}.%j.out"), str(script)], cwd=job_dir)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.strip().split(";")[0])


def job(job_id: int) -> dict:
    out = run(["scontrol", "show", "job", str(job_id), "--json"])
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["jobs"][0]


def node(name: str) -> dict:
    """``scontrol show node NAME --json``: the node's record (state, reason, ...)."""
    return json.loads(run(["scontrol", "show", "node", name, "--json"]).stdout)["nodes"][0]


def drain_audit(cluster, node_name: str, job_id: int) -> list[dict]:
    """The audit lines of ``tpassd.drain`` requests for ``job_id`` in ``node_name``'s tpassd log
    (requester_uid, health, reason, outcome): who asked tpassd to drain the node, and why it did."""
    lines = []
    for ln in (cluster.run_dir / "log" / f"tpassd.{node_name}.log").read_text(errors="replace").splitlines():
        try:
            e = json.loads(ln)
        except ValueError:
            continue
        if isinstance(e, dict) and e.get("event") == "privileged action" and e.get("action") == "drain" \
                and e.get("job_id") == job_id:
            lines.append(e)
    return lines


def wait_end(job_id: int, timeout_s: float = 240, context: str = "") -> dict:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        j = job(job_id)
        if not set(j["job_state"]) & ACTIVE:
            return j
        time.sleep(0.5)
    raise AssertionError(f"{context}job {job_id} still {j['job_state']} after {timeout_s}s")


def steps(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if re.fullmatch(r"step=\d+ loss=\S+", ln)]


def per_step(lines: list[str]) -> dict[int, Counter]:
    """step -> how often each exact line appeared (every rank prints the same global loss)."""
    out: dict[int, Counter] = {}
    for ln in lines:
        n = int(ln.split()[0].split("=")[1])
        out.setdefault(n, Counter())[ln] += 1
    return out
