"""Interception without code changes.

``install()`` (called from boot/sitecustomize.py at interpreter start) puts a
``sys.meta_path`` finder in front that wraps the loader of
``torch.distributed``; once that module has executed, ``patch()`` registers
the ``torchpass`` backend and replaces ``init_process_group`` in both
``torch.distributed`` and ``torch.distributed.distributed_c10d``. Torch is
never imported by the hook itself.

The patched ``init_process_group`` resolves rank, world size and the
rendezvous address the way torch would (arguments, ``tcp://`` init method,
RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT; like torch, never SLURM_*), builds
the switchable store itself, and calls the real ``init_process_group`` with
``backend="torchpass"``: torch's own bookkeeping makes the
``ReconfigurablePG`` the default group. Anything it cannot cover (a user
store, ``file://``, ``mpi``/``ucc`` backends, an explicit torchpass-disable)
falls back to the real call with one ``torchpass:`` line on stderr.

torchrun: its workers (``TORCHELASTIC_RUN_ID`` in their environment) are
ranks like any other; their first store is the one their agent serves
(``TORCHELASTIC_USE_AGENT_STORE``), so no worker serves it. In the agent
itself (no rank: it never calls ``init_process_group``) the hook replaces the
c10d rendezvous backend's store client with a ``ReconnectingStore`` that lets
go of its connection while all the agent's workers are held, so that the
whole tree (agent and workers) can be dumped and moved, and connects again
after (``_patch_torchrun_agent``). An agent that serves a store cannot move:
its workers register their node as pinned (control.py).

Subgroups: torch's ``new_group`` (DeviceMesh, new_subgroups, ...) hands the
making of the group to the ``ReconfigurablePG``, which makes a
reconfigurable subgroup (pg.py ``new_group``); the hook passes on the
backend the script asked for, and lets torch make the group natively when
the runtime cannot serve that backend. Native groups (split_group, those)
are watched at registration and mark the job unprotected (pg.py
``mark_unprotected``).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlparse

from torchpass import envnames
from torchpass.runtime import torch_range
from torchpass.runtime.say import say

TARGET = "torch.distributed"
# torchrun's c10d rendezvous backend, loaded in torchrun's agent (elastic's rendezvous registry
# imports it when the agent makes its rendezvous handler).
AGENT_TARGET = "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend"
_lock = threading.Lock()
_installed = False
_patched = False
_pending: "Plan | None" = None
_torch: "torch_range.Verdict | None" = None  # judged once, when torch.distributed (or torchrun's agent) loads
state: dict = {}  # "pg": the ReconfigurablePG, "control": the ControlLink, "fallback": reason


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, then):
        self._inner = inner
        self._then = then

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        try:
            self._then(module)
        except Exception as exc:  # noqa: BLE001 - training must run, unprotected
            say(f"runtime not loaded ({type(exc).__name__}: {exc}); training runs unprotected")


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        then = _AFTER_LOAD.get(fullname)  # asked for every module the process imports
        if then is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader, then)
        return spec


# What runs once a watched module has loaded (late-bound: both functions are defined below).
_AFTER_LOAD = {TARGET: lambda _module: patch(), AGENT_TARGET: lambda module: _patch_torchrun_agent(module)}


def install() -> None:
    """Arrange for patch() to run once torch.distributed has loaded (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    if TARGET in sys.modules:
        patch()
    if AGENT_TARGET in sys.modules:
        _patch_torchrun_agent(sys.modules[AGENT_TARGET])
    sys.meta_path.insert(0, _Finder())


@dataclass
class Plan:
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    use_nccl: bool
    backend: str  # what dist.get_backend() reports: the backend the script asked for
    timeout: object
    pg: object = None
    store: object = None  # the SwitchableStore: the default group's and, through it, every subgroup's
    served: bool = True  # rank 0 serves the first store; False under torchrun, whose agent serves it


RUNTIME_OFF = f"{envnames.RUNTIME}=0"  # the fallback's reason when the runtime is switched off
# torchrun's elastic agent puts this in every worker's environment (torch's LocalElasticAgent):
# True when the worker's rendezvous address is the agent's own store.
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
# torch's switch: worker 0 serves the workers' bootstrap store, not an agent (_patch_torchrun_agent).
NO_SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# How long a fallen-back rank keeps trying to tell the coordinator (it may come up after the ranks).
REPORT_UNPROTECTED_S = 600.0


def _env_int(*names: str) -> int | None:
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return int(v)
    return None


def plan_for(backend, init_method, world_size, rank, store, timeout, device_id=None) -> tuple["Plan | None", str]:
    """Decide whether the runtime can wrap this init; (None, reason) when not."""
    import torch

    if os.environ.get(envnames.RUNTIME, "1") == "0":
        return None, RUNTIME_OFF
    if store is not None:
        return None, "init_process_group was given its own store"
    b = str(backend).lower() if backend is not None else None
    cuda = torch.cuda.is_available()
    if b in (None, "undefined"):
        use_nccl = cuda
    elif b == "gloo":
        use_nccl = False
    elif b == "nccl" or b == "cpu:gloo,cuda:nccl" or b == "cuda:nccl,cpu:gloo":
        use_nccl = True
    else:
        return None, f"backend {backend!r} is not covered (gloo and nccl are)"
    reported = "nccl" if use_nccl else "gloo"
    if b is not None and "," in b:
        reported = b
    elif b in (None, "undefined") and device_id is None:
        reported = "undefined"  # what torch's own init_process_group() reports (it binds backends lazily)
    # Resolved exactly as torch's env:// and tcp:// rendezvous handlers do (arguments, then the
    # URL's query, then for env:// only RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT; never SLURM_*):
    # where torch would fail, the real call runs and fails the same way (do no harm).
    u = urlparse(str(init_method or "env://"))
    if u.scheme not in ("env", "tcp"):
        return None, f"init_method {init_method!r} is not covered (env:// and tcp:// are)"
    query = dict(part.partition("=")[::2] for part in (u.query or "").split("&") if part)
    if rank in (None, -1):
        rank = int(query["rank"]) if "rank" in query else None
    if world_size in (None, -1):
        world_size = int(query["world_size"]) if "world_size" in query else None
    if u.scheme == "tcp":
        addr, port = u.hostname, u.port
    else:
        addr, port = os.environ.get("MASTER_ADDR"), _env_int("MASTER_PORT")
        rank = _env_int("RANK") if rank is None else rank
        world_size = _env_int("WORLD_SIZE") if world_size is None else world_size
    if rank is None or world_size is None or not addr or not port:
        return None, "rank, world size or the rendezvous address unknown (as torch would need them)"
    if timeout is None:
        from torch.distributed.distributed_c10d import default_pg_timeout

        timeout = default_pg_timeout
    # A torchrun worker's rendezvous address is its agent's store: torch's _create_c10d_store makes
    # every worker a client of it (env:// and tcp:// alike), and so does the runtime.
    served = os.environ.get(AGENT_STORE_ENV) != str(True)
    return Plan(int(rank), int(world_size), addr, int(port), use_nccl, reported, timeout, served=served), ""


def torch_verdict() -> "torch_range.Verdict":
    """Whether this process's torch is one the runtime patches (torch_range), judged once; the
    one line it is worth (outside the tested range) is said then."""
    global _torch
    with _lock:
        if _torch is not None:
            return _torch
        _torch = torch_range.of_loaded_torch(os.environ)
    if _torch.support is torch_range.Support.SITE_ALLOWED:
        say(_torch.why)
    elif not _torch.patch:
        state["fallback"] = _torch.why
        say(f"{_torch.why}; training runs unprotected")
        _report_once_initialized(_torch.why)
    return _torch


def _report_once_initialized(why: str, *, limit_s: float = REPORT_UNPROTECTED_S, poll_s: float = 0.5) -> None:
    """Tell the coordinator that the job is unprotected once the script has made its default group
    (torch's own init_process_group, unpatched: the rank's number is known only then). A thread
    looks every ``poll_s``; a script that never makes one registers nothing."""
    if not os.environ.get(envnames.COORDINATOR):
        return

    def wait() -> None:
        import torch.distributed as dist

        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            if dist.is_available() and dist.is_initialized():
                _report_unprotected(why)
                return
            time.sleep(poll_s)

    threading.Thread(target=wait, name="torchpass-unprotected-wait", daemon=True).start()


def _patch_torchrun_agent(backend_module) -> None:
    """In torchrun's agent: a c10d rendezvous store client that can be let go of during a move.

    The agent's tree (the agent and its workers) is what the rank wrapper starts and what moves;
    CRIU dumps no TCP connection. ``_create_tcp_store`` returns a ``ReconnectingStore`` instead of
    a plain client, and an ``AgentHoldWatch`` closes it while every worker of this agent is held
    (they write markers in ``$TORCHPASS_AGENT_DIR``, which this exports to them). An agent that
    hosts the store (the endpoint is this host, or ``is_host``) keeps torch's own server: its node
    cannot move (its workers say so). The workers' bootstrap store is left to worker 0
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, unless set). Only under torchpass
    (``TORCHPASS_COORDINATOR``), not with the runtime switched off.
    """
    if not os.environ.get(envnames.COORDINATOR) or os.environ.get(envnames.RUNTIME, "1") == "0":
        return
    if not torch_verdict().patch:
        return
    orig = getattr(backend_module, "_create_tcp_store", None)
    if orig is None or hasattr(orig, "__torchpass_orig__"):
        return
    # torch's own switch (read at each rendezvous): worker 0 serves its workers' bootstrap store
    # instead of the agent of node rank 0, so that agent's node is not pinned by it; a worker's
    # store closes at the pause and moves with it. The script's own setting wins.
    os.environ.setdefault(NO_SHARED_STORE_ENV, "1")

    @functools.wraps(orig)
    def create_tcp_store(params):
        try:
            from datetime import timedelta

            from torch.distributed import TCPStore
            from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

            from torchpass.runtime.store import ReconnectingStore

            host, port = parse_rendezvous_endpoint(params.endpoint, default_port=backend_module.DEFAULT_PORT)
            is_host = params.get_as_bool("is_host")
            if is_host is None:
                is_host = backend_module._matches_machine_hostname(host)
            timeout = timedelta(seconds=int(params.get_as_int("read_timeout", 60)))
        except Exception as exc:  # noqa: BLE001 - torch's own store: this node cannot move
            say(f"could not look at torchrun's rendezvous ({type(exc).__name__}: {exc}); "
                "this node runs unprotected")
            return orig(params)
        if is_host:
            return orig(params)

        def connect():
            return TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timeout)

        try:
            store = ReconnectingStore(connect)
        except (ValueError, RuntimeError, TimeoutError) as exc:
            # what torch's own _create_tcp_store raises when the client cannot connect
            raise backend_module.RendezvousConnectionError(
                "The connection to the C10d store has failed. See inner exception for details."
            ) from exc
        _watch_agent_holds(store)
        return store

    create_tcp_store.__torchpass_orig__ = orig
    backend_module._create_tcp_store = create_tcp_store


