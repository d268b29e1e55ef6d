/*
 * relaunch.c - the coordinator's relaunch verdict (see relaunch.h).
 */
#include "relaunch.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "layout.h"
#include "util.h"

/* "S,S,...": step ids; "" is no step at all (nothing of the job's ran there). */
static int parse_steps(const char *val, struct tpass_relaunch *out, char *err,
		       size_t errlen)
{
	const char *p = val;

	out->steps_known = true;
	out->nsteps = 0;
	while (*p) {
		const char *comma = strchr(p, ',');
		size_t len = comma ? (size_t)(comma - p) : strlen(p);
		char num[16];

		if (out->nsteps == TPASS_RELAUNCH_MAX_STEPS ||
		    tpass_copy_str(num, sizeof(num), p, len) < 0 ||
		    tpass_parse_uint(num, 0, 4294967294u,
				     &out->steps[out->nsteps]) < 0)
			return tpass_fail(err, errlen,
				    "relaunch verdict steps '%.80s' is not a list of at most %d step ids",
				    val, TPASS_RELAUNCH_MAX_STEPS);
		out->nsteps++;
		if (!comma)
			break;
		p = comma + 1;
	}
	return 0;
}

bool tpass_snapshot_id_valid(const char *id)
{
	size_t len = strlen(id);

	return len >= 1 && len <= TPASS_SNAPSHOT_ID_MAX &&
	       strspn(id, "abcdefghijklmnopqrstuvwxyz"
			  "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_") == len;
}

int tpass_relaunch_parse(const char *text, struct tpass_relaunch *out,
			 char *err, size_t errlen)
{
	const char *line = text;
	bool seen_count = false;

	memset(out, 0, sizeof(*out));
	while (*line) {
		const char *end = strchr(line, '\n'), *eq;
		size_t len = end ? (size_t)(end - line) : strlen(line);
		char val[256];

		eq = memchr(line, '=', len);
		if (len && !eq)
			return tpass_fail(err, errlen,
				    "relaunch verdict line '%.*s' is not key=value",
				    (int)(len > 80 ? 80 : len), line);
		if (eq) {
			size_t klen = (size_t)(eq - line);

			if (tpass_copy_str(val, sizeof(val), eq + 1,
					   len - klen - 1) < 0)
				return tpass_fail(err, errlen,
					    "relaunch verdict value of '%.*s' is too long",
					    (int)klen, line);
			if (klen == 5 && !strncmp(line, "count", 5)) {
				if (tpass_parse_uint(val, 0, 1000000,
						     &out->count) < 0)
					return tpass_fail(err, errlen,
						    "relaunch verdict count '%s' is not a number",
						    val);
				seen_count = true;
			} else if (klen == 7 && !strncmp(line, "pending", 7)) {
				if (strcmp(val, "0") && strcmp(val, "1"))
					return tpass_fail(err, errlen,
						    "relaunch verdict pending '%s' is not 0 or 1",
						    val);
				out->pending = val[0] == '1';
			} else if (klen == 4 && !strncmp(line, "node", 4)) {
				snprintf(out->node, sizeof(out->node), "%s",
					 val);
			} else if (klen == 5 && !strncmp(line, "steps", 5)) {
				if (parse_steps(val, out, err, errlen) < 0)
					return -1;
			} else if (klen == 5 && !strncmp(line, "cause", 5)) {
				out->cause = !strcmp(val, "lost_node") ? TPASS_CAUSE_LOST_NODE
					   : !strcmp(val, "rank_died") ? TPASS_CAUSE_RANK_DIED
					   : TPASS_CAUSE_UNKNOWN;
			} else if (klen == 6 && !strncmp(line, "spares", 6)) {
				snprintf(out->spares, sizeof(out->spares), "%s",
					 val);
			} else if (klen == 8 && !strncmp(line, "snapshot", 8)) {
				/* it ends up in an argv and a path: checked here */
				if (!tpass_snapshot_id_valid(val))
					return tpass_fail(err, errlen,
						    "relaunch verdict snapshot '%.80s' is not a snapshot id (1..%d of [A-Za-z0-9_-])",
						    val, TPASS_SNAPSHOT_ID_MAX);
				snprintf(out->snapshot, sizeof(out->snapshot),
					 "%s", val);
			}
		}
		if (!end)
			break;
		line = end + 1;
	}
	if (!seen_count)
		return tpass_fail(err, errlen, "relaunch verdict has no count");
	return 0;
}

int tpass_relaunch_read(const char *state_dir, unsigned job_id,
			struct tpass_relaunch *out, char *err, size_t errlen)
{
	char path[TPASS_PATH_MAXLEN + 64], buf[1024];
	ssize_t n;
	int fd;

