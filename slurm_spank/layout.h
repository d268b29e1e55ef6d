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
 */
#ifndef TPASS_LAYOUT_H
#define TPASS_LAYOUT_H

#define TPASS_LAYOUT_JOBS            "jobs"
#define TPASS_LAYOUT_COORDINATOR_PID "coordinator.pid"
#define TPASS_LAYOUT_COORDINATOR_LOG "coordinator.log"
#define TPASS_LAYOUT_HOSTFILE        "hostfile"
#define TPASS_LAYOUT_RELAUNCH        "relaunch"

#endif /* TPASS_LAYOUT_H */
