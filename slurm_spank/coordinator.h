/*
 * coordinator.h - start and stop the per-job torchpass coordinator.
 *
 * No Slurm calls in here: remote.c and jobscript.c gather the job's
 * identity and pass it in.
 */
#ifndef TPASS_COORDINATOR_H
#define TPASS_COORDINATOR_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include "conf.h"

struct tpass_job {
	unsigned job_id;
	uid_t uid;
	gid_t gid;
	const gid_t *gids;   /* supplementary groups of the job */
	int ngids;
	unsigned spares;
	const char *policy;
	unsigned snapshot_every; /* seconds; 0 = the policy's */
	const char *node;    /* this node's Slurm name */
	char *const *env;    /* environment handed to the coordinator */
	const char *secret;  /* the job secret (TPASS_SECRET_HEX_LEN hex digits) or NULL */
};

/* The per-job secret: 32 random bytes as lowercase hex. */
#define TPASS_SECRET_BYTES 32
#define TPASS_SECRET_HEX_LEN (2 * TPASS_SECRET_BYTES)

struct tpass_coord {
	pid_t pid;
	unsigned long long start_time; /* /proc/PID/stat field 22 */
	char address[256];             /* tcp://ADDR:PORT */
};

/*
 * A fresh job secret from getrandom(2): TPASS_SECRET_HEX_LEN hex digits and
 * a NUL in out (outlen > TPASS_SECRET_HEX_LEN).  The coordinator gets it on
 * a pipe (--secret-fd), the job's tasks as TORCHPASS_JOB_SECRET; it signs
 * every rank.* request (torchpass/jobauth.py).
 */
int tpass_secret_new(char *out, size_t outlen, char *err, size_t errlen);

/*
 * Prepare STATE_DIR/jobs/JOB (owned by the job user), stop a coordinator
 * left by an earlier run of the same job on this node, start
 * COORDINATOR --job-id J --state-dir D --spares N --policy P --ready-fd 3
 * [--secret-fd 4: a pipe holding job->secret, never on the command line]
 * as the job user (detached, own session, stdin /dev/null, stdout/stderr
 * appended to STATE_DIR/jobs/J/coordinator.log), wait up to
 * conf->ready_timeout_s for its "tcp://ADDR:PORT" line and write
 * STATE_DIR/jobs/J/coordinator.pid ("PID STARTTIME NODE").  Must run as root.
 */
int tpass_coord_start(const struct tpass_conf *conf, const struct tpass_job *job,
		      struct tpass_coord *out, char *err, size_t errlen);

/*
 * Stop the coordinator pid if it is still the process we started (same
 * start time, owned by uid): SIGTERM to its process group, SIGKILL after
 * timeout_s.  Returns 0 when it is gone (or was never there), -1 on error.
 */
int tpass_coord_stop(pid_t pid, unsigned long long start_time, uid_t uid,
		     unsigned timeout_s, char *err, size_t errlen);

/*
 * Backstop used by the epilog: read STATE_DIR/jobs/J/coordinator.pid and
 * stop that coordinator if it was started on this node (node name match).
 * *stopped tells whether a live coordinator was found and stopped.
 */
int tpass_coord_stop_from_pidfile(const struct tpass_conf *conf,
				  unsigned job_id, uid_t uid, const char *node,
				  bool *stopped, char *err, size_t errlen);

/*
 * Whether the coordinator of STATE_DIR/jobs/JOB/coordinator.pid still runs
 * (as uid, with its recorded start time).  No pid file: false.  Started on
 * another node than node: true (this node cannot see it).
 */
bool tpass_coord_running(const char *state_dir, unsigned job_id, uid_t uid,
			 const char *node);

/*
 * Check the first line the coordinator writes to its ready fd:
 * "tcp://ADDR:PORT".
 */
int tpass_ready_line_valid(const char *line, char *err, size_t errlen);

#endif /* TPASS_COORDINATOR_H */
