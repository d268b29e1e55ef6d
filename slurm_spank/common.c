/*
 * common.c - state, logging, plugstack.conf and the --torchpass option.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "tpass.h"

struct tpass_state tpass;

static bool client_context(void)
{
	spank_context_t ctx = spank_context();

	return ctx == S_CTX_ALLOCATOR || ctx == S_CTX_LOCAL;
}

/*
 * Messages up to the configured log_level are logged at Slurm's info level
 * in the daemons (slurmd, slurmstepd, prolog/epilog), so log_level=debug
 * makes them visible without raising the whole daemon's verbosity.  In
 * sbatch/salloc/srun they only appear with -v, so a --torchpass job prints
 * nothing unless something is wrong.
 */
static void vlog(enum tpass_log_level level, const char *fmt, va_list ap)
{
	char buf[1024];

	if (tpass.conf_parsed && level > tpass.conf.log_level &&
	    level != TPASS_LOG_ERROR)
		return;
	vsnprintf(buf, sizeof(buf), fmt, ap);
	if (level == TPASS_LOG_ERROR)
		slurm_error("tpass: %s", buf);
	else if (client_context())
		slurm_verbose("tpass: %s", buf);
	else
		slurm_info("tpass: %s", buf);
}

#define DEFINE_LOG(name, level)                        \
	void name(const char *fmt, ...)                \
	{                                              \
		va_list ap;                            \
		va_start(ap, fmt);                     \
		vlog(level, fmt, ap);                  \
		va_end(ap);                            \
	}

DEFINE_LOG(tpass_error, TPASS_LOG_ERROR)
DEFINE_LOG(tpass_info, TPASS_LOG_INFO)
DEFINE_LOG(tpass_verbose, TPASS_LOG_VERBOSE)
DEFINE_LOG(tpass_debug, TPASS_LOG_DEBUG)

void tpass_load_conf(int ac, char **av)
{
	if (tpass.conf_parsed)
		return;
	tpass.conf_ok = tpass_conf_parse(ac, av, &tpass.conf, tpass.conf_err,
					 sizeof(tpass.conf_err)) == 0;
	tpass.conf_parsed = true;
	if (!tpass.conf_ok)
		tpass.conf.log_level = TPASS_LOG_INFO;
}

void tpass_report_conf_broken(void)
{
	tpass_error("--torchpass is unavailable: the torchpass plugin is misconfigured on this cluster (%s); ask your administrator",
		    tpass.conf_err);
}

static int opt_cb(int val, const char *optarg, int remote);

static struct spank_option torchpass_option = {
	"torchpass",
	"[spares=N,policy=NAME|off]",
	"[torchpass] Keep this PyTorch job running through node faults by "
	"live-migrating ranks (spares=N hot spare nodes, 0..64, default 0; "
	"policy=NAME; off disables it for one srun)",
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
	switch (spank_context()) {
	case S_CTX_ALLOCATOR:
		return tpass_allocator_check(&tpass.opts);
	case S_CTX_LOCAL:
		return tpass_local_check(&tpass.opts);
	default:
		return 0;
	}
}

int tpass_register_option(spank_t sp)
{
	spank_err_t rc = spank_option_register(sp, &torchpass_option);

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

void tpass_node_name(char *buf, size_t len)
{
	char *dot;

	if (gethostname(buf, len) < 0 || !buf[0]) {
		snprintf(buf, len, "unknown");
		return;
	}
	buf[len - 1] = '\0';
	dot = strchr(buf, '.');
	if (dot)
		*dot = '\0';
}
