"""Live migration against checkpoint-restart, in the same run, on the devcluster.

    .venv/bin/python bench/bench_migration.py [--sizes 10M,100M] [--repeat N] [--requeue-hold both|slurm|lifted|none]
                                              [--out bench/results/migration.json] [--as-root]

For each model size (examples/train_ddp.py, 3-layer MLP + Adam, gloo, one
thread per rank) it runs three jobs on one devcluster (4 nodes, each in its
own network namespace, a tpassd per node):

1. **reference**: ``sbatch -N3`` of train_ddp.py, fault-free: the losses
   every faulty run must reproduce.
2. **live migration**: ``sbatch -N4 --torchpass=spares=1`` of the same
   script (3 training nodes, 1 hot spare). At step F a fault drill
   (ecc-sbe-storm) makes node2's tpassd publish ``degraded``; the
   coordinator pauses every rank at one collective, CRIU-dumps node2's rank,
   restores it on node4 and resumes. Phase durations come from the
   coordinator's ``migration.completed`` event (state dir
   ``jobs/J/events.json``).
3. **checkpoint-restart**: ``sbatch -N3 --requeue`` of bench/train_ckpt.py
   (the same training plus a ``torch.save`` checkpoint every K steps). At
   step F the same drill, and at that instant the reaction Slurm offers
   without torchpass: drain node2 and ``scontrol requeue`` the job. Slurm
   kills it, starts it again on node1,3,4 (node4 stands for the node a
   requeued job lands on), it reloads the last checkpoint
   and recomputes the steps since. Slurm holds a requeued job for about two
   minutes before it may start again (EligibleTime: the killed run's job
   credential must expire first). The bench runs this baseline twice, side
   by side: once as Slurm does it (the job waits out the hold: what a site
   gets), and once with the hold lifted 2 s after the job is pending again
   (``scontrol update StartTime=now``; sooner, the launch is refused because
   the killed run's credential was revoked in the same second): the fastest
   restart Slurm can do. ``--requeue-hold slurm|lifted`` runs only one.

The live migration run is repeated (``--repeat``; 3 times for 10M): the stall
varies from run to run on a 2-core machine, the median run stands for the
size and every run's stall is kept.

Time is read from the job's own output: the bench tails the output file
every 5 ms and stamps the first arrival of each ``step=N`` line. The lost
time of a run is how much later the steps after the fault arrive than the
run's own step period says they should: for migration the stall seen by
the healthy ranks (the largest step gap minus the median gap), for
checkpoint-restart the time from the requeue until the job prints the step
after the last one it had finished (restart + recompute), minus one period.
Steps lost: for migration, every step must appear exactly once per rank with
the reference's loss (float.hex, bit for bit); for checkpoint-restart the
steps printed twice (recomputed) are counted and their losses checked too.

Every job is submitted as the devcluster's first job user (an ordinary user,
as on a real cluster: its coordinator runs as that user, and tpassd dumps
and restores a rank it does not own); ``--as-root`` submits as root, as the
figures before 2026-12-06 were measured.

Writes bench/results/migration.json (with ``migration_pause_s`` and
``detection_latency_s`` for ``tpassctl goodput --measured``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import pwd
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from torchpass import layout  # noqa: E402
from torchpass.devcluster import Devcluster, DevclusterSpec  # noqa: E402

TRAIN = REPO / "examples" / "train_ddp.py"
TRAIN_CKPT = REPO / "bench" / "train_ckpt.py"
PY = sys.executable
TPASSCTL = str(Path(sys.executable).parent / "tpassctl")
STEP_RE = re.compile(r"^step=(\d+) loss=(\S+)$")
BAD_NODE = "node2"

# size -> (steps, fault at step, checkpoint every K steps, sleep per step).
# F is mid-way between two checkpoints, so checkpoint-restart recomputes about
# K/2 steps (the expected loss for a fault at a random time). For migration
# the pause point T now lies 1-3 steps after the decision (decide.pause_point:
# measured collective rate, rounded up to a step boundary); with the old fixed
# margin of 64 collectives it lay ~30 steps after F at 10M, and at 100M the
# job ended before T (the pause timed out and the job resumed in place).
# "repeat": migration runs per size (the stall varies by +-30 % from run to run on
# this 2-core machine: the table gives the median, the JSON every run).
PLANS = {
    "10M": {"steps": 50, "fault_at": 12, "ckpt_every": 10, "sleep": 0.0, "repeat": 3},
    "100M": {"steps": 32, "fault_at": 6, "ckpt_every": 5, "sleep": 0.0, "repeat": 1},
}


def run(argv, timeout=120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)


def as_user(user: str, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``argv`` run as the job user (runuser), as that user typing it would run it."""
    return subprocess.run(["runuser", "-u", user, "--", *argv], capture_output=True, text=True, timeout=60,
                          cwd=cwd, env=os.environ)


