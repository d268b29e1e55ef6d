/*
 * token.c - restore tokens (see token.h).
 */
#include "token.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>
#include <sys/syscall.h>

#include "layout.h"
#include "util.h"

#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE (1 << 0)
#endif

/* A token written this far in the future is a clock gone wrong, not ours. */
#define TOKEN_CLOCK_SLACK_S 60

static const char *const kind_names[] = {
	[TPASS_TOKEN_MIGRATION] = "migration",
	[TPASS_TOKEN_SNAPSHOT] = "snapshot",
	/* the stop marker's word: the token of the step a stopped job restores */
	[TPASS_TOKEN_STOPPED] = TPASS_LAYOUT_STOPPED,
};

const char *tpass_token_kind_name(enum tpass_token_kind kind)
{
	return (unsigned)kind < 3 ? kind_names[kind] : "?";
}

static int parse_ll(const char *s, long long *out)
{
	long long v = 0;
	const char *p = s;

	if (!*s || strlen(s) > 18)
		return -1;
	for (; *p; p++) {
		if (*p < '0' || *p > '9')
			return -1;
		v = v * 10 + (*p - '0');
	}
	*out = v;
	return 0;
}

int tpass_token_parse(const char *text, struct tpass_token *t, char *err,
		      size_t errlen)
{
	enum { K_KIND, K_JOB, K_ALLOC, K_UID, K_RANK, K_GEN, K_SNAP, K_STEP,
	       K_CREATED, K_N };
	static const char *const keys[K_N] = {
		"kind", "job", "alloc", "uid", "rank", "generation", "snapshot",
		"step", "created",
	};
	bool seen[K_N] = { false };
	const char *line = text;
	struct tpass_token tok;

	memset(&tok, 0, sizeof(tok));
	while (*line) {
		const char *end = strchr(line, '\n'), *eq;
		size_t len = end ? (size_t)(end - line) : strlen(line);
		char val[128];
		int k;

		if (!len)
			goto next;
		eq = memchr(line, '=', len);
		if (!eq)
			return tpass_fail(err, errlen, "line '%.*s' is not key=value",
					  (int)(len > 60 ? 60 : len), line);
		for (k = 0; k < K_N; k++)
			if ((size_t)(eq - line) == strlen(keys[k]) &&
			    !strncmp(line, keys[k], strlen(keys[k])))
				break;
		if (k == K_N)
			return tpass_fail(err, errlen, "unknown key '%.*s'",
					  (int)((eq - line) > 30 ? 30 : (eq - line)),
					  line);
		if (seen[k])
			return tpass_fail(err, errlen, "%s= given twice", keys[k]);
		seen[k] = true;
		if (tpass_copy_str(val, sizeof(val), eq + 1,
				   len - (size_t)(eq - line) - 1) < 0)
			return tpass_fail(err, errlen, "value of %s= is too long",
					  keys[k]);
		switch (k) {
		case K_KIND:
			for (k = 0; k < 3; k++)
				if (!strcmp(val, kind_names[k]))
					break;
			if (k == 3)
				return tpass_fail(err, errlen,
					    "kind '%.30s' is not migration, snapshot or stopped",
					    val);
			tok.kind = (enum tpass_token_kind)k;
			break;
		case K_SNAP:
			if (!tpass_snapshot_id_valid(val))
				return tpass_fail(err, errlen,
					    "snapshot '%.70s' is not a snapshot id", val);
			snprintf(tok.snapshot, sizeof(tok.snapshot), "%s", val);
			break;
		case K_CREATED:
			if (parse_ll(val, &tok.created) < 0)
				return tpass_fail(err, errlen,
					    "created '%.30s' is not a time", val);
			break;
		default: {
			unsigned *field[K_N] = {
				[K_JOB] = &tok.job, [K_ALLOC] = &tok.alloc,
				[K_UID] = &tok.uid, [K_RANK] = &tok.rank,
				[K_GEN] = &tok.generation, [K_STEP] = &tok.step,
			};
			if (tpass_parse_uint(val, 0, 4294967294u, field[k]) < 0)
				return tpass_fail(err, errlen,
					    "%s '%.30s' is not a number", keys[k], val);
		}
		}
next:
		if (!end)
			break;
		line = end + 1;
	}
	for (int k = 0; k < K_N; k++)
		if (!seen[k] && (k == K_KIND || k == K_JOB || k == K_ALLOC ||
				 k == K_UID || k == K_CREATED))
			return tpass_fail(err, errlen, "no %s= line", keys[k]);
	tok.has_rank = seen[K_RANK];
	tok.has_generation = seen[K_GEN];
	tok.has_step = seen[K_STEP];
	if (tok.kind == TPASS_TOKEN_MIGRATION &&
	    (!tok.has_rank || !tok.has_generation))
		return tpass_fail(err, errlen, "a migration token needs rank= and generation=");
	if (tok.kind != TPASS_TOKEN_MIGRATION && !tok.snapshot[0])
		return tpass_fail(err, errlen, "a %s token needs snapshot=",
				  kind_names[tok.kind]);
	*t = tok;
	return 0;
}