def _watch_agent_holds(store) -> None:
    """The agent's hold markers: a directory of its own, exported to the workers it starts."""
    import atexit
    import shutil
    import tempfile

    from torchpass.runtime.store import AGENT_DIR_ENV, AgentHoldWatch

    try:
        directory = tempfile.mkdtemp(prefix="torchpass-agent-")
        os.environ[AGENT_DIR_ENV] = directory  # torchrun starts its workers with this environment
        atexit.register(shutil.rmtree, directory, True)
        state["agent_watch"] = AgentHoldWatch(store, directory).start()
    except Exception as exc:  # noqa: BLE001 - the workers then hold with the agent still connected
        say(f"cannot watch for held workers ({type(exc).__name__}: {exc}); this node cannot move")


def _creator(store, rank, size, timeout):
    """Backend creator registered for 'torchpass': returns the ReconfigurablePG."""
    from torchpass.runtime.pg import ReconfigurablePG, Rendezvous

    plan = _pending
    if plan is None:
        raise RuntimeError(
            "torchpass: the torchpass backend only serves the default process group "
            "(init_process_group); use a native backend for new_group"
        )
    pg = ReconfigurablePG(
        rank=rank,
        size=size,
        timeout=timeout,
        rendezvous=Rendezvous(plan.master_addr, plan.master_port, plan.served),
        use_nccl=plan.use_nccl,
        store=plan.store,
        on_collective=None,
    )
    plan.pg = pg
    return pg


