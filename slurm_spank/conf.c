/*
 * conf.c - parse the plugstack.conf arguments (see conf.h).
 *
 * Every key is one entry of conf_keys[]: its name, its parser, the field it
 * fills and what the allowed-values message says.  Keys are matched by name.
 */
#include "conf.h"
#include "layout.h"

#include <ctype.h>
#include <stdio.h>
#include <string.h>

bool tpass_policy_valid(const char *s)
{
	size_t n = 0;

	if (!s)
		return false;
	for (; s[n]; n++) {
		unsigned char c = (unsigned char)s[n];
		if (!(isascii(c) && (isalnum(c) || c == '_' || c == '-')))
			return false;
		if (n >= TPASS_POLICY_MAXLEN)
			return false;
	}
	return n >= 1;
}

void tpass_conf_defaults(struct tpass_conf *conf)
{
	memset(conf, 0, sizeof(*conf));
	strcpy(conf->policy, "default");
	conf->max_spares = TPASS_SPARES_LIMIT;
	conf->log_level = TPASS_LOG_INFO;
	conf->ready_timeout_s = 10;
	conf->stop_timeout_s = 5;
	/* A periodic snapshot pauses every rank and writes every rank's memory to
	 * the shared snapshot directory: more often than this is the admin's call. */
	conf->snapshot_every_min_s = 600;
	strcpy(conf->restore_tokens, TPASS_LAYOUT_RESTORE_TOKENS);
}

struct conf_key;

/* Store val into the field of conf named by key; -1 with err on a bad value. */
typedef int (*conf_parser)(const struct conf_key *key, const char *val,
			   void *field, char *err, size_t errlen);

struct conf_key {
	const char *name;
	conf_parser parse;
	size_t offset;       /* of the field in struct tpass_conf */
	size_t size;         /* of the field */
	bool required;
	unsigned min, max;   /* unsigned keys */
	const char *usage;   /* for the allowed-keys message */
	const char *allowed; /* for the invalid-value message */
	const char *renamed; /* a deprecated name: the key it is now (not listed) */
};

static int parse_abs_path(const struct conf_key *key, const char *val,
			  void *field, char *err, size_t errlen)
{
	if (val[0] != '/')
		return tpass_fail(err, errlen,
				  "plugstack.conf: %s='%s' must be an absolute path",
				  key->name, val);
	if (tpass_copy_str(field, key->size, val, strlen(val)) < 0)
		return tpass_fail(err, errlen,
				  "plugstack.conf: %s is longer than %zu bytes",
				  key->name, key->size - 1);
	return 0;
}

/* An absolute path that can be one PYTHONPATH entry. */
static int parse_search_path(const struct conf_key *key, const char *val,
			     void *field, char *err, size_t errlen)
{
	if (parse_abs_path(key, val, field, err, errlen) < 0)
		return -1;
	if (strchr(val, ':'))
		return tpass_fail(err, errlen,
				  "plugstack.conf: %s='%s' must not contain ':'",
				  key->name, val);
	return 0;
}

static int parse_policy(const struct conf_key *key, const char *val,
			void *field, char *err, size_t errlen)
{
	if (!tpass_policy_valid(val))
		return tpass_fail(err, errlen,
				  "plugstack.conf: invalid %s '%s'; allowed: %s",
				  key->name, val, key->allowed);
	strcpy(field, val);
	return 0;
}

static int parse_unsigned(const struct conf_key *key, const char *val,
			  void *field, char *err, size_t errlen)
{
	if (tpass_parse_uint(val, key->min, key->max, field) < 0)
		return tpass_fail(err, errlen,
				  "plugstack.conf: invalid %s '%s'; allowed: %s %u..%u",
				  key->name, val, key->allowed, key->min,
				  key->max);
	return 0;
}

static int parse_log_level(const struct conf_key *key, const char *val,
			   void *field, char *err, size_t errlen)
{
	static const char *const names[] = {
		[TPASS_LOG_ERROR] = "error", [TPASS_LOG_INFO] = "info",
		[TPASS_LOG_VERBOSE] = "verbose", [TPASS_LOG_DEBUG] = "debug",
	};

	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		if (!strcmp(val, names[i])) {
			*(enum tpass_log_level *)field = (enum tpass_log_level)i;
			return 0;
		}
	return tpass_fail(err, errlen,
			  "plugstack.conf: invalid %s '%s'; allowed: %s",
			  key->name, val, key->allowed);
}

#define FIELD(f) offsetof(struct tpass_conf, f), sizeof(((struct tpass_conf *)0)->f)

