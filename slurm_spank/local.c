/*
 * local.c - srun (local context).
 *
 * srun --torchpass is accepted only inside a job submitted with
 * 'sbatch --torchpass' (that is how every srun in the batch script gets the
 * option: Slurm hands it down in SLURM_SPANK__SLURM_SPANK_OPTION_torchpass_
 * torchpass, and the batch step exported TORCHPASS_JOB_ID).  Outside such a
 * job there is no coordinator, so it is refused.  spares and policy are per
 * job: a nested srun may repeat them or give --torchpass=off, nothing else.
 * The checks run from the option callback (see allocator.c for why).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "context.h"
#include "tpass.h"

static int local_check(const struct tpass_opts *opts)
{
	const char *job = getenv("SLURM_JOB_ID");
	const char *tjob = getenv("TORCHPASS_JOB_ID");
	const char *spares = getenv("TORCHPASS_SPARES");
	const char *policy = getenv("TORCHPASS_POLICY");
	char mine[64];

	if (!job || !*job) {
		tpass_error("srun --torchpass outside a batch job is not supported: srun would make its own allocation, which has no batch step to run the coordinator; use 'sbatch --torchpass' and call srun in the batch script");
		return -1;
	}
	if (!tjob || strcmp(tjob, job)) {
		tpass_error("srun --torchpass needs a job submitted with 'sbatch --torchpass'; job %s was not (salloc allocations and plain sbatch jobs cannot use it; drop the option or use --torchpass=off)",
			    job);
		return -1;
	}
	snprintf(mine, sizeof(mine), "%u", opts->spares);
	if ((spares && strcmp(spares, mine)) ||
	    (policy && strcmp(policy, opts->policy))) {
		tpass_error("srun --torchpass=spares=%u,policy=%s differs from job %s's spares=%s,policy=%s: spares and policy are set once per job by sbatch; repeat them or use --torchpass=off",
			    opts->spares, opts->policy, job,
			    spares ? spares : "?", policy ? policy : "?");
		return -1;
	}
	return 0;
}

int tpass_local_init(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	return tpass_option_register(sp, local_check);
}
