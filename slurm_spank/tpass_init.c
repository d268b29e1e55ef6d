/*
 * tpass-init - PID 1 of a rank's PID namespace.
 *
 *   tpass-init UID GID PARENT [GID...]
 *
 * Executed as root by the plugin's task_init_privileged hook (remote.c) in
 * the child it forks right after unshare(CLONE_NEWPID), so this process is
 * PID 1 of the namespace the task's children will land in.  It becomes the
 * job's uid, gid and groups with CAP_SYS_ADMIN as its only capability
 * (CRIU's parasite in the root of a dumped tree must mount a proc for the
 * namespace: without that capability an ordinary user's rank cannot be
 * dumped), keeps no fd but /dev/null, gets its own session and a working
 * directory of its own (make_workdir), and stays dumpable (drop_privileges
 * says why the user still cannot ptrace it, read its memory or use its
 * capability; the user may kill it, ending their own job).  The rank wrapper (PARENT, the task, running as the user)
 * double-forks the rank so that it is orphaned into the namespace and
 * reparented to us; we then wait for it and exit with its exit
 * code.  A rank ended by signal S cannot be mirrored (a namespace init
 * cannot die by a signal it sends itself): we name ourselves "tpass-sig:S"
 * and exit 128+S; the wrapper reads that name from our zombie before it
 * reaps us, and ends by S itself (torchpass.checkpoint.rankwrap).
 *
 * Built by slurm_spank/Makefile and installed next to torchpass.so, owned by
 * root and writable by root alone (the plugin checks that before it runs it).
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <linux/capability.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>

#include "cgroup_join.h"

#define TPASS_INIT_MAX_GROUPS 256

/* exit codes before the rank exists (the wrapper then runs it unprotected) */
enum { E_USAGE = 120, E_SETUP = 121, E_CAPS = 122, E_NO_RANK = 126 };

/*
 * Our working directory.  CRIU's parasite, run inside us when our tree is
 * dumped, makes a directory of one fixed name, "proc.crtools", in our cwd,
 * mounts a proc there, opens it and detaches it again (our /proc is the
 * node's, not our namespace's: criu/pie/parasite.c get_proc_fd).  It does
 * so with our ids and our CAP_SYS_ADMIN, by path.  So the directory must be
 *   - our own: with one cwd for every tpass-init, the ranks of a node dumped
 *     at once collided there (EEXIST: "Can't create a directory (-17)", the
 *     move rolled back);
 *   - writable by us but by no process of the job user: a directory the
 *     user could write would let the rank swap "proc.crtools" for a symlink
 *     between that mkdir and the mount, and have proc mounted over, or a
 *     mount detached from, any path of the node.
 * Hence WORKDIR_BASE/XXXXXX, both root's with mode 0770 and group root
 * (WORKDIR_GID), which we alone of the job's processes keep as a
 * supplementary group (drop_privileges): the user's processes can neither
 * enter nor change it, and root made both in /run, which is root's alone.
 * torchpass.checkpoint.criu records the path in the dump's manifest and
 * makes it on the node the rank is restored to; we remove it when the rank
 * ends (a copy killed after a move leaves it: tpassd removes that one).
 */
#define WORKDIR_BASE "/run/torchpass-init"
#define WORKDIR_GID 0
static char workdir[] = WORKDIR_BASE "/XXXXXX";
static int have_workdir;

