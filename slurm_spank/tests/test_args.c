/*
 * test_args.c - unit tests for the pure parsers (no Slurm needed): conf.c,
 * opts.c, hostlist.c, pythonpath.c, util.c, relaunch.c, placement.c, stop.c
 * (its files in a temporary state directory), token.c (restore tokens, in a
 * temporary token directory) and the ready line of
 * coordinator.c.
 * Build and run: make -C slurm_spank test
 * Prints one line per failed check and a summary "N checks, F failed".
 */
#include "../conf.h"
#include "../coordinator.h"
#include "../hostlist.h"
#include "../layout.h"
#include "../opts.h"
#include "../placement.h"
#include "../proc.h"
#include "../pythonpath.h"
#include "../relaunch.h"
#include "../stop.h"
#include "../token.h"
#include "../layout.h"
#include "../util.h"

#include <fcntl.h>
#include <stdarg.h>
#include <stdbool.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>

static int checks, failed;

#define CHECK(cond)                                                        \
	do {                                                               \
		checks++;                                                  \
		if (!(cond)) {                                             \
			failed++;                                          \
			printf("FAIL %s:%d: %s\n", __FILE__, __LINE__,     \
			       #cond);                                     \
		}                                                          \
	} while (0)

#define CHECK_CONTAINS(hay, needle)                                        \
	do {                                                               \
		checks++;                                                  \
		if (!strstr((hay), (needle))) {                            \
			failed++;                                          \
			printf("FAIL %s:%d: '%s' does not contain '%s'\n", \
			       __FILE__, __LINE__, (hay), (needle));       \
		}                                                          \
	} while (0)

static struct tpass_conf conf;
static char err[TPASS_ERR_MAXLEN];

static int opts(const char *v, struct tpass_opts *o)
{
	err[0] = '\0';
	return tpass_opts_parse(v, &conf, o, err, sizeof(err));
}

static void test_opts_ok(void)
{
	struct tpass_opts o;

	CHECK(opts(NULL, &o) == 0);
	CHECK(o.given && !o.off && o.spares == 0);
	CHECK(!strcmp(o.policy, "default"));

	CHECK(opts("", &o) == 0 && o.spares == 0);
	CHECK(opts("spares=0", &o) == 0 && o.spares == 0);
	CHECK(opts("spares=64", &o) == 0 && o.spares == 64);
	CHECK(opts("spares=2,policy=fast-1_x", &o) == 0);
	CHECK(o.spares == 2 && !strcmp(o.policy, "fast-1_x"));
	CHECK(opts("policy=p", &o) == 0 && o.spares == 0 &&
	      !strcmp(o.policy, "p"));
	CHECK(opts("policy=abcdefghijklmnopqrstuvwxyz012345", &o) == 0);
	CHECK(opts("off", &o) == 0 && o.off);

	/* idempotent: parsing again starts from defaults */
	CHECK(opts("spares=3", &o) == 0 && o.spares == 3);
	CHECK(opts("policy=x", &o) == 0 && o.spares == 0);
	CHECK(opts("spares=3", &o) == 0 && opts("spares=3", &o) == 0 &&
	      o.spares == 3 && !strcmp(o.policy, "default"));

	/* snapshot_every: 0 (the policy's) or at least the site minimum */
	CHECK(opts("spares=1", &o) == 0 && o.snapshot_every == 0);
	CHECK(opts("snapshot_every=0", &o) == 0 && o.snapshot_every == 0);
	CHECK(opts("snapshot_every=600", &o) == 0 && o.snapshot_every == 600);
	CHECK(opts("spares=1,snapshot_every=604800,policy=p", &o) == 0 &&
	      o.snapshot_every == 604800 && o.spares == 1);
	{
		char buf[128];
		CHECK(tpass_opts_format(&o, buf, sizeof(buf)) == 0);
		CHECK(!strcmp(buf, "spares=1,policy=p,snapshot_every=604800"));
		CHECK(opts("spares=2", &o) == 0);
		CHECK(tpass_opts_format(&o, buf, sizeof(buf)) == 0);
		CHECK(!strcmp(buf, "spares=2,policy=default"));
	}
	conf.snapshot_every_min_s = 5;
	CHECK(opts("snapshot_every=5", &o) == 0 && o.snapshot_every == 5);
	conf.snapshot_every_min_s = 600;
}

static void test_opts_bad(void)
{
	struct tpass_opts o;

	CHECK(opts("spares=abc", &o) < 0);
	CHECK_CONTAINS(err, "'abc'");
	CHECK_CONTAINS(err, "spares");
	CHECK_CONTAINS(err, "0..64");

	CHECK(opts("bogus=1", &o) < 0);
	CHECK_CONTAINS(err, "unknown key 'bogus'");
	CHECK_CONTAINS(err, "spares=N (0..64)");
	CHECK_CONTAINS(err, "policy=NAME");

	CHECK(opts("spares=65", &o) < 0);
	CHECK_CONTAINS(err, "'65'");
	CHECK(opts("spares=-1", &o) < 0);
	CHECK(opts("spares=+1", &o) < 0);
	CHECK(opts("spares= 1", &o) < 0);
	CHECK(opts("spares=1 ", &o) < 0);
	CHECK(opts("spares=", &o) < 0);
	CHECK(opts("spares=99999999999999999999", &o) < 0);
	CHECK(opts("spares=0x1", &o) < 0);
	CHECK(opts("spares", &o) < 0);
	CHECK_CONTAINS(err, "needs a value");
	CHECK(opts("spares=1,spares=2", &o) < 0);
	CHECK_CONTAINS(err, "twice");
	CHECK(opts("policy=a,policy=b", &o) < 0);
	CHECK(opts("spares=1,", &o) < 0);
	CHECK_CONTAINS(err, "empty item");
	CHECK(opts(",spares=1", &o) < 0);
	CHECK(opts("spares=1,,policy=a", &o) < 0);
	CHECK(opts("off,spares=1", &o) < 0);
	CHECK_CONTAINS(err, "off");
	CHECK(opts("spares=1,off", &o) < 0);
	CHECK(opts("OFF", &o) < 0);
	CHECK(opts("=1", &o) < 0);

	CHECK(opts("policy=", &o) < 0);
	CHECK_CONTAINS(err, "policy");
	CHECK(opts("policy=a b", &o) < 0);
	CHECK_CONTAINS(err, "[A-Za-z0-9_-]");
	CHECK(opts("policy=a/b", &o) < 0);
	CHECK(opts("policy=../x", &o) < 0);
	CHECK(opts("policy=abcdefghijklmnopqrstuvwxyz0123456", &o) < 0);
	CHECK(opts("policy=\xc3\xa9", &o) < 0);
	CHECK(opts("policy", &o) < 0);

	CHECK(opts("snapshot_every=599", &o) < 0);
	CHECK_CONTAINS(err, "below this cluster's minimum of 600 s");
	CHECK_CONTAINS(err, "snapshot_every=600 or more");
	CHECK(opts("snapshot_every=604801", &o) < 0);
	CHECK_CONTAINS(err, "'604801'");
	CHECK_CONTAINS(err, "600..604800");
	CHECK(opts("snapshot_every=10m", &o) < 0);
	CHECK(opts("snapshot_every=", &o) < 0);
	CHECK(opts("snapshot_every", &o) < 0);
	CHECK_CONTAINS(err, "snapshot_every");
	CHECK(opts("snapshot_every=600,snapshot_every=700", &o) < 0);
	CHECK_CONTAINS(err, "twice");
	CHECK(opts("bogus=1", &o) < 0);
	CHECK_CONTAINS(err, "snapshot_every=SECONDS");

	/* long garbage gets truncated in the message, not overflowed */
	{
		char big[4096];
		memset(big, 'x', sizeof(big) - 1);
		big[sizeof(big) - 1] = '\0';
		memcpy(big, "spares=", 7);
		CHECK(opts(big, &o) < 0);
		CHECK(strlen(err) < 300);
		memcpy(big, "policy=", 7);
		CHECK(opts(big, &o) < 0);
		big[0] = 'z';
		CHECK(opts(big, &o) < 0);
		CHECK_CONTAINS(err, "unknown key");
	}
}

static void test_opts_max_spares(void)
{
	struct tpass_conf c;
	struct tpass_opts o;
	char *av[] = { "coordinator=/c", "state_dir=/s", "max_spares=2",
		       "policy=site" };

	CHECK(tpass_conf_parse(4, av, &c, err, sizeof(err)) == 0);
	CHECK(tpass_opts_parse("spares=2", &c, &o, err, sizeof(err)) == 0);
	CHECK(tpass_opts_parse("spares=3", &c, &o, err, sizeof(err)) < 0);
	CHECK_CONTAINS(err, "0..2");
	CHECK(tpass_opts_parse(NULL, &c, &o, err, sizeof(err)) == 0);
	CHECK(!strcmp(o.policy, "site"));
}

static void test_opts_format(void)
{
	struct tpass_opts o, o2;
	char buf[128];

	CHECK(opts("policy=x,spares=4", &o) == 0);
	CHECK(tpass_opts_format(&o, buf, sizeof(buf)) == 0);
	CHECK(!strcmp(buf, "spares=4,policy=x"));
	CHECK(opts(buf, &o2) == 0 && o2.spares == 4 &&
	      !strcmp(o2.policy, "x"));
	CHECK(opts("off", &o) == 0);
	CHECK(tpass_opts_format(&o, buf, sizeof(buf)) == 0);
	CHECK(!strcmp(buf, "off"));
	CHECK(tpass_opts_format(&o, buf, 3) < 0);
}

static int conf_parse(int n, char **av, struct tpass_conf *c)
{
	err[0] = '\0';
	return tpass_conf_parse(n, av, c, err, sizeof(err));
}

static void test_conf(void)
{
	struct tpass_conf c;

	{
		char *av[] = { "coordinator=/opt/tp/bin/tpass-coordinator",
			       "state_dir=/var/lib/torchpass",
			       "runtime_path=/opt/tp/boot", "policy=p1",
			       "max_spares=8", "log_level=debug",
			       "ready_timeout=20", "stop_timeout=2" };
		CHECK(conf_parse(8, av, &c) == 0);
		CHECK(!strcmp(c.coordinator, "/opt/tp/bin/tpass-coordinator"));
		CHECK(!strcmp(c.state_dir, "/var/lib/torchpass"));
		CHECK(!strcmp(c.runtime_path, "/opt/tp/boot"));
		CHECK(!strcmp(c.policy, "p1"));
		CHECK(c.max_spares == 8);
		CHECK(c.log_level == TPASS_LOG_DEBUG);
		CHECK(c.ready_timeout_s == 20 && c.stop_timeout_s == 2);
	}
	{
		char *av[] = { "state_dir=/s", "coordinator=/c" };
		CHECK(conf_parse(2, av, &c) == 0);
		CHECK(c.runtime_path[0] == '\0');
		CHECK(!strcmp(c.policy, "default"));
		CHECK(c.max_spares == 64 && c.log_level == TPASS_LOG_INFO);
		CHECK(c.ready_timeout_s == 10 && c.stop_timeout_s == 5);
		CHECK(c.snapshot_every_min_s == 600);
	}
	{
		char *av[] = { "coordinator=/c", "state_dir=/s", "snapshot_every_min_s=3" };
		CHECK(conf_parse(3, av, &c) == 0 && c.snapshot_every_min_s == 3 && !c.deprecated);
	}
	{
		/* the deprecated name still works, and says so */
		char *av[] = { "coordinator=/c", "state_dir=/s", "snapshot_every_min=2" };
		CHECK(conf_parse(3, av, &c) == 0 && c.snapshot_every_min_s == 2);
		CHECK(c.deprecated && !strcmp(c.deprecated, "snapshot_every_min") &&
		      !strcmp(c.deprecated_for, "snapshot_every_min_s"));
	}
	{
		/* both names: one key given twice */
		char *av[] = { "coordinator=/c", "state_dir=/s", "snapshot_every_min=2", "snapshot_every_min_s=3" };
		CHECK(conf_parse(4, av, &c) < 0);
	}
	{
		char *av[] = { "coordinator=/c", "state_dir=/s", "bogus=1" };
		char err[512];

		CHECK(tpass_conf_parse(3, av, &c, err, sizeof(err)) < 0);
		CHECK(strstr(err, "[snapshot_every_min_s=1..604800]") && !strstr(err, "snapshot_every_min="));
	}
	{
		char *av[] = { "coordinator=/c", "state_dir=/s", "snapshot_every_min=0" };
		CHECK(conf_parse(3, av, &c) < 0);
	}
	{
		char *av[] = { "coordinator=/c", "state_dir=/s", "bogus=1" };
		CHECK(conf_parse(3, av, &c) < 0);
		CHECK_CONTAINS(err, "unknown argument 'bogus'");
		CHECK_CONTAINS(err, "coordinator=PATH");
	}
	{
		char *av[] = { "coordinator=/c", "state_dir=/s", "verbose" };
		CHECK(conf_parse(3, av, &c) < 0);
		CHECK_CONTAINS(err, "'verbose' is not key=value");
	}
	{
		char *av[] = { "coordinator=/c" };
		CHECK(conf_parse(1, av, &c) < 0);
		CHECK_CONTAINS(err, "missing required argument state_dir");
	}
	{
		char *av[] = { "state_dir=/s" };
		CHECK(conf_parse(1, av, &c) < 0);
		CHECK_CONTAINS(err, "missing required argument coordinator");
	}
	CHECK(conf_parse(0, NULL, &c) < 0);
	{
		char *av[] = { "coordinator=relative/c", "state_dir=/s" };
		CHECK(conf_parse(2, av, &c) < 0);
		CHECK_CONTAINS(err, "absolute");
	}
	{
		char *av[] = { "coordinator=/c", "state_dir=/s", "coordinator=/d" };
		CHECK(conf_parse(3, av, &c) < 0);
		CHECK_CONTAINS(err, "twice");
	}
	{
		char *av[] = { "coordinator=/c", "state_dir=" };
		CHECK(conf_parse(2, av, &c) < 0);
		CHECK_CONTAINS(err, "empty");
	}
	{
		char *av[] = { "coordinator=/c", "state_dir=/s", "max_spares=65" };
		CHECK(conf_parse(3, av, &c) < 0);
		CHECK_CONTAINS(err, "max_spares");
	}
	{
		char *av[] = { "coordinator=/c", "state_dir=/s", "log_level=loud" };
		CHECK(conf_parse(3, av, &c) < 0);
		CHECK_CONTAINS(err, "error, info, verbose, debug");
	}
	{
		char *av[] = { "coordinator=/c", "state_dir=/s", "policy=a.b" };
		CHECK(conf_parse(3, av, &c) < 0);
	}
	{
		char *av[] = { "coordinator=/c", "state_dir=/s",
			       "runtime_path=/a:/b" };
		CHECK(conf_parse(3, av, &c) < 0);
	}
	{
		char *av[] = { "coordinator=/c", "state_dir=/s", "ready_timeout=0" };
		CHECK(conf_parse(3, av, &c) < 0);
	}
	{
		char *av[] = { "coordinator=/c", "state_dir=/s",
			       "stop_timeout=301" };
		CHECK(conf_parse(3, av, &c) < 0);
	}
	{
		char *av[] = { "coordinator=/c", "state_dir=/s",
			       "rank_wrapper=/opt/tp/bin/tpass-rankwrap" };
		CHECK(conf_parse(3, av, &c) == 0);
		CHECK(!strcmp(c.rank_wrapper, "/opt/tp/bin/tpass-rankwrap"));
		/* the root restore agent is a program of its own, beside it */
		CHECK(!strcmp(c.restore_agent, "/opt/tp/bin/tpass-restore-agent"));
	}
	{
		char *av[] = { "coordinator=/c", "state_dir=/s",
			       "rank_wrapper=/opt/tp/bin/tpass-rankwrap",
			       "restore_agent=/usr/sbin/tpass-restore-agent" };
		CHECK(conf_parse(4, av, &c) == 0);
		CHECK(!strcmp(c.restore_agent, "/usr/sbin/tpass-restore-agent"));
	}
	{
		char *av[] = { "coordinator=/c", "state_dir=/s",
			       "restore_agent=tpass-restore-agent" };
		CHECK(conf_parse(3, av, &c) < 0);
		CHECK_CONTAINS(err, "restore_agent='tpass-restore-agent' must be an absolute path");
	}
	{
		char *av[] = { "coordinator=/c", "state_dir=/s" };
		CHECK(conf_parse(2, av, &c) == 0);
		CHECK(c.rank_wrapper[0] == '\0');
		CHECK(c.restore_agent[0] == '\0');
		CHECK(c.gpu_inventory[0] == '\0'); /* the node's GPUs from NVML */
	}
	{
		char *av[] = { "coordinator=/c", "state_dir=/s",
			       "gpu_inventory=/run/tp/dev/gpus.json" };
		CHECK(conf_parse(3, av, &c) == 0);
		CHECK(!strcmp(c.gpu_inventory, "/run/tp/dev/gpus.json"));
	}
	{
		char *av[] = { "coordinator=/c", "state_dir=/s",
			       "gpu_inventory=gpus.json" };
		CHECK(conf_parse(3, av, &c) < 0);
		CHECK_CONTAINS(err, "gpu_inventory='gpus.json' must be an absolute path");
	}
	{
		char *av[] = { "coordinator=/c", "state_dir=/s",
			       "rank_wrapper=tpass-rankwrap" };
		CHECK(conf_parse(3, av, &c) < 0);
		CHECK_CONTAINS(err, "rank_wrapper='tpass-rankwrap' must be an absolute path");
	}
	{
		char *av[] = { "coordinator=/c", "state_dir=/s",
			       "rank_wrapper=/a", "rank_wrapper=/b" };
		CHECK(conf_parse(4, av, &c) < 0);
		CHECK_CONTAINS(err, "'rank_wrapper' given twice");
	}
	{
		char *av[] = { "coordinator=/c", "state_dir=/s", "bogus=1" };
		CHECK(conf_parse(3, av, &c) < 0);
		CHECK_CONTAINS(err, "[rank_wrapper=PATH]");
	}
}

static void test_uint(void)
{
	unsigned v;

	CHECK(tpass_parse_uint("0", 0, 5, &v) == 0 && v == 0);
	CHECK(tpass_parse_uint("5", 0, 5, &v) == 0 && v == 5);
	CHECK(tpass_parse_uint("6", 0, 5, &v) < 0);
	CHECK(tpass_parse_uint("007", 0, 64, &v) == 0 && v == 7);
	CHECK(tpass_parse_uint("", 0, 5, &v) < 0);
	CHECK(tpass_parse_uint(NULL, 0, 5, &v) < 0);
	CHECK(tpass_parse_uint("1", 2, 5, &v) < 0);
	CHECK(tpass_parse_uint("4294967296", 0, 4294967295u, &v) < 0);
}

static void test_hostlist(void)
{
	char **h;
	size_t n;
	char buf[256];

	CHECK(tpass_hostlist_expand("node[1-4]", &h, &n, err, sizeof(err)) == 0);
	CHECK(n == 4 && !strcmp(h[0], "node1") && !strcmp(h[3], "node4"));
	CHECK(tpass_hostlist_join(h, 2, 4, buf, sizeof(buf)) == 0);
	CHECK(!strcmp(buf, "node3,node4"));
	CHECK(tpass_hostlist_join(h, 0, 1, buf, sizeof(buf)) == 0);
	CHECK(!strcmp(buf, "node1"));
	CHECK(tpass_hostlist_join(h, 0, 4, buf, 10) < 0);
	tpass_hostlist_free(h, n);

	CHECK(tpass_hostlist_expand("gpu[08-10,12],login,x[3]-ib", &h, &n,
				    err, sizeof(err)) == 0);
	CHECK(n == 6);
	if (n == 6) {
		CHECK(!strcmp(h[0], "gpu08") && !strcmp(h[1], "gpu09"));
		CHECK(!strcmp(h[2], "gpu10") && !strcmp(h[3], "gpu12"));
		CHECK(!strcmp(h[4], "login") && !strcmp(h[5], "x3-ib"));
	}
	tpass_hostlist_free(h, n);

	CHECK(tpass_hostlist_expand("a,b", &h, &n, err, sizeof(err)) == 0);
	CHECK(n == 2 && !strcmp(h[1], "b"));
	tpass_hostlist_free(h, n);

	CHECK(tpass_hostlist_expand("", &h, &n, err, sizeof(err)) < 0);
	CHECK(tpass_hostlist_expand("n[1-", &h, &n, err, sizeof(err)) < 0);
	CHECK(tpass_hostlist_expand("n[3-1]", &h, &n, err, sizeof(err)) < 0);
	CHECK(tpass_hostlist_expand("n[1-2]x[1-2]", &h, &n, err,
				    sizeof(err)) < 0);
	CHECK(tpass_hostlist_expand("a,,b", &h, &n, err, sizeof(err)) < 0);
	CHECK(tpass_hostlist_expand("a,", &h, &n, err, sizeof(err)) < 0);
	CHECK(tpass_hostlist_expand("n[a]", &h, &n, err, sizeof(err)) < 0);
	CHECK(tpass_hostlist_expand("n[1-999999]", &h, &n, err,
				    sizeof(err)) < 0);
}

static void test_tasks(void)
{
	unsigned long t;

	CHECK(tpass_tasks_on_first_nodes("1(x4)", 3, &t, err, sizeof(err)) == 0 &&
	      t == 3);
	CHECK(tpass_tasks_on_first_nodes("2(x3),1", 4, &t, err, sizeof(err)) == 0 &&
	      t == 7);
	CHECK(tpass_tasks_on_first_nodes("2(x3),1", 2, &t, err, sizeof(err)) == 0 &&
	      t == 4);
	CHECK(tpass_tasks_on_first_nodes("4,2,1", 2, &t, err, sizeof(err)) == 0 &&
	      t == 6);
	{
		unsigned long c[4] = { 0 };
		CHECK(tpass_tasks_per_node("2(x2),3,1", 4, c, &t, err,
					   sizeof(err)) == 0);
		CHECK(t == 8 && c[0] == 2 && c[1] == 2 && c[2] == 3 &&
		      c[3] == 1);
	}
	CHECK(tpass_tasks_on_first_nodes("1(x2)", 3, &t, err, sizeof(err)) < 0);
	CHECK(tpass_tasks_on_first_nodes("1(y2)", 1, &t, err, sizeof(err)) < 0);
	CHECK(tpass_tasks_on_first_nodes("", 1, &t, err, sizeof(err)) < 0);
	CHECK(tpass_tasks_on_first_nodes("x", 1, &t, err, sizeof(err)) < 0);
}

static void test_pythonpath(void)
{
	char buf[256];

	CHECK(tpass_pythonpath_prepend(NULL, "/rt", buf, sizeof(buf)) == 0 &&
	      !strcmp(buf, "/rt"));
	CHECK(tpass_pythonpath_prepend("", "/rt", buf, sizeof(buf)) == 0 &&
	      !strcmp(buf, "/rt"));
	CHECK(tpass_pythonpath_prepend("/a:/b", "/rt", buf, sizeof(buf)) == 0 &&
	      !strcmp(buf, "/rt:/a:/b"));
	CHECK(tpass_pythonpath_prepend("/rt:/a", "/rt", buf, sizeof(buf)) == 0 &&
	      !strcmp(buf, "/rt:/a"));
	CHECK(tpass_pythonpath_prepend("/rtx", "/rt", buf, sizeof(buf)) == 0 &&
	      !strcmp(buf, "/rt:/rtx"));
	CHECK(tpass_pythonpath_prepend("/a", "/rt", buf, 4) < 0);

	CHECK(tpass_pythonpath_strip("/rt:/a:/b", "/rt", buf, sizeof(buf)) == 0 &&
	      !strcmp(buf, "/a:/b"));
	CHECK(tpass_pythonpath_strip("/a:/rt", "/rt", buf, sizeof(buf)) == 0 &&
	      !strcmp(buf, "/a"));
	CHECK(tpass_pythonpath_strip("/rt", "/rt", buf, sizeof(buf)) == 0 &&
	      !strcmp(buf, ""));
	CHECK(tpass_pythonpath_strip("/a:/rtx", "/rt", buf, sizeof(buf)) == 0 &&
	      !strcmp(buf, "/a:/rtx"));
	CHECK(tpass_pythonpath_strip("/rt:/a:/rt", "/rt", buf, sizeof(buf)) == 0 &&
	      !strcmp(buf, "/a"));
}

static void test_ready(void)
{
	CHECK(tpass_ready_line_valid("tcp://10.0.0.1:5555", err, sizeof(err)) == 0);
	CHECK(tpass_ready_line_valid("tcp://node1:1", err, sizeof(err)) == 0);
	CHECK(tpass_ready_line_valid("tcp://[::1]:80", err, sizeof(err)) == 0);
	CHECK(tpass_ready_line_valid("udp://h:1", err, sizeof(err)) < 0);
	CHECK(tpass_ready_line_valid("tcp://h:0", err, sizeof(err)) < 0);
	CHECK(tpass_ready_line_valid("tcp://h:65536", err, sizeof(err)) < 0);
	CHECK(tpass_ready_line_valid("tcp://:1", err, sizeof(err)) < 0);
	CHECK(tpass_ready_line_valid("tcp://h", err, sizeof(err)) < 0);
	CHECK(tpass_ready_line_valid("tcp://a b:1", err, sizeof(err)) < 0);
	CHECK(tpass_ready_line_valid("tcp://a;rm:1", err, sizeof(err)) < 0);
}

static void test_relaunch(void)
{
	struct tpass_relaunch v;
	char block[] = "srun\0-N\0003\0python\0train.py\0";
	char **argv;

	CHECK(tpass_relaunch_parse("count=2\npending=1\nnode=node7\n", &v, err,
				   sizeof(err)) == 0 &&
	      v.count == 2 && v.pending && !strcmp(v.node, "node7"));
	CHECK(tpass_relaunch_parse("count=0\npending=0\nnode=\nnew=x\n", &v,
				   err, sizeof(err)) == 0 &&
	      v.count == 0 && !v.pending && !v.node[0]);
	CHECK(tpass_relaunch_parse("count=3", &v, err, sizeof(err)) == 0 &&
	      v.count == 3 && !v.pending);
	CHECK(tpass_relaunch_parse("pending=1\n", &v, err, sizeof(err)) < 0);
	CHECK_CONTAINS(err, "no count");
	CHECK(tpass_relaunch_parse("count=-1\n", &v, err, sizeof(err)) < 0);
	CHECK_CONTAINS(err, "count '-1' is not a number");
	CHECK(tpass_relaunch_parse("count=1\npending=yes\n", &v, err,
				   sizeof(err)) < 0);
	CHECK(tpass_relaunch_parse("count=1\ngarbage\n", &v, err, sizeof(err)) < 0);
	CHECK_CONTAINS(err, "'garbage' is not key=value");
	CHECK(tpass_relaunch_read("/nonexistent-state-dir", 5, &v, err,
				  sizeof(err)) == 0 && v.count == 0 && !v.pending);

	/* the exit hook's choice */
	CHECK(tpass_relaunch_parse("count=1\nsteps=0,7\n", &v, err, sizeof(err)) == 0 &&
	      v.steps_known && v.nsteps == 2 && v.steps[1] == 7);
	CHECK(tpass_relaunch_parse("count=1\nsteps=\n", &v, err, sizeof(err)) == 0 &&
	      v.steps_known && v.nsteps == 0);
	CHECK(tpass_relaunch_parse("count=1\nsteps=1,x\n", &v, err, sizeof(err)) < 0);
	CHECK_CONTAINS(err, "not a list of at most");
	CHECK(tpass_relaunch_parse("count=1\nsteps=0,7\n", &v, err, sizeof(err)) == 0);
	CHECK(tpass_relaunch_next(&v, 0, true, 7, true, false) == TPASS_RELAUNCH_AGAIN);
	CHECK(tpass_relaunch_next(&v, 0, true, 3, true, false) == TPASS_RELAUNCH_EXIT); /* ran elsewhere */
	CHECK(tpass_relaunch_next(&v, 0, false, 0, true, false) == TPASS_RELAUNCH_EXIT);
	CHECK(tpass_relaunch_next(&v, 1, true, 7, true, false) == TPASS_RELAUNCH_EXIT); /* started after */
	v.steps_known = false; /* the coordinator could not list the steps: any srun */
	CHECK(tpass_relaunch_next(&v, 0, true, 3, false, true) == TPASS_RELAUNCH_AGAIN);
	CHECK(tpass_relaunch_next(&v, 0, false, 0, true, false) == TPASS_RELAUNCH_AGAIN);
	v.pending = true; /* a node is silent: wait while the coordinator runs */
	CHECK(tpass_relaunch_next(&v, 1, true, 3, true, false) == TPASS_RELAUNCH_WAIT);
	CHECK(tpass_relaunch_next(&v, 1, true, 3, false, false) == TPASS_RELAUNCH_EXIT);
	CHECK(tpass_relaunch_next(&v, 1, true, 3, true, true) == TPASS_RELAUNCH_EXIT);

	argv = tpass_argv_split(block, sizeof(block) - 1);
	CHECK(argv && !strcmp(argv[0], "srun") && !strcmp(argv[1], "-N") &&
	      !strcmp(argv[2], "3") && !strcmp(argv[4], "train.py") &&
	      argv[5] == NULL);
	tpass_argv_free(argv);
	argv = tpass_argv_split("srun\0x", 6); /* last argument without its NUL */
	CHECK(argv && !strcmp(argv[1], "x") && argv[2] == NULL);
	tpass_argv_free(argv);
	CHECK(tpass_argv_split("", 0) == NULL);
}

/* snapshot=ID of the verdict, checked as torchpass.layout.valid_snapshot_id */
static void test_relaunch_snapshot(void)
{
	struct tpass_relaunch v;
	char id64[65], id65[66], text[128];

	memset(id64, 'a', 64);
	id64[64] = '\0';
	memset(id65, 'b', 65);
	id65[65] = '\0';
	CHECK(tpass_snapshot_id_valid("s1"));
	CHECK(tpass_snapshot_id_valid("job-12_AZaz09"));
	CHECK(tpass_snapshot_id_valid("-"));   /* as Python: '-' may lead */
	CHECK(tpass_snapshot_id_valid(id64));
	CHECK(!tpass_snapshot_id_valid(""));
	CHECK(!tpass_snapshot_id_valid(id65));
	CHECK(!tpass_snapshot_id_valid("a.b"));
	CHECK(!tpass_snapshot_id_valid(".."));
	CHECK(!tpass_snapshot_id_valid("a/b"));
	CHECK(!tpass_snapshot_id_valid("a b"));
	CHECK(!tpass_snapshot_id_valid("a\tb"));
	CHECK(!tpass_snapshot_id_valid("\xc3\xa9"));

	CHECK(tpass_relaunch_parse("count=1\n", &v, err, sizeof(err)) == 0 &&
	      v.snapshot[0] == '\0');
	CHECK(tpass_relaunch_parse("count=2\nnode=n3\nsnapshot=snap-7_x\nsteps=0\n",
				   &v, err, sizeof(err)) == 0 &&
	      v.count == 2 && !strcmp(v.snapshot, "snap-7_x") &&
	      !strcmp(v.node, "n3") && v.nsteps == 1);
	snprintf(text, sizeof(text), "count=1\nsnapshot=%s\n", id64);
	CHECK(tpass_relaunch_parse(text, &v, err, sizeof(err)) == 0 &&
	      !strcmp(v.snapshot, id64));
	snprintf(text, sizeof(text), "count=1\nsnapshot=%s\n", id65);
	CHECK(tpass_relaunch_parse(text, &v, err, sizeof(err)) < 0);
	CHECK_CONTAINS(err, "is not a snapshot id");
	CHECK_CONTAINS(err, "1..64");
	CHECK(tpass_relaunch_parse("count=1\nsnapshot=\n", &v, err,
				   sizeof(err)) < 0);
	CHECK_CONTAINS(err, "snapshot '' is not a snapshot id");
	CHECK(tpass_relaunch_parse("count=1\nsnapshot=../x\n", &v, err,
				   sizeof(err)) < 0);
	CHECK_CONTAINS(err, "snapshot '../x' is not a snapshot id");
	CHECK(tpass_relaunch_parse("count=1\nsnapshot=a b\n", &v, err,
				   sizeof(err)) < 0);
	CHECK(tpass_relaunch_parse("count=1\nsnapshot=a;rm\n", &v, err,
				   sizeof(err)) < 0);
	CHECK(strchr(err, '\n') == NULL);
	/* a later line does not leave an earlier verdict's snapshot behind */
	CHECK(tpass_relaunch_parse("count=1\nsnapshot=s1\n", &v, err, sizeof(err)) == 0);
	CHECK(tpass_relaunch_parse("count=2\n", &v, err, sizeof(err)) == 0 &&
	      v.snapshot[0] == '\0');
}

static size_t env_count(char **env, const char *entry)
{
	size_t n = 0;

	for (; env && *env; env++)
		n += !strcmp(*env, entry);
	return n;
}

static size_t env_len(char **env)
{
	size_t n = 0;

	while (env && env[n])
		n++;
	return n;
}

static void test_env_set(void)
{
	char *envp[] = {
		"PATH=/bin", "TORCHPASS_RESTORE_SNAPSHOT=old", "HOME=/h",
		"TORCHPASS_RESTORE_SNAPSHOT_X=keep", "TORCHPASS_RESTORE_SNAPSHOT",
		"TORCHPASS_RESTORE_SNAPSHOT=again", "XTORCHPASS_RESTORE_SNAPSHOT=keep",
		NULL,
	};
	char *plain[] = { "PATH=/bin", "HOME=/h", NULL };
	char *empty[] = { NULL };
	char **env;

	/* replace: every old entry goes, the new one comes last, once */
	env = tpass_env_set(envp, "TORCHPASS_RESTORE_SNAPSHOT", "s2");
	CHECK(env && env_len(env) == 6);
	CHECK(env_count(env, "TORCHPASS_RESTORE_SNAPSHOT=s2") == 1 &&
	      !strcmp(env[5], "TORCHPASS_RESTORE_SNAPSHOT=s2"));
	CHECK(env_count(env, "TORCHPASS_RESTORE_SNAPSHOT=old") == 0 &&
	      env_count(env, "TORCHPASS_RESTORE_SNAPSHOT=again") == 0);
	/* only NAME=...: a longer name, another prefix, no '=' stay */
	CHECK(env_count(env, "TORCHPASS_RESTORE_SNAPSHOT_X=keep") == 1 &&
	      env_count(env, "XTORCHPASS_RESTORE_SNAPSHOT=keep") == 1 &&
	      env_count(env, "TORCHPASS_RESTORE_SNAPSHOT") == 1);
	CHECK(env && !strcmp(env[0], "PATH=/bin") && !strcmp(env[1], "HOME=/h"));
	/* copies, and the original untouched */
	CHECK(env && env[0] != envp[0]);
	CHECK(!strcmp(envp[1], "TORCHPASS_RESTORE_SNAPSHOT=old") &&
	      !strcmp(envp[5], "TORCHPASS_RESTORE_SNAPSHOT=again") &&
	      envp[7] == NULL);
	tpass_argv_free(env);

	/* remove (a relaunch from a checkpoint after one from a snapshot) */
	env = tpass_env_set(envp, "TORCHPASS_RESTORE_SNAPSHOT", NULL);
	CHECK(env && env_len(env) == 5);
	CHECK(env && !strcmp(env[1], "HOME=/h") &&
	      !strcmp(env[4], "XTORCHPASS_RESTORE_SNAPSHOT=keep"));
	for (size_t i = 0; env && env[i]; i++)
		CHECK(strncmp(env[i], "TORCHPASS_RESTORE_SNAPSHOT=", 27));
	tpass_argv_free(env);

	/* append when absent; remove when absent is a plain copy */
	env = tpass_env_set(plain, "TORCHPASS_RESTORE_SNAPSHOT", "s1");
	CHECK(env && env_len(env) == 3 && !strcmp(env[0], "PATH=/bin") &&
	      !strcmp(env[2], "TORCHPASS_RESTORE_SNAPSHOT=s1"));
	tpass_argv_free(env);
	env = tpass_env_set(plain, "TORCHPASS_RESTORE_SNAPSHOT", NULL);
	CHECK(env && env_len(env) == 2 && !strcmp(env[1], "HOME=/h"));
	tpass_argv_free(env);
	env = tpass_env_set(empty, "A", "");
	CHECK(env && env_len(env) == 1 && !strcmp(env[0], "A="));
	tpass_argv_free(env);
	env = tpass_env_set(empty, "A", NULL);
	CHECK(env && env[0] == NULL);
	tpass_argv_free(env);
}

static bool places(const char *which_expected, ...)
{
	char *argv[32], which[32];
	va_list ap;
	size_t n = 0;
	bool r;

	va_start(ap, which_expected);
	while (n < 31 && (argv[n] = va_arg(ap, char *)))
		n++;
	va_end(ap);
	argv[n] = NULL;
	r = tpass_srun_places_step(argv, which, sizeof(which));
	if (r != (which_expected != NULL) ||
	    (which_expected && strcmp(which, which_expected))) {
		printf("  srun_places_step: got %d '%s', expected '%s'\n", r,
		       which, which_expected ? which_expected : "(none)");
		return false;
	}
	return true;
}

static int stopped(const char *text, char *snap, unsigned *step)
{
	err[0] = '\0';
	return tpass_stopped_parse(text, snap, TPASS_SNAPSHOT_ID_MAX + 1, step,
				   err, sizeof(err));
}

/* the stop marker's text (stop.h) */
static void test_stopped_parse(void)
{
	char snap[TPASS_SNAPSHOT_ID_MAX + 1], id64[65], text[160], small[4];
	unsigned step;

	CHECK(stopped("snapshot=20261205T204847Z-2\nstep=0\ngeneration=3\nworld_size=3\n",
		      snap, &step) == 0);
	CHECK(!strcmp(snap, "20261205T204847Z-2") && step == 0);
	/* the coordinator's whole marker (executor.py): snapshot_step= is not step= */
	CHECK(stopped("snapshot=s9\nstep=2\nsnapshot_step=1200\ngeneration=3\nworld_size=3\nstep_offset=0\n",
		      snap, &step) == 0 && !strcmp(snap, "s9") && step == 2);
	CHECK(stopped("snapshot_step=5\nsnapshot=s9\nstep=2\n", snap, &step) == 0 &&
	      step == 2);
	/* any order, no final newline, empty lines, unknown keys */
	CHECK(stopped("\nfuture=x=y\nstep=7\n\nsnapshot=s_1", snap, &step) == 0 &&
	      !strcmp(snap, "s_1") && step == 7);
	CHECK(stopped("snapshot=a\nstep=4294967294\n", snap, &step) == 0 &&
	      step == 4294967294u);
	memset(id64, 'a', 64);
	id64[64] = '\0';
	snprintf(text, sizeof(text), "step=1\nsnapshot=%s\n", id64);
	CHECK(stopped(text, snap, &step) == 0 && !strcmp(snap, id64));
	/* an unknown key's long value is not read */
	memset(text, 'v', sizeof(text) - 1);
	text[sizeof(text) - 1] = '\0';
	memcpy(text, "snapshot=a\nstep=2\nnote=", 23);
	CHECK(stopped(text, snap, &step) == 0 && step == 2);

	/* missing keys; a failure leaves the outputs as they were */
	strcpy(snap, "keep");
	step = 99;
	CHECK(stopped("step=0\ngeneration=3\n", snap, &step) < 0);
	CHECK_CONTAINS(err, "no snapshot= line");
	CHECK(!strcmp(snap, "keep") && step == 99);
	CHECK(stopped("snapshot=s1\n", snap, &step) < 0);
	CHECK_CONTAINS(err, "no step= line");
	CHECK(!strcmp(snap, "keep") && step == 99);
	CHECK(stopped("", snap, &step) < 0);
	CHECK_CONTAINS(err, "no snapshot= line");
	/* bad step */
	CHECK(stopped("snapshot=s1\nstep=\n", snap, &step) < 0);
	CHECK_CONTAINS(err, "step '' is not a step id");
	CHECK(stopped("snapshot=s1\nstep=-1\n", snap, &step) < 0);
	CHECK(stopped("snapshot=s1\nstep=x\n", snap, &step) < 0);
	CHECK(stopped("snapshot=s1\nstep=4294967295\n", snap, &step) < 0);
	CHECK(stopped("snapshot=s1\nstep=0x1\n", snap, &step) < 0);
	/* bad snapshot id: it ends up in an argv and a path */
	CHECK(stopped("snapshot=../x\nstep=0\n", snap, &step) < 0);
	CHECK_CONTAINS(err, "snapshot '../x' is not a snapshot id (1..64");
	CHECK(stopped("snapshot=\nstep=0\n", snap, &step) < 0);
	CHECK(stopped("snapshot=a;rm\nstep=0\n", snap, &step) < 0);
	snprintf(text, sizeof(text), "step=1\nsnapshot=%sb\n", id64);
	CHECK(stopped(text, snap, &step) < 0);
	/* each once */
	CHECK(stopped("snapshot=a\nstep=0\nstep=1\n", snap, &step) < 0);
	CHECK_CONTAINS(err, "step= given twice");
	CHECK(stopped("snapshot=a\nsnapshot=b\nstep=0\n", snap, &step) < 0);
	CHECK_CONTAINS(err, "snapshot= given twice");
	/* not key=value */
	CHECK(stopped("snapshot=a\nstep=0\ngarbage\n", snap, &step) < 0);
	CHECK_CONTAINS(err, "line 'garbage' is not key=value");
	/* CRLF and spaces are errors, not trimmed */
	CHECK(stopped("snapshot=a\r\nstep=0\r\n", snap, &step) < 0);
	CHECK_CONTAINS(err, "carriage return");
	CHECK(stopped("snapshot=a\nstep=0\nnote=x\r\n", snap, &step) < 0);
	CHECK(stopped("snapshot=a \nstep=0\n", snap, &step) < 0);
	CHECK_CONTAINS(err, "snapshot 'a ' is not a snapshot id");
	CHECK(stopped("snapshot=a\nstep=0 \n", snap, &step) < 0);
	CHECK_CONTAINS(err, "step '0 ' is not a step id");
	CHECK(stopped("snapshot = a\nstep=0\n", snap, &step) < 0); /* key "snapshot " */
	CHECK(stopped(" step=0\nsnapshot=a\n", snap, &step) < 0);
	CHECK(strchr(err, '\n') == NULL && strchr(err, '\r') == NULL);
	/* the caller's buffer is checked too */
	CHECK(tpass_stopped_parse("snapshot=abcd\nstep=0\n", small, sizeof(small),
				  &step, err, sizeof(err)) < 0);
	CHECK(tpass_stopped_parse("snapshot=abc\nstep=0\n", small, sizeof(small),
				  &step, err, sizeof(err)) == 0 &&
	      !strcmp(small, "abc"));
}

static char state_dir[64], job_dir[128];

/* STATE_DIR/jobs/5/NAME with len bytes of data (mode 0644) */
static int put_file(const char *name, const char *data, size_t len)
{
	char path[256];
	int fd, rc = 0;

	snprintf(path, sizeof(path), "%s/%s", job_dir, name);
	unlink(path);
	fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	if (fd < 0)
		return -1;
	if (write(fd, data, len) != (ssize_t)len)
		rc = -1;
	close(fd);
	return rc;
}

static bool job_file_exists(const char *name)
{
	char path[256];
	struct stat st;

	snprintf(path, sizeof(path), "%s/%s", job_dir, name);
	return lstat(path, &st) == 0;
}

static int read_marker(uid_t uid, char *snap, unsigned *step, bool *found)
{
	err[0] = '\0';
	return tpass_stopped_read(state_dir, 5, uid, snap,
				  TPASS_SNAPSHOT_ID_MAX + 1, step, found, err,
				  sizeof(err));
}

static int copy_out(const char *name, uid_t uid, int out, bool *found)
{
	err[0] = '\0';
	return tpass_stopped_output_copy(state_dir, 5, name, uid, out, found,
					 err, sizeof(err));
}

/* The whole content of fd (from its start) into a malloc'd string. */
static char *slurp(int fd, size_t *len)
{
	struct stat st;
	char *buf;

	if (fstat(fd, &st) < 0 || !(buf = malloc((size_t)st.st_size + 1)))
		return NULL;
	*len = (size_t)pread(fd, buf, (size_t)st.st_size, 0);
	buf[*len] = '\0';
	return buf;
}

/* The marker and the kept output files, in a temporary state directory. */
static void test_stopped_files(void)
{
	const char marker[] = "snapshot=20261205T204847Z-2\nstep=0\ngeneration=3\nworld_size=3\n";
	char snap[TPASS_SNAPSHOT_ID_MAX + 1], path[256], out_path[256], *big, *got;
	uid_t me = getuid();
	unsigned step = 0;
	bool found = true;
	size_t len, big_len = 300000;
	int out;

	snprintf(state_dir, sizeof(state_dir), "/tmp/tpass-test-XXXXXX");
	if (!mkdtemp(state_dir)) {
		CHECK(!"mkdtemp");
		return;
	}
	snprintf(job_dir, sizeof(job_dir), "%s/jobs", state_dir);
	mkdir(job_dir, 0755);
	snprintf(job_dir, sizeof(job_dir), "%s/jobs/5", state_dir);
	CHECK(mkdir(job_dir, 0755) == 0);

	/* the marker: no file is nothing at all */
	CHECK(read_marker(me, snap, &step, &found) == 0 && !found);
	CHECK(put_file("stopped", marker, strlen(marker)) == 0);
	CHECK(read_marker(me, snap, &step, &found) == 0 && found &&
	      !strcmp(snap, "20261205T204847Z-2") && step == 0);
	/* someone else's file, even a well-formed one */
	CHECK(read_marker(me + 1, snap, &step, &found) < 0 && !found);
	CHECK_CONTAINS(err, "/jobs/5/stopped is owned by uid");
	CHECK_CONTAINS(err, "not by the job's user");
	/* malformed: named with its path */
	CHECK(put_file("stopped", "step=0\n", 7) == 0);
	CHECK(read_marker(me, snap, &step, &found) < 0 && !found);
	CHECK_CONTAINS(err, "/jobs/5/stopped: no snapshot= line");
	CHECK(put_file("stopped", "snapshot=a\0\nstep=0\n", 19) == 0);
	CHECK(read_marker(me, snap, &step, &found) < 0);
	CHECK_CONTAINS(err, "NUL byte");
	/* at most TPASS_STOPPED_MAX bytes */
	big = malloc(big_len);
	if (!big) {
		CHECK(!"malloc");
		return;
	}
	memset(big, '#', big_len);
	memcpy(big, "snapshot=a\nstep=0\nx=", 20);
	CHECK(put_file("stopped", big, TPASS_STOPPED_MAX) == 0);
	CHECK(read_marker(me, snap, &step, &found) == 0 && found);
	CHECK(put_file("stopped", big, TPASS_STOPPED_MAX + 1) == 0);
	CHECK(read_marker(me, snap, &step, &found) < 0 && !found);
	CHECK_CONTAINS(err, "has 4097 bytes, more than 4096");
	/* a symbolic link, even to a good marker of the user's, is not followed */
	CHECK(put_file("good", marker, strlen(marker)) == 0);
	snprintf(path, sizeof(path), "%s/stopped", job_dir);
	unlink(path);
	CHECK(symlink("good", path) == 0);
	CHECK(read_marker(me, snap, &step, &found) < 0 && !found);
	CHECK_CONTAINS(err, "/jobs/5/stopped is a symbolic link");
	unlink(path);
	/* a hard link to a file of the user's (a user makes one to a file they cannot read where
	 * fs.protected_hardlinks is off; the owner check alone would not see it then) */
	{
		char good[256];

		snprintf(good, sizeof(good), "%s/good", job_dir);
		CHECK(link(good, path) == 0);
		CHECK(read_marker(me, snap, &step, &found) < 0 && !found);
		CHECK_CONTAINS(err, "/jobs/5/stopped has 2 links");
		unlink(path);
	}
	/* a directory or a FIFO (not opened blocking) */
	CHECK(mkdir(path, 0755) == 0);
	CHECK(read_marker(me, snap, &step, &found) < 0);
	CHECK_CONTAINS(err, "/jobs/5/stopped is not a regular file");
	rmdir(path);
	CHECK(mkfifo(path, 0644) == 0);
	CHECK(read_marker(me, snap, &step, &found) < 0);
	CHECK_CONTAINS(err, "/jobs/5/stopped is not a regular file");
	unlink(path);

	/* the kept output: written whole after what out holds, then removed */
	snprintf(out_path, sizeof(out_path), "%s/job.out", state_dir);
	out = open(out_path, O_RDWR | O_CREAT | O_TRUNC | O_APPEND, 0644);
	CHECK(out >= 0);
	CHECK(copy_out("stopped.out", me, out, &found) == 0 && !found);
	for (size_t i = 0; i < big_len; i++)
		big[i] = (char)('a' + i % 26); /* several read()s' worth */
	CHECK(put_file("stopped.out", big, big_len) == 0);
	CHECK(copy_out("stopped.out", me, out, &found) == 0 && found);
	CHECK(!job_file_exists("stopped.out"));
	CHECK(write(out, "after\n", 6) == 6);
	got = slurp(out, &len);
	CHECK(got && len == big_len + 6 && !memcmp(got, big, big_len) &&
	      !memcmp(got + big_len, "after\n", 6));
	free(got);
	/* an empty copy is removed too */
	CHECK(put_file("stopped.err", "", 0) == 0);
	CHECK(copy_out("stopped.err", me, out, &found) == 0 && found);
	CHECK(!job_file_exists("stopped.err"));
	/* someone else's, or a link: not read, left in place */
	CHECK(put_file("stopped.out", "old\n", 4) == 0);
	CHECK(copy_out("stopped.out", me + 1, out, &found) < 0 && !found);
	CHECK_CONTAINS(err, "/jobs/5/stopped.out is owned by uid");
	CHECK(job_file_exists("stopped.out"));
	snprintf(path, sizeof(path), "%s/stopped.err", job_dir);
	CHECK(symlink("stopped.out", path) == 0);
	CHECK(copy_out("stopped.err", me, out, &found) < 0 && !found);
	CHECK_CONTAINS(err, "/jobs/5/stopped.err is a symbolic link");
	unlink(path);
	/* a failed write keeps the copy */
	CHECK(copy_out("stopped.out", me, -1, &found) < 0 && found);
	CHECK_CONTAINS(err, "cannot write");
	CHECK_CONTAINS(err, "it is left in place");
	CHECK(job_file_exists("stopped.out"));
	{
		int full = open("/dev/full", O_WRONLY | O_CLOEXEC);

		if (full >= 0) { /* ENOSPC */
			CHECK(copy_out("stopped.out", me, full, &found) < 0 && found);
			CHECK_CONTAINS(err, "No space left on device");
			CHECK(job_file_exists("stopped.out"));
			close(full);
		}
	}
	{
		int ro = open(out_path, O_RDONLY);

		CHECK(copy_out("stopped.out", me, ro, &found) < 0 && found);
		CHECK(job_file_exists("stopped.out"));
		close(ro);
	}
	got = slurp(out, &len);
	CHECK(got && len == big_len + 6); /* nothing more was written */
	free(got);
	close(out);
	free(big);

	/* leave nothing behind */
	unlink(out_path);
	for (const char *const *n = (const char *const[]){ "stopped", "stopped.out",
			"stopped.err", "good", NULL }; *n; n++) {
		snprintf(path, sizeof(path), "%s/%s", job_dir, *n);
		unlink(path);
	}
	CHECK(rmdir(job_dir) == 0);
	snprintf(path, sizeof(path), "%s/jobs", state_dir);
	CHECK(rmdir(path) == 0);
	CHECK(rmdir(state_dir) == 0);
}

static void test_placement(void)
{
	/* what the host file would break */
	CHECK(places("-N", "srun", "-N1", "-n1", "hostname", NULL));
	CHECK(places("-N", "srun", "-N", "2", "hostname", NULL));
	CHECK(places("-N", "srun", "-lN2", "hostname", NULL));
	CHECK(places("--nodes", "srun", "--nodes=2", "hostname", NULL));
	CHECK(places("--nodes", "srun", "--nodes", "2", "hostname", NULL));
	CHECK(places("-m", "srun", "-m", "cyclic", "hostname", NULL));
	CHECK(places("--distribution", "srun", "--distribution=cyclic", "a", NULL));
	CHECK(places("-x", "srun", "--overlap", "-x", "node1", "a", NULL));
	CHECK(places("--exclude", "srun", "--exclude=node1", "a", NULL));
	CHECK(places("-w", "srun", "-wnode2", "a", NULL));
	CHECK(places("--nodelist", "srun", "--nodelist", "node2", "a", NULL));
	CHECK(places("-F", "srun", "-F", "hosts.txt", "a", NULL));
	CHECK(places("--nodefile", "srun", "--nodefile=h", "a", NULL));
	CHECK(places("-r", "srun", "-r1", "a", NULL));
	CHECK(places("--relative", "srun", "--relative", "1", "a", NULL));
	/* options before it, with their values as separate words */
	CHECK(places("-N", "srun", "-J", "-x1", "-o", "out", "-N1", "a", NULL)); /* "-x1" is -J's value */
	CHECK(places("-N", "srun", "-o", "out", "--job-name", "x", "-K", "-N1", "a", NULL));
	CHECK(places("-N", "srun", "--kill-on-bad-exit=1", "--overlap", "-N1", "a", NULL));
	CHECK(places("-N", "srun", "--torchpass=off", "-N1", "a", NULL));
	/* plain sruns keep the host file */
	CHECK(places(NULL, "srun", "hostname", NULL));
	CHECK(places(NULL, "srun", "-n1", "--overlap", "hostname", NULL));
	CHECK(places(NULL, "srun", "-l", "-o", "-N", "hostname", NULL)); /* -o's value */
	CHECK(places(NULL, "srun", "-J", "-N", "hostname", NULL));
	CHECK(places(NULL, "srun", "--job-name", "-N", "hostname", NULL));
	CHECK(places(NULL, "srun", "--ntasks=2", "-c", "1", "hostname", NULL));
	/* the command's own arguments are the command's */
	CHECK(places(NULL, "srun", "python", "train.py", "-N", "4", NULL));
	CHECK(places(NULL, "srun", "-n2", "--", "-N", "x", NULL));
	CHECK(places(NULL, "srun", "-n2", "-", "-N", NULL));
	/* an unknown short option ends the scan; an unknown long one's value too */
	CHECK(places(NULL, "srun", "-y", "-N1", "a", NULL));
	CHECK(places(NULL, "srun", "--container-image", "img", "-N1", "a", NULL));
	CHECK(places(NULL, "srun", "-o", NULL));
	CHECK(places(NULL, "srun", "--job-name", NULL));
	CHECK(places(NULL, "srun", NULL));
	CHECK(!tpass_srun_places_step(NULL, NULL, 0));
	{
		/* three active nodes with 2, 2 and 1 tasks */
		const unsigned long counts[] = { 2, 2, 1 };
		size_t order[8];
		char e[256];
		const struct {
			const char *dist;
			unsigned long plane;
			const char *want;
		} cases[] = {
			{ NULL, 0, "00112" },
			{ "block", 0, "00112" },
			{ "block:cyclic", 0, "00112" },
			{ "*", 0, "00112" },
			{ "cyclic", 0, "01201" },
			{ "cyclic:block,Pack", 0, "01201" },
			{ "plane", 2, "00112" },
			{ "plane", 1, "01201" },
		};

		for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
			char got[8] = "";
			long n = tpass_hostfile_order(cases[c].dist, cases[c].plane,
						      counts, 3, order, 8, e,
						      sizeof(e));

			for (long t = 0; t < n && t < 7; t++)
				got[t] = (char)('0' + order[t]);
			if (n != 5 || strcmp(got, cases[c].want))
				printf("  hostfile_order(%s, %lu): %ld '%s', expected '%s'\n",
				       cases[c].dist ? cases[c].dist : "NULL",
				       cases[c].plane, n, got, cases[c].want);
			CHECK(n == 5 && !strcmp(got, cases[c].want));
		}
		CHECK(tpass_hostfile_order("arbitrary", 0, counts, 3, order, 8, e,
					   sizeof(e)) < 0);
		CHECK_CONTAINS(e, "distribution 'arbitrary' is not block, cyclic or plane");
		CHECK(tpass_hostfile_order("plane", 0, counts, 3, order, 8, e,
					   sizeof(e)) < 0);
		CHECK(tpass_hostfile_order("cyclic", 0, counts, 3, order, 4, e,
					   sizeof(e)) < 0);
		CHECK_CONTAINS(e, "more than 4 tasks");
	}
	{
		/*
		 * Task counts whose sum wraps: ULONG_MAX + 2 is 1.  No user sets
		 * SLURM_TASKS_PER_NODE of a batch step (slurmctld does), so the
		 * functions are driven directly.  Without the overflow check the wrapped sum
		 * passed the "more tasks than order[] holds" check and the
		 * block loop wrote node 0's ULONG_MAX tasks into a 1-entry
		 * heap buffer (ASan: heap-buffer-overflow).
		 */
		const unsigned long wrap[] = { ULONG_MAX, 2 };
		const unsigned long wrap3[] = { 3, ULONG_MAX - 1 };
		size_t *order = calloc(1, sizeof(*order));
		unsigned long c[2], t = 0;
		char e[256];

		CHECK(order != NULL);
		CHECK(tpass_hostfile_order(NULL, 0, wrap, 2, order, 1, e,
					   sizeof(e)) < 0);
		CHECK_CONTAINS(e, "more than 1 tasks");
		CHECK(tpass_hostfile_order("cyclic", 0, wrap3, 2, order, 1, e,
					   sizeof(e)) < 0);
		CHECK(tpass_hostfile_order("plane", 4, wrap3, 2, order, 1, e,
					   sizeof(e)) < 0);
		free(order);
		CHECK(tpass_tasks_per_node("18446744073709551615,2", 2, c, &t,
					   e, sizeof(e)) < 0);
		CHECK_CONTAINS(e, "sums past");
		CHECK(tpass_tasks_per_node("9223372036854775808(x2)", 2, c, &t,
					   e, sizeof(e)) < 0);
		CHECK(tpass_tasks_per_node("18446744073709551615,0", 2, c, &t,
					   e, sizeof(e)) == 0 && t == ULONG_MAX);
	}
	for (size_t i = 0; tpass_hidden_alloc_vars[i]; i++)
		CHECK(!strncmp(tpass_hidden_alloc_vars[i], "SLURM_", 6));
}