def log(msg: str) -> None:
    print(f"[bench_migration {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Tail(threading.Thread):
    """Stamps the first arrival (time.monotonic) of every line of a growing file."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path = path
        self.lines: list[tuple[float, str]] = []
        self._halt = False
        self._lock = threading.Lock()

    def run(self) -> None:
        pos, buf = 0, b""
        while not self._halt:
            try:
                with open(self.path, "rb") as f:
                    f.seek(0, 2)
                    if f.tell() < pos:  # truncated (a requeued job may reopen it): start over
                        pos, buf = 0, b""
                    f.seek(pos)
                    data = f.read()
            except FileNotFoundError:
                data = b""
            if data:
                now = time.monotonic()
                pos += len(data)
                buf += data
                *whole, buf = buf.split(b"\n")
                with self._lock:
                    self.lines.extend((now, ln.decode(errors="replace")) for ln in whole)
            time.sleep(0.005)

    def stop(self) -> None:
        self._halt = True
        self.join(timeout=2)

    def steps(self) -> list[tuple[float, int, str]]:
        with self._lock:
            out = []
            for t, ln in self.lines:
                m = STEP_RE.match(ln.strip())
                if m:
                    out.append((t, int(m.group(1)), ln.strip()))
            return out

    def max_step(self) -> int:
        s = self.steps()
        return max((n for _, n, _ in s), default=-1)


class Bench:
    def __init__(self, cluster: Devcluster, work: Path, policy: str = "", user: str | None = None):
        self.c = cluster
        self.work = work
        self.policy = policy  # the live migrations' --torchpass policy name ("": default)
        # Jobs are submitted as this ordinary user, as on a real cluster (None: as root). The
        # bench itself stays root: the drill, the requeue baseline's drain and requeue are an
        # admin's actions.
        self.user = user
        # the interpreter of the jobs: one every job user may run (the bench's own venv is root's)
        self.python = cluster.job_python if user is not None else PY

    def own(self, path: Path) -> Path:
        """``path`` made the job user's (a directory the job writes into)."""
        if self.user is not None:
            pw = pwd.getpwnam(self.user)
            os.chown(path, pw.pw_uid, pw.pw_gid)
        return path

    # --- Slurm helpers ---------------------------------------------------------------
    def submit(self, tag: str, cmd: str, sbatch_args: list[str]) -> tuple[int, Path]:
        script = self.work / f"{tag}.sbatch"
        script.write_text(f"#!/bin/bash\nsrun {cmd}\n")
        out = self.work / f"{tag}.out"
        argv = ["sbatch", "--parsable", "--ntasks-per-node=1", "--open-mode=append", "-o", str(out),
                *sbatch_args, str(script)]
        p = as_user(self.user, argv, self.work) if self.user is not None else run(argv, cwd=self.work)
        if p.returncode != 0:
            raise RuntimeError(f"sbatch {tag}: {p.stderr.strip()}")
        return int(p.stdout.strip().split(";")[0]), out

    def job(self, job_id: int) -> dict:
        p = run(["scontrol", "show", "job", str(job_id), "--json"])
        return json.loads(p.stdout)["jobs"][0] if p.returncode == 0 else {}

    def wait_end(self, job_id: int, timeout_s: float) -> dict:
        end = time.monotonic() + timeout_s
        j: dict = {}
        while time.monotonic() < end:
            j = self.job(job_id)
            if j and not set(j["job_state"]) & {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING",
                                                 "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"}:
                return j
            time.sleep(0.25)
        raise RuntimeError(f"job {job_id} still {j.get('job_state')} after {timeout_s:.0f}s")

    def wait_step(self, tail: Tail, step: int, job_id: int, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if tail.max_step() >= step:
                return
            time.sleep(0.005)
        raise RuntimeError(f"job {job_id} did not reach step {step} in {timeout_s:.0f}s: "
                           + "\n".join(ln for _, ln in tail.lines[-20:]))

    def release_requeued(self, job_id: int, lift: bool = True, timeout_s: float = 300) -> float | None:
        """Slurm holds a requeued batch job (EligibleTime = requeue + ~2 min); with ``lift``
        that hold is lifted at once, else the job waits it out as it would on any cluster.

        Returns how long Slurm holds it (s), for the record. Lifted, the
        baseline is as fast as Slurm can restart a job, not Slurm's default.
        Slurm sets the hold once the killed job has completed, so this
        repeats until the job runs again.
        """
        end = time.monotonic() + timeout_s
        hold = None
        while time.monotonic() < end:
            j = self.job(job_id)
            states = set(j.get("job_state", []))
            if "RUNNING" in states and int(j.get("restart_cnt", 0)) > 0:
                return hold
            if "PENDING" in states and j.get("state_reason") == "BeginTime":
                try:  # the hold as first seen (waited out, it counts down to 0)
                    if hold is None:
                        hold = round(float(j["eligible_time"]["number"]) - time.time(), 1)
                except (KeyError, TypeError, ValueError):
                    pass
                if not lift:
                    time.sleep(0.5)
                    continue
                # Not at once: the killed run's job credential is revoked with a
                # 1 s resolution, and a launch in the same second is refused
                # ("Job credential revoked": the job fails). 2 s is safe here.
                time.sleep(2.0)
                run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])
                time.sleep(1.0)
            time.sleep(0.05)
        raise RuntimeError(f"requeued job {job_id} did not start again within {timeout_s:.0f}s")

    def inject(self, fault: str) -> None:
        p = run([TPASSCTL, "inject", "--node", BAD_NODE, "--fault", fault], timeout=30)
        if p.returncode != 0:
            raise RuntimeError(f"tpassctl inject {fault}: {p.stderr.strip()}")

    def heal(self, timeout_s: float = 120.0) -> None:
        """Clear the drill and wait until node2's tpassd says healthy again: its ECC rule
        looks back 60 s, so the next job's coordinator would otherwise see node2 degraded
        from its first second and move the rank before training got anywhere."""
        run([TPASSCTL, "inject", "--node", BAD_NODE, "--fault", "clear"], timeout=30)
        run(["scontrol", "update", f"NodeName={BAD_NODE}", "State=RESUME"])
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            p = run([TPASSCTL, "nodes", "--node", BAD_NODE, "--json"], timeout=30)
            try:  # {"t": ..., "nodes": [{"node": ..., "state": ...}]}
                state = json.loads(p.stdout)["nodes"][0]["state"]
            except (ValueError, IndexError, KeyError):
                state = None
            if state == "healthy":
                time.sleep(1.5)  # published to every subscriber
                return
            time.sleep(1.0)
        raise RuntimeError(f"{BAD_NODE} not healthy again {timeout_s:.0f}s after the drill was cleared")

    # --- the three runs ----------------------------------------------------------------
    def reference(self, size: str, plan: dict) -> dict:
        cmd = f"{self.python} {TRAIN} --steps {plan['steps']} --params {size} --sleep {plan['sleep']}"
        job_id, out = self.submit(f"ref-{size}", cmd, ["-N3"])
        tail = Tail(out)
        tail.start()
        try:
            j = self.wait_end(job_id, 900)
        finally:
            time.sleep(0.2)
            tail.stop()
        if j["job_state"][0] != "COMPLETED":
            raise RuntimeError(f"reference job {job_id} ended {j['job_state']}: {out.read_text()[-2000:]}")
        steps = tail.steps()
        first = first_arrivals(steps)
        gaps = [first[n + 1] - first[n] for n in sorted(first) if n + 1 in first]
        return {"job_id": job_id, "lines": [ln for _, _, ln in steps], "step_period_s": statistics.median(gaps)}

    def migration(self, size: str, plan: dict, ref: dict, run_no: int = 1) -> dict:
        cmd = f"{self.python} {TRAIN} --steps {plan['steps']} --params {size} --sleep {plan['sleep']}"
        option = "--torchpass=spares=1" + (f",policy={self.policy}" if self.policy else "")
        job_id, out = self.submit(f"mig-{size}-{run_no}", cmd, ["-N4", option])
        tail = Tail(out)
        tail.start()
        try:
            self.wait_step(tail, plan["fault_at"], job_id, 600)
            t_fault = time.monotonic()
            wall_fault = time.time()
            self.inject("ecc-sbe-storm")
            j = self.wait_end(job_id, 900)
        finally:
            time.sleep(0.2)
            tail.stop()
            run(["scancel", str(job_id)])
            self.heal()
        text = out.read_text()
        events_path = layout.events_json(self.c.state_dir, job_id)
        events = json.loads(events_path.read_text()) if events_path.exists() else []
        done = [e for e in events if e["kind"] == "migration.completed"]
        ok = j["job_state"][0] == "COMPLETED" and j["exit_code"]["return_code"]["number"] == 0
        steps = tail.steps()
        identical = per_step(ln for _, _, ln in steps) == per_step(ref["lines"])
        first = first_arrivals(steps)
        gaps = {n: first[n + 1] - first[n] for n in sorted(first) if n + 1 in first}
        period = statistics.median(gaps.values())
        worst = max(gaps, key=gaps.get)
        if worst < plan["fault_at"] or not identical:
            raise RuntimeError(f"migration run of job {job_id}: the largest step gap ({worst}->{worst + 1}) lies "
                               f"before the drill at step {plan['fault_at']}, or the losses differ from the "
                               f"reference (identical={identical}): not a measurement of this migration")
        res = {
            "job_id": job_id, "completed": ok, "restart_cnt": int(j.get("restart_cnt", 0)),
            "bit_identical_to_reference": identical,
            "steps_lost": 0 if identical else None,
            "step_period_s": round(period, 4),
            "stall_s": round(gaps[worst] - period, 4),
            "stall_between_steps": [worst, worst + 1],
            "fault_at_step": plan["fault_at"],
        }
        if not ok or not done:
            coord = layout.coordinator_log(self.c.state_dir, job_id)
            raise RuntimeError(f"migration job {job_id} ended {j['job_state']} "
                               f"(events {[e['kind'] for e in events]}): {text[-1500:]}\n"
                               + (coord.read_text()[-3000:] if coord.exists() else ""))
        ev = done[0]
        pd = ev["data"]["phase_durations"]
        started = [e for e in events if e["kind"] == "migration.started"]
        res["phase_durations_s"] = pd
        res["tool_durations"] = ev["data"].get("tool_durations", {})
        res["pause_at"] = ev["data"].get("pause_at")
        res["pause_estimate"] = ev["data"].get("pause_estimate")
        # The standstill the coordinator drove (the ranks stand still from the
        # quiesce at T, i.e. the end of PAUSE, until every rank rebuilt).
        res["coordinator_standstill_s"] = round(sum(pd.get(k, 0.0) for k in (
            "dump", "transfer", "restore", "kill_source", "rebuild")), 4)
        if started:
            res["detection_latency_s"] = round(started[0]["time"] - wall_fault, 4)
        image_mb = res["tool_durations"].get("dump.image_mb")
        if image_mb:
            # The machine's own floor, right after this migration: the image's bytes written
            # to fresh memory (what dump and restore each pay on this VM).
            res["image_mb"] = image_mb
            res["effective_gb_s"] = round(image_mb / 1e3 / max(res["stall_s"], 1e-3), 3)
            res["floor"] = first_touch_floor(int(image_mb * 1e6))
            res["effective_to_floor"] = round(res["effective_gb_s"] / res["floor"]["gb_s"], 3)
        del t_fault
        return res

    def checkpoint_restart(self, size: str, plan: dict, ref: dict, lift_hold: bool = True) -> dict:
        ckpt = self.work / f"ckpt-{size}-{'lifted' if lift_hold else 'slurm'}"
        shutil.rmtree(ckpt, ignore_errors=True)
        ckpt.mkdir()
        self.own(ckpt)
        cmd = (f"{self.python} {TRAIN_CKPT} --steps {plan['steps']} --params {size} --sleep {plan['sleep']} "
               f"--ckpt-dir {ckpt} --ckpt-every {plan['ckpt_every']}")
        job_id, out = self.submit(f"ckpt-{size}-{'lifted' if lift_hold else 'slurm'}", cmd, ["-N3", "--requeue"])
        tail = Tail(out)
        tail.start()
        try:
            fault = plan["fault_at"]
            self.wait_step(tail, fault, job_id, 600)
            t_detect = time.monotonic()
            self.inject("ecc-sbe-storm")
            # What a site does without torchpass: take the node out, requeue the job.
            run(["scontrol", "update", f"NodeName={BAD_NODE}", "State=DRAIN", "Reason=bench: ecc storm"])
            p = run(["scontrol", "requeue", str(job_id)])
            if p.returncode != 0:
                raise RuntimeError(f"scontrol requeue {job_id}: {p.stderr.strip()}")
            t_requeued = time.monotonic()
            hold = self.release_requeued(job_id, lift=lift_hold)
            j = self.wait_end(job_id, 1200)
        finally:
            time.sleep(0.2)
            tail.stop()
            run(["scancel", str(job_id)])
            self.heal()
        ok = j["job_state"][0] == "COMPLETED" and j["exit_code"]["return_code"]["number"] == 0
        if not ok:
            raise RuntimeError(f"checkpoint-restart job {job_id} ended {j['job_state']}: {out.read_text()[-2000:]}")
        steps = tail.steps()
        before = [(t, n, ln) for t, n, ln in steps if t < t_detect]
        after = [(t, n, ln) for t, n, ln in steps if t >= t_requeued]
        last_done = max(n for _, n, _ in before)
        # Lines of steps that finished between the detection and the kill belong to the first run too.
        first_run = [(t, n, ln) for t, n, ln in steps if t_detect <= t < t_requeued]
        last_done = max([last_done] + [n for _, n, _ in first_run])
        t_last = max(t for t, n, _ in before + first_run if n == last_done)
        resumed_at = min(n for _, n, _ in after)
        t_resumed = min(t for t, n, _ in after if n == resumed_at)
        t_caught_up = min(t for t, n, _ in after if n == last_done + 1)
        pre_gaps = first_arrivals(before)
        post = first_arrivals(after)
        gaps = [b - a for n, a in pre_gaps.items() if n + 1 in pre_gaps for b in [pre_gaps[n + 1]]]
        gaps += [post[n + 1] - post[n] for n in post if n + 1 in post]
        period = statistics.median(gaps)
        # Every step's final line (the restarted run's) must equal the reference.
        # (the last line of each rank, i.e. the last `world` lines of a step: lines
        # of the killed run can still arrive after the requeue)
        world = 3  # -N3, one rank per node
        by_step: dict[int, list[str]] = {}
        for t, n, ln in steps:
            by_step.setdefault(n, []).append(ln)
        final = {n: Counter(lns[-world:]) for n, lns in by_step.items()}
        identical = final == per_step(ref["lines"])
        ckpt_saves = [float(m.group(1)) for m in re.finditer(r"ckpt saved step=\d+ seconds=(\S+)", out.read_text())]
        ckpt_loads = [float(m.group(1)) for m in re.finditer(r"ckpt loaded step=\d+ seconds=(\S+)", out.read_text())]
        return {
            "job_id": job_id, "completed": ok, "restart_cnt": int(j.get("restart_cnt", 0)),
            "step_period_s": round(period, 4),
            "last_step_done_before_fault": last_done,
            "resumed_from_step": resumed_at,
            "steps_recomputed": last_done + 1 - resumed_at,
            "detection_to_training_resumed_s": round(t_resumed - t_detect, 4),
            "detection_to_caught_up_s": round(t_caught_up - t_detect, 4),
            # Lost: how much later step last_done+1 came than one period after last_done.
            "lost_s": round(t_caught_up - t_last - period, 4),
            "final_losses_bit_identical_to_reference": identical,
            "checkpoint_save_s": round(statistics.mean(ckpt_saves), 4) if ckpt_saves else None,
            "checkpoint_load_s": round(statistics.mean(ckpt_loads), 4) if ckpt_loads else None,
            "fault_at_step": plan["fault_at"], "ckpt_every": plan["ckpt_every"],
            "slurm_requeue_hold_s": hold,
            "requeue_hold": "lifted 2 s after the requeue" if lift_hold else "Slurm's own (not touched)",
        }