def _init(orig, backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None, group_name="",
          pg_options=None, device_id=None, **kw):
    global _pending
    call = dict(
        backend=backend, init_method=init_method, timeout=timeout, world_size=world_size, rank=rank,
        store=store, group_name=group_name, pg_options=pg_options, device_id=device_id, **kw,
    )
    try:
        plan, why = plan_for(backend, init_method, world_size, rank, store, timeout, device_id)
    except Exception as exc:  # noqa: BLE001
        plan, why = None, f"{type(exc).__name__}: {exc}"
    if plan is None:
        state["fallback"] = why
        say(f"{why}; training runs unprotected")
        out = orig(**call)
        _report_unprotected(why)
        return out
    from torch.distributed import distributed_c10d as c10d

    with _lock:
        _pending = plan
        try:
            # The creator opens the TCPStore behind this store. Torch keeps it as
            # the default group's store: new_group and DeviceMesh make their
            # groups on it, as they would on the store of a plain init.
            from torchpass.runtime.store import SwitchableStore

            plan.store = SwitchableStore()
            orig(
                backend="torchpass", store=plan.store, rank=plan.rank, world_size=plan.world_size,
                timeout=plan.timeout, group_name=group_name, **kw,
            )
        finally:
            _pending = None
    pg = plan.pg
    # Scripts that check dist.get_backend() see the backend they asked for.
    entry = c10d._world.pg_map.get(pg)
    if entry is not None:
        c10d._world.pg_map[pg] = (plan.backend, entry[1])
    if device_id is not None:
        try:
            pg.bound_device_id = device_id
        except Exception:  # noqa: BLE001
            pass
    state["pg"] = pg
    state.pop("fallback", None)
    _route_new_groups(c10d)
    _watch_groups(c10d)
    _count_steps(pg)
    _start_control(pg, plan)
    return None


