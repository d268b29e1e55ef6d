/*
 * stop.c - a job stopped by 'tpassctl snapshot --stop' (see stop.h).
 */
#include "stop.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>

#include "layout.h"
#include "relaunch.h"
#include "util.h"

int tpass_stopped_parse(const char *text, char *snap, size_t snaplen,
			unsigned *step, char *err, size_t errlen)
{
	char id[TPASS_SNAPSHOT_ID_MAX + 1] = "";
	bool seen_snap = false, seen_step = false;
	const char *line = text;
	unsigned st = 0;

	/* said plainly: "step '0\r' is not a step id" would print a bare CR */
	if (strchr(text, '\r'))
		return tpass_fail(err, errlen,
			    "a carriage return (CRLF line ends?); its lines must end in a plain newline");
	while (*line) {
		const char *end = strchr(line, '\n'), *eq;
		size_t len = end ? (size_t)(end - line) : strlen(line);
		char val[128];

		eq = memchr(line, '=', len);
		if (len && !eq)
			return tpass_fail(err, errlen,
				    "line '%.*s' is not key=value",
				    (int)(len > 80 ? 80 : len), line);
		if (eq) {
			size_t klen = (size_t)(eq - line);
			bool is_snap = klen == 8 && !strncmp(line, "snapshot", 8);
			bool is_step = klen == 4 && !strncmp(line, "step", 4);

			if ((is_snap && seen_snap) || (is_step && seen_step))
				return tpass_fail(err, errlen,
					    "%.*s= given twice", (int)klen, line);
			if ((is_snap || is_step) &&
			    tpass_copy_str(val, sizeof(val), eq + 1,
					   len - klen - 1) < 0)
				return tpass_fail(err, errlen,
					    "value of %.*s= is too long",
					    (int)klen, line);
			if (is_snap) {
				/* it ends up in an argv and a path: checked here */
				if (!tpass_snapshot_id_valid(val))
					return tpass_fail(err, errlen,
						    "snapshot '%.80s' is not a snapshot id (1..%d of [A-Za-z0-9_-])",
						    val, TPASS_SNAPSHOT_ID_MAX);
				snprintf(id, sizeof(id), "%s", val);
				seen_snap = true;
			} else if (is_step) {
				if (tpass_parse_uint(val, 0, 4294967294u, &st) < 0)
					return tpass_fail(err, errlen,
						    "step '%.80s' is not a step id",
						    val);
				seen_step = true;
			}
		}
		if (!end)
			break;
		line = end + 1;
	}
	if (!seen_snap)
		return tpass_fail(err, errlen, "no snapshot= line");
	if (!seen_step)
		return tpass_fail(err, errlen, "no step= line");
	if (strlen(id) >= snaplen)
		return tpass_fail(err, errlen, "snapshot '%s' is too long", id);
	snprintf(snap, snaplen, "%s", id);
	*step = st;
	return 0;
}

/*
 * Open STATE_DIR/jobs/JOB/NAME (path filled in) for reading, if it is a
 * regular file owned by uid: its fd, with its size in *size; -2 if there is
 * no such file; -1 with err otherwise.  O_NOFOLLOW and the owner check keep
 * a link to someone else's file from being read (and echoed in an error
 * line) with slurmstepd's rights, and so does the one-link check for a hard
 * link; O_NONBLOCK keeps a FIFO from hanging it.
 */
static int open_user_file(const char *state_dir, unsigned job_id,
			  const char *name, uid_t uid, char *path,
			  size_t pathlen, off_t *size, char *err, size_t errlen)
{
	struct stat st;
	int fd;

	snprintf(path, pathlen, "%s/" TPASS_LAYOUT_JOBS "/%u/%s", state_dir,
		 job_id, name);
	fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0) {
		if (errno == ENOENT)
			return -2;
		if (errno == ELOOP)
			return tpass_fail(err, errlen,
				    "%s is a symbolic link; not read", path);
		return tpass_fail(err, errlen, "cannot open %s: %s", path,
			    strerror(errno));
	}
	if (fstat(fd, &st) < 0) {
		tpass_fail(err, errlen, "cannot stat %s: %s", path,
			   strerror(errno));
		goto bad;
	}
	if (!S_ISREG(st.st_mode)) {
		tpass_fail(err, errlen, "%s is not a regular file; not read",
			   path);
		goto bad;
	}
	if (st.st_uid != uid) {
		tpass_fail(err, errlen,
			   "%s is owned by uid %u, not by the job's user (uid %u); not read",
			   path, (unsigned)st.st_uid, (unsigned)uid);
		goto bad;
	}
	/* a hard link to a file the user cannot read would be read as root */
	if (st.st_nlink != 1) {
		tpass_fail(err, errlen, "%s has %lu links; not read", path,
			   (unsigned long)st.st_nlink);
		goto bad;
	}
	*size = st.st_size;
	return fd;
