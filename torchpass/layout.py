"""The state-directory layout: the one place Python spells it.

Two trees, both on a filesystem every node of a job shares:

```
STATE_DIR/                        (tpassd/coordinator --state-dir, /var/lib/torchpass)
  jobs/                           root's alone (JOBS_DIR_MODE): no user can make a jobs/J
  jobs/J/                         job_dir(state_dir, J); made by the SPANK plugin (root) at the job's start,
                                  owner the job's user, group SlurmUser's, JOB_DIR_MODE: private to them and root
    coordinator.json              coordinator_json(): registration (endpoint, auth) for tpassctl
    coordinator.pid               coordinator_pid(): "PID STARTTIME NODE" (written by the C plugin)
    coordinator.log               coordinator_log(): the coordinator's stdout/stderr (C plugin)
    hostfile                      hostfile(): active nodes, once per task (C plugin; the coordinator
                                  rewrites it when it relaunches the job's step)
    relaunch                      relaunch_file(): the coordinator's verdict on a lost node, read by
                                  srun's exit hook (C plugin): "count=N" relaunches decided,
                                  "pending=1" while a silent node may lead to one
    events.json                   events_json(): the event log, outlives the coordinator
    restored-ranks.out            restored_ranks_out(): stdout of restore steps (default)
    restore-M-rankR.err           restore_error_file(): why restore step M of rank R failed
    restore-M-rankR.go            restore_go_file(): the restore gate's go/abort verdict
    hold/M.rankR                  hold_file(): keeps rank R's source paused for migration M
    ranks/                        rank_records_dir(): the rank wrappers' directory (RANK_DIR below)
    snapshots/ID.json             snapshot_manifest(): a whole-job snapshot's manifest (root's, owner's group)

RANK_DIR/                         (the rank wrapper's --state-dir, $TORCHPASS_RANK_STATE_DIR)
  jobJ/                           rank_job_dir(rank_dir, J)
    rankR.json                    rank_record(): wrapper pid, rank pid, pipe inodes
    rankR.handoff                 handoff(): moving / moved / abort
    rankR.exit                    exit_file(): exit code of a moved rank
    rankR.released                released_file(): its launch wrapper left the source node

TOKENS/                           (tpassd.toml restore_token_dir = plugstack.conf restore_tokens=;
                                  default RESTORE_TOKENS; root's, 0700, node-local)
  NODE/                           restore_token_dir(TOKENS, NODE): root's, 0700
    jobJ.rankR.token              restore_token(..., "migration", rank=R): a migration's restore step
    jobJ.snapshot.token           restore_token(..., "snapshot"): a relaunch from a whole-job snapshot
    jobJ.stopped.token            restore_token(..., "stopped"): the restore of a stopped job
    jobJ.KIND.stepS.token         the same once step S took it (the SPANK plugin renames it)

SNAPSHOT_DIR/                     (tpassd --snapshot-dir, node-local)
  jobJ/                           snapshot_job_dir(snapshot_dir, J)
    rankR.genG/                   images_dir(snapshot_dir, J, R, G): CRIU images of one dump
  snapshots/jobJ/ID/rankR/        snapshot_images_dir(snapshot_dir, J, ID, R): rank R in whole-job snapshot ID
```

The C plugin spells the names it needs in slurm_spank/layout.h; a unit test
checks that they agree with the constants here. Functions take and return
``pathlib.Path``; arguments may be ``str`` or ``os.PathLike``.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

PathLike = str | os.PathLike

# Names under STATE_DIR/jobs/J (the C plugin spells the first five and RELAUNCH too).
JOBS = "jobs"
COORDINATOR_JSON = "coordinator.json"
COORDINATOR_PID = "coordinator.pid"
COORDINATOR_LOG = "coordinator.log"
HOSTFILE = "hostfile"
RELAUNCH = "relaunch"
STOPPED = "stopped"
STOPPED_OUT = "stopped.out"
STOPPED_ERR = "stopped.err"
EVENTS_JSON = "events.json"
RANKS = "ranks"
HOLD = "hold"
RESTORED_RANKS_OUT = "restored-ranks.out"

# Who may read STATE_DIR/jobs/J (slurm_spank/layout.h spells the same modes). jobs/ is root's and
# writable by root alone, so the owner of jobs/J, made by the plugin as root and given to the job's
# user, is the job's owner. jobs/J's group is SlurmUser's primary group, and its setgid bit gives
# that group to every file and directory made inside: the owner, root and SlurmUser read a job's
# events, log and rank records, whether it runs or has ended, and no other user does, whatever
# Slurm's PrivateData says. The coordinator runs with JOB_UMASK.
JOBS_DIR_MODE = 0o755
JOB_DIR_MODE = 0o2750
JOB_FILE_MODE = 0o640
JOB_UMASK = 0o027

# Suffixes of the per-rank files in RANK_DIR/jobJ.
RECORD_SUFFIX = ".json"
HANDOFF_SUFFIX = ".handoff"
EXIT_SUFFIX = ".exit"
RELEASED_SUFFIX = ".released"

# Default rank-wrapper directory when neither --state-dir nor $TORCHPASS_RANK_STATE_DIR is set.
DEFAULT_RANK_DIR = "/run/torchpass/ranks"


def _job_name(job: int | str) -> str:
    return f"job{job}"


def _rank_name(rank: int | str) -> str:
    return f"rank{rank}"


# --- STATE_DIR/jobs/J -------------------------------------------------------

def jobs_dir(state_dir: PathLike) -> Path:
    """STATE_DIR/jobs."""
    return Path(state_dir) / JOBS


def job_dir(state_dir: PathLike, job: int | str) -> Path:
    """STATE_DIR/jobs/J."""
    return jobs_dir(state_dir) / str(job)


def _job_file(name: str) -> Callable[[PathLike, int | str], Path]:
    def path(state_dir: PathLike, job: int | str) -> Path:
        return job_dir(state_dir, job) / name

    path.__doc__ = f"STATE_DIR/jobs/J/{name}."
    return path


coordinator_json = _job_file(COORDINATOR_JSON)
coordinator_pid = _job_file(COORDINATOR_PID)
coordinator_log = _job_file(COORDINATOR_LOG)
hostfile = _job_file(HOSTFILE)
relaunch_file = _job_file(RELAUNCH)
# A job stopped by `tpassctl snapshot --stop`: its coordinator writes STOPPED (key=value
# lines: the snapshot, the Slurm step it stopped, ...) before it requeue-holds the job; `tpassctl
# resume` copies the job's output (and error) file there as STOPPED.out (.err), which the SPANK
# plugin writes back at the start of the resumed batch step (Slurm truncates the files on a
# requeue); the plugin restores the step of that id from the snapshot; the resumed coordinator
# removes STOPPED once every rank resumed.
stopped_file = _job_file(STOPPED)
stopped_out = _job_file(STOPPED_OUT)
stopped_err = _job_file(STOPPED_ERR)
events_json = _job_file(EVENTS_JSON)
restored_ranks_out = _job_file(RESTORED_RANKS_OUT)


def restore_error_file(state_dir: PathLike, job: int | str, migration: int | str, rank: int | str) -> Path:
    """STATE_DIR/jobs/J/restore-M-rankR.err."""
    return job_dir(state_dir, job) / f"restore-{migration}-{_rank_name(rank)}.err"


def restore_go_file(state_dir: PathLike, job: int | str, migration: int | str, rank: int | str) -> Path:
    """STATE_DIR/jobs/J/restore-M-rankR.go (the restore gate, torchpass.checkpoint.restore_gate)."""
    return job_dir(state_dir, job) / f"restore-{migration}-{_rank_name(rank)}.go"


# A hold file that says "restored ID" woke a copy of the rank restored from whole-job snapshot ID
# (a relaunch from a snapshot): the copy registers again (torchpass.runtime.control).
RESTORED_WAKE = "restored"


def hold_file(state_dir: PathLike, job: int | str, migration: int | str, rank: int | str) -> Path:
    """STATE_DIR/jobs/J/hold/M.rankR."""
    return job_dir(state_dir, job) / HOLD / f"{migration}.{_rank_name(rank)}"


def rank_records_dir(state_dir: PathLike, job: int | str) -> Path:
    """STATE_DIR/jobs/J/ranks: the RANK_DIR the job's rank wrappers use."""
    return job_dir(state_dir, job) / RANKS


