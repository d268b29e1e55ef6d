"""ReconfigurablePG's pause/resume state in one process (world size 1, real gloo and TCPStore).

The multi-process behaviour is covered by test_runtime_ddp / _collectives / _fsdp; this file
pins races of the command handling that those hit only now and then.
"""

from __future__ import annotations

import datetime
import threading
import time

import torch

from torchpass.runtime.pg import PauseListener, ReconfigurablePG, Rendezvous
from torchpass.runtime.testing import free_port


class Recorder(PauseListener):
    def __init__(self):
        self.quiesced: list[dict] = []
        self.resumed: list[dict] = []
        self.cv = threading.Condition()

    def on_quiesced(self, pg, info):
        with self.cv:
            self.quiesced.append(info)
            self.cv.notify_all()

    def on_resumed(self, pg, info):
        with self.cv:
            self.resumed.append(info)
            self.cv.notify_all()

    def wait(self, what: str, n: int, timeout: float = 20.0) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: len(getattr(self, what)) >= n, timeout), f"no {what} #{n}"


def test_a_resume_repeated_during_the_rebuild_is_not_kept_for_the_next_pause():
    """The coordinator repeats `resume` in every reply until `rank.resumed`, which comes
    after the rebuild. A repeat taken while the group was being rebuilt used to stay
    pending: at the next pause the rank at once rebuilt the *old* generation at the old
    port while the other ranks met at the new one, and every rank hung."""
    rv0 = Rendezvous("127.0.0.1", free_port())
    pg = ReconfigurablePG(rank=0, size=1, timeout=datetime.timedelta(seconds=20), rendezvous=rv0)
    rec = Recorder()
    pg.listener = rec
    rv1, rv2 = Rendezvous("127.0.0.1", free_port()), Rendezvous("127.0.0.1", free_port())
    build = pg._build

    def build_with_a_repeat(generation, rv):
        assert pg.resume(generation, rv) == ""  # the repeat arrives mid-rebuild: ignored
        build(generation, rv)

    pg._build = build_with_a_repeat
    t = torch.ones(4)
    errors: list[BaseException] = []
    go = threading.Semaphore(0)  # one release per collective: the test decides how far training gets

    def train():
        try:
            for _ in range(6):
                assert go.acquire(timeout=30)
                pg.allreduce([t]).wait()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    assert pg.arm(2, 1)
    worker = threading.Thread(target=train)
    worker.start()
    try:
        for _ in range(3):  # the third stops before it is issued
            go.release()
        rec.wait("quiesced", 1)
        assert rec.quiesced[0]["collectives"] == 2
        assert pg.resume(1, rv1) == "resume"
        rec.wait("resumed", 1)
        assert (pg.generation, pg.rendezvous) == (1, rv1)
        assert pg.resume(1, rv1) == ""  # a late repeat after the rebuild: nothing to do
        assert pg.arm(4, 2)
        for _ in range(2):  # the fourth, then the fifth stops
            go.release()
        rec.wait("quiesced", 2)
        time.sleep(0.2)  # a stale resume would have rebuilt generation 1 by now
        assert rec.quiesced[1]["collectives"] == 4 and len(rec.resumed) == 1, rec.resumed
        assert pg.resume(2, rv2) == "resume"
        rec.wait("resumed", 2)
        assert (pg.generation, pg.rendezvous) == (2, rv2)
        go.release()  # the sixth
    finally:
        for _ in range(6):
            go.release()
        if len(rec.resumed) < 2 and len(rec.quiesced) >= 2:
            pg.resume(2, rv2)
        worker.join(30)
        pg.shutdown()
    assert not errors, errors
    assert not worker.is_alive()
    assert t.tolist() == [1.0] * 4  # world size 1: every all-reduce is the identity


def test_an_unprotected_group_refuses_pauses_and_acknowledges_the_cancel():
    """mark_unprotected (a subgroup was made): the arm it had is dropped and reported,
    every later arm is refused, the coordinator's cancel is adopted once, and
    collectives go on as before."""
    from torchpass.runtime.pg import PGState

    pg = ReconfigurablePG(rank=0, size=1, timeout=datetime.timedelta(seconds=20),
                          rendezvous=Rendezvous("127.0.0.1", free_port()))
    dropped: list = []

    class Listener(Recorder):
        def on_unprotected(self, pg, reason, arm):
            dropped.append((reason, arm))

    pg.listener = Listener()
    try:
        assert pg.state is PGState.RUNNING
        assert pg.arm(5, 1) and pg.state is PGState.ARMED
        assert pg.mark_unprotected("a subgroup")
        assert not pg.mark_unprotected("again")  # once
        assert dropped == [("a subgroup", (5, 1))]
        assert pg.state is PGState.UNPROTECTED and pg.unprotected == "a subgroup"
        assert not pg.arm(7, 2)
        t = torch.ones(2)
        for _ in range(8):  # past the dropped T: never stops
            pg.allreduce([t]).wait()
        assert pg.collectives == 8 and not pg.paused
        assert pg.resume(1, Rendezvous("127.0.0.1", 1)) == "cancelled" and pg.generation == 1
        assert pg.resume(1, Rendezvous("127.0.0.1", 1)) == ""  # a repeat
        assert pg.state is PGState.UNPROTECTED
    finally:
        pg.shutdown()
    assert pg.state is PGState.CLOSED


