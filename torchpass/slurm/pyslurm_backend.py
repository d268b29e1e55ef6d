"""pyslurm backend: used only where pyslurm's version matches the cluster's.

pyslurm's major.minor must equal the Slurm release it talks to (PyPI builds
it for Slurm 25.11 only). Where it does not match, ``pyslurm_matches``
says why and the CLI backend is used instead.
"""

from __future__ import annotations

import subprocess

from torchpass.errors import DependencyError, SlurmError
from torchpass.slurm.base import JobInfo, NodeInfo
from torchpass.slurm.cli import CliSlurmClient


def _slurm_version() -> str:
    try:
        out = subprocess.run(["sinfo", "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    parts = out.split()
    return parts[1] if len(parts) > 1 else ""


def pyslurm_matches() -> tuple[bool, str]:
    try:
        import pyslurm
    except ImportError:
        return False, "pyslurm is not installed"
    have = getattr(pyslurm, "__version__", "")
    slurm = _slurm_version()
    if not slurm:
        return False, "cannot read the Slurm version (sinfo --version)"
    if have.split(".")[:2] != slurm.split(".")[:2]:
        return False, f"pyslurm {have} does not match Slurm {slurm}"
    return True, ""


class PyslurmClient(CliSlurmClient):
    """Reads the hot paths (job and node state) through pyslurm's API.

    Updates (drain, shrink) and spare allocations (salloc, job expansion,
    scancel) and step listings stay on the commands (inherited from the CLI
    backend): they are rare and their behaviour is what admins know. Not exercised in CI: the test cluster runs
    Slurm 24.11, for which PyPI has no pyslurm.
    """

    name = "pyslurm"

    def __init__(self, environ=None):
        super().__init__(environ=environ)
        ok, why = pyslurm_matches()
        if not ok:
            raise DependencyError(f"pyslurm backend unusable: {why}")
        import pyslurm

        self._pyslurm = pyslurm

    def job(self, job_id: int) -> JobInfo | None:
        try:
            j = self._pyslurm.Job.load(int(job_id))
        except self._pyslurm.RPCError as exc:
            # Only slurmctld's "Invalid job id specified" means the job is gone; any other RPC
            # error (slurmctld unreachable) is no answer, which the caller must not take for one.
            if "Invalid job id" in str(exc):
                return None
            raise SlurmError(f"cannot ask slurmctld about job {job_id} ({exc})") from None
        nodes = j.nodes or ""
        return JobInfo(
            job_id=int(j.id),
            name=j.name or "",
            user=j.user_name or "",
            user_id=int(j.user_id),
            state=str(j.state),
            nodes=tuple(self.expand_nodelist(nodes)) if nodes else (),
            batch_host=j.batch_host or "",
            exit_code=j.exit_code,
            restarts=int(j.requeue_count or 0) if hasattr(j, "requeue_count") else 0,
            comment=j.comment or "",
            partition=getattr(j, "partition", "") or "",
            account=getattr(j, "account", "") or "",
            qos=getattr(j, "qos", "") or "",
            end_time=int(j.end_time) if getattr(j, "end_time", None) else None,
            output=getattr(j, "standard_output", "") or "",
            requeue=j.is_requeueable if isinstance(getattr(j, "is_requeueable", None), bool) else None,
            batch=bool(getattr(j, "is_batch_job", True)),
        )

    def nodes(self) -> list[NodeInfo]:
        out = []
        for name, n in self._pyslurm.Nodes.load().items():
            out.append(
                NodeInfo(
                    name=name,
                    address=n.address or name,
                    state=tuple(str(n.state).split("+")),
                    reason=n.reason or "",
                )
            )
        return out