/* ---- restore tokens (token.c) ---- */

static char tok_dir[256], tok_node[300];

static int put_token(const char *name, const char *text, mode_t mode)
{
	char path[600];
	int fd;

	snprintf(path, sizeof(path), "%s/%s", tok_node, name);
	unlink(path);
	fd = open(path, O_WRONLY | O_CREAT | O_EXCL, mode);
	if (fd < 0)
		return -1;
	if (write(fd, text, strlen(text)) != (ssize_t)strlen(text)) {
		close(fd);
		return -1;
	}
	fchmod(fd, mode);
	return close(fd);
}

static bool token_exists(const char *name)
{
	char path[600];

	snprintf(path, sizeof(path), "%s/%s", tok_node, name);
	return access(path, F_OK) == 0;
}

static int take(const struct tpass_token_want *w, long long now,
		struct tpass_token *t)
{
	err[0] = '\0';
	return tpass_token_take(tok_dir, "node1", geteuid(), w, now, t, err,
				sizeof(err));
}

static void test_token(void)
{
	const long long now = 1765000000;
	char text[512];
	struct tpass_token t;
	struct tpass_token_want mig = {
		.kind = TPASS_TOKEN_MIGRATION, .job = 7, .alloc = 7,
		.uid = 1001, .rank = 2, .step = 4,
	}, w;
	struct tpass_token_want snap = {
		.kind = TPASS_TOKEN_SNAPSHOT, .job = 7, .alloc = 7, .uid = 1001,
		.step = 5, .snapshot = "s1",
	};

	/* parse: strict */
	CHECK(tpass_token_parse("kind=migration\njob=7\nalloc=7\nuid=1001\nrank=2\ngeneration=3\ncreated=5\n",
				&t, err, sizeof(err)) == 0 &&
	      t.kind == TPASS_TOKEN_MIGRATION && t.rank == 2 && t.generation == 3);
	CHECK(tpass_token_parse("kind=migration\njob=7\nalloc=7\nuid=1001\nrank=2\ncreated=5\n",
				&t, err, sizeof(err)) < 0);
	CHECK_CONTAINS(err, "needs rank= and generation=");
	CHECK(tpass_token_parse("kind=root\njob=7\n", &t, err, sizeof(err)) < 0);
	CHECK(tpass_token_parse("kind=snapshot\njob=7\nalloc=7\nuid=1\nsnapshot=../x\ncreated=5\n",
				&t, err, sizeof(err)) < 0);
	CHECK_CONTAINS(err, "not a snapshot id");
	CHECK(tpass_token_parse("kind=snapshot\njob=7\njob=8\n", &t, err, sizeof(err)) < 0);
	CHECK_CONTAINS(err, "job= given twice");
	CHECK(tpass_token_parse("kind=snapshot\nimages=/x\n", &t, err, sizeof(err)) < 0);
	CHECK_CONTAINS(err, "unknown key 'images'");

	snprintf(tok_dir, sizeof(tok_dir), "/tmp/tpass-tok-XXXXXX");
	if (!mkdtemp(tok_dir)) {
		CHECK(!"mkdtemp");
		return;
	}
	chmod(tok_dir, 0700);
	/* no node directory: no token */
	CHECK(take(&mig, now, &t) == -2);
	snprintf(tok_node, sizeof(tok_node), "%s/node1", tok_dir);
	CHECK(mkdir(tok_node, 0700) == 0);
	CHECK(take(&mig, now, &t) == -2);
	CHECK_CONTAINS(err, "no token");

	/* a migration token: taken once */
	snprintf(text, sizeof(text), "kind=migration\njob=7\nalloc=7\nuid=1001\nrank=2\ngeneration=3\ncreated=%lld\n", now);
	CHECK(put_token("job7.rank2.token", text, 0600) == 0);
	CHECK(take(&mig, now + 10, &t) == 0 && t.generation == 3);
	CHECK(!token_exists("job7.rank2.token"));
	CHECK(take(&mig, now + 10, &t) == -2);
	/* another job, rank, kind, uid or step's job: refused, and gone */
	for (int i = 0; i < 5; i++) {
		w = mig;
		if (i == 0)
			w.uid = 1002;
		else if (i == 1)
			w.alloc = 8;
		else if (i == 2)
			w.job = 8;
		else if (i == 3)
			w.rank = 3;
		CHECK(put_token("job7.rank2.token", text, 0600) == 0);
		if (i == 4) { /* a snapshot's token under a migration's name */
			CHECK(put_token("job7.rank2.token",
					"kind=snapshot\njob=7\nalloc=7\nuid=1001\nsnapshot=s1\ncreated=1765000000\n",
					0600) == 0);
		}
		if (i == 2 || i == 3) { /* named for what it is: nothing there */
			CHECK(take(&w, now, &t) == -2);
			continue;
		}
		CHECK(take(&w, now, &t) == -1);
		CHECK_CONTAINS(err, "refused");
		CHECK(!token_exists("job7.rank2.token"));
	}
	/* expired, or from the future */
	CHECK(put_token("job7.rank2.token", text, 0600) == 0);
	CHECK(take(&mig, now + TPASS_RESTORE_TOKEN_TTL_S + 1, &t) == -1);
	CHECK_CONTAINS(err, "expired");
	CHECK(put_token("job7.rank2.token", text, 0600) == 0);
	CHECK(take(&mig, now - 3600, &t) == -1);
	CHECK_CONTAINS(err, "in the future");
	/* a token others may read or write, a symbolic link, a hard link */
	CHECK(put_token("job7.rank2.token", text, 0644) == 0);
	CHECK(take(&mig, now, &t) == -1);
	CHECK_CONTAINS(err, "not a regular file of root's with mode 0600");
	{
		char path[600], target[600];

		CHECK(put_token("good", text, 0600) == 0);
		snprintf(target, sizeof(target), "%s/good", tok_node);
		snprintf(path, sizeof(path), "%s/job7.rank2.token", tok_node);
		unlink(path);
		CHECK(symlink(target, path) == 0);
		CHECK(take(&mig, now, &t) == -1);
		CHECK_CONTAINS(err, "symbolic link");
		CHECK(link(target, path) == 0);
		CHECK(take(&mig, now, &t) == -1);
		CHECK_CONTAINS(err, "one link");
		unlink(target);
		/* a file of another uid (root's test only: chown) */
		if (geteuid() == 0) {
			CHECK(put_token("job7.rank2.token", text, 0600) == 0);
			CHECK(chown(path, 65534, 65534) == 0);
			CHECK(take(&mig, now, &t) == -1);
			CHECK_CONTAINS(err, "not a regular file of root's");
		}
	}
	/* a token directory others may enter: nothing in it is trusted */
	CHECK(put_token("job7.rank2.token", text, 0600) == 0);
	chmod(tok_node, 0755);
	CHECK(take(&mig, now, &t) == -1);
	CHECK_CONTAINS(err, "not root's with mode 0700");
	chmod(tok_node, 0700);
	chmod(tok_dir, 0711);
	CHECK(take(&mig, now, &t) == -1);
	chmod(tok_dir, 0700);

	/* a snapshot token: bound to the first step, serves its every task */
	snprintf(text, sizeof(text), "kind=snapshot\njob=7\nalloc=7\nuid=1001\nsnapshot=s1\ncreated=%lld\n", now);
	CHECK(put_token("job7.snapshot.token", text, 0600) == 0);
	CHECK(take(&snap, now, &t) == 0 && !strcmp(t.snapshot, "s1"));
	CHECK(token_exists("job7.snapshot.step5.token") && !token_exists("job7.snapshot.token"));
	CHECK(take(&snap, now, &t) == 0);
	w = snap;
	w.step = 6; /* another step: none */
	CHECK(take(&w, now, &t) == -2);
	w = snap;
	w.snapshot = "s2";
	CHECK(take(&w, now, &t) == -1);
	CHECK_CONTAINS(err, "names snapshot s1, not s2");
	w = snap;
	w.kind = TPASS_TOKEN_STOPPED; /* a relaunch's token does not restore a stopped job */
	CHECK(take(&w, now, &t) == -2);
	/* a stopped job's token names its step */
	snprintf(text, sizeof(text), "kind=stopped\njob=7\nalloc=7\nuid=1001\nsnapshot=s1\nstep=3\ncreated=%lld\n", now);
	CHECK(put_token("job7.stopped.token", text, 0600) == 0);
	w.step = 4;
	CHECK(take(&w, now, &t) == -1);
	CHECK_CONTAINS(err, "names step 3, not step 4");
	CHECK(put_token("job7.stopped.token", text, 0600) == 0);
	w.step = 3;
	CHECK(take(&w, now, &t) == 0 && t.has_step && t.step == 3);
	{
		char cmd[300];

		snprintf(cmd, sizeof(cmd), "rm -rf %s", tok_dir);
		CHECK(system(cmd) == 0);
	}
}

