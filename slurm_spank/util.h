/*
 * util.h - helpers shared by every file of the plugin (no Slurm calls).
 *
 * Error convention of the whole plugin: a function that can fail returns 0
 * on success and -1 on error, with one human-readable line (no "tpass: "
 * prefix, no newline) written into the caller's err buffer.
 */
#ifndef TPASS_UTIL_H
#define TPASS_UTIL_H

#include <stdbool.h>
#include <stddef.h>

#define TPASS_PATH_MAXLEN 1024
#define TPASS_ERR_MAXLEN  512

/* Write the formatted message into err (if err/errlen) and return -1. */
int tpass_fail(char *err, size_t errlen, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

/* Copy src[0..srclen-1] into dst as a string; -1 if it does not fit. */
int tpass_copy_str(char *dst, size_t len, const char *src, size_t srclen);

/* Strict unsigned decimal parse in [min, max]; no sign, no spaces. */
int tpass_parse_uint(const char *s, unsigned min, unsigned max, unsigned *out);

#endif /* TPASS_UTIL_H */
