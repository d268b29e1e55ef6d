"""The coordinator's policy: when to migrate, how long each phase may take.

One frozen dataclass, loaded with torchpass.config (defaults -> TOML file ->
flags; unknown keys are rejected by name). The defaults below are the
documented defaults (docs/coordinator.md repeats them with their reasons).

Named policies: ``sbatch --torchpass=policy=NAME`` makes the coordinator load
``/etc/torchpass/policies/NAME.toml``. ``default`` is built in: it needs no
file, but an admin may put a ``default.toml`` there to change site defaults.
Any other name must have its file; a missing one is an error that lists the
policies that exist (a typo must never silently fall back to the defaults).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchpass import config as tconfig
from torchpass.coordinator.model import COMPUTE_KEPT, SpareHow
from torchpass.errors import ConfigError

DEFAULT_POLICIES_DIR = Path("/etc/torchpass/policies")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MIGRATE_STATES = ("degraded", "failed")
SPARE_STRATEGIES = tuple(h.value for h in SpareHow)  # ("hot", "expand", "companion")


@dataclass(frozen=True)
class CoordinatorPolicy:
    # --- detection -------------------------------------------------------
    # Node health states that start a planned migration. "unknown" (tpassd
    # silent, a check that itself failed) is never accepted here: not
    # knowing is not a fault. A "failed" node that is unreachable cannot be
    # dumped at all and is handed to Slurm whatever this says.
    migrate_on: tuple[str, ...] = ("degraded", "failed")
    # A rank whose collective count is behind another rank's and has not
    # advanced for this long is "stalled": its node counts as degraded.
    # Must exceed the longest legitimate one-rank pause (rank 0 writing a
    # checkpoint while the others wait in the next collective). 0 disables.
    stall_s: float = 600.0
    # Fail-slow (decide_failslow.py draws the rule): a node whose ranks' compute time per step
    # (runtime/compute_time.py: wall time with no collective in flight) is at least
    # failslow_ratio x the median of the other nodes' ranks, and at least failslow_min_excess_s
    # more, in each of failslow_windows windows of failslow_window_steps steps (the median step of
    # each rank in each window), and found so continuously for failslow_sustain_s, gets a planned
    # migration to a spare. 0 disables. A whole-job slowdown never fires (no node stands out).
    failslow_ratio: float = 1.5
    failslow_window_steps: int = 10
    failslow_windows: int = 3
    # At a few milliseconds per step a scheduler's noise alone makes a ratio of 1.5: on the
    # 2-core development VM with two devclusters training side by side, ranks of the same job
    # differed by up to ~10 ms per step (50-60 ms steps of examples/train_ddp.py --params 1M).
    failslow_min_excess_s: float = 0.02
    # Longer than a transient slowdown (a neighbour's burst, a checkpoint's copy on one node):
    # a slowdown shorter than this moves nothing.
    failslow_sustain_s: float = 15.0
    # A rank that dies on a live node (its task wrapper reports the exit or signal at once:
    # decide_rank_death.py) is matched to a GPU fault of its node (Xid, GPU lost, uncorrectable
    # ECC, from tpassd) reported within this many seconds before or after the death. tpassd
    # publishes an NVML event in milliseconds and a polled reading within its sample interval
    # (1 s by default), so 10 s covers both with room for a loaded node.
    death_event_window_s: float = 10.0
    # Relaunches of the job after a death with no hardware fault in the window (a bug in the
    # script, or the OOM killer: the script's own memory use); the next such death ends the job
    # as it would without torchpass. 0: never relaunch for one.
    max_unexplained_relaunches: int = 1

    # --- spares ------------------------------------------------------------
    # Order in which spares are sought: "hot" = an idle node inside the
    # allocation (--torchpass=spares=N), "expand" = grow the job through
    # slurmctld (needs permit_job_expansion), "companion" = a separate
    # allocation linked to the job. Remove a strategy to forbid it.
    spare_strategies: tuple[str, ...] = ("hot", "expand", "companion")
    # Only a spare whose tpassd reports "healthy" is used (false: any spare
    # that is not degraded or failed, "unknown" included).
    spare_requires_healthy: bool = True
    # How long one slurmctld spare request (or a granted spare's first
    # health report) may take before the next strategy is tried.
    spare_timeout_s: float = 300.0
    # Different spares tried within one migration (a spare that dies
    # during transfer/restore is replaced by the next free one).
    max_spare_attempts: int = 2
    # After "no spare anywhere", the node runs unprotected; ask again after.
    spare_retry_s: float = 900.0

    # --- the pause -----------------------------------------------------------
    # T is the smallest collective count every rank can still reach before it
    # stops: a rank learns of the pause at once while its report waits at the
    # coordinator as a long poll, else in the reply to its next progress
    # report, so T = max over ranks of (reported collectives + the job's
    # measured rate x (time since its report, or until its next report,
    # + pause_slack_s, + pause_fanout_s_per_1000_ranks per thousand ranks for
    # the long-polling ranks))
    # + pause_margin_collectives, then rounded up to the next optimizer-step
    # boundary when the ranks report one (decide.pause_point). The pause then
    # costs about one step of waiting, not ~30 (the old fixed margin of 64).
    pause_margin_collectives: int = 2
    # Covers the coordinator's decision delay and the reply's round trip
    # (and jitter of the report interval on a loaded node).
    pause_slack_s: float = 0.5
    # The same for a rank whose report waits at the coordinator as a long poll:
    # the pause leaves in the reply at once (milliseconds), so only the
    # decision and the reply's way to the rank are left to cover. T nearer by
    # (0.5 - 0.1) s x the job's rate: at 10M on the devcluster about one step
    # (docs/benchmark-history.md, "Decision to standstill").
    pause_slack_listening_s: float = 0.1
    # The pause to every long-polling rank leaves as one batch of replies; the
    # last rank of a large job hears it this much later per 1,000 ranks
    # (measured with bench/bench_coordinator.py: 0.25-0.46 s for 2,048 ranks on
    # a shared 2-core machine; docs/benchmarks.md).
    pause_fanout_s_per_1000_ranks: float = 0.25
    # T = max reported + this while no rate is known yet (fewer than two
    # progress reports, or no collective between them).
    pause_fallback_collectives: int = 64
    # A rank already past T refuses the pause; re-arm at a later T this often.
    max_pause_rearms: int = 2
    # How often the coordinator's supervisor starts a coordinator that died (killed, crashed) again
    # in one job (restart.py). 0: never; the ranks then go on unprotected, as without a supervisor.
    coordinator_restarts: int = 3

    # --- phase timeouts (seconds); an expired one rolls back ---------------
    pause_timeout_s: float = 60.0  # every rank quiesced at T
    dump_timeout_s: float = 600.0  # CUDA checkpoint + CRIU dump of every moved rank
    transfer_timeout_s: float = 600.0  # images readable on the target
    restore_timeout_s: float = 600.0  # CRIU restore (+ CUDA restore) on the target
    kill_timeout_s: float = 30.0  # the source copies are gone
    rebuild_timeout_s: float = 120.0  # every rank rebuilt its group and resumed (also rollback)
    finalize_timeout_s: float = 120.0  # drain, then shrink (training already runs)
    # Resume / resume-in-place commands sent before the job is declared stuck.
    max_resume_attempts: int = 3
    # A paused rank with no resume this long after it quiesced resumes in place on its own
    # (the coordinator died: docs/coordinator.md, "Never left paused"). 0: max_pause_s() + 60 s,
    # 3630 s with these defaults, beyond every phase's own deadline. A smaller value is for tests
    # that kill the coordinator: below the time a migration really takes, ranks would leave a
    # pause the coordinator still runs.
    hold_deadline_s: float = 0.0
    # Ports (inclusive range) of each generation's rendezvous store on rank 0's
    # node. Below Linux's default ephemeral range (ip_local_port_range
    # 32768-60999): a port in it can be held by any outgoing connection on that
    # node (the control link opens one per report) when rank 0 binds it, and a
    # failed bind there would stop the rebuild.
    rendezvous_ports: str = "30000-32767"

    # --- retries ---------------------------------------------------------------
    # A node whose migration failed is tried again after this long...
    retry_backoff_s: float = 600.0
    # ...at most this many times; then torchpass stops trying (an operator
    # can still run `tpassctl migrate`).
    max_attempts_per_node: int = 3

    # --- whole-job snapshots (tpassctl snapshot) ---------------------------------
    # Complete snapshots kept per job: when one more completes, root (tpassd) removes the older ones.
    snapshot_keep: int = 2
    # Seconds of training between the end of one whole-job snapshot and the start of the next
    # (each pauses every rank for one leave-running dump); 0: none but those an operator asks for.
    # `--torchpass=snapshot_every=S` sets it for one job, at least plugstack.conf's
    # snapshot_every_min_s. The first is taken this long after every rank registered.
    snapshot_every_s: float = 0.0

    # --- data rails (decide_reroute) ----------------------------------------------
    # A rail left out after a fault is used again once it has been usable on every node of the job
    # for this long: a rail that flaps five times in a minute causes one reroute, not five.
    rail_restore_after_s: float = 30.0

    def rendezvous_port_range(self) -> tuple[int, int]:
        m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", str(self.rendezvous_ports))
        lo, hi = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
        if not (m and 1024 <= lo <= hi <= 65535):
            raise ConfigError(f"rendezvous_ports: {self.rendezvous_ports!r} is not a port range like "
                              "\"30000-32767\" (1024-65535, low-high)")
        return lo, hi

    def validate(self) -> None:
        if self.rail_restore_after_s < 0:
            raise ConfigError(f"rail_restore_after_s must be >= 0, got {self.rail_restore_after_s!r}")
        bad = sorted(set(self.migrate_on) - set(MIGRATE_STATES))
        if bad:
            raise ConfigError(
                f"migrate_on: {', '.join(bad)} cannot trigger a migration; allowed: {', '.join(MIGRATE_STATES)}"
                + (" (unknown health is never a reason to migrate)" if "unknown" in bad else "")
            )
        bad = sorted(set(self.spare_strategies) - set(SPARE_STRATEGIES))
        if bad:
            raise ConfigError(
                f"spare_strategies: unknown strategy {', '.join(bad)}; allowed: {', '.join(SPARE_STRATEGIES)}"
            )
        if len(set(self.spare_strategies)) != len(self.spare_strategies):
            raise ConfigError(f"spare_strategies: {list(self.spare_strategies)} lists a strategy twice")
        for name in ("spare_timeout_s", "pause_timeout_s", "dump_timeout_s", "transfer_timeout_s",
                     "restore_timeout_s", "kill_timeout_s", "rebuild_timeout_s", "finalize_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("stall_s", "spare_retry_s", "retry_backoff_s", "hold_deadline_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.pause_margin_collectives < 1:
            raise ConfigError(f"pause_margin_collectives must be >= 1, got {self.pause_margin_collectives}")
        if self.pause_fallback_collectives < 1:
            raise ConfigError(f"pause_fallback_collectives must be >= 1, got {self.pause_fallback_collectives}")
        for name in ("pause_slack_s", "pause_slack_listening_s", "pause_fanout_s_per_1000_ranks"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("max_spare_attempts", "max_resume_attempts", "max_attempts_per_node"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        self.rendezvous_port_range()
        if self.snapshot_every_s < 0:
            raise ConfigError(
                f"snapshot_every_s must be >= 0 (0: no periodic snapshots), got {self.snapshot_every_s!r}")
        if self.snapshot_keep < 1:
            raise ConfigError(f"snapshot_keep must be >= 1, got {self.snapshot_keep}")
        if not (self.failslow_ratio == 0 or self.failslow_ratio > 1):
            raise ConfigError(f"failslow_ratio must be > 1 (or 0: fail-slow off), got {self.failslow_ratio!r}")
        if self.failslow_window_steps < 2 or self.failslow_windows < 1:
            raise ConfigError(f"failslow_window_steps must be >= 2 and failslow_windows >= 1, got "
                              f"{self.failslow_window_steps} and {self.failslow_windows}")
        if self.failslow_window_steps * self.failslow_windows > COMPUTE_KEPT:
            raise ConfigError(f"failslow_window_steps x failslow_windows must be <= {COMPUTE_KEPT} (the steps the "
                              f"coordinator keeps per rank), got {self.failslow_window_steps * self.failslow_windows}")
        for name in ("failslow_min_excess_s", "failslow_sustain_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not self.death_event_window_s > 0:
            raise ConfigError(f"death_event_window_s must be > 0, got {self.death_event_window_s!r}")
        if self.max_unexplained_relaunches < 0:
            raise ConfigError(f"max_unexplained_relaunches must be >= 0, got {self.max_unexplained_relaunches}")
        if self.max_pause_rearms < 0:
            raise ConfigError(f"max_pause_rearms must be >= 0, got {self.max_pause_rearms}")
        if self.coordinator_restarts < 0:
            raise ConfigError(f"coordinator_restarts must be >= 0, got {self.coordinator_restarts}")

    def max_pause_s(self) -> float:
        """Upper bound on how long one migration can keep training paused.

        Every paused phase has a deadline; re-arming, replacing a spare and
        resending a resume each restart a bounded number of deadlines.
        """
        pause = self.pause_timeout_s * (1 + self.max_pause_rearms)
        move = (self.transfer_timeout_s + self.restore_timeout_s) * self.max_spare_attempts
        resume = self.rebuild_timeout_s * self.max_resume_attempts
        return pause + self.dump_timeout_s + move + self.kill_timeout_s + resume


def policy_path(name: str, policies_dir: Path = DEFAULT_POLICIES_DIR) -> Path:
    if not _NAME.match(name):
        raise ConfigError(
            f"policy name {name!r} is invalid: use letters, digits, '.', '_' or '-' (it names "
            f"{policies_dir}/NAME.toml)"
        )
    return Path(policies_dir) / f"{name}.toml"


def load_policy(
    name: str = "default",
    *,
    policies_dir: Path = DEFAULT_POLICIES_DIR,
    flags: dict[str, Any] | None = None,
) -> CoordinatorPolicy:
    """The named policy: built-in defaults <- POLICIES_DIR/NAME.toml <- flags."""
    path = policy_path(name, policies_dir)
    if name != "default" and not path.exists():
        have = sorted(p.stem for p in Path(policies_dir).glob("*.toml")) if Path(policies_dir).is_dir() else []
        raise ConfigError(
            f"policy {name!r} not found: no {path}; available: "
            f"{', '.join(['default', *[h for h in have if h != 'default']])}"
        )
    return tconfig.load(CoordinatorPolicy, path=path, flags=flags)
