"""torchrun's workers are ranks, and the other fallbacks tell the coordinator.

A worker of torchrun (``TORCHELASTIC_RUN_ID`` in its environment) gets a
``ReconfigurablePG`` like a task srun started; its first store is its agent's
(``TORCHELASTIC_USE_AGENT_STORE``), of which it is only a client. Real
``torchrun --nproc-per-node=2`` here, with the runtime loaded through
boot/sitecustomize.py as in a job, against a MiniCoordinator, in two forms:

* ``--standalone``: the agent serves the rendezvous store (and the workers'
  bootstrap store): each worker registers its node as pinned;
* a client agent (``is_host=false``, the store served by the test; the
  bootstrap store by worker 0, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which
  the runtime in the agent sets too): not pinned, and while both workers
  hold, the agent holds no socket either (the whole tree could be dumped),
  then connects again.

Each: the same losses bit for bit as with the runtime switched off, a pause in
the middle of training where both workers hold and close every socket, a
resume at a new rendezvous, exit 0 and ``TORCHELASTIC_RESTART_COUNT`` 0; each
worker registers its task (the rank wrapper's ``TORCHPASS_TASK``). (Without
the task key every worker falls back to torch's own group, unprotected.)
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from test_runtime_init_forms import SCRIPT as INIT_FORMS_SCRIPT
from torchpass.runtime import boot_dir, hook
from torchpass.runtime.control import AGENT_SERVES_WHY
from torchpass.runtime.pg import count_sockets
from torchpass.runtime.testing import MiniCoordinator, free_port, hold_files, run_ranks

SCRIPT = INIT_FORMS_SCRIPT  # for the store fallback below
JOB_ID = 4711
STEPS = 40
# The init-forms script in its "noargs" form (init_process_group() as torchrun sets it up), 40
# steps, 50 ms apart (room for a pause), which first says which restart of torchrun's this is.
TRAIN = ("import os; print('restarts', os.environ.get('TORCHELASTIC_RESTART_COUNT'), flush=True)\n"
         + INIT_FORMS_SCRIPT)
TRAIN_ENV = {"FORM": "noargs", "STEPS": str(STEPS), "STEP_SLEEP": "0.05"}


def _torchrun(tmp_path, tag: str, runtime: bool, coordinator: str, store_port: int | None = None):
    """torchrun of TRAIN: standalone, or (``store_port``) as a client of the rendezvous store there."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHPASS_", "SLURM_", "PYTHON", "TORCHELASTIC"))}
    env.update(PYTHONPATH=boot_dir(), TORCHPASS_JOB_ID=str(JOB_ID), TORCHPASS_RUNTIME="1" if runtime else "0",
               TORCHPASS_COORDINATOR=coordinator, TORCHPASS_NODE="nodeA", TORCHPASS_TASK="3",
               TORCHPASS_STATE_DIR=str(tmp_path), **TRAIN_ENV)
    # Each worker's stdout to a file of its own (--redirects 1): two workers writing to one pipe
    # can interleave inside a line under load.
    logs = tmp_path / f"{tag}-logs"
    if store_port is None:
        rdzv = ["--standalone", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
    else:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # no bootstrap server in the agent
        rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{store_port}", "--rdzv-conf=is_host=false",
                f"--rdzv-id={tag}", f"--master-port={free_port()}"]
    argv = [sys.executable, "-m", "torch.distributed.run", *rdzv, "--nnodes=1", "--nproc-per-node=2",
            "--log-dir", str(logs), "--redirects", "1", str(script)]
    return subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL), logs


def _finish(proc, logs) -> tuple[int, list[str], str]:
    out, err = proc.communicate(timeout=180)
    files = sorted(logs.rglob("stdout.log"))
    lines = [ln for f in files for ln in f.read_text().splitlines() if ln]
    return proc.returncode, sorted(lines), err + "".join(f"\n[{f}]" for f in files)


