/*
 * placement.h - how a step of a job with spares finds its nodes (no Slurm
 * calls).
 *
 * The batch step of a spares=N job hides the spares from plain sruns with a
 * host file (SLURM_HOSTFILE, see remote.c), and lowers SLURM_JOB_NUM_NODES,
 * SLURM_NNODES, SLURM_NTASKS and SLURM_NPROCS to the active nodes.  It keeps
 * the allocation's own values as TORCHPASS_ALLOC_<name> (absent when the
 * variable was).
 *
 * srun takes a host file as --distribution=arbitrary over its hosts: with
 * -N it refuses to run ("--nodes is incompatible with
 * --distribution=arbitrary"), a -m of its own is silently replaced, and an
 * --exclude of an active node is an error.  An srun that places its step
 * itself therefore gets the job's environment back (local.c), and runs as it
 * would without torchpass: slurmctld may then put it on a spare.
 */
#ifndef TPASS_PLACEMENT_H
#define TPASS_PLACEMENT_H

#include <stdbool.h>
#include <stddef.h>

#include "envnames.h"

/* The variables the batch step lowers, NULL-terminated. */
extern const char *const tpass_hidden_alloc_vars[];

/* TPASS_ENV_ALLOC_PREFIX (envnames.h) + name: where the allocation's value is kept. */

/*
 * Whether srun's own options (argv[1] up to the command, as srun 24.11's
 * getopt_long reads them) choose the step's nodes or their order: -N/--nodes,
 * -w/--nodelist, -F/--nodefile, -x/--exclude, -m/--distribution,
 * -r/--relative.  Long options count by their full names only.  On true,
 * `which` holds the option as written (for the log).
 *
 * A short option srun does not have ends the scan.  A long option not in
 * srun's table (a SPANK plugin's, such as --torchpass) is taken to have no
 * argument: a value given as its own word then ends the scan as the
 * command would.  Either way the srun keeps the host file, as before.
 */
bool tpass_srun_places_step(char *const *argv, char *which, size_t len);

/*
 * The host file's order: order[t] is the index of the node (among `nodes`,
 * with counts[i] tasks on node i) where task t runs, as the job's
 * distribution (SLURM_DISTRIBUTION in the batch step: sbatch -m) lays a
 * plain srun's tasks out: "block" or none (each node's tasks together),
 * "cyclic" (one task per node in turn, skipping full nodes) or "plane" with
 * plane_size (that many at a time).  Only the node level (before ':' or
 * ',') counts.  Returns the number of tasks, or -1 with err set (an
 * unknown distribution, or more tasks than norder).
 */
long tpass_hostfile_order(const char *distribution, unsigned long plane_size,
			  const unsigned long *counts, size_t nodes,
			  size_t *order, size_t norder, char *err,
			  size_t errlen);

#endif /* TPASS_PLACEMENT_H */
