/*
 * proc.c - what the plugin reads from /proc (see proc.h).
 */
#include "proc.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

ssize_t tpass_proc_read(pid_t pid, const char *name, char *buf, size_t len)
{
	char path[64];
	ssize_t n;
	int fd;

	snprintf(path, sizeof(path), "/proc/%d/%s", (int)pid, name);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	n = read(fd, buf, len - 1);
	close(fd);
	if (n <= 0)
		return -1;
	buf[n] = '\0';
	return n;
}

/* Fields after the ")" of /proc/PID/stat: [0]=state [2]=pgrp [19]=starttime */
int tpass_proc_stat(pid_t pid, char *state, pid_t *pgrp,
		    unsigned long long *start)
{
	char buf[2048], *p;
	int i;

	if (tpass_proc_read(pid, "stat", buf, sizeof(buf)) < 0)
		return -1;
	p = strrchr(buf, ')');
	if (!p)
		return -1;
	p++;
	for (i = 0; i <= 19; i++) {
		char *tok;
		while (*p == ' ')
			p++;
		tok = p;
		while (*p && *p != ' ')
			p++;
		if (tok == p)
			return -1;
		if (i == 0)
			*state = *tok;
		else if (i == 2)
			*pgrp = (pid_t)strtol(tok, NULL, 10);
		else if (i == 19)
			*start = strtoull(tok, NULL, 10);
	}
	return 0;
}

unsigned long long tpass_proc_start_time(pid_t pid)
{
	unsigned long long start = 0;
	pid_t pgrp;
	char state;

	if (pid <= 0 || tpass_proc_stat(pid, &state, &pgrp, &start) < 0)
		return 0;
	if (state == 'Z' || state == 'X')
		return 0;
	return start;
}

int tpass_proc_real_uid(pid_t pid, uid_t *uid)
{
	char buf[4096], *p;

	if (tpass_proc_read(pid, "status", buf, sizeof(buf)) < 0)
		return -1;
	p = strstr(buf, "\nUid:");
	if (!p)
		return -1;
	*uid = (uid_t)strtoul(p + 5, NULL, 10);
	return 0;
}