def _report_unprotected(why: str) -> None:
    """Tell the job's coordinator that this rank, whose group torch made without the runtime, runs
    unprotected: ``rank.register`` with ``unprotected`` (the coordinator records the job.unprotected
    event once, shows it in status and starts no migration; without it an unregistered rank would
    only keep migrations waiting, silently). From a background thread: the coordinator may not be up
    yet, and training must not wait for it. Nothing is sent when the runtime was switched off."""
    if why == RUNTIME_OFF or not os.environ.get(envnames.COORDINATOR):
        return
    try:
        import socket

        import torch.distributed as dist

        from torchpass.jobauth import signer_from_env

        endpoint = os.environ[envnames.COORDINATOR]
        body = {
            "job_id": int(os.environ[envnames.JOB_ID]), "rank": dist.get_rank(),
            "world_size": dist.get_world_size(), "pid": os.getpid(), "unprotected": why,
            "node": os.environ.get(envnames.NODE) or os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        }
        args = (endpoint if "://" in endpoint else f"tcp://{endpoint}", body, signer_from_env())
        threading.Thread(target=_register_unprotected, args=args, name="torchpass-unprotected",
                         daemon=True).start()
    except Exception as exc:  # noqa: BLE001 - training goes on; only the event is lost
        say(f"could not tell the coordinator that the job is unprotected ({type(exc).__name__}: {exc})")


def _register_unprotected(endpoint: str, body: dict, auth, *, limit_s: float = REPORT_UNPROTECTED_S,
                          timeout_s: float = 2.0, clock=time.monotonic, sleep=time.sleep) -> bool:
    """Send ``body`` as ``rank.register`` until the coordinator answers (backing off up to 5 s,
    for ``limit_s`` at most); True once it took it. Never raises, never prints: the rank's one
    line is said."""
    try:
        import zmq

        from torchpass import zmqio
        from torchpass.errors import UnreachableError
    except Exception:  # noqa: BLE001
        return False
    ctx = zmq.Context()
    try:
        end, wait = clock() + limit_s, 0.5
        while True:
            try:
                zmqio.request(endpoint, "rank.register", body, timeout_s=timeout_s, retries=0, auth=auth,
                              context=ctx)
                return True
            except UnreachableError:
                if clock() + wait > end:
                    return False
                sleep(wait)
                wait = min(2 * wait, 5.0)
            except Exception:  # noqa: BLE001 - refused (another job, a bad credential): nothing to add
                return False
    finally:
        ctx.destroy(linger=0)


def _route_new_groups(c10d) -> None:
    """Pass the backend a ``new_group`` call asks for on to the ReconfigurablePG.

    torch's ``_new_group_with_tag`` hands the group to the default group's
    ``new_group`` without the backend. Nothing, the default group's backend
    or "gloo" (a CPU-only group) are served by a reconfigurable subgroup; any
    other (e.g. "nccl" when the default group is gloo) hides the method for
    the call, so torch makes the group natively as it would without the
    runtime, and the job runs unprotected (``_watch_groups``).
    """
    orig = getattr(c10d, "_new_group_with_tag", None)
    if orig is None or hasattr(orig, "__torchpass_orig__"):
        return

    @functools.wraps(orig)
    def new_group_with_tag(ranks=None, timeout=None, backend=None, *args, **kwargs):
        pg = state.get("pg")
        if pg is None or c10d._world.default_pg is not pg:
            return orig(ranks, timeout, backend, *args, **kwargs)
        try:
            b = str(backend).lower() if backend else ""
            served = b in ("", "undefined", "gloo", c10d._world.pg_map[pg][0]) and (b != "nccl" or pg._use_nccl)
        except Exception as exc:  # noqa: BLE001 - the script's call goes on; torch makes the group natively
            say(f"could not look at the new group's backend ({type(exc).__name__}: {exc})")
            b, served = "", False
        if not served:
            pg.new_group = None  # torch skips a default group whose new_group is not callable
        pg.next_backend = b
        try:
            return orig(ranks, timeout, backend, *args, **kwargs)
        finally:
            pg.next_backend = ""
            if not served:
                del pg.new_group

    new_group_with_tag.__torchpass_orig__ = orig
    c10d._new_group_with_tag = new_group_with_tag


