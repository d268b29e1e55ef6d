"""Joining another process's cgroups: the restore agent lands in its restore step's.

Under Slurm's proctrack/cgroup and task/cgroup, slurmstepd places a task in
its step's cgroups from the parent, after the task has forked and run the
SPANK ``task_init_privileged`` hook, and only then lets it exec. What the
hook forks (the root restore agent here, tpass-init in slurm_spank) keeps
the cgroups the task had before: freezer ``.../job_J`` instead of
``.../job_J/step_S``, so ``scontrol listpids`` does not list it, and criu
(``--manage-cgroups=ignore``) would restore the rank there, outside Slurm's
control: not signalled at the step's end, refused by the next dump's
``listpids`` check, not held to the step's CPU set and memory limit.

By the time the agent restores, the task has exec'd the user-side wrapper,
so Slurm has placed it: the agent moves itself into the task's cgroup in
every hierarchy where its own differs, as root, and criu's restored tree is
born there. The C twin for tpass-init is ``join_cgroups_of`` in
slurm_spank/tpass_init.c.

Paths come from the kernel (``/proc/TASK/cgroup``, ``/proc/self/mountinfo``),
never from a file the user writes; a path outside the mount (``..``, as the
kernel shows a cgroup outside our cgroup namespace) is refused.
"""

from __future__ import annotations

import os
from pathlib import Path

from torchpass.checkpoint import pidfds
from torchpass.errors import CheckpointError


def read_cgroup_file(path: Path) -> dict[str, str]:
    """A /proc/PID/cgroup file: hierarchy key ("freezer", "cpu,cpuacct", "name=systemd"; "" for
    cgroup v2) -> cgroup path."""
    out = {}
    for line in path.read_text().splitlines():
        _, ctrls, cgroup = line.split(":", 2)
        out[ctrls] = cgroup
    return out


def cgroup_lines(pid: int | str, proc: str = "/proc") -> dict[str, str]:
    """``pid``'s cgroups (``read_cgroup_file``)."""
    return read_cgroup_file(Path(f"{proc}/{pid}/cgroup"))


def cgroup_mounts(proc: str = "/proc") -> list[tuple[frozenset[str], str, str]]:
    """(super options, mount point, the cgroup path at its root) of every cgroup mount we see;
    cgroup2's options are {""}: its /proc/PID/cgroup line has no controller list."""
    out = []
    for line in Path(f"{proc}/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        opts = frozenset({""}) if tail[0] == "cgroup2" else frozenset(tail[2].split(","))
        out.append((opts, fields[4], fields[3]))
    return out


def _reach(path: str, opts_wanted: frozenset[str],
           mounts: list[tuple[frozenset[str], str, str]]) -> tuple[str, str] | None:
    """(mount point, ``path`` below its root) for the last mount of that hierarchy whose root is
    ``path`` or above it: a later mount hides an earlier one at the same point (the
    devcluster's per-node mounts do). None if no mount reaches it."""
    found = None
    for opts, point, root in mounts:
        if not opts_wanted <= opts or "/.." in root + "/":
            continue
        base = "" if root == "/" else root
        if path == base or path.startswith(base + "/"):
            found = (point, path[len(base):])
    return found


def join_cgroups_of(task: int, proc: str = "/proc", pidfd: int | None = None) -> list[str]:
    """Move this process into ``task``'s cgroup in every hierarchy where ours differs and that
    is mounted here; returns the cgroup.procs files written. CheckpointError (one line) when
    one cannot be joined: the restored rank would run outside Slurm's control.

    ``pidfd``: the task's, held by the caller. /proc/TASK/cgroup is read by number: checked live
    after the read, the task still held its number then, so what was read was its (a task that
    exited could have left its number to a process in another cgroup)."""
    theirs, ours, mounts = cgroup_lines(task, proc), cgroup_lines("self", proc), cgroup_mounts(proc)
    if pidfd is not None and not pidfds.alive(pidfd):
        raise CheckpointError(f"the restore task {task} exited before the restore; restore refused")
    done = []
    for key, path in theirs.items():
        if ours.get(key) == path:
            continue
        wanted = frozenset(key.split(","))
        if not any(wanted <= opts for opts, _, _ in mounts):
            continue  # a hierarchy not mounted here: nothing of ours can be moved in it
        reach = None if "/.." in path + "/" else _reach(path, wanted, mounts)
        if reach is None:
            raise CheckpointError(f"the restore step's cgroup {path} lies outside every mount of its hierarchy "
                                  f"({key or 'cgroup2'}); the restored rank would run outside Slurm's control: "
                                  "restore refused")
        point, rel = reach
        target = Path(point + rel) / "cgroup.procs"
        try:
            fd = os.open(target, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.write(fd, str(os.getpid()).encode())
            finally:
                os.close(fd)
        except OSError as exc:
            raise CheckpointError(f"cannot join the restore step's cgroup {target} ({exc.strerror}); "
                                  "the restored rank would run outside Slurm's control: restore refused") from None
        done.append(str(target))
    return done
