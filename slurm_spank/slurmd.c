/*
 * slurmd.c - slurmd (slurmd context), as root.
 */
#include "context.h"
#include "tpass.h"

/* slurmd context: the admin's log is where a broken configuration shows. */
int tpass_slurmd_init(spank_t sp, int ac, char **av)
{
	(void)sp;
	(void)ac;
	(void)av;
	if (!tpass.conf_ok)
		tpass_error("plugin disabled for --torchpass jobs: %s",
			    tpass.conf_err);
	return 0;
}
