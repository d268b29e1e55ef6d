/*
 * tpass.h - state and services shared by the per-context files of the
 * torchpass plugin.
 *
 * Layout (after NVIDIA pyxis): dispatch.c defines every slurm_spank_* hook
 * and switches on spank_context() into tpass_<context>_<hook>() functions
 * (context.h) that live in allocator.c (sbatch/salloc), local.c (srun),
 * remote.c (slurmstepd), slurmd.c and jobscript.c (prolog/epilog).  The
 * shared code names no context: common.c holds the state, logging and the
 * plugstack configuration, option.c the --torchpass option, whose
 * submit-time check each context hands in when it registers the option.
 */
#ifndef TPASS_H
#define TPASS_H

#include <stdbool.h>
#include <slurm/spank.h>

#include "conf.h"
#include "opts.h"

/* Environment variable Slurm uses to hand our option to nested sruns. */
#define TPASS_SPANK_OPT_ENV "SLURM_SPANK__SLURM_SPANK_OPTION_torchpass_torchpass"

struct tpass_state {
	/* plugstack.conf */
	bool conf_parsed;
	bool conf_ok;
	struct tpass_conf conf;
	char conf_err[TPASS_ERR_MAXLEN];

	/* --torchpass */
	struct tpass_opts opts;     /* opts.given == false: option not used */
	bool opts_bad;
	char opts_err[TPASS_ERR_MAXLEN];
};

extern struct tpass_state tpass;

/* Logging: every line starts with "tpass: ". */
void tpass_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void tpass_info(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void tpass_verbose(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void tpass_debug(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* At Slurm's info level in every context: shown by srun/sbatch without -v. */
void tpass_notice(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/*
 * This node's name: the short host name.  (slurmstepd does not know the
 * Slurm NodeName before the tasks' environment is built, and SLURMD_NODENAME
 * in a step's environment is inherited from the batch script.)
 */
void tpass_node_name(char *buf, size_t len);

/* Parse plugstack arguments once per process (idempotent). */
void tpass_load_conf(int ac, char **av);

/* The one-line reason given to users when the plugin config is broken. */
void tpass_report_conf_broken(void);

/*
 * Submit-time check of a valid, enabled --torchpass, run by the option
 * callback in sbatch/salloc/srun; -1 fails the command (it logs why).
 */
typedef int (*tpass_submit_check)(const struct tpass_opts *opts);

/*
 * Register --torchpass (every context that accepts options).  check is run
 * by the option callback outside slurmstepd (NULL: none).
 */
int tpass_option_register(spank_t sp, tpass_submit_check check);

/*
 * Make sure tpass.opts reflects the option for this process: the option
 * callback normally did it; otherwise ask spank_option_getopt.  Returns
 * true when --torchpass is in effect (given and not "off").
 */
bool tpass_active(spank_t sp);

#endif /* TPASS_H */
