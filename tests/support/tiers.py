"""Which tier each test is in, and what each tier may use (tests/conftest.py applies it)."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

TIERS = {
    "pure": "Python in the test's own process: no root, CRIU, munged, Slurm or torch child processes "
            "(make test-fast)",
    "host": "this machine as root: CRIU, a private munged, tpass-init, cgroups, rank processes with torch",
    "cluster": "a devcluster: real Slurm in network namespaces (tests/integration)",
}

# Per-test time limits (pytest-timeout), unless a test sets its own. Pure tests take at most a
# few seconds each. The slowest host test took 17 s on an idle 2-core machine, 3x that under
# load. The slowest cluster test keeps slurmctld away for 180 s and then moves a rank (193 s
# on an idle machine), and two devclusters side by side stretch every test.
TIMEOUT_S = {"pure": 60, "host": 300, "cluster": 600}

# Fixtures that start a host service: a pure test that asks for one is mis-tiered.
HOST_FIXTURES = frozenset({"munge", "cluster", "plugin_built", "job_user", "other_user", "jobs_base", "job_dir"})

# Programs a pure test may not start (by their file name): the host's root tools and services,
# Slurm's commands, and torchpass's own root and rank programs.
HOST_PROGRAMS = frozenset({
    "criu", "munged", "munge", "unmunge", "slurmctld", "slurmd", "slurmstepd", "sbatch", "srun", "salloc",
    "scontrol", "squeue", "scancel", "sinfo", "ip", "nsenter", "unshare", "runuser", "setpriv", "su",
    "useradd", "mount", "torchrun",
})
HOST_PROGRAM_PREFIXES = ("tpass-", "tpassd")
# A Python child's code that loads torch ("import os, torch", "from torch.distributed import ...").
_IMPORTS_TORCH = re.compile(r"\bimport\b[^\n;]*\btorch\b|\bfrom torch\b")

# Unit files in the host tier, with what they need of the host. Every other unit file is pure.
HOST_MODULES = {
    # A private munged (tpassd, the coordinator's job.migrate and job.snapshot, tpassctl).
    "test_auth.py": "a private munged",
    "test_events_migrate_cli.py": "a private munged (job.migrate is munge-authenticated)",
    "test_job_auth.py": "a private munged, credentials of other uids (setpriv)",
    "test_migrate_admin_drain.py": "a private munged and a live tpassd",
    "test_snapshot_server.py": "a private munged",
    "test_tpassd_cli.py": "a private munged and a live tpassd",
    "test_tpassd_control.py": "a private munged and a live tpassd",
    "test_tpassd_daemon.py": "a private munged and a live tpassd, credentials of other uids",
    "test_tpassd_limits.py": "a private munged, a live tpassd, other uids' processes",
    "test_prometheus.py": "a private munged, a live tpassd, credentials of other uids (setpriv)",
    "test_tpassd_ports.py": "a private munged, ports below 1024, runuser",
    "test_tpassd_sweep.py": "a private munged, a live tpassd, root-owned state",
    "test_fleet_spool.py": "root-owned spool directories (safeio refuses others)",
    "test_fleet_probe.py": "the audit probe in a Python child (its source may load torch)",
    "test_tpassd_systemd.py": "a private munged, tpassd programs under setpriv's bounding set",
    "test_wire_fuzz.py": "a private munged and a live tpassd",
    # CRIU, tpass-init, PID and mount namespaces, cgroups: root.
    "test_cgroup_join.py": "cgroup v1 hierarchies (root)",
    "test_gpu_device_cgroup.py": "a cgroup v1 devices cgroup and char devices made with mknod (root)",
    "test_checkpoint_full_disk.py": "a full tmpfs in a mount namespace (root)",
    "test_checkpoint_service.py": "CRIU dumps and restores (root)",
    "test_criu_cgroups.py": "cgroups and CRIU (root)",
    "test_criu_checkpoint.py": "CRIU dumps and restores (root)",
    "test_criu_owner_creds.py": "CRIU as the owner, tpass-init (root)",
    "test_criu_parallel_dumps.py": "tpass-init and CRIU (root)",
    "test_devcluster_cgroups.py": "a mount namespace (root)",
    "test_dump_as_owner.py": "tpassd's dump as root",
    "test_job_manifest.py": "root-owned manifests (chown)",
    "test_job_privacy.py": "plays root and two users",
    "test_privilege_boundary.py": "plays root (tpassd) against a user: namespaces, CRIU, munged",
    "test_rankwrap_abort.py": "the task wrapper's PID namespace (root)",
    "test_rankwrap_transparent.py": "the task wrapper's PID namespace and CRIU (root)",
    "test_restore_agent.py": "root-owned directories, files of another user",
    "test_restore_errors.py": "CRIU",
    "test_restore_init_tree.py": "tpass-init and CRIU (root)",
    "test_restore_races.py": "root's checks raced by a user's processes",
    "test_restore_token.py": "root-owned tokens and manifests",
    "test_snapshot_files.py": "CRIU dumps of a running process",
    "test_snapshot_service.py": "CRIU (root)",
    "test_status_cmd.py": "files of another uid (chown)",
    "test_cli_exit_codes.py": "a root-owned STATE_DIR/jobs, as the SPANK plugin (root) makes it",
    "test_tpass_init.py": "tpass-init, started by root",
    "test_tpassd_golden.py": "tpassd's collectors run criu --version",
    "test_install_system_deps.py": "a private mount namespace over /etc (unshare, root)",
    # The C plugin, built and inspected with the toolchain.
    "test_spank_args.py": "builds the SPANK plugin (make, nm)",
    "test_spank_install.py": "builds and installs the SPANK plugin and tpass-init, root-owned (make install)",
    "test_versions.py": "runs tpassd and the tpass-* programs, builds the SPANK plugin",
    # Rank processes that load torch (gloo process groups, torchrun, the runtime's hook).
    "test_application_checkpoint.py": "rank processes with torch",
    "test_partial_p2p_pause.py": "rank processes with torch",
    "test_runtime_boot.py": "processes that load torch under the runtime's hook",
    "test_runtime_collectives.py": "rank processes with torch",
    "test_runtime_ddp.py": "rank processes with torch (DDP)",
    "test_runtime_fsdp.py": "rank processes with torch (FSDP)",
    "test_runtime_hook_torchrun.py": "torchrun and its ranks",
    "test_runtime_init_forms.py": "rank processes with torch",
    "test_runtime_not_covered.py": "rank processes with torch",
    "test_runtime_subgroups.py": "rank processes with torch",
    "test_subgroup_pause.py": "rank processes with torch",
    "test_torchrun_agent.py": "torch's TCPStore in a child process",
}


def tier_of(item) -> str:
    """A test's own tier marker, else its directory's tier (tests/integration: cluster), else its
    unit file's (HOST_MODULES, else pure)."""
    for tier in TIERS:
        if item.get_closest_marker(tier) is not None:
            return tier
    path = Path(str(item.fspath))
    if "integration" in path.parts:
        return "cluster"
    return "host" if path.name in HOST_MODULES else "pure"


def host_program(args, executable=None) -> str | None:
    """The host program ``args`` (a Popen argv or shell string) starts, or None. A Python child
    that imports torch counts: a rank's process."""
    if isinstance(args, (str, bytes, os.PathLike)):
        words = os.fsdecode(args).split()
    else:
        words = [os.fsdecode(a) for a in args]
    if not words:
        return None
    path = os.fsdecode(executable) if executable else words[0]
    if os.path.isabs(path) and path.startswith(tempfile.gettempdir() + os.sep):
        return None  # a test's own stand-in (an srun script in tmp_path), not the host's program
    first = os.path.basename(path)
    if first in HOST_PROGRAMS or first.startswith(HOST_PROGRAM_PREFIXES):
        return first
    if first.startswith("python") and any(_IMPORTS_TORCH.search(w) for w in words):
        return f"{first} (with torch)"
    return None