/*
 * Only a pid file root wrote, a plain file with one link, names the
 * coordinator (the epilog stops what it names, as root): one the job's user
 * put in their directory, a hard link or a FIFO names nothing.
 */
static void test_coord_pidfile(void)
{
	char dir[64] = "/tmp/tpass-pid-XXXXXX", path[256], other[256], line[128];
	unsigned long long start = tpass_proc_start_time(getpid());
	int fd, n;

	if (geteuid() != 0)
		return; /* files of root and of another user: needs root */
	if (!mkdtemp(dir)) {
		CHECK(!"mkdtemp");
		return;
	}
	snprintf(path, sizeof(path), "%s/jobs", dir);
	CHECK(mkdir(path, 0755) == 0);
	snprintf(path, sizeof(path), "%s/jobs/7", dir);
	CHECK(mkdir(path, 0755) == 0);
	snprintf(path, sizeof(path), "%s/jobs/7/" TPASS_LAYOUT_COORDINATOR_PID, dir);
	snprintf(other, sizeof(other), "%s/other", dir);
	n = snprintf(line, sizeof(line), "%d %llu n1\n", (int)getpid(), start);
	fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0640);
	CHECK(fd >= 0 && write(fd, line, (size_t)n) == n);
	close(fd);
	CHECK(tpass_coord_running(dir, 7, 0, "n1")); /* root's, one link: this process */
	CHECK(chown(path, 65534, 65534) == 0);
	CHECK(!tpass_coord_running(dir, 7, 0, "n1")); /* the user's file */
	CHECK(chown(path, 0, 0) == 0);
	CHECK(link(path, other) == 0);
	CHECK(!tpass_coord_running(dir, 7, 0, "n1")); /* two links */
	unlink(other);
	CHECK(tpass_coord_running(dir, 7, 0, "n1"));
	unlink(path);
	CHECK(mkfifo(path, 0640) == 0);
	CHECK(!tpass_coord_running(dir, 7, 0, "n1")); /* a FIFO, not waited on */
	unlink(path);
	snprintf(path, sizeof(path), "%s/jobs/7", dir);
	rmdir(path);
	snprintf(path, sizeof(path), "%s/jobs", dir);
	rmdir(path);
	rmdir(dir);
}

int main(void)
{
	tpass_conf_defaults(&conf);
	test_opts_ok();
	test_opts_bad();
	test_opts_max_spares();
	test_opts_format();
	test_conf();
	test_uint();
	test_hostlist();
	test_tasks();
	test_pythonpath();
	test_ready();
	test_relaunch();
	test_relaunch_snapshot();
	test_env_set();
	test_stopped_parse();
	test_stopped_files();
	test_coord_pidfile();
	test_placement();
	test_token();
	printf("%d checks, %d failed\n", checks, failed);
	return failed ? 1 : 0;
}
