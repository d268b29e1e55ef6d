/*
 * option.c - the --torchpass option: registration, callback, lookup.
 */
#include <string.h>

#include "tpass.h"

static int opt_cb(int val, const char *optarg, int remote);

/* The check of the context that registered the option (see tpass.h). */
static tpass_submit_check submit_check;

static struct spank_option torchpass_option = {
	"torchpass",
	"[spares=N,policy=NAME,snapshot_every=S|off]",
	"[torchpass] Keep this PyTorch job running through node faults by "
	"live-migrating ranks (spares=N hot spare nodes, 0..64, default 0; "
	"policy=NAME; snapshot_every=S seconds between whole-job snapshots; "
	"off disables it for one srun)",
	2, /* optional argument */
	0,
	opt_cb,
};

/*
 * Called by Slurm for --torchpass on the command line and for the value it
 * hands to nested sruns through the environment; possibly more than once.
 * Each call re-parses from the defaults, so calls are idempotent.  In the
 * submit commands a bad value fails the command here, naming the key and the
 * allowed values; in slurmstepd the error is recorded and reported by the
 * remote hooks (values were already checked at submit).
 */
static int opt_cb(int val, const char *optarg, int remote)
{
	(void)val;
	/*
	 * Slurm renders a value-less --torchpass as the string "(null)" when it
	 * hands the option to nested sruns (and to prolog/epilog).
	 */
	if (optarg && !strcmp(optarg, "(null)"))
		optarg = NULL;
	if (tpass_opts_parse(optarg, &tpass.conf, &tpass.opts, tpass.opts_err,
			     sizeof(tpass.opts_err)) < 0) {
		tpass.opts.given = true;
		tpass.opts_bad = true;
		if (!remote) {
			tpass_error("%s", tpass.opts_err);
			return -1;
		}
		return 0;
	}
	tpass.opts_bad = false;
	if (remote || tpass.opts.off)
		return 0;
	if (!tpass.conf_ok) {
		tpass_report_conf_broken();
		return -1;
	}
	/*
	 * Slurm 24.11 ignores a failing init_post_opt in srun and salloc, so
	 * the submit-time checks run here, where a failure stops the command.
	 */
	return submit_check ? submit_check(&tpass.opts) : 0;
}

int tpass_option_register(spank_t sp, tpass_submit_check check)
{
	spank_err_t rc;

	submit_check = check;
	rc = spank_option_register(sp, &torchpass_option);
	if (rc != ESPANK_SUCCESS) {
		tpass_error("cannot register --torchpass: %s",
			    spank_strerror(rc));
		return -1;
	}
	return 0;
}

bool tpass_active(spank_t sp)
{
	if (!tpass.opts.given) {
		char *optarg = NULL;

		if (spank_option_getopt(sp, &torchpass_option, &optarg) ==
		    ESPANK_SUCCESS) {
			opt_cb(0, optarg, 1);
		}
	}
	return tpass.opts.given && !tpass.opts.off;
}