# --- RANK_DIR/jobJ (rank_dir is rank_records_dir(...) or the wrapper's --state-dir) ---

def rank_job_dir(rank_dir: PathLike, job: int | str) -> Path:
    """RANK_DIR/jobJ."""
    return Path(rank_dir) / _job_name(job)


def restore_request_file(rank_job_dir: PathLike, rank: int | str, agent_pid: int) -> Path:
    """RANK_DIR/jobJ/rankR.restore-req.AGENTPID: the restore wrapper's request to the plugin's root agent
    (named per agent, so a restore step started before a dump never reads an earlier move's request)."""
    return Path(rank_job_dir) / f"{_rank_name(rank)}.restore-req.{agent_pid}"


def restore_result_file(rank_job_dir: PathLike, rank: int | str, agent_pid: int) -> Path:
    """RANK_DIR/jobJ/rankR.restore-res.AGENTPID: the root agent's answer."""
    return Path(rank_job_dir) / f"{_rank_name(rank)}.restore-res.{agent_pid}"


def rank_record(rank_dir: PathLike, job: int | str, rank: int | str) -> Path:
    """RANK_DIR/jobJ/rankR.json."""
    return rank_job_dir(rank_dir, job) / (_rank_name(rank) + RECORD_SUFFIX)


def handoff(rank_dir: PathLike, job: int | str, rank: int | str) -> Path:
    """RANK_DIR/jobJ/rankR.handoff."""
    return rank_job_dir(rank_dir, job) / (_rank_name(rank) + HANDOFF_SUFFIX)


