/*
 * remote.c - slurmstepd (remote context).
 *
 * Batch step of a --torchpass job (init_post_opt, as root): make the job's
 * secret and start the one coordinator of the job on the batch host.  Every
 * step of a --torchpass job (user_init): export TORCHPASS_* and the runtime's
 * PYTHONPATH to the tasks; in the batch step also export the job secret
 * (TORCHPASS_JOB_SECRET: every srun of the batch script hands it on to its
 * tasks) and hide the hot spares from a plain srun.  Every task of the
 * other steps: a new PID namespace for its children with a root-made init
 * (task_init_privileged, as root), then the rank wrapper (task_init); in a
 * restore step, the root restore agent (task_init_privileged), but only once
 * it took the restore token that the node's tpassd wrote for exactly that
 * restore (token.h): the variables below and the stop marker are the user's
 * to set, so without a token such a step fails with one line and nothing
 * runs as root for it.  A step that
 * srun's exit hook started again from a whole-job snapshot (relaunch.h: its
 * environment holds TORCHPASS_RESTORE_SNAPSHOT=ID) starts no program: each
 * task gets the root restore agent instead of a PID namespace, and runs
 * 'rank_wrapper --restore-snapshot ID --', which restores its rank from
 * snapshot ID.  A job that 'tpassctl snapshot --stop' requeue-held and
 * 'tpassctl resume' released runs its batch script again (stop.h): the
 * batch step's task first writes the output the job printed before it was
 * stopped (STATE_DIR/jobs/J/stopped.out, .err) to its stdout and stderr
 * (task_init), and the step named by the coordinator's marker
 * (STATE_DIR/jobs/J/stopped) restores from its snapshot as a relaunched one
 * does (user_init).  Batch step exit: stop the coordinator (the epilog
 * repeats that as a backstop).
 *
 * Steps of jobs without --torchpass return at the first line of each hook.
 */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <dlfcn.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>

#include <slurm/slurm.h>

#include "context.h"
#include "coordinator.h"
#include "hostlist.h"
#include "layout.h"
#include "placement.h"
#include "pythonpath.h"
#include "relaunch.h"
#include "stop.h"
#include "token.h"
#include "tpass.h"
#include "envnames.h"

/* the PID namespace init, installed beside torchpass.so (tpass_init.c) */
#define TPASS_INIT_PROGRAM "tpass-init"

static struct {
	bool is_batch;
	unsigned job_id;
	uint32_t step_id;
	uid_t uid;
	gid_t gid;
	char node[256];
	bool launch_failed;
	char launch_err[TPASS_ERR_MAXLEN + 256];
	/* TORCHPASS_RESTORE_SNAPSHOT or the stop marker (user_init): ""
	 * starts the program */
	char snapshot[TPASS_SNAPSHOT_ID_MAX + 1];
	/* which restore R.snapshot is: a relaunch (snapshot) or a stopped job's */
	enum tpass_token_kind snapshot_kind;
	/* a --torchpass=off step asked for a restore that no token allows
	 * (task_init_privileged): task_init prints R.launch_err and fails it */
	bool restore_refused;
	bool coord_started;
	struct tpass_coord coord;
	char secret[TPASS_SECRET_HEX_LEN + 1];
} R;

static const char *const exported_vars[] = {
	TPASS_ENV_JOB_ID, TPASS_ENV_COORDINATOR, TPASS_ENV_STATE_DIR,
	TPASS_ENV_SPARES, TPASS_ENV_POLICY, TPASS_ENV_SNAPSHOT_EVERY, TPASS_ENV_NODE,
	TPASS_ENV_SPARE_NODES, TPASS_ENV_ACTIVE_NODES, TPASS_ENV_JOB_SECRET,
	TPASS_ENV_ALLOC_PREFIX "SLURM_JOB_NUM_NODES", TPASS_ENV_ALLOC_PREFIX "SLURM_NNODES",
	TPASS_ENV_ALLOC_PREFIX "SLURM_NTASKS", TPASS_ENV_ALLOC_PREFIX "SLURM_NPROCS",
	NULL,
};

static void launch_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static void launch_fail(const char *fmt, ...)
{
	va_list ap;

	if (R.launch_failed)
		return; /* keep the first reason */
	va_start(ap, fmt);
	vsnprintf(R.launch_err, sizeof(R.launch_err), fmt, ap);
	va_end(ap);
	R.launch_failed = true;
}

static int get_env(spank_t sp, const char *name, char *buf, int len)
{
	return spank_getenv(sp, name, buf, len) == ESPANK_SUCCESS ? 0 : -1;
}

static void identify(spank_t sp)
{
	uint32_t u32 = 0;

	spank_get_item(sp, S_JOB_ID, &u32);
	R.job_id = u32;
	R.step_id = 0;
	spank_get_item(sp, S_JOB_STEPID, &R.step_id);
	R.is_batch = R.step_id == SLURM_BATCH_SCRIPT;
	spank_get_item(sp, S_JOB_UID, &R.uid);
	spank_get_item(sp, S_JOB_GID, &R.gid);
	tpass_node_name(R.node, sizeof(R.node));
}

int tpass_remote_init(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	return tpass_option_register(sp, NULL);
}

/* Environment for the coordinator: Slurm's and the locale, not the user's
 * Python or loader settings (PYTHONPATH, LD_PRELOAD, ...). */
