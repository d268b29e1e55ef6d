"""Whole-job snapshots (tpassctl snapshot): dump every rank (DumpRank), commit the snapshot's
manifest (CommitSnapshot) or remove a failed one's images (DiscardSnapshot), and stop the job
after its snapshot (StopJob, ForgetStopped). The pause and the resume are the migration's
PauseAt (every rank held: a held rank has closed its link, so CRIU finds no socket) and
ResumeInPlace with the snapshot's id where a migration's would be."""

from __future__ import annotations

from collections.abc import Collection

import structlog

from torchpass import layout
from torchpass.coordinator import contract as ct
from torchpass.coordinator.executor_ports import ExecutorPorts, write_atomically
from torchpass.coordinator.model import CoordState
from torchpass.coordinator.stopped import stopped_text
from torchpass.errors import TorchpassError

log = structlog.get_logger("torchpass.coordinator.executor")


class JobSnapshotActions:
    """DumpRank, CommitSnapshot, DiscardSnapshot, StopJob, ForgetStopped."""

    def __init__(self, ports: ExecutorPorts):
        self.ports = ports


    def dump_rank(self, a: ct.DumpRank, st: CoordState) -> None:
        body = {"job_id": self.ports.job_id, "rank": a.rank, "generation": a.generation, "op": "snap",
                "snapshot": a.snapshot, "rank_dir": str(self.ports.rank_dir), "keep": a.keep}

        def run() -> None:
            try:
                res = self.ports.tpassd.request(a.node, "tpassd.snapshot", body, self.ports.policy.dump_timeout_s)
                image = ct.SnapImage(a.rank, a.node, str(res["images"]), str(res["checksum"]), int(res["bytes"]))
            except (TorchpassError, KeyError, TypeError, ValueError) as exc:
                self.ports.post(ct.RankDumpFailed(a.snapshot, a.rank, str(exc)))
                return
            durations = {k: res[k] for k in ("criu_dump_s", "total_s") if isinstance(res.get(k), (int, float))}
            durations["image_mb"] = round(image.bytes / 1e6, 1)
            self.ports.post(ct.RankDumped(a.snapshot, image, durations))

        self.ports.thread(run, f"snap-{a.rank}")

    def commit(self, a: ct.CommitSnapshot, st: CoordState) -> None:
        body = {"job_id": self.ports.job_id, "rank": 0, "op": "commit", "snapshot": a.snapshot, "step": a.step,
                "generation": a.generation, "collectives": a.collectives, "keep": a.keep,
                "parts": [{"rank": i.rank, "node": i.node, "images": i.images, "checksum": i.checksum}
                          for i in a.ranks]}

        def run() -> None:
            try:
                res = self.ports.tpassd.request(a.node, "tpassd.snapshot", body, self.ports.policy.dump_timeout_s)
                done = ct.SnapshotCommitted(a.snapshot, str(res["manifest"]), int(res["bytes"]),
                                            tuple(str(r) for r in res.get("removed") or ()))
            except (TorchpassError, KeyError, TypeError, ValueError) as exc:
                self.ports.post(ct.SnapshotCommitFailed(a.snapshot, str(exc)))
                return
            self.ports.post(done)

        self.ports.thread(run, "snap-commit")

    def discard(self, a: ct.DiscardSnapshot, st: CoordState) -> None:
        def run() -> None:
            for node in a.nodes:
                try:
                    self.ports.tpassd.request(
                        node,
                        "tpassd.snapshot",
                        {"job_id": self.ports.job_id, "rank": 0, "op": "discard", "snapshot": a.snapshot},
                        30.0,
                    )
                except TorchpassError as exc:
                    log.warning("could not remove a failed snapshot's images", snapshot=a.snapshot, node=node,
                                error=str(exc))

        self.ports.thread(run, "snap-discard")

    def stop_job(self, a: ct.StopJob, st: CoordState) -> None:
        self.ports.save_events()  # the hold ends this coordinator soon after: its events are on disk first

        def run() -> None:
            marker = layout.stopped_file(self.ports.state_dir, self.ports.job_id)
            try:
                step = self.stopped_step(a.nodes)
                write_atomically(marker, stopped_text({
                    "snapshot": a.snapshot, "step": step, "snapshot_step": a.snapshot_step,
                    "generation": a.generation, "world_size": a.world_size, "step_offset": a.step_offset}))
                self.ports.slurm.requeue_hold(self.ports.job_id)
            except (TorchpassError, OSError) as exc:
                marker.unlink(missing_ok=True)
                self.ports.post(ct.JobStopFailed(a.snapshot, str(exc)))
                return
            log.warning("job stopped: requeue-held after its snapshot", job_id=self.ports.job_id, snapshot=a.snapshot,
                        step=step)

        self.ports.thread(run, "stop-job")

    def stopped_step(self, nodes: Collection[str]) -> int:
        """The Slurm step of the ranks (the resumed run restores the step of the same id): the
        job's step on most of their nodes, the first one of those; TorchpassError if none."""
        if self.ports.slurm is None:
            raise TorchpassError("no Slurm client: the job cannot be held")
        want = set(nodes)
        steps = {int(s.step_id.split(".", 1)[1]): len(want & set(s.nodes))
                 for s in self.ports.slurm.steps(self.ports.job_id) if s.user_step and want & set(s.nodes)}
        if not steps:
            raise TorchpassError(f"no step of job {self.ports.job_id} runs on the ranks' nodes {sorted(want)}")
        return max(steps, key=lambda step: (steps[step], -step))

    def forget_stopped(self, a: ct.ForgetStopped, st: CoordState) -> None:
        layout.stopped_file(self.ports.state_dir, self.ports.job_id).unlink(missing_ok=True)
        log.info("the stopped job resumed; its stop marker is removed", job_id=self.ports.job_id, snapshot=a.snapshot)
