/*
 * slurmd.c - slurmd (slurmd context), as root.
 */
#include <slurm/slurm_version.h>

#include "context.h"
#include "tpass.h"

#ifndef TPASS_VERSION
#error "TPASS_VERSION is not defined: build with slurm_spank/Makefile (it passes pyproject.toml's version)"
#endif

/*
 * slurmd context: the admin's log is where a broken configuration shows, and
 * where the Slurm release the plugin was compiled against is said once per
 * slurmd start.  Slurm refuses a plugin of another major.minor release outright;
 * a plugin built for another micro release loads, and this line is how an
 * admin sees that it was not rebuilt at the upgrade.
 */
int tpass_slurmd_init(spank_t sp, int ac, char **av)
{
	char *running = NULL;

	(void)ac;
	(void)av;
	if (spank_get_item(sp, S_SLURM_VERSION, &running) != ESPANK_SUCCESS)
		running = NULL;
	/* One literal with the version in it: `strings torchpass.so` shows it too. */
	tpass_info("torchpass " TPASS_VERSION ", built for Slurm %d.%02d.%d, running in slurmd %s",
		   SLURM_VERSION_MAJOR(SLURM_VERSION_NUMBER),
		   SLURM_VERSION_MINOR(SLURM_VERSION_NUMBER),
		   SLURM_VERSION_MICRO(SLURM_VERSION_NUMBER),
		   running ? running : "(unknown)");
	if (!tpass.conf_ok)
		tpass_error("plugin disabled for --torchpass jobs: %s",
			    tpass.conf_err);
	return 0;
}
