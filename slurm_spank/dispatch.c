/*
 * dispatch.c - every slurm_spank_* hook of torchpass.so, and nothing else.
 *
 * Each hook switches on spank_context() and calls tpass_<context>_<hook>()
 * (model: NVIDIA pyxis).  Contexts a hook does not need return 0.  Hooks
 * never fail for jobs that do not use --torchpass.  (Loaded as an
 * "optional" plugin, SPANK ignores hook return codes anyway; what fails a
 * --torchpass job is the option callback at submit, or task_init at launch,
 * see remote.c.)
 */
#include "context.h"
#include "tpass.h"

SPANK_PLUGIN(torchpass, 1);

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	tpass_load_conf(ac, av);
	switch (spank_context()) {
	case S_CTX_ALLOCATOR:
		return tpass_allocator_init(sp, ac, av);
	case S_CTX_LOCAL:
		return tpass_local_init(sp, ac, av);
	case S_CTX_REMOTE:
		return tpass_remote_init(sp, ac, av);
	case S_CTX_SLURMD:
		return tpass_slurmd_init(sp, ac, av);
	default:
		return 0;
	}
}

int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
	/* sbatch/salloc/srun check everything in the option callback */
	switch (spank_context()) {
	case S_CTX_REMOTE:
		return tpass_remote_init_post_opt(sp, ac, av);
	default:
		return 0;
	}
}

int slurm_spank_user_init(spank_t sp, int ac, char **av)
{
	switch (spank_context()) {
	case S_CTX_REMOTE:
		return tpass_remote_user_init(sp, ac, av);
	default:
		return 0;
	}
}

int slurm_spank_local_user_init(spank_t sp, int ac, char **av)
{
	switch (spank_context()) {
	case S_CTX_LOCAL:
		return tpass_local_user_init(sp, ac, av);
	default:
		return 0;
	}
}

int slurm_spank_task_init_privileged(spank_t sp, int ac, char **av)
{
	switch (spank_context()) {
	case S_CTX_REMOTE:
		return tpass_remote_task_init_privileged(sp, ac, av);
	default:
		return 0;
	}
}

int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
	switch (spank_context()) {
	case S_CTX_REMOTE:
		return tpass_remote_task_init(sp, ac, av);
	default:
		return 0;
	}
}

int slurm_spank_job_epilog(spank_t sp, int ac, char **av)
{
	switch (spank_context()) {
	case S_CTX_JOB_SCRIPT:
		return tpass_jobscript_job_epilog(sp, ac, av);
	default:
		return 0;
	}
}

int slurm_spank_exit(spank_t sp, int ac, char **av)
{
	switch (spank_context()) {
	case S_CTX_LOCAL:
		return tpass_local_exit(sp, ac, av);
	case S_CTX_REMOTE:
		return tpass_remote_exit(sp, ac, av);
	default:
		return 0;
	}
}
