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

#endif /* TPASS_LAYOUT_H */
