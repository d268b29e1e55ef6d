"""How the devcluster starts a real tpassd on each node, by its command line:
fake NVML (8 GPUs, drills on) and a fixture InfiniBand tree (4 ports, rebuilt
by ``tpassd --fixture-sysfs`` on every start), bound to the node's address on
the cluster's tpassd ports (the defaults unless the spec says otherwise), authenticated with the cluster's munged.

Each tpassd runs under ``setpriv --bounding-set`` of the capabilities that the
systemd unit (contrib/systemd/tpassd.service, ``CapabilityBoundingSet=``)
leaves it: read from that file at every start, so every migration test runs
with the unit's capabilities, and a capability the unit lacks fails them.

The devcluster runs the installed ``tpassd`` program; it imports nothing from
the tpassd package (torchpass never imports tpassd)."""

from __future__ import annotations

import shutil
import sys
from importlib import resources
from pathlib import Path

from torchpass.errors import DevclusterError
from torchpass.ports import TPASSD_CONTROL_PORT, TPASSD_METRICS_PORT, TPASSD_PUB_PORT


def _toml_str(v: object) -> str:
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def tpassd_program() -> str:
    """The ``tpassd`` console script beside this Python (the virtualenv's), else on PATH."""
    beside = Path(sys.executable).parent / "tpassd"
    found = str(beside) if beside.is_file() else shutil.which("tpassd")
    if not found:
        raise DevclusterError("tpassd is not installed in this environment (no tpassd program beside "
                              f"{sys.executable} or on PATH); pip install -e .")
    return found


UNIT_NAME = "tpassd.service"
SETPRIV = "/usr/bin/setpriv"


def unit_file() -> Path:
    """contrib/systemd/tpassd.service: in the checkout this package runs from, else in the
    package's own data (an installed wheel)."""
    checkout = Path(__file__).resolve().parents[2] / "contrib" / "systemd" / UNIT_NAME
    candidates = [checkout]
    try:
        pkg = Path(str(resources.files("torchpass")))
        candidates += [pkg / "contrib" / "systemd" / UNIT_NAME, pkg / "data" / "contrib" / "systemd" / UNIT_NAME]
    except (ModuleNotFoundError, TypeError):
        pass
    candidates.append(Path(sys.prefix) / "share" / "torchpass" / "contrib" / "systemd" / UNIT_NAME)
    for c in candidates:
        if c.is_file():
            return c
    raise DevclusterError(f"tpassd's unit file is not installed (looked at {', '.join(map(str, candidates))}); "
                          "the devcluster runs tpassd with its CapabilityBoundingSet=")


def unit_bounding_set(text: str) -> list[str]:
    """The capabilities a unit's ``CapabilityBoundingSet=`` lines leave, as setpriv names them
    ("sys_admin"), in the unit's order. systemd.exec(5): the lines add up and an empty one resets;
    an inverted list ("~CAP_...") is refused here (this unit lists what it keeps). A unit without
    the setting keeps every capability: DevclusterError, since the devcluster would then test
    nothing."""
    caps: list[str] = []
    seen = False
    section = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, _, value = line.partition("=")
        if section != "Service" or key.strip() != "CapabilityBoundingSet":
            continue
        seen = True
        value = value.strip()
        if not value:
            caps = []
            continue
        if value.startswith("~"):
            raise DevclusterError("tpassd's unit inverts CapabilityBoundingSet= (~); list the capabilities it keeps")
        for name in value.split():
            if not name.upper().startswith("CAP_"):
                raise DevclusterError(f"tpassd's unit: {name!r} in CapabilityBoundingSet= is not a capability")
            short = name.lower().removeprefix("cap_")
            if short not in caps:
                caps.append(short)
    if not seen:
        raise DevclusterError("tpassd's unit sets no CapabilityBoundingSet=: it would keep every capability")
    return caps