def exit_file(rank_dir: PathLike, job: int | str, rank: int | str) -> Path:
    """RANK_DIR/jobJ/rankR.exit."""
    return rank_job_dir(rank_dir, job) / (_rank_name(rank) + EXIT_SUFFIX)


def released_file(rank_dir: PathLike, job: int | str, rank: int | str) -> Path:
    """RANK_DIR/jobJ/rankR.released: the launch wrapper of a moved rank left its node (torchpass.checkpoint.
    moved_exit); srun's exit hook collects the rank's exit code instead."""
    return rank_job_dir(rank_dir, job) / (_rank_name(rank) + RELEASED_SUFFIX)


# --- SNAPSHOT_DIR/jobJ ------------------------------------------------------

def snapshot_job_dir(snapshot_dir: PathLike, job: int | str) -> Path:
    """SNAPSHOT_DIR/jobJ."""
    return Path(snapshot_dir) / _job_name(job)


def images_dir(snapshot_dir: PathLike, job: int | str, rank: int | str, generation: int | str) -> Path:
    """SNAPSHOT_DIR/jobJ/rankR.genG: the CRIU images of one dump."""
    return snapshot_job_dir(snapshot_dir, job) / f"{_rank_name(rank)}.gen{generation}"


def images_dirs(snapshot_dir: PathLike, job: int | str, rank: int | str) -> list[Path]:
    """Every SNAPSHOT_DIR/jobJ/rankR.gen* of one rank, sorted by name."""
    return sorted(snapshot_job_dir(snapshot_dir, job).glob(f"{_rank_name(rank)}.gen*"))


def parse_images_dir(path: PathLike, job: int | str, rank: int | str) -> tuple[Path, int] | None:
    """(SNAPSHOT_DIR, G) when ``path`` is exactly images_dir(SNAPSHOT_DIR, job, rank, G), else None."""
    p = Path(path)
    if ".." in p.parts:
        return None
    gen = p.name.removeprefix(f"{_rank_name(rank)}.gen")
    if gen == p.name or not gen.isdigit() or p.parent.name != _job_name(job):
        return None
    root = p.parent.parent
    return (root, int(gen)) if images_dir(root, job, rank, int(gen)) == p else None


# --- Restore tokens (torchpass.checkpoint.restore_token; slurm_spank/token.h) ----------------
# tpassd writes one before each restore it checked ('tpassd.restore' op=prepare); the SPANK plugin
# starts the root restore agent only for a step whose token it takes. Root-only and node-local:
# TOKENS/NODE, so nodes that share /run (the devcluster's) keep theirs apart.
RESTORE_TOKENS = "/run/torchpass/restore-tokens"
TOKEN_SUFFIX = ".token"
TOKEN_KINDS = ("migration", "snapshot", STOPPED)  # slurm_spank/token.c spells STOPPED as layout.h does
# A token older than this is refused: tpassd writes it right before the step's srun, and a step that
# waits at its restore gate took its token at launch (slurm_spank/layout.h TPASS_RESTORE_TOKEN_TTL_S).
RESTORE_TOKEN_TTL_S = 600


def restore_token_dir(tokens: PathLike, node: str) -> Path:
    """TOKENS/NODE: the node's restore tokens."""
    if not node or "/" in node or node in (".", ".."):
        raise ValueError(f"node name {node!r} cannot name a directory")
    return Path(tokens) / node


def restore_token(tokens: PathLike, node: str, job: int | str, kind: str, rank: int | str | None = None,
                  step: int | str | None = None) -> Path:
    """TOKENS/NODE/jobJ.rankR.token (migration), jobJ.KIND.token, or jobJ.KIND.stepS.token (bound)."""
    if kind not in TOKEN_KINDS:
        raise ValueError(f"restore token kind {kind!r} is not one of {', '.join(TOKEN_KINDS)}")
    tag = _rank_name(rank) if kind == "migration" else kind if step is None else f"{kind}.step{step}"
    return restore_token_dir(tokens, node) / f"{_job_name(job)}.{tag}{TOKEN_SUFFIX}"