static char **coordinator_env(spank_t sp)
{
	static const char *const keep[] = { "PATH=", "HOME=", "USER=",
					    "LOGNAME=", "LANG=", "LC_",
					    "TZ=", "TMPDIR=", "SLURM_", NULL };
	char **job_env = NULL, **env;
	size_t n = 0, i, k, out = 0;
	bool have_path = false, have_conf = false;
	const char *conf = getenv("SLURM_CONF");

	if (spank_get_item(sp, S_JOB_ENV, &job_env) != ESPANK_SUCCESS)
		job_env = NULL;
	while (job_env && job_env[n])
		n++;
	env = calloc(n + 16, sizeof(*env));
	if (!env)
		return NULL;
	for (i = 0; i < n; i++) {
		for (k = 0; keep[k]; k++)
			if (!strncmp(job_env[i], keep[k], strlen(keep[k])))
				break;
		if (!keep[k] || !strncmp(job_env[i], "SLURM_SPANK_", 12))
			continue;
		if (!strncmp(job_env[i], "PATH=", 5))
			have_path = true;
		if (!strncmp(job_env[i], "SLURM_CONF=", 11))
			have_conf = true;
		env[out++] = strdup(job_env[i]);
	}
	if (!have_path)
		env[out++] = strdup("PATH=/usr/local/bin:/usr/bin:/bin");
	if (!have_conf && conf && *conf &&
	    asprintf(&env[out], "SLURM_CONF=%s", conf) > 0)
		out++;
	if (asprintf(&env[out], TPASS_ENV_JOB_ID "=%u", R.job_id) > 0)
		out++;
	if (asprintf(&env[out], TPASS_ENV_STATE_DIR "=%s", tpass.conf.state_dir) > 0)
		out++;
	if (asprintf(&env[out], TPASS_ENV_SPARES "=%u", tpass.opts.spares) > 0)
		out++;
	if (asprintf(&env[out], TPASS_ENV_POLICY "=%s", tpass.opts.policy) > 0)
		out++;
	if (asprintf(&env[out], TPASS_ENV_SNAPSHOT_EVERY "=%u", tpass.opts.snapshot_every) > 0)
		out++;
	if (asprintf(&env[out], TPASS_ENV_NODE "=%s", R.node) > 0)
		out++;
	env[out] = NULL;
	return env;
}

static void free_env(char **env)
{
	for (size_t i = 0; env && env[i]; i++)
		free(env[i]);
	free(env);
}

static void start_coordinator(spank_t sp)
{
	char err[TPASS_ERR_MAXLEN];
	gid_t *gids = NULL;
	int ngids = 0;
	struct tpass_job job = { 0 };
	char **env;

	if (spank_get_item(sp, S_JOB_SUPPLEMENTARY_GIDS, &gids, &ngids) !=
	    ESPANK_SUCCESS) {
		gids = &R.gid;
		ngids = 1;
	}
	if (tpass_secret_new(R.secret, sizeof(R.secret), err, sizeof(err)) < 0) {
		launch_fail("job %u: %s", R.job_id, err);
		return;
	}
	env = coordinator_env(sp);
	if (!env) {
		launch_fail("out of memory");
		return;
	}
	job.job_id = R.job_id;
	job.uid = R.uid;
	job.gid = R.gid;
	job.gids = gids;
	job.ngids = ngids;
	job.spares = tpass.opts.spares;
	job.policy = tpass.opts.policy;
	job.snapshot_every = tpass.opts.snapshot_every;
	job.node = R.node;
	job.env = env;
	job.secret = R.secret;
	if (tpass_coord_start(&tpass.conf, &job, &R.coord, err, sizeof(err)) < 0) {
		launch_fail("job %u: %s", R.job_id, err);
	} else {
		R.coord_started = true;
		tpass_info("job %u: coordinator pid %d on %s at %s", R.job_id,
			   (int)R.coord.pid, R.node, R.coord.address);
	}
	free_env(env);
}

/*
 * The job's nodes (*hosts, free with tpass_hostlist_free), refusing
 * spares >= nodes; launch_fail() says why it failed.  (The job environment
 * already holds SLURM_JOB_NODELIST in the batch step's init_post_opt;
 * S_JOB_NNODES is 0 for the batch step.)
 */
static int job_hosts(spank_t sp, char ***hosts, size_t *n)
{
	char nodelist[8192], err[TPASS_ERR_MAXLEN];

	*hosts = NULL;
	*n = 0;
	if (get_env(sp, "SLURM_JOB_NODELIST", nodelist, sizeof(nodelist)) < 0) {
		launch_fail("spares=%u: SLURM_JOB_NODELIST is not set",
			    tpass.opts.spares);
		return -1;
	}
	if (tpass_hostlist_expand(nodelist, hosts, n, err, sizeof(err)) < 0) {
		launch_fail("spares=%u: %s", tpass.opts.spares, err);
		return -1;
	}
	if (tpass.opts.spares >= *n) {
		launch_fail("--torchpass=spares=%u needs at least %u nodes but job %u has %zu; submit with -N %u or more, or ask for fewer spares",
			    tpass.opts.spares, tpass.opts.spares + 1, R.job_id,
			    *n, tpass.opts.spares + 1);
		tpass_hostlist_free(*hosts, *n);
		*hosts = NULL;
		*n = 0;
		return -1;
	}
	return 0;
}

/* Batch step: refuse spares >= nodes before anything is started. */
static int check_spares(spank_t sp)
{
	char **hosts;
	size_t n;

	if (tpass.opts.spares == 0)
		return 0;
	if (job_hosts(sp, &hosts, &n) < 0)
		return -1;
	tpass_hostlist_free(hosts, n);
	return 0;
}

int tpass_remote_init_post_opt(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	if (!tpass_active(sp))
		return 0;
	identify(sp);
	if (tpass.opts_bad) {
		launch_fail("%s", tpass.opts_err);
		return 0;
	}
	if (!tpass.conf_ok) {
		launch_fail("the torchpass plugin is misconfigured on node %s (%s); ask your administrator",
			    R.node, tpass.conf_err);
		return 0;
	}
	if (R.is_batch && check_spares(sp) == 0)
		start_coordinator(sp);
	return 0;
}

static int set_env(spank_t sp, const char *name, const char *value)
{
	spank_err_t rc = spank_setenv(sp, name, value, 1);

	if (rc != ESPANK_SUCCESS) {
		launch_fail("cannot set %s: %s", name, spank_strerror(rc));
		return -1;
	}
	return 0;
}

