/*
 * local.c - srun (local context).
 *
 * srun --torchpass is accepted only inside a job submitted with
 * 'sbatch --torchpass' (that is how every srun in the batch script gets the
 * option: Slurm hands it down in SLURM_SPANK__SLURM_SPANK_OPTION_torchpass_
 * torchpass, and the batch step exported TORCHPASS_JOB_ID).  Outside such a
 * job there is no coordinator, so it is refused.  spares, policy and
 * snapshot_every are per job: a nested srun may repeat them or give
 * --torchpass=off, nothing else.
 * The checks run from the option callback (see allocator.c for why).
 *
 * Relaunch after a lost node or a rank that died on a live node
 * (relaunch.h): at init srun keeps its own arguments (/proc/self/cmdline),
 * environment and executable, and the job's relaunch count;
 * local_user_init, its step id.  At exit, if the coordinator has since
 * decided a relaunch that ended this srun's step (a node of it was lost, or
 * a rank of it died; the job's host file may name a spare in that node's
 * place), srun says why (tpass_relaunch_message) and execs itself again
 * with them:
 * the batch script's srun goes on as the relaunched step and its exit status
 * is that step's.  srun calls the exit hook from an atexit handler, so the
 * exec replaces srun's exit with the new step.  A relaunch from a whole-job
 * snapshot (the verdict's snapshot=ID) sets TORCHPASS_RESTORE_SNAPSHOT=ID in
 * that environment, and slurmstepd then restores every rank from the
 * snapshot instead of starting the program (remote.c); any other relaunch
 * takes the variable out.
 *
 * Spares (placement.h): an srun whose own options choose its nodes (-N, -w,
 * -x, -m, ...) gets the allocation's environment back at init, before srun
 * reads it, so that it runs as it would in a job without torchpass.  This
 * holds for every srun of a spares=N job, with or without --torchpass.
 */
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "context.h"
#include "coordinator.h"
#include "layout.h"
#include "moved_exit.h"
#include "placement.h"
#include "proc.h"
#include "relaunch.h"
#include "tpass.h"
#include "envnames.h"

extern char **environ;

/* What srun needs to exec itself again (armed at init in a --torchpass job). */
static struct {
	bool armed;
	unsigned job_id;
	unsigned baseline; /* the job's relaunch count when this srun started */
	bool step_known;   /* local_user_init ran: step_id is this srun's step */
	unsigned step_id;
	char exe[PATH_MAX];
	char **argv;
	char **envp;
} again;

static int local_check(const struct tpass_opts *opts)
{
	const char *job = getenv("SLURM_JOB_ID");
	const char *tjob = getenv(TPASS_ENV_JOB_ID);
	const char *spares = getenv(TPASS_ENV_SPARES);
	const char *policy = getenv(TPASS_ENV_POLICY);
	const char *every = getenv(TPASS_ENV_SNAPSHOT_EVERY);
	char mine[64], mine_every[16];

	if (!job || !*job) {
		tpass_error("srun --torchpass outside a batch job is not supported: srun would make its own allocation, which has no batch step to run the coordinator; use 'sbatch --torchpass' and call srun in the batch script");
		return -1;
	}
	if (!tjob || strcmp(tjob, job)) {
		tpass_error("srun --torchpass needs a job submitted with 'sbatch --torchpass'; job %s was not (salloc allocations and plain sbatch jobs cannot use it; drop the option or use --torchpass=off)",
			    job);
		return -1;
	}
	snprintf(mine, sizeof(mine), "%u", opts->spares);
	if ((spares && strcmp(spares, mine)) ||
	    (policy && strcmp(policy, opts->policy))) {
		tpass_error("srun --torchpass=spares=%u,policy=%s differs from job %s's spares=%s,policy=%s: spares and policy are set once per job by sbatch; repeat them or use --torchpass=off",
			    opts->spares, opts->policy, job,
			    spares ? spares : "?", policy ? policy : "?");
		return -1;
	}
	snprintf(mine_every, sizeof(mine_every), "%u", opts->snapshot_every);
	if (every && strcmp(every, mine_every)) {
		tpass_error("srun --torchpass=snapshot_every=%u differs from job %s's snapshot_every=%s: it is set once per job by sbatch; repeat it or use --torchpass=off",
			    opts->snapshot_every, job, every);
		return -1;
	}
	return 0;
}

