"""tpassd's checkpoint request handlers: ``tpassd.snapshot`` and ``tpassd.restore``.

``tpassd.restore`` op=prepare writes the restore token without which the SPANK plugin starts no
root restore agent on this node (torchpass.checkpoint.restore_token), in tpassd.toml's
restore_token_dir.

The mechanism (dump, kill, abort, verify) is torchpass.checkpoint.service;
this module only puts it on tpassd's control server. Who may ask: root or
the job's owner, checked per job by the control server before a request is
queued (tpassd/control.py, "Admission") and again by the service.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from torchpass import envnames
from torchpass.checkpoint import gpu_map
from torchpass.checkpoint.service import CheckpointService
from tpassd.control import USER


def job_state_dir(cfg, environ=os.environ):
    """The jobs' state directory, whose jobs/J/ranks holds the rank records: the plugin's
    state_dir. $TORCHPASS_STATE_DIR of tpassd's own (root's) environment when set (the
    devcluster, whose tpassd keeps its config state_dir per node), else tpassd's state_dir."""
    return environ.get(envnames.STATE_DIR) or cfg.state_dir


def gpu_inventory_of(cfg) -> Callable[[], gpu_map.GpuInventory] | None:
    """The node's GPUs for the dump: tpassd.toml's gpu_inventory file (the devcluster's fake GPUs),
    else NVML where tpassd reads NVML (nvml_provider auto or nvml); None on a node without."""
    if cfg.gpu_inventory is not None:
        return gpu_map.inventory_loader(cfg.gpu_inventory)
    return gpu_map.nvml_inventory if cfg.nvml_provider in ("auto", "nvml") else None


def register(control, cfg, node: str, restore_fault: Callable[[], bool] | None = None,
             kill_fault: Callable[[], bool] | None = None) -> CheckpointService:
    """Add tpassd.snapshot / tpassd.restore to tpassd's control server (authorization is per job)."""
    svc = CheckpointService(cfg.snapshot_dir, node, state_dir=job_state_dir(cfg),
                            criu_binary=cfg.criu_binary or None, restore_fault=restore_fault, kill_fault=kill_fault,
                            restore_tokens=cfg.restore_token_dir,
                            job_owner=control.job_owner)  # the owner the admission looked up (cached)
    inventory = gpu_inventory_of(cfg)
    if inventory is not None:
        svc.settings.gpu_inventory = inventory
        if cfg.gpu_inventory is not None:  # the CUDA path names the same GPUs
            svc.settings.gpu_uuids_by_minor = lambda: inventory().uuids
    control.register("tpassd.snapshot", svc.snapshot, USER)
    control.register("tpassd.restore", svc.restore, USER)
    return svc


__all__ = ["gpu_inventory_of", "job_state_dir", "register"]