bad:
	close(fd);
	return -1;
}

int tpass_stopped_read(const char *state_dir, unsigned job_id, uid_t uid,
		       char *snap, size_t snaplen, unsigned *step, bool *found,
		       char *err, size_t errlen)
{
	char path[TPASS_PATH_MAXLEN + 64], buf[TPASS_STOPPED_MAX + 2];
	char why[TPASS_ERR_MAXLEN];
	size_t have = 0;
	off_t size;
	int fd;

	*found = false;
	fd = open_user_file(state_dir, job_id, TPASS_LAYOUT_STOPPED, uid, path,
			    sizeof(path), &size, err, errlen);
	if (fd == -2)
		return 0;
	if (fd < 0)
		return -1;
	if (size > TPASS_STOPPED_MAX) {
		close(fd);
		return tpass_fail(err, errlen, "%s has %lld bytes, more than %d; not read",
			    path, (long long)size, TPASS_STOPPED_MAX);
	}
	/* one byte more than allowed: a file that grew since fstat is seen */
	while (have < TPASS_STOPPED_MAX + 1) {
		ssize_t n = read(fd, buf + have, TPASS_STOPPED_MAX + 1 - have);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			tpass_fail(err, errlen, "cannot read %s: %s", path,
				   strerror(errno));
			close(fd);
			return -1;
		}
		if (n == 0)
			break;
		have += (size_t)n;
	}
	close(fd);
	if (have > TPASS_STOPPED_MAX)
		return tpass_fail(err, errlen, "%s has more than %d bytes; not read",
			    path, TPASS_STOPPED_MAX);
	if (memchr(buf, '\0', have))
		return tpass_fail(err, errlen, "%s holds a NUL byte; not a stop marker",
			    path);
	buf[have] = '\0';
	if (tpass_stopped_parse(buf, snap, snaplen, step, why, sizeof(why)) < 0)
		return tpass_fail(err, errlen, "%s: %s", path, why);
	*found = true;
	return 0;
}

/* Write len bytes of buf to fd, through short writes and signals. */
static int write_all(int fd, const char *buf, size_t len)
{
	while (len) {
		ssize_t n = write(fd, buf, len);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			return -1;
		if (n == 0) {
			errno = EIO; /* no progress: not worth spinning on */
			return -1;
		}
		buf += n;
		len -= (size_t)n;
	}
	return 0;
}

int tpass_stopped_output_copy(const char *state_dir, unsigned job_id,
			      const char *name, uid_t uid, int out,
			      bool *found, char *err, size_t errlen)
{
	char path[TPASS_PATH_MAXLEN + 64], buf[65536];
	unsigned long long done = 0;
	off_t size;
	int fd;

	*found = false;
	fd = open_user_file(state_dir, job_id, name, uid, path, sizeof(path),
			    &size, err, errlen);
	if (fd == -2)
		return 0;
	if (fd < 0)
		return -1;
	*found = true;
	for (;;) {
		ssize_t n = read(fd, buf, sizeof(buf));

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			tpass_fail(err, errlen,
				   "cannot read %s after %llu bytes: %s; it is left in place",
				   path, done, strerror(errno));
			goto bad;
		}
		if (n == 0)
			break;
		if (write_all(out, buf, (size_t)n) < 0) {
			tpass_fail(err, errlen,
				   "cannot write %s to fd %d after %llu bytes: %s; it is left in place",
				   path, out, done, strerror(errno));
			goto bad;
		}
		done += (unsigned long long)n;
	}
	close(fd);
	if (unlink(path) < 0)
		return tpass_fail(err, errlen,
			    "copied %s (%llu bytes) but cannot remove it: %s; the job's next run copies it again",
			    path, done, strerror(errno));
	return 0;
bad:
	close(fd);
	return -1;
}
