"""torchrun and the other fallbacks: do no harm, and the coordinator hears why (issue 11, deliver 1, 3).

A job launched by torchrun cannot be moved (its workers are children of
torchrun's agent, which holds TCP connections to its rendezvous store). The
runtime sees it from what torchrun puts in every worker's environment
(``TORCHELASTIC_RUN_ID``) and runs torch's own ``init_process_group``: the
same group, the same losses bit for bit, the same exit code, and
``TORCHELASTIC_RESTART_COUNT`` still 0. One ``torchpass:`` line for the
whole job (from rank 0) says why and what to do instead, and every worker
registers with the coordinator as unprotected (the coordinator records the
event and starts no migration: tests/unit/test_coordinator_server.py covers
its side). On e994c1d the workers were wrapped as movable ranks (a
``ReconfigurablePG``), said nothing, and a migration was tried and rolled back.

Real ``torchrun --standalone --nproc-per-node=2`` here, with the runtime
loaded through boot/sitecustomize.py as in a job, against a MiniCoordinator.
"""

from __future__ import annotations

import os
import subprocess
import sys

from test_runtime_init_forms import SCRIPT as INIT_FORMS_SCRIPT

from torchpass.runtime import boot_dir, hook
from torchpass.runtime.testing import MiniCoordinator, free_port, run_ranks

# The init-forms script (its "noargs" form: init_process_group() as torchrun sets it up, and its
# "store" form), which first says which restart of torchrun's this worker is.
SCRIPT = ("import os; print('restarts', os.environ.get('TORCHELASTIC_RESTART_COUNT'), flush=True)\n"
          + INIT_FORMS_SCRIPT)
JOB_ID = 4711


def _torchrun(tmp_path, tag: str, runtime: bool, coordinator: str) -> tuple[int, list[str], str]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHPASS_", "SLURM_", "PYTHON", "TORCHELASTIC"))}
    env.update(PYTHONPATH=boot_dir(), TORCHPASS_JOB_ID=str(JOB_ID), TORCHPASS_RUNTIME="1" if runtime else "0",
               TORCHPASS_COORDINATOR=coordinator, TORCHPASS_NODE="nodeA", FORM="noargs")
    # Each worker's stdout to a file of its own (--redirects 1): two workers writing to one pipe
    # can interleave inside a line under load.
    logs = tmp_path / f"{tag}-logs"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--log-dir", str(logs), "--redirects", "1", str(script)]
    p = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180,
                       stdin=subprocess.DEVNULL)
    outs = sorted(logs.rglob("stdout.log"))
    lines = [ln for f in outs for ln in f.read_text().splitlines() if ln]
    # the workers' lines, both workers' together
    return p.returncode, sorted(lines), p.stderr + "".join(f"\n[{f}]" for f in outs)


def test_a_torchrun_job_runs_as_without_the_runtime_says_why_once_and_registers_unprotected(tmp_path):
    with MiniCoordinator(world_size=2, job_id=JOB_ID) as coord:
        plain_rc, plain, plain_err = _torchrun(tmp_path, "plain", False, coord.endpoint)
        assert plain_rc == 0 and "torchpass" not in plain_err, plain_err[-3000:]
        assert not coord.ranks  # the runtime switched off says nothing to anyone
        rc, out, err = _torchrun(tmp_path, "rt", True, coord.endpoint)
        ctx = "\n".join([*out, err[-3000:]])
        # torch's own group and math: the same lines bit for bit, the same exit code, no restart
        assert rc == plain_rc == 0, ctx
        assert out == plain, ctx
        assert len(out) == 2 * 6, ctx  # per worker: its restart count, its group, 4 steps
        assert [ln for ln in out if "group" in ln] == ["group ProcessGroup undefined"] * 2, ctx
        assert [ln for ln in out if "restarts" in ln] == ["restarts 0"] * 2, ctx
        said = [ln for ln in err.splitlines() if "torchpass" in ln]
        assert said == [f"torchpass: {hook.TORCHRUN_WHY}; training runs unprotected"], ctx
        assert "launched by torchrun" in said[0] and "srun" in said[0], said
        # every worker told the coordinator why (the coordinator turns it into one job.unprotected event)
        coord.wait_registered(timeout=30)
        assert {r: (v.node, v.unprotected) for r, v in coord.ranks.items()} == {
            r: ("nodeA", hook.TORCHRUN_WHY) for r in (0, 1)}


def test_a_fallback_for_a_store_of_the_script_tells_the_coordinator_too(tmp_path):
    """The same report from every fallback that started training: here init_process_group(store=...)
    (on e994c1d such a rank never spoke to the coordinator: no event, status showed nothing)."""
    with MiniCoordinator(world_size=2, job_id=JOB_ID) as coord:
        outs, errs = run_ranks(SCRIPT, 2, tmp_path, "store", runtime=True, env={"FORM": "store"}, timeout=120,
                               job_id=JOB_ID, coordinator=coord.endpoint)
        coord.wait_registered(timeout=30)
    why = "init_process_group was given its own store"
    assert all(out[1] == "group ProcessGroup gloo" for out in outs), outs
    assert {r: v.unprotected for r, v in coord.ranks.items()} == {0: why, 1: why}, errs


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_the_unprotected_report_gives_up_quietly_when_no_coordinator_answers(capfd):
    clock = _Clock()
    body = {"job_id": JOB_ID, "rank": 0, "world_size": 1, "node": "n", "pid": os.getpid(), "unprotected": "x"}
    # a port nobody serves: each try times out, the injected clock runs the back-off
    slept = []
    got = hook._register_unprotected(f"tcp://127.0.0.1:{free_port()}", body, None, limit_s=3.0, timeout_s=0.2,
                                     clock=clock, sleep=lambda s: (slept.append(s), clock.sleep(s)))
    assert got is False
    assert slept == [0.5, 1.0], slept  # then 2 s more would pass the 3 s
    assert capfd.readouterr().err == ""  # the rank's one line is said; nothing more


def test_the_unprotected_report_reaches_a_coordinator():
    with MiniCoordinator(world_size=1, job_id=JOB_ID) as coord:
        body = {"job_id": JOB_ID, "rank": 0, "world_size": 1, "node": "n", "pid": 7, "unprotected": "why"}
        assert hook._register_unprotected(coord.endpoint, body, None) is True
        assert coord.ranks[0].unprotected == "why" and coord.ranks[0].pid == 7
        # a coordinator of another job refuses it: no retry, no exception
        assert hook._register_unprotected(coord.endpoint, {**body, "job_id": JOB_ID + 1}, None) is False
