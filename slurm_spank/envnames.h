/*
 * The TORCHPASS_* environment variables the plugin reads or sets, defined once
 * for C (torchpass/envnames.py is the Python side; tests/unit/test_envnames_c_agrees.py
 * checks that the two agree and that no .c file spells a name itself).
 */
#ifndef TPASS_ENVNAMES_H
#define TPASS_ENVNAMES_H

/* the job's id (its batch step's, for every srun of it) */
#define TPASS_ENV_JOB_ID "TORCHPASS_JOB_ID"
/* plugstack.conf state_dir */
#define TPASS_ENV_STATE_DIR "TORCHPASS_STATE_DIR"
/* ADDR:PORT of the job's coordinator */
#define TPASS_ENV_COORDINATOR "TORCHPASS_COORDINATOR"
/* the job secret (hex): signs every rank.* request */
#define TPASS_ENV_JOB_SECRET "TORCHPASS_JOB_SECRET"
/* the node a task runs on */
#define TPASS_ENV_NODE "TORCHPASS_NODE"
/* --torchpass-spares */
#define TPASS_ENV_SPARES "TORCHPASS_SPARES"
/* --torchpass-policy */
#define TPASS_ENV_POLICY "TORCHPASS_POLICY"
/* --torchpass-snapshot-every (seconds) */
#define TPASS_ENV_SNAPSHOT_EVERY "TORCHPASS_SNAPSHOT_EVERY"
/* the allocation's nodes kept as spares */
#define TPASS_ENV_SPARE_NODES "TORCHPASS_SPARE_NODES"
/* the allocation's nodes the steps run on */
#define TPASS_ENV_ACTIVE_NODES "TORCHPASS_ACTIVE_NODES"
/* + a SLURM_* name: the allocation's own value (placement.h) */
#define TPASS_ENV_ALLOC_PREFIX "TORCHPASS_ALLOC_"
/* "0": do not load the rank runtime into Python */
#define TPASS_ENV_RUNTIME "TORCHPASS_RUNTIME"
/* a migration's restore step: the rank it restores */
#define TPASS_ENV_RESTORE_RANK "TORCHPASS_RESTORE_RANK"
/* a migration's restore step: its job */
#define TPASS_ENV_RESTORE_JOB "TORCHPASS_RESTORE_JOB"
/* a step relaunched from this whole-job snapshot */
#define TPASS_ENV_RESTORE_SNAPSHOT "TORCHPASS_RESTORE_SNAPSHOT"

#endif
