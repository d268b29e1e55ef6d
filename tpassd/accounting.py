"""``tpassd.account``: root writes the job's ``torchpass: ...`` part into its Slurm record.

The coordinator runs as the job's user, and slurmctld lets only root, SlurmUser and Slurm
administrators set AdminComment, so the coordinator asks a tpassd of its job's nodes after each
migration, snapshot, reroute and relaunch. The request carries nothing but the job id: tpassd
checks with slurmctld that the requester owns the job (or is root or SlurmUser) and that the job
runs on this node, reads the job's own event log through torchpass.jobdir (no link followed, the
job directory and a regular file of the job's owner, at most EVENTS_MAX bytes), and builds the part itself
(torchpass/accounting.py: counted, never copied as text, at most 200 characters). So a user can
write only into the record of a job of their own, and only text of torchpass' making.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from torchpass import accounting, jobdir, wire
from torchpass.auth import AuthFailure
from torchpass.checkpoint.admission import Audit
from torchpass.errors import RemoteError, TorchpassError
from torchpass.slurm import SlurmClient

log = structlog.get_logger("tpassd.accounting")

# The event log is kept to its last 10,000 events (torchpass/coordinator/job_record.py): a few MB
# at most. Larger is not a log the coordinator wrote; tpassd runs under MemoryMax=256M.
EVENTS_MAX = 16 << 20


class JobAccounting:
    def __init__(self, node: str, state_dir: str | os.PathLike, field: str,
                 slurm_client: Callable[[], SlurmClient], is_admin: Callable[[int], bool]):
        self.node = node
        self.state_dir = Path(state_dir)
        self.field = field
        self._slurm = slurm_client
        self._is_admin = is_admin

    def handle(self, msg: wire.Message, ident: Any) -> dict[str, Any]:
        job_id = msg.body["job_id"]
        with Audit(ident, "account", msg.body) as act:
            if isinstance(job_id, bool) or job_id < 0:
                raise RemoteError("bad_request", "tpassd.account: job_id must be a non-negative integer")
            if not self.field:
                raise RemoteError("disabled", f"accounting is off on {self.node} (tpassd.toml accounting_field)")
            try:
                job = self._slurm().job(job_id)
            except TorchpassError as exc:
                raise RemoteError("unavailable", f"cannot ask Slurm about job {job_id} ({exc})") from None
            if job is None:
                raise RemoteError("not_found", f"job {job_id} is not known to Slurm")
            if job.user_id != ident.uid and not self._is_admin(ident.uid):
                raise AuthFailure("forbidden", f"uid {ident.uid} does not own job {job_id}")
            if not job.active or self.node not in job.nodes:
                raise AuthFailure("forbidden", f"job {job_id} does not run on {self.node}")
            part = accounting.render(accounting.summarize(self._events(job_id, job.user_id)))
            current = job.admin_comment if self.field == "AdminComment" else job.comment
            value = accounting.merge(current, part)
            act.fields.update(field=self.field, part=part)
            if value != current:
                try:
                    self._slurm().set_job_field(job_id, self.field, value)
                except TorchpassError as exc:
                    raise RemoteError("failed", f"scontrol could not set {self.field} of job {job_id}: {exc}") from None
                log.info("job accounted", job_id=job_id, field=self.field, part=part)
            return {"job_id": job_id, "field": self.field, "value": value, "changed": value != current}

    def _events(self, job_id: int, owner: int) -> list[Any]:
        """The job's events.json, opened below state_dir without following a link, in the job
        directory of the job's owner (Slurm's word), a regular file of theirs; RemoteError when it
        cannot be read or is not a JSON list."""
        try:
            events, _ = jobdir.read_events(self.state_dir, job_id, owner=owner, cap=EVENTS_MAX)
        except (OSError, ValueError) as exc:
            raise RemoteError("bad_request", f"cannot read job {job_id}'s event log: {exc}") from None
        return events


__all__ = ["EVENTS_MAX", "JobAccounting"]
