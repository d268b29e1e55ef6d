"""Helpers shared by the live-migration integration tests: submit the plain DDP
example under --torchpass, read its per-step losses, wait for the job's end."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from slurm_helpers import job_id_of, job_python, sbatch, submit_env

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train_ddp.py"
TPASSCTL = [str(Path(sys.executable).parent / "tpassctl")]
ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING"}


def run(argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, **kw)


def train_script(job_dir: Path) -> Path:
    """examples/train_ddp.py copied into ``job_dir`` (owned by its owner, as a user's own
    script would be): the checkout itself may be unreadable to job users."""
    dst = job_dir / TRAIN.name
    if not dst.exists():
        shutil.copyfile(TRAIN, dst)
        st = job_dir.stat()
        os.chown(dst, st.st_uid, st.st_gid)
    return dst


def submit(job_dir: Path, tag: str, steps: int, nodes: int, torchpass: str = "spares=1",
           user: str | None = None, sbatch_extra: tuple[str, ...] = ()) -> int:
    """sbatch examples/train_ddp.py (1M parameters, one rank per training node) as ``user``
    (root if None), run by the job Python; the job id. The job's coordinator is strict
    (tests/conftest.py's TORCHPASS_STRICT_TRANSITIONS). ``sbatch_extra``: more sbatch options."""
    strict = {k: v for k, v in os.environ.items() if k == "TORCHPASS_STRICT_TRANSITIONS"}
    proc = sbatch(["-N", str(nodes), "--ntasks-per-node=1", f"--torchpass={torchpass}", *sbatch_extra,
                   "-o", str(job_dir / f"{tag}.%j.out")],
                  "#!/bin/bash\n"
                  f"srun {job_python()} {train_script(job_dir)} --steps {steps} --params 1M --sleep 0.05\n",
                  cwd=job_dir, user=user, env={**submit_env(user), **strict})
    return job_id_of(proc)


# srun torchrun, 2 workers per node, the c10d rendezvous on the first node of the job (or a store
# the batch script serves: ``serve``/``stop`` around it, ``conf`` for torchrun's own options);
# ``script`` is the worker's file and arguments, in ``d``.
TORCHRUN_BATCH = """#!/bin/bash
#SBATCH --ntasks-per-node=1
cd {d}
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
port=$((20000 + SLURM_JOB_ID % 20000))
{serve}
srun {torchrun} --nnodes={nnodes} --nproc-per-node=2 --rdzv-backend=c10d \\
  --rdzv-endpoint="$head:$port" --rdzv-id="$SLURM_JOB_ID" {conf} {script}
rc=$?
{stop}
exit $rc
"""


def torchrun_batch(d: Path, torchrun: Path | str, nnodes: int, script: str, conf: str = "", serve: str = "",
                   stop: str = "") -> str:
    return TORCHRUN_BATCH.format(d=d, torchrun=torchrun, nnodes=nnodes, script=script, conf=conf, serve=serve,
                                 stop=stop)


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


def wait_end(job_id: int, timeout_s: float = 240, context: str = "", diag=None) -> dict:
    """The job's record once it has ended. On a timeout the error carries ``context`` and, where
    given, ``diag()`` (the job's output, events and coordinator log), read at the moment of failure."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        j = job(job_id)
        if not set(j["job_state"]) & ACTIVE:
            return j
        time.sleep(0.5)
    detail = f"\n{diag()}" if diag is not None else ""
    raise AssertionError(f"{context}job {job_id} still {j['job_state']} after {timeout_s}s{detail}")


def leave_idle(jobs: list[int], nodes: tuple[str, ...], timeout_s: float = 90) -> None:
    """After a test: cancel ``jobs``, clear every node's drill, resume what torchpass drained, and
    wait until every node is IDLE."""
    for j in jobs:
        run(["scancel", str(j)])
    for n in nodes:
        run([*TPASSCTL, "inject", "--node", n, "--fault", "clear"])
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        states = {n: node(n) for n in nodes}
        for n, st in states.items():
            if "DRAIN" in st["state"] and st.get("reason", "").startswith("torchpass"):
                run(["scontrol", "update", f"NodeName={n}", "State=RESUME"])
        if all(st["state"] == ["IDLE"] for st in states.values()):
            return
        time.sleep(0.5)
    raise AssertionError(f"cluster not clean after the test: {[(n, node(n)['state']) for n in nodes]}")


def alive(pid: int) -> bool:
    """Whether a process of this pid exists (a zombie counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# The longest reference run so far in this process, by job user: train_ddp.py's loss at a step
# does not depend on --steps (the loop is range(steps), nothing is scheduled on the total), so a
# run of N steps is the reference of any run of at most N. The first run makes REFERENCE_STEPS at
# least, the most any module asks for (test_failslow, test_coordinator_loss), so one run serves
# every module of a worker (250 steps took 52.6 s beside a second devcluster).
REFERENCE_STEPS = 250
_LONGEST_REFERENCE: dict[str, tuple[int, int, dict[int, Counter]]] = {}


def reference_run(jobs_base: Path, user, tag: str, n_steps: int, context: str = "") -> dict:
    """A module's fault-free run of train_ddp.py on 4 nodes (3 ranks and a spare) as ``user``, in a
    directory of its own under ``jobs_base``: its job id and its losses per step, to compare with.
    A longer run made earlier in this process (another module's) serves: its first ``n_steps``."""
    cached = _LONGEST_REFERENCE.get(user.name)
    if cached is not None and cached[1] >= n_steps:
        print(f"reference: the first {n_steps} steps of job {cached[0]}'s {cached[1]}")
    else:
        d = Path(tempfile.mkdtemp(dir=jobs_base, prefix=f"{tag}-ref-{os.getpid()}-"))
        d.chmod(0o755)
        os.chown(d, user.uid, user.gid)
        t0 = time.monotonic()
        made = max(n_steps, REFERENCE_STEPS)
        ref_id = submit(d, "ref", made, nodes=4, user=user.name)
        ref = wait_end(ref_id, 300, context=context)
        text = (d / f"ref.{ref_id}.out").read_text()
        assert ref["job_state"][0] == "COMPLETED", text[-3000:]
        lines = steps(text)
        assert len(lines) == 3 * made, text[-3000:]
        print(f"reference: {made} steps in {time.monotonic() - t0:.1f} s")
        cached = _LONGEST_REFERENCE[user.name] = (ref_id, made, per_step(lines))
    ref_id, _, losses = cached
    return {"job_id": ref_id, "per_step": {k: v for k, v in losses.items() if k < n_steps}}


def excerpt(text: str, limit: int = 3000) -> str:
    """A failed job's output for an assertion: from its first traceback (the rank that failed
    first, which the others' "Connection closed by peer" follow), then its end."""
    first = text.find("Traceback")
    if first < 0 or len(text) - first <= 2 * limit:
        return text[max(first, len(text) - 2 * limit):] if first >= 0 else text[-limit:]
    return text[first:first + limit] + "\n[...]\n" + text[-limit:]


def steps(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if re.fullmatch(r"step=\d+ loss=\S+", ln)]


def per_step(lines: list[str]) -> dict[int, Counter]:
    """step -> how often each exact line appeared (every rank prints the same global loss)."""
    out: dict[int, Counter] = {}
    for ln in lines:
        n = int(ln.split()[0].split("=")[1])
        out.setdefault(n, Counter())[ln] += 1
    return out