def bounded_argv(argv: list[str], unit: Path | None = None) -> list[str]:
    """``argv`` under setpriv with the unit's bounding set (setpriv execs it: same pid)."""
    caps = unit_bounding_set((unit or unit_file()).read_text())
    return [SETPRIV, "--bounding-set=" + ",".join(["-all", *(f"+{c}" for c in caps)]), "--", *argv]


def ports_toml(ports: tuple[int, int, int]) -> list[str]:
    """tpassd's port keys (pub, control, metrics): in each node's config and in the
    cluster-wide file its callers read (torchpass.tpassd_ports)."""
    pub, control, metrics = ports
    return [f"pub_port = {int(pub)}", f"control_port = {int(control)}", f"metrics_port = {int(metrics)}"]


def start_args(node_name: str, address: str, node_dir: Path, munge_socket: Path,
               interval_s: float = 1.0,
               ports: tuple[int, int, int] = (TPASSD_PUB_PORT, TPASSD_CONTROL_PORT, TPASSD_METRICS_PORT),
               snapshot_dir: Path | None = None, restore_tokens: Path | None = None,
               rails: tuple[str, ...] = (), rail_flap_window_s: float = 300.0,
               fake_gpu_uuids: tuple[str, ...] | None = None,
               gpu_inventory: Path | None = None, fleet_spool: Path | None = None) -> list[str]:
    """Write the node's config and policy under ``node_dir``; return tpassd's argv. ``snapshot_dir``:
    the one every node shares (the devcluster's); default: the node's own, under ``node_dir``.
    ``fake_gpu_uuids``: the node's fake GPUs (a GRES devcluster: its count and UUIDs); None: 8.
    ``gpu_inventory``: the node's GPU inventory file (the dump reads the GPUs there, not NVML).
    ``rail_flap_window_s``: how long a rail that flapped stays degraded (the policy's [rail] window_s)."""
    node_dir = Path(node_dir)
    node_dir.mkdir(parents=True, exist_ok=True)
    (node_dir / "state").mkdir(exist_ok=True)
    snapshot_dir = Path(snapshot_dir) if snapshot_dir is not None else node_dir / "snapshots"
    snapshot_dir.mkdir(mode=0o755, exist_ok=True)
    policy = node_dir / "policy.toml"
    # The devcluster shares one disk among many nodes: a small free-space floor.
    policy.write_text(f"[host]\ndisk_free_gb_degraded = 1.0\n\n[rail]\nwindow_s = {float(rail_flap_window_s)}\n")
    cfg = node_dir / "tpassd.toml"
    cfg.write_text("\n".join([
        f"node_name = {_toml_str(node_name)}",
        f"bind_address = {_toml_str(address)}",
        *ports_toml(ports),
        f"interval_s = {float(interval_s)}",
        'nvml_provider = "fake"',
        *([f"fake_gpus = {len(fake_gpu_uuids)}",
           f"fake_gpu_uuids = [{', '.join(_toml_str(u) for u in fake_gpu_uuids)}]"] if fake_gpu_uuids is not None
          else ["fake_gpus = 8"]),
        "fake_nvlinks = 4",
        *([f"gpu_inventory = {_toml_str(gpu_inventory)}"] if gpu_inventory is not None else []),
        f"sysfs_root = {_toml_str(node_dir / 'sys')}",
        "ib_expected_ports = 4",
        *([f"rails = [{', '.join(_toml_str(r) for r in rails)}]"] if rails else []),
        f"state_dir = {_toml_str(node_dir / 'state')}",
        f"snapshot_dir = {_toml_str(snapshot_dir)}",
        *([f"fleet_spool = {_toml_str(fleet_spool)}"] if fleet_spool is not None else []),
        *([f"restore_token_dir = {_toml_str(restore_tokens)}"] if restore_tokens is not None else []),
        f"policy = {_toml_str(policy)}",
        f"munge_socket = {_toml_str(munge_socket)}",
        "drills = true",
        f"ports_file = {_toml_str(node_dir / 'ports.json')}",
        'log_level = "info"',
        "",
    ]))
    return bounded_argv([tpassd_program(), "--config", str(cfg), "--fixture-sysfs"])