	memset(out, 0, sizeof(*out));
	snprintf(path, sizeof(path),
		 "%s/" TPASS_LAYOUT_JOBS "/%u/" TPASS_LAYOUT_RELAUNCH,
		 state_dir, job_id);
	fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0) {
		if (errno == ENOENT)
			return 0;
		return tpass_fail(err, errlen, "cannot read %s: %s", path,
			    strerror(errno));
	}
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n < 0)
		return tpass_fail(err, errlen, "cannot read %s: %s", path,
			    strerror(errno));
	buf[n] = '\0';
	if (tpass_relaunch_parse(buf, out, err, errlen) < 0)
		return -1;
	return 0;
}

static bool ended_mine(const struct tpass_relaunch *v, bool step_known,
		       unsigned step)
{
	if (!v->steps_known)
		return true;
	if (!step_known)
		return false;
	for (unsigned i = 0; i < v->nsteps; i++)
		if (v->steps[i] == step)
			return true;
	return false;
}

enum tpass_relaunch_step tpass_relaunch_next(const struct tpass_relaunch *v,
					     unsigned baseline,
					     bool step_known, unsigned step,
					     bool coordinator_runs,
					     bool expired)
{
	if (v->count > baseline)
		return ended_mine(v, step_known, step) ? TPASS_RELAUNCH_AGAIN :
							 TPASS_RELAUNCH_EXIT;
	if (v->pending && coordinator_runs && !expired)
		return TPASS_RELAUNCH_WAIT;
	return TPASS_RELAUNCH_EXIT;
}

char **tpass_argv_split(const char *buf, size_t len)
{
	size_t n = 0, i, at = 0;
	char **argv;

	if (!len)
		return NULL;
	for (i = 0; i < len; i++)
		if (!buf[i])
			n++;
	if (buf[len - 1])
		n++; /* no terminating NUL on the last argument */
	argv = calloc(n + 1, sizeof(*argv));
	if (!argv)
		return NULL;
	for (i = 0; i < n; i++) {
		size_t l = strnlen(buf + at, len - at);

		argv[i] = strndup(buf + at, l);
		if (!argv[i]) {
			tpass_argv_free(argv);
			return NULL;
		}
		at += l + 1;
	}
	return argv;
}

void tpass_argv_free(char **argv)
{
	if (!argv)
		return;
	for (char **a = argv; *a; a++)
		free(*a);
	free(argv);
}

char **tpass_env_set(char *const *envp, const char *name, const char *value)
{
	size_t n = 0, out = 0, nlen = strlen(name);
	char **env;

	while (envp[n])
		n++;
	env = calloc(n + 2, sizeof(*env));
	if (!env)
		return NULL;
	for (size_t i = 0; i < n; i++) {
		if (!strncmp(envp[i], name, nlen) && envp[i][nlen] == '=')
			continue;
		env[out] = strdup(envp[i]);
		if (!env[out++])
			goto oom;
	}
	if (value && asprintf(&env[out], "%s=%s", name, value) < 0) {
		env[out] = NULL;
		goto oom;
	}
	return env;
oom:
	tpass_argv_free(env);
	return NULL;
}

void tpass_relaunch_message(const struct tpass_relaunch *v, unsigned job_id,
			    char *buf, size_t buflen)
{
	char what[400], where[400], from[160];

	switch (v->cause) {
	case TPASS_CAUSE_LOST_NODE:
		snprintf(what, sizeof(what), "job %u lost %s", job_id, v->node);
		break;
	case TPASS_CAUSE_RANK_DIED:
		snprintf(what, sizeof(what),
			 "job %u: a rank died on %s (the node is up)", job_id,
			 v->node);
		break;
	default:
		snprintf(what, sizeof(what), "job %u: a fault on %s", job_id,
			 v->node);
		break;
	}
	if (v->spares[0])
		snprintf(where, sizeof(where), "with %s in %s place", v->spares,
			 strchr(v->spares, ',') ? "their" : "its");
	else if (v->cause == TPASS_CAUSE_LOST_NODE)
		/* a coordinator that does not name its spares */
		snprintf(where, sizeof(where), "with a spare in its place");
	else
		snprintf(where, sizeof(where), "on the same nodes");
	if (v->snapshot[0])
		snprintf(from, sizeof(from),
			 ", every rank restored from snapshot %s", v->snapshot);
	else
		from[0] = '\0';
	snprintf(buf, buflen,
		 "%s; srun starts its step again %s%s (relaunch %u; 'tpassctl events %u' says more)",
		 what, where, from, v->count, job_id);
}
