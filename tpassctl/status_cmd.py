"""`tpassctl status`: every running torchpass job, its coordinator and ranks."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Any

import click

from torchpass import auth, coordinator_lost, jobdir, layout, zmqio
from torchpass.checkpoint import safeio
from torchpass.errors import DependencyError, RemoteError, SlurmError, TorchpassError, UnreachableError
from torchpass.slurm import client
from torchpass.slurm.conf import job_privacy
from tpassctl.context import state_dir_option
from tpassctl.exit_codes import CliError, finish
from tpassctl.follow import SLURM_LIVE  # a job that may still get a coordinator: "starting" until it registers
from tpassctl.table import table


def no_state_dir(state_dir: Path) -> CliError:
    return CliError(
        f"no torchpass state directory at {state_dir}; pass --state-dir or set TORCHPASS_STATE_DIR "
        "(for the devcluster: eval \"$(tpassctl devcluster env)\")", "no_state_dir")


def not_visible(state_dir: Path, job_id: int) -> CliError:
    """The one refusal for a job the caller may not see: the same line (and exit status: not
    found) whether the job is another user's, running or ended, or does not exist, so the answer
    tells nothing about other users' jobs, as Slurm's PrivateData=jobs does."""
    return CliError(
        f"job {job_id}: no torchpass job of yours with this id in {state_dir} (only its owner or an "
        "admin can see a job; check the id and --state-dir)", "not_found")


def _slurm_owner(job_id: int) -> int | None:
    """The uid Slurm records for ``job_id``; None when Slurm does not know it (or cannot say)."""
    try:
        job = client().job(job_id)
    except (SlurmError, DependencyError, TorchpassError):
        return None
    return None if job is None else job.user_id


def starting_job_of_caller(job_id: int) -> bool:
    """Whether Slurm holds ``job_id`` pending or running for the caller (or the caller is an
    admin): a job whose torchpass directory the plugin has not made yet."""
    try:
        job = client().job(job_id)
    except (SlurmError, DependencyError, TorchpassError):
        return False
    if job is None or job.state not in SLURM_LIVE:
        return False
    uid = os.getuid()
    return job.user_id == uid or uid in job_privacy()[1]


def visible_job(state_dir: Path, job_id: int, uid: int | None = None) -> tuple[int, int]:
    """(directory fd, owner uid) of STATE_DIR/jobs/JOB_ID when the caller may see the job: its
    owner (the owner of the directory, which only root makes) or an admin (root, SlurmUser).
    While Slurm knows the job, its owner there must be the directory's. Otherwise the one
    not_visible line. Close the fd."""
    if not state_dir.is_dir():
        raise no_state_dir(state_dir)
    uid = os.getuid() if uid is None else uid
    try:
        fd, owner = jobdir.open_job_dir(state_dir, job_id)
    except (FileNotFoundError, PermissionError, NotADirectoryError):
        raise not_visible(state_dir, job_id) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise not_visible(state_dir, job_id) from None
        raise CliError(str(exc)) from None
    if uid != owner and uid not in job_privacy()[1]:
        os.close(fd)
        raise not_visible(state_dir, job_id)
    slurm_owner = _slurm_owner(job_id)
    if slurm_owner is not None and slurm_owner != owner:
        os.close(fd)
        raise CliError(
            f"job {job_id}: {layout.job_dir(state_dir, job_id)} belongs to uid {owner} but Slurm says the job "
            f"is uid {slurm_owner}'s (a directory left by an earlier job {job_id}?); refused", "refused")
    return fd, owner


def discover_coordinators(state_dir: Path, uid: int | None = None) -> dict[int, dict[str, Any]]:
    """The registrations (STATE_DIR/jobs/J/coordinator.json) of the jobs the caller may see, by job id.

    A registration is keyed by the name of its directory and belongs to the directory's owner:
    jobs/ is root's alone and the SPANK plugin (root) makes jobs/J for job J's user. A file that
    names another job or another uid changes nothing. Slurm's agreement is checked by the caller.
    """
    if not state_dir.is_dir():
        raise no_state_dir(state_dir)
    uid = os.getuid() if uid is None else uid
    admin = uid in job_privacy()[1]
    try:
        names = jobdir.job_names(state_dir)
    except OSError as exc:
        raise CliError(str(exc)) from None
    found: dict[int, dict[str, Any]] = {}
    for jid in names:
        try:
            fd, owner = jobdir.open_job_dir(state_dir, jid)
        except OSError:
            continue  # not ours to read, or gone meanwhile
        try:
            if owner != uid and not admin:
                continue
            info = jobdir.registration(fd, jid, owner)
        finally:
            os.close(fd)
        if info is not None:
            found[jid] = info
    return found


def job_registration(state_dir: Path, job_id: int) -> dict[str, Any]:
    """The coordinator registration of ``job_id``, a job the caller may see (visible_job); a
    one-line ClickException when it has none (ended, or not a --torchpass job)."""
    fd, owner = visible_job(state_dir, job_id)
    try:
        info = jobdir.registration(fd, job_id, owner)
    finally:
        os.close(fd)
    if info is None:
        raise CliError(
            f"job {job_id} has no torchpass coordinator registered in {state_dir}"
            " (not a --torchpass job, not running, or a different --state-dir)", "not_found")
    return info


RANK_RECORD_MAX_BYTES = 64 * 1024  # rankR.json: a few hundred bytes (argv included)
_RANK_RECORD = re.compile(r"rank(\d+)" + re.escape(layout.RECORD_SUFFIX))


def host_pids(state_dir: Path, job_id: int) -> dict[int, int]:
    """Task -> host pid of its rank, from the rank records (STATE_DIR/jobs/J/ranks/jobJ/rankT.json).

    The rank registers os.getpid() from inside its PID namespace (tpass-init makes one per task:
    pid 3 for every rank); the task wrapper writes the rank's pid as the node sees it (``rank_pid``)
    and rewrites it when a restored copy takes over. Records are the job owner's files, read without
    following a link ({} when there are none the caller may read)."""
    try:
        fd, owner = jobdir.open_job_dir(state_dir, job_id)
    except OSError:
        return {}
    out: dict[int, int] = {}
    try:
        rfd = safeio.open_dir_at(fd, layout.RANKS)
        try:
            dfd = safeio.open_dir_at(rfd, layout.rank_job_dir(".", job_id).name)
        finally:
            os.close(rfd)
        try:
            for name in os.listdir(dfd):
                m = _RANK_RECORD.fullmatch(name)
                rec = jobdir.read_json(dfd, name, owner, RANK_RECORD_MAX_BYTES) if m else None
                pid = rec.get("rank_pid") if isinstance(rec, dict) else None
                if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0:
                    out[int(m.group(1))] = pid
        finally:
            os.close(dfd)
    except OSError:
        return out
    finally:
        os.close(fd)
    return out


def _with_host_pids(ranks: list[dict[str, Any]], pids: dict[int, int]) -> list[dict[str, Any]]:
    """Each rank with ``host_pid``: the pid its task's record names (a task is one rank under srun).
    Ranks that share a task (torchrun's workers) have no record of their own: None."""
    def task(r: dict[str, Any]) -> int:
        t = r.get("task")
        return r["rank"] if t is None or t < 0 else t
    per_task: dict[int, int] = {}
    for r in ranks:
        per_task[task(r)] = per_task.get(task(r), 0) + 1
    return [{**r, "host_pid": pids.get(task(r)) if per_task[task(r)] == 1 else None} for r in ranks]


def _slurm_view(job_id: int | None) -> tuple[dict[int, Any], str | None]:
    states = ("RUNNING", "COMPLETING") if job_id is None else (*SLURM_LIVE, "COMPLETING")
    try:
        return {j.job_id: j for j in client().jobs(states=states)}, None
    except (SlurmError, DependencyError) as exc:
        return {}, str(exc)


def _unregistered(job_id: int, sj: Any, slurm_error: str | None) -> dict[str, Any]:
    """A job of the caller's with no coordinator registration: not up yet, or ended."""
    starting = sj is not None and sj.state in SLURM_LIVE
    row: dict[str, Any] = {"job_id": job_id, "state": "starting" if starting else "finished",
                           "slurm_state": sj.state if sj else None, "nodes": list(sj.nodes) if sj else None,
                           "user": sj.user if sj else None, "coordinator": None, "reachable": None, "ranks": []}
    if slurm_error:
        row["slurm_error"] = slurm_error
    return row


def collect(state_dir: Path, job_id: int | None, timeout_s: float) -> list[dict[str, Any]]:
    """One row per job, each with ``state``: running (its coordinator answered), starting (no
    coordinator registered yet), finished, lost (Slurm runs it, its coordinator is silent),
    unreachable (silent, and Slurm cannot say) or refused (the coordinator refused us)."""
    if job_id is not None:
        fd, owner = visible_job(state_dir, job_id)
        try:
            info = jobdir.registration(fd, job_id, owner)
        finally:
            os.close(fd)
        slurm_jobs, slurm_error = _slurm_view(job_id)
        if info is None:
            return [_unregistered(job_id, slurm_jobs.get(job_id), slurm_error)]
        registrations = {job_id: info}
    else:
        registrations = discover_coordinators(state_dir)
        slurm_jobs, slurm_error = _slurm_view(None)
    rows = []
    for jid in sorted(registrations):
        info = registrations[jid]
        sj = slurm_jobs.get(jid)
        if slurm_error is None and sj is None and job_id is None:
            continue  # a leftover registration of a job that has ended
        if sj is not None and sj.user_id != info["uid"]:
            continue  # a directory left by an earlier job of this id: Slurm says whose job it is
        row: dict[str, Any] = {
            "job_id": jid,
            "slurm_state": sj.state if sj else None,
            "nodes": list(sj.nodes) if sj else None,
            "user": sj.user if sj else None,
            "coordinator": {"endpoint": info.get("endpoint"), "pid": info.get("pid"), "host": info.get("host")},
        }
        try:
            st = zmqio.request(info["endpoint"], "job.status", {}, timeout_s=timeout_s, retries=1,
                               auth=auth.optional_credential_for("job.status", {}, auth.job_target(jid)))
            row["reachable"] = True
            row["state"] = "running"
            row.update({k: st[k] for k in ("world_size", "registered_ranks", "min_step", "max_step",
                                           "ranks", "spares", "policy", "migration", "snapshot",
                                           "last_migration", "torch_override", "rails") if k in st})
            row["ranks"] = _with_host_pids(row.get("ranks", []), host_pids(state_dir, jid))
            # "unprotected": why the runtime cannot protect the job (None: it can)
            row["unprotected"] = st.get("unprotected")
            row["protected"] = not st.get("unprotected")
        except (UnreachableError, TorchpassError) as exc:
            row["reachable"] = False
            row["error"] = str(exc)
            if isinstance(exc, RemoteError):
                row["error_code"] = exc.code
            # Slurm runs the job but its coordinator does not answer: it died, and nothing moves the job.
            lost = isinstance(exc, UnreachableError) and sj is not None and sj.state == "RUNNING"
            row["coordinator_lost"] = lost
            row["protected"] = False if lost else None  # None: not known
            if isinstance(exc, RemoteError):
                row["state"] = "refused"
            elif lost:
                row["state"] = "lost"
            elif slurm_error is None and (sj is None or sj.state == "COMPLETING"):
                row["state"] = "finished"  # its coordinator left with the job; the registration stays
            else:
                row["state"] = "unreachable"
        # A rank's note that its link had no answer (torchpass.coordinator_lost): the coordinator is
        # lost even if it still answers us (the ranks cannot reach it), and even if Slurm cannot say.
        note = coordinator_lost.read(state_dir, jid)
        if note is not None and row["state"] != "finished":
            row.update(coordinator_lost=True, protected=False, lost=note, state="lost")
            row.setdefault("error", coordinator_lost.message(note))
        rows.append(row)
    if slurm_error:
        for r in rows:
            r["slurm_error"] = slurm_error
    return rows


def activity_lines(row: dict[str, Any]) -> list[str]:
    """What the coordinator is doing to the job (job.status's migration, snapshot, last_migration)."""
    lines = []
    m, s, last = row.get("migration"), row.get("snapshot"), row.get("last_migration")
    if m:
        lines.append(f"migrating {m['node']} -> {m['target'] or '(no spare yet)'} ({m['id']}): "
                     f"{m['phase']} for {m['phase_age_s']:.1f}s, {m['age_s']:.1f}s in all")
    if s:
        lines.append(f"snapshot {s['id']} ({s['trigger']}): {s['phase']} for {s['phase_age_s']:.1f}s")
    if last and not m:
        lines.append(f"last migration {last['id']}: {last['node']} -> {last['target'] or '-'} {last['outcome']}")
    return lines


REFUSED_CODES = ("forbidden", "unauthenticated")


def refusal(job_id: int | None, rows: list[dict[str, Any]]) -> CliError | None:
    """A question about one job that its coordinator refused fails (exit 1): scripts must not take
    a refusal for an answer. A listing of every job does not, with the refusal in that job's entry."""
    if job_id is None:
        return None
    for row in rows:
        if row.get("error_code") in REFUSED_CODES:
            return CliError(f"job {job_id}: {row['error']}; only the job's owner or an admin can see it", "refused")
    return None


def silence(job_id: int | None, rows: list[dict[str, Any]]) -> CliError | None:
    """Exit 3 when a coordinator that should answer did not: a running job's (lost) or one Slurm
    cannot say of (unreachable). A rank's lost note alone (it answered us) is shown, not an exit."""
    silent = [r for r in rows if r.get("state") in ("lost", "unreachable") and r.get("reachable") is False]
    if not silent:
        return None
    which = ", ".join(str(r["job_id"]) for r in silent)
    return CliError(f"job {which}: the coordinator did not answer ({silent[0]['error']})"
                    if job_id is not None else f"the coordinator of job(s) {which} did not answer", "unreachable")


JOB_HEADERS = ("JOBID", "STATE", "SLURM", "USER", "RANKS", "STEP", "COORDINATOR")
RANK_HEADERS = ("RANK", "NODE", "HOST PID", "PID", "STEP", "GEN", "LAST REPORT")


def job_lines(row: dict[str, Any]) -> list[str]:
    """A job in text: its line under headers, what is wrong or going on, then its ranks' table."""
    steps = None if row.get("min_step") is None else f"{row['min_step']}..{row['max_step']}"
    ranks = f"{row.get('registered_ranks', '?')}/{row.get('world_size') or '?'}" if row.get("reachable") else None
    coord = row.get("coordinator")
    where = None if coord is None else f"{coord['endpoint']} (pid {coord['pid']} on {coord['host']})"
    lines = table(JOB_HEADERS, [(row["job_id"], row["state"], row.get("slurm_state"), row.get("user"), ranks,
                                 steps, where)], right=("JOBID",))
    notes = []
    if row["state"] == "starting":
        notes.append("its coordinator has not registered yet (the job is starting)")
    elif row.get("coordinator_lost"):
        why = coordinator_lost.message(row["lost"]) if row.get("lost") else row["error"]
        notes.append(f"coordinator LOST: the job is unprotected (no migrations): {why}")
    elif row["state"] in ("unreachable", "refused"):
        notes.append(f"{row['state'].upper()}: {row['error']}")
    elif row.get("unprotected"):
        notes.append(f"UNPROTECTED: {row['unprotected']}")
    if row.get("torch_override"):
        notes.append(f"torch outside the tested range, allowed by the site: {row['torch_override']}")
    rails = row.get("rails")
    if rails:
        left = [r for r in rails["all"] if r not in rails["using"]]
        notes.append(f"data rails: {', '.join(rails['using'])}"
                     + (f" ({', '.join(left)} left out)" if left else "")
                     + (f"; unusable now: {', '.join(rails['down'])}" if rails["down"] else ""))
    notes += activity_lines(row)
    lines += [f"  {n}" for n in notes]
    if row.get("ranks"):
        lines += ["  " + line for line in table(
            RANK_HEADERS, [(r["rank"], r["node"], r.get("host_pid"), r["pid"], r["step"], r["generation"],
                            f"{r['last_report_age_s']:.1f}s ago") for r in row["ranks"]],
            right=("RANK", "HOST PID", "PID", "STEP", "GEN", "LAST REPORT"))]
    return lines


@click.command()
@click.argument("job_id", type=click.IntRange(min=1), required=False)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0.05), default=1.0, show_default=True,
              help="Seconds to wait for each coordinator.")
@state_dir_option
@click.pass_obj
def status(obj, job_id, as_json, timeout_s):
    """Show running torchpass jobs: coordinator, ranks, node and last step of each.

    Lists every job with a registered coordinator that Slurm reports running
    (or only JOB_ID), and for each rank its node, its pid on that node (HOST
    PID; PID is the pid inside the rank's own PID namespace) and the time since
    its last report. You see your own jobs; root and SlurmUser see every job.
    Another user's job, or a job id with no torchpass job, gets one and the
    same line (exit 4). STATE is running, starting (no coordinator registered
    yet: not an error), finished, lost (Slurm runs the job and its coordinator
    does not answer: nothing migrates it; exit 3), unreachable (exit 3) or
    refused (exit 1). A job the runtime cannot protect shows UNPROTECTED and
    why. A migration or whole-job snapshot in flight shows its phase and for
    how long it has been in it, and the last migration how it ended.
    """
    rows = collect(obj.state_dir, job_id, timeout_s)
    failure = refusal(job_id, rows) or silence(job_id, rows)
    if not as_json:
        if not rows:
            click.echo("no running torchpass jobs")
        for row in rows:
            for line in job_lines(row):
                click.echo(line)
    finish(as_json, {"jobs": rows}, failure)
