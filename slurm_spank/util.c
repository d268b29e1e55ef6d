/*
 * util.c - helpers shared by every file of the plugin (see util.h).
 */
#include "util.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

int tpass_fail(char *err, size_t errlen, const char *fmt, ...)
{
	va_list ap;

	if (err && errlen) {
		va_start(ap, fmt);
		vsnprintf(err, errlen, fmt, ap);
		va_end(ap);
	}
	return -1;
}

int tpass_copy_str(char *dst, size_t len, const char *src, size_t srclen)
{
	if (srclen >= len)
		return -1;
	memcpy(dst, src, srclen);
	dst[srclen] = '\0';
	return 0;
}

int tpass_parse_uint(const char *s, unsigned min, unsigned max, unsigned *out)
{
	unsigned long v = 0;
	const char *p;

	if (!s || !*s)
		return -1;
	for (p = s; *p; p++) {
		if (*p < '0' || *p > '9')
			return -1;
		v = v * 10 + (unsigned long)(*p - '0');
		if (v > max)
			return -1;
	}
	if (p - s > 10)
		return -1;
	if (v < min)
		return -1;
	*out = (unsigned)v;
	return 0;
}
