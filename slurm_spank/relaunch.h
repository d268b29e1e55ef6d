/*
 * relaunch.h - the coordinator's relaunch verdict, as srun's exit hook reads
 * it (no Slurm calls).
 *
 * When a node of a --torchpass job is lost outright and the job has a restore
 * point (an application checkpoint or a whole-job snapshot) and a hot spare,
 * the coordinator rewrites
 * the job's host file (the spare in the lost node's place) and counts one
 * more relaunch in STATE_DIR/jobs/J/relaunch:
 *
 *   count=N        relaunches decided in the job so far
 *   pending=0|1    1 while a silent node of the job may lead to one
 *   node=NAME      the node concerned (for the message)
 *   steps=S,S,...  the job's steps the relaunch ended (those with a task on
 *                  the lost node); absent when the coordinator could not
 *                  list them, then any ending srun is relaunched
 *   snapshot=ID    the relaunch restores whole-job snapshot ID (every rank
 *                  from its CRIU images) instead of the application's
 *                  checkpoint; absent for a relaunch from a checkpoint
 *   cause=lost_node|rank_died
 *                  what ended the step: node= was lost outright, or a
 *                  rank died on node=, which is still up (a GPU fault, an
 *                  OOM kill, a bug in the script); absent: lost_node (a
 *                  coordinator before the key), another value: not known
 *   spares=S,S,... the spares in the replaced nodes' places (at most
 *                  255 characters); absent or empty: the step starts
 *                  again on the same nodes
 *
 * srun remembers count when it starts, and its step id once the step exists
 * (local_user_init).  At its exit it waits while pending=1 and the
 * coordinator runs, and execs itself again, with its own arguments and
 * environment, if count grew and its step is one the relaunch ended: an
 * srun of the batch script that ran elsewhere and ends later is not run
 * again.  With snapshot=ID, the relaunched srun carries
 * TORCHPASS_RESTORE_SNAPSHOT=ID (tpass_env_set), and slurmstepd restores
 * every rank of its step from snapshot ID instead of starting the program
 * (remote.c); without, that variable is taken out of the environment, so a
 * later relaunch from a checkpoint starts the program again.
 * The file is the job user's (written by the coordinator, which runs as the
 * job user), read by the job user's srun: no privilege is involved.
 */
#ifndef TPASS_RELAUNCH_H
#define TPASS_RELAUNCH_H

#include <stdbool.h>
#include <stddef.h>

#include "envnames.h"

/* How long srun's exit hook waits for a pending verdict at most. */
#define TPASS_RELAUNCH_WAIT_S 300
#define TPASS_RELAUNCH_MAX_STEPS 64
/* A snapshot id: 1..64 of [A-Za-z0-9_-] (torchpass.layout.valid_snapshot_id). */
#define TPASS_SNAPSHOT_ID_MAX 64
/* What carries snapshot=ID from srun's exit hook to slurmstepd: TPASS_ENV_RESTORE_SNAPSHOT (envnames.h). */

enum tpass_relaunch_cause {
	TPASS_CAUSE_LOST_NODE,
	TPASS_CAUSE_RANK_DIED,
	TPASS_CAUSE_UNKNOWN,    /* a value this plugin does not know */
};

struct tpass_relaunch {
	unsigned count;
	bool pending;
	char node[256];
	enum tpass_relaunch_cause cause;
	char spares[256];   /* "": none, the same nodes */
	bool steps_known;   /* steps= given */
	unsigned nsteps;
	unsigned steps[TPASS_RELAUNCH_MAX_STEPS];
	char snapshot[TPASS_SNAPSHOT_ID_MAX + 1]; /* "": no snapshot= */
};

/*
 * Can id name a snapshot (its directory and manifest)?  The same test as
 * torchpass.layout.valid_snapshot_id: no separator, dot or oddity.
 */
bool tpass_snapshot_id_valid(const char *id);

/*
 * Parse the verdict text: "key=value" lines, count required, unknown keys
 * ignored (a newer coordinator may add some).  -1 with err on bad input.
 */
int tpass_relaunch_parse(const char *text, struct tpass_relaunch *out,
			 char *err, size_t errlen);

/*
 * Read STATE_DIR/jobs/JOB/relaunch.  No file: count 0, nothing pending
 * (returns 0).  -1 with err when it cannot be read or parsed.
 */
int tpass_relaunch_read(const char *state_dir, unsigned job_id,
			struct tpass_relaunch *out, char *err, size_t errlen);

/*
 * The line srun's exit hook prints (after "tpass: ") when it starts the step
 * of job job_id again for verdict v: what ended the step, where it starts
 * again, from what.  Cut to buflen.
 */
void tpass_relaunch_message(const struct tpass_relaunch *v, unsigned job_id,
			    char *buf, size_t buflen);

/* What srun's exit hook does with a verdict. */
enum tpass_relaunch_step {
	TPASS_RELAUNCH_EXIT,    /* exit as srun would without torchpass */
	TPASS_RELAUNCH_WAIT,    /* read the verdict again shortly */
	TPASS_RELAUNCH_AGAIN,   /* exec srun again */
};

/*
 * The exit hook's choice for verdict v, given the count when this srun
 * started, its step (step_known false: local_user_init never told it),
 * whether the coordinator still runs and whether the wait expired: a
 * relaunch decided since the start that ended this srun's step wins; a
 * pending verdict is waited for while the coordinator runs and the wait has
 * not expired.
 */
enum tpass_relaunch_step tpass_relaunch_next(const struct tpass_relaunch *v,
					     unsigned baseline,
					     bool step_known, unsigned step,
					     bool coordinator_runs,
					     bool expired);

/*
 * Split a NUL-separated argument block (/proc/self/cmdline) of len bytes into
 * a NULL-terminated, malloc'd argv of copies.  NULL if it is empty or memory
 * runs out.  tpass_argv_free() frees it.
 */
char **tpass_argv_split(const char *buf, size_t len);
void tpass_argv_free(char **argv);

/*
 * A malloc'd, NULL-terminated copy of envp (its strings copied too) without
 * any NAME=... entry, and with NAME=VALUE at the end when value is not NULL.
 * envp is left as it is.  NULL if memory runs out; tpass_argv_free() frees it.
 */
char **tpass_env_set(char *const *envp, const char *name, const char *value);

#endif /* TPASS_RELAUNCH_H */
