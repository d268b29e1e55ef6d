/*
 * hostlist.h - Slurm host lists and SLURM_TASKS_PER_NODE (no Slurm calls).
 */
#ifndef TPASS_HOSTLIST_H
#define TPASS_HOSTLIST_H

#include <stddef.h>

/*
 * tpass_hostlist_expand turns "a[1-3,05],b" into a malloc'ed array of
 * malloc'ed names; free with tpass_hostlist_free.  Supports one bracket
 * group per host expression (what Slurm produces for flat node names), zero
 * padding taken from the range's first number.
 */
int tpass_hostlist_expand(const char *list, char ***hosts, size_t *count,
			  char *err, size_t errlen);
void tpass_hostlist_free(char **hosts, size_t count);

/* Join hosts[from..to-1] with commas into buf. */
int tpass_hostlist_join(char **hosts, size_t from, size_t to, char *buf,
			size_t len);

/*
 * Sum of tasks on the first `nodes` nodes of a SLURM_TASKS_PER_NODE value
 * such as "2(x3),1".  Errors if the string covers fewer nodes.
 */
int tpass_tasks_on_first_nodes(const char *tasks_per_node, size_t nodes,
			       unsigned long *out, char *err, size_t errlen);
/* Same, also storing each of the first `nodes` counts in counts[] (if set). */
int tpass_tasks_per_node(const char *tasks_per_node, size_t nodes,
			 unsigned long *counts, unsigned long *sum, char *err,
			 size_t errlen);

#endif /* TPASS_HOSTLIST_H */
