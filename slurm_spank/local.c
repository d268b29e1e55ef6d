/*
 * local.c - srun (local context).
 *
 * srun --torchpass is accepted only inside a job submitted with
 * 'sbatch --torchpass' (that is how every srun in the batch script gets the
 * option: Slurm hands it down in SLURM_SPANK__SLURM_SPANK_OPTION_torchpass_
 * torchpass, and the batch step exported TORCHPASS_JOB_ID).  Outside such a
 * job there is no coordinator, so it is refused.  spares, policy and
 * snapshot_every are per job: a nested srun may repeat them or give
 * --torchpass=off, nothing else.
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
	const char *every = getenv("TORCHPASS_SNAPSHOT_EVERY");
	char mine[64], mine_every[16];

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
	snprintf(mine_every, sizeof(mine_every), "%u", opts->snapshot_every);
	if (every && strcmp(every, mine_every)) {
		tpass_error("srun --torchpass=snapshot_every=%u differs from job %s's snapshot_every=%s: it is set once per job by sbatch; repeat it or use --torchpass=off",
			    opts->snapshot_every, job, every);
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
