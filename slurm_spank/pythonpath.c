/*
 * pythonpath.c - the runtime's entry in the tasks' PYTHONPATH (see
 * pythonpath.h).
 */
#include "pythonpath.h"

#include <stdio.h>
#include <string.h>

int tpass_pythonpath_prepend(const char *old, const char *runtime, char *buf,
			     size_t len)
{
	size_t rl = strlen(runtime);
	int n;

	if (old && !strncmp(old, runtime, rl) &&
	    (old[rl] == '\0' || old[rl] == ':'))
		n = snprintf(buf, len, "%s", old);
	else if (old && *old)
		n = snprintf(buf, len, "%s:%s", runtime, old);
	else
		n = snprintf(buf, len, "%s", runtime);
	return (n < 0 || (size_t)n >= len) ? -1 : 0;
}

int tpass_pythonpath_strip(const char *old, const char *runtime, char *buf,
			   size_t len)
{
	size_t used = 0, kept = 0;
	const char *p = old ? old : "";

	if (!len)
		return -1;
	buf[0] = '\0';
	while (1) {
		const char *c = strchr(p, ':');
		size_t n = c ? (size_t)(c - p) : strlen(p);

		if (!(n == strlen(runtime) && !strncmp(p, runtime, n))) {
			if (used + n + (kept > 0) + 1 > len)
				return -1;
			if (kept++ > 0)
				buf[used++] = ':';
			memcpy(buf + used, p, n);
			used += n;
			buf[used] = '\0';
		}
		if (!c)
			break;
		p = c + 1;
	}
	return 0;
}