/*
 * Batch step with spares=N: the last N nodes of the allocation are hot
 * spares.  A plain srun in the batch script must run on the others only,
 * every time.  srun 24.11 has no environment variable for --exclude, and a
 * smaller SLURM_JOB_NUM_NODES alone lets the step land on a spare whenever
 * an active node is still releasing the previous step, so the plugin writes
 * a host file (STATE_DIR/jobs/J/hostfile: each active node once per task, in
 * the order of the job's distribution, SLURM_DISTRIBUTION: block unless
 * sbatch -m said cyclic or plane; placement.h) and exports
 * SLURM_HOSTFILE, with SLURM_JOB_NUM_NODES/SLURM_NNODES and
 * SLURM_NTASKS/SLURM_NPROCS reduced to match (their values before are kept
 * as TORCHPASS_ALLOC_<name>, for an srun that places itself: placement.h).
 * Runs as the job user.
 */
static int write_hostfile(char **hosts, const size_t *order, size_t ntasks,
			  char *path, size_t pathlen)
{
	FILE *f;
	int fd;

	snprintf(path, pathlen,
		 "%s/" TPASS_LAYOUT_JOBS "/%u/" TPASS_LAYOUT_HOSTFILE,
		 tpass.conf.state_dir,
		 R.job_id);
	fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC,
		  0644);
	if (fd < 0) {
		launch_fail("spares=%u: cannot write %s: %s",
			    tpass.opts.spares, path, strerror(errno));
		return -1;
	}
	f = fdopen(fd, "w");
	if (!f) {
		close(fd);
		launch_fail("spares=%u: cannot write %s", tpass.opts.spares,
			    path);
		return -1;
	}
	for (size_t t = 0; t < ntasks; t++)
		fprintf(f, "%s\n", hosts[order[t]]);
	if (fclose(f) != 0) {
		launch_fail("spares=%u: cannot write %s", tpass.opts.spares,
			    path);
		return -1;
	}
	return 0;
}

/* The allocation's values of what hide_spares lowers (placement.h). */
static int keep_alloc_env(spank_t sp)
{
	char name[64], value[1024];

	for (int i = 0; tpass_hidden_alloc_vars[i]; i++) {
		snprintf(name, sizeof(name), TPASS_ENV_ALLOC_PREFIX "%s",
			 tpass_hidden_alloc_vars[i]);
		if (get_env(sp, tpass_hidden_alloc_vars[i], value,
			    sizeof(value)) == 0) {
			if (set_env(sp, name, value) < 0)
				return -1;
		} else {
			spank_unsetenv(sp, name);
		}
	}
	return 0;
}

/*
 * The host file's task order (placement.h): the job's distribution, as a
 * plain srun would lay its tasks out without the host file.  One srun does
 * not know (arbitrary, a distribution of its own): block, said once.
 */
static int host_order(spank_t sp, const unsigned long *counts, size_t active,
		      unsigned long tasks, size_t **order)
{
	char dist[64] = "", plane[32] = "", err[TPASS_ERR_MAXLEN];
	unsigned long plane_size = 0;

	*order = calloc(tasks ? tasks : 1, sizeof(**order));
	if (!*order) {
		launch_fail("out of memory");
		return -1;
	}
	if (get_env(sp, "SLURM_DISTRIBUTION", dist, sizeof(dist)) < 0)
		dist[0] = '\0';
	if (get_env(sp, "SLURM_DIST_PLANESIZE", plane, sizeof(plane)) == 0)
		plane_size = strtoul(plane, NULL, 10);
	if (tpass_hostfile_order(dist, plane_size, counts, active, *order,
				 tasks, err, sizeof(err)) >= 0)
		return 0;
	tpass_error("job %u: spares=%u: %s; a plain srun in the batch script lays its tasks out in blocks on the active nodes",
		    R.job_id, tpass.opts.spares, err);
	if (tpass_hostfile_order(NULL, 0, counts, active, *order, tasks, err,
				 sizeof(err)) < 0) {
		launch_fail("spares=%u: %s", tpass.opts.spares, err);
		return -1;
	}
	return 0;
}

static int hide_spares(spank_t sp)
{
	char buf[8192], tpn[1024], err[TPASS_ERR_MAXLEN];
	char path[TPASS_PATH_MAXLEN + 64];
	size_t *order = NULL;
	unsigned long *counts = NULL, tasks = 0;
	char **hosts = NULL;
	size_t n = 0, active, i;
	int rc = -1;

	if (job_hosts(sp, &hosts, &n) < 0)
		return -1;
	active = n - tpass.opts.spares;
	counts = calloc(n, sizeof(*counts));
	if (!counts) {
		launch_fail("out of memory");
		goto out;
	}
	if (get_env(sp, "SLURM_TASKS_PER_NODE", tpn, sizeof(tpn)) == 0) {
		if (tpass_tasks_per_node(tpn, active, counts, &tasks, err,
					 sizeof(err)) < 0) {
			launch_fail("spares=%u: %s", tpass.opts.spares, err);
			goto out;
		}
	} else {
		for (i = 0; i < active; i++)
			counts[i] = 1;
		tasks = active;
	}
	if (host_order(sp, counts, active, tasks, &order) < 0 ||
	    write_hostfile(hosts, order, tasks, path, sizeof(path)) < 0)
		goto out;
	if (tpass_hostlist_join(hosts, active, n, buf, sizeof(buf)) < 0 ||
	    set_env(sp, TPASS_ENV_SPARE_NODES, buf) < 0)
		goto out;
	if (tpass_hostlist_join(hosts, 0, active, buf, sizeof(buf)) < 0 ||
	    set_env(sp, TPASS_ENV_ACTIVE_NODES, buf) < 0)
		goto out;
	if (keep_alloc_env(sp) < 0 || set_env(sp, "SLURM_HOSTFILE", path) < 0)
		goto out;
	snprintf(buf, sizeof(buf), "%zu", active);
	if (set_env(sp, "SLURM_JOB_NUM_NODES", buf) < 0 ||
	    set_env(sp, "SLURM_NNODES", buf) < 0)
		goto out;
	snprintf(buf, sizeof(buf), "%lu", tasks);
	if (set_env(sp, "SLURM_NTASKS", buf) < 0 ||
	    set_env(sp, "SLURM_NPROCS", buf) < 0)
		goto out;
	rc = 0;
out:
	if (rc < 0 && !R.launch_failed)
		launch_fail("spares=%u: node list too long", tpass.opts.spares);
	free(order);
	free(counts);
	tpass_hostlist_free(hosts, n);
	return rc;
}

