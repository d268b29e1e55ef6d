/*
 * opts.h - the value of --torchpass[=...] (no Slurm calls).
 */
#ifndef TPASS_OPTS_H
#define TPASS_OPTS_H

#include <stdbool.h>
#include <stddef.h>

#include "conf.h"

/* Parsed value of --torchpass[=...]. */
struct tpass_opts {
	bool given;   /* the option was seen at all */
	bool off;     /* --torchpass=off */
	unsigned spares;
	char policy[TPASS_POLICY_MAXLEN + 1];
	unsigned snapshot_every; /* seconds; 0 = the policy's snapshot_every_s */
};

/* Defaults for --torchpass given without a value (policy from conf). */
void tpass_opts_defaults(struct tpass_opts *opts, const struct tpass_conf *conf);

/*
 * Parse the value of --torchpass.  value == NULL or "" means "defaults".
 * "off" (alone) disables torchpass.  Otherwise a comma-separated list of
 * key=value with keys spares (0..conf->max_spares), policy and snapshot_every
 * (0, or conf->snapshot_every_min_s..TPASS_SNAPSHOT_EVERY_MAX).  Unknown keys,
 * repeated keys, empty items and bad values are errors; the message names
 * the key and the allowed values.  Always starts from the defaults, so
 * calling it twice with the same value gives the same result.
 */
int tpass_opts_parse(const char *value, const struct tpass_conf *conf,
		     struct tpass_opts *opts, char *err, size_t errlen);

/* Canonical value string for opts ("off" or "spares=N,policy=P[,snapshot_every=S]"). */
int tpass_opts_format(const struct tpass_opts *opts, char *buf, size_t len);

#endif /* TPASS_OPTS_H */
