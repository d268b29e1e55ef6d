"""The reconfigurable default process group.

``ReconfigurablePG`` is a Python subclass of ``torch.distributed.ProcessGroup``
that ``init_process_group`` installs as the default group (see hook.py). It
forwards every collective to an *inner* native group (gloo on CPU, plus NCCL
for CUDA tensors when asked for) built for the current *generation* ``g`` on
``PrefixStore(f"gen{g}", switchable_store)``, and returns the inner ``Work``
unchanged. DDP, FSDP and plain ``dist.*`` calls keep the same outer object
while the inner group is torn down and rebuilt.

Counting and pausing: every collective increments ``collectives`` before it
is issued. ``arm(at=T, generation=g)`` makes the thread that is about to issue
collective number ``T + 1`` (that is, with exactly ``T`` issued) stop instead:
it waits for every outstanding Work, meets the other ranks on the store
(everyone has drained), destroys the inner group and closes the store, so the
process holds no socket that belongs to the group. It then reports
"quiesced" and waits for ``resume(g, master_addr, master_port)``, rebuilds
generation ``g`` with a fresh rendezvous and issues the collective it stopped
before. Because every rank issues the same collectives in the same order, all
ranks stop at the same boundary and the math is unchanged (bit-identical).

Point-to-point calls (send/recv) are forwarded and drained but not counted
and never a pause point: they run on subsets of ranks.
"""

from __future__ import annotations

import datetime
import enum
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchpass import envnames
from torchpass.runtime.compute_time import ComputeMeter
from torchpass.runtime.say import say
from torchpass.runtime.store import SwitchableStore, open_tcp_store

BACKEND_NAME = "torchpass"
# A kept Work keeps its output tensor alive: the bounds are small, so that a step's
# buffers go a few collectives later (see _track).
TRACK_PRUNE_MIN = 8  # Works kept before _track first prunes the finished ones
TRACK_MAX = 16  # collective Works kept at most (the oldest are waited for and dropped)


@dataclass(frozen=True)
class Rendezvous:
    master_addr: str
    master_port: int
    # Rank 0 serves the store at this address (every rendezvous the coordinator names). False for
    # the first one of a torchrun worker: its agent serves it (TORCHELASTIC_USE_AGENT_STORE).
    served: bool = True


class CudaBackendFactory:
    """Every CUDA backend of the runtime's groups is made and shut down here, and nowhere else.

    NCCL's communicators must be gone before the CUDA checkpoint of a dump, and be made anew
    after the restore; one factory makes that one place to look at (and the place a test
    replaces with a stand-in, on a machine without CUDA)."""

    def create(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> Any:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)

    def shutdown(self, backend: Any) -> None:
        backend.shutdown()  # destroys its communicators


CUDA_BACKENDS = CudaBackendFactory()


class PauseListener:
    """Callbacks the control link implements (all called from the pausing thread)."""

    def on_quiesced(self, pg: "ReconfigurablePG", info: dict) -> None:  # pragma: no cover - interface
        pass

    def on_resumed(self, pg: "ReconfigurablePG", info: dict) -> None:  # pragma: no cover - interface
        pass

    def on_unprotected(self, pg: "ReconfigurablePG", reason: str,
                       dropped: tuple[int, int] | None) -> None:  # pragma: no cover - interface
        """The group refuses pauses from now on; ``dropped``: the (T, generation) it was armed for."""


def count_sockets(pid: int | str = "self") -> int:
    """Sockets this process holds open, from /proc/<pid>/fd (what CRIU would see)."""
    n = 0
    base = f"/proc/{pid}/fd"
    for fd in os.listdir(base):
        try:
            if os.readlink(f"{base}/{fd}").startswith("socket:"):
                n += 1
        except OSError:
            pass
    return n


def child_sockets(pid: int | str = "self") -> list[tuple[int, int]]:
    """(pid, sockets) of every descendant of ``pid`` that holds a socket (DataLoader workers
    share tensors by passing fds over Unix sockets; helper processes): the tree CRIU dumps."""
    found, todo = [], [str(pid)]
    while todo:
        p = todo.pop()
        try:
            kids = [k for t in os.listdir(f"/proc/{p}/task")
                    for k in open(f"/proc/{p}/task/{t}/children").read().split()]
        except OSError:
            continue
        for k in kids:
            try:
                n = count_sockets(k)
            except OSError:
                continue
            if n:
                found.append((int(k), n))
            todo.append(k)
    return found


def local_address_towards(host: str, port: int) -> str:
    """The local IP address the kernel would use to reach ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port or 9))
        return s.getsockname()[0]


DEBUG = os.environ.get(envnames.DEBUG, "") not in ("", "0")


def data_rails_from_env(environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The node's data interfaces the job was given (TORCHPASS_DATA_RAILS, "rail0,rail1"); () = none."""
    value = (os.environ if environ is None else environ).get(envnames.DATA_RAILS, "")
    return tuple(r.strip() for r in value.split(",") if r.strip())


