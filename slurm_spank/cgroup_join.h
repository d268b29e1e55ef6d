/*
 * tpass-init joins the cgroups of its task (PARENT) once the task has exec'd
 * and Slurm has placed it (tpass_init.c says why).  For each hierarchy of
 * PROC/TASK/cgroup where ours (PROC/self/cgroup) differs, the cgroup is
 * reached through the last mount of that hierarchy in PROC/self/mountinfo
 * whose root is the cgroup or above it, and our pid is written to its
 * cgroup.procs (O_NOFOLLOW).  A path with "/.." (outside our cgroup
 * namespace), or one no mount reaches, is left alone: best effort, the rank
 * runs and tpassd refuses its dump with the reason.  Returns how many
 * cgroup.procs files were written.
 *
 * torchpass/checkpoint/cgroup_join.py is the restore agent's twin, which
 * refuses where this leaves alone; tests/unit/test_cgroup_join_c_agrees.py
 * runs both on the same /proc and compares what they join.  PROC is "/proc"
 * except in that test.
 */
#ifndef TPASS_CGROUP_JOIN_H
#define TPASS_CGROUP_JOIN_H

int tpass_join_cgroups_of(const char *proc, const char *task);

#endif