def _watch_groups(c10d) -> None:
    """Mark the default group unprotected as soon as the job registers a native group.

    Every group torch makes (new_group, split_group, shrink_group, DeviceMesh)
    goes through ``_register_pg_in_world``; the wrapper calls it unchanged,
    then asks the current ReconfigurablePG to look (its own reconfigurable
    subgroups do not count). Any error of its own is
    reported and swallowed: the group the script asked for exists either way.
    (``arm`` looks again, for a torch that registers groups another way.)
    """
    orig = getattr(c10d, "_register_pg_in_world", None)
    if orig is None or hasattr(orig, "__torchpass_orig__"):
        return

    @functools.wraps(orig)
    def register(*args, **kwargs):
        out = orig(*args, **kwargs)
        try:
            pg = state.get("pg")
            if pg is not None and c10d._world.default_pg is pg:
                pg.note_native_groups()
        except Exception as exc:  # noqa: BLE001 - the script's group is made; only protection is at stake
            say(f"could not check the new process group ({type(exc).__name__}: {exc}); "
                "pauses will check again")
        return out

    register.__torchpass_orig__ = orig
    c10d._register_pg_in_world = register


def _count_steps(pg) -> None:
    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        from torchpass.runtime import pg as pgmod

        def _step(*_a, **_k):
            pg.step_ended()  # counts the step; pauses here when T is this step's end
            if pgmod.DEBUG:
                say(f"rank {pg.rank()} step {pg.steps} collectives {pg.collectives}")

        register_optimizer_step_post_hook(_step)
    except Exception:  # noqa: BLE001 - progress without steps is still progress
        pass


def _start_control(pg, plan: Plan) -> None:
    if not os.environ.get(envnames.COORDINATOR):
        return
    try:
        from torchpass.runtime.control import ControlLink

        link = ControlLink.from_env(pg)
        if _torch is not None and _torch.support is torch_range.Support.SITE_ALLOWED:
            link.torch_override = _torch.why  # in its rank.register: the coordinator shows it
        link.start()
        state["control"] = link
    except Exception as exc:  # noqa: BLE001 - protection lost, training goes on
        say(f"no link to the coordinator ({type(exc).__name__}: {exc}); the rank cannot be migrated")


def patch() -> None:
    """Register the backend and patch init_process_group (idempotent); nothing for a torch
    outside the tested range (torch_range)."""
    global _patched
    if _patched:
        return
    import torch.distributed as dist

    if not dist.is_available():
        return
    if not torch_verdict().patch:
        return
    from torch.distributed import distributed_c10d as c10d

    if BACKEND_UPPER not in dist.Backend._plugins:
        dist.Backend.register_backend("torchpass", _creator, devices=["cpu", "cuda"])
    orig = c10d.init_process_group

    @functools.wraps(orig)
    def init_process_group(*args, **kwargs):
        names = ("backend", "init_method", "timeout", "world_size", "rank", "store", "group_name", "pg_options",
                 "device_id")
        kwargs.update(zip(names, args))
        return _init(orig, **kwargs)

    init_process_group.__torchpass_orig__ = orig
    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group
    _patched = True


BACKEND_UPPER = "TORCHPASS"


def unpatch() -> None:
    """Undo patch() (tests)."""
    global _patched
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    orig = getattr(c10d.init_process_group, "__torchpass_orig__", None)
    if orig is not None:
        c10d.init_process_group = orig
        dist.init_process_group = orig
    for name in ("_register_pg_in_world", "_new_group_with_tag"):
        orig = getattr(getattr(c10d, name), "__torchpass_orig__", None)
        if orig is not None:
            setattr(c10d, name, orig)
    _patched = False