static void strip_env(spank_t sp)
{
	char old[8192], buf[8192];

	for (int i = 0; exported_vars[i]; i++)
		spank_unsetenv(sp, exported_vars[i]);
	if (tpass.conf_ok && tpass.conf.runtime_path[0] &&
	    get_env(sp, "PYTHONPATH", old, sizeof(old)) == 0 &&
	    tpass_pythonpath_strip(old, tpass.conf.runtime_path, buf,
				   sizeof(buf)) == 0) {
		if (buf[0])
			spank_setenv(sp, "PYTHONPATH", buf, 1);
		else
			spank_unsetenv(sp, "PYTHONPATH");
	}
}

static int export_env(spank_t sp)
{
	char buf[8192], old[8192];
	bool runtime = true;

	snprintf(buf, sizeof(buf), "%u", R.job_id);
	if (set_env(sp, TPASS_ENV_JOB_ID, buf) < 0 ||
	    set_env(sp, TPASS_ENV_STATE_DIR, tpass.conf.state_dir) < 0 ||
	    set_env(sp, TPASS_ENV_POLICY, tpass.opts.policy) < 0 ||
	    set_env(sp, TPASS_ENV_NODE, R.node) < 0)
		return -1;
	snprintf(buf, sizeof(buf), "%u", tpass.opts.spares);
	if (set_env(sp, TPASS_ENV_SPARES, buf) < 0)
		return -1;
	snprintf(buf, sizeof(buf), "%u", tpass.opts.snapshot_every);
	if (set_env(sp, TPASS_ENV_SNAPSHOT_EVERY, buf) < 0)
		return -1;
	if (R.coord_started &&
	    (set_env(sp, TPASS_ENV_COORDINATOR, R.coord.address) < 0 ||
	     set_env(sp, TPASS_ENV_JOB_SECRET, R.secret) < 0))
		return -1;

	if (get_env(sp, TPASS_ENV_RUNTIME, buf, sizeof(buf)) == 0) {
		if (!strcmp(buf, "0"))
			runtime = false;
		else if (strcmp(buf, "1")) {
			launch_fail(TPASS_ENV_RUNTIME "='%.64s' is invalid; allowed: 0 (do not load the torchpass runtime into Python) or 1",
				    buf);
			return -1;
		}
	}
	if (runtime && tpass.conf.runtime_path[0]) {
		if (get_env(sp, "PYTHONPATH", old, sizeof(old)) < 0)
			old[0] = '\0';
		if (tpass_pythonpath_prepend(old, tpass.conf.runtime_path, buf,
					     sizeof(buf)) < 0) {
			launch_fail("PYTHONPATH is too long");
			return -1;
		}
		if (set_env(sp, "PYTHONPATH", buf) < 0)
			return -1;
	}
	if (R.is_batch && tpass.opts.spares > 0 && hide_spares(sp) < 0)
		return -1;
	return 0;
}

/*
 * Does this task run under the rank wrapper?  Every task of a --torchpass
 * job step (not the batch script) that launched without error, when
 * plugstack.conf names a rank_wrapper.
 */
static bool wraps_rank(void)
{
	return tpass.opts.given && !tpass.opts.off && !R.launch_failed &&
	       !R.is_batch && tpass.conf_ok && tpass.conf.rank_wrapper[0];
}

/*
 * A job stopped by 'tpassctl snapshot --stop' and released by 'tpassctl
 * resume' runs its batch script again, and its steps are numbered from 0
 * again (Slurm resets them on requeue), so the step the snapshot was taken
 * of comes again with the id the coordinator's marker names (stop.h).  That
 * step restores from the marker's snapshot, as a relaunched one does, and
 * its tasks see the id in TORCHPASS_RESTORE_SNAPSHOT (the wrapper takes it
 * from its argv; the variable tells the runtime).  Any other step, or any
 * step when there is no marker, starts its program.
 *
 * The marker is the job user's file, and this hook runs with the user's
 * effective uid but root's real one: stop.c reads only a regular file the
 * job's uid owns.  A marker that fails that, or does not parse, is said in
 * one line (on every node of every wrapped step: each reads it) and the
 * step starts its program.  Unlike a bad TORCHPASS_RESTORE_SNAPSHOT, it
 * does not fail the launch: a marker that cannot be read names no step, so
 * that would fail every wrapped step of the job until its owner removed it.
 */
static void restore_stopped(spank_t sp)
{
	char snap[TPASS_SNAPSHOT_ID_MAX + 1], err[TPASS_ERR_MAXLEN];
	unsigned step;
	bool found;
	spank_err_t rc;

	if (tpass_stopped_read(tpass.conf.state_dir, R.job_id, R.uid, snap,
			       sizeof(snap), &step, &found, err,
			       sizeof(err)) < 0) {
		tpass_error("job %u: %s; step %u starts its program, nothing is restored",
			    R.job_id, err, (unsigned)R.step_id);
		return;
	}
	if (!found || step != R.step_id)
		return;
	snprintf(R.snapshot, sizeof(R.snapshot), "%s", snap);
	R.snapshot_kind = TPASS_TOKEN_STOPPED;
	tpass_info("job %u: step %u was stopped by tpassctl snapshot --stop: every rank restores from snapshot %s",
		   R.job_id, (unsigned)R.step_id, R.snapshot);
	rc = spank_setenv(sp, TPASS_ENV_RESTORE_SNAPSHOT, R.snapshot, 1);
	if (rc != ESPANK_SUCCESS)
		tpass_error("job %u: cannot set " TPASS_ENV_RESTORE_SNAPSHOT " for step %u: %s; its ranks restore from snapshot %s all the same",
			    R.job_id, (unsigned)R.step_id, spank_strerror(rc),
			    R.snapshot);
}

/*
 * A step of wrapped ranks that srun's exit hook started again from a
 * whole-job snapshot (local.c) carries TORCHPASS_RESTORE_SNAPSHOT=ID: keep
 * ID in R.snapshot, which task_init_privileged and task_init read (they run
 * in each task, forked after this hook).  A value that is not a snapshot id
 * fails the launch: starting the program afresh instead would quietly drop
 * what the job had done since its last checkpoint.  Without the variable,
 * the step may be one a stopped job restores (restore_stopped).
 */