@pytest.fixture(scope="module")
def rdzv_store():
    """A c10d rendezvous store served by the test, outside the agent (multi-tenant, as torch's)."""
    return dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=60), wait_for_workers=False,
                         multi_tenant=True)


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """TRAIN under torchrun with the runtime switched off (one run for both forms: the
    rendezvous changes nothing of the training): its exit code and its workers' lines."""
    with MiniCoordinator(world_size=2, job_id=JOB_ID) as coord:
        rc0, plain, plain_err = _finish(*_torchrun(tmp_path_factory.mktemp("plain"), "plain", False, coord.endpoint))
        assert rc0 == 0 and "torchpass" not in plain_err, plain_err[-3000:]
        assert not coord.ranks  # the runtime switched off says nothing to anyone
    return rc0, plain


@pytest.mark.parametrize("form", ["standalone", "client"])
def test_torchrun_workers_are_ranks_that_pause_hold_and_resume_bit_identically(tmp_path, form, rdzv_store,
                                                                               plain_run):
    port = rdzv_store.port if form == "client" else None
    rc0, plain = plain_run
    with MiniCoordinator(world_size=2, job_id=JOB_ID) as coord:
        proc, logs = _torchrun(tmp_path, "rt", True, coord.endpoint, port)
        agent_sockets = None
        try:
            coord.wait_registered(timeout=60)
            bodies = {r: v.history[0][1] for r, v in coord.ranks.items()}
            coord.wait_collectives(12)
            hold = hold_files(tmp_path, JOB_ID, "m1", (0, 1))
            at, gen = coord.pause(margin=6, hold_files=hold)
            q = coord.wait_quiesced()
            assert {r: q[r]["collectives"] for r in q} == {0: at, 1: at}
            # held workers close every socket (their agent's store too): CRIU could dump them now;
            # a client agent lets go of its rendezvous connection as well
            pids = {r: v.pid for r, v in coord.ranks.items()}
            watched = {**pids, "agent": proc.pid} if form == "client" else pids
            deadline = time.monotonic() + 5
            while any(count_sockets(p) for p in watched.values()) and time.monotonic() < deadline:
                time.sleep(0.01)
            agent_sockets = count_sockets(proc.pid)
            assert {r: count_sockets(p) for r, p in watched.items()} == {r: 0 for r in watched}
            for f in hold.values():
                open(f, "w").close()
            coord.resume(gen, "127.0.0.1", free_port())
            res = coord.wait_resumed(gen)
            assert all(res[r]["collectives"] == at for r in res), res
        finally:
            if proc.poll() is None:
                rc, out, err = _finish(proc, logs)
    ctx = "\n".join([*out, err[-3000:]])
    assert rc == rc0 == 0, ctx
    assert [ln for ln in out if "group" in ln] == ["group ReconfigurablePG undefined"] * 2, ctx
    assert [ln for ln in out if "restarts" in ln] == ["restarts 0"] * 2, ctx
    # the same losses bit for bit, every step once per worker
    assert [ln for ln in out if "group" not in ln] == [ln for ln in plain if "group" not in ln], ctx
    assert len([ln for ln in out if ln.startswith("step=")]) == 2 * STEPS, ctx
    assert [ln for ln in err.splitlines() if "torchpass:" in ln] == [], ctx
    # registered as workers of task 3; a standalone agent serves the store: pinned
    pinned = AGENT_SERVES_WHY if form == "standalone" else None
    assert {r: (b.get("task"), b.get("pinned"), b.get("unprotected")) for r, b in bodies.items()} \
        == {r: (3, pinned, None) for r in (0, 1)}, bodies
    if form == "standalone":
        assert agent_sockets > 0  # it serves the store all along: why its node cannot move


def test_a_fallback_for_a_store_of_the_script_tells_the_coordinator_too(tmp_path):
    """The same report from every fallback that started training: here init_process_group(store=...)
    (without the report such a rank never speaks to the coordinator: no event, status shows nothing)."""
    with MiniCoordinator(world_size=2, job_id=JOB_ID) as coord:
        outs, errs = run_ranks(SCRIPT, 2, tmp_path, "store", runtime=True, env={"FORM": "store"}, timeout=120,
                               job_id=JOB_ID, coordinator=coord.endpoint)
        coord.wait_registered(timeout=30)
    why = "init_process_group was given its own store"
    assert all(out[0] == "group ProcessGroup gloo" for out in outs), outs
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
