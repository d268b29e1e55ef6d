"""Every TORCHPASS_* environment variable, defined once for Python (slurm_spank/envnames.h is
the C side; tests/unit/test_envnames_c_agrees.py checks that the two agree and that no other
file spells a name itself).

Set by the SPANK plugin in every task of a --torchpass step (slurm_spank/remote.c), read by the
rank runtime, the rank wrapper and the coordinator; the others are settings of one program.
Importing this loads nothing.
"""

from __future__ import annotations

PREFIX = "TORCHPASS_"

# --- the plugin sets these in every task of a --torchpass step (remote.c) ---------------------
JOB_ID = "TORCHPASS_JOB_ID"  # the job's id (its batch step's, for every srun of it)
STATE_DIR = "TORCHPASS_STATE_DIR"  # plugstack.conf state_dir: STATE_DIR/jobs/J (torchpass.layout)
COORDINATOR = "TORCHPASS_COORDINATOR"  # ADDR:PORT of the job's coordinator
JOB_SECRET = "TORCHPASS_JOB_SECRET"  # the job secret (hex) that signs every rank.* request
NODE = "TORCHPASS_NODE"  # the node the task runs on, as Slurm names it
SPARES = "TORCHPASS_SPARES"  # --torchpass-spares
POLICY = "TORCHPASS_POLICY"  # --torchpass-policy
SNAPSHOT_EVERY = "TORCHPASS_SNAPSHOT_EVERY"  # --torchpass-snapshot-every (seconds)
SPARE_NODES = "TORCHPASS_SPARE_NODES"  # the allocation's nodes kept as spares
ACTIVE_NODES = "TORCHPASS_ACTIVE_NODES"  # the allocation's nodes the steps run on
ALLOC_PREFIX = "TORCHPASS_ALLOC_"  # + a SLURM_* name: the allocation's own value (placement.h)
RUNTIME = "TORCHPASS_RUNTIME"  # "0": do not load the rank runtime into Python
# --- restores: set on a restore step, read by the plugin and the rank wrapper ------------------
RESTORE_RANK = "TORCHPASS_RESTORE_RANK"  # a migration's restore step: the rank it restores
RESTORE_JOB = "TORCHPASS_RESTORE_JOB"  # ... and its job
RESTORE_SNAPSHOT = "TORCHPASS_RESTORE_SNAPSHOT"  # a step relaunched from this whole-job snapshot
# --- the rank wrapper and the runtime -----------------------------------------------------------
TASK = "TORCHPASS_TASK"  # the wrapper's Slurm task (its rank record's key)
RANK_STATE_DIR = "TORCHPASS_RANK_STATE_DIR"  # the wrapper's record directory
AGENT_DIR = "TORCHPASS_AGENT_DIR"  # torchrun's agent: where its workers' hold markers go
PROGRESS_INTERVAL = "TORCHPASS_PROGRESS_INTERVAL"  # seconds between a rank's progress reports
PAUSED_POLL_INTERVAL = "TORCHPASS_PAUSED_POLL_INTERVAL"  # seconds between a paused rank's polls
COORDINATOR_LOST_S = "TORCHPASS_COORDINATOR_LOST_S"  # no answer this long: coordinator.lost
RELAY = "TORCHPASS_RELAY"  # "0": no node relay (every rank connects to the coordinator itself)
RELAY_DIR = "TORCHPASS_RELAY_DIR"  # where the node relay's socket lives
DEBUG = "TORCHPASS_DEBUG"  # the process group's debug lines
DATA_RAILS = "TORCHPASS_DATA_RAILS"  # the nodes' data interfaces ("rail0,rail1"); unset: the default route's
ALLOW_TORCH = "TORCHPASS_ALLOW_TORCH"  # a site's torch minor versions beyond the tested ones ("2.11,2.12")
TEST_TORCH_VERSION = "TORCHPASS_TEST_TORCH_VERSION"  # tests only: the torch version the runtime checks
# --- programs' settings -------------------------------------------------------------------------
MUNGE_SOCKET = "TORCHPASS_MUNGE_SOCKET"  # munged's socket (else MUNGE_SOCKET, else libmunge's)
TPASSD_CONFIG = "TORCHPASS_TPASSD_CONFIG"  # tpassd's config file, for its ports
SLURM_BACKEND = "TORCHPASS_SLURM_BACKEND"  # torchpass.slurm's client
STRICT_TRANSITIONS = "TORCHPASS_STRICT_TRANSITIONS"  # "1": an illegal state move raises (tests)
# --- the devcluster ---------------------------------------------------------------------------
DEVCLUSTER = "TORCHPASS_DEVCLUSTER"  # the devcluster a command runs in
JOB_PYTHON = "TORCHPASS_JOB_PYTHON"  # the job Python of a devcluster
JOB_VENV = "TORCHPASS_JOB_VENV"  # where `make jobvenv` builds it

# The names the SPANK plugin reads or sets: slurm_spank/envnames.h defines each of them.
PLUGIN_NAMES = frozenset({JOB_ID, STATE_DIR, COORDINATOR, JOB_SECRET, NODE, SPARES, POLICY, SNAPSHOT_EVERY,
                          SPARE_NODES, ACTIVE_NODES, ALLOC_PREFIX, RUNTIME, RESTORE_RANK, RESTORE_JOB,
                          RESTORE_SNAPSHOT})

ALL = frozenset(v for k, v in dict(globals()).items() if k.isupper() and k not in ("PREFIX",) and isinstance(v, str))
