"""A node lost outright and what follows: HandToSlurm (drain it through another node's tpassd;
with ``end_job``, requeue the job or end its steps there, as slurmctld does at DOWN), the
relaunch verdict (Relaunch, RelaunchPossible) that srun's exit hook reads, and the check with
slurmctld of nodes whose tpassd fell silent (``check_silent``). docs/coordinator.md, "A node
lost outright"."""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field

import structlog

from torchpass import layout
from torchpass.coordinator import contract as ct
from torchpass.coordinator.executor_ports import DRAIN_TIMEOUT_S, ExecutorPorts, write_atomically
from torchpass.coordinator.model import CoordState
from torchpass.coordinator.restore_steps import RestoreSteps
from torchpass.errors import RemoteError, TorchpassError
from torchpass.health_state import State
from torchpass.slurm.base import JobInfo, NodeInfo

log = structlog.get_logger("torchpass.coordinator.executor")

# A lost node's requeue waits at most this long for the serve thread to save job.requeuing (it
# serves within a batch; a serve thread that busy is not worth leaving the other ranks waiting).
REQUEUE_RECORD_WAIT_S = 5.0
# check_silent: slurmctld is asked about job nodes whose tpassd fell silent at most this often.
SILENT_CHECK_S = 2.0
RETRY_PREPARE_TIMEOUT_S = 15.0  # a second tpassd.restore prepare, for the nodes that did not answer the first


def slurm_lost(job: JobInfo | None, node: NodeInfo | None) -> str:
    """Why slurmctld confirms that ``node`` of ``job`` is lost ("" if it does not): the job
    runs on it and slurmctld does not hear its slurmd either."""
    if job is None or node is None or not job.active or node.name not in job.nodes:
        return ""
    if not node.not_answering:
        return ""
    said = f" ({node.reason})" if node.reason else ""
    return f"tpassd silent; slurmctld reports {'+'.join(node.state)}{said}"


@dataclass(frozen=True)
class LostNodeEnded:
    """Executor-internal outcome: what became of a job that lost ``node`` and cannot be
    relaunched (HandToSlurm ``end_job``): ``how`` "requeued", "steps_ended" or "" (nothing done:
    ``why``). Recorded as an event."""

    node: str
    how: str
    why: str
    steps: tuple[str, ...] = ()


def _as_slurm_requeues(node: str) -> str:
    """Why a job that lost ``node`` is requeued (events job.requeuing and job.requeued)."""
    return (f"as slurmctld requeues a batch job that loses a node ({node} lost, no relaunch possible): it "
            "starts again from its batch script under the same job id")


@dataclass(frozen=True)
class LostNodeRequeuing:
    """Executor-internal outcome: the job that lost ``node`` is about to be requeued. Recorded
    (``job.requeuing``) and saved, then ``recorded`` is set: the requeue ends the batch step and
    this coordinator with it, often before an event recorded after it would reach the disk."""

    node: str
    recorded: threading.Event = field(compare=False, repr=False)


@dataclass(frozen=True)
class LostNodeDrain:
    """Executor-internal outcome: the drain of a node lost outright, through another node's
    tpassd (``witness``), succeeded (``error`` None) or not. Recorded as an event."""

    node: str
    reason: str
    witness: str | None
    slurm_state: str
    error: str | None