static void restore_snapshot_of(spank_t sp)
{
	char val[256] = "";
	spank_err_t rc;

	rc = spank_getenv(sp, TPASS_ENV_RESTORE_SNAPSHOT, val, sizeof(val));
	if (rc == ESPANK_ENV_NOEXIST) {
		restore_stopped(sp);
		return;
	}
	if (rc != ESPANK_SUCCESS && rc != ESPANK_NOSPACE) {
		launch_fail("cannot read " TPASS_ENV_RESTORE_SNAPSHOT ": %s; the step cannot be restored",
			    spank_strerror(rc));
		return;
	}
	val[sizeof(val) - 1] = '\0'; /* ESPANK_NOSPACE: cut short */
	if (rc != ESPANK_SUCCESS || !tpass_snapshot_id_valid(val)) {
		launch_fail(TPASS_ENV_RESTORE_SNAPSHOT "='%.70s' is not a snapshot id; the step cannot be restored",
			    val);
		return;
	}
	snprintf(R.snapshot, sizeof(R.snapshot), "%s", val);
	R.snapshot_kind = TPASS_TOKEN_SNAPSHOT;
}

/*
 * Every step of a --torchpass job, once per node, with the job user's
 * effective uid, before its tasks are forked: the environment (export_env),
 * and for a step of wrapped ranks whether it restores from a whole-job
 * snapshot instead of starting its program (restore_snapshot_of: a
 * relaunch, or the step a stopped job restores).
 */
int tpass_remote_user_init(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	if (!tpass.opts.given && !tpass_active(sp))
		return 0;
	if (!R.job_id)
		identify(sp);
	if (tpass.opts.off) {
		strip_env(sp);
		return 0;
	}
	if (!R.launch_failed && export_env(sp) < 0)
		strip_env(sp);
	if (wraps_rank())
		restore_snapshot_of(sp);
	if (R.launch_failed) {
		/* to the job's stderr and the slurmd log; task_init fails the task */
		tpass_error("%s", R.launch_err);
		return -1;
	}
	return 0;
}

/*
 * May root execute path for a job?  A regular executable (not a symlink)
 * owned by root and writable by root alone; -1 (and why, in err) otherwise.
 */
static int root_program(const char *path, char *err, size_t errlen)
{
	struct stat st;

	if (lstat(path, &st) < 0) {
		snprintf(err, errlen, "%s: %s", path, strerror(errno));
		return -1;
	}
	if (!S_ISREG(st.st_mode) || st.st_uid != 0 || (st.st_mode & 022) ||
	    !(st.st_mode & S_IXUSR)) {
		snprintf(err, errlen, "%s is not a root-owned executable writable by root alone", path);
		return -1;
	}
	return 0;
}

/*
 * tpass-init, beside this plugin (same directory as torchpass.so), if it is
 * a regular executable owned by root and writable by root alone: what the
 * PID namespace's init execs.  -1 (and why, in err) otherwise.
 */
static int init_program(char *path, size_t len, char *err, size_t errlen)
{
	Dl_info info;
	char *slash;

	if (!dladdr((void *)&init_program, &info) || !info.dli_fname ||
	    info.dli_fname[0] != '/') {
		snprintf(err, errlen, "cannot tell where torchpass.so is");
		return -1;
	}
	snprintf(path, len, "%s", info.dli_fname);
	slash = strrchr(path, '/');
	snprintf(slash + 1, len - (size_t)(slash + 1 - path), "%s", TPASS_INIT_PROGRAM);
	return root_program(path, err, errlen);
}

/*
 * In the forked child: exec tpass-init UID GID TASK [GID...] as root, with
 * EXEC_R as its fd 3: the read end of a pipe whose write end the task keeps
 * close-on-exec, so tpass-init reads EOF once the task has exec'd, which
 * slurmstepd lets it do only after it placed the task in the step's
 * cgroups; tpass-init then joins them (tpass_init.c).  -1: no such pipe.
 */
static void __attribute__((noreturn)) exec_init(spank_t sp, const char *prog, pid_t task, int exec_r)
{
	char *argv[4 + 256 + 1], ids[3 + 256][16];
	char *const envp[] = { "PATH=/usr/sbin:/usr/bin:/sbin:/bin", NULL };
	gid_t *gids = NULL;
	int ngids = 0, n = 0;

	if (spank_get_item(sp, S_JOB_SUPPLEMENTARY_GIDS, &gids, &ngids) != ESPANK_SUCCESS)
		ngids = 0;
	if (ngids > 256)
		ngids = 256;
	snprintf(ids[0], sizeof(ids[0]), "%u", (unsigned)R.uid);
	snprintf(ids[1], sizeof(ids[1]), "%u", (unsigned)R.gid);
	snprintf(ids[2], sizeof(ids[2]), "%d", (int)task);
	argv[n++] = (char *)prog;
	for (int i = 0; i < 3; i++)
		argv[n++] = ids[i];
	for (int i = 0; i < ngids; i++) {
		snprintf(ids[3 + i], sizeof(ids[3 + i]), "%u", (unsigned)gids[i]);
		argv[n++] = ids[3 + i];
	}
	argv[n] = NULL;
	if (exec_r == 3)
		fcntl(3, F_SETFD, 0);
	else if (exec_r < 0 || dup2(exec_r, 3) < 0)
		close(3);
	syscall(SYS_close_range, 4U, ~0U, 0);
	execve(prog, argv, envp);
	_exit(127);
}