def first_arrivals(steps) -> dict[int, float]:
    first: dict[int, float] = {}
    for t, n, _ in steps:
        first.setdefault(n, t)
    return first


def per_step(lines) -> dict[int, Counter]:
    out: dict[int, Counter] = {}
    for ln in lines:
        m = STEP_RE.match(ln)
        if m:
            out.setdefault(int(m.group(1)), Counter())[ln] += 1
    return out


def machine() -> dict:
    mem = 0
    try:
        for ln in Path("/proc/meminfo").read_text().splitlines():
            if ln.startswith("MemTotal:"):
                mem = int(ln.split()[1]) // 1024
    except OSError:
        pass
    cpu = ""
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    criu = run(["criu", "--version"]).stdout.split("\n")[0]
    import torch

    return {"cpus": os.cpu_count(), "cpu": cpu, "memory_mb": mem, "kernel": platform.release(),
            "criu": criu, "torch": torch.__version__, "python": platform.python_version()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10M,100M")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "migration.json")
    ap.add_argument("--cluster", default=os.environ.get("TORCHPASS_TEST_CLUSTER", "bench"))
    ap.add_argument("--subnet", default=os.environ.get("TORCHPASS_TEST_SUBNET", "10.76.0"))
    ap.add_argument("--repeat", type=int, default=0,
                    help="migration runs per size (default: the plan's, 3 for 10M, 1 for 100M); the median counts")
    ap.add_argument("--policy", default="",
                    help="the live migrations' --torchpass policy (a file /etc/torchpass/policies/NAME.toml), "
                         "e.g. to run the same bench with other pause settings side by side")
    ap.add_argument("--requeue-hold", choices=sorted(HOLDS), default="both",
                    help="checkpoint-restart baseline: wait out Slurm's requeue hold (slurm), lift it (lifted), "
                         "run both side by side (both, the default), or none (migration only: a run "
                         "for investigation; bench/run_all.py never passes it)")
    ap.add_argument("--as-root", action="store_true",
                    help="submit the jobs as root (the figures before 2026-12-06); by default they run as the "
                         "devcluster's first job user, an ordinary user, as on a real cluster")
    args = ap.parse_args()
    if args.requeue_hold == "none" and args.out == ap.get_default("out"):
        ap.error("--requeue-hold none runs no baseline: give --out a file outside bench/results/ "
                 "(tpassctl goodput --measured reads bench/results/migration.json)")
    sizes = [s.strip().upper() for s in args.sizes.split(",") if s.strip()]
    for s in sizes:
        if s not in PLANS:
            ap.error(f"no plan for size {s}; known: {', '.join(PLANS)}")
    if os.geteuid() != 0:
        ap.error("needs root (the devcluster: network namespaces, slurmd, CRIU)")
    t_all = time.monotonic()
    c = Devcluster.up(DevclusterSpec(name=args.cluster, subnet=args.subnet, nodes=4))
    saved = dict(os.environ)
    os.environ.update(c.env())
    results: dict[str, dict] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-migration-") as tmp:
            work = Path(tmp)
            work.chmod(0o777)
            b = Bench(c, work, args.policy, user=None if args.as_root else c.job_users[0])
            log(f"jobs submitted as {b.user or 'root'}")
            time.sleep(2.0)  # every tpassd has published its first sample
            for size in sizes:
                plan = PLANS[size]
                log(f"{size}: reference run")
                ref = b.reference(size, plan)
                runs = []
                for i in range(args.repeat or plan["repeat"]):
                    log(f"{size}: live migration run {i + 1}")
                    runs.append(b.migration(size, plan, ref, i + 1))
                    log(f"{size}: migration stall {runs[-1]['stall_s']}s, phases {runs[-1]['phase_durations_s']}")
                # the run with the median stall stands for the size; every run is kept
                mig = sorted(runs, key=lambda r: r["stall_s"])[len(runs) // 2]
                mig = {**mig, "stall_s_runs": [r["stall_s"] for r in runs]}
                crs = {}
                for hold in HOLDS[args.requeue_hold]:
                    log(f"{size}: checkpoint-restart run (requeue hold {hold})")
                    crs[hold] = b.checkpoint_restart(size, plan, ref, lift_hold=hold == "lifted")
                    log(f"{size}: checkpoint-restart ({hold} hold) lost {crs[hold]['lost_s']}s, "
                        f"{crs[hold]['steps_recomputed']} steps recomputed")
                results[size] = {
                    "plan": plan, "reference_step_period_s": round(ref["step_period_s"], 4),
                    "migration": mig, "migration_runs": runs,
                }
                if crs:
                    results[size]["checkpoint_restart"] = crs.get("slurm") or crs["lifted"]
                    results[size]["lost_time_ratio"] = round(
                        results[size]["checkpoint_restart"]["lost_s"] / max(mig["stall_s"], 1e-3), 1)
                if "lifted" in crs and "slurm" in crs:
                    results[size]["checkpoint_restart_hold_lifted"] = crs["lifted"]
                    results[size]["lost_time_ratio_hold_lifted"] = round(
                        crs["lifted"]["lost_s"] / max(mig["stall_s"], 1e-3), 1)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        c.down()
    # For tpassctl goodput --measured (docs/goodput.md): the largest model measured is
    # the conservative figure for the pause; detection is the drill-to-migration start.
    big = max(results, key=lambda s: PLANS_ORDER.index(s))
    data = {
        "migration_pause_s": {"mean": results[big]["migration"]["stall_s"], "n": 1, "model": big,
                              "by_model": {s: r["migration"]["stall_s"] for s, r in results.items()}},
        "detection_latency_s": {"mean": round(statistics.mean(
            r["migration"]["detection_latency_s"] for r in results.values()), 4), "n": len(results),
            "what": "fault drill sent to migration.started (tpassd detection + coordinator decision)"},
        "checkpoint_restart_lost_s": {s: r["checkpoint_restart"]["lost_s"] for s, r in results.items()
                                      if "checkpoint_restart" in r},
        "checkpoint_restart_lost_s_hold_lifted": {s: r["checkpoint_restart_hold_lifted"]["lost_s"]
                                                  for s, r in results.items() if "checkpoint_restart_hold_lifted" in r},
        "models": results,
        "policy": args.policy or "default",
        "job_user": "root" if args.as_root else c.job_users[0],
        "machine": machine(),
        "bench_seconds": round(time.monotonic() - t_all, 1),
        "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, args.out)
    print_table(results)
    print(f"wrote {args.out} in {data['bench_seconds']} s")
    return 0


# A first-touch write of N bytes: fresh anonymous memory, every page written once (memset),
# in a process of its own so the bench's own memory plays no part.
FIRST_TOUCH = (
    "import ctypes, mmap, sys, time\n"
    "n = int(sys.argv[1])\n"
    "m = mmap.mmap(-1, n)\n"
    "a = ctypes.addressof(ctypes.c_char.from_buffer(m))\n"
    "t = time.monotonic()\n"
    "ctypes.memset(a, 1, n)\n"
    "print(time.monotonic() - t)\n"
)


def first_touch_floor(nbytes: int, passes: int = 3) -> dict:
    """The machine's floor for moving ``nbytes`` into a process: the median of ``passes``
    first-touch writes of that many bytes (GB/s and seconds, each pass kept)."""
    times = []
    for _ in range(passes):
        p = run([sys.executable, "-c", FIRST_TOUCH, str(nbytes)], timeout=300)
        times.append(float(p.stdout.strip()))
    med = statistics.median(times)
    return {"bytes": nbytes, "seconds": round(med, 4), "seconds_runs": [round(t, 4) for t in times],
            "gb_s": round(nbytes / 1e9 / med, 3)}


PLANS_ORDER = list(PLANS)
HOLDS = {"both": ("slurm", "lifted"), "slurm": ("slurm",), "lifted": ("lifted",), "none": ()}


def print_table(results: dict) -> None:
    """One row per model and baseline: the migration's median stall against checkpoint-restart
    with Slurm's own requeue hold, and against the same with the hold lifted."""
    hdr = (f"{'model':>6} {'step':>6} | {'mig stall':>9} {'runs':>17} {'lost':>4} {'bitid':>5} | {'requeue':>7} "
           f"{'ckpt lost':>9} {'restart':>7} {'recomp':>6} | {'ratio':>6} | phases (s)")
    print(hdr)
    print("-" * len(hdr))
    for size, r in results.items():
        m = r["migration"]
        if "floor" in m:
            print(f"{size:>6} image {m['image_mb']:.0f} MB, stall {m['stall_s']:.3f} s"
                  f" = {m['effective_gb_s']:.3f} GB/s;"
                  f" first-touch floor {m['floor']['gb_s']:.3f} GB/s ({m['floor']['seconds']:.3f} s for the same"
                  f" bytes); effective / floor {m['effective_to_floor']:.2f}"
                  f"; freed before the dump {m['tool_durations'].get('quiesce.released_mb', 0):.0f} MB")
    for size, r in results.items():
        m = r["migration"]
        pd = m["phase_durations_s"]
        phases = " ".join(f"{k}={pd[k]}" for k in ("pause", "dump", "transfer", "restore", "kill_source", "rebuild")
                          if k in pd)
        runs = ",".join(f"{x:.2f}" for x in m.get("stall_s_runs", [m["stall_s"]]))
        if "checkpoint_restart" not in r:
            print(f"{size:>6} {r['reference_step_period_s']:>6.3f} | {m['stall_s']:>9.3f} {runs:>17} "
                  f"{m['steps_lost']!s:>4} {m['bit_identical_to_reference']!s:>5} | (no baseline run) | {phases}")
            continue
        rows = [(r["checkpoint_restart"], r["lost_time_ratio"])]
        if "checkpoint_restart_hold_lifted" in r:
            rows.append((r["checkpoint_restart_hold_lifted"], r["lost_time_ratio_hold_lifted"]))
        for cr, ratio in rows:
            hold = "lifted" if cr.get("requeue_hold", "lifted").startswith("lifted") else "slurm"
            print(f"{size:>6} {r['reference_step_period_s']:>6.3f} | {m['stall_s']:>9.3f} {runs:>17} "
                  f"{m['steps_lost']!s:>4} {m['bit_identical_to_reference']!s:>5} | {hold:>7} "
                  f"{cr['lost_s']:>9.2f} {cr['detection_to_training_resumed_s']:>7.2f} "
                  f"{cr['steps_recomputed']:>6} | {ratio:>5.1f}x | {phases}")

if __name__ == "__main__":
    sys.exit(main())