static char **copy_environ(void)
{
	size_t n = 0;
	char **copy;

	while (environ[n])
		n++;
	copy = calloc(n + 1, sizeof(*copy));
	if (!copy)
		return NULL;
	for (size_t i = 0; i < n; i++) {
		copy[i] = strdup(environ[i]);
		if (!copy[i]) {
			tpass_argv_free(copy);
			return NULL;
		}
	}
	return copy;
}

static void arm_relaunch(void)
{
	const char *job = getenv("SLURM_JOB_ID");
	const char *tjob = getenv(TPASS_ENV_JOB_ID);
	char cmdline[65536], err[TPASS_ERR_MAXLEN];
	struct tpass_relaunch v;
	ssize_t n, len;

	if (!tpass.conf_ok || !job || !tjob || strcmp(job, tjob) ||
	    tpass_parse_uint(job, 1, 4294967295u, &again.job_id) < 0)
		return;
	if (tpass_relaunch_read(tpass.conf.state_dir, again.job_id, &v, err,
				sizeof(err)) < 0) {
		tpass_verbose("no relaunch after a lost node for this srun: %s", err);
		return;
	}
	len = readlink("/proc/self/exe", again.exe, sizeof(again.exe) - 1);
	n = tpass_proc_read(getpid(), "cmdline", cmdline, sizeof(cmdline));
	if (len <= 0 || n <= 0 || (size_t)n >= sizeof(cmdline) - 1)
		return; /* arguments too long to keep: this srun is not relaunched */
	again.exe[len] = '\0';
	again.argv = tpass_argv_split(cmdline, (size_t)n);
	again.envp = copy_environ();
	if (!again.argv || !again.envp) {
		tpass_argv_free(again.argv);
		tpass_argv_free(again.envp);
		again.argv = again.envp = NULL;
		return;
	}
	again.baseline = v.count;
	again.armed = true;
}

/*
 * An srun that places its step itself does not get the job's host file
 * (placement.h).  Only the host file the batch step wrote is taken away,
 * never one the user set.  Runs before srun reads its options.
 */
static void let_srun_place_itself(void)
{
	const char *hostfile = getenv("SLURM_HOSTFILE");
	const char *job = getenv("SLURM_JOB_ID");
	char ours[TPASS_PATH_MAXLEN + 64], cmdline[65536], which[32], name[64];
	char **argv;
	ssize_t n;
	bool places;

	if (!tpass.conf_ok || !hostfile || !job)
		return;
	snprintf(ours, sizeof(ours),
		 "%s/" TPASS_LAYOUT_JOBS "/%s/" TPASS_LAYOUT_HOSTFILE,
		 tpass.conf.state_dir, job);
	if (strcmp(hostfile, ours))
		return;
	n = tpass_proc_read(getpid(), "cmdline", cmdline, sizeof(cmdline));
	if (n <= 0 || (size_t)n >= sizeof(cmdline) - 1)
		return;
	argv = tpass_argv_split(cmdline, (size_t)n);
	places = argv && tpass_srun_places_step(argv, which, sizeof(which));
	tpass_argv_free(argv);
	if (!places)
		return;
	unsetenv("SLURM_HOSTFILE");
	for (int i = 0; tpass_hidden_alloc_vars[i]; i++) {
		const char *var = tpass_hidden_alloc_vars[i];
		const char *alloc;

		snprintf(name, sizeof(name), TPASS_ENV_ALLOC_PREFIX "%s", var);
		alloc = getenv(name);
		if (alloc)
			setenv(var, alloc, 1);
		else
			unsetenv(var);
	}
	tpass_info("srun %s places this step itself: the job's spares are not hidden from it",
		   which);
}

