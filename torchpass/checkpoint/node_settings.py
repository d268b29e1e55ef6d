"""What every part of tpassd's checkpoint service knows of its node: paths, limits and seams.

One mutable object shared by the parts (admission, job_files, rank_dump, rank_kill,
job_snapshots, restore_requests): tpassd sets the site limits after it built the service
(tpassd/daemon.py, from tpassd.toml), and tests move the clock or Slurm's answers on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchpass import jobdir, layout, slurm
from torchpass.checkpoint import criu as criu_mod
from torchpass.checkpoint import gpu_map, procs


def slurm_job_owner(job_id: int) -> int | None:
    """The job's owner as slurmctld records it; None when Slurm does not know the job."""
    info = slurm.client().job(job_id)
    return None if info is None else info.user_id


def maps_nvidia_device(pid: int, proc: str = "/proc") -> bool:
    """True if ``pid`` maps an NVIDIA device file (a CUDA context): its GPU state must be checkpointed."""
    try:
        with open(f"{proc}/{pid}/maps") as f:
            return any("/dev/nvidia" in line for line in f)
    except OSError:
        return False


@dataclass
class NodeSettings:
    snapshot_dir: Path
    node: str
    # The job state directory (STATE_DIR, whose jobs/J/ranks is the job's rank directory): the only
    # place tpassd looks for rank records. None: this tpassd finds no rank records.
    state_dir: Path | None = None
    criu_binary: str | None = None
    # The job's owner as slurmctld records it (tpassd passes its admission's cached lookup).
    job_owner: Callable[[int], int | None] = slurm_job_owner
    # The job's processes on this node, as Slurm tracks them (scontrol listpids).
    job_pids: Callable[[int], set[int]] = procs.slurm_job_pids
    proc: str = "/proc"
    # The restore-fail fault drill (tpassd/drills.py): True once when armed.
    restore_fault: Callable[[], bool] = lambda: False
    # The kill-fail drill: True once when armed; the next op=kill is refused.
    kill_fault: Callable[[], bool] = lambda: False
    # Does a process hold GPU state (then the driver must move it to host memory before CRIU can
    # dump)? None: it maps an NVIDIA device file. Injectable for tests on GPU-less machines.
    gpu_in_use: Callable[[int], bool] | None = None
    cuda_loader: Callable[[], Any] | None = None
    # GPU device minor -> UUID (NVML): the UUIDs a GPU rank's image names, recorded in its manifest.
    gpu_uuids_by_minor: Callable[[], dict[int, str]] = gpu_map.nvml_uuids_by_minor
    # The node's GPUs (tpassd.toml gpu_inventory, else NVML where tpassd reads NVML): a rank that holds
    # no GPU state records the GPUs its task's devices cgroup allows. None: not asked (no GPUs known).
    gpu_inventory: Callable[[], gpu_map.GpuInventory] | None = None
    dump_timeout_s: float = criu_mod.DUMP_TIMEOUT_S
    # How many bytes a dump of a tree will write (checked against snapshot_dir's free space before
    # anything moves, and again right before CRIU, after a CUDA suspend brought the GPU state into
    # host memory). Injectable: tests make it miss.
    image_estimate: Callable[[int], int] = criu_mod.image_estimate
    # Whole-job snapshots leave at least this much free on snapshot_dir: tpassd's own free-space
    # health rule (disk_free_gb_degraded) must not trip because of a snapshot.
    keep_free_bytes: int = 0
    # Site limits on complete whole-job snapshots (tpassd.toml snapshot_quota_gb, snapshot_max_age_h):
    # bytes per user over all their jobs, checked at commit; age after which a snapshot expires. 0: none.
    snapshot_quota_bytes: int = 0
    snapshot_max_age_s: float = 0.0
    wall: Callable[[], float] = time.time  # the job manifest's created time, the tokens' and expiry's clock
    # The group that may read a job's manifests: the owner's primary group if it is a user-private
    # group; None: no group, the owner reads them through an ACL entry (jobdir.share_with_owner).
    owner_gid: Callable[[int], int | None] = jobdir.private_group
    # Restore tokens (op=prepare): TOKENS/NODE, root's 0700 (token_owner: tests run unprivileged).
    restore_tokens: Path = field(default_factory=lambda: Path(layout.RESTORE_TOKENS))
    token_owner: int = 0

    def holds_gpu_state(self, pid: int) -> bool:
        return self.gpu_in_use(pid) if self.gpu_in_use is not None else maps_nvidia_device(pid, self.proc)


__all__ = ["NodeSettings", "maps_nvidia_device", "slurm_job_owner"]
