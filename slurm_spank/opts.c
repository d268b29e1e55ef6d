/*
 * opts.c - parse the value of --torchpass (see opts.h).
 */
#include "opts.h"

#include <stdio.h>
#include <string.h>

void tpass_opts_defaults(struct tpass_opts *opts, const struct tpass_conf *conf)
{
	memset(opts, 0, sizeof(*opts));
	opts->given = true;
	opts->spares = 0;
	strcpy(opts->policy, conf && conf->policy[0] ? conf->policy : "default");
}

int tpass_opts_parse(const char *value, const struct tpass_conf *conf,
		     struct tpass_opts *opts, char *err, size_t errlen)
{
	unsigned max = conf ? conf->max_spares : TPASS_SPARES_LIMIT;
	unsigned every_min = conf && conf->snapshot_every_min_s ? conf->snapshot_every_min_s : 1;
	bool seen_spares = false, seen_policy = false, seen_every = false;
	const char *p, *end;

	tpass_opts_defaults(opts, conf);
	if (!value || !*value)
		return 0;
	if (!strcmp(value, "off")) {
		opts->off = true;
		return 0;
	}

	for (p = value;; p = end + 1) {
		const char *eq;
		size_t ilen, klen;
		char val[256];

		end = strchr(p, ',');
		if (!end)
			end = p + strlen(p);
		ilen = (size_t)(end - p);
		if (ilen == 0)
			return tpass_fail(err, errlen,
				    "--torchpass: empty item in '%s'; give comma-separated key=value items: spares=N (0..%u), policy=NAME",
				    value, max);
		eq = memchr(p, '=', ilen);
		klen = eq ? (size_t)(eq - p) : ilen;

		if (klen == 3 && !strncmp(p, "off", 3) && !eq)
			return tpass_fail(err, errlen,
				    "--torchpass: 'off' cannot be combined with other keys; use --torchpass=off alone");

		if (klen == 6 && !strncmp(p, "spares", 6)) {
			if (seen_spares)
				return tpass_fail(err, errlen,
					    "--torchpass: key 'spares' given twice; give it once (spares=N, N in 0..%u)",
					    max);
			seen_spares = true;
			if (!eq)
				return tpass_fail(err, errlen,
					    "--torchpass: key 'spares' needs a value; allowed: spares=N with N an integer 0..%u",
					    max);
			if (tpass_copy_str(val, sizeof(val), eq + 1,
				     ilen - klen - 1) < 0 ||
			    tpass_parse_uint(val, 0, max, &opts->spares) < 0)
				return tpass_fail(err, errlen,
					    "--torchpass: invalid value '%.*s' for key 'spares'; allowed: an integer 0..%u",
					    (int)(ilen - klen - 1) > 64 ? 64 : (int)(ilen - klen - 1),
					    eq + 1, max);
		} else if (klen == 6 && !strncmp(p, "policy", 6)) {
			if (seen_policy)
				return tpass_fail(err, errlen,
					    "--torchpass: key 'policy' given twice; give it once (policy=NAME)");
			seen_policy = true;
			if (!eq)
				return tpass_fail(err, errlen,
					    "--torchpass: key 'policy' needs a value; allowed: policy=NAME with NAME 1-32 characters from [A-Za-z0-9_-]");
			if (tpass_copy_str(val, sizeof(val), eq + 1,
				     ilen - klen - 1) < 0 ||
			    !tpass_policy_valid(val))
				return tpass_fail(err, errlen,
					    "--torchpass: invalid value '%.*s' for key 'policy'; allowed: 1-32 characters from [A-Za-z0-9_-]",
					    (int)(ilen - klen - 1) > 64 ? 64 : (int)(ilen - klen - 1),
					    eq + 1);
			strcpy(opts->policy, val);
		} else if (klen == 14 && !strncmp(p, "snapshot_every", 14)) {
			if (seen_every)
				return tpass_fail(err, errlen,
					    "--torchpass: key 'snapshot_every' given twice; give it once (snapshot_every=SECONDS)");
			seen_every = true;
			if (!eq || tpass_copy_str(val, sizeof(val), eq + 1,
					    ilen - klen - 1) < 0 ||
			    tpass_parse_uint(val, 0, TPASS_SNAPSHOT_EVERY_MAX,
					     &opts->snapshot_every) < 0)
				return tpass_fail(err, errlen,
					    "--torchpass: invalid value '%.*s' for key 'snapshot_every'; allowed: seconds between periodic snapshots, %u..%u (0: the policy's)",
					    eq ? ((int)(ilen - klen - 1) > 64 ? 64 : (int)(ilen - klen - 1)) : 0,
					    eq ? eq + 1 : "", every_min, TPASS_SNAPSHOT_EVERY_MAX);
			if (opts->snapshot_every && opts->snapshot_every < every_min)
				return tpass_fail(err, errlen,
					    "--torchpass: snapshot_every=%u is below this cluster's minimum of %u s (each snapshot pauses every rank and writes its memory); use snapshot_every=%u or more",
					    opts->snapshot_every, every_min, every_min);
		} else {
			return tpass_fail(err, errlen,
				    "--torchpass: unknown key '%.*s'; allowed keys: spares=N (0..%u), policy=NAME ([A-Za-z0-9_-]{1,32}), snapshot_every=SECONDS, or the single word off",
				    (int)klen > 64 ? 64 : (int)klen, p, max);
		}
		if (!*end)
			break;
	}
	return 0;
}

int tpass_opts_format(const struct tpass_opts *opts, char *buf, size_t len)
{
	int n;

	if (opts->off)
		n = snprintf(buf, len, "off");
	else if (opts->snapshot_every)
		n = snprintf(buf, len, "spares=%u,policy=%s,snapshot_every=%u",
			     opts->spares, opts->policy, opts->snapshot_every);
	else
		n = snprintf(buf, len, "spares=%u,policy=%s", opts->spares,
			     opts->policy);
	return (n < 0 || (size_t)n >= len) ? -1 : 0;
}
