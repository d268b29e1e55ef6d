/*
 * coordinator.c - start and stop the per-job coordinator (see coordinator.h).
 *
 * Runs inside slurmstepd (batch step, as root) and in the epilog (root).
 * Everything done in the job user's directory is done either as the user or
 * through directory fds with O_NOFOLLOW/O_EXCL, so a user cannot redirect a
 * root write with a symlink or hard link, and only processes owned by the
 * job user with the recorded start time are ever signalled.
 */
#include "coordinator.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <slurm/slurm.h>

#include "layout.h"
#include "proc.h"

#define PIDFILE TPASS_LAYOUT_COORDINATOR_PID
#define LOGFILE TPASS_LAYOUT_COORDINATOR_LOG
#define READY_FD 3
#define SECRET_FD 4

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static bool still_ours(pid_t pid, unsigned long long start, uid_t uid)
{
	uid_t owner;

	if (tpass_proc_start_time(pid) != start)
		return false;
	if (tpass_proc_real_uid(pid, &owner) < 0 || owner != uid)
		return false;
	return true;
}

static void signal_coord(pid_t pid, int sig)
{
	unsigned long long start;
	pid_t pgrp = 0;
	char state;

	/* the coordinator leads its own session: signal its whole group */
	if (tpass_proc_stat(pid, &state, &pgrp, &start) == 0 && pgrp == pid &&
	    kill(-pid, sig) == 0)
		return;
	kill(pid, sig);
}

int tpass_coord_stop(pid_t pid, unsigned long long start_time, uid_t uid,
		     unsigned timeout_s, char *err, size_t errlen)
{
	double deadline;

	if (pid <= 1 || !still_ours(pid, start_time, uid))
		return 0;
	signal_coord(pid, SIGTERM);
	deadline = now_s() + timeout_s;
	while (now_s() < deadline) {
		if (tpass_proc_start_time(pid) != start_time)
			return 0;
		usleep(20000);
	}
	if (still_ours(pid, start_time, uid))
		signal_coord(pid, SIGKILL);
	deadline = now_s() + 5;
	while (now_s() < deadline) {
		if (tpass_proc_start_time(pid) != start_time)
			return 0;
		usleep(20000);
	}
	return tpass_fail(err, errlen, "coordinator pid %d survived SIGKILL",
		    (int)pid);
}

/* ------------------------------------------------------------ directories */

/*
 * slurm.conf as slurmstepd holds it (libslurm's global, filled from what
 * slurmd sent: slurmstepd_init.c packs slurm_user_id, not slurm_user_name,
 * which is NULL there).  Weak: the C unit tests have none.  No call into
 * Slurm is made.
 */
extern slurm_conf_t slurm_conf __attribute__((weak));

/*
 * SlurmUser's primary group: the group of STATE_DIR/jobs/JOB, so that
 * SlurmUser reads a job's state whatever user runs it.  Without slurm.conf,
 * or a SlurmUser this node cannot name: root's group, so that no one else
 * does.
 */
static gid_t slurm_user_gid(void)
{
	struct passwd pw, *res = NULL;
	char buf[4096];

	if (&slurm_conf == NULL)
		return 0;
	if (getpwuid_r(slurm_conf.slurm_user_id, &pw, buf, sizeof(buf), &res) != 0 ||
	    !res)
		return 0;
	return res->pw_gid;
}

static int check_root_dir(int fd, const char *path, char *err, size_t errlen)
{
	struct stat st;

	if (fstat(fd, &st) < 0)
		return tpass_fail(err, errlen, "cannot stat %s: %s", path,
			    strerror(errno));
	if (st.st_uid != 0)
		return tpass_fail(err, errlen,
			    "%s must be owned by root (it is owned by uid %u)",
			    path, (unsigned)st.st_uid);
	if ((st.st_mode & (S_IWOTH | S_IWGRP)) && !(st.st_mode & S_ISVTX))
		return tpass_fail(err, errlen,
			    "%s is group/world-writable without the sticky bit; use mode 0755 or 1777",
			    path);
	return 0;
}

/*
 * STATE_DIR/jobs: root's, and writable by root alone (no sticky exception):
 * whoever owns jobs/JOB is taken for the job's owner (tpassctl), so only root
 * may make one.
 */