def interface_present(name: str) -> bool:
    """Whether this network namespace has interface ``name``. Not /sys/class/net: a devcluster
    node shares the host's /sys, which lists the host's interfaces."""
    try:
        socket.if_nametoindex(name)
    except OSError:
        return False
    return True


def _in_backward() -> bool:
    try:
        return torch._C._current_autograd_node() is not None
    except Exception:  # noqa: BLE001
        return False


class PGState(enum.Enum):
    """Where a ReconfigurablePG is in its life cycle (see the class docstring)."""

    RUNNING = "running"  # collectives flow; no pause asked for
    ARMED = "armed"  # a pause at T is asked for; collectives flow until T are issued
    AT_T = "at_t"  # stopped with T issued, group intact: draining, agreeing go / cancel with the others
    DOWN = "down"  # inner group destroyed, store closed (no socket): waiting for resume
    REBUILDING = "rebuilding"  # the resume was taken: building the next generation
    UNPROTECTED = "unprotected"  # the job made a group the runtime cannot move: collectives flow, pauses are refused
    CLOSED = "closed"  # shutdown() / abort(): every later collective raises


# The states in which the rank stands still at T (``paused``), and those in
# which the inner group is gone (re-arms are refused, resumes are rebuilds).
_PAUSED = frozenset({PGState.AT_T, PGState.DOWN, PGState.REBUILDING})
_TORN_DOWN = frozenset({PGState.DOWN, PGState.REBUILDING})


