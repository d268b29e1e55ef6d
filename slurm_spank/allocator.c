/*
 * allocator.c - sbatch and salloc (allocator context).
 *
 * Only init, the option callback, init_post_opt and exit run here.  A bad
 * --torchpass value is rejected by the option callback (option.c), which
 * calls allocator_check() (handed in at registration) for a valid one.  Only a failing option
 * callback stops sbatch/salloc: SPANK ignores the return code of every hook
 * of an "optional" plugin, so every submit-time check lives there.
 */
#include <errno.h>
#include <string.h>

#include "context.h"
#include "tpass.h"

static int allocator_check(const struct tpass_opts *opts)
{
	(void)opts;
	/*
	 * The coordinator lives in the batch step of the job; an salloc
	 * allocation has none, so there would be nothing to host it.
	 */
	if (!strcmp(program_invocation_short_name, "salloc")) {
		tpass_error("salloc --torchpass is not supported: the coordinator runs in the batch step of an sbatch job; submit with 'sbatch --torchpass' instead");
		return -1;
	}
	return 0;
}

int tpass_allocator_init(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	return tpass_option_register(sp, allocator_check);
}
