/*
 * args.h - pure parsing for the torchpass SPANK plugin.
 *
 * Nothing in here calls Slurm: the option value of --torchpass, the
 * plugstack.conf arguments, Slurm host lists and SLURM_TASKS_PER_NODE are
 * parsed into plain structs so that tests/test_args.c can check them without
 * a cluster.  Every parse function returns 0 on success and -1 on error, with
 * one human-readable line (no "tpass: " prefix, no newline) in err.
 */
#ifndef TPASS_ARGS_H
#define TPASS_ARGS_H

#include <stdbool.h>
#include <stddef.h>

#define TPASS_SPARES_LIMIT   64   /* hard upper bound of spares=N */
#define TPASS_POLICY_MAXLEN  32   /* policy=NAME: [A-Za-z0-9_-]{1,32} */
#define TPASS_PATH_MAXLEN    1024
#define TPASS_ERR_MAXLEN     512

/* Log levels for the plugstack argument log_level= (ordered). */
enum tpass_log_level {
	TPASS_LOG_ERROR = 0,
	TPASS_LOG_INFO = 1,
	TPASS_LOG_VERBOSE = 2,
	TPASS_LOG_DEBUG = 3,
};

/* Parsed plugstack.conf arguments. */
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
};

/* Parsed value of --torchpass[=...]. */
struct tpass_opts {
	bool given;   /* the option was seen at all */
	bool off;     /* --torchpass=off */
	unsigned spares;
	char policy[TPASS_POLICY_MAXLEN + 1];
};

void tpass_conf_defaults(struct tpass_conf *conf);

/*
 * Parse plugstack.conf arguments (argv[0..argc-1], each "key=value").
 * Known keys: coordinator, state_dir, runtime_path, policy, max_spares,
 * log_level, ready_timeout, stop_timeout, rank_wrapper.  Unknown or repeated keys, bad
 * values and missing required keys are errors.  On error *conf holds the
 * defaults plus whatever was parsed before the error.
 */
int tpass_conf_parse(int argc, char **argv, struct tpass_conf *conf,
		     char *err, size_t errlen);

/* Defaults for --torchpass given without a value (policy from conf). */
void tpass_opts_defaults(struct tpass_opts *opts, const struct tpass_conf *conf);

/*
 * Parse the value of --torchpass.  value == NULL or "" means "defaults".
 * "off" (alone) disables torchpass.  Otherwise a comma-separated list of
 * key=value with keys spares (0..conf->max_spares) and policy.  Unknown keys,
 * repeated keys, empty items and bad values are errors; the message names
 * the key and the allowed values.  Always starts from the defaults, so
 * calling it twice with the same value gives the same result.
 */
int tpass_opts_parse(const char *value, const struct tpass_conf *conf,
		     struct tpass_opts *opts, char *err, size_t errlen);

/* Canonical value string for opts ("off" or "spares=N,policy=P"). */
int tpass_opts_format(const struct tpass_opts *opts, char *buf, size_t len);

/* Strict unsigned decimal parse in [min, max]; no sign, no spaces. */
int tpass_parse_uint(const char *s, unsigned min, unsigned max, unsigned *out);

/* Is s a valid policy name ([A-Za-z0-9_-]{1,32})? */
bool tpass_policy_valid(const char *s);

/*
 * Slurm host lists.  tpass_hostlist_expand turns "a[1-3,05],b" into a
 * malloc'ed array of malloc'ed names; free with tpass_hostlist_free.
 * Supports one bracket group per host expression (what Slurm produces for
 * flat node names), zero padding taken from the range's first number.
 */
int tpass_hostlist_expand(const char *list, char ***hosts, size_t *count,
			  char *err, size_t errlen);
void tpass_hostlist_free(char **hosts, size_t count);

/* Join hosts[from..to-1] with commas into buf. */
int tpass_hostlist_join(char **hosts, size_t from, size_t to, char *buf,
			size_t len);

/*
 * Sum of tasks on the first `nodes` nodes of a SLURM_TASKS_PER_NODE value
 * such as "2(x3),1".  Errors if the string covers fewer nodes.
 */
int tpass_tasks_on_first_nodes(const char *tasks_per_node, size_t nodes,
			       unsigned long *out, char *err, size_t errlen);
/* Same, also storing each of the first `nodes` counts in counts[] (if set). */
int tpass_tasks_per_node(const char *tasks_per_node, size_t nodes,
			 unsigned long *counts, unsigned long *sum, char *err,
			 size_t errlen);

/*
 * PYTHONPATH handling for the runtime path.  tpass_pythonpath_prepend writes
 * "runtime:old" (or "runtime" when old is NULL/empty) into buf, without
 * adding runtime a second time if it is already the first entry.
 * tpass_pythonpath_strip removes every entry equal to runtime.
 */
int tpass_pythonpath_prepend(const char *old, const char *runtime, char *buf,
			     size_t len);
int tpass_pythonpath_strip(const char *old, const char *runtime, char *buf,
			   size_t len);

/* Parse the first line written by the coordinator: "tcp://HOST:PORT". */
int tpass_ready_line_valid(const char *line, char *err, size_t errlen);

#endif /* TPASS_ARGS_H */
