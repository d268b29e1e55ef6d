"""Application restore points: ``torchpass.checkpoint``, the API training code may call.

A job whose process images are too large to snapshot often saves its state
itself, at a step boundary, in the ``torch.distributed.checkpoint`` (DCP)
format::

    import torchpass.checkpoint as tpc

    ckpt = tpc.Checkpointer("/shared/ckpt/run1", keep=2)       # every rank, the same path
    state = {"train": tpc.ModelState(model, opt)}               # DDP, FSDP, or a plain module
    start = ckpt.load(state) or 0                               # None: nothing saved yet
    for step in range(start, steps):
        ...train one step...
        if (step + 1) % 100 == 0:
            ckpt.save(step + 1, state)                          # blocks for the copy only
    ckpt.close()                                                # waits for the last write

``state`` maps names to state dicts or to objects with ``state_dict()`` /
``load_state_dict()`` (DCP's Stateful). A model and its optimizer go in as
``ModelState`` (DCP's ``get_state_dict`` / ``set_state_dict``: a fresh
optimizer has no state to load into until they make one).

What ``save`` does, on every rank, in the calling (training) thread:

1. waits for this rank's previous save to be written, if it is still being
   written (one save in flight: one staged copy of the state in host memory);
2. copies the state dict to host memory: the copy training must wait for,
   since the tensors change at the next step. The host copy is kept between
   saves and copied into (pinned where CUDA is present), as DCP's
   ``BlockingAsyncStager(cache_staged_state_dict=True)`` does: fresh memory
   costs a page fault per page at every save (first touch runs at ~0.7 GB/s
   on the development VM, a warm copy at ~10 GB/s). It costs one copy of the
   state in host memory for the job's life (``keep_host_copy=False``: a fresh
   copy each save, freed after its write);
3. agrees on the save plan with the other ranks: DCP's planner, and one
   gather and one scatter of the plans on the job's process group, exactly
   as ``dcp.save`` / ``dcp.async_save`` plan.

Then a background thread writes this rank's part (DCP's ``FileSystemWriter``,
fsynced), and rank 0's writes DCP's ``.metadata`` once every rank's part is
on disk, then ``torchpass.json`` (step, world size, bytes): a checkpoint
directory with both is complete and readable by plain ``dcp.load`` (with any
number of ranks, as DCP reshards). Under ``--torchpass`` rank 0 then tells
the job's coordinator (event ``checkpoint.completed``).

Why not ``dcp.async_save`` itself: it runs its planning and completion
collectives in its background thread, on a group the training thread also
uses. Under torchpass that is the default group, which pauses at one
collective count on every rank (a background collective would be counted at a
different point on each rank), and whose pause drains every outstanding
collective (a background collective waiting for a peer that has already
paused never completes). Here the background thread runs no collective at
all: the ranks tell rank 0 that their part is written through small files in
the checkpoint directory, which must be shared by every node (as DCP needs
for a checkpoint readable as a whole anyway). (And plain torch 2.13 hangs
when two ``dcp.save`` run at once in threads on one group: saves here never
overlap.)

Pauses (docs/coordinator.md, "Application restore points"): the plan's
collectives are ordinary collectives of the training thread, counted like
any other. A rank about to be dumped (a migration's or a snapshot's held
rank) first waits for its background write to end, so that no checkpoint
file is open in its image; ranks that stay in place do not wait.
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import re
import shutil
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from torchpass.errors import TorchpassError

STEP_DIR = re.compile(r"^step-(\d{9})$")
COMPLETE = "torchpass.json"  # rank 0 writes it last: the checkpoint is complete
METADATA = ".metadata"  # DCP's
RESULTS_DIR = ".torchpass-results"  # each rank's write results, for rank 0's .metadata
FINISH_TIMEOUT_S = 1800.0  # rank 0 waits this long for the other ranks' parts
POLL_S = 0.05


class CheckpointError(TorchpassError):
    """A checkpoint cannot be saved or loaded (the message says what to do)."""


@dataclass(frozen=True)
class Saved:
    """A complete checkpoint: its step and directory."""

    step: int
    path: Path


class ModelState:
    """A model (plain, DDP or FSDP) and its optimizers, as DCP saves and loads them
    (``get_state_dict`` / ``set_state_dict``: parameter names without DDP's ``module.``
    prefix, optimizer state keyed by those names, sharded for FSDP)."""

    def __init__(self, model, optimizers=()):
        self.model = model
        self.optimizers = optimizers

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizers)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizers, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:09d}"


def results_file(step_path: Path, rank: int) -> Path:
    """Where ``rank`` leaves its write results of one save, for rank 0's ``.metadata``."""
    return step_path / RESULTS_DIR / f"{rank}.results"


