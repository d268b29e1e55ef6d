/*
 * Joining another process's cgroups (cgroup_join.h).
 */
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "cgroup_join.h"

/* Does the comma-separated list WANT name only options of the mount's OPTS? */
static int options_cover(const char *opts, const char *want)
{
	char w[256], *save = NULL;

	snprintf(w, sizeof(w), "%s", want);
	for (char *t = strtok_r(w, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
		size_t n = strlen(t);
		const char *o = opts;
		int found = 0;

		while (o && *o && !found) {
			const char *comma = strchr(o, ',');
			size_t len = comma ? (size_t)(comma - o) : strlen(o);

			found = len == n && !strncmp(o, t, n);
			o = comma ? comma + 1 : NULL;
		}
		if (!found)
			return 0;
	}
	return 1;
}

/*
 * Where cgroup PATH of the hierarchy CTRLS ("" = cgroup2) is reached: the
 * mount point of that hierarchy whose root is PATH or above it, the last one
 * in mountinfo (a later mount hides an earlier one at the same point, as the
 * devcluster's per-node mounts do), and PATH below that root in REL.  0 if
 * none.
 */
static int cgroup_mount(const char *proc, const char *ctrls, const char *path, char *point, size_t plen,
			char *rel, size_t rlen)
{
	char line[4096];
	char file[1024];
	FILE *f;
	int ok = 0;

	snprintf(file, sizeof(file), "%s/self/mountinfo", proc);
	if (!(f = fopen(file, "re")))
		return 0;
	while (fgets(line, sizeof(line), f)) {
		char mroot[1024], mpoint[1024], fstype[64], opts[1024];
		char *dash = strstr(line, " - ");
		size_t n;

		if (!dash || sscanf(line, "%*s %*s %*s %1023s %1023s", mroot, mpoint) != 2 ||
		    sscanf(dash + 3, "%63s %*s %1023s", fstype, opts) != 2)
			continue;
		if (*ctrls ? strcmp(fstype, "cgroup") || !options_cover(opts, ctrls)
			   : strcmp(fstype, "cgroup2"))
			continue;
		n = strcmp(mroot, "/") ? strlen(mroot) : 0;
		if (strstr(mroot, "/..") || (n && (strncmp(path, mroot, n) || (path[n] && path[n] != '/'))))
			continue; /* PATH is not below this mount's root */
		snprintf(point, plen, "%s", mpoint);
		snprintf(rel, rlen, "%s", path + n);
		ok = 1;
	}
	fclose(f);
	return ok;
}

/* PID's cgroup in the hierarchy CTRLS, from PROC/PID/cgroup ("self" for us). */
static int cgroup_of(const char *proc, const char *pid, const char *ctrls, char *path, size_t len)
{
	char file[1024], line[4096];
	FILE *f;
	int ok = 0;

	snprintf(file, sizeof(file), "%s/%s/cgroup", proc, pid);
	if (!(f = fopen(file, "re")))
		return 0;
	while (!ok && fgets(line, sizeof(line), f)) {
		char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;

		if (!c2)
			continue;
		line[strcspn(line, "\n")] = '\0';
		*c2 = '\0';
		if (!strcmp(c1 + 1, ctrls)) {
			snprintf(path, len, "%s", c2 + 1);
			ok = 1;
		}
	}
	fclose(f);
	return ok;
}

int tpass_join_cgroups_of(const char *proc, const char *task)
{
	char file[1024], line[4096];
	FILE *f;
	int joined = 0;

	snprintf(file, sizeof(file), "%s/%s/cgroup", proc, task);
	if (!(f = fopen(file, "re")))
		return 0;
	while (fgets(line, sizeof(line), f)) {
		char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
		char ours[2048], point[1024], rel[2048], target[4096], pid[16];
		const char *path;
		int fd;

		if (!c2)
			continue;
		line[strcspn(line, "\n")] = '\0';
		*c2 = '\0';
		path = c2 + 1;
		if (cgroup_of(proc, "self", c1 + 1, ours, sizeof(ours)) && !strcmp(ours, path))
			continue;
		if (strstr(path, "/..") ||
		    !cgroup_mount(proc, c1 + 1, path, point, sizeof(point), rel, sizeof(rel)))
			continue;
		snprintf(target, sizeof(target), "%s%s/cgroup.procs", point, rel);
		fd = open(target, O_WRONLY | O_NOFOLLOW | O_CLOEXEC);
		if (fd < 0)
			continue;
		snprintf(pid, sizeof(pid), "%d", (int)getpid());
		if (write(fd, pid, strlen(pid)) == (ssize_t)strlen(pid))
			joined++;
		/* else best effort: see cgroup_join.h */
		close(fd);
	}
	fclose(f);
	return joined;
}