int tpass_local_init(spank_t sp, int ac, char **av)
{
	int rc;

	(void)ac;
	(void)av;
	rc = tpass_option_register(sp, local_check);
	let_srun_place_itself();
	arm_relaunch();
	return rc;
}

/* A --torchpass step's moved ranks may leave their exit code to srun (moved_exit.h). */
static void arm_moved_exit(spank_t sp)
{
	const char *job = getenv("SLURM_JOB_ID");
	const char *tjob = getenv(TPASS_ENV_JOB_ID);
	unsigned job_id;

	if (!tpass_active(sp) || !job || !tjob || strcmp(job, tjob) ||
	    tpass_parse_uint(job, 1, 4294967295u, &job_id) < 0)
		return;
	tpass_moved_exit_arm(sp, job_id);
}

int tpass_local_user_init(spank_t sp, int ac, char **av)
{
	uint32_t step;

	(void)ac;
	(void)av;
	if (again.armed && spank_get_item(sp, S_JOB_STEPID, &step) == ESPANK_SUCCESS) {
		again.step_id = step;
		again.step_known = true;
	}
	arm_moved_exit(sp);
	return 0;
}

static double mono_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Returns unless srun starts its step again (execve). */
static int relaunch_at_exit(spank_t sp, int ac, char **av)
{
	char err[TPASS_ERR_MAXLEN], node[256], msg[1024];
	struct tpass_relaunch v;
	char **envp;
	double deadline = mono_s() + TPASS_RELAUNCH_WAIT_S;
	bool said = false;

	(void)sp;
	(void)ac;
	(void)av;
	if (!again.armed || !tpass.opts.given || tpass.opts.off || tpass.opts_bad)
		return 0;
	tpass_node_name(node, sizeof(node));
	for (;;) {
		enum tpass_relaunch_step next;

		if (tpass_relaunch_read(tpass.conf.state_dir, again.job_id, &v,
					err, sizeof(err)) < 0) {
			tpass_error("job %u: %s; srun exits as it would without torchpass",
				    again.job_id, err);
			return 0;
		}
		next = tpass_relaunch_next(&v, again.baseline, again.step_known,
					   again.step_id,
					   tpass_coord_running(tpass.conf.state_dir,
							       again.job_id,
							       getuid(), node),
					   mono_s() > deadline);
		if (next == TPASS_RELAUNCH_EXIT)
			return 0;
		if (next == TPASS_RELAUNCH_AGAIN)
			break;
		if (!said) {
			tpass_notice("job %u: node %s is silent; waiting for torchpass's verdict before srun exits (at most %ds)",
				     again.job_id, v.node, TPASS_RELAUNCH_WAIT_S);
			said = true;
		}
		usleep(250000);
	}
	/*
	 * The saved environment may hold the variable from an earlier
	 * relaunch from a snapshot: a relaunch from a checkpoint must not
	 * carry it on.
	 */
	envp = tpass_env_set(again.envp, TPASS_ENV_RESTORE_SNAPSHOT,
			     v.snapshot[0] ? v.snapshot : NULL);
	if (!envp) {
		tpass_error("job %u: out of memory; srun exits as it would without torchpass",
			    again.job_id);
		return 0;
	}
	tpass_argv_free(again.envp);
	again.envp = envp;
	tpass_relaunch_message(&v, again.job_id, msg, sizeof(msg));
	tpass_notice("%s", msg);
	fflush(NULL);
	execve(again.exe, again.argv, again.envp);
	tpass_error("job %u: cannot start srun again (%s: %m); srun exits as it would without torchpass",
		    again.job_id, again.exe);
	return 0;
}

int tpass_local_exit(spank_t sp, int ac, char **av)
{
	relaunch_at_exit(sp, ac, av);
	tpass_moved_exit_collect();
	return 0;
}