class _ForwardingGroup(dist.ProcessGroup):
    """What the default group and its subgroups share: a Python ProcessGroup
    (the object torch, DDP, FSDP, DTensor and DeviceMesh keep) forwarding every
    call to one *inner* native group that can be destroyed and built again.

    Subclasses decide what happens before a collective (``_before_collective``)
    and where the inner group is built (``_build``).
    """

    def __init__(self, rank: int, size: int, timeout: datetime.timedelta, use_nccl: bool):
        super().__init__(rank, size)
        self._rank = rank
        self._size = size
        self._group_name = ""
        self._group_desc = ""
        self._timeout = timeout
        self._use_nccl = use_nccl
        # The data rails the inner group is built on (gloo); a reroute sets them before a rebuild.
        self.rails: tuple[str, ...] = data_rails_from_env()
        self._inner: dist.ProcessGroup | None = None
        self._cuda_backend: Any = None  # the inner group's CUDA backend (CUDA_BACKENDS made it)
        self._works: list = []
        self._prune_at = TRACK_PRUNE_MIN  # _track prunes when this many Works are kept
        # The rank's compute time per step (compute_time.py): the default group's, shared by its subgroups.
        self.meter: ComputeMeter | None = None

    # -- identity -------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - C++ virtual name
        return BACKEND_NAME

    def getRank(self) -> int:  # noqa: N802
        return self._rank

    def getSize(self) -> int:  # noqa: N802
        return self._size

    # The native ProcessGroup keeps its name on its registered backends; this
    # one has none (they live on the inner group), so it keeps them itself.
    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    # -- the inner group ----------------------------------------------------------
    def _gloo_devices(self, rv: Rendezvous) -> list:
        """One gloo device per data rail in use (gloo spreads the collectives over them, one
        context each), else one on GLOO_SOCKET_IFNAME or the route to the rendezvous host.
        Every rank builds the same list (the same rails, the same order): both ends of every
        pair must agree, so a rail this node lacks is an error, never silently left out."""
        if self.rails:
            self._check_rails()
            return [dist.ProcessGroupGloo.create_device(interface=r) for r in self.rails]
        ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
        if ifname and interface_present(ifname):
            return [dist.ProcessGroupGloo.create_device(interface=ifname)]
        # After a move the interface names and addresses differ: take the
        # address the kernel routes towards the rendezvous host.
        return [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(rv.master_addr, rv.master_port))]

    def _check_rails(self) -> None:
        missing = [r for r in self.rails if not interface_present(r)]
        if missing:
            raise RuntimeError(f"torchpass: data rail(s) {', '.join(missing)} are not interfaces of this node")

    def _make_inner(self, st: dist.Store, rv: Rendezvous) -> None:
        """Build the inner native group on ``st`` (a generation's prefix of the switchable store)."""
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = self._timeout
        opts._devices = self._gloo_devices(rv)
        gloo = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", st), self._rank, self._size, opts)
        inner = dist.ProcessGroup(st, self._rank, self._size)
        if self._use_nccl:
            nccl = CUDA_BACKENDS.create(dist.PrefixStore("cuda/", st), self._rank, self._size, self._timeout)
            self._cuda_backend = nccl
            inner._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
            inner._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
            inner._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, nccl)
        else:
            inner._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
            inner._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        self._inner = inner

    def _drop_inner(self) -> None:
        """Destroy the inner group (its sockets close when the last reference goes); its CUDA
        backend first, through the factory that made it."""
        inner, self._inner = self._inner, None
        cuda, self._cuda_backend = self._cuda_backend, None
        if cuda is not None:
            try:
                CUDA_BACKENDS.shutdown(cuda)
            except Exception:  # noqa: BLE001 - best effort, the refs go anyway
                pass
            del cuda
        if inner is not None:
            try:
                inner.shutdown()  # NCCL: destroys communicators; gloo: nothing
            except Exception:  # noqa: BLE001 - best effort, the refs go anyway
                pass
            del inner

    def _drain(self) -> None:
        """Wait for every Work this rank issued, then drop the references.

        Collectives: ``wait()`` (some gloo collectives return a Work whose
        is_completed() never turns true; waiting a finished collective again
        is harmless), then a CUDA synchronize when NCCL is in use (NCCL's
        wait() only orders streams). Point-to-point: poll is_completed(),
        never a second wait() (gloo p2p Work.wait() twice hangs).
        """
        deadline = time.monotonic() + self._timeout.total_seconds()
        works, self._works = self._works, []
        p2p = [w for kind, w in works if kind == "p2p"]
        for kind, w in works:
            if kind == "coll" and not w.is_completed():
                w.wait()
        if self._use_nccl and torch.cuda.is_available():
            torch.cuda.synchronize()
        while p2p:
            p2p = [w for w in p2p if not w.is_completed()]
            if p2p and time.monotonic() > deadline:
                raise RuntimeError("torchpass: outstanding send/recv did not finish before the pause")
            if p2p:
                time.sleep(0.0005)
        del works, p2p

    def shutdown(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def abort(self) -> None:
        inner = self._inner
        if inner is not None:
            try:
                inner.abort()
            except Exception:  # noqa: BLE001
                pass
        self.shutdown()

    def inner(self) -> dist.ProcessGroup:
        if self._inner is None:
            raise RuntimeError("torchpass: the process group is paused or destroyed")
        return self._inner

    # -- forwarding ----------------------------------------------------------------
    def _before_collective(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def _track(self, kind: str, work) -> None:
        """Keep ``work`` for the drain; the list stays bounded.

        Past TRACK_PRUNE_MIN, finished Works are dropped. A pipeline group
        issues only send/recv, and a gloo send's Work holds its tensor: kept
        for good, every activation sent would stay alive until the next
        pause. Some collective Works never report completion (gloo's
        reduce_scatter_tensor): past TRACK_MAX, the oldest collectives are
        waited for (finished long ago, TRACK_MAX / 2 collectives back at
        least) until half are left. The next prune comes when the list has
        doubled from what this one kept (at most TRACK_MAX + 1): with Works
        that never complete, pruning at every call once 32 were kept cost
        each FSDP collective ~0.25 ms (profiled: 2 % of an HSDP step).

        The bounds are small because a Work holds its output tensor. With 256,
        FSDP2's reduce-scatter outputs lived for 128-256 collectives and every
        step's buffers were fresh memory, faulted in page by page: +17.6 % per
        HSDP step on the devcluster, all of it the runtime's (bench_overhead
        --split). A Work waited for here is at least TRACK_MAX / 2 collectives
        of its group old, so the job has waited for it already or its peers
        have issued it; only a program that leaves 8 collectives of a group
        unwaited while its peers wait for it elsewhere would stall here (128
        before).
        """
        works = self._works
        if len(works) >= self._prune_at:
            works[:] = [kw for kw in works if not kw[1].is_completed()]
            if len(works) > TRACK_MAX:
                while len(works) > TRACK_MAX // 2 and works[0][0] == "coll":
                    works.pop(0)[1].wait()
            self._prune_at = min(TRACK_MAX + 1, max(TRACK_PRUNE_MIN, 2 * len(works)))
        works.append((kind, work))

    def _collective(self, name: str, args, kwargs):
        self._before_collective()
        work = getattr(self._inner, name)(*args, **kwargs)
        self._track("coll", work)
        if self.meter is not None:
            self.meter.issued(work)
        return work

    def _p2p(self, name: str, args, kwargs):
        inner = self._inner
        if inner is None:
            raise RuntimeError("torchpass: point-to-point call while the process group is paused")
        work = getattr(inner, name)(*args, **kwargs)
        self._track("p2p", work)
        return work


class ReconfigurablePG(_ForwardingGroup):
    """The default process group, reconfigurable: one outer object, one inner native group per generation.

    Life cycle (``state``, a PGState; every change under ``_cv``)::

      RUNNING ──arm(T, g)──► ARMED ──T issued──► AT_T ──every rank drained: "go"──► DOWN
       ▲  ▲                   │  ▲                │ │                                 │
       │  └──resume(g): ──────┘  └─"rearm"────────┘ │                           resume(g, A:P)
       │     cancel, adopt g    (a later T came)    │                                 ▼
       ├───────── "cancel" (resume(g) came at T) ───┘                            REBUILDING
       └──────────────── generation g built on the store at A:P ──────────────────────┘
      RUNNING, ARMED ── mark_unprotected(why) ──► UNPROTECTED (arm refused; resume(g): adopt g)
      any state ── shutdown() / abort() ──► CLOSED

    Who moves it: the control thread calls ``arm`` and ``resume`` (commands
    from the coordinator); the training thread, in ``_before_collective`` and
    ``step_ended``, takes ARMED to AT_T when exactly T collectives are issued
    and then runs the whole pause in ``_pause_here``: drain, agree with every
    rank on the store (``_decide``: either every rank tears down or none),
    tear down, report ``on_quiesced``, wait for the resume, rebuild, report
    ``on_resumed``. The control thread never blocks on the group.

    Data beside the state: ``_armed`` = (T, next generation) while ARMED,
    AT_T (it may change there: a re-arm or a cancel, which ``_decide``
    notices), DOWN and REBUILDING; ``_resume`` = the (generation, Rendezvous)
    a resume delivered while AT_T or DOWN, taken by the training thread.
    ``unprotected`` = why the group refuses pauses (hook.py marks it when
    the job registers another process group: new_group, split_group, a
    DeviceMesh): marked in AT_T or later, the pause under way ends first.
    ``arm`` in DOWN/REBUILDING only confirms the pause already under way;
    ``resume`` in REBUILDING (a repeat of the command being carried out) is
    ignored. ``generation`` and ``rendezvous`` name the inner group that is
    (or was last) built; ``collectives`` and ``steps`` only grow.
    """

    def __init__(
        self,
        *,
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        rendezvous: Rendezvous,
        use_nccl: bool = False,
        store: SwitchableStore | None = None,
        generation: int = 0,
        on_collective: Callable[[int], None] | None = None,
    ):
        super().__init__(rank, size, timeout, use_nccl)
        self.store = store if store is not None else SwitchableStore()
        self.generation = generation
        self.rendezvous = rendezvous
        self.collectives = 0
        self.steps = 0  # optimizer steps seen (hook.py counts them)
        # (step, collectives issued when it ended): reported so that the
        # coordinator can put T on a step boundary
        self.boundary: tuple[int, int] = (-1, -1)
        self.listener: PauseListener | None = None
        self.last_reconfigure_s: float | None = None
        # the job's other groups (new_group, DeviceMesh), in the order they were
        # made: the same on every rank, so rebuilding in this order cannot deadlock
        self.subgroups: list[ReconfigurableSubgroup] = []
        # A pipeline over this group alone: step ends count (step_ended). Decided once (None:
        # not yet), at the first step end after the first send/recv on this group (_p2p_at: the
        # count then).
        self.default_p2p: bool | None = None
        self._p2p_at: int | None = None
        self.next_backend = ""  # the backend the script asks new_group for (hook.py sets it for the call)
        self._cv = threading.Condition()
        self._state = PGState.RUNNING
        self._armed: tuple[int, int] | None = None  # (at, generation)
        self._resume: tuple[int, Rendezvous] | None = None
        # The data rails the resume names (a reroute): the rebuild builds the inner groups on them.
        self._resume_rails: tuple[str, ...] | None = None
        self.unprotected: str | None = None  # why pauses are refused (mark_unprotected)
        self._on_collective = on_collective
        self.meter = ComputeMeter()
        self._build(generation, rendezvous)

    @property
    def state(self) -> PGState:
        return self._state

    @property
    def paused(self) -> bool:
        """Stopped at T: waiting for the other ranks, torn down, or rebuilding."""
        return self._state in _PAUSED

    _paused = paused  # the name the tests and older callers read

    @property
    def armed(self) -> tuple[int, int] | None:
        return self._armed

    # -- building and tearing down the inner group -----------------------------
    def _open_store(self, rv: Rendezvous) -> None:
        tcp = open_tcp_store(rv.master_addr, rv.master_port, self._size, self._rank == 0 and rv.served, self._timeout)
        self.store.switch(tcp)

    def _build(self, generation: int, rv: Rendezvous) -> None:
        # This node's own configuration first, before any wait on the others: rank 0 serves the
        # store without waiting for the workers, so a rank 0 that failed after opening it left
        # the others waiting for it to listen until the group's timeout (4 of 10 runs).
        self._check_rails()
        if not self.store.is_open or rv != self.rendezvous:
            self._open_store(rv)
        self.rendezvous = rv
        self._make_inner(dist.PrefixStore(f"gen{generation}", self.store), rv)
        self.generation = generation
        # every rank builds the default group first, then its subgroups in the
        # order they were made (a gloo group waits for all its members)
        for sub in self.subgroups:
            sub._build(generation, rv)

    def _drain_all(self) -> None:
        """Wait for every Work of this group and of every subgroup (the drain before the pause)."""
        self._drain()
        for sub in self.subgroups:
            sub._drain()

    def _decide(self, armed: tuple[int, int]) -> str:
        """Agree with every rank on the pause at T: "go" (tear down), or not.

        Each rank adds itself to ``drained.T``; the last to arrive sets
        ``decision.T`` to "go". A rank whose arm changes while it waits (re-arm
        to a later T, or a cancel) tries to set it to "cancel". The store's
        compare_set makes the first writer win, so either every rank tears
        down or none does. Returns "go", "rearm" or "cancel".
        """
        at = armed[0]
        st = dist.PrefixStore(f"gen{self.generation}/torchpass", self.store)
        key, decision = f"drained.{at}", f"decision.{at}"
        if st.add(key, 1) >= self._size:
            st.compare_set(decision, "", "go")
        deadline = time.monotonic() + self._timeout.total_seconds()
        while True:
            v = st.compare_set(decision, "?", "?")  # read: "?" while undecided
            if v == b"go":
                return "go"
            if v != b"?" or self._armed != armed:
                if v == b"?":
                    v = st.compare_set(decision, "", "cancel")
                    if v == b"go":
                        return "go"
                # cancelled: wait for this rank's own new arm / cancel to arrive
                while self._armed == armed:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"torchpass: pause at {at} was cancelled by another rank, "
                                           "but this rank never got the new command")
                    time.sleep(0.001)
                return "rearm" if self._armed is not None else "cancel"
            if time.monotonic() > deadline:
                raise RuntimeError(f"torchpass: not every rank reached collective {at} of generation "
                                   f"{self.generation} within the timeout")
            time.sleep(0.001)

    def _teardown(self) -> None:
        """Destroy the inner group and close the store: no socket left.

        Called once every rank has drained (``_meet`` on "drained.T").
        """
        for sub in self.subgroups:
            sub._drop_inner()
        self._drop_inner()
        # Only the master (rank 0) serves the store; it may close only after
        # every client has done its last store operation.
        st = dist.PrefixStore(f"gen{self.generation}/torchpass", self.store)
        st.add("left", 1)
        if self._rank == 0:
            deadline = time.monotonic() + self._timeout.total_seconds()
            while st.add("left", 0) < self._size and time.monotonic() < deadline:
                time.sleep(0.001)
        del st
        self.store.close()
        # No gc.collect() here: the inner group and the store are freed by reference
        # counting when the last reference goes (above), which closes their sockets.
        # A full collection cost ~180 ms in a rank with a 10M-parameter model, on
        # every rank, between reaching T and reporting quiesced.

    # -- pause protocol (called from the control thread) ------------------------
    def arm(self, at: int, generation: int) -> bool:
        """Ask to pause with exactly ``at`` collectives issued. False if already past.

        A rank already waiting at an earlier T (the group still intact) may be
        re-armed to a later T: it leaves the wait and runs on to the new T.
        """
        self.note_native_groups()
        self.note_child_sockets()
        with self._cv:
            if self._state in _TORN_DOWN:
                return self._armed == (at, generation)
            if (self._state in (PGState.CLOSED, PGState.UNPROTECTED) or self.collectives > at
                    or generation <= self.generation):
                return False
            self._armed = (at, generation)
            if self._state is PGState.RUNNING:
                self._state = PGState.ARMED
            self._cv.notify_all()
            return True

    def resume(self, generation: int, rendezvous: Rendezvous, rails: tuple[str, ...] | None = None) -> str:
        """Resume as ``generation`` at ``rendezvous`` (``rails``: rebuild the inner groups on these
        data rails, a reroute; None: on the rails in use).

        Returns "resume" (torn down: the pausing thread rebuilds and calls
        listener.on_resumed), "deferred" (stopped at T but not torn down: the
        pausing thread settles with the other ranks whether this is a cancel
        or a rebuild, and calls listener.on_resumed either way),
        "cancelled" (T not reached: nothing to rebuild; the generation number
        is adopted so that every rank keeps the same one) or "" (a repeat, or
        a command that does not apply).
        """
        with self._cv:
            if self._state in _TORN_DOWN:
                # REBUILDING: a repeat of the command being carried out (the
                # coordinator repeats it until rank.resumed, sent after the
                # rebuild). Keeping it made the rank rebuild the old generation
                # at the old port at its next pause while the others met at the new one.
                if self._state is PGState.REBUILDING or generation != self._armed[1]:
                    return ""
                self._resume, self._resume_rails = (generation, rendezvous), rails
                self._cv.notify_all()
                return "resume"
            if self._armed is not None and self._armed[1] == generation:
                self._armed = None
                self._cv.notify_all()
                if self._state is PGState.AT_T:
                    self._resume, self._resume_rails = (generation, rendezvous), rails
                    return "deferred"
                self._state = self._idle_state()
                self.generation = generation
                return "cancelled"
            if self._state is PGState.UNPROTECTED and generation > self.generation:
                # the coordinator's cancel of a pause this rank refused: acknowledge it
                self.generation = generation
                return "cancelled"
            return ""

    def _idle_state(self) -> PGState:
        return PGState.UNPROTECTED if self.unprotected is not None else PGState.RUNNING

    def note_native_groups(self) -> None:
        """Mark the group unprotected if the job registered a native process group besides its own.

        new_group and DeviceMesh come through ``new_group`` below and are
        reconfigurable subgroups. Others (split_group, shrink_group, a group
        whose reconfigurable version could not be made) are native groups with
        their own sockets and their own collectives; pausing alone could leave
        a rank waiting in one of them for a paused peer, and the dump would
        find their sockets.
        """
        if self.unprotected is not None:
            return
        try:
            names = dist.distributed_c10d._world.pg_names
            others = sorted(f"{name} ({g.size()} ranks)" for g, name in list(names.items())
                            if g is not self and not isinstance(g, ReconfigurableSubgroup))
        except Exception:  # noqa: BLE001 - another torch: hook.py still marks on registration
            return
        if others:
            self.mark_unprotected(
                f"the job made native process group(s) {', '.join(others)} besides the default one "
                "(split_group, or a new_group the runtime could not make reconfigurable), which the "
                "runtime cannot move; pauses are refused and training runs as without torchpass")

    def note_child_sockets(self) -> None:
        """Mark the group unprotected if a child process of the rank holds a socket: the dump
        (which takes the rank's whole tree) would refuse it after every rank had paused."""
        if self.unprotected is not None:
            return
        try:
            held = child_sockets()
        except Exception:  # noqa: BLE001 - the dump's own check still refuses
            return
        if held:
            self.mark_unprotected(
                f"its child process(es) {', '.join(f'{p} ({n} socket(s))' for p, n in held)} hold sockets "
                "(DataLoader workers share tensors over Unix sockets), which the move cannot take; "
                "pauses are refused and training runs as without torchpass")

    # -- subgroups -----------------------------------------------------------------
    def new_group(self, ranks, timeout=None, pg_options=None, group_name=None, group_desc=None):
        """Called by torch's ``new_group`` (and so by DeviceMesh, new_subgroups, ...):
        torch 2.13 hands subgroup creation to a default group that has this method,
        then registers what it returns. Returns a ReconfigurableSubgroup (None on a
        rank outside ``ranks``), or, if the runtime fails to make one, the native
        group torch would have made: the job then runs unprotected (do no harm).
        """
        ranks = [int(r) for r in ranks]
        if self._rank not in ranks:
            return None
        timeout = timeout if timeout is not None else self._timeout
        group_desc = group_desc or "undefined"
        # hook.py passes on the backend the script asked for ("gloo" on an NCCL
        # job: a CPU-only group, as torch would make it)
        use_nccl = self._use_nccl and self.next_backend != "gloo"
        try:
            sub = self._new_subgroup(ranks, timeout, group_name, group_desc, use_nccl)
        except Exception as exc:  # noqa: BLE001 - the script gets its group either way
            say(f"rank {self._rank}: could not make group {group_name} reconfigurable "
                f"({type(exc).__name__}: {exc}); it is made as without torchpass")
            return self._native_group(ranks, timeout, group_name, group_desc, use_nccl)
        with self._cv:
            self.subgroups.append(sub)
        return sub

    def _new_subgroup(self, ranks, timeout, group_name, group_desc, use_nccl) -> "ReconfigurableSubgroup":
        if self._state not in (PGState.RUNNING, PGState.ARMED, PGState.UNPROTECTED):
            raise RuntimeError(f"the default group is {self._state.value}")
        return ReconfigurableSubgroup(self, ranks, timeout, group_name, group_desc, use_nccl)

    def _native_group(self, ranks, timeout, group_name, group_desc, use_nccl) -> dist.ProcessGroup:
        """The group torch's ``_new_process_group_helper`` makes, on the same store keys.

        Its members meet only if every one of them falls back here: an error
        of the runtime's own (before any rendezvous) does so on every rank; one
        on a single rank leaves the group's rendezvous to time out, as a rank
        that fails inside torch's own new_group would."""
        rank, size = ranks.index(self._rank), len(ranks)
        prefix = dist.PrefixStore(f"{group_name}/", dist.distributed_c10d._world.pg_map[self][1])
        pg = dist.ProcessGroup(prefix, rank, size)
        gloo = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", prefix), rank, size, timeout=timeout)
        gloo.options.global_ranks_in_group = ranks
        gloo.options.group_name = group_name
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        if use_nccl:
            nccl = CUDA_BACKENDS.create(dist.PrefixStore("cuda/", prefix), rank, size, timeout)
            pg._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
            pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, nccl)
        pg._set_group_name(group_name)
        pg._set_group_desc(group_desc)
        return pg

    def mark_unprotected(self, reason: str) -> bool:
        """Refuse every pause from now on: the job holds a group the runtime cannot move.

        Says so in one ``torchpass: rank R unprotected: ...`` line and tells the
        listener (the control link reports it to the coordinator). An arm not yet
        reached is dropped: this rank never stops at that T, so "go" cannot be
        decided there, and ranks already waiting at T (which may not have made
        the same group) leave on the coordinator's cancel, as from any cancel.
        Returns False if already marked.
        """
        with self._cv:
            if self.unprotected is not None:
                return False
            self.unprotected = reason
            dropped = None
            if self._state is PGState.ARMED:
                dropped, self._armed = self._armed, None
            if self._state in (PGState.RUNNING, PGState.ARMED):
                self._state = PGState.UNPROTECTED
            self._cv.notify_all()
        say(f"rank {self._rank} unprotected: {reason}")
        if self.listener is not None:
            self.listener.on_unprotected(self, reason, dropped)
        return True

    def _before_collective(self) -> None:
        while True:
            with self._cv:
                if self._state is PGState.CLOSED:
                    raise RuntimeError("torchpass: process group was destroyed")
                armed = self._armed
                if armed is None or self.collectives < armed[0]:
                    self.collectives += 1
                    n = self.collectives
                    break
                if self._state is PGState.ARMED:
                    self._state = PGState.AT_T
            self._pause_here(armed)
        if self._on_collective is not None:
            self._on_collective(n)

    def _p2p(self, name: str, args, kwargs):
        if self._p2p_at is None:
            self._p2p_at = self.collectives
        return super()._p2p(name, args, kwargs)

    def step_ended(self) -> None:
        """An optimizer step finished (hook.py; training thread): a pause point.

        When T falls here (exactly T collectives issued, the last one the
        step's final gradient all-reduce) the rank stops now, between two
        steps: DDP has already waited for every bucket, so nothing is in
        flight and the drain is immediate. Otherwise it would stop only at
        the next step's first collective, in the middle of its backward pass,
        after a forward pass and waiting there for the all-reduce it had in
        flight. Either way exactly T collectives are issued, so the ranks
        agree and the math is unchanged.

        A job with subgroups also counts each step end as one event after
        this check (``collectives`` then counts default-group collectives plus
        step ends): its collectives may all run in subgroups (a 2-D mesh,
        HSDP), which are not pause points, so without the step ends the count
        could stand still and no pause would ever be reached. A step end is
        where every subgroup collective of the step has been issued by every
        member, so none of them waits for a paused peer.

        So does a pipeline whose stages talk over the default group alone
        (as torch.distributed.pipelining does when given no group): its count
        would stand still too. It is recognised once, at the first step end
        after the rank's first send/recv on the default group: no
        default-group collective in between. Every stage of such a pipeline
        sends or receives in its first step, so every rank decides the same
        at the same step end. A job whose default group carries collectives
        in every step (DDP, even one whose ranks also send/recv on it) keeps
        counting collectives only, as before, on every rank alike; a job that
        sends between its backward pass and its optimizer step, on some
        ranks only, would decide differently on those ranks: its pause is
        expected to time out and roll back (not tested). The step end is
        past every send/recv the rank issued in the step; the drain waits
        until the peers, still in their own step, have matched them.
        """
        self.meter.step_ended()
        with self._cv:
            self.steps += 1
            if self._p2p_at is not None and self.default_p2p is None:
                self.default_p2p = self.collectives == self._p2p_at
            self.boundary = (self.steps, self.collectives)
        while True:
            with self._cv:
                armed = self._armed
                if self._state not in (PGState.ARMED, PGState.AT_T) or armed is None or self.collectives != armed[0]:
                    if (self.subgroups or self.default_p2p) and self._state is not PGState.CLOSED:
                        self.collectives += 1
                    return
                self._state = PGState.AT_T
            # after a resume (or a cancel) nothing is armed: the loop counts the step end and returns
            self._pause_here(armed, at_step_end=True)

    def _pause_here(self, armed: tuple[int, int], at_step_end: bool = False) -> None:
        at, next_gen = armed
        t0 = time.monotonic()
        self.meter.paused()
        self._drain_all()
        # Every rank has drained collectives < T before anyone destroys its
        # communicator; a re-arm or cancel before that lets every rank go on.
        verdict = self._decide(armed)
        if verdict != "go":
            with self._cv:
                self._state = PGState.ARMED if self._armed is not None else self._idle_state()
                deferred, self._resume, self._resume_rails = self._resume, None, None
                if verdict == "cancel" and deferred is not None:
                    self.generation = deferred[0]
            if verdict == "cancel" and self.listener is not None:
                self.listener.on_resumed(self, {"generation": self.generation, "collectives": self.collectives,
                                                "rebuild_s": 0.0, "cancelled": True})
            return
        with self._cv:
            self._state = PGState.DOWN  # from here on re-arms are refused
            self._armed = armed
        old_gen = self.generation
        self._teardown()
        info = {
            "generation": old_gen,
            "next_generation": next_gen,
            "collectives": self.collectives,
            "drain_s": time.monotonic() - t0,
            "sockets": count_sockets(),
        }
        info["in_backward"] = _in_backward()
        info["at_step_end"] = at_step_end
        if DEBUG:
            say(f"rank {self._rank} paused with {self.collectives} collectives issued"
                 f"{' (in backward)' if info['in_backward'] else ''}{' (at a step end)' if at_step_end else ''},"
                 f" generation {old_gen} -> {next_gen},"
                 f" {info['sockets']} sockets")
        if self.listener is not None:
            self.listener.on_quiesced(self, info)
        with self._cv:
            while self._resume is None:
                # short timed waits: a restored process must not sleep on an
                # absolute deadline of another host's clock for long
                self._cv.wait(0.05)
            generation, rv = self._resume
            rails, self._resume, self._resume_rails = self._resume_rails, None, None
            self._state = PGState.REBUILDING
        if rails is not None:  # a reroute: every rank was told the same rails (both ends must agree)
            self.rails = rails
            for sub in self.subgroups:
                sub.rails = rails
        t1 = time.monotonic()
        if DEBUG:
            say(f"rank {self._rank} rebuilding generation {generation} at {rv.master_addr}:{rv.master_port}")
        self._build(generation, rv)
        with self._cv:
            self._armed = None
            self._state = self._idle_state()
            self._cv.notify_all()  # subgroup collectives of other threads wait for the rebuild
        self.last_reconfigure_s = time.monotonic() - t1
        if DEBUG:
            say(f"rank {self._rank} resumed as generation {generation} in {self.last_reconfigure_s:.3f} s")
        if self.listener is not None:
            self.listener.on_resumed(
                self, {"generation": generation, "collectives": self.collectives, "rebuild_s": self.last_reconfigure_s}
            )

    # -- lifecycle ---------------------------------------------------------------
    def shutdown(self) -> None:
        with self._cv:
            self._state = PGState.CLOSED
            self._cv.notify_all()
        self._works = []
        for sub in list(self.subgroups):
            sub.shutdown()
        self._drop_inner()
        self.store.close()


