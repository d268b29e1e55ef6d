/*
 * stop.h - a job that 'tpassctl snapshot JOB --stop' stopped, as slurmstepd
 * finds it when the job runs again (no Slurm calls).
 *
 * The job's coordinator (the job user) takes a whole-job snapshot, writes
 * STATE_DIR/jobs/J/stopped and requeue-holds the job:
 *
 *   snapshot=ID    the whole-job snapshot to restore (relaunch.h's ids)
 *   step=S         the job step it holds the ranks of
 *   ...            anything else (generation=, world_size=, a newer
 *                  coordinator's keys) is ignored here
 *
 * 'tpassctl resume JOB' copies the job's output file to
 * STATE_DIR/jobs/J/stopped.out (and its error file, when it is another
 * file, to stopped.err) and releases the job.  Slurm then runs the batch
 * script again from the top, truncating the output files, and numbers its
 * steps from 0 again, so the step the snapshot was taken of comes again
 * with the same id.  slurmstepd (remote.c): the batch step's task writes
 * stopped.out and stopped.err to its stdout and stderr before the script
 * runs, and removes them; step S restores every rank from snapshot ID
 * instead of starting its program, as a step relaunched from a snapshot
 * does (relaunch.h).
 *
 * All three files are the job user's: slurmstepd reads them only when they
 * are regular files (not symbolic links) owned by the job's uid.
 */
#ifndef TPASS_STOP_H
#define TPASS_STOP_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

/* The marker is a few short lines; anything larger is not one. */
#define TPASS_STOPPED_MAX 4096

/*
 * Parse the marker's text: "key=value" lines, snapshot= (a snapshot id) and
 * step= (a step id) required, once each; unknown keys ignored; empty lines
 * allowed.  Strict about the rest: a carriage return (CRLF line ends) or a
 * space around a value is an error, not trimmed (tpassctl writes neither, so
 * either means someone else wrote the file).  On success the id goes to snap
 * (snaplen >= TPASS_SNAPSHOT_ID_MAX + 1) and the step to *step; on error
 * neither is touched and err says why.
 */
int tpass_stopped_parse(const char *text, char *snap, size_t snaplen,
			unsigned *step, char *err, size_t errlen);

/*
 * Read STATE_DIR/jobs/JOB/stopped for a job of uid.  No file: 0 with
 * *found false.  A regular file (not a symbolic link) owned by uid, of at
 * most TPASS_STOPPED_MAX bytes, that parses: 0 with *found true and snap
 * and *step set.  -1 otherwise, with err naming the file and why.
 */
int tpass_stopped_read(const char *state_dir, unsigned job_id, uid_t uid,
		       char *snap, size_t snaplen, unsigned *step, bool *found,
		       char *err, size_t errlen);

/*
 * Copy STATE_DIR/jobs/JOB/NAME (stopped.out or stopped.err) whole to fd out,
 * then remove it.  No file: 0 with *found false.  It must be a regular file
 * (not a symbolic link) owned by uid; -1 with err otherwise, or when it
 * cannot be read, written whole to out or removed.  It is removed only after
 * a complete copy, so a failed copy leaves it for the user to find.
 */
int tpass_stopped_output_copy(const char *state_dir, unsigned job_id,
			      const char *name, uid_t uid, int out,
			      bool *found, char *err, size_t errlen);

#endif /* TPASS_STOP_H */