static int root_dir_0770(int fd)
{
	struct stat st;

	return fstat(fd, &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == 0 &&
	       (st.st_gid == WORKDIR_GID || fchown(fd, 0, WORKDIR_GID) == 0) &&
	       fchmod(fd, 0770) == 0;
}

static int make_workdir(void)
{
	int fd, ok;

	if (mkdir(WORKDIR_BASE, 0770) < 0 && errno != EEXIST)
		return -1;
	fd = open(WORKDIR_BASE, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (fd < 0)
		return -1;
	ok = root_dir_0770(fd);
	close(fd);
	if (!ok || !mkdtemp(workdir))
		return -1;
	have_workdir = 1;
	fd = open(workdir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (fd < 0)
		return -1;
	ok = root_dir_0770(fd) && fchdir(fd) == 0;
	close(fd);
	return ok ? 0 : -1;
}

static void __attribute__((noreturn)) end(int code)
{
	if (have_workdir && chdir("/") == 0)
		rmdir(workdir);
	_exit(code);
}

/*
 * Slurm's cgroups.  slurmstepd forks the task, which runs the
 * plugin's task_init_privileged (forking us) while slurmstepd adds the task,
 * not its children, to the step's cgroups (proctrack/cgroup, task/cgroup);
 * only then does it let the task exec.  So we may start in the job's freezer
 * cgroup instead of the step's: scontrol listpids would not list us, tpassd
 * would refuse to dump the rank, and the step's end would not kill us.  The
 * plugin gives us EXEC_FD, the read end of a pipe whose write end the task
 * holds close-on-exec: at its EOF the task has exec'd, hence been placed,
 * and we move ourselves, still root, into its cgroup in every hierarchy where
 * ours differs (the rank, forked by the task after its exec, is there
 * already).  Paths come from the kernel (/proc/PARENT/cgroup and our
 * mountinfo); a path with ".." (outside our cgroup namespace) is left
 * alone.  Best effort: a cgroup we cannot join leaves us where we are, the
 * rank runs, and a dump of it is refused by tpassd with the reason.
 * The join itself is cgroup_join.c; torchpass/checkpoint/cgroup_join.py is
 * the restore agent's twin (tests/unit/test_cgroup_join_c_agrees.py).
 */
#define EXEC_FD 3
#define EXEC_WAIT_MS 30000

static int exec_fd_given(void)
{
	struct stat st;

	return fstat(EXEC_FD, &st) == 0 && S_ISFIFO(st.st_mode);
}

static void wait_task_exec(void)
{
	struct pollfd p = { .fd = EXEC_FD, .events = POLLIN };
	char c;

	while (poll(&p, 1, EXEC_WAIT_MS) < 0 && errno == EINTR)
		;
	while (read(EXEC_FD, &c, 1) < 0 && errno == EINTR)
		;
	close(EXEC_FD);
}

static int parse_id(const char *s, unsigned long *out)
{
	char *end;

	if (!s || !*s || strspn(s, "0123456789") != strlen(s))
		return -1;
	errno = 0;
	*out = strtoul(s, &end, 10);
	return errno || *out > 0x7fffffffUL ? -1 : 0;
}

/* Our child's pid in our namespace (the last NSpid), 0 if unknown. */
static pid_t ns_pid_of(pid_t host)
{
	char path[64], line[256];
	pid_t ns = 0;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/status", (int)host);
	if (!(f = fopen(path, "re")))
		return 0;
	while (fgets(line, sizeof(line), f))
		if (!strncmp(line, "NSpid:", 6)) {
			char *p = line + 6, *end;
			long v;

			while ((v = strtol(p, &end, 10)), end != p) {
				ns = (pid_t)v;
				p = end;
			}
		}
	fclose(f);
	return ns;
}

/* The first process reparented to us: the rank.  0 when the wrapper died first. */
static pid_t wait_for_rank(pid_t parent)
{
	char buf[256], path[64];

	snprintf(path, sizeof(path), "/proc/%d", (int)parent);
	for (;;) {
		FILE *f = fopen("/proc/thread-self/children", "re");
		pid_t host = 0, ns;

		buf[0] = '\0';
		if (f) {
			if (!fgets(buf, sizeof(buf), f))
				buf[0] = '\0';
			fclose(f);
		}
		host = (pid_t)atoi(buf);
		if (host > 0 && (ns = ns_pid_of(host)) > 0)
			return ns;
		/* PARENT is a host pid; /proc is the node's (no mount namespace) */
		if (host <= 0 && access(path, F_OK) < 0)
			return 0;
		usleep(5000);
	}
}

/* groups has room for one more: WORKDIR_GID is added unless the job has it. */
static void drop_privileges(uid_t uid, gid_t gid, gid_t *groups, int ngroups)
{
	struct __user_cap_header_struct hdr = { _LINUX_CAPABILITY_VERSION_3, 0 };
	struct __user_cap_data_struct data[2];
	unsigned bit = 1U << (CAP_SYS_ADMIN % 32);
	int i;

	for (i = 0; i < ngroups && groups[i] != WORKDIR_GID; i++)
		;
	if (i == ngroups)
		groups[ngroups++] = WORKDIR_GID;
	if (prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0) < 0 ||
	    setgroups((size_t)ngroups, groups) < 0 ||
	    setresgid(gid, gid, gid) < 0 || setresuid(uid, uid, uid) < 0)
		end(E_SETUP);
	memset(data, 0, sizeof(data));
	data[CAP_SYS_ADMIN / 32].permitted = bit;
	data[CAP_SYS_ADMIN / 32].effective = bit;
	if (syscall(SYS_capset, &hdr, data) < 0)
		end(E_CAPS);
	prctl(PR_SET_KEEPCAPS, 0, 0, 0, 0);
	/*
	 * Dumpable again (the change of uid above cleared it, fs.suid_dumpable
	 * being 0), so that our /proc files are the job user's and the dump's
	 * criu, running as that user with CAP_SYS_ADMIN among its capabilities,
	 * may ptrace us and read them without CAP_SYS_PTRACE or
	 * CAP_DAC_READ_SEARCH.  The job user's own processes still cannot: the
	 * kernel lets one process ptrace or read the memory, environ, fds or
	 * cwd of another only if its permitted capabilities include all of the
	 * other's (cap_ptrace_access_check), and we hold CAP_SYS_ADMIN, which
	 * they do not.  Measured on Linux 6.18 as the job user against us:
	 * PTRACE_SEIZE, process_vm_readv and pidfd_getfd EPERM; /proc/PID/mem,
	 * environ, fd/N, fdinfo/N, cwd and root EACCES; only the names in fd/
	 * (0, 1, 2: /dev/null) can be listed
	 * (tests/unit/test_criu_owner_creds.py).
	 */
	prctl(PR_SET_DUMPABLE, 1, 0, 0, 0);
}

int main(int argc, char **argv)
{
	gid_t groups[TPASS_INIT_MAX_GROUPS + 1];
	unsigned long uid, gid, parent, v;
	sigset_t all;
	pid_t rank;
	int ngroups = 0, fd, st, exec_fd;

	if (argc < 4 || argc - 4 > TPASS_INIT_MAX_GROUPS ||
	    parse_id(argv[1], &uid) || parse_id(argv[2], &gid) ||
	    parse_id(argv[3], &parent) || !parent)
		return E_USAGE;
	for (int i = 4; i < argc; i++) {
		if (parse_id(argv[i], &v))
			return E_USAGE;
		groups[ngroups++] = (gid_t)v;
	}
	if (!ngroups)
		groups[ngroups++] = (gid_t)gid;
	sigfillset(&all);
	sigprocmask(SIG_UNBLOCK, &all, NULL);
	for (int s = 1; s < NSIG; s++)
		signal(s, SIG_DFL);
	exec_fd = exec_fd_given();
	syscall(SYS_close_range, exec_fd ? 4U : 3U, ~0U, 0);
	fd = open("/dev/null", O_RDWR);
	if (fd < 0)
		return E_SETUP;
	dup2(fd, 0);
	dup2(fd, 1);
	dup2(fd, 2);
	if (fd > 2)
		close(fd);
	setsid();
	if (make_workdir() < 0)
		end(E_SETUP);
	if (exec_fd) {
		wait_task_exec();
		{
			char task[16];

			snprintf(task, sizeof(task), "%lu", parent);
			tpass_join_cgroups_of("/proc", task);
		}
	}
	drop_privileges((uid_t)uid, (gid_t)gid, groups, ngroups);
	prctl(PR_SET_NAME, "tpass-init", 0, 0, 0);
	rank = wait_for_rank((pid_t)parent);
	if (!rank)
		end(E_NO_RANK);
	for (;;) {
		pid_t got = waitpid(-1, &st, 0);

		if (got < 0 && errno == EINTR)
			continue;
		if (got < 0)
			end(E_NO_RANK);
		if (got != rank)
			continue; /* an orphan of the rank's: reaped, as an init does */
		if (WIFEXITED(st))
			end(WEXITSTATUS(st));
		{
			char name[16];

			snprintf(name, sizeof(name), "tpass-sig:%d", WTERMSIG(st));
			prctl(PR_SET_NAME, name, 0, 0, 0);
		}
		end(128 + WTERMSIG(st));
	}
}