/*
 * In the task, as root, before Slurm switches to the job user.
 *
 * Launch steps: unshare(CLONE_NEWPID), so the task's children land in a new
 * PID namespace, and fork its PID 1: tpass-init (tpass_init.c), executed as
 * root, which becomes the job's uid/gids/groups with CAP_SYS_ADMIN only
 * (CRIU needs it in the root of a dumped tree).  The rank wrapper, running
 * as the user, sees that /proc/self/ns/pid differs from pid_for_children
 * and that its child is that init, and double-forks the rank into the
 * namespace, where it is reparented to the init.  The task itself stays in
 * the node's namespace (Slurm tracks and signals it as before).  User code
 * never holds a capability.  A failure never fails the task: without
 * tpass-init nothing is unshared and the wrapper runs the rank as it can
 * (unprotected for an ordinary user).
 *
 * Restore steps (the coordinator's srun --torchpass=off carries
 * TORCHPASS_RESTORE_RANK=R, and tpassd wrote its migration token): the task
 * becomes a child subreaper (kept
 * across setuid and execve) and forks a root restore agent (the rank
 * program restore_agent, clean environment, fds >= 3 closed) that
 * checks the user-side wrapper's request and runs criu restore -d
 * (torchpass.checkpoint.restore_agent); the restored tree is reparented to
 * the task, in the restore step, and its exit status is the step's.
 *
 * Steps relaunched from a whole-job snapshot (a --torchpass step whose
 * environment holds TORCHPASS_RESTORE_SNAPSHOT=ID, or the step of a stopped
 * job that the marker STATE_DIR/jobs/J/stopped names; user_init): no PID
 * namespace and no tpass-init (the snapshot's images hold the rank's own);
 * once it took the node's snapshot (or stopped) token, bound to this step,
 * the task forks the same root restore agent, for rank S_TASK_GLOBAL_ID of
 * this job, and task_init runs 'rank_wrapper --restore-snapshot ID --',
 * which asks the agent to restore that rank from snapshot ID.  Unlike a
 * launch step's, a failure here fails the task (with the reason, as a
 * launch error): a rank that cannot be restored must not start afresh.
 *
 * The first process the task forks becomes the namespace's PID 1: that is
 * tpass-init, so a TaskProlog no longer takes that place.
 */
static void __attribute__((noreturn)) exec_agent(const char *job, const char *rank, pid_t task,
						  const struct tpass_token *tok)
{
	char tpid[32], uid[32], which[TPASS_SNAPSHOT_ID_MAX + 16];
	const char *flag = "--snapshot";
	char *const envp[] = { "PATH=/usr/sbin:/usr/bin:/sbin:/bin", NULL };

	syscall(SYS_close_range, 3U, ~0U, 0);
	snprintf(tpid, sizeof(tpid), "%d", (int)task);
	snprintf(uid, sizeof(uid), "%u", (unsigned)R.uid);
	/* the images the token allows: the agent refuses any others */
	if (tok->kind == TPASS_TOKEN_MIGRATION) {
		flag = "--generation";
		snprintf(which, sizeof(which), "%u", tok->generation);
	} else {
		snprintf(which, sizeof(which), "%s", tok->snapshot);
	}
	/* a node whose GPUs NVML does not describe (the devcluster's fake
	 * GPUs) names their inventory in plugstack.conf */
	if (tpass.conf.gpu_inventory[0])
		execle(tpass.conf.restore_agent, tpass.conf.restore_agent,
		       "--job", job, "--rank", rank, "--task-pid", tpid, "--uid", uid,
		       "--jobs-state-dir", tpass.conf.state_dir, flag, which,
		       "--gpu-inventory", tpass.conf.gpu_inventory, (char *)NULL, envp);
	else
		execle(tpass.conf.restore_agent, tpass.conf.restore_agent,
		       "--job", job, "--rank", rank, "--task-pid", tpid, "--uid", uid,
		       "--jobs-state-dir", tpass.conf.state_dir, flag, which,
		       (char *)NULL, envp);
	_exit(127);
}

/*
 * Take the restore token for want (token.h) from this node's token
 * directory: 0 with *tok filled in; -1 (and the one line a user sees, in
 * err) if there is none or it does not match.  Logged either way: a
 * refusal is something a site wants to know of.
 */
static int take_token(const struct tpass_token_want *want,
		      struct tpass_token *tok, char *err, size_t errlen)
{
	char why[TPASS_ERR_MAXLEN + 512];
	int rc;

	rc = tpass_token_take(tpass.conf.restore_tokens, R.node, 0, want,
			      (long long)time(NULL), tok, why, sizeof(why));
	if (rc == 0) {
		tpass_info("job %u: step %u: %s restore of job %u set up by tpassd on %s; starting the restore agent",
			   R.job_id, (unsigned)R.step_id,
			   tpass_token_kind_name(want->kind), want->job, R.node);
		return 0;
	}
	if (rc == -2)
		return tpass_fail(err, errlen,
				  "job %u: step %u asks for a %s restore (%s) that tpassd on %s did not set up (%s); nothing ran. Only torchpass's coordinator starts restores: %s",
				  R.job_id, (unsigned)R.step_id,
				  tpass_token_kind_name(want->kind),
				  want->kind == TPASS_TOKEN_MIGRATION ? TPASS_ENV_RESTORE_RANK :
				  want->kind == TPASS_TOKEN_SNAPSHOT ? TPASS_ENV_RESTORE_SNAPSHOT :
				  "the job's stop marker",
				  R.node, why,
				  want->kind == TPASS_TOKEN_STOPPED ?
				  "remove the stop marker to start the step afresh, or run tpassctl resume again" :
				  "unset " TPASS_ENV_RESTORE_RANK ", " TPASS_ENV_RESTORE_JOB " and " TPASS_ENV_RESTORE_SNAPSHOT " to run a plain step");
	return tpass_fail(err, errlen,
			  "job %u: step %u: the %s restore on %s is refused: %s; nothing was restored",
			  R.job_id, (unsigned)R.step_id,
			  tpass_token_kind_name(want->kind), R.node, why);
}

static bool is_number(const char *s)
{
	return s[0] && strlen(s) <= 10 && strspn(s, "0123456789") == strlen(s);
}

/*
 * Make this task a child subreaper and fork the root restore agent for rank
 * RANK of job JOB (decimal strings), for the images tok allows; -1 (and
 * why, in err) if it cannot.
 */
