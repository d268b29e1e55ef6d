/*
 * common.c - state, logging and the plugstack.conf arguments.
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

/*
 * A line the user must see in sbatch/srun/salloc without -v (what torchpass
 * did to their command: srun starting its step again after a lost node).
 */
void tpass_notice(const char *fmt, ...)
{
	char buf[1024];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	slurm_info("tpass: %s", buf);
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
	else if (tpass.conf.deprecated)
		tpass_info("plugstack.conf: %s is deprecated; name it %s (the same value)",
			   tpass.conf.deprecated, tpass.conf.deprecated_for);
}

void tpass_report_conf_broken(void)
{
	tpass_error("--torchpass is unavailable: the torchpass plugin is misconfigured on this cluster (%s); ask your administrator",
		    tpass.conf_err);
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
