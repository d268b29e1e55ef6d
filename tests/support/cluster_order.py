"""The order the cluster tier hands its modules to the devclusters: longest first.

pytest-xdist's ``--dist loadfile`` gives each worker the next module in collection order when
it has two tests or fewer left. In file-name order the long modules (test_hard_failure,
test_mesh_shapes, test_slurmctld_outage, test_torchrun) came in the middle and at the end, and
one devcluster finished minutes before the other. Handing out the longest modules first
(longest-processing-time order) leaves only short modules for the end.

The figures are each module's wall seconds (setup, calls, teardown) in CI on a 2-core machine
with two devclusters side by side; ``make test`` prints them again at its end
("cluster modules by wall time") to update this table. A module missing here counts as
``DEFAULT_SECONDS``.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_SECONDS = 60.0

MODULE_SECONDS = {
    "test_hard_failure.py": 320,
    "test_gpu_killed_cluster.py": 292,
    "test_slurmctld_outage.py": 207,
    "test_mesh_shapes.py": 198,
    "test_migration.py": 178,
    "test_failslow_cluster.py": 173,
    "test_second_fault.py": 156,
    "test_spank.py": 152,
    "test_snapshot.py": 151,
    "test_fleet_cluster.py": 121,
    "test_nonroot_migration.py": 118,
    "test_torchrun.py": 105,
    "test_linkpass_cluster.py": 104,
    "test_coordinator_loss.py": 84,
    "test_source_release_cluster.py": 69,
    "test_gres_cluster.py": 68,
    "test_do_no_harm.py": 64,
    "test_subgroup_migration.py": 57,
    "test_full_disk.py": 56,
    "test_cli_scripts.py": 53,
    "test_cgroup_migration.py": 53,
    "test_criu_migration.py": 52,
    "test_app_checkpoint_migration.py": 39,
    "test_admin_drain.py": 37,
    "test_torchpass_job.py": 34,
    "test_dataloader_migration.py": 32,
    "test_tpassd_cluster.py": 24,
    "test_torch_outside_range_job.py": 20,
    "test_sweep_cluster.py": 15,
    "test_multiuser.py": 14,
    "test_devcluster.py": 13,
}


def module_seconds(path: str | Path) -> float:
    return float(MODULE_SECONDS.get(Path(path).name, DEFAULT_SECONDS))


def longest_modules_first(items: list) -> None:
    """Reorder ``items`` in place: cluster modules by descending cost, tests within a module
    in their own order, every other test where it was (after the cluster modules)."""
    def key(indexed):
        index, item = indexed
        path = Path(str(item.fspath))
        if path.parent.name != "integration":
            return (1, 0.0, "", index)
        return (0, -module_seconds(path), str(path), index)

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]
