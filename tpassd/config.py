"""tpassd's settings: one typed object, defaults -> /etc/torchpass/tpassd.toml
(or $TORCHPASS_TPASSD_CONFIG) -> environment (TPASSD_<KEY>) -> command-line
flags. Unknown keys are rejected by name. Every key is documented in
docs/tpassd.md and contrib/tpassd.toml.example. The coordinator and tpassctl
read tpassd's ports from the same file and variables (torchpass/tpassd_ports.py)."""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path

from torchpass import config as tconfig
from torchpass import layout
from torchpass.accounting import DEFAULT_FIELD, FIELDS
from torchpass.errors import ConfigError
from torchpass.ports import TPASSD_CONTROL_PORT, TPASSD_METRICS_PORT, TPASSD_PUB_PORT
from torchpass.tpassd_ports import DEFAULT_TPASSD_CONFIG as DEFAULT_CONFIG  # noqa: F401 - tpassd/main.py imports it
from torchpass.tpassd_ports import ENV_PREFIX, tpassd_config_path

PROVIDERS = ("auto", "nvml", "fake", "none")
_GPU_UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@dataclass(frozen=True)
class TpassdConfig:
    node_name: str = ""  # "" = this host's short hostname (Slurm's NodeName)
    bind_address: str = "0.0.0.0"
    pub_port: int = TPASSD_PUB_PORT  # 0 = ephemeral (tests); see ports_file
    control_port: int = TPASSD_CONTROL_PORT
    metrics_port: int = TPASSD_METRICS_PORT  # -1 = no metrics endpoint
    metrics_address: str = ""  # "" = bind_address
    interval_s: float = 1.0  # sampling and heartbeat interval
    collector_timeout_s: float = 0.5  # a collector slower than this is "unknown" for that tick
    nvml_provider: str = "auto"  # auto | nvml | fake | none (docs/tpassd.md)
    fake_gpus: int = 8
    # The fake GPUs' UUIDs, GPU 0 first (the devcluster gives each node its own, as it names them
    # in the node's GPU inventory); () = GPU-fake-NNNN-... by index.
    fake_gpu_uuids: tuple[str, ...] = ()
    fake_nvlinks: int = 4
    # The node's GPUs from this root-owned JSON file rather than NVML (the devcluster's fake GPUs,
    # torchpass.checkpoint.gpu_map.file_inventory); None = NVML.
    gpu_inventory: Path | None = None
    sysfs_root: Path = Path("/sys")
    ib_expected_ports: int = -1  # >= 0: fewer ports than this is a fault
    # The node's data rails: Ethernet interfaces ("eth1") and IB ports ("ib:mlx5_0/1"). A rail
    # down leaves the node's state alone (jobs reroute) until none is usable; () = no rails, every
    # IB port judged as before. A listed rail the node lacks stops tpassd at start.
    rails: tuple[str, ...] = ()
    procfs_root: Path = Path("/proc")  # /proc/net/dev of tpassd's own network namespace
    state_dir: Path = Path("/var/lib/torchpass")
    snapshot_dir: Path = Path("/var/lib/torchpass/snapshots")
    # More node-local directories whose free space is health (besides snapshot_dir); one that a
    # user other than root can write is left out with a log line (tpassd/collectors/host.py).
    disk_paths: tuple[Path, ...] = ()
    criu_binary: str = ""  # "" = criu on PATH, else /usr/sbin/criu; must be >= 4.0
    policy: Path | None = None  # health policy TOML; None = the documented defaults
    munge_socket: str = ""  # "" = $MUNGE_SOCKET or munge's default socket
    drills: bool = False  # accept fault drills (needs nvml_provider = fake or a non-/sys sysfs_root)
    ports_file: Path | None = None  # write the bound ports here as JSON (port 0 in tests)
    # Remove ended jobs' migration images and hold files (tpassd/sweep.py) at start and
    # this often; 0 = never (then use the Epilog helper, contrib/epilog.d/torchpass-sweep).
    sweep_interval_s: float = 300.0
    # Complete whole-job snapshots (tpassctl snapshot, snapshot_every): at most this many GB per user
    # over all their jobs (a commit beyond it is refused and its images removed); 0 = no quota.
    snapshot_quota_gb: float = 0.0
    # The tpassd that committed a snapshot removes it this many hours after it was taken (at its
    # sweep); 0 = kept until deleted or replaced by retention.
    snapshot_max_age_h: float = 0.0
    # Restore tokens (torchpass.checkpoint.restore_token): root's, node-local; the SPANK plugin's
    # restore_tokens= in plugstack.conf must name the same directory.
    restore_token_dir: Path = Path(layout.RESTORE_TOKENS)
    # Requests of at most this many jobs per uid in flight on this tpassd (waiting, queued or running;
    # a job's requests for all its ranks count as one); root is not limited (tpassd/control.py).
    max_jobs_per_uid: int = 2
    # TCP connections to the control port at once; each new one beyond closes the oldest that never
    # authenticated (a client reconnects by itself). Under attack each may hold 2 MiB (tpassd/control.py).
    control_max_peers: int = 16
    # Remove STATE_DIR/jobs/J of a job Slurm no longer lists this many hours after it ended (at the
    # sweep); 0 = kept (then remove them yourself).
    job_dir_retention_h: float = 168.0
    # Where this tpassd appends its node's health changes for the fleet history (docs/fleet.md):
    # a root-only directory every node shares; "" = STATE_DIR/fleet/spool. "-" = none.
    fleet_spool: str = ""
    # The job field tpassd keeps torchpass' "torchpass: ..." part in (torchpass/accounting.py):
    # AdminComment, Comment, or "" (off).
    accounting_field: str = DEFAULT_FIELD
    log_level: str = "info"

    def validate(self) -> None:
        if self.nvml_provider not in PROVIDERS:
            raise ConfigError(f"nvml_provider must be one of {', '.join(PROVIDERS)}, got {self.nvml_provider!r}")
        if not 0.05 <= self.interval_s <= 3600:
            raise ConfigError(f"interval_s must be between 0.05 and 3600, got {self.interval_s}")
        if not 0 < self.collector_timeout_s <= self.interval_s:
            raise ConfigError(
                f"collector_timeout_s must be > 0 and <= interval_s ({self.interval_s}), got {self.collector_timeout_s}"
            )
        for name in ("pub_port", "control_port"):
            v = getattr(self, name)
            if not 0 <= v <= 65535:
                raise ConfigError(f"{name} must be 0..65535, got {v}")
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be -1 (off) or 0..65535, got {self.metrics_port}")
        if self.sweep_interval_s != 0 and not 10 <= self.sweep_interval_s <= 86400:
            raise ConfigError(f"sweep_interval_s must be 0 (off) or 10..86400, got {self.sweep_interval_s}")
        for name in ("snapshot_quota_gb", "snapshot_max_age_h"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0: no limit), got {getattr(self, name)}")
        if self.snapshot_max_age_h > 0 and self.sweep_interval_s == 0:
            raise ConfigError("snapshot_max_age_h needs the sweep (sweep_interval_s > 0): it removes expired snapshots")
        if self.gpu_inventory is not None and not Path(self.gpu_inventory).is_absolute():
            raise ConfigError(f"gpu_inventory must be an absolute path, got {str(self.gpu_inventory)!r}")
        if not Path(self.restore_token_dir).is_absolute():
            raise ConfigError(f"restore_token_dir must be an absolute path, got {str(self.restore_token_dir)!r}")
        if not 1 <= self.max_jobs_per_uid <= 1024:
            raise ConfigError(f"max_jobs_per_uid must be 1..1024, got {self.max_jobs_per_uid}")
        if not 4 <= self.control_max_peers <= 4096:
            raise ConfigError(f"control_max_peers must be 4..4096, got {self.control_max_peers}")
        if self.job_dir_retention_h < 0:
            raise ConfigError(f"job_dir_retention_h must be >= 0 (0: kept), got {self.job_dir_retention_h}")
        if not 0 <= self.fake_gpus <= 64:
            raise ConfigError(f"fake_gpus must be 0..64, got {self.fake_gpus}")
        if self.fake_gpu_uuids and len(self.fake_gpu_uuids) != self.fake_gpus:
            raise ConfigError(f"fake_gpu_uuids names {len(self.fake_gpu_uuids)} GPUs, fake_gpus is {self.fake_gpus}")
        for u in self.fake_gpu_uuids:
            if not _GPU_UUID.fullmatch(u):
                raise ConfigError(f"fake_gpu_uuids: {u!r} is not a GPU UUID (GPU- and 32 hex digits, 8-4-4-4-12)")
        for rail in self.rails:
            if not rail or "," in rail or (rail.startswith("ib:") and "/" not in rail):
                raise ConfigError(f"rails: {rail!r} is not an interface name or ib:DEVICE/PORT")
        if len(set(self.rails)) != len(self.rails):
            raise ConfigError(f"rails lists a rail twice: {list(self.rails)}")
        if self.fleet_spool not in ("", "-") and not Path(self.fleet_spool).is_absolute():
            raise ConfigError(f"fleet_spool must be an absolute path, \"\" or \"-\", got {self.fleet_spool!r}")
        if self.accounting_field and self.accounting_field not in FIELDS:
            raise ConfigError(f"accounting_field must be one of {', '.join(FIELDS)} or \"\" (off), "
                              f"got {self.accounting_field!r}")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")

    @property
    def node(self) -> str:
        return self.node_name or socket.gethostname().split(".")[0]


def load_config(path: Path | None = None, flags: dict | None = None, environ: dict | None = None,
                required_file: bool = False) -> TpassdConfig:
    path = tpassd_config_path(environ) if path is None else Path(path)
    return tconfig.load(TpassdConfig, path=path, env_prefix=ENV_PREFIX, flags=flags, environ=environ,
                        required_file=required_file)
