/*
 * jobscript.c - prolog/epilog (job script context), as root on every node.
 *
 * The epilog is the backstop for the coordinator: if the batch step's
 * slurm_spank_exit did not run (slurmstepd killed, node trouble), stop the
 * coordinator recorded in STATE_DIR/jobs/J/coordinator.pid when it was
 * started on this node and is still the same process of the job user.
 * Never fails: an epilog error would drain the node.
 */
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

#include "context.h"
#include "coordinator.h"
#include "tpass.h"

int tpass_jobscript_job_epilog(spank_t sp, int ac, char **av)
{
	char node[256], err[TPASS_ERR_MAXLEN];
	uint32_t job_id = 0;
	uid_t uid = 0;
	bool stopped = false;

	tpass_load_conf(ac, av);
	if (!tpass.conf_ok)
		return 0;
	if (spank_get_item(sp, S_JOB_ID, &job_id) != ESPANK_SUCCESS || !job_id)
		return 0;
	if (spank_get_item(sp, S_JOB_UID, &uid) != ESPANK_SUCCESS)
		return 0;
	tpass_node_name(node, sizeof(node));
	if (tpass_coord_stop_from_pidfile(&tpass.conf, job_id, uid, node,
					  &stopped, err, sizeof(err)) < 0)
		tpass_error("epilog job %u: %s", job_id, err);
	else if (stopped)
		tpass_info("epilog job %u: stopped a coordinator left running on %s",
			   job_id, node);
	return 0;
}
