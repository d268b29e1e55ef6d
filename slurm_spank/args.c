/*
 * args.c - pure parsing for the torchpass SPANK plugin (no Slurm calls).
 */
#include "args.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(char *err, size_t errlen, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

static int fail(char *err, size_t errlen, const char *fmt, ...)
{
	va_list ap;

	if (err && errlen) {
		va_start(ap, fmt);
		vsnprintf(err, errlen, fmt, ap);
		va_end(ap);
	}
	return -1;
}

static int copy_str(char *dst, size_t len, const char *src, size_t srclen)
{
	if (srclen >= len)
		return -1;
	memcpy(dst, src, srclen);
	dst[srclen] = '\0';
	return 0;
}

int tpass_parse_uint(const char *s, unsigned min, unsigned max, unsigned *out)
{
	unsigned long v = 0;
	const char *p;

	if (!s || !*s)
		return -1;
	for (p = s; *p; p++) {
		if (*p < '0' || *p > '9')
			return -1;
		v = v * 10 + (unsigned long)(*p - '0');
		if (v > max)
			return -1;
	}
	if (p - s > 10)
		return -1;
	if (v < min)
		return -1;
	*out = (unsigned)v;
	return 0;
}

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

/* ------------------------------------------------------------------ conf */

void tpass_conf_defaults(struct tpass_conf *conf)
{
	memset(conf, 0, sizeof(*conf));
	strcpy(conf->policy, "default");
	conf->max_spares = TPASS_SPARES_LIMIT;
	conf->log_level = TPASS_LOG_INFO;
	conf->ready_timeout_s = 10;
	conf->stop_timeout_s = 5;
}

static int parse_abs_path(const char *key, const char *val, char *dst,
			  size_t len, char *err, size_t errlen)
{
	if (val[0] != '/')
		return fail(err, errlen,
			    "plugstack.conf: %s='%s' must be an absolute path",
			    key, val);
	if (copy_str(dst, len, val, strlen(val)) < 0)
		return fail(err, errlen,
			    "plugstack.conf: %s is longer than %zu bytes", key,
			    len - 1);
	return 0;
}

static const char *const conf_keys[] = {
	"coordinator", "state_dir", "runtime_path", "policy", "max_spares",
	"log_level", "ready_timeout", "stop_timeout", "rank_wrapper", NULL,
};

#define CONF_ALLOWED \
	"coordinator=PATH state_dir=PATH [runtime_path=PATH] [policy=NAME] " \
	"[max_spares=0..64] [log_level=error|info|verbose|debug] " \
	"[ready_timeout=1..300] [stop_timeout=1..300] [rank_wrapper=PATH]"

