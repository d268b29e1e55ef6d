"""Issue 2 end to end: sbatch --torchpass of a 3-node gloo DDP job on the devcluster.

The training script is examples/train_ddp.py, which knows nothing about
torchpass; the SPANK plugin starts the coordinator and loads the runtime.
Every job here is an ordinary user's (``job_user``), as on a real cluster.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from slurm_helpers import job_id_of, job_python, sbatch, tpassctl, wait_job, wait_running
from torchpass import layout
from training_jobs import train_script


def coordinator_pids(job_id: int, *, supervised: bool = False) -> list[int]:
    """Processes anywhere on this machine running job_id's ``tpass-coordinator`` (the supervisor the
    plugin starts), or with ``supervised`` the coordinators it runs (``--supervised``)."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            continue
        text = [a.decode(errors="replace") for a in argv]
        if "--job-id" not in text or text[text.index("--job-id") + 1] != str(job_id):
            continue
        if supervised and "--supervised" in text and "torchpass.coordinator.main" in text:
            pids.append(int(d))
        elif not supervised and any(a.endswith("tpass-coordinator") for a in text[:2]):
            pids.append(int(d))
    return pids


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def status_json(job_id: int, user: str | None = None) -> dict:
    out = tpassctl("status", str(job_id), "--json", user=user)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["jobs"][0]


