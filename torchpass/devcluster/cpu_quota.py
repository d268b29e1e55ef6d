"""`tpassctl devcluster slow`: a devcluster node that only slows down, for fail-slow tests and demos.

The node's processes (everything in its network namespace but its tpassd: slurmd, the
slurmstepds, rank wrappers, ranks and their children) move into a CPU cgroup of their own,
``tp-<cluster>-slow-<node>``, whose quota allows PCT % of one CPU: cgroup v2's ``cpu.max``
where the cpu controller is on the v2 hierarchy, else v1's ``cpu.cfs_quota_us``. Processes they
start later inherit it (slurmd's new steps too, so a step started on an idle node later is slow
from its start), and a watcher (``keep_slowing``) moves in the node's other new processes until
the quota is lifted; a restored copy on another node is not slowed (it is not there). Lifting
sets the quota back to unlimited and leaves the processes where they are; ``devcluster down``
removes the cgroups.

The period is 20 ms, not the kernel's default 100 ms: a throttled process runs in bursts of
PCT % of the period, and shorter bursts spread the slowdown evenly over a training step of tens
of milliseconds instead of stalling one step in five.

Roots are parameters, so tests run against a tree under ``tmp_path``.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from torchpass.errors import DevclusterError

CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 20_000


@dataclass(frozen=True)
class CpuHierarchy:
    """Where the cpu controller is: the directory cgroups are made under, and its version."""

    root: Path
    version: int  # 1 or 2

    def quota_file(self, group: Path) -> Path:
        return group / ("cpu.max" if self.version == 2 else "cpu.cfs_quota_us")

    def quota_text(self, pct: int) -> str:
        """The quota file's content for PCT % of one CPU (100 or more: unlimited)."""
        if pct >= 100:
            return f"max {PERIOD_US}" if self.version == 2 else "-1"
        quota = max(1000, PERIOD_US * pct // 100)  # the kernel's least quota is 1 ms
        return f"{quota} {PERIOD_US}" if self.version == 2 else str(quota)


def find_hierarchy(root: Path = CGROUP_ROOT) -> CpuHierarchy:
    """The cpu controller's hierarchy: v2 if the unified hierarchy (at ``root`` or
    ``root/unified``) offers it, else v1's ``root/cpu``."""
    for v2 in (root, root / "unified"):
        controllers = v2 / "cgroup.controllers"
        if controllers.exists() and "cpu" in controllers.read_text().split():
            return CpuHierarchy(v2, 2)
    if (root / "cpu" / "cpu.cfs_quota_us").exists():
        return CpuHierarchy(root / "cpu", 1)
    raise DevclusterError(f"no cpu controller under {root} (neither cgroup v2 cpu.max nor v1 cpu.cfs_quota_us): "
                          "'devcluster slow' needs one")


def group_name(cluster: str, node: str) -> str:
    return f"tp-{cluster}-slow-{node}"


def slow(h: CpuHierarchy, cluster: str, node: str, pids: list[int], pct: int) -> Path:
    """Put ``pids`` under PCT % of one CPU (100: unlimited); the cgroup's path."""
    group = h.root / group_name(cluster, node)
    if h.version == 2:
        control = h.root / "cgroup.subtree_control"
        if "cpu" not in control.read_text().split():
            control.write_text("+cpu")
    group.mkdir(exist_ok=True)
    if h.version == 1:
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
    h.quota_file(group).write_text(h.quota_text(pct))
    for pid in pids:
        try:
            (group / "cgroup.procs").write_text(str(pid))
        except ProcessLookupError:
            pass  # it ended meanwhile
        except OSError as exc:
            if exc.errno != 3:  # ESRCH
                raise
    return group


def keep_slowing(h: CpuHierarchy, group: Path, netns: str, exclude: set[int], interval_s: float = 0.2) -> int:
    """Move the node's new processes (a job step started on an idle node later: not a child of
    anything already slowed) into ``group`` every ``interval_s``, from a process of its own that
    ends once the quota is lifted or the cgroup removed; its pid. A step's first ``interval_s``
    runs at full speed: a Python step takes seconds to start."""
    quota = h.quota_file(group)
    script = ('while [ -e "$1" ] && [ "$(cat "$1")" != "$2" ]; do '
              'for p in $(ip netns pids "$3"); do case " $4 " in *" $p "*) ;; *) echo "$p" > "$5" 2>/dev/null;; '
              'esac; done; sleep "$6"; done')
    proc = subprocess.Popen(["sh", "-c", script, "keep-slowing", str(quota), h.quota_text(100), netns,
                             " ".join(str(p) for p in sorted(exclude)), str(group / "cgroup.procs"), f"{interval_s:g}"],
                            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    return proc.pid


def lift_later(h: CpuHierarchy, group: Path, after_s: float) -> int:
    """Lift the quota of ``group`` after ``after_s`` seconds, from a process of its own (the
    command returns at once); its pid."""
    quota = h.quota_file(group)
    proc = subprocess.Popen(["sh", "-c", f'sleep {after_s:g}; [ -e "$1" ] && echo "$2" > "$1"', "lift",
                             str(quota), h.quota_text(100)],
                            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    return proc.pid


def remove_all(cluster: str, root: Path = CGROUP_ROOT) -> list[Path]:
    """Remove the cluster's slow cgroups (their processes gone); those left behind."""
    try:
        h = find_hierarchy(root)
    except DevclusterError:
        return []
    left = []
    for group in sorted(h.root.glob(f"{group_name(cluster, '')}*")):
        try:
            group.rmdir()
        except OSError:
            left.append(group)
    return left
