/*
 * cgroup_join_probe PROC TASK: tpass_join_cgroups_of(PROC, TASK), then the
 * count on stdout.  Built by `make -C slurm_spank cgroup_join_probe` for
 * tests/unit/test_cgroup_join_c_agrees.py.
 */
#include <stdio.h>

#include "../cgroup_join.h"

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: cgroup_join_probe PROC TASK\n");
		return 2;
	}
	printf("%d\n", tpass_join_cgroups_of(argv[1], argv[2]));
	return 0;
}