int tpass_conf_parse(int argc, char **argv, struct tpass_conf *conf,
		     char *err, size_t errlen)
{
	bool seen[sizeof(conf_keys) / sizeof(conf_keys[0])] = { false };
	int i;

	tpass_conf_defaults(conf);
	for (i = 0; i < argc; i++) {
		const char *arg = argv[i];
		const char *eq = strchr(arg, '=');
		const char *val;
		size_t klen;
		int k;

		if (!eq || eq == arg)
			return fail(err, errlen,
				    "plugstack.conf: argument '%s' is not key=value; allowed: %s",
				    arg, CONF_ALLOWED);
		klen = (size_t)(eq - arg);
		val = eq + 1;
		for (k = 0; conf_keys[k]; k++)
			if (strlen(conf_keys[k]) == klen &&
			    !strncmp(conf_keys[k], arg, klen))
				break;
		if (!conf_keys[k])
			return fail(err, errlen,
				    "plugstack.conf: unknown argument '%.*s'; allowed: %s",
				    (int)klen, arg, CONF_ALLOWED);
		if (seen[k])
			return fail(err, errlen,
				    "plugstack.conf: argument '%s' given twice",
				    conf_keys[k]);
		seen[k] = true;
		if (!*val)
			return fail(err, errlen,
				    "plugstack.conf: argument '%s' has an empty value",
				    conf_keys[k]);

		switch (k) {
		case 0:
			if (parse_abs_path("coordinator", val, conf->coordinator,
					   sizeof(conf->coordinator), err,
					   errlen) < 0)
				return -1;
			break;
		case 1:
			if (parse_abs_path("state_dir", val, conf->state_dir,
					   sizeof(conf->state_dir), err,
					   errlen) < 0)
				return -1;
			break;
		case 2:
			if (parse_abs_path("runtime_path", val,
					   conf->runtime_path,
					   sizeof(conf->runtime_path), err,
					   errlen) < 0)
				return -1;
			if (strchr(val, ':'))
				return fail(err, errlen,
					    "plugstack.conf: runtime_path='%s' must not contain ':'",
					    val);
			break;
		case 3:
			if (!tpass_policy_valid(val))
				return fail(err, errlen,
					    "plugstack.conf: invalid policy '%s'; allowed: 1-32 characters from [A-Za-z0-9_-]",
					    val);
			strcpy(conf->policy, val);
			break;
		case 4:
			if (tpass_parse_uint(val, 0, TPASS_SPARES_LIMIT,
					     &conf->max_spares) < 0)
				return fail(err, errlen,
					    "plugstack.conf: invalid max_spares '%s'; allowed: an integer 0..%d",
					    val, TPASS_SPARES_LIMIT);
			break;
		case 5:
			if (!strcmp(val, "error"))
				conf->log_level = TPASS_LOG_ERROR;
			else if (!strcmp(val, "info"))
				conf->log_level = TPASS_LOG_INFO;
			else if (!strcmp(val, "verbose"))
				conf->log_level = TPASS_LOG_VERBOSE;
			else if (!strcmp(val, "debug"))
				conf->log_level = TPASS_LOG_DEBUG;
			else
				return fail(err, errlen,
					    "plugstack.conf: invalid log_level '%s'; allowed: error, info, verbose, debug",
					    val);
			break;
		case 6:
		case 7: {
			unsigned *dst = k == 6 ? &conf->ready_timeout_s :
						 &conf->stop_timeout_s;
			if (tpass_parse_uint(val, 1, 300, dst) < 0)
				return fail(err, errlen,
					    "plugstack.conf: invalid %s '%s'; allowed: seconds 1..300",
					    conf_keys[k], val);
			break;
		}
		case 8:
			if (parse_abs_path("rank_wrapper", val,
					   conf->rank_wrapper,
					   sizeof(conf->rank_wrapper), err,
					   errlen) < 0)
				return -1;
			break;
		}
	}
	if (!seen[0])
		return fail(err, errlen,
			    "plugstack.conf: missing required argument coordinator=PATH");
	if (!seen[1])
		return fail(err, errlen,
			    "plugstack.conf: missing required argument state_dir=PATH");
	return 0;
}