/* fd is a directory of owner's with no group or other access; else -1. */
static int check_dir(int fd, const char *path, uid_t owner, char *err,
		     size_t errlen)
{
	struct stat st;

	if (fstat(fd, &st) < 0)
		return tpass_fail(err, errlen, "cannot stat %s: %s", path,
				  strerror(errno));
	if (!S_ISDIR(st.st_mode) || st.st_uid != owner || (st.st_mode & 077))
		return tpass_fail(err, errlen,
				  "%s is owned by uid %u with mode %o, not root's with mode 0700; no token there is trusted",
				  path, (unsigned)st.st_uid,
				  (unsigned)(st.st_mode & 07777));
	return 0;
}

/* Open TOKENS/NODE: its fd; -2 if either is missing; -1 with err. */
static int open_node_dir(const char *tokens, const char *node, uid_t owner,
			 char *err, size_t errlen)
{
	const int flags = O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;
	char path[TPASS_PATH_MAXLEN + 300];
	int dfd, nfd;

	if (!node[0] || strchr(node, '/') || !strcmp(node, ".") ||
	    !strcmp(node, ".."))
		return tpass_fail(err, errlen, "node name '%.64s' cannot name a directory",
				  node);
	dfd = open(tokens, flags);
	if (dfd < 0) {
		if (errno == ENOENT)
			return tpass_fail(err, errlen, "no %s", tokens), -2;
		return tpass_fail(err, errlen, "cannot open %s: %s", tokens,
				  strerror(errno));
	}
	if (check_dir(dfd, tokens, owner, err, errlen) < 0) {
		close(dfd);
		return -1;
	}
	snprintf(path, sizeof(path), "%s/%s", tokens, node);
	nfd = openat(dfd, node, flags);
	close(dfd);
	if (nfd < 0) {
		if (errno == ENOENT)
			return tpass_fail(err, errlen, "no %s", path), -2;
		return tpass_fail(err, errlen, "cannot open %s: %s", path,
				  strerror(errno));
	}
	if (check_dir(nfd, path, owner, err, errlen) < 0) {
		close(nfd);
		return -1;
	}
	return nfd;
}

/* Read and parse the token NAME in dfd; -2 if absent, -1 with err. */
static int read_token(int dfd, const char *name, uid_t owner,
		      struct tpass_token *t, char *err, size_t errlen)
{
	char buf[TPASS_TOKEN_MAX + 2], why[TPASS_ERR_MAXLEN];
	size_t have = 0;
	struct stat st;
	int fd;

	fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0) {
		if (errno == ENOENT)
			return -2;
		if (errno == ELOOP)
			return tpass_fail(err, errlen, "token %s is a symbolic link; refused",
					  name);
		return tpass_fail(err, errlen, "cannot open token %s: %s", name,
				  strerror(errno));
	}
	if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_uid != owner ||
	    (st.st_mode & 077) || st.st_nlink != 1 ||
	    st.st_size > TPASS_TOKEN_MAX) {
		close(fd);
		return tpass_fail(err, errlen,
				  "token %s is not a regular file of root's with mode 0600, one link and at most %d bytes; refused",
				  name, TPASS_TOKEN_MAX);
	}
	while (have < TPASS_TOKEN_MAX + 1) {
		ssize_t n = read(fd, buf + have, TPASS_TOKEN_MAX + 1 - have);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		have += (size_t)n;
	}
	close(fd);
	if (have > TPASS_TOKEN_MAX || memchr(buf, '\0', have))
		return tpass_fail(err, errlen, "token %s is not a token; refused",
				  name);
	buf[have] = '\0';
	if (tpass_token_parse(buf, t, why, sizeof(why)) < 0)
		return tpass_fail(err, errlen, "token %s: %s; refused", name, why);
	return 0;
}

