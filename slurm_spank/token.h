/*
 * token.h - restore tokens: root's word that a restore was set up (no Slurm
 * calls).
 *
 * The plugin forks the root restore agent (remote.c) only for a restore
 * that tpassd prepared on this node: the job's coordinator (munge: the job's
 * owner) or root asks the node's tpassd ('tpassd.restore' op=prepare,
 * torchpass.checkpoint.restore_token), which checks the request and writes
 * a token, a file of key=value lines, in TOKENS/NODE (layout.h), a
 * directory of root's with mode 0700 on the node's own disk:
 *
 *   kind=K         migration (a migration's restore step), snapshot (a step
 *                  relaunched from a whole-job snapshot) or stopped (the
 *                  step a stopped job restores)
 *   job=J          the job whose rank(s) are restored
 *   alloc=A        the job the restore step runs in (J, or a companion
 *                  allocation's)
 *   uid=U          the job's owner
 *   rank=R         migration: the rank (the step's TORCHPASS_RESTORE_RANK)
 *   generation=G   migration: the dump's generation (its images directory is
 *                  layout.images_dir(ROOT, J, R, G))
 *   snapshot=ID    snapshot, stopped: the whole-job snapshot
 *   step=S         stopped: the step that restores (optional)
 *   created=T      when tpassd wrote it (seconds since the epoch)
 *
 * Names in TOKENS/NODE: jobJ.rankR.token (migration: one task takes it, once)
 * and jobJ.KIND.token (snapshot, stopped: every task of one step on the node
 * takes it; the first renames it to jobJ.KIND.stepS.token, which binds it to
 * that step, and the step's other tasks read that one).
 */
#ifndef TPASS_TOKEN_H
#define TPASS_TOKEN_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include "relaunch.h"

/* A token is a few short lines; anything larger is not one. */
#define TPASS_TOKEN_MAX 1024

enum tpass_token_kind {
	TPASS_TOKEN_MIGRATION,
	TPASS_TOKEN_SNAPSHOT,
	TPASS_TOKEN_STOPPED,
};

struct tpass_token {
	enum tpass_token_kind kind;
	unsigned job, alloc, uid, rank, generation, step;
	bool has_rank, has_generation, has_step;
	char snapshot[TPASS_SNAPSHOT_ID_MAX + 1]; /* "": none */
	long long created;
};

/* What the step asks for: the token must name exactly this. */
struct tpass_token_want {
	enum tpass_token_kind kind;
	unsigned job;   /* the restored job (TORCHPASS_RESTORE_JOB or S_JOB_ID) */
	unsigned alloc; /* this step's job (S_JOB_ID) */
	unsigned uid;   /* this step's owner (S_JOB_UID) */
	unsigned rank;  /* migration: TORCHPASS_RESTORE_RANK */
	unsigned step;  /* this step (S_JOB_STEPID) */
	const char *snapshot; /* snapshot, stopped: the id the step restores */
};

/* "migration", "snapshot" or "stopped". */
const char *tpass_token_kind_name(enum tpass_token_kind kind);

/*
 * Parse a token's text (strict: every line key=value, known keys once each,
 * kind, job, alloc, uid and created required; rank and generation for a
 * migration, snapshot for the others).  -1 with err otherwise.
 */
int tpass_token_parse(const char *text, struct tpass_token *t, char *err,
		      size_t errlen);

/*
 * Take the token for want from TOKENS/NODE (tokens, node): the directories
 * must be owner's (root's: the plugin passes 0) with no group or other
 * access, reached without following a symbolic link at their last
 * component; the token a regular file of owner's with one link, no group or
 * other access and at most TPASS_TOKEN_MAX bytes, read without following a
 * symbolic link and without blocking.  A migration token is removed when
 * taken, whatever it says; a snapshot or stopped one is bound to want->step.
 * It must name want's kind, job, alloc, uid (and rank, snapshot and step as
 * kind says), and be no older than TPASS_RESTORE_TOKEN_TTL_S at now.
 *
 * 0: taken, *got filled in.  -2: there is no token for want (err says
 * where none was found).  -1: a token (or its directory) was refused; err
 * says why.
 */
int tpass_token_take(const char *tokens, const char *node, uid_t owner,
		     const struct tpass_token_want *want, long long now,
		     struct tpass_token *got, char *err, size_t errlen);

#endif /* TPASS_TOKEN_H */
