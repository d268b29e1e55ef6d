/*
 * placement.c - see placement.h.
 */
#include "placement.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

const char *const tpass_hidden_alloc_vars[] = {
	"SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_NTASKS", "SLURM_NPROCS",
	NULL,
};

/*
 * srun 24.11's option table (src/common/slurm_opt.c, the options srun
 * registers): short options by how they take an argument, and the long
 * options that require one.  Long options without an argument or with an
 * optional one (given only as --opt=value) need no list: a long option not
 * below never consumes the next word.
 */
static const char short_required[] = "ABCDFGJLMNSTWbcdeimnopqrtwx";
static const char short_optional[] = "IKk";
static const char short_none[] = "EHOQVXZhlsuv";

static const char *const long_required[] = {
	"accel-bind", "account", "acctg-freq", "autocomplete", "bb", "bbf",
	"bcast-exclude", "begin", "chdir", "cluster", "cluster-constraint",
	"clusters", "comment", "constraint", "container", "container-id",
	"context", "core-spec", "cores-per-socket", "cpu-bind", "cpu-freq",
	"cpu_bind", "cpus-per-gpu", "cpus-per-task", "deadline", "delay-boot",
	"dependency", "distribution", "epilog", "error", "exclude", "export",
	"extra", "extra-node-info", "gpu-bind", "gpu-freq", "gpus",
	"gpus-per-node", "gpus-per-socket", "gpus-per-task", "gres",
	"gres-flags", "het-group", "hint", "input", "job-name", "jobid",
	"licenses", "mail-type", "mail-user", "mcs-label", "mem", "mem-bind",
	"mem-per-cpu", "mem-per-gpu", "mincpus", "mpi", "msg-timeout",
	"network", "nodefile", "nodelist", "nodes", "ntasks",
	"ntasks-per-core", "ntasks-per-gpu", "ntasks-per-node",
	"ntasks-per-socket", "ntasks-per-tres", "open-mode", "output",
	"pack-group", "partition", "prefer", "priority", "profile", "prolog",
	"qos", "relative", "reservation", "segment", "signal", "slurmd-debug",
	"sockets-per-node", "switches", "task-epilog", "task-prolog",
	"tasks-per-node", "thread-spec", "threads", "threads-per-core", "time",
	"time-min", "tmp", "treewidth", "tres-bind", "tres-per-task", "wait",
	"wckey", NULL,
};

static const char places_short[] = "NwFxmr";
static const char *const places_long[] = {
	"nodes", "nodelist", "nodefile", "exclude", "distribution", "relative",
	NULL,
};

static bool listed(const char *const *list, const char *name, size_t n)
{
	for (size_t i = 0; list[i]; i++)
		if (strlen(list[i]) == n && !strncmp(list[i], name, n))
			return true;
	return false;
}

static bool found(char *which, size_t len, const char *fmt, const char *opt,
		  size_t n)
{
	if (len)
		snprintf(which, len, fmt, (int)n, opt);
	return true;
}

bool tpass_srun_places_step(char *const *argv, char *which, size_t len)
{
	if (len)
		which[0] = '\0';
	if (!argv || !argv[0])
		return false;
	for (size_t i = 1; argv[i]; i++) {
		const char *a = argv[i];

		if (a[0] != '-' || !a[1])
			return false; /* the command */
		if (a[1] == '-') {
			const char *name = a + 2;
			const char *eq = strchr(name, '=');
			size_t n = eq ? (size_t)(eq - name) : strlen(name);

			if (!n)
				return false; /* "--": the command follows */
			if (listed(places_long, name, n))
				return found(which, len, "--%.*s", name, n);
			if (!eq && listed(long_required, name, n))
				i++; /* "--opt value" */
			if (!argv[i])
				return false;
			continue;
		}
		for (const char *c = a + 1; *c; c++) {
			if (strchr(places_short, *c))
				return found(which, len, "-%.*s", c, 1);
			if (strchr(short_required, *c)) {
				if (!c[1])
					i++; /* "-o value" */
				break;
			}
			if (strchr(short_optional, *c))
				break; /* "-K" or "-K1" */
			if (!strchr(short_none, *c))
				return false; /* not srun's */
		}
		if (!argv[i])
			return false;
	}
	return false;
}

long tpass_hostfile_order(const char *distribution, unsigned long plane_size,
			  const unsigned long *counts, size_t nodes,
			  size_t *order, size_t norder, char *err,
			  size_t errlen)
{
	size_t len = distribution ? strcspn(distribution, ":,") : 0;
	unsigned long chunk, total = 0, *left;
	size_t n = 0;

	/*
	 * Summed with a bound, never past norder: a sum that wraps (counts
	 * of ULONG_MAX and 2 add up to 1) would pass the check and let the
	 * loop below write one node's whole count into order[].
	 */
	for (size_t i = 0; i < nodes; i++) {
		if (counts[i] > norder - total)
			return tpass_fail(err, errlen,
					  "more than %zu tasks (node %zu has %lu)",
					  norder, i, counts[i]);
		total += counts[i];
	}
	if (!len || (len == 5 && !strncmp(distribution, "block", 5)) ||
	    (len == 1 && distribution[0] == '*'))
		chunk = 0; /* every task of a node before the next node's */
	else if (len == 6 && !strncmp(distribution, "cyclic", 6))
		chunk = 1;
	else if (len == 5 && !strncmp(distribution, "plane", 5) && plane_size)
		chunk = plane_size;
	else
		return tpass_fail(err, errlen,
				  "distribution '%.*s' is not block, cyclic or plane with a size",
				  (int)len, distribution);
	left = calloc(nodes ? nodes : 1, sizeof(*left));
	if (!left)
		return tpass_fail(err, errlen, "out of memory");
	memcpy(left, counts, nodes * sizeof(*left));
	/*
	 * Every pass places at least one task while n < total (the counts
	 * left add up to total - n), so at most total passes; each write is
	 * checked against total (<= norder) all the same.
	 */
	for (unsigned long pass = 0; n < total && pass < total; pass++) {
		for (size_t i = 0; i < nodes && n < total; i++) {
			unsigned long take = chunk ? chunk : left[i];

			for (; take && left[i] && n < total; take--, left[i]--)
				order[n++] = i;
		}
	}
	free(left);
	if (n != total)
		return tpass_fail(err, errlen, "placed %zu of %lu tasks", n,
				  total);
	return (long)n;
}
