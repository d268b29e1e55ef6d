/*
 * context.h - the per-context functions that dispatch.c calls, named
 * tpass_<context>_<hook> (model: NVIDIA pyxis).  Only dispatch.c and the
 * context files include this header; the shared code (common.c, option.c)
 * calls none of them.
 */
#ifndef TPASS_CONTEXT_H
#define TPASS_CONTEXT_H

#include <slurm/spank.h>

/* allocator.c: sbatch, salloc */
int tpass_allocator_init(spank_t sp, int ac, char **av);

/* local.c: srun */
int tpass_local_init(spank_t sp, int ac, char **av);
int tpass_local_user_init(spank_t sp, int ac, char **av);
int tpass_local_exit(spank_t sp, int ac, char **av);

/* remote.c: slurmstepd */
int tpass_remote_init(spank_t sp, int ac, char **av);
int tpass_remote_init_post_opt(spank_t sp, int ac, char **av);
int tpass_remote_user_init(spank_t sp, int ac, char **av);
int tpass_remote_task_init_privileged(spank_t sp, int ac, char **av);
int tpass_remote_task_init(spank_t sp, int ac, char **av);
int tpass_remote_exit(spank_t sp, int ac, char **av);

/* slurmd.c: slurmd */
int tpass_slurmd_init(spank_t sp, int ac, char **av);

/* jobscript.c: prolog/epilog */
int tpass_jobscript_job_epilog(spank_t sp, int ac, char **av);

#endif /* TPASS_CONTEXT_H */