def test_three_node_ddp_job_registers_ranks_and_reports_progress(cluster, plugin_built, job_dir, job_user):
    env_script = (
        f"#!/bin/bash\n#SBATCH -N3 --ntasks-per-node=1\n"
        f"export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1) MASTER_PORT=29511\n"
        f"srun --kill-on-bad-exit=1 {job_python()} {train_script(job_dir)} --steps 60 --sleep 0.1\n"
    )
    job_id = job_id_of(sbatch(["--torchpass", "-o", str(job_dir / "out.txt")], env_script, cwd=job_dir,
                              user=job_user.name))
    running = wait_running(job_id)

    # Wait until all three ranks have registered and report steps.
    deadline = time.monotonic() + 60
    st = {}
    while time.monotonic() < deadline:
        try:
            st = status_json(job_id, job_user.name)  # the owner sees their job
        except AssertionError:
            st = {}
        if st.get("registered_ranks") == 3 and (st.get("min_step") or -1) >= 0:
            break
        time.sleep(0.3)
    assert st.get("registered_ranks") == 3, f"status never showed 3 ranks: {st}"
    assert st["world_size"] == 3
    # One rank on each node Slurm gave the job (which three depends on what earlier tests on this
    # devcluster left drained or busy).
    assert len(running.nodes) == 3, running
    assert sorted(r["node"] for r in st["ranks"]) == sorted(running.nodes)
    assert all(r["last_report_age_s"] < 5 for r in st["ranks"])

    # Progress advances between two looks, and exactly one coordinator runs.
    first = st["max_step"]
    time.sleep(1.5)
    second = status_json(job_id)
    assert second["max_step"] > first, (first, second["max_step"])
    # One supervisor (the plugin's tpass-coordinator) and the one coordinator it runs, which is
    # the process the job registered.
    pids = coordinator_pids(job_id)
    assert len(pids) == 1, f"expected exactly one tpass-coordinator for job {job_id}, found {pids}"
    children = coordinator_pids(job_id, supervised=True)
    assert len(children) == 1 and _parent(children[0]) == pids[0], (pids, children)
    assert st["coordinator"]["pid"] == children[0]

    job = wait_job(job_id, timeout_s=120)
    assert (job.state, job.exit_code, job.restarts) == ("COMPLETED", 0, 0), (job_dir / "out.txt").read_text()[-2000:]
    lines = [ln for ln in (job_dir / "out.txt").read_text().splitlines() if ln.startswith("step=")]
    assert lines[-1].startswith("step=59 "), lines[-3:]

    # The coordinator goes with the job.
    deadline = time.monotonic() + 15
    while (coordinator_pids(job_id) or coordinator_pids(job_id, supervised=True)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert coordinator_pids(job_id) == [] and coordinator_pids(job_id, supervised=True) == []


def test_job_without_torchpass_gets_no_coordinator_and_no_env(cluster, plugin_built, job_dir, job_user):
    script = ("#!/bin/bash\n#SBATCH -N2\n"
              "srun -l sh -c 'env | grep ^TORCHPASS_ | wc -l; echo pythonpath=${PYTHONPATH:-}'\n")
    job_id = job_id_of(sbatch(["-o", str(job_dir / "plain.txt")], script, cwd=job_dir, user=job_user.name))
    job = wait_job(job_id, timeout_s=60)
    assert job.state == "COMPLETED"
    out = (job_dir / "plain.txt").read_text().split()
    assert sorted(out) == sorted(["0:", "0", "1:", "0", "0:", "pythonpath=", "1:", "pythonpath="]), out
    assert not layout.job_dir(cluster.state_dir, job_id).exists()


# Steps whose outcome the task wrapper must not change: stdin that
# srun forwards, an exit code, a step ended by SIGKILL (srun's answer to a SIGTERM) and
# one ended by scancel's SIGTERM. The task output goes through the wrapper's relay.
TRANSPARENT_STEPS = """#!/bin/bash
#SBATCH -N2 --ntasks-per-node=1
srun -N1 -n1 sh -c 'echo "wrapped=$(( PPID == 1 ))"'  # the rank's parent is tpass-init, PID 1 of its namespace
printf 'hello\\n' | srun -l sh -c 'read l; echo "got $l"' | sort
srun -N1 -n1 sh -c 'exit 3'; echo "exit=$?"
for how in kill scancel; do
  rm -f ready.txt
  srun -N1 -n1 -J victim -o ready.txt sh -c 'echo ready; exec sleep 300' & p=$!
  until grep -q ready ready.txt 2>/dev/null; do sleep 0.1; done
  if [ $how = kill ]; then kill -TERM $p  # srun ends its step with SIGKILL
  else scancel -s TERM $(squeue -h -s -j $SLURM_JOB_ID -o '%i %j' | awk '$2 == "victim" {print $1}')
  fi
  wait $p; echo "$how=$?"
done
"""


def _steps_outcome(job_dir: Path, name: str, args: list[str], user) -> tuple[list[str], list[str]]:
    """(what the batch script printed, srun's lines about its tasks) of TRANSPARENT_STEPS, run by
    ``user`` (a JobUser; root if None)."""
    d = job_dir / name
    d.mkdir()
    if user is not None:
        os.chown(d, user.uid, user.gid)
    job_id = job_id_of(sbatch([*args, "-o", str(d / "out.txt"), "-e", str(d / "err.txt")], TRANSPARENT_STEPS, cwd=d,
                              user=user and user.name))
    job = wait_job(job_id, timeout_s=120)
    out, err = (d / "out.txt").read_text(), (d / "err.txt").read_text()
    assert job.state == "COMPLETED", out + err
    tasks = sorted(ln for ln in err.splitlines() if ": task " in ln)
    return out.splitlines(), tasks


def test_the_rank_wrapper_keeps_stdin_exit_codes_and_signals_as_slurm_gives_them(cluster, plugin_built, job_dir):
    # The suite's root job: a root task goes through the same plugin hooks and wrapper as a user's.
    plain = _steps_outcome(job_dir, "plain", [], None)
    wrapped = _steps_outcome(job_dir, "torchpass", ["--torchpass"], None)
    assert plain[0] == ["wrapped=0", "0: got hello", "1: got hello", "exit=3", "kill=137", "scancel=143"], plain
    assert sum(": task 0: Terminated" in ln for ln in plain[1]) == 1, plain[1]
    assert wrapped == (["wrapped=1", *plain[0][1:]], plain[1])
