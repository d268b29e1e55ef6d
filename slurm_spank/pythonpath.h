/*
 * pythonpath.h - the runtime's entry in the tasks' PYTHONPATH (no Slurm
 * calls).  remote.c prepends conf.runtime_path for --torchpass steps and
 * strips it for --torchpass=off steps.
 */
#ifndef TPASS_PYTHONPATH_H
#define TPASS_PYTHONPATH_H

#include <stddef.h>

/*
 * Write "runtime:old" (or "runtime" when old is NULL/empty) into buf,
 * without adding runtime a second time if it is already the first entry.
 */
int tpass_pythonpath_prepend(const char *old, const char *runtime, char *buf,
			     size_t len);

/* Write old without any entry equal to runtime into buf. */
int tpass_pythonpath_strip(const char *old, const char *runtime, char *buf,
			   size_t len);

#endif /* TPASS_PYTHONPATH_H */