/* ------------------------------------------------------------------ opts */

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
	bool seen_spares = false, seen_policy = false;
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
			return fail(err, errlen,
				    "--torchpass: empty item in '%s'; give comma-separated key=value items: spares=N (0..%u), policy=NAME",
				    value, max);
		eq = memchr(p, '=', ilen);
		klen = eq ? (size_t)(eq - p) : ilen;

		if (klen == 3 && !strncmp(p, "off", 3) && !eq)
			return fail(err, errlen,
				    "--torchpass: 'off' cannot be combined with other keys; use --torchpass=off alone");

		if (klen == 6 && !strncmp(p, "spares", 6)) {
			if (seen_spares)
				return fail(err, errlen,
					    "--torchpass: key 'spares' given twice; give it once (spares=N, N in 0..%u)",
					    max);
			seen_spares = true;
			if (!eq)
				return fail(err, errlen,
					    "--torchpass: key 'spares' needs a value; allowed: spares=N with N an integer 0..%u",
					    max);
			if (copy_str(val, sizeof(val), eq + 1,
				     ilen - klen - 1) < 0 ||
			    tpass_parse_uint(val, 0, max, &opts->spares) < 0)
				return fail(err, errlen,
					    "--torchpass: invalid value '%.*s' for key 'spares'; allowed: an integer 0..%u",
					    (int)(ilen - klen - 1) > 64 ? 64 : (int)(ilen - klen - 1),
					    eq + 1, max);
		} else if (klen == 6 && !strncmp(p, "policy", 6)) {
			if (seen_policy)
				return fail(err, errlen,
					    "--torchpass: key 'policy' given twice; give it once (policy=NAME)");
			seen_policy = true;
			if (!eq)
				return fail(err, errlen,
					    "--torchpass: key 'policy' needs a value; allowed: policy=NAME with NAME 1-32 characters from [A-Za-z0-9_-]");
			if (copy_str(val, sizeof(val), eq + 1,
				     ilen - klen - 1) < 0 ||
			    !tpass_policy_valid(val))
				return fail(err, errlen,
					    "--torchpass: invalid value '%.*s' for key 'policy'; allowed: 1-32 characters from [A-Za-z0-9_-]",
					    (int)(ilen - klen - 1) > 64 ? 64 : (int)(ilen - klen - 1),
					    eq + 1);
			strcpy(opts->policy, val);
		} else {
			return fail(err, errlen,
				    "--torchpass: unknown key '%.*s'; allowed keys: spares=N (0..%u), policy=NAME ([A-Za-z0-9_-]{1,32}), or the single word off",
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
	else
		n = snprintf(buf, len, "spares=%u,policy=%s", opts->spares,
			     opts->policy);
	return (n < 0 || (size_t)n >= len) ? -1 : 0;
}

/* -------------------------------------------------------------- hostlist */

struct strvec {
	char **v;
	size_t n, cap;
};

static int strvec_push(struct strvec *sv, const char *s, size_t len)
{
	char *copy;

	if (sv->n == sv->cap) {
		size_t cap = sv->cap ? sv->cap * 2 : 16;
		char **nv = realloc(sv->v, cap * sizeof(*nv));
		if (!nv)
			return -1;
		sv->v = nv;
		sv->cap = cap;
	}
	copy = malloc(len + 1);
	if (!copy)
		return -1;
	memcpy(copy, s, len);
	copy[len] = '\0';
	sv->v[sv->n++] = copy;
	return 0;
}

void tpass_hostlist_free(char **hosts, size_t count)
{
	size_t i;

	if (!hosts)
		return;
	for (i = 0; i < count; i++)
		free(hosts[i]);
	free(hosts);
}

#define HOSTLIST_MAX_HOSTS 65536

/* Expand one host expression "pre[ranges]suf" (or a plain name). */
static int expand_one(const char *expr, size_t len, struct strvec *sv,
		      char *err, size_t errlen)
{
	const char *lb = memchr(expr, '[', len);
	const char *rb, *suf, *p;
	size_t prelen, suflen;

	if (!lb) {
		if (memchr(expr, ']', len))
			return fail(err, errlen, "host list: unbalanced ']' in '%.*s'",
				    (int)len, expr);
		return strvec_push(sv, expr, len) < 0 ?
			       fail(err, errlen, "out of memory") : 0;
	}
	rb = memchr(lb, ']', len - (size_t)(lb - expr));
	if (!rb)
		return fail(err, errlen, "host list: unbalanced '[' in '%.*s'",
			    (int)len, expr);
	prelen = (size_t)(lb - expr);
	suf = rb + 1;
	suflen = len - (size_t)(suf - expr);
	if (memchr(suf, '[', suflen) || memchr(suf, ']', suflen))
		return fail(err, errlen,
			    "host list: more than one bracket group in '%.*s' is not supported",
			    (int)len, expr);

	for (p = lb + 1; p < rb;) {
		const char *q = memchr(p, ',', (size_t)(rb - p));
		const char *dash;
		const char *itemend = q ? q : rb;
		unsigned long lo, hi, v;
		int width;
		char *e;

		if (itemend == p)
			return fail(err, errlen, "host list: empty range in '%.*s'",
				    (int)len, expr);
		if (!isdigit((unsigned char)*p))
			return fail(err, errlen, "host list: bad range in '%.*s'",
				    (int)len, expr);
		errno = 0;
		lo = strtoul(p, &e, 10);
		width = (int)(e - p);
		if (errno || width > 9)
			return fail(err, errlen, "host list: bad range in '%.*s'",
				    (int)len, expr);
		dash = e;
		if (dash < itemend && *dash == '-') {
			const char *h = dash + 1;
			if (h >= itemend || !isdigit((unsigned char)*h))
				return fail(err, errlen,
					    "host list: bad range in '%.*s'",
					    (int)len, expr);
			hi = strtoul(h, &e, 10);
			if (errno || e != itemend || hi < lo || e - h > 9)
				return fail(err, errlen,
					    "host list: bad range in '%.*s'",
					    (int)len, expr);
		} else if (dash == itemend) {
			hi = lo;
		} else {
			return fail(err, errlen, "host list: bad range in '%.*s'",
				    (int)len, expr);
		}
		if (hi - lo >= HOSTLIST_MAX_HOSTS ||
		    sv->n + (hi - lo) >= HOSTLIST_MAX_HOSTS)
			return fail(err, errlen, "host list: too many hosts");
		for (v = lo; v <= hi; v++) {
			char name[512];
			int n = snprintf(name, sizeof(name), "%.*s%0*lu%.*s",
					 (int)prelen, expr, width, v,
					 (int)suflen, suf);
			if (n < 0 || (size_t)n >= sizeof(name))
				return fail(err, errlen,
					    "host list: host name too long");
			if (strvec_push(sv, name, (size_t)n) < 0)
				return fail(err, errlen, "out of memory");
		}
		p = q ? q + 1 : rb;
	}
	return 0;
}

int tpass_hostlist_expand(const char *list, char ***hosts, size_t *count,
			  char *err, size_t errlen)
{
	struct strvec sv = { 0 };
	const char *p = list;

	*hosts = NULL;
	*count = 0;
	if (!list || !*list)
		return fail(err, errlen, "host list: empty");
	while (*p) {
		const char *start = p;
		int depth = 0;

		/* a comma splits hosts only outside brackets */
		for (; *p; p++) {
			if (*p == '[')
				depth++;
			else if (*p == ']')
				depth--;
			else if (*p == ',' && depth == 0)
				break;
		}
		if (p == start) {
			tpass_hostlist_free(sv.v, sv.n);
			return fail(err, errlen, "host list: empty name in '%s'",
				    list);
		}
		if (expand_one(start, (size_t)(p - start), &sv, err, errlen) < 0) {
			tpass_hostlist_free(sv.v, sv.n);
			return -1;
		}
		if (*p == ',') {
			p++;
			if (!*p) {
				tpass_hostlist_free(sv.v, sv.n);
				return fail(err, errlen,
					    "host list: trailing comma in '%s'",
					    list);
			}
		}
	}
	*hosts = sv.v;
	*count = sv.n;
	return 0;
}

int tpass_hostlist_join(char **hosts, size_t from, size_t to, char *buf,
			size_t len)
{
	size_t used = 0, i;

	if (!len)
		return -1;
	buf[0] = '\0';
	for (i = from; i < to; i++) {
		size_t n = strlen(hosts[i]);
		if (used + n + (i > from) + 1 > len)
			return -1;
		if (i > from)
			buf[used++] = ',';
		memcpy(buf + used, hosts[i], n);
		used += n;
		buf[used] = '\0';
	}
	return 0;
}

int tpass_tasks_on_first_nodes(const char *tpn, size_t nodes,
			       unsigned long *out, char *err, size_t errlen)
{
	return tpass_tasks_per_node(tpn, nodes, NULL, out, err, errlen);
}

int tpass_tasks_per_node(const char *tpn, size_t nodes, unsigned long *counts,
			 unsigned long *sum_out, char *err, size_t errlen)
{
	const char *p = tpn;
	unsigned long sum = 0;
	size_t covered = 0;

	if (!tpn || !*tpn)
		return fail(err, errlen, "SLURM_TASKS_PER_NODE is empty");
	while (*p && covered < nodes) {
		unsigned long tasks, reps = 1;
		char *e;

		if (!isdigit((unsigned char)*p))
			goto bad;
		errno = 0;
		tasks = strtoul(p, &e, 10);
		if (errno)
			goto bad;
		p = e;
		if (*p == '(') {
			if (strncmp(p, "(x", 2))
				goto bad;
			p += 2;
			if (!isdigit((unsigned char)*p))
				goto bad;
			reps = strtoul(p, &e, 10);
			if (errno || *e != ')' || reps == 0)
				goto bad;
			p = e + 1;
		}
		if (*p == ',')
			p++;
		else if (*p)
			goto bad;
		while (reps-- && covered < nodes) {
			if (counts)
				counts[covered] = tasks;
			sum += tasks;
			covered++;
		}
	}
	if (covered < nodes)
		return fail(err, errlen,
			    "SLURM_TASKS_PER_NODE='%s' covers fewer than %zu nodes",
			    tpn, nodes);
	*sum_out = sum;
	return 0;
bad:
	return fail(err, errlen, "cannot parse SLURM_TASKS_PER_NODE='%s'", tpn);
}

/* ------------------------------------------------------------ PYTHONPATH */

int tpass_pythonpath_prepend(const char *old, const char *runtime, char *buf,
			     size_t len)
{
	size_t rl = strlen(runtime);
	int n;

	if (old && !strncmp(old, runtime, rl) &&
	    (old[rl] == '\0' || old[rl] == ':'))
		n = snprintf(buf, len, "%s", old);
	else if (old && *old)
		n = snprintf(buf, len, "%s:%s", runtime, old);
	else
		n = snprintf(buf, len, "%s", runtime);
	return (n < 0 || (size_t)n >= len) ? -1 : 0;
}

int tpass_pythonpath_strip(const char *old, const char *runtime, char *buf,
			   size_t len)
{
	size_t used = 0, kept = 0;
	const char *p = old ? old : "";

	if (!len)
		return -1;
	buf[0] = '\0';
	while (1) {
		const char *c = strchr(p, ':');
		size_t n = c ? (size_t)(c - p) : strlen(p);

		if (!(n == strlen(runtime) && !strncmp(p, runtime, n))) {
			if (used + n + (kept > 0) + 1 > len)
				return -1;
			if (kept++ > 0)
				buf[used++] = ':';
			memcpy(buf + used, p, n);
			used += n;
			buf[used] = '\0';
		}
		if (!c)
			break;
		p = c + 1;
	}
	return 0;
}

int tpass_ready_line_valid(const char *line, char *err, size_t errlen)
{
	const char *host, *colon;
	unsigned port;

	if (strncmp(line, "tcp://", 6))
		return fail(err, errlen,
			    "coordinator ready line '%.80s' does not start with tcp://",
			    line);
	host = line + 6;
	colon = strrchr(host, ':');
	if (!colon || colon == host)
		return fail(err, errlen,
			    "coordinator ready line '%.80s' is not tcp://ADDR:PORT",
			    line);
	if (tpass_parse_uint(colon + 1, 1, 65535, &port) < 0)
		return fail(err, errlen,
			    "coordinator ready line '%.80s' has a bad port", line);
	for (const char *p = host; p < colon; p++)
		if (!(isalnum((unsigned char)*p) || *p == '.' || *p == '-' ||
		      *p == '[' || *p == ']' || *p == ':' || *p == '_'))
			return fail(err, errlen,
				    "coordinator ready line '%.80s' has a bad address",
				    line);
	return 0;
}
