/*
 * moved_exit.h - srun's share of a moved rank's exit code.
 *
 * The plugin starts every rank of a --torchpass step under
 * 'rank_wrapper --on-handoff release --' (remote.c).  When a planned
 * migration moves a rank, its launch wrapper on the source node does not
 * wait there for the rank's exit code: once a restored copy holds the rank it
 * writes RANK_DIR/jobJ/rankR.released and exits 0, so nothing of the step
 * stays on the node and the coordinator can release it from the job
 * (torchpass/checkpoint/moved_exit.py says why Slurm needs that).
 *
 * srun then owes the moved rank's exit code: local_user_init registers an
 * on_exit handler that keeps the status srun exits with (srun registers its
 * own spank exit handler with atexit before local_user_init runs, and exit
 * handlers run last-registered first, so ours runs before the exit hook);
 * the exit hook, when a released record exists, runs
 * 'rank_wrapper --collect-moved STEP --status S' as the job user, which
 * waits for those ranks and exits with the largest of S and their codes;
 * srun exits with that.
 */
#ifndef TPASS_MOVED_EXIT_H
#define TPASS_MOVED_EXIT_H

#include <slurm/spank.h>

/* local_user_init: remember the step and start keeping srun's exit status */
void tpass_moved_exit_arm(spank_t sp, unsigned job_id);
/* the exit hook: srun exits with the moved ranks' codes (does not return then) */
void tpass_moved_exit_collect(void);

#endif /* TPASS_MOVED_EXIT_H */