/* Does token t name what want asks for, and is it fresh at now? */
static int check_token(const struct tpass_token *t,
		       const struct tpass_token_want *w, long long now,
		       char *err, size_t errlen)
{
	const char *kind = kind_names[w->kind];

	if (t->kind != w->kind)
		return tpass_fail(err, errlen, "the token is for a %s, not a %s; refused",
				  kind_names[t->kind], kind);
	if (t->job != w->job || t->alloc != w->alloc || t->uid != w->uid)
		return tpass_fail(err, errlen,
				  "the token names job %u in job %u of uid %u, not job %u in job %u of uid %u; refused",
				  t->job, t->alloc, t->uid, w->job, w->alloc, w->uid);
	if (w->kind == TPASS_TOKEN_MIGRATION && t->rank != w->rank)
		return tpass_fail(err, errlen, "the token names rank %u, not rank %u; refused",
				  t->rank, w->rank);
	if (w->kind != TPASS_TOKEN_MIGRATION &&
	    (!w->snapshot || strcmp(t->snapshot, w->snapshot)))
		return tpass_fail(err, errlen, "the token names snapshot %s, not %s; refused",
				  t->snapshot, w->snapshot ? w->snapshot : "none");
	if (t->has_step && t->step != w->step)
		return tpass_fail(err, errlen, "the token names step %u, not step %u; refused",
				  t->step, w->step);
	if (t->created + TPASS_RESTORE_TOKEN_TTL_S < now)
		return tpass_fail(err, errlen, "the token expired %lld s ago (tokens last %d s); refused",
				  now - t->created - TPASS_RESTORE_TOKEN_TTL_S,
				  TPASS_RESTORE_TOKEN_TTL_S);
	if (t->created > now + TOKEN_CLOCK_SLACK_S)
		return tpass_fail(err, errlen, "the token was written %lld s in the future; refused",
				  t->created - now);
	return 0;
}

int tpass_token_take(const char *tokens, const char *node, uid_t owner,
		     const struct tpass_token_want *w, long long now,
		     struct tpass_token *got, char *err, size_t errlen)
{
	char name[128], bound[160], why[TPASS_ERR_MAXLEN];
	struct tpass_token t;
	int dfd, rc;

	if ((unsigned)w->kind > TPASS_TOKEN_STOPPED)
		return tpass_fail(err, errlen, "no such kind of token");
	dfd = open_node_dir(tokens, node, owner, err, errlen);
	if (dfd < 0)
		return dfd;
	if (w->kind == TPASS_TOKEN_MIGRATION) {
		/* claimed by a rename: of two takers, one gets it */
		snprintf(name, sizeof(name), "job%u.rank%u" TPASS_LAYOUT_TOKEN_SUFFIX,
			 w->job, w->rank);
		snprintf(bound, sizeof(bound), "%s.taken.%d", name, (int)getpid());
		if (renameat(dfd, name, dfd, bound) < 0) {
			rc = errno == ENOENT ? -2 : -1;
			tpass_fail(err, errlen, "no token %s/%s/%s%s%s", tokens,
				   node, name, rc == -1 ? ": " : "",
				   rc == -1 ? strerror(errno) : "");
			close(dfd);
			return rc;
		}
		rc = read_token(dfd, bound, owner, &t, why, sizeof(why));
		unlinkat(dfd, bound, 0);
	} else {
		snprintf(name, sizeof(name), "job%u.%s" TPASS_LAYOUT_TOKEN_SUFFIX,
			 w->job, kind_names[w->kind]);
		snprintf(bound, sizeof(bound), "job%u.%s.step%u" TPASS_LAYOUT_TOKEN_SUFFIX,
			 w->job, kind_names[w->kind], w->step);
		/* the first task of the step binds it; the others find it bound */
		if (syscall(SYS_renameat2, dfd, name, dfd, bound, RENAME_NOREPLACE) < 0 &&
		    errno != ENOENT && errno != EEXIST) {
			tpass_fail(err, errlen, "cannot take token %s/%s/%s: %s",
				   tokens, node, name, strerror(errno));
			close(dfd);
			return -1;
		}
		rc = read_token(dfd, bound, owner, &t, why, sizeof(why));
	}
	close(dfd);
	if (rc == -2)
		return tpass_fail(err, errlen, "no token %s/%s/%s", tokens, node,
				  name), -2;
	if (rc < 0)
		return tpass_fail(err, errlen, "%s", why);
	if (check_token(&t, w, now, why, sizeof(why)) < 0)
		return tpass_fail(err, errlen, "token %s/%s/%s: %s", tokens,
				  node, name, why);
	*got = t;
	return 0;
}