class LostNodeActions:
    """HandToSlurm, Relaunch, RelaunchPossible, and the silent-node check."""

    def __init__(self, ports: ExecutorPorts, restore_steps: RestoreSteps):
        self.ports = ports
        self.restore_steps = restore_steps
        self._silent_check: threading.Thread | None = None  # check_silent's worker
        self._next_silent_check = 0.0
        # The relaunch verdict: written by the serve thread (RelaunchPossible) and by a Relaunch's
        # worker, under this lock; the steps the newest relaunch ended stay in every later write.
        self._verdict_lock = threading.Lock()
        # (count, steps, snapshot, cause, spares) of the newest relaunch published
        self._verdict_steps: tuple[int, list[str] | None, str, str, str] = (0, None, "", "", "")
        # A verdict left by an earlier run of the job (requeued) would hide this run's relaunches
        # from its sruns (they compare counts): this run's sruns start after its coordinator.
        layout.relaunch_file(ports.state_dir, ports.job_id).unlink(missing_ok=True)


    def hand_to_slurm(self, a: ct.HandToSlurm, st: CoordState) -> None:
        # slurmctld marks a node that stops answering DOWN ("Not responding") by itself after
        # SlurmdTimeout, ending the job as a node failure (requeued if requeueable). A node lost
        # outright (slurmctld confirmed it: unreachable) is also drained, with the reason, so that
        # it does not return to service by itself when its slurmd comes back: its own tpassd died
        # with it, so another node of the job witnesses for it. docs/coordinator.md, "A node lost
        # outright".
        log.warning("node handed to Slurm", node=a.node, reason=a.reason)
        # A node that still answers (a GPU that failed under a rank: decide_rank_death) is drained
        # by its own tpassd, on its own evidence (its health view says failed); a node lost
        # outright through another node's.
        live = a.drain_live and st.node_health(a.node).reachable
        drain = self.ports.tpassd is not None and (live or not st.node_health(a.node).reachable)
        if not drain and not a.end_job:
            return
        witnesses = [a.node] if live else sorted(
            (n for n in {*st.rank_nodes(), *(sp.node for sp in st.spares)}
             if n != a.node and n not in st.handed and st.node_health(n).reachable),
            key=lambda n: (st.node_health(n).state != State.HEALTHY, n))

        def drain_through_a_witness() -> None:
            tried = []
            body = {"job_id": self.ports.job_id, "reason": a.reason}
            if not live:
                body["node"] = a.node
            for node in witnesses:
                try:
                    res = self.ports.tpassd.request(node, "tpassd.drain", body, DRAIN_TIMEOUT_S)
                except TorchpassError as exc:
                    tried.append(f"{node}: {exc}")
                    if isinstance(exc, RemoteError) and exc.code in ("forbidden", "bad_request", "conflict"):
                        break  # slurmctld's answer, the same through any witness
                    continue
                self.ports.post(LostNodeDrain(a.node, a.reason, node, str(res.get("slurm_state") or ""), None))
                return
            self.ports.post(LostNodeDrain(a.node, a.reason, None, "", "; ".join(tried) or "no other node of the job "
                                                                                  "has a tpassd that answers"))

        def run() -> None:
            # The drain first: the witness's tpassd drains only a node slurmctld says the job still
            # runs on, which a requeue would end.
            if drain:
                drain_through_a_witness()
            if a.end_job:
                self.ports.post(self.end_as_node_failure(a.node))

        self.ports.thread(run, "drain-lost")

    def end_as_node_failure(self, node: str) -> LostNodeEnded:
        """What slurmctld does to a job without --no-kill when it marks one of its nodes DOWN, done
        now: requeue a requeueable batch job, else end the steps with a task on the node. Without it
        a job run with --no-kill (as torchpass's relaunch needs) that cannot be relaunched would keep
        its other ranks waiting in their collectives (until their timeout: 10 to 30 minutes)."""
        if self.ports.slurm is None:
            return LostNodeEnded(node, "", "no Slurm client")
        try:
            job = self.ports.slurm.job(self.ports.job_id)
            if job is None or job.state != "RUNNING":
                return LostNodeEnded(node, "", f"slurmctld reports the job {job.state if job else 'gone'} already")
            if job.requeue and job.batch:
                recorded = threading.Event()
                self.ports.post(LostNodeRequeuing(node, recorded))
                recorded.wait(REQUEUE_RECORD_WAIT_S)  # on disk first: what the requeue ends may not save it
                self.ports.slurm.requeue(self.ports.job_id)
                return LostNodeEnded(node, "requeued", "")
            why = ("the job is an allocation, not a batch job" if not job.batch
                   else "slurmctld does not say whether the job may be requeued" if job.requeue is None
                   else "the job is not requeueable (--no-requeue, or JobRequeue=0 in slurm.conf)")
            steps = tuple(s.step_id for s in self.ports.slurm.steps(self.ports.job_id)
                          if s.user_step and node in s.nodes)
            for step in steps:
                self.ports.slurm.cancel_step(step)
            if not steps:
                return LostNodeEnded(node, "", f"{why}; no step of the job has a task on {node} any more")
            return LostNodeEnded(node, "steps_ended", why, steps)
        except TorchpassError as exc:
            return LostNodeEnded(node, "", f"slurmctld refused or did not answer ({exc}); slurmctld's own DOWN "
                                           "handling is what remains")

    def write_verdict(self, pending: bool, node: str,
                        relaunch: tuple[int, list[str] | None, str, str, str] | None = None) -> None:
        """The verdict: with ``relaunch`` (count, the steps it ended (None: not known), the
        snapshot its tasks restore from ("": none, the script starts again), its cause
        ("lost_node" or "rank_died") and the spares in the replaced nodes' places, comma-separated
        ("": the same nodes)) a relaunch whose host file is written; without, the newest
        relaunch's again, pending or not (a pending flag never publishes a relaunch before its
        worker wrote the host file)."""
        with self._verdict_lock:
            if relaunch is not None:
                self._verdict_steps = relaunch
            count, steps, snapshot, cause, spares = self._verdict_steps
            text = f"count={count}\npending={int(pending)}\nnode={node}\n"
            if steps is not None:  # without it srun's exit hook relaunches any srun that ends
                text += f"steps={','.join(s.split('.', 1)[1] for s in steps)}\n"
            if snapshot:  # srun's exit hook sets TORCHPASS_RESTORE_SNAPSHOT for the relaunched step
                text += f"snapshot={snapshot}\n"
            if cause:  # what srun's exit hook says happened: a node lost, or a rank dead on a live one
                text += f"cause={cause}\nspares={spares}\n"
            write_atomically(layout.relaunch_file(self.ports.state_dir, self.ports.job_id), text)

    def relaunch(self, a: ct.Relaunch, st: CoordState) -> None:
        path = layout.hostfile(self.ports.state_dir, self.ports.job_id)
        swap = dict(a.replaced)
        lines = path.read_text().splitlines()
        log.warning("relaunching the job's training step", job_id=self.ports.job_id, relaunch=a.count,
                    replaced=swap, checkpoint_step=a.checkpoint_step, snapshot=a.snapshot or None)

        def run() -> None:
            # The steps with a task on a lost node are the ones to start again. Slurm ends such a
            # step only once it marks the node DOWN (SlurmdTimeout, 300 s by default); its tasks
            # on the other nodes hang in a collective until then. Ending it now lets its srun exit,
            # and its exit hook start it again, at once: after the host file and the verdict.
            ended: list[str] | None = None
            try:
                ends = swap.keys() | set(a.ended_on)
                ended = [s.step_id for s in self.ports.slurm.steps(self.ports.job_id)
                         if s.user_step and ends & set(s.nodes)] if self.ports.slurm is not None else None
            except TorchpassError as exc:
                log.warning("cannot list the job's steps; any srun that ends is started again",
                            job_id=self.ports.job_id, error=str(exc))
            hosts = [swap.get(h, h) for h in lines]
            write_atomically(path, "".join(f"{h}\n" for h in hosts))
            if a.snapshot:
                # Each node the relaunched step may use gets its token before the verdict lets the
                # srun start again: without one its tasks fail rather than restore.
                failed = self.restore_steps.prepare_all(set(hosts), "snapshot", snapshot=a.snapshot)
                if failed:
                    # Once more, given longer: a node's tpassd shares its cores with the job's ranks
                    # and wrappers, which all wake at the step's end. Without a token the node's tasks
                    # fail to restore and the job hangs (seen once on the loaded 2-core devcluster: the
                    # batch host's two tasks found no token, the other nodes' restored; still running
                    # 180 s later).
                    log.warning("the relaunch from the snapshot is not set up on every node yet; asking those "
                                "again", snapshot=a.snapshot, failed=failed)
                    failed = self.restore_steps.prepare_all(set(failed), "snapshot", snapshot=a.snapshot,
                                                            timeout_s=RETRY_PREPARE_TIMEOUT_S)
                if failed:
                    log.warning("the relaunch from the snapshot is not set up on every node; the step's tasks "
                                "there fail", snapshot=a.snapshot, failed=failed)
            # The node srun's exit hook names: the lost or faulted ones, else where the first rank died.
            self.write_verdict(False, ",".join(swap) or (a.ended_on[0] if a.ended_on else ""),
                               (a.count, ended, a.snapshot, a.cause, ",".join(swap.values())))
            for step in ended or ():
                try:
                    self.ports.slurm.cancel_step(step)
                    log.info("step on a lost node ended", job_id=self.ports.job_id, step=step)
                except TorchpassError as exc:
                    log.warning("cannot end the step on the lost node; Slurm ends it when it marks the node DOWN",
                                job_id=self.ports.job_id, step=step, error=str(exc))

        self.ports.thread(run, "relaunch")

    def relaunch_possible(self, a: ct.RelaunchPossible, st: CoordState) -> None:
        self.write_verdict(a.pending, a.node)
        log.info("relaunch verdict pending" if a.pending else "relaunch verdict no longer pending",
                 job_id=self.ports.job_id, node=a.node)

    def check_silent(self, silent: Collection[str]) -> None:
        """Job nodes whose tpassd fell silent: ask slurmctld (in a worker, at most every
        SILENT_CHECK_S) whether each is still in the job and not answering it either; for
        each that is, post ``NodeHealthChanged(failed, unreachable)``, which decide treats as
        a node lost outright. A silent tpassd alone is ``unknown`` (a tpassd restart, a
        network blip), never a reason to act (docs/tpassd.md)."""
        now = time.monotonic()
        busy = self._silent_check is not None and self._silent_check.is_alive()
        if not silent or self.ports.slurm is None or busy or now < self._next_silent_check:
            return
        self._next_silent_check = now + SILENT_CHECK_S
        nodes = sorted(silent)

        def run() -> None:
            try:
                job = self.ports.slurm.job(self.ports.job_id)
                views = {n.name: n for n in self.ports.slurm.nodes()}
            except TorchpassError as exc:
                log.info("cannot ask slurmctld about silent nodes", nodes=nodes, error=str(exc))
                return
            for node in nodes:
                why = slurm_lost(job, views.get(node))
                if why:
                    log.warning("node lost outright", node=node, why=why)
                    self.ports.post(ct.NodeHealthChanged(node, "failed", (why,), reachable=False))

        self._silent_check = self.ports.thread(run, "silent-nodes")

    # --- its own outcomes, seen in the serve thread: each is recorded as an event and saved ---
    def observe_drain(self, outcome: LostNodeDrain) -> None:
        job, now = self.ports.job, self.ports.wall()
        if outcome.error is None:
            said = outcome.slurm_state or "not answering"
            how = ("by its own tpassd" if outcome.witness == outcome.node else
                   f"through {outcome.witness}'s tpassd (slurmctld reports it {said})")
            job.record(now, "node.drained", f"{outcome.node} drained {how}: {outcome.reason}",
                       node=outcome.node, witness=outcome.witness, reason=outcome.reason)
        else:
            job.record(now, "node.drain_failed",
                       f"{outcome.node} was not drained ({outcome.error}); slurmctld's own DOWN state is "
                       "what remains", node=outcome.node, error=outcome.error)
        log.warning("lost node drained" if outcome.error is None else "lost node not drained", node=outcome.node,
                    witness=outcome.witness, error=outcome.error)
        self.ports.save_events()

    def observe_requeuing(self, outcome: LostNodeRequeuing) -> None:
        self.ports.job.record(self.ports.wall(), "job.requeuing",
                              f"torchpass requeues the job, {_as_slurm_requeues(outcome.node)}", node=outcome.node)
        log.warning("requeuing the job after a lost node", node=outcome.node)
        self.ports.save_events()
        outcome.recorded.set()

    def observe_ended(self, outcome: LostNodeEnded) -> None:
        job, now = self.ports.job, self.ports.wall()
        if outcome.how == "requeued":
            job.record(now, "job.requeued",
                       f"job requeued by torchpass, {_as_slurm_requeues(outcome.node)}", node=outcome.node)
        elif outcome.how == "steps_ended":
            job.record(now, "job.steps_ended",
                       f"{outcome.why}: step(s) {', '.join(outcome.steps)} with a task on {outcome.node} "
                       "ended, as slurmctld would end the job; the batch script goes on",
                       node=outcome.node, steps=list(outcome.steps), why=outcome.why)
        else:
            job.record(now, "job.not_ended",
                       f"the job was left as it is after losing {outcome.node}: {outcome.why}",
                       node=outcome.node, why=outcome.why)
        log.warning("job after a lost node", node=outcome.node, how=outcome.how or "left", why=outcome.why,
                    steps=list(outcome.steps))
        self.ports.save_events()
