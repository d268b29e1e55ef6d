/*
 * layout.h - names in the torchpass state directory that the plugin spells.
 *
 * The Python side defines the same names in torchpass/layout.py;
 * tests/unit/test_layout_c_agrees.py checks that every TPASS_LAYOUT_<NAME>
 * here equals torchpass.layout.<NAME>, and that no .c file spells one of
 * these names itself.
 *
 *   STATE_DIR/jobs/JOB/coordinator.pid   "PID STARTTIME NODE" (coordinator.c)
 *   STATE_DIR/jobs/JOB/coordinator.log   the coordinator's stdout/stderr
 *   STATE_DIR/jobs/JOB/hostfile          SLURM_HOSTFILE of the active nodes
 *   STATE_DIR/jobs/JOB/relaunch          the coordinator's verdict on a lost
 *                                        node (relaunch.c, srun's exit hook)
 *   STATE_DIR/jobs/JOB/stopped           the coordinator's marker of a job
 *                                        that 'tpassctl snapshot --stop'
 *                                        requeue-held: its snapshot and step
 *                                        (stop.c, slurmstepd's user_init)
 *   STATE_DIR/jobs/JOB/stopped.out       the job's output (and error) file as
 *   STATE_DIR/jobs/JOB/stopped.err       'tpassctl resume' found it, written
 *                                        ahead of the batch script's output
 *                                        when the job runs again (stop.c,
 *                                        slurmstepd's task_init)
 *   STATE_DIR/jobs/JOB/ranks/jobJOB/rankR.released
 *                                        a moved rank's launch wrapper left
 *                                        its node (moved_exit.h, srun's exit
 *                                        hook)
 *
 * Restore tokens (token.h): root-only and node-local, not in STATE_DIR.
 *
 *   TOKENS/NODE/                         0700 root; TOKENS is plugstack.conf's
 *                                        restore_tokens= (tpassd.toml's
 *                                        restore_token_dir), default
 *                                        TPASS_LAYOUT_RESTORE_TOKENS
 *   TOKENS/NODE/jobJ.rankR.token         a migration's restore of rank R
 *   TOKENS/NODE/jobJ.snapshot.token      a relaunch from a whole-job snapshot
 *   TOKENS/NODE/jobJ.stopped.token       the restore of a stopped job
 *   TOKENS/NODE/jobJ.KIND.stepS.token    that token once step S took it
 */
#ifndef TPASS_LAYOUT_H
#define TPASS_LAYOUT_H

#define TPASS_LAYOUT_JOBS            "jobs"
#define TPASS_LAYOUT_COORDINATOR_PID "coordinator.pid"
#define TPASS_LAYOUT_COORDINATOR_LOG "coordinator.log"
#define TPASS_LAYOUT_HOSTFILE        "hostfile"
#define TPASS_LAYOUT_RELAUNCH        "relaunch"
#define TPASS_LAYOUT_STOPPED         "stopped"
#define TPASS_LAYOUT_STOPPED_OUT     "stopped.out"
#define TPASS_LAYOUT_STOPPED_ERR     "stopped.err"
#define TPASS_LAYOUT_RANKS           "ranks"
#define TPASS_LAYOUT_RELEASED_SUFFIX ".released"
#define TPASS_LAYOUT_RESTORE_TOKENS  "/run/torchpass/restore-tokens"
#define TPASS_LAYOUT_TOKEN_SUFFIX    ".token"
/* A token older than this (seconds) is refused (tpassd writes it right
 * before the step's srun; torchpass.layout.RESTORE_TOKEN_TTL_S) */
#define TPASS_RESTORE_TOKEN_TTL_S    600

/*
 * Modes (torchpass/layout.py explains them): jobs/ is root's alone; jobs/JOB
 * is the job user's, group SlurmUser's, setgid so what is made inside gets
 * that group; the coordinator runs with TPASS_LAYOUT_JOB_UMASK.
 */
#define TPASS_LAYOUT_JOBS_DIR_MODE   0755
#define TPASS_LAYOUT_JOB_DIR_MODE    02750
#define TPASS_LAYOUT_JOB_FILE_MODE   0640
#define TPASS_LAYOUT_JOB_UMASK       027

#endif /* TPASS_LAYOUT_H */