static int fork_restore_agent(const char *job, const char *rank,
			      const struct tpass_token *tok, char *err,
			      size_t errlen)
{
	char why[TPASS_ERR_MAXLEN + 64];
	pid_t task = getpid(), pid;

	if (root_program(tpass.conf.restore_agent, why, sizeof(why)) < 0)
		return tpass_fail(err, errlen, "job %u: no restore agent: restore_agent %s",
				  R.job_id, why);
	if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0)
		return tpass_fail(err, errlen, "job %u: restore: cannot become a child subreaper: %s",
				  R.job_id, strerror(errno));
	pid = fork();
	if (pid == 0)
		exec_agent(job, rank, task, tok);
	if (pid < 0)
		return tpass_fail(err, errlen, "job %u: restore: cannot fork the restore agent: %s",
				  R.job_id, strerror(errno));
	return 0;
}

/* A --torchpass=off step whose restore is refused: task_init fails it. */
static void refuse_restore(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static void refuse_restore(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(R.launch_err, sizeof(R.launch_err), fmt, ap);
	va_end(ap);
	R.restore_refused = true;
	/* for the site (slurmd's log); the user's one line is task_init's */
	tpass_info("refused: %s", R.launch_err);
}

/*
 * A restore step (a --torchpass=off step with TORCHPASS_RESTORE_RANK or
 * TORCHPASS_RESTORE_JOB): the rank is TORCHPASS_RESTORE_RANK; its job is
 * this step's, or (a restore step in a companion allocation)
 * TORCHPASS_RESTORE_JOB.  The agent starts only if tpassd wrote a
 * migration token for exactly that job, rank, this step's job and owner; it
 * is consumed.  Without one the step fails with one line, and nothing runs
 * as root for it.
 */
static void start_restore_agent(spank_t sp)
{
	char rank[16] = "", job[16] = "", err[TPASS_ERR_MAXLEN + 512];
	bool has_rank, has_job;
	struct tpass_token_want want = { 0 };
	struct tpass_token tok;
	unsigned n;

	has_rank = get_env(sp, TPASS_ENV_RESTORE_RANK, rank, sizeof(rank)) == 0;
	has_job = get_env(sp, TPASS_ENV_RESTORE_JOB, job, sizeof(job)) == 0;
	if (!has_rank && !has_job)
		return;
	if (!has_job)
		snprintf(job, sizeof(job), "%u", R.job_id);
	if (!has_rank || !is_number(rank) || !is_number(job)) {
		refuse_restore("job %u: " TPASS_ENV_RESTORE_RANK "='%.15s' " TPASS_ENV_RESTORE_JOB "='%.15s': not a restore the coordinator starts; nothing was restored (unset both to run a plain step)",
			       R.job_id, rank, job);
		return;
	}
	want.kind = TPASS_TOKEN_MIGRATION;
	want.job = tpass_parse_uint(job, 0, 4294967294u, &n) == 0 ? n : 0;
	want.rank = tpass_parse_uint(rank, 0, 4294967294u, &n) == 0 ? n : 0;
	want.alloc = R.job_id;
	want.uid = (unsigned)R.uid;
	want.step = R.step_id;
	if (take_token(&want, &tok, err, sizeof(err)) < 0) {
		refuse_restore("%s", err);
		return;
	}
	if (fork_restore_agent(job, rank, &tok, err, sizeof(err)) < 0)
		tpass_error("%s", err);
}

/*
 * A step relaunched from snapshot R.snapshot (or a stopped job's): the rank
 * is this task's global id (its SLURM_PROCID), the job this step's.  The
 * agent starts only if tpassd wrote a token of that kind for this job,
 * owner and snapshot on this node (bound to this step by its first task).
 * Without the agent the rank cannot be restored, so the task fails
 * (task_init prints why) rather than have the wrapper wait for an agent
 * that never comes, or start the program afresh.
 */
static void start_snapshot_agent(spank_t sp)
{
	char rank[16], job[16], err[TPASS_ERR_MAXLEN + 512];
	struct tpass_token_want want = { 0 };
	struct tpass_token tok;
	uint32_t gtid;
	spank_err_t rc;

	want.kind = R.snapshot_kind;
	want.job = want.alloc = R.job_id;
	want.uid = (unsigned)R.uid;
	want.step = R.step_id;
	want.snapshot = R.snapshot;
	rc = spank_get_item(sp, S_TASK_GLOBAL_ID, &gtid);
	if (rc != ESPANK_SUCCESS) {
		launch_fail("job %u: no restore agent: cannot tell the task's rank (%s); it cannot be restored from snapshot %s",
			    R.job_id, spank_strerror(rc), R.snapshot);
	} else if (take_token(&want, &tok, err, sizeof(err)) < 0) {
		launch_fail("%s", err);
	} else {
		snprintf(rank, sizeof(rank), "%u", (unsigned)gtid);
		snprintf(job, sizeof(job), "%u", R.job_id);
		if (fork_restore_agent(job, rank, &tok, err, sizeof(err)) < 0)
			launch_fail("%s; rank %s cannot be restored from snapshot %s",
				    err, rank, R.snapshot);
	}
	if (R.launch_failed) /* the user's one line is task_init's */
		tpass_info("refused: %s", R.launch_err);
}

int tpass_remote_task_init_privileged(spank_t sp, int ac, char **av)
{
	char prog[TPASS_PATH_MAXLEN + 64], err[TPASS_ERR_MAXLEN + 64];
	pid_t task = getpid(), pid;
	int exec_pipe[2];

	(void)ac;
	(void)av;
	if (tpass.opts.given && tpass.opts.off && !R.is_batch && tpass.conf_ok &&
	    tpass.conf.rank_wrapper[0]) {
		start_restore_agent(sp);
		return 0;
	}
	if (!wraps_rank())
		return 0;
	if (R.snapshot[0]) {
		start_snapshot_agent(sp);
		return 0;
	}
	if (init_program(prog, sizeof(prog), err, sizeof(err)) < 0) {
		tpass_error("job %u: no init for the rank's PID namespace (%s); ordinary users' ranks run but cannot be migrated",
			    R.job_id, err);
		return 0;
	}
	if (unshare(CLONE_NEWPID) < 0) {
		tpass_error("job %u: cannot make a PID namespace for the rank: %s; it runs but cannot be migrated",
			    R.job_id, strerror(errno));
		return 0;
	}
	if (pipe2(exec_pipe, O_CLOEXEC) < 0) {
		tpass_error("job %u: no pipe for the rank's PID namespace init (%s); under proctrack/cgroup its rank cannot be migrated",
			    R.job_id, strerror(errno));
		exec_pipe[0] = exec_pipe[1] = -1;
	}
	pid = fork();
	if (pid == 0)
		exec_init(sp, prog, task, exec_pipe[0]);
	if (pid < 0)
		tpass_error("job %u: cannot start the rank's PID namespace init: %s; it runs but cannot be migrated",
			    R.job_id, strerror(errno));
	/* the write end stays open, close-on-exec, until this task execs */
	if (exec_pipe[0] >= 0)
		close(exec_pipe[0]);
	return 0;
}

/*
 * The batch step of a job that 'tpassctl snapshot --stop' stopped and
 * 'tpassctl resume' released: Slurm truncated the output and error files
 * when this run of the script started, and the task's fds 1 and 2 are those
 * files (slurmstepd opens them, O_APPEND, and dup2()s them onto the task
 * before task_init).  tpassctl resume copied them to
 * STATE_DIR/jobs/J/stopped.out and .err just before it released the job:
 * writing those copies to fds 1 and 2 before the script runs keeps what the
 * job printed before it was stopped, with the script's output after it.
 * Each copy is removed once it is written whole, so it is written once.
 * (A job whose files Slurm keeps, --open-mode=append or JobFileAppend=1,
 * still has that output in them: a copy made for it is written twice.)  A
 * failure is said in one line and the script runs all the same: the job is
 * not failed over its old output (the copy is left in place to be found).
 */
static void put_stopped_output(void)
{
	static const struct {
		const char *name;
		int fd;
	} out[] = {
		{ TPASS_LAYOUT_STOPPED_OUT, 1 },
		{ TPASS_LAYOUT_STOPPED_ERR, 2 },
	};
	char err[TPASS_ERR_MAXLEN];
	bool found;

	if (!tpass.conf_ok || !R.job_id)
		return;
	for (size_t i = 0; i < sizeof(out) / sizeof(out[0]); i++)
		if (tpass_stopped_output_copy(tpass.conf.state_dir, R.job_id,
					      out[i].name, R.uid, out[i].fd,
					      &found, err, sizeof(err)) < 0)
			tpass_error("job %u: the output kept when the job was stopped: %s; the batch script runs without it",
				    R.job_id, err);
}

/*
 * In the task, before exec, as the job user.  The batch step's task writes
 * the output a stopped job printed before its stop (put_stopped_output);
 * every task of a step of wrapped ranks gets the rank wrapper in front of
 * its program.  plugstack.conf loads torchpass as "optional",
 * and SPANK ignores the return code of an optional plugin's hooks, so a
 * launch error cannot fail the step by returning -1 (which is also what
 * keeps a torchpass problem from ever draining a node).  Instead the task
 * runs /bin/sh that prints the reason to the task's stderr and exits 1, in
 * place of the user's program: the job ends FAILED (exit code 1) with the
 * reason in its output, and nothing was started.
 */
int tpass_remote_task_init(spank_t sp, int ac, char **av)
{
	char msg[sizeof(R.launch_err) + 16];
	const char *argv[] = {
		"/bin/sh", "-c", "printf '%s\\n' \"$0\" >&2; exit 1", msg,
	};
	spank_err_t rc;

	(void)ac;
	(void)av;
	if (!tpass.opts.given)
		return 0;
	if (tpass.opts.off) {
		if (!R.restore_refused)
			return 0;
		goto refuse; /* R.launch_err says why */
	}
	/* first: a launch error below is said after the job's earlier output */
	if (R.is_batch)
		put_stopped_output();
	if (!R.launch_failed) {
		/*
		 * Every rank of a --torchpass job step (not the batch script)
		 * runs under the rank wrapper, which makes it movable with
		 * CRIU (PID 1 of its own PID namespace, hand-off markers).
		 */
		/* a moved rank's exit code is collected by srun (moved_exit.h) */
		const char *wrap[] = { tpass.conf.rank_wrapper, "--on-handoff",
				       "release", "--" };
		/* a relaunch from a snapshot: the wrapper ignores the program */
		const char *restore[] = { tpass.conf.rank_wrapper,
					  "--restore-snapshot", R.snapshot,
					  "--" };

		if (!wraps_rank())
			return 0;
		if (!R.snapshot[0]) {
			rc = spank_prepend_task_argv(sp, 4, wrap);
			if (rc != ESPANK_SUCCESS)
				tpass_error("cannot start the task under rank_wrapper %s: %s; it runs but cannot be migrated",
					    tpass.conf.rank_wrapper, spank_strerror(rc));
			return 0;
		}
		rc = spank_prepend_task_argv(sp, 4, restore);
		if (rc == ESPANK_SUCCESS)
			return 0;
		/* the program must not start afresh in place of the rank */
		launch_fail("cannot start the task under rank_wrapper %s: %s; it cannot be restored from snapshot %s",
			    tpass.conf.rank_wrapper, spank_strerror(rc),
			    R.snapshot);
		tpass_error("%s", R.launch_err);
	}
refuse:
	snprintf(msg, sizeof(msg), "tpass: %s", R.launch_err);
	rc = spank_prepend_task_argv(sp, 4, argv);
	if (rc != ESPANK_SUCCESS)
		tpass_error("cannot stop the task after a launch error: %s",
			    spank_strerror(rc));
	return -1;
}

int tpass_remote_exit(spank_t sp, int ac, char **av)
{
	char err[TPASS_ERR_MAXLEN];

	(void)sp;
	(void)ac;
	(void)av;
	if (!R.coord_started)
		return 0;
	R.coord_started = false;
	if (tpass_coord_stop(R.coord.pid, R.coord.start_time, R.uid,
			     tpass.conf.stop_timeout_s, err, sizeof(err)) < 0)
		tpass_error("job %u: %s", R.job_id, err);
	else
		tpass_info("job %u: coordinator pid %d stopped", R.job_id,
			   (int)R.coord.pid);
	return 0;
}
