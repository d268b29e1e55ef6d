"""An ordinary user's moved rank, looked at from the kernel and Slurm.

test_migration.py and test_second_fault.py run the drills (a move, a rollback,
a second move, a called-off second move) as the job user and compare losses.
This module checks what those do not look at:

* after the move, on the spare: the rank runs as the job user (every uid and
  gid, the same supplementary groups) with no capability at all; its PID 1,
  tpass-init, holds CAP_SYS_ADMIN only; both are listed by Slurm for the job
  on that node (``scontrol listpids``: the restore step), and tpass-init's
  parent is the restore step's task (the subreaper the plugin made);
* the moved rank's exit status is the job's: a rank that exits 3 after its
  move ends the job FAILED 3:0, as it would have without torchpass.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

import training_jobs as tj
from slurm_helpers import job_id_of, job_python, sbatch, submit_env
from torchpass import layout
from training_jobs import TPASSCTL
from training_jobs import run as _run

pytestmark = pytest.mark.integration

SPARE = "node4"
CAP_SYS_ADMIN = 21


def _wait(pred, timeout_s: float, what: str, diag=lambda: ""):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if got := pred():
            return got
        time.sleep(0.2)
    raise AssertionError(f"{what} not within {timeout_s:g}s\n{diag()}")


def _events(cluster, job_id: int) -> list[dict]:
    try:
        return json.loads(layout.events_json(cluster.state_dir, job_id).read_text())
    except (OSError, ValueError):
        return []


def _diag(cluster, job_id: int, out: Path):
    def diag() -> str:
        log = layout.coordinator_log(cluster.state_dir, job_id)
        return ((out.read_text()[-2000:] if out.exists() else "no output") + "\n--- events ---\n"
                + "\n".join(f"{e['kind']}: {e['message']}" for e in _events(cluster, job_id))
                + "\n--- coordinator.log ---\n" + (log.read_text()[-3000:] if log.exists() else ""))
    return diag


def _status(pid: int) -> dict[str, list[str]]:
    text = Path(f"/proc/{pid}/status").read_text()
    return {k: v.split() for k, _, v in (ln.partition(":") for ln in text.splitlines())}


def _cleanup(job_id: int) -> None:
    _run(["scancel", str(job_id)])
    for n in ("node1", "node2", "node3", SPARE):
        _run([*TPASSCTL, "inject", "--node", n, "--fault", "clear"])
        _run(["scontrol", "update", f"NodeName={n}", "State=RESUME"])


def _drill_and_move(cluster, job_id: int, out: Path, diag) -> dict:
    """ECC drill on node2 once the job trains; the completed move of its rank (1) to the spare."""
    _wait(lambda: out.exists() and "step=3 " in out.read_text(), 120, "step 3", diag)
    assert _run([*TPASSCTL, "inject", "--node", "node2", "--fault", "ecc-sbe-storm"]).returncode == 0
    done = _wait(lambda: [e for e in _events(cluster, job_id) if e["kind"] == "migration.completed"],
                 150, "migration.completed", diag)
    assert done[0]["data"]["target"] == SPARE, diag()
    return done[0]


def test_a_moved_user_rank_keeps_its_ids_gets_no_capability_and_lives_in_the_restore_step(
        cluster, plugin_built, job_dir, job_user):
    job_id = tj.submit(job_dir, "ids", 400, nodes=4, user=job_user.name)
    out = job_dir / f"ids.{job_id}.out"
    diag = _diag(cluster, job_id, out)
    try:
        _drill_and_move(cluster, job_id, out, diag)
        rec = json.loads(layout.rank_record(layout.rank_records_dir(cluster.state_dir, job_id), job_id, 1)
                         .read_text())
        assert rec["node"] == SPARE and rec["pid"] != rec["rank_pid"], rec
        init, rank = _status(rec["pid"]), _status(rec["rank_pid"])
        groups = sorted(str(g) for g in os.getgrouplist(job_user.name, job_user.gid))
        for st in (init, rank):
            assert st["Uid"] == [str(job_user.uid)] * 4 and st["Gid"] == [str(job_user.gid)] * 4, st
        assert sorted(rank["Groups"]) == groups, (rank["Groups"], groups)
        # tpass-init alone keeps group root: its working directory, where CRIU's parasite mounts by
        # path with its capability, must be writable by it and by no process of the user
        assert sorted(init["Groups"]) == sorted({*groups, "0"}), (init["Groups"], groups)
        for cap in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
            assert int(rank[cap][0], 16) == 0, (cap, rank[cap])
        assert int(init["CapEff"][0], 16) == 1 << CAP_SYS_ADMIN and int(init["CapAmb"][0], 16) == 0, init
        assert init["PPid"] == [str(rec["wrapper_pid"])], (init["PPid"], rec)
        env = {**os.environ, **cluster.env()}
        listed = cluster.exec_on(SPARE, ["scontrol", "listpids", str(job_id)], capture_output=True, text=True,
                                 env=env, timeout=30)
        rows = [ln.split() for ln in listed.stdout.splitlines()[1:]]
        steps = {int(r[0]): r[2] for r in rows if len(r) >= 3 and r[0].isdigit()}
        assert rec["pid"] in steps and rec["rank_pid"] in steps and rec["wrapper_pid"] in steps, listed.stdout
        assert steps[rec["pid"]] == steps[rec["wrapper_pid"]] != "0", listed.stdout  # the restore step
        final = tj.wait_end(job_id, 240)
        assert final["job_state"][0] == "COMPLETED", diag()
        assert final["exit_code"]["return_code"]["number"] == 0 and int(final.get("restart_cnt", 0)) == 0, diag()
    finally:
        _cleanup(job_id)


EXIT_AFTER = """import os, runpy, sys
sys.argv = [sys.argv[1], *sys.argv[2:]]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")  # train_ddp.py ends with sys.exit(main())
except SystemExit as e:
    if e.code not in (0, None):
        raise
