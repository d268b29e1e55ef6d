/*
 * proc.h - what the plugin reads from /proc (no Slurm calls).
 */
#ifndef TPASS_PROC_H
#define TPASS_PROC_H

#include <sys/types.h>

/*
 * Read /proc/PID/NAME into buf (at most len - 1 bytes, NUL-terminated).
 * Returns the number of bytes read, or -1 if it cannot be read or is empty.
 */
ssize_t tpass_proc_read(pid_t pid, const char *name, char *buf, size_t len);

/* Fields of /proc/PID/stat: state, process group and start time. */
int tpass_proc_stat(pid_t pid, char *state, pid_t *pgrp,
		    unsigned long long *start);

/* Start time of pid from /proc (0 if it is gone or a zombie). */
unsigned long long tpass_proc_start_time(pid_t pid);

/* Real uid of pid from /proc/PID/status. */
int tpass_proc_real_uid(pid_t pid, uid_t *uid);

#endif /* TPASS_PROC_H */
