/*
 * moved_exit.c - srun (local context): exit with the codes of the ranks
 * whose launch wrappers left their source node (moved_exit.h).
 */
#include <dirent.h>
#include <errno.h>
#include <spawn.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "envnames.h"
#include "layout.h"
#include "moved_exit.h"
#include "tpass.h"

extern char **environ;

static struct {
	bool armed;
	bool status_known;
	int status; /* what srun passed to exit() */
	unsigned job_id;
	uint32_t step_id;
} moved;

static void keep_status(int status, void *arg)
{
	(void)arg;
	moved.status = status;
	moved.status_known = true;
}

void tpass_moved_exit_arm(spank_t sp, unsigned job_id)
{
	if (moved.armed || !tpass.conf_ok || !tpass.conf.rank_wrapper[0] ||
	    spank_get_item(sp, S_JOB_STEPID, &moved.step_id) != ESPANK_SUCCESS)
		return;
	moved.job_id = job_id;
	if (on_exit(keep_status, NULL) == 0)
		moved.armed = true;
}

/* RANK_DIR/jobJ holds a released record (a directory scan: no Python for an srun without one) */
static bool any_released(const char *rank_dir)
{
	size_t suffix = strlen(TPASS_LAYOUT_RELEASED_SUFFIX);
	struct dirent *d;
	bool found = false;
	DIR *dir = opendir(rank_dir);

	if (!dir)
		return false;
	while (!found && (d = readdir(dir))) {
		size_t n = strlen(d->d_name);

		found = n > suffix && d->d_name[0] != '.' &&
			!strcmp(d->d_name + n - suffix, TPASS_LAYOUT_RELEASED_SUFFIX);
	}
	closedir(dir);
	return found;
}

void tpass_moved_exit_collect(void)
{
	char ranks[TPASS_PATH_MAXLEN + 64], job_ranks[TPASS_PATH_MAXLEN + 96];
	char step[16], status[16];
	char *argv[] = { tpass.conf.rank_wrapper, "--state-dir", ranks,
			 "--collect-moved", step, "--status", status, NULL };
	pid_t pid;
	int rc, ws, code;

	if (!moved.armed || !moved.status_known || !tpass.opts.given ||
	    tpass.opts.off || tpass.opts_bad)
		return;
	snprintf(ranks, sizeof(ranks), "%s/" TPASS_LAYOUT_JOBS "/%u/" TPASS_LAYOUT_RANKS,
		 tpass.conf.state_dir, moved.job_id);
	snprintf(job_ranks, sizeof(job_ranks), "%s/job%u", ranks, moved.job_id);
	if (!any_released(job_ranks))
		return;
	snprintf(step, sizeof(step), "%u", (unsigned)moved.step_id);
	snprintf(status, sizeof(status), "%d", moved.status & 0xff);
	/* the collector follows the coordinator's pid file there */
	setenv(TPASS_ENV_STATE_DIR, tpass.conf.state_dir, 1);
	fflush(NULL);
	rc = posix_spawn(&pid, argv[0], NULL, NULL, argv, environ);
	if (rc) {
		tpass_error("job %u: cannot run %s to collect the exit codes of moved ranks: %s; srun exits with %d",
			    moved.job_id, argv[0], strerror(rc), moved.status & 0xff);
		return;
	}
	while (waitpid(pid, &ws, 0) < 0)
		if (errno != EINTR)
			return;
	if (!WIFEXITED(ws)) {
		tpass_error("job %u: the collector of moved ranks' exit codes ended by signal %d; srun exits with %d",
			    moved.job_id, WIFSIGNALED(ws) ? WTERMSIG(ws) : 0, moved.status & 0xff);
		return;
	}
	code = WEXITSTATUS(ws);
	if (code == (moved.status & 0xff))
		return;
	tpass_info("job %u: step %u's moved ranks ended with exit code %d; srun exits with it",
		   moved.job_id, (unsigned)moved.step_id, code);
	fflush(NULL);
	_exit(code);
}