def complete_checkpoints(root: Path) -> list[Saved]:
    """The complete checkpoints under ``root``, oldest first (``.metadata`` and ``torchpass.json``)."""
    found = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    for e in entries:
        m = STEP_DIR.match(e.name)
        if m and os.path.exists(os.path.join(e.path, METADATA)) and os.path.exists(os.path.join(e.path, COMPLETE)):
            found.append(Saved(int(m.group(1)), Path(e.path)))
    return sorted(found, key=lambda s: s.step)


def _say(text: str) -> None:
    print(f"torchpass: {text}", file=sys.stderr, flush=True)


def _plain_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with every Stateful value (a model, an optimizer) replaced by its state_dict()."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"the state to save must be a dict (got {type(state).__name__}): "
                              "pass e.g. {'model': model, 'optim': optimizer}")
    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _Write:
    """One save's background part on this rank (a thread): write, then (rank 0) finish."""

    def __init__(self, ckpt: "Checkpointer", step: int, path: Path, writer, planner, plan, metadata,
                 blocking_s: float, waited_s: float):
        self.ckpt, self.step, self.path = ckpt, step, path
        self.writer, self.planner, self.plan, self.metadata = writer, planner, plan, metadata
        self.blocking_s, self.waited_s = blocking_s, waited_s
        self.error: str | None = None
        self.write_s = 0.0
        self.thread = threading.Thread(target=self._run, name=f"torchpass-checkpoint-{step}", daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            fut = self.writer.write_data(self.plan, self.planner)
            fut.wait()
            results = fut.value()
            self.write_s = time.monotonic() - t0
            _write_atomically(results_file(self.path, self.ckpt.rank), pickle.dumps(results))
            if self.ckpt.rank == 0:
                self._finish(t0)
        except Exception as exc:  # noqa: BLE001 - a failed checkpoint never takes training down
            self.error = f"{type(exc).__name__}: {exc}"
            _say(f"checkpoint of step {self.step} in {self.path} failed on rank {self.ckpt.rank}: {self.error}; "
                 "training goes on, the previous checkpoint stays the newest")
            if self.ckpt.rank == 0:
                self.ckpt._report("failed", self.step, self.path, error=self.error)
        finally:
            self.planner = self.plan = None  # the staged copy goes with the planner

    def _finish(self, t0: float) -> None:
        """Rank 0: every rank's part written -> DCP's .metadata, then torchpass.json, then retention."""
        world = self.ckpt.world
        deadline = time.monotonic() + self.ckpt.finish_timeout_s
        all_results = []
        for r in range(world):
            f = results_file(self.path, r)
            while not f.exists():
                if time.monotonic() > deadline:
                    raise CheckpointError(f"rank {r} did not write its part within {self.ckpt.finish_timeout_s:g} s")
                time.sleep(POLL_S)
            all_results.append(pickle.loads(f.read_bytes()))
        self.writer.finish(metadata=self.metadata, results=all_results)
        size = sum(e.stat().st_size for e in os.scandir(self.path) if e.is_file())
        total_s = time.monotonic() - t0
        record = {"step": self.step, "world_size": world, "bytes": size, "time": time.time(),
                  "blocking_s": round(self.blocking_s, 4), "write_s": round(total_s, 4)}
        _write_atomically(self.path / COMPLETE, json.dumps(record).encode())
        shutil.rmtree(self.path / RESULTS_DIR, ignore_errors=True)
        removed = self.ckpt._retain()
        self.ckpt._report("completed", self.step, self.path, bytes=size, blocking_s=self.blocking_s,
                          write_s=total_s, waited_s=self.waited_s, removed=removed)


class Checkpointer:
    """Asynchronous DCP checkpoints of one job into ``directory`` (shared by every node).

    Every rank makes one with the same arguments and calls ``save`` / ``load`` at the
    same steps (they plan together). ``keep``: complete checkpoints kept (rank 0 removes
    older ones, and unfinished ones older than the newest complete one).
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 2, process_group=None,
                 finish_timeout_s: float = FINISH_TIMEOUT_S, keep_host_copy: bool = True):
        if keep < 1:
            raise CheckpointError(f"keep={keep}: keep at least 1 checkpoint")
        self.root = Path(directory)
        self.keep = keep
        self.group = process_group
        self.finish_timeout_s = finish_timeout_s
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.world = dist.get_world_size(process_group) if self.distributed else 1
        self._write: _Write | None = None
        self.keep_host_copy = keep_host_copy
        self._host_copy: dict | None = None  # the staged state of the last save, copied into next time
        self.last: dict[str, Any] | None = None  # the last save's figures on this rank (blocking_s, ...)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
        atexit.register(self.close)
        _guard_dumps(self)

    # -- saving ------------------------------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Checkpoint ``state`` as of ``step``: returns once it is copied to host memory and the
        ranks agreed on the plan; the files are written in the background."""
        t0 = time.monotonic()
        self.wait()
        waited_s = time.monotonic() - t0
        path = step_dir(self.root, step)
        staged = self._stage(_plain_state(state))
        if self.rank == 0:
            # What an earlier run of the job left in this step's directory (it died while writing
            # it) goes first: its ranks' results files would pass for this save's. Every other
            # rank writes there only after the plan's collectives, which rank 0 joins after this.
            # The directory itself stays: the other ranks' DCP writers create it before those
            # collectives, and one removed between another rank's mkdir and its check that the
            # directory exists failed that rank's save with FileExistsError, and its training
            # (reproduced with threads; the likely cause of a rank of a plain job, without
            # torchpass, dying in a save in CI on 2026-12-05).
            _empty_dir(path)
            (path / RESULTS_DIR).mkdir(parents=True, exist_ok=True)
        writer = dcp.FileSystemWriter(path, single_file_per_rank=True, sync_files=True, thread_count=1)
        planner = DefaultSavePlanner()
        plan, metadata = self._plan(staged, writer, planner)
        blocking_s = time.monotonic() - t0
        self.last = {"step": step, "blocking_s": blocking_s, "waited_s": waited_s}
        w = _Write(self, step, path, writer, planner, plan, metadata, blocking_s, waited_s)
        self._write = w
        w.thread.start()

    def _stage(self, state: dict) -> dict:
        """A host copy of ``state`` (DCP's own staging helpers; the previous save's write has ended)."""
        if self._host_copy is not None:
            try:
                return _copy_state_dict(state, self._host_copy, type_check=False)
            except Exception:  # noqa: BLE001 - the state's layout changed: stage it afresh
                self._host_copy = None
        staged = _create_cpu_state_dict(state, pin_memory=torch.cuda.is_available())
        staged = _copy_state_dict(state, staged, type_check=False)
        if self.keep_host_copy:
            self._host_copy = staged
        return staged

    def _plan(self, staged: dict, writer, planner):
        """DCP's planning, as dcp.save does it: local plans, gathered to rank 0, global plan scattered."""
        coordinator = self.rank == 0
        planner.set_up_planner(state_dict=staged, storage_meta=writer.storage_meta(), is_coordinator=coordinator)
        writer.set_up_storage_writer(coordinator, rank=self.rank, use_collectives=True)
        local = writer.prepare_local_plan(planner.create_local_plan())
        metadata = None
        if not self.distributed:
            plans, metadata = planner.create_global_plan([local])
            central = writer.prepare_global_plan(plans)[0]
        else:
            gathered = [None] * self.world if coordinator else None
            dist.gather_object(local, gathered, dst=self._global(0), group=self.group)
            scattered = None
            if coordinator:
                plans, metadata = planner.create_global_plan(gathered)
                scattered = writer.prepare_global_plan(plans)
            out = [None]
            dist.scatter_object_list(out, scattered, src=self._global(0), group=self.group)
            central = out[0]
        return planner.finish_plan(central), metadata

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for this rank's save in flight to be written (rank 0: and completed). False if
        it failed or is still running after ``timeout``."""
        w = self._write
        if w is None:
            return True
        w.thread.join(timeout)
        if w.thread.is_alive():
            return False
        self._write = None
        self.last = {**(self.last or {}), "write_s": w.write_s, "error": w.error}
        return w.error is None

    def close(self, tell_timeout_s: float = 5.0) -> None:
        """Wait for the last save, and (rank 0, under torchpass) until the coordinator heard of
        it, at most ``tell_timeout_s`` more (also run at interpreter exit)."""
        self.wait()
        link = _control_link()
        if link is not None and self.rank == 0:
            link.checkpoints_told(tell_timeout_s)

    # -- loading -----------------------------------------------------------------------------
    def latest(self) -> Saved | None:
        """The newest complete checkpoint (rank 0 looks; every rank gets its answer)."""
        found = complete_checkpoints(self.root) if self.rank == 0 else []
        newest = (found[-1].step, str(found[-1].path)) if found else None
        if self.distributed:
            box = [newest]
            dist.broadcast_object_list(box, src=self._global(0), group=self.group)
            newest = box[0]
        return Saved(newest[0], Path(newest[1])) if newest else None

    def load(self, state: Mapping[str, Any]) -> int | None:
        """Load the newest complete checkpoint into ``state`` (in place; models and optimizers
        get load_state_dict). Returns its step, or None when there is none (a fresh start)."""
        saved = self.latest()
        if saved is None:
            return None
        try:
            dcp.load(dict(state), checkpoint_id=saved.path, process_group=self.group)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - one line saying what is wrong
            # (DCP's CheckpointException is a BaseException: it names every rank's failure)
            why = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise CheckpointError(f"cannot load checkpoint {saved.path}: {why}; "
                                  "move that directory aside to start from the one before it") from None
        if self.rank == 0:  # the coordinator numbers the job's steps from here (its relaunch events)
            self._report("loaded", saved.step, saved.path)
        return saved.step

    # -- rank 0: retention, and the coordinator ------------------------------------------------
    def _retain(self) -> list[int]:
        complete = complete_checkpoints(self.root)
        doomed = [s.path for s in complete[:-self.keep]]
        newest = complete[-1].step if complete else -1
        for e in os.scandir(self.root):
            m = STEP_DIR.match(e.name)
            if m and int(m.group(1)) < newest and Path(e.path) not in {s.path for s in complete}:
                doomed.append(Path(e.path))  # an unfinished one older than the newest complete
        for p in doomed:
            shutil.rmtree(p, ignore_errors=True)
        return sorted(int(STEP_DIR.match(p.name).group(1)) for p in doomed)

    def _report(self, outcome: str, step: int, path: Path, **figures) -> None:
        link = _control_link()
        if link is None:
            return
        body = {"outcome": outcome, "step": step, "path": str(path),
                **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in figures.items()}}
        link.report_checkpoint(body)


def _empty_dir(path: Path) -> None:
    """Remove what ``path`` holds (if it exists), not ``path`` itself (a symlink there is removed,
    never followed)."""
    if path.is_symlink():
        path.unlink()
        return
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return
    for e in entries:
        if e.is_dir(follow_symlinks=False):
            shutil.rmtree(e.path, ignore_errors=True)
        else:
            try:
                os.unlink(e.path)
            except FileNotFoundError:
                pass


def _control_link():
    """The rank's link to the coordinator when the torchpass runtime runs, else None."""
    hook = sys.modules.get("torchpass.runtime.hook")
    link = getattr(hook, "state", {}).get("control") if hook is not None else None
    return link if hasattr(link, "report_checkpoint") else None


def _guard_dumps(ckpt: Checkpointer) -> None:
    """A rank about to be dumped waits for ``ckpt``'s write first (no checkpoint file open in its image)."""
    link = _control_link()
    if link is not None:
        link.before_dump.append(lambda: ckpt.wait())


__all__ = ["Checkpointer", "CheckpointError", "ModelState", "Saved", "complete_checkpoints"]