sys.exit(3 if os.environ.get("SLURM_PROCID") == "1" else 0)
"""


def test_the_moved_ranks_exit_status_is_the_jobs(cluster, plugin_built, job_dir, job_user):
    """Rank 1 (node2) moves to the spare, then exits 3: the job ends FAILED 3:0, as without torchpass."""
    script = job_dir / "exit_after.py"
    script.write_text(EXIT_AFTER)
    os.chown(script, job_user.uid, job_user.gid)
    train = tj.train_script(job_dir)
    proc = sbatch(["-N4", "--ntasks-per-node=1", "--torchpass=spares=1", "-o", str(job_dir / "x.%j.out")],
                  "#!/bin/bash\n"
                  f"srun {job_python()} {script} {train} --steps 150 --params 1M --sleep 0.05\n",
                  cwd=job_dir, user=job_user.name, env=submit_env(job_user.name))
    job_id = job_id_of(proc)
    out = job_dir / f"x.{job_id}.out"
    diag = _diag(cluster, job_id, out)
    try:
        _drill_and_move(cluster, job_id, out, diag)
        final = tj.wait_end(job_id, 240)
        assert final["job_state"][0] == "FAILED", (final["job_state"], diag())
        assert final["exit_code"]["return_code"]["number"] == 3, (final["exit_code"], diag())
        assert len(tj.steps(out.read_text())) == 3 * 150, diag()
    finally:
        _cleanup(job_id)


# A step's program that shows what the plugin started beside it: the task's children are forked in
# task_init_privileged, before the program is exec'd in the same process ($$).
PROBE = """#!/bin/sh
echo "PROBE-RAN $(id -u)"
ps -o uid=,args= --ppid $$ | sed 's/^/PROBE-CHILD /'
"""


def test_a_users_own_restore_variables_start_nothing_as_root(cluster, plugin_built, job_dir, job_user):
    """An ordinary user sets the variables of a restore step on an srun of their own: a migration's
    (TORCHPASS_RESTORE_RANK on a --torchpass=off step) and a relaunch's (TORCHPASS_RESTORE_SNAPSHOT on
    a --torchpass step), and writes a stop marker naming their next step. No tpassd set any up, so
    each step fails with one line, its program does not run, and no root restore agent is forked."""
    probe = job_dir / "probe.sh"
    probe.write_text(PROBE)
    probe.chmod(0o755)
    os.chown(probe, job_user.uid, job_user.gid)
    proc = sbatch(["-N1", "-n1", "--torchpass", "-o", str(job_dir / "attack.%j.out")],
                  "#!/bin/bash\n"
                  f"TORCHPASS_RESTORE_RANK=0 srun -N1 -n1 --torchpass=off {probe}; echo \"ATTACK-RANK rc=$?\"\n"
                  f"TORCHPASS_RESTORE_SNAPSHOT=s1 srun -N1 -n1 {probe}; echo \"ATTACK-SNAPSHOT rc=$?\"\n"
                  "printf 'snapshot=s1\\nstep=2\\n' > \"$TORCHPASS_STATE_DIR/jobs/$SLURM_JOB_ID/stopped\"\n"
                  f"srun -N1 -n1 {probe}; echo \"ATTACK-MARKER rc=$?\"\n",
                  cwd=job_dir, user=job_user.name, env=submit_env(job_user.name))
    job_id = job_id_of(proc)
    out = job_dir / f"attack.{job_id}.out"
    try:
        tj.wait_end(job_id, 120)
        text = out.read_text()
        assert "tpass-restore-agent" not in text and "restore agent audit" not in text, text
        assert "PROBE-RAN" not in text, text  # refused before the program: nothing of it ran
        refusals = [ln for ln in text.splitlines() if "did not set up" in ln]
        assert len(refusals) == 3 and all(ln.startswith("tpass: ") for ln in refusals), text
        assert "a migration restore" in refusals[0] and "a snapshot restore" in refusals[1], text
        assert "a stopped restore (the job's stop marker)" in refusals[2], text
        for attack in ("RANK", "SNAPSHOT", "MARKER"):
            assert f"ATTACK-{attack} rc=" in text and f"ATTACK-{attack} rc=0" not in text, text
    finally:
        _run(["scancel", str(job_id)])
