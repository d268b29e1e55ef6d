/*
 * conf.h - the plugstack.conf arguments of torchpass.so (no Slurm calls).
 */
#ifndef TPASS_CONF_H
#define TPASS_CONF_H

#include <stdbool.h>
#include <stddef.h>

#include "util.h"

#define TPASS_SPARES_LIMIT   64   /* hard upper bound of spares=N */
#define TPASS_POLICY_MAXLEN  32   /* policy=NAME: [A-Za-z0-9_-]{1,32} */
#define TPASS_SNAPSHOT_EVERY_MAX 604800 /* snapshot_every=S: at most a week */

/* Log levels for the plugstack argument log_level= (ordered). */
enum tpass_log_level {
	TPASS_LOG_ERROR = 0,
	TPASS_LOG_INFO = 1,
	TPASS_LOG_VERBOSE = 2,
	TPASS_LOG_DEBUG = 3,
};

/* Parsed plugstack.conf arguments. */
/* the restore agent's program name, beside rank_wrapper by default */
#define TPASS_RESTORE_AGENT_NAME "tpass-restore-agent"

struct tpass_conf {
	char coordinator[TPASS_PATH_MAXLEN];  /* required, absolute */
	char state_dir[TPASS_PATH_MAXLEN];    /* required, absolute */
	char runtime_path[TPASS_PATH_MAXLEN]; /* optional, absolute; "" = none */
	char policy[TPASS_POLICY_MAXLEN + 1]; /* default policy, "default" */
	unsigned max_spares;                  /* 0..64, default 64 */
	enum tpass_log_level log_level;       /* default info */
	unsigned ready_timeout_s;             /* 1..300, default 10 */
	unsigned stop_timeout_s;              /* 1..300, default 5 */
	char rank_wrapper[TPASS_PATH_MAXLEN]; /* optional, absolute; "" = none */
	char restore_agent[TPASS_PATH_MAXLEN]; /* absolute; default
						* tpass-restore-agent beside
						* rank_wrapper */
	unsigned snapshot_every_min_s;        /* snapshot_every's least: 1..604800 s, default 600 */
	char restore_tokens[TPASS_PATH_MAXLEN]; /* absolute; default
					       * TPASS_LAYOUT_RESTORE_TOKENS */
	char gpu_inventory[TPASS_PATH_MAXLEN]; /* optional, absolute; "" = the
						* node's GPUs from NVML (the
						* restore agent's --gpu-inventory) */
	const char *deprecated;     /* a deprecated key given (logged), or NULL */
	const char *deprecated_for; /* ... and its name now */
};

void tpass_conf_defaults(struct tpass_conf *conf);

/*
 * Parse plugstack.conf arguments (argv[0..argc-1], each "key=value").
 * Known keys: coordinator, state_dir, runtime_path, policy, max_spares,
 * log_level, ready_timeout, stop_timeout, rank_wrapper, restore_agent,
 * snapshot_every_min_s, restore_tokens, gpu_inventory; snapshot_every_min is the deprecated
 * name of snapshot_every_min_s (conf->deprecated says so).
 * Unknown or
 * repeated keys, bad values and missing required keys are errors.  On error
 * *conf holds the defaults plus whatever was parsed before the error.
 */
int tpass_conf_parse(int argc, char **argv, struct tpass_conf *conf,
		     char *err, size_t errlen);

/* Is s a valid policy name ([A-Za-z0-9_-]{1,32})? */
bool tpass_policy_valid(const char *s);

#endif /* TPASS_CONF_H */