static int check_jobs_dir(int fd, const char *path, char *err, size_t errlen)
{
	struct stat st;

	if (fstat(fd, &st) < 0)
		return tpass_fail(err, errlen, "cannot stat %s: %s", path,
			    strerror(errno));
	if (st.st_uid != 0 || (st.st_mode & (S_IWOTH | S_IWGRP)))
		return tpass_fail(err, errlen,
			    "%s must be owned by root and writable by root alone (it is uid %u, mode %04o); run chown root: %s; chmod %04o %s",
			    path, (unsigned)st.st_uid, (unsigned)(st.st_mode & 07777),
			    path, TPASS_LAYOUT_JOBS_DIR_MODE, path);
	return 0;
}

/*
 * Open STATE_DIR/jobs/JOB, creating what is missing, and make sure the job
 * directory belongs to the job user, group SlurmUser's, mode
 * TPASS_LAYOUT_JOB_DIR_MODE (private to them and root; setgid, so what the
 * job makes inside gets SlurmUser's group).  Returns a directory fd.
 */
static int open_job_dir(const struct tpass_conf *conf,
			const struct tpass_job *job, char *err, size_t errlen)
{
	char name[32], jobs_path[TPASS_PATH_MAXLEN + 8];
	int sfd, jfd = -1, dfd = -1;
	struct stat st;

	sfd = open(conf->state_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (sfd < 0)
		return tpass_fail(err, errlen,
			    "state_dir %s is not an accessible directory: %s",
			    conf->state_dir, strerror(errno));
	if (check_root_dir(sfd, conf->state_dir, err, errlen) < 0)
		goto out;
	snprintf(jobs_path, sizeof(jobs_path), "%s/" TPASS_LAYOUT_JOBS, conf->state_dir);
	if (mkdirat(sfd, TPASS_LAYOUT_JOBS, TPASS_LAYOUT_JOBS_DIR_MODE) < 0 && errno != EEXIST) {
		tpass_fail(err, errlen, "cannot create %s: %s", jobs_path,
		     strerror(errno));
		goto out;
	}
	jfd = openat(sfd, TPASS_LAYOUT_JOBS, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (jfd < 0) {
		tpass_fail(err, errlen, "cannot open %s: %s", jobs_path,
		     strerror(errno));
		goto out;
	}
	if (check_jobs_dir(jfd, jobs_path, err, errlen) < 0)
		goto out;

	snprintf(name, sizeof(name), "%u", job->job_id);
	/* 0700 until it has its owner and group */
	if (mkdirat(jfd, name, 0700) < 0 && errno != EEXIST) {
		tpass_fail(err, errlen, "cannot create %s/%s: %s", jobs_path, name,
		     strerror(errno));
		goto out;
	}
	dfd = openat(jfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (dfd < 0) {
		tpass_fail(err, errlen, "cannot open %s/%s: %s", jobs_path, name,
		     strerror(errno));
		goto out;
	}
	if (fstat(dfd, &st) < 0) {
		tpass_fail(err, errlen, "cannot stat %s/%s: %s", jobs_path, name,
		     strerror(errno));
		goto bad;
	}
	if (st.st_uid != 0 && st.st_uid != job->uid) {
		tpass_fail(err, errlen,
		     "%s/%s belongs to uid %u, not to the job user %u",
		     jobs_path, name, (unsigned)st.st_uid, (unsigned)job->uid);
		goto bad;
	}
	/* also on a requeue: a directory left with other modes by an older torchpass */
	if (fchown(dfd, job->uid, slurm_user_gid()) < 0 ||
	    fchmod(dfd, TPASS_LAYOUT_JOB_DIR_MODE) < 0) {
		tpass_fail(err, errlen, "cannot give %s/%s to uid %u: %s", jobs_path,
		     name, (unsigned)job->uid, strerror(errno));
		goto bad;
	}
	goto out;
bad:
	close(dfd);
	dfd = -1;
out:
	if (jfd >= 0)
		close(jfd);
	close(sfd);
	return dfd;
}

/* --------------------------------------------------------------- pid file */

/*
 * A regular file of uid with one link: the job's user can put a FIFO, a
 * device or a hard link to a file they cannot read in their directory; root
 * reads none of them.
 */
static bool is_plain_file_of(int fd, uid_t uid)
{
	struct stat st;

	return fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_nlink == 1 &&
	       st.st_uid == uid;
}

static int read_pidfile(int dfd, pid_t *pid, unsigned long long *start,
			char *node, size_t nodelen)
{
	char buf[512], nodebuf[256];
	long p;
	ssize_t n;
	int fd;

	fd = openat(dfd, PIDFILE, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0)
		return -1;
	/* root wrote it (write_pidfile): one the job's user put there is not read */
	if (!is_plain_file_of(fd, 0)) {
		close(fd);
		return -1;
	}
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return -1;
	buf[n] = '\0';
	if (sscanf(buf, "%ld %llu %255s", &p, start, nodebuf) != 3 || p <= 1 ||
	    p > INT_MAX)
		return -1;
	*pid = (pid_t)p;
	snprintf(node, nodelen, "%s", nodebuf);
	return 0;
}

static int write_pidfile(int dfd, const struct tpass_coord *c,
			 const char *node, char *err, size_t errlen)
{
	char buf[512];
	int fd, n;

	n = snprintf(buf, sizeof(buf), "%d %llu %s\n", (int)c->pid,
		     c->start_time, node);
	unlinkat(dfd, PIDFILE ".tmp", 0);
	fd = openat(dfd, PIDFILE ".tmp",
		    O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
		    TPASS_LAYOUT_JOB_FILE_MODE);
	if (fd < 0)
		return tpass_fail(err, errlen, "cannot write %s: %s", PIDFILE,
			    strerror(errno));
	if (write(fd, buf, (size_t)n) != n) {
		close(fd);
		return tpass_fail(err, errlen, "cannot write %s: %s", PIDFILE,
			    strerror(errno));
	}
	close(fd);
	if (renameat(dfd, PIDFILE ".tmp", dfd, PIDFILE) < 0)
		return tpass_fail(err, errlen, "cannot rename %s: %s", PIDFILE,
			    strerror(errno));
	return 0;
}

/*
 * Last non-empty line of the coordinator log, for error messages: only from
 * a regular file of the job's user (the coordinator made it as that user).
 */
static void log_tail(int dfd, uid_t uid, char *out, size_t len)
{
	char buf[4096];
	ssize_t n;
	off_t size;
	int fd;
	char *end, *start;

	out[0] = '\0';
	fd = openat(dfd, LOGFILE, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0)
		return;
	if (!is_plain_file_of(fd, uid)) {
		close(fd);
		return;
	}
	size = lseek(fd, 0, SEEK_END);
	if (size > (off_t)sizeof(buf) - 1)
		lseek(fd, size - (off_t)sizeof(buf) + 1, SEEK_SET);
	else
		lseek(fd, 0, SEEK_SET);
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return;
	buf[n] = '\0';
	end = buf + n;
	while (end > buf && (end[-1] == '\n' || end[-1] == '\r' || end[-1] == ' '))
		*--end = '\0';
	start = strrchr(buf, '\n');
	start = start ? start + 1 : buf;
	snprintf(out, len, "%s", start);
	for (char *p = out; *p; p++)
		if ((unsigned char)*p < 0x20)
			*p = ' ';
}

/* ----------------------------------------------------------------- secret */

int tpass_secret_new(char *out, size_t outlen, char *err, size_t errlen)
{
	static const char hex[] = "0123456789abcdef";
	unsigned char raw[TPASS_SECRET_BYTES];
	size_t got = 0;

	if (outlen <= TPASS_SECRET_HEX_LEN)
		return tpass_fail(err, errlen, "secret buffer too small");
	while (got < sizeof(raw)) {
		ssize_t n = getrandom(raw + got, sizeof(raw) - got, 0);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return tpass_fail(err, errlen, "getrandom: %s",
				    strerror(n < 0 ? errno : EIO));
		got += (size_t)n;
	}
	for (size_t i = 0; i < sizeof(raw); i++) {
		out[2 * i] = hex[raw[i] >> 4];
		out[2 * i + 1] = hex[raw[i] & 15];
	}
	out[TPASS_SECRET_HEX_LEN] = '\0';
	memset(raw, 0, sizeof(raw));
	return 0;
}

/* A pipe holding secret and a newline; returns its read end (or -1). */
static int secret_pipe(const char *secret, char *err, size_t errlen)
{
	size_t len = strlen(secret);
	int p[2];

	if (pipe2(p, O_CLOEXEC) < 0)
		return tpass_fail(err, errlen, "pipe: %s", strerror(errno));
	/* far below the pipe buffer: never blocks */
	if (write(p[1], secret, len) != (ssize_t)len || write(p[1], "\n", 1) != 1) {
		tpass_fail(err, errlen, "cannot hand the job secret over: %s",
		     strerror(errno));
		close(p[0]);
		close(p[1]);
		return -1;
	}
	close(p[1]);
	return p[0];
}

/* ------------------------------------------------------------------ start */

static int move_high(int fd)
{
	int nfd;

	if (fd >= 10)
		return fd;
	nfd = fcntl(fd, F_DUPFD_CLOEXEC, 10);
	if (nfd >= 0)
		close(fd);
	return nfd;
}

static void child_fail(int ready_w, const char *what, int e)
{
	dprintf(ready_w, "error: %s: %s\n", what, strerror(e));
	_exit(127);
}

/* In the grandchild: become the job user, set up fds, exec. */
static void exec_coordinator(const struct tpass_conf *conf,
			     const struct tpass_job *job, int dfd, int ready_w,
			     int secret_r, char *const argv[])
{
	sigset_t none;
	int i, nullfd, logfd;

	setsid();
	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);
	for (i = 1; i < NSIG; i++)
		signal(i, SIG_DFL);

	ready_w = move_high(ready_w);
	if (ready_w < 0)
		_exit(127);
	if (secret_r >= 0 && (secret_r = move_high(secret_r)) < 0)
		child_fail(ready_w, "fcntl", errno);
	if (setgroups((size_t)(job->ngids > 0 ? job->ngids : 0), job->gids) < 0)
		child_fail(ready_w, "setgroups", errno);
	if (setresgid(job->gid, job->gid, job->gid) < 0)
		child_fail(ready_w, "setresgid", errno);
	if (setresuid(job->uid, job->uid, job->uid) < 0)
		child_fail(ready_w, "setresuid", errno);
	if (job->uid != 0 && (setuid(0) == 0 || geteuid() == 0))
		child_fail(ready_w, "dropping root privileges", EPERM);

	umask(TPASS_LAYOUT_JOB_UMASK);
	if (fchdir(dfd) < 0)
		child_fail(ready_w, "chdir to the job directory", errno);
	logfd = openat(dfd, LOGFILE,
		       O_WRONLY | O_APPEND | O_CREAT | O_NOFOLLOW | O_CLOEXEC,
		       TPASS_LAYOUT_JOB_FILE_MODE);
	if (logfd < 0)
		child_fail(ready_w, "open " LOGFILE, errno);
	/* a log an earlier run left with wider modes */
	if (fchmod(logfd, TPASS_LAYOUT_JOB_FILE_MODE) < 0)
		child_fail(ready_w, "chmod " LOGFILE, errno);
	logfd = move_high(logfd);
	nullfd = move_high(open("/dev/null", O_RDONLY | O_CLOEXEC));
	if (logfd < 0 || nullfd < 0)
		child_fail(ready_w, "open /dev/null", errno);
	if (dup2(nullfd, 0) < 0 || dup2(logfd, 1) < 0 || dup2(logfd, 2) < 0 ||
	    dup2(ready_w, READY_FD) < 0 ||
	    (secret_r >= 0 && dup2(secret_r, SECRET_FD) < 0))
		child_fail(ready_w, "dup2", errno);
	if (syscall(SYS_close_range, SECRET_FD + 1, ~0U, 0) < 0)
		for (i = SECRET_FD + 1; i < 4096; i++)
			close(i);
	if (secret_r < 0)
		close(SECRET_FD);
	(void)conf;
	execve(argv[0], argv, job->env);
	dprintf(2, "tpass: cannot execute %s: %s\n", argv[0], strerror(errno));
	dprintf(READY_FD, "error: cannot execute %s: %s\n", argv[0],
		strerror(errno));
	_exit(127);
}

/* Read one line from fd within timeout_s. 1: line, 0: EOF, -1: timeout. */
static int read_line(int fd, char *buf, size_t len, unsigned timeout_s)
{
	double deadline = now_s() + timeout_s;
	size_t used = 0;

	buf[0] = '\0';
	while (used + 1 < len) {
		struct pollfd pfd = { .fd = fd, .events = POLLIN };
		double left = deadline - now_s();
		ssize_t n;
		int rc;

		if (left <= 0)
			return -1;
		rc = poll(&pfd, 1, (int)(left * 1000) + 1);
		if (rc < 0 && errno == EINTR)
			continue;
		if (rc == 0)
			return -1;
		n = read(fd, buf + used, 1);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return 0;
		if (buf[used] == '\n') {
			buf[used] = '\0';
			return 1;
		}
		used++;
		buf[used] = '\0';
	}
	return 1;
}

int tpass_coord_start(const struct tpass_conf *conf, const struct tpass_job *job,
		      struct tpass_coord *out, char *err, size_t errlen)
{
	char jobid[16], spares[16], every[16], readyfd[16], secretfd[16], line[512], tail[300];
	char jobdir[TPASS_PATH_MAXLEN + 32];
	char *argv[] = { (char *)conf->coordinator, "--job-id", jobid,
			 "--state-dir", (char *)conf->state_dir, "--spares",
			 spares, "--policy", (char *)job->policy,
			 "--snapshot-every", every, "--ready-fd",
			 readyfd, job->secret ? "--secret-fd" : NULL, secretfd,
			 NULL };
	int ready[2] = { -1, -1 }, info[2] = { -1, -1 }, secret_r = -1;
	int dfd, rc = -1, st;
	pid_t c1, pid = 0;
	struct stat sb;
	char oldnode[256];
	pid_t oldpid;
	unsigned long long oldstart;

	memset(out, 0, sizeof(*out));
	snprintf(jobid, sizeof(jobid), "%u", job->job_id);
	snprintf(spares, sizeof(spares), "%u", job->spares);
	snprintf(every, sizeof(every), "%u", job->snapshot_every);
	snprintf(readyfd, sizeof(readyfd), "%d", READY_FD);
	snprintf(secretfd, sizeof(secretfd), "%d", SECRET_FD);
	snprintf(jobdir, sizeof(jobdir), "%s/" TPASS_LAYOUT_JOBS "/%u", conf->state_dir,
		 job->job_id);

	if (stat(conf->coordinator, &sb) < 0 || !S_ISREG(sb.st_mode) ||
	    !(sb.st_mode & 0111))
		return tpass_fail(err, errlen,
			    "coordinator=%s (plugstack.conf) is not an executable file",
			    conf->coordinator);

	dfd = open_job_dir(conf, job, err, errlen);
	if (dfd < 0)
		return -1;

	/* a coordinator left by an earlier run of this job (requeue) */
	if (read_pidfile(dfd, &oldpid, &oldstart, oldnode, sizeof(oldnode)) == 0 &&
	    !strcmp(oldnode, job->node) &&
	    tpass_coord_stop(oldpid, oldstart, job->uid, conf->stop_timeout_s,
			     err, errlen) < 0)
		goto out;

	if (pipe2(ready, O_CLOEXEC) < 0 || pipe2(info, O_CLOEXEC) < 0) {
		tpass_fail(err, errlen, "pipe: %s", strerror(errno));
		goto out;
	}
	if (job->secret &&
	    (secret_r = secret_pipe(job->secret, err, errlen)) < 0)
		goto out;
	c1 = fork();
	if (c1 < 0) {
		tpass_fail(err, errlen, "fork: %s", strerror(errno));
		goto out;
	}
	if (c1 == 0) {
		pid_t c2;

		close(ready[0]);
		close(info[0]);
		c2 = fork();
		if (c2 == 0) {
			close(info[1]);
			exec_coordinator(conf, job, dfd, ready[1], secret_r,
					 argv);
		}
		if (write(info[1], &c2, sizeof(c2)) != sizeof(c2))
			_exit(1);
		_exit(c2 < 0 ? 1 : 0);
	}
	close(ready[1]);
	ready[1] = -1;
	close(info[1]);
	info[1] = -1;
	if (secret_r >= 0)
		close(secret_r);
	secret_r = -1;
	while (waitpid(c1, &st, 0) < 0 && errno == EINTR)
		;
	if (read(info[0], &pid, sizeof(pid)) != sizeof(pid) || pid <= 0) {
		tpass_fail(err, errlen, "could not fork the coordinator");
		goto out;
	}
	out->pid = pid;
	out->start_time = tpass_proc_start_time(pid);

	rc = read_line(ready[0], line, sizeof(line), conf->ready_timeout_s);
	if (rc == 1 && !strncmp(line, "error: ", 7)) {
		tpass_fail(err, errlen, "cannot start the coordinator: %s", line + 7);
		rc = -1;
		goto out;
	}
	if (rc != 1) {
		log_tail(dfd, job->uid, tail, sizeof(tail));
		if (out->start_time)
			tpass_coord_stop(pid, out->start_time, job->uid, 1,
					 line, sizeof(line));
		tpass_fail(err, errlen,
		     "the coordinator %s (see %s/" LOGFILE "%s%s)",
		     rc == 0 ? "exited before reporting its address" :
			       "did not report its address in time",
		     jobdir, tail[0] ? ", last line: " : "", tail);
		rc = -1;
		goto out;
	}
	if (tpass_ready_line_valid(line, err, errlen) < 0) {
		if (out->start_time)
			tpass_coord_stop(pid, out->start_time, job->uid, 1,
					 line, sizeof(line));
		rc = -1;
		goto out;
	}
	snprintf(out->address, sizeof(out->address), "%s", line);
	if (!out->start_time)
		out->start_time = tpass_proc_start_time(pid);
	if (!out->start_time) {
		tpass_fail(err, errlen,
		     "the coordinator exited right after reporting %s (see %s/" LOGFILE ")",
		     line, jobdir);
		rc = -1;
		goto out;
	}
	rc = write_pidfile(dfd, out, job->node, err, errlen);
	if (rc < 0)
		tpass_coord_stop(pid, out->start_time, job->uid, 1, line,
				 sizeof(line));
out:
	for (int i = 0; i < 2; i++) {
		if (ready[i] >= 0)
			close(ready[i]);
		if (info[i] >= 0)
			close(info[i]);
	}
	if (secret_r >= 0)
		close(secret_r);
	close(dfd);
	return rc < 0 ? -1 : 0;
}

int tpass_coord_stop_from_pidfile(const struct tpass_conf *conf,
				  unsigned job_id, uid_t uid, const char *node,
				  bool *stopped, char *err, size_t errlen)
{
	char path[TPASS_PATH_MAXLEN + 32], pnode[256];
	unsigned long long start;
	pid_t pid;
	int dfd;

	*stopped = false;
	snprintf(path, sizeof(path), "%s/" TPASS_LAYOUT_JOBS "/%u", conf->state_dir, job_id);
	dfd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (dfd < 0)
		return 0; /* not a torchpass job, or nothing started */
	if (read_pidfile(dfd, &pid, &start, pnode, sizeof(pnode)) < 0 ||
	    strcmp(pnode, node)) {
		close(dfd);
		return 0;
	}
	close(dfd);
	if (!still_ours(pid, start, uid))
		return 0;
	*stopped = true;
	return tpass_coord_stop(pid, start, uid, conf->stop_timeout_s, err,
				errlen);
}

bool tpass_coord_running(const char *state_dir, unsigned job_id, uid_t uid,
			 const char *node)
{
	char path[TPASS_PATH_MAXLEN + 32], pnode[256];
	unsigned long long start;
	pid_t pid;
	int dfd;

	snprintf(path, sizeof(path), "%s/" TPASS_LAYOUT_JOBS "/%u", state_dir, job_id);
	dfd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (dfd < 0)
		return false;
	if (read_pidfile(dfd, &pid, &start, pnode, sizeof(pnode)) < 0) {
		close(dfd);
		return false;
	}
	close(dfd);
	if (strcmp(pnode, node))
		return true; /* another node's process: cannot tell, assume so */
	return still_ours(pid, start, uid);
}

int tpass_ready_line_valid(const char *line, char *err, size_t errlen)
{
	const char *host, *colon;
	unsigned port;

	if (strncmp(line, "tcp://", 6))
		return tpass_fail(err, errlen,
			    "coordinator ready line '%.80s' does not start with tcp://",
			    line);
	host = line + 6;
	colon = strrchr(host, ':');
	if (!colon || colon == host)
		return tpass_fail(err, errlen,
			    "coordinator ready line '%.80s' is not tcp://ADDR:PORT",
			    line);
	if (tpass_parse_uint(colon + 1, 1, 65535, &port) < 0)
		return tpass_fail(err, errlen,
			    "coordinator ready line '%.80s' has a bad port", line);
	for (const char *p = host; p < colon; p++)
		if (!(isalnum((unsigned char)*p) || *p == '.' || *p == '-' ||
		      *p == '[' || *p == ']' || *p == ':' || *p == '_'))
			return tpass_fail(err, errlen,
				    "coordinator ready line '%.80s' has a bad address",
				    line);
	return 0;
}
