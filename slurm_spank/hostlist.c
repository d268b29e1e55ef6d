/*
 * hostlist.c - Slurm host lists and SLURM_TASKS_PER_NODE (see hostlist.h).
 */
#include "hostlist.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

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
			return tpass_fail(err, errlen, "host list: unbalanced ']' in '%.*s'",
				    (int)len, expr);
		return strvec_push(sv, expr, len) < 0 ?
			       tpass_fail(err, errlen, "out of memory") : 0;
	}
	rb = memchr(lb, ']', len - (size_t)(lb - expr));
	if (!rb)
		return tpass_fail(err, errlen, "host list: unbalanced '[' in '%.*s'",
			    (int)len, expr);
	prelen = (size_t)(lb - expr);
	suf = rb + 1;
	suflen = len - (size_t)(suf - expr);
	if (memchr(suf, '[', suflen) || memchr(suf, ']', suflen))
		return tpass_fail(err, errlen,
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
			return tpass_fail(err, errlen, "host list: empty range in '%.*s'",
				    (int)len, expr);
		if (!isdigit((unsigned char)*p))
			return tpass_fail(err, errlen, "host list: bad range in '%.*s'",
				    (int)len, expr);
		errno = 0;
		lo = strtoul(p, &e, 10);
		width = (int)(e - p);
		if (errno || width > 9)
			return tpass_fail(err, errlen, "host list: bad range in '%.*s'",
				    (int)len, expr);
		dash = e;
		if (dash < itemend && *dash == '-') {
			const char *h = dash + 1;
			if (h >= itemend || !isdigit((unsigned char)*h))
				return tpass_fail(err, errlen,
					    "host list: bad range in '%.*s'",
					    (int)len, expr);
			hi = strtoul(h, &e, 10);
			if (errno || e != itemend || hi < lo || e - h > 9)
				return tpass_fail(err, errlen,
					    "host list: bad range in '%.*s'",
					    (int)len, expr);
		} else if (dash == itemend) {
			hi = lo;
		} else {
			return tpass_fail(err, errlen, "host list: bad range in '%.*s'",
				    (int)len, expr);
		}
		if (hi - lo >= HOSTLIST_MAX_HOSTS ||
		    sv->n + (hi - lo) >= HOSTLIST_MAX_HOSTS)
			return tpass_fail(err, errlen, "host list: too many hosts");
		for (v = lo; v <= hi; v++) {
			char name[512];
			int n = snprintf(name, sizeof(name), "%.*s%0*lu%.*s",
					 (int)prelen, expr, width, v,
					 (int)suflen, suf);
			if (n < 0 || (size_t)n >= sizeof(name))
				return tpass_fail(err, errlen,
					    "host list: host name too long");
			if (strvec_push(sv, name, (size_t)n) < 0)
				return tpass_fail(err, errlen, "out of memory");
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
		return tpass_fail(err, errlen, "host list: empty");
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
			return tpass_fail(err, errlen, "host list: empty name in '%s'",
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
				return tpass_fail(err, errlen,
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
		return tpass_fail(err, errlen, "SLURM_TASKS_PER_NODE is empty");
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
			if (tasks > ULONG_MAX - sum) /* the sum would wrap */
				return tpass_fail(err, errlen,
					    "SLURM_TASKS_PER_NODE='%.64s' sums past %lu tasks",
					    tpn, ULONG_MAX);
			if (counts)
				counts[covered] = tasks;
			sum += tasks;
			covered++;
		}
	}
	if (covered < nodes)
		return tpass_fail(err, errlen,
			    "SLURM_TASKS_PER_NODE='%s' covers fewer than %zu nodes",
			    tpn, nodes);
	*sum_out = sum;
	return 0;
bad:
	return tpass_fail(err, errlen, "cannot parse SLURM_TASKS_PER_NODE='%s'", tpn);
}