# --- Whole-job snapshots ---------------------------------------------------------------------
# SNAPSHOT_DIR/snapshots/jobJ/ID/rankR/   snapshot_images_dir(): CRIU images of rank R in job snapshot ID
#                                         (root only; never under SNAPSHOT_DIR/jobJ, which the job's end sweeps)
# STATE_DIR/jobs/J/snapshots/ID.json      snapshot_manifest(): the job manifest, written by root (tpassd);
#                                         the snapshots directory is root's, group the owner's, 0750
SNAPSHOTS = "snapshots"
SNAPSHOT_MANIFEST_SUFFIX = ".json"
# A snapshot id names directories and files: these characters only, and never a leading dot.
SNAPSHOT_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")
SNAPSHOT_ID_MAX = 64


def valid_snapshot_id(snap: str) -> bool:
    """``snap`` can name a snapshot's directory and manifest (no separator, dot or oddity)."""
    return isinstance(snap, str) and 0 < len(snap) <= SNAPSHOT_ID_MAX and set(snap) <= SNAPSHOT_ID_CHARS


def snapshot_tree(snapshot_dir: PathLike, job: int | str) -> Path:
    """SNAPSHOT_DIR/snapshots/jobJ: every whole-job snapshot of job J on this snapshot_dir."""
    return Path(snapshot_dir) / SNAPSHOTS / _job_name(job)


def snapshot_images_dir(snapshot_dir: PathLike, job: int | str, snap: str, rank: int | str) -> Path:
    """SNAPSHOT_DIR/snapshots/jobJ/ID/rankR: the CRIU images of rank R in snapshot ID."""
    return snapshot_tree(snapshot_dir, job) / snap / _rank_name(rank)


def parse_snapshot_images_dir(path: PathLike, job: int | str, rank: int | str) -> tuple[Path, str] | None:
    """(SNAPSHOT_DIR, ID) when ``path`` is exactly snapshot_images_dir(SNAPSHOT_DIR, job, ID, rank), else None."""
    p = Path(path)
    if ".." in p.parts or len(p.parts) < 5 or not valid_snapshot_id(p.parent.name):
        return None
    root = p.parent.parent.parent.parent
    snap = p.parent.name
    return (root, snap) if snapshot_images_dir(root, job, snap, rank) == p else None


def snapshot_manifests_dir(state_dir: PathLike, job: int | str) -> Path:
    """STATE_DIR/jobs/J/snapshots: the job manifests of job J's snapshots."""
    return job_dir(state_dir, job) / SNAPSHOTS


def snapshot_manifest(state_dir: PathLike, job: int | str, snap: str) -> Path:
    """STATE_DIR/jobs/J/snapshots/ID.json: the job manifest of snapshot ID."""
    return snapshot_manifests_dir(state_dir, job) / f"{snap}{SNAPSHOT_MANIFEST_SUFFIX}"


__all__ = [
    "JOBS", "COORDINATOR_JSON", "COORDINATOR_PID", "COORDINATOR_LOG", "HOSTFILE", "RELAUNCH", "EVENTS_JSON",
    "RANKS", "HOLD", "RESTORED_WAKE", "RESTORED_RANKS_OUT", "RECORD_SUFFIX", "HANDOFF_SUFFIX", "EXIT_SUFFIX",
    "RELEASED_SUFFIX",
    "DEFAULT_RANK_DIR", "JOBS_DIR_MODE", "JOB_DIR_MODE", "JOB_FILE_MODE", "JOB_UMASK",
    "jobs_dir", "job_dir", "coordinator_json", "coordinator_pid", "coordinator_log", "hostfile", "relaunch_file",
    "stopped_file", "stopped_out", "stopped_err", "STOPPED", "STOPPED_OUT", "STOPPED_ERR",
    "events_json", "restored_ranks_out", "restore_error_file", "restore_go_file", "hold_file",
    "rank_records_dir", "rank_job_dir", "rank_record", "handoff", "exit_file", "released_file",
    "snapshot_job_dir", "images_dir", "images_dirs", "parse_images_dir",
    # whole-job snapshots
    "SNAPSHOTS", "SNAPSHOT_MANIFEST_SUFFIX", "valid_snapshot_id", "snapshot_tree", "snapshot_images_dir",
    "parse_snapshot_images_dir", "snapshot_manifests_dir", "snapshot_manifest",
    # restore tokens
    "RESTORE_TOKENS", "TOKEN_SUFFIX", "TOKEN_KINDS", "RESTORE_TOKEN_TTL_S", "restore_token_dir", "restore_token",
]
