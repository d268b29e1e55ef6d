"""tpassd: the torchpass node daemon (entry point ``tpassd``).

    tpassd [--config /etc/torchpass/tpassd.toml] [--node-name N] [--bind-address A]
           [--interval S] [--nvml-provider auto|nvml|fake|none] [--sysfs-root DIR] ...
    tpassd --check-config [--config FILE]
    tpassd --sweep-job JOBID [--config FILE]

``--sweep-job J`` (a node ``Epilog=`` helper, contrib/epilog.d): remove job
J's migration images under snapshot_dir and its hold files under the jobs'
state directory (tpassd/sweep.py), without following any link, and exit.
Refused while Slurm says the job is running or pending; the running
tpassd's own sweep catches what a dump still running then writes.

``--fixture-sysfs`` (the devcluster and benches, which run tpassd with fake
GPUs): before starting, rebuild a healthy fixture InfiniBand tree (4 ACTIVE
ports) under the config's sysfs_root, so a restarted tpassd begins healthy
as a fresh fake GPU set does. Refused when sysfs_root is the real /sys.

Settings: defaults -> config file -> TPASSD_* environment -> flags.

Signals: SIGTERM and SIGINT stop it; SIGHUP re-reads the policy file (an
invalid one keeps the policy in force and logs one error). Under systemd
(``Type=notify``, tpassd/sd_notify.py) it says READY=1 once its sockets
accept and pings the watchdog while health samples flow. Exit status: 0
stopped, 1 could not start, 2 an invalid config or policy (the unit's
``RestartPreventExitStatus=2``: restarting cannot fix it).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

import structlog

from torchpass import __version__, logs, slurm
from torchpass.errors import TorchpassError
from torchpass.slurm import SlurmClient
from torchpass.tpassd_ports import CONFIG_ENV
from tpassd.checkpoint_handlers import job_state_dir
from tpassd.config import DEFAULT_CONFIG, load_config
from tpassd.daemon import Tpassd
from tpassd.drills import write_fixture_tree
from tpassd.policy import load_policy
from tpassd.sd_notify import Notifier, SampleWatchdog, watchdog_period_s
from tpassd.sweep import Sweeper

log = structlog.get_logger("tpassd")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tpassd", description="torchpass node health daemon")
    p.add_argument("--version", action="version", version=f"tpassd {__version__}")
    p.add_argument("--config", type=Path, default=None,
                   help=f"config file (default ${CONFIG_ENV} or {DEFAULT_CONFIG}; optional there)")
    p.add_argument("--check-config", action="store_true", help="validate the config and policy, print them, exit")
    p.add_argument("--node-name")
    p.add_argument("--bind-address")
    p.add_argument("--pub-port", type=int)
    p.add_argument("--control-port", type=int)
    p.add_argument("--metrics-port", type=int)
    p.add_argument("--interval", dest="interval_s", type=float)
    p.add_argument("--nvml-provider", choices=["auto", "nvml", "fake", "none"])
    p.add_argument("--fake-gpus", type=int)
    p.add_argument("--sysfs-root", type=Path)
    p.add_argument("--state-dir", type=Path)
    p.add_argument("--snapshot-dir", type=Path)
    p.add_argument("--policy", type=Path)
    p.add_argument("--munge-socket")
    p.add_argument("--ports-file", type=Path)
    p.add_argument("--drills", action="store_true", default=None, help="accept fault drills (fake provider only)")
    p.add_argument("--log-level")
    p.add_argument("--sweep-job", type=int, metavar="JOBID",
                   help="remove this ended job's migration images and hold files, then exit (Epilog)")
    p.add_argument("--fixture-sysfs", action="store_true",
                   help="rebuild a healthy fixture InfiniBand tree under sysfs_root first (never /sys)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    not_config = ("config", "check_config", "fixture_sysfs", "sweep_job")
    flags = {k: v for k, v in vars(args).items() if k not in not_config and v is not None}
    try:
        cfg = load_config(args.config, flags=flags, required_file=args.config is not None)
        policy = load_policy(cfg.policy)
    except TorchpassError as exc:
        logs.say(f"tpassd: {exc}")
        return 2
    if args.check_config:
        def plain(o):
            return {k: plain(v) for k, v in o.items()} if isinstance(o, dict) else (
                str(o) if isinstance(o, Path) else o)

        print(json.dumps({"config": plain(asdict(cfg)), "policy": asdict(policy)}, indent=2, default=str))
        print("tpassd: configuration OK", file=sys.stderr)
        return 0
    if args.sweep_job is not None:
        return sweep_job(cfg, args.sweep_job)
    if args.fixture_sysfs:
        if cfg.sysfs_root.resolve() == Path("/sys"):
            logs.say("tpassd: --fixture-sysfs needs a sysfs_root other than /sys")
            return 2
        shutil.rmtree(cfg.sysfs_root, ignore_errors=True)
        write_fixture_tree(cfg.sysfs_root)
    logs.configure(cfg.log_level)
    fixed_mmap_threshold()
    signals = Signals().install()
    try:
        daemon = Tpassd(cfg, policy=policy)
    except TorchpassError as exc:
        logs.say(f"tpassd: {exc}")
        return 1
    return serve(daemon, signals, Notifier.from_environment(), watchdog_period_s())


class Signals:
    """SIGTERM/SIGINT (stop) and SIGHUP (re-read the policy), for ``serve``'s loop on the main
    thread. The handlers only set flags, which the loop reads every ``POLL_S``: a handler that
    took a lock (``Event.set``) could wait for ever on one the interrupted main thread holds."""

    POLL_S = 0.2

    def __init__(self) -> None:
        self.stop = False
        self.reload = False

    def install(self) -> Signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_reload)
        return self

    def _on_stop(self, *_: object) -> None:
        self.stop = True

    def _on_reload(self, *_: object) -> None:
        self.reload = True

    def wait(self) -> None:
        """Until a signal came (at most ``POLL_S``: a signal cuts the sleep short)."""
        if not (self.stop or self.reload):
            time.sleep(self.POLL_S)


def serve(daemon: Tpassd, signals: Signals, notifier: Notifier, watchdog_s: float | None) -> int:
    """Start ``daemon`` and run it until ``signals.stop``; tell systemd (``notifier``) when it is
    ready, reloading and stopping, and ping its watchdog (every ``watchdog_s / 2``; None: off)
    while samples flow. 1 when it cannot start."""
    cfg = daemon.cfg
    try:
        daemon.start()
    except TorchpassError as exc:
        logs.say(f"tpassd: {exc}")
        return 1
    watchdog = None
    try:
        # start() returned: the PUB, control and metrics sockets are bound (a ZeroMQ bind listens
        # before it returns) and the control thread answers; only now may systemd call tpassd up.
        notifier.send(READY=1, STATUS=ready_status(daemon))
        if watchdog_s is not None:
            watchdog = SampleWatchdog(notifier, watchdog_s, 2 * cfg.interval_s + cfg.collector_timeout_s,
                                      lambda: daemon.last_tick_end).start()
        while not signals.stop:
            signals.wait()
            if signals.reload and not signals.stop:
                signals.reload = False
                notifier.send(RELOADING=1, MONOTONIC_USEC=time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000)
                reload_policy(daemon, cfg.policy)
                notifier.send(READY=1, STATUS=ready_status(daemon))
        notifier.send(STOPPING=1)
    finally:
        if watchdog is not None:
            watchdog.stop()
        daemon.stop()
        notifier.close()
    return 0


def ready_status(daemon: Tpassd) -> str:
    """The line ``systemctl status tpassd`` shows."""
    p = daemon.ports()
    return f"serving {daemon.node}: pub {p['pub_port']}, control {p['control_port']}, metrics {p['metrics_port']}"


def reload_policy(daemon: Tpassd, path: Path | None) -> bool:
    """SIGHUP: read the policy file again and apply it. An invalid file keeps the policy in force
    and logs one error; True when the new one applies."""
    try:
        new = load_policy(path)
    except (TorchpassError, OSError) as exc:
        log.error("policy not reloaded: the file is invalid; the policy in force stays", policy=str(path),
                  error=str(exc))
        return False
    changed = changed_keys(asdict(daemon.policy), asdict(new))
    daemon.set_policy(new)
    log.info("policy reloaded", policy=str(path) if path else "(defaults)", changed=changed)
    return True


def changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested policy dicts."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += changed_keys(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}")
    return out


# glibc serves an allocation of this size or more with its own mmap, returned at free. By default
# the threshold rises to the largest block freed (up to 32 MiB), and then every 1 MiB frame that
# ZeroMQ's I/O thread reads comes from a heap arena that keeps it after the free: under 1,000 peers
# sending 1 MiB frames, tpassd's RSS stayed at 210 MB after the flood with 16 peers allowed; with the
# threshold fixed it fell back to 65 MB (tests/unit/test_tpassd_limits.py measures the peak).
MMAP_THRESHOLD = 128 << 10
M_MMAP_THRESHOLD = -3  # malloc.h


def fixed_mmap_threshold() -> None:
    """Fix glibc's mmap threshold (no rise): freed frames go back to the system at once."""
    try:
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    except (OSError, AttributeError):
        pass  # not glibc: its allocator decides


STILL_RUNNING = ("RUNNING", "PENDING", "SUSPENDED", "CONFIGURING", "REQUEUED", "RESIZING")


def sweep_job(cfg, job_id: int, slurm_client: SlurmClient | None = None) -> int:
    """``tpassd --sweep-job J``: one ended job's files; prints what it removed as JSON."""
    logs.configure(cfg.log_level)
    if job_id < 1:
        print(f"tpassd: --sweep-job needs a job id >= 1, got {job_id}", file=sys.stderr)
        return 2
    sl = slurm_client or slurm.client()
    try:
        info = sl.job(job_id)
    except TorchpassError as exc:  # the Epilog's word that the job ended is enough
        info = None
        print(f"tpassd: cannot ask Slurm about job {job_id} ({exc}); sweeping on the Epilog's word",
              file=sys.stderr)
    if info is not None and info.state in STILL_RUNNING:
        print(f"tpassd: job {job_id} is {info.state}; its migration files are in use, not removed "
              "(run --sweep-job from the Epilog, once the job ended)", file=sys.stderr)
        return 1
    res = Sweeper(cfg.snapshot_dir, job_state_dir(cfg), lambda: sl).sweep_job(job_id)
    print(json.dumps({"job_id": job_id, **res.as_dict()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