static const struct conf_key conf_keys[] = {
	{ "coordinator", parse_abs_path, FIELD(coordinator), true, 0, 0,
	  "coordinator=PATH", NULL, NULL },
	{ "state_dir", parse_abs_path, FIELD(state_dir), true, 0, 0,
	  "state_dir=PATH", NULL, NULL },
	{ "runtime_path", parse_search_path, FIELD(runtime_path), false, 0, 0,
	  "[runtime_path=PATH]", NULL, NULL },
	{ "policy", parse_policy, FIELD(policy), false, 0, 0, "[policy=NAME]",
	  "1-32 characters from [A-Za-z0-9_-]", NULL },
	{ "max_spares", parse_unsigned, FIELD(max_spares), false, 0,
	  TPASS_SPARES_LIMIT, "[max_spares=0..64]", "an integer", NULL },
	{ "log_level", parse_log_level, FIELD(log_level), false, 0, 0,
	  "[log_level=error|info|verbose|debug]",
	  "error, info, verbose, debug", NULL },
	{ "ready_timeout", parse_unsigned, FIELD(ready_timeout_s), false, 1,
	  300, "[ready_timeout=1..300]", "seconds", NULL },
	{ "stop_timeout", parse_unsigned, FIELD(stop_timeout_s), false, 1, 300,
	  "[stop_timeout=1..300]", "seconds", NULL },
	{ "rank_wrapper", parse_abs_path, FIELD(rank_wrapper), false, 0, 0,
	  "[rank_wrapper=PATH]", NULL, NULL },
	{ "restore_agent", parse_abs_path, FIELD(restore_agent), false, 0, 0,
	  "[restore_agent=PATH]", NULL, NULL },
	{ "snapshot_every_min_s", parse_unsigned, FIELD(snapshot_every_min_s),
	  false, 1, TPASS_SNAPSHOT_EVERY_MAX, "[snapshot_every_min_s=1..604800]",
	  "seconds", NULL },
	/* its old name, which read as minutes: deprecated, still taken (logged) */
	{ "snapshot_every_min", parse_unsigned, FIELD(snapshot_every_min_s),
	  false, 1, TPASS_SNAPSHOT_EVERY_MAX, NULL, "seconds",
	  "snapshot_every_min_s" },
	{ "restore_tokens", parse_abs_path, FIELD(restore_tokens), false, 0, 0,
	  "[restore_tokens=PATH]", NULL, NULL },
	{ "gpu_inventory", parse_abs_path, FIELD(gpu_inventory), false, 0, 0,
	  "[gpu_inventory=PATH]", NULL, NULL },
};

#define NKEYS (sizeof(conf_keys) / sizeof(conf_keys[0]))

/* "coordinator=PATH state_dir=PATH [runtime_path=PATH] ..." */
static const char *allowed_keys(char *buf, size_t len)
{
	size_t used = 0;

	buf[0] = '\0';
	for (size_t i = 0; i < NKEYS && used < len; i++)
		if (conf_keys[i].usage)
			used += (size_t)snprintf(buf + used, len - used, "%s%s",
						 used ? " " : "", conf_keys[i].usage);
	return buf;
}

static const struct conf_key *find_key(const char *name, size_t len)
{
	for (size_t i = 0; i < NKEYS; i++)
		if (strlen(conf_keys[i].name) == len &&
		    !strncmp(conf_keys[i].name, name, len))
			return &conf_keys[i];
	return NULL;
}

/*
 * The restore agent's default: tpass-restore-agent in rank_wrapper's
 * directory (pip installs both console scripts there).
 */
static int default_restore_agent(struct tpass_conf *conf, char *err,
				 size_t errlen)
{
	const char *slash = strrchr(conf->rank_wrapper, '/');
	size_t dir = (size_t)(slash - conf->rank_wrapper) + 1;
	int n = snprintf(conf->restore_agent, sizeof(conf->restore_agent),
			 "%.*s" TPASS_RESTORE_AGENT_NAME, (int)dir,
			 conf->rank_wrapper);

	if (n < 0 || (size_t)n >= sizeof(conf->restore_agent)) {
		conf->restore_agent[0] = '\0';
		return tpass_fail(err, errlen,
				  "plugstack.conf: rank_wrapper's directory is too long for the restore agent beside it; give restore_agent=PATH");
	}
	return 0;
}

int tpass_conf_parse(int argc, char **argv, struct tpass_conf *conf,
		     char *err, size_t errlen)
{
	bool seen[NKEYS] = { false };
	char allowed[512];
	int i;

	tpass_conf_defaults(conf);
	for (i = 0; i < argc; i++) {
		const char *arg = argv[i];
		const char *eq = strchr(arg, '=');
		const struct conf_key *key;
		size_t klen;

		if (!eq || eq == arg)
			return tpass_fail(err, errlen,
					  "plugstack.conf: argument '%s' is not key=value; allowed: %s",
					  arg, allowed_keys(allowed, sizeof(allowed)));
		klen = (size_t)(eq - arg);
		key = find_key(arg, klen);
		if (!key)
			return tpass_fail(err, errlen,
					  "plugstack.conf: unknown argument '%.*s'; allowed: %s",
					  (int)klen, arg,
					  allowed_keys(allowed, sizeof(allowed)));
		if (key->renamed) {
			conf->deprecated = key->name;
			conf->deprecated_for = key->renamed;
			key = find_key(key->renamed, strlen(key->renamed));
		}
		if (seen[key - conf_keys])
			return tpass_fail(err, errlen,
					  "plugstack.conf: argument '%s' given twice",
					  key->name);
		seen[key - conf_keys] = true;
		if (!eq[1])
			return tpass_fail(err, errlen,
					  "plugstack.conf: argument '%s' has an empty value",
					  key->name);
		if (key->parse(key, eq + 1, (char *)conf + key->offset, err,
			       errlen) < 0)
			return -1;
	}
	for (size_t k = 0; k < NKEYS; k++)
		if (conf_keys[k].required && !seen[k])
			return tpass_fail(err, errlen,
					  "plugstack.conf: missing required argument %s",
					  conf_keys[k].usage);
	if (!conf->restore_agent[0] && conf->rank_wrapper[0])
		return default_restore_agent(conf, err, errlen);
	return 0;
}