def _pair() -> dict[int, ReconfigurablePG]:
    """Two ranks of one ReconfigurablePG in this process (threads), on real gloo."""
    rv = Rendezvous("127.0.0.1", free_port())
    pgs: dict[int, ReconfigurablePG] = {}
    errors: list[BaseException] = []

    def make(rank: int) -> None:
        try:
            pgs[rank] = ReconfigurablePG(rank=rank, size=2, timeout=datetime.timedelta(seconds=30), rendezvous=rv)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(pgs) == 2, errors
    return pgs


def test_a_pipeline_groups_sends_and_receives_are_not_kept_for_good():
    """A pipeline group issues only send/recv, whose Works the group keeps for the drain at
    a pause. They were dropped only when a collective was issued on the same group, so a
    pipeline pair kept every Work of the job (and every activation sent: a gloo send's Work
    holds its tensor) until the next pause. Finished ones are dropped as for collectives."""
    pgs = _pair()
    errors: list[BaseException] = []
    got: list[float] = []

    def receive() -> None:
        try:
            for _ in range(200):
                buf = torch.empty(4)
                pgs[1].recv([buf], 0, 0).wait()
                got.append(buf[0].item())
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    rx = threading.Thread(target=receive)
    rx.start()
    try:
        for i in range(200):
            pgs[0].send([torch.full((4,), float(i))], 1, 0).wait()
        rx.join(60)
        assert not errors and got == [float(i) for i in range(200)], errors
        assert len(pgs[0]._works) <= 32 and len(pgs[1]._works) <= 32, (len(pgs[0]._works), len(pgs[1]._works))
    finally:
        for pg in pgs.values():
            pg.shutdown()


def test_tracking_works_that_never_complete_stays_bounded_and_cheap():
    """gloo's reduce_scatter_tensor Works never report completion: the list stays at most
    TRACK_MAX + 1 long, only Works TRACK_MAX / 2 collectives old or more are waited for, and the
    pruning scans each Work a bounded number of times (it once rescanned the whole list at every
    collective once 32 were kept: ~0.25 ms per FSDP collective)."""
    from types import SimpleNamespace

    from torchpass.runtime import pg as pgmod

    checks = {"n": 0}
    waited: list[int] = []

    class NeverDone:
        def __init__(self, i: int):
            self.i = i

        def is_completed(self) -> bool:
            checks["n"] += 1
            return False

        def wait(self) -> bool:
            waited.append(self.i)
            return True

    owner = SimpleNamespace(_works=[], _prune_at=pgmod.TRACK_PRUNE_MIN)
    n = 5000
    for i in range(n):
        pgmod._ForwardingGroup._track(owner, "coll", NeverDone(i))
        assert len(owner._works) <= pgmod.TRACK_MAX + 1
        if waited:
            assert i - waited[-1] >= pgmod.TRACK_MAX // 2
    assert checks["n"] <= 4 * n, checks  # amortized: a few is_completed() per collective, not ~256
    assert waited == list(range(len(waited)))  # the oldest first, each once


def test_a_collectives_buffers_are_freed_a_few_collectives_later():
    """The group keeps each Work for the drain at a pause, and a Work holds its tensors. gloo's
    reduce_scatter Works never report completion, so they were kept until 256 had piled up:
    FSDP2's gradient buffers (a reduce-scatter's output) stayed alive for 128-256
    collectives, and every step's new buffer was fresh memory, faulted in page by page (+17 %
    per HSDP step on the devcluster, bench_overhead --split). Now at most TRACK_MAX + 1 are
    kept: the buffers of a step go a few collectives later."""
    import weakref

    pgs = _pair()
    alive: dict[int, list] = {0: [], 1: []}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            for i in range(100):
                shard = torch.empty(32)  # what a Work keeps: its output
                pgs[rank]._reduce_scatter_base(shard, torch.full((64,), float(i))).wait()
                gathered = torch.empty(64)
                pgs[rank]._allgather_base(gathered, shard).wait()
                alive[rank] += [weakref.ref(shard), weakref.ref(gathered)]
                del shard, gathered
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    peer = threading.Thread(target=run, args=(1,))
    peer.start()
    try:
        run(0)
        peer.join(60)
        assert not errors, errors
        for rank in (0, 1):
            kept = sum(ref() is not None for ref in alive[rank])
            # 200 buffers made; with the old bound of 256 Works all 100 reduce-scatter outputs lived on
            assert kept <= 24, (rank, kept)
    finally:
        for pg in pgs.values():
            pg.shutdown()