class ReconfigurableSubgroup(_ForwardingGroup):
    """A group the job made besides the default one (new_group, DeviceMesh), reconfigurable with it.

    The object the script, DeviceMesh, DTensor and FSDP2 hold stays the same;
    its inner native group is destroyed when the default group tears down at
    a pause and built again, as generation g, on
    ``PrefixStore(f"gen{g}/group.{name}", switchable store)`` right after the
    default group's. Its collectives are not counted and are not pause
    points: the default group's count (collectives plus step ends) decides
    where every rank stops, and the drain waits for the subgroup's Works. A
    collective issued while the default group is torn down (another thread)
    waits for the rebuild.
    """

    def __init__(self, parent: ReconfigurablePG, ranks: list[int], timeout: datetime.timedelta,
                 group_name: str, group_desc: str, use_nccl: bool):
        super().__init__(ranks.index(parent.rank()), len(ranks), timeout, use_nccl)
        self.parent = parent
        self.ranks = ranks
        self.meter = parent.meter
        self._group_name = group_name
        self._group_desc = group_desc
        self._closed = False
        self.generation = -1
        self._build(parent.generation, parent.rendezvous)

    def _build(self, generation: int, rv: Rendezvous) -> None:
        if self._closed:
            return
        self._make_inner(dist.PrefixStore(f"gen{generation}/group.{self._group_name}", self.parent.store), rv)
        self.generation = generation

    def _before_collective(self) -> None:
        cv = self.parent._cv
        with cv:
            while self.parent._state in _TORN_DOWN and not self._closed:
                cv.wait(0.05)
        if self._closed or self._inner is None:
            raise RuntimeError("torchpass: process group was destroyed")

    def shutdown(self) -> None:
        """destroy_process_group(group) or of the default group: not rebuilt any more."""
        self._closed = True
        with self.parent._cv:
            if self in self.parent.subgroups:
                self.parent.subgroups.remove(self)
        self._works = []
        self._drop_inner()


def _make_collective(name: str):
    def method(self, *args, **kwargs):
        return self._collective(name, args, kwargs)

    method.__name__ = name
    method.__doc__ = f"Counted, pausable forward of ProcessGroup.{name} to the inner group."
    return method


def _make_p2p(name: str):
    def method(self, *args, **kwargs):
        return self._p2p(name, args, kwargs)

    method.__name__ = name
    return method


# Both the names torch 2.13 calls first and the older fallbacks: a method not
# overridden here would raise "no backend for cpu", never bypass the wrapper.
COLLECTIVES = (
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "allgather_coalesced",
    "all_gather_single",
    "_allgather_base",
    "all_gather_single_coalesced",
    "allgather_into_tensor_coalesced",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced",
    "alltoall",
    "all_to_all_single",
    "alltoall_base",
    "barrier",
    "monitored_barrier",
)
P2P = ("send", "recv", "recv_anysource")

for _n in COLLECTIVES:
    setattr(_ForwardingGroup, _n, _make_collective(_n))
for _n in P2P:
    setattr(_ForwardingGroup, _n, _make_p2p(_n))
del _n
