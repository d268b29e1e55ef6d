"""Live migration end to end on the devcluster (issue 4).

``sbatch -N4 --torchpass=spares=1`` of a 3-rank gloo DDP job
(examples/train_ddp.py, unchanged); a fault drill makes a training node's
tpassd publish ``degraded``; the coordinator pauses every rank at the same
collective, CRIU-dumps the rank on that node (tpassd.snapshot), restores it
on the hot spare inside a job step of the same job, kills the source copy,
rebuilds the process group and resumes. The job keeps its id, is never
requeued, ends COMPLETED 0:0, and its per-step losses equal a fault-free run
of the same job bit for bit; the node is drained with a torchpass reason and
the events carry the phase durations.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train_ddp.py"
STEPS = 150
FAULT_AT_STEP = 12
TPASSCTL = [str(Path(sys.executable).parent / "tpassctl")]


def _run(argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, **kw)


def _submit(job_dir: Path, tag: str) -> int:
    script = job_dir / f"{tag}.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f"srun {sys.executable} {TRAIN} --steps {STEPS} --params 1M --sleep 0.05\n"
    )
    proc = _run(["sbatch", "--parsable", "-N4", "--ntasks-per-node=1", "--torchpass=spares=1",
                 "-o", str(job_dir / f"{tag}.%j.out"), str(script)], cwd=job_dir)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.strip().split(";")[0])


def _job(job_id: int) -> dict:
    out = _run(["scontrol", "show", "job", str(job_id), "--json"])
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["jobs"][0]


def _wait_end(job_id: int, timeout_s: float = 240) -> dict:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        j = _job(job_id)
        if not set(j["job_state"]) & {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING"}:
            return j
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} still {j['job_state']} after {timeout_s}s")


def _steps(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if re.fullmatch(r"step=\d+ loss=\S+", ln)]


def _per_step(lines: list[str]) -> dict[int, Counter]:
    out: dict[int, Counter] = {}
    for ln in lines:
        n = int(ln.split()[0].split("=")[1])
        out.setdefault(n, Counter())[ln] += 1
    return out


def test_degraded_node_rank_migrates_to_hot_spare_bit_identical(cluster, plugin_built, job_dir):
    node = "node2"
    # The fault-free run of the same job (every rank prints the global mean loss).
    ref_id = _submit(job_dir, "ref")
    ref = _wait_end(ref_id)
    ref_out = (job_dir / f"ref.{ref_id}.out").read_text()
    assert ref["job_state"][0] == "COMPLETED", ref_out[-3000:]
    ref_lines = _steps(ref_out)
    assert len(ref_lines) == 3 * STEPS, ref_out[-3000:]

    job_id = _submit(job_dir, "mig")
    out_path = job_dir / f"mig.{job_id}.out"
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end:
            if out_path.exists() and f"step={FAULT_AT_STEP} " in out_path.read_text():
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"job {job_id} did not reach step {FAULT_AT_STEP}: "
                                 + (out_path.read_text()[-3000:] if out_path.exists() else "no output"))
        inj = _run([*TPASSCTL, "inject", "--node", node, "--fault", "ecc-sbe-storm"])
        assert inj.returncode == 0, inj.stderr
        final = _wait_end(job_id)
        text = out_path.read_text()
        coord_log = cluster.state_dir / "jobs" / str(job_id) / "coordinator.log"
        diag = text[-3000:] + "\n--- coordinator.log ---\n" + (coord_log.read_text()[-6000:] if coord_log.exists() else "")
        assert final["job_state"][0] == "COMPLETED", diag
        assert final["exit_code"]["return_code"]["number"] == 0, diag
        assert int(final.get("restart_cnt", 0)) == 0, diag
        # Same losses, every step, exactly once per rank: no gap, no duplicate.
        assert _per_step(_steps(text)) == _per_step(ref_lines), diag
        # The node was drained with the torchpass reason.
        n = json.loads(_run(["scontrol", "show", "node", node, "--json"]).stdout)["nodes"][0]
        assert "DRAIN" in n["state"], n["state"]
        assert n["reason"].startswith("torchpass: "), n["reason"]
        # The events name the phases and their durations.
        events = json.loads((cluster.state_dir / "jobs" / str(job_id) / "events.json").read_text())
        done = [e for e in events if e["kind"] == "migration.completed"]
        assert done, ([e['kind'] for e in events], diag)
        pd = done[0]["data"]["phase_durations"]
        for ph in ("detect", "pause", "dump", "transfer", "restore", "kill_source", "rebuild", "paused", "total"):
            assert ph in pd, pd
        assert done[0]["data"]["target"] == "node4"
        print(f"\nmigration {node} -> node4: phases {pd} tools {done[0]['data'].get('tool_durations')}")
    finally:
        _run(["scancel", str(job_id)])
        _run([*TPASSCTL, "inject", "--node", node, "--fault", "clear"])
        _run(["scontrol", "update", f"NodeName={node}", "State=RESUME"])
