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
    "test_hard_failure.py": 343,
    "test_gpu_killed_cluster.py": 270,
    "test_mesh_shapes.py": 243,
    "test_slurmctld_outage.py": 201,
    "test_failslow_cluster.py": 198,
    "test_second_fault.py": 160,
    "test_gres_cluster.py": 150,
    "test_torchrun.py": 128,
    "test_coordinator_loss.py": 103,
    "test_snapshot.py": 91,
    "test_tpassd_cluster.py": 90,
    "test_do_no_harm.py": 82,
    "test_linkpass_cluster.py": 81,
    # measured on this 2-core VM with one devcluster: 30 s (load ~4) to 97 s (load ~8, two audits)
    "test_fleet_cluster.py": 100,
    "test_source_release_cluster.py": 72,
    "test_migration.py": 70,
    "test_nonroot_migration.py": 70,
    "test_cli_scripts.py": 65,
    "test_spank.py": 63,
    "test_subgroup_migration.py": 53,
    "test_cgroup_migration.py": 53,
    "test_app_checkpoint_migration.py": 44,
    "test_admin_drain.py": 38,
    "test_full_disk.py": 38,
    "test_coordinator_scale.py": 22,
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
