"""contrib/systemd/tpassd.service agrees with docs/admin.md and tpassd's config defaults,
passes `systemd-analyze verify`, and criu dumps (not restores) run in their own slice."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from torchpass.checkpoint import criu as criu_mod
from torchpass.errors import CheckpointError
from tpassd.config import TpassdConfig

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "contrib" / "systemd" / "tpassd.service"
ADMIN = ROOT / "docs" / "admin.md"
EXAMPLE = ROOT / "contrib" / "tpassd.toml.example"
OFF = {"no", "false", "0", "off"}


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """{section: {key: [values in order]}} of a systemd unit file."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = out.setdefault(line[1:-1], {})
            continue
        key, _, value = line.partition("=")
        assert section is not None, f"{line!r} before any section"
        section.setdefault(key.strip(), []).append(value.strip())
    return out


def admin_section(title: str) -> str:
    text = ADMIN.read_text()
    start = text.index(title)
    nxt = re.search(r"^##+ ", text[start + len(title):], re.M)
    return text[start:start + len(title) + nxt.start()] if nxt else text[start:]


def table_rows(section: str) -> list[list[str]]:
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in section.splitlines()
            if ln.startswith("|")]
    return [r for r in rows[2:]]  # without the header and the |---| line


def settings_in(cell: str) -> list[str]:
    return re.findall(r"`([A-Za-z]+)=`", cell)


@pytest.fixture(scope="module")
def unit() -> dict[str, dict[str, list[str]]]:
    return parse_unit(UNIT.read_text())


@pytest.fixture(scope="module")
def service(unit) -> dict[str, list[str]]:
    return unit["Service"]


def test_exec_paths_are_where_admin_md_installs(service):
    install = admin_section("## 3. tpassd")
    venv = re.search(r"python3 -m venv (\S+)", ADMIN.read_text()).group(1)
    config_dest = re.search(r"install -m 0644 contrib/tpassd\.toml\.example (\S+)", install).group(1)
    unit_dest = re.search(r"install -m 0644 contrib/systemd/tpassd\.service (\S+)", install).group(1)
    assert unit_dest == "/etc/systemd/system/"
    tpassd = f"{venv}/bin/tpassd"
    assert shlex.split(service["ExecStart"][0]) == [tpassd, "--config", config_dest]
    # No ExecStartPre= check: systemd would restart a failing one despite RestartPreventExitStatus=,
    # which it matches against the main process only; tpassd exits 2 on a bad config itself.
    assert "ExecStartPre" not in service
    assert f"{tpassd} --check-config --config {config_dest}" in install  # the check admins run by hand
    for src in re.findall(r"install -m 0644 (contrib/\S+)", install):
        assert (ROOT / src).is_file(), f"admin.md installs {src}, which does not exist"


def test_environment_file_is_the_documented_one(service):
    (env,) = service["EnvironmentFile"]
    assert env.lstrip("-") == "/etc/default/tpassd"
    assert env.startswith("-"), "the overrides file is optional"
    assert "EnvironmentFile=/etc/default/tpassd" in admin_section("## 3. tpassd")


def test_state_and_snapshot_defaults_are_writable_and_created(service):
    cfg = TpassdConfig()
    example = tomllib.loads(EXAMPLE.read_text())
    assert Path(example["state_dir"]) == cfg.state_dir
    assert Path(example["snapshot_dir"]) == cfg.snapshot_dir
    (state,) = service["StateDirectory"]
    assert Path("/var/lib") / state == cfg.state_dir
    assert cfg.snapshot_dir.is_relative_to(cfg.state_dir)
    protect = service.get("ProtectSystem", ["no"])[-1]
    if protect not in OFF:  # a read-only file system: each default directory must be listed
        rw = [Path(p.lstrip("-")) for v in service.get("ReadWritePaths", []) for p in v.split()]
        for d in (cfg.state_dir, cfg.snapshot_dir):
            assert any(d.is_relative_to(p) for p in rw), f"{d} is read-only under ProtectSystem={protect}"


def test_no_sandboxing_that_would_reach_a_dump_or_restore(service):
    section = admin_section("### What the unit must not sandbox")
    rows = table_rows(section[:section.index("| Setting (on)")])
    off = [s for r in rows for s in settings_in(r[0])]
    # The settings the issue names must be among those admin.md keeps off.
    assert {"PrivateTmp", "ProtectHome", "ProtectControlGroups", "ProtectSystem", "ReadWritePaths",
            "ProtectHostname", "PrivateNetwork"} <= set(off)
    for name in off:
        values = service.get(name, [])
        assert all(v in OFF for v in values), f"{name}={values[-1]} gives tpassd a namespace of its own"


def test_hardening_admin_md_promises_is_set(service):
    section = admin_section("### What the unit must not sandbox")
    on = table_rows(section[section.index("| Setting (on)"):])
    assert len(on) >= 5
    for name_cell, value_cell in on:
        (name,) = settings_in(name_cell)
        assert service.get(name, [None])[-1] == value_cell.strip("`"), name
    assert "CPUQuota" not in service, "a CPU quota would throttle the snapshot hash that runs in tpassd"


def test_criu_slice_is_the_documented_one():
    text = admin_section("### criu outside tpassd's caps")
    assert f"--slice={criu_mod.CRIU_SLICE}" in text
    assert (ROOT / "contrib" / "systemd" / criu_mod.CRIU_SLICE).is_file()


def test_systemd_analyze_verify(tmp_path, unit):
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze not found: apt-get install systemd (the unit is checked with it)"
    # The unit names /opt/torchpass/bin/tpassd, which is not installed here: verify a copy
    # whose executable is a stand-in (verify checks that the command exists).
    fake = tmp_path / "opt" / "torchpass" / "bin" / "tpassd"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    tpassd = shlex.split(unit["Service"]["ExecStart"][0])[0]
    copy = tmp_path / "tpassd.service"
    copy.write_text(UNIT.read_text().replace(tpassd, str(fake)))
    slice_copy = tmp_path / criu_mod.CRIU_SLICE
    shutil.copy(ROOT / "contrib" / "systemd" / criu_mod.CRIU_SLICE, slice_copy)
    for path in (copy, slice_copy):
        out = subprocess.run([analyze, "verify", "--man=no", str(path)], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0 and not out.stderr.strip() and not out.stdout.strip(), \
            f"systemd-analyze verify {path.name}: rc {out.returncode}: {out.stdout}{out.stderr}"


def test_verify_catches_a_bad_setting(tmp_path):
    """The check above can fail: an unknown key is reported."""
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze not found: apt-get install systemd"
    bad = tmp_path / "bad.service"
    bad.write_text(f"[Service]\nExecStart={sys.executable} -c pass\nProtectHome=maybe\n")
    out = subprocess.run([analyze, "verify", "--man=no", str(bad)], capture_output=True, text=True, timeout=120)
    assert "ProtectHome=maybe" in out.stderr


# -- criu in its own slice ------------------------------------------------------------------------
def test_scoped_only_when_systemd_is_pid1():
    argv = ["/proc/self/fd/5", "dump", "-t", "42"]
    assert criu_mod.scoped(argv, "x.slice", booted=lambda: True) == [
        "systemd-run", "--scope", "--quiet", "--collect", "--slice=x.slice", "--", *argv]
    assert criu_mod.scoped(argv, "x.slice", booted=lambda: False) == argv
    assert criu_mod.scoped(argv, None, booted=lambda: True) == argv
    assert criu_mod.systemd_booted(str(ROOT)) is True
    assert criu_mod.systemd_booted(str(ROOT / "no-such-dir")) is False


@pytest.fixture
def recorded_runs(monkeypatch):
    calls: list[dict] = []

    def fake_run(criu, args, timeout_s, what, then, **kw):
        calls.append({"args": list(args), **kw})
        return subprocess.CompletedProcess(args, 1, "", "")

    monkeypatch.setattr(criu_mod, "run_criu", fake_run)
    return calls


def test_dump_runs_criu_in_the_criu_slice(tmp_path, recorded_runs):
    sleeper = subprocess.Popen(["sleep", "30"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        with pytest.raises(CheckpointError, match="failed"):
            criu_mod.dump(criu_mod.Criu("/bin/true", (4, 1)), sleeper.pid, tmp_path / "img",
                          wait_no_sockets_s=0)
    finally:
        sleeper.kill()
        sleeper.wait()
    (call,) = recorded_runs
    assert call["args"][0] == "dump" and call["slice_"] == criu_mod.CRIU_SLICE


def test_restore_stays_in_the_callers_cgroup(tmp_path, recorded_runs):
    (tmp_path / "img").mkdir()
    with pytest.raises(CheckpointError, match="failed"):
        criu_mod.restore(criu_mod.Criu("/bin/true", (4, 1)), tmp_path / "img", verified={})
    (call,) = recorded_runs
    assert call["args"][0] == "restore" and call.get("slice_") is None


# -- Type=notify, the watchdog, restarts, capabilities --------------------------------------------
def test_readiness_watchdog_reload_and_restart_settings(service):
    assert service["Type"] == ["notify"] and service["NotifyAccess"] == ["main"]
    (watchdog,) = service["WatchdogSec"]
    assert 0 < int(watchdog) <= 120
    assert "2" in service["RestartPreventExitStatus"][-1].split(), "a config error would restart every 2 s"
    assert service["Restart"] == ["on-failure"]
    assert shlex.split(service["ExecReload"][0]) == ["/bin/kill", "-HUP", "$MAINPID"]
    assert service["SyslogLevelPrefix"] == ["yes"]


def test_no_filter_that_criu_would_inherit(service):
    """seccomp and device filters reach criu (a child cannot drop them); DeviceAllow= also hides
    /dev/nvidia*. None is set, and the unit says why in a comment."""
    for name in ("SystemCallFilter", "DeviceAllow", "MemoryDenyWriteExecute", "ProtectClock"):
        assert all(v in OFF for v in service.get(name, [])), f"{name}= is inherited by criu"
    assert all(v in OFF for v in service.get("RestrictNamespaces", []))
    text = UNIT.read_text()
    for name in ("SystemCallFilter=", "RestrictNamespaces=", "DeviceAllow=", "ProtectClock=",
                 "MemoryDenyWriteExecute="):
        assert name in text, f"the unit's comment does not say why {name} is not set"


def _doc_caps() -> list[str]:
    section = admin_section("### tpassd under systemd")
    table = section[section.index("| Capability |"):]
    table = table[:table.index("\n\n")]
    return [c for row in table_rows(table) for c in re.findall(r"`(CAP_[A-Z_]+)`", row[0])]


def test_each_capability_of_the_bounding_set_is_explained_in_admin_md(service):
    from torchpass.devcluster.tpassd_node import unit_bounding_set

    caps = [c for v in service["CapabilityBoundingSet"] for c in v.split()]
    assert caps and not any(c.startswith("~") for c in caps)
    assert sorted(_doc_caps()) == sorted(caps)
    assert service.get("AmbientCapabilities", [""]) == [""]
    # The devcluster starts tpassd with the same list (setpriv's names).
    assert unit_bounding_set(UNIT.read_text()) == [c.lower().removeprefix("cap_") for c in caps]


def _security(tmp_path) -> tuple[float, list[dict]]:
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze not found: apt-get install systemd"
    copy = tmp_path / "tpassd.service"
    shutil.copy(UNIT, copy)
    text = subprocess.run([analyze, "security", "--offline=true", "--no-pager", str(copy)],
                          capture_output=True, text=True, timeout=60)
    score = re.search(r"Overall exposure level for tpassd\.service: (\d+\.\d+)", text.stdout)
    assert score, text.stdout + text.stderr
    items = subprocess.run([analyze, "security", "--offline=true", "--json=short", str(copy)],
                           capture_output=True, text=True, timeout=60, check=True)
    return float(score.group(1)), json.loads(items.stdout)


def test_systemd_analyze_security_scores_at_most_7_5_and_admin_md_explains_every_remaining_item(tmp_path):
    score, items = _security(tmp_path)
    assert score <= 7.5, f"systemd-analyze security rates the unit {score}"
    section = admin_section("### tpassd under systemd")
    assert f"**{score} " in section, f"admin.md states another score than the tool's {score}"
    table = section[section.index("| Item(s) `systemd-analyze security` marks |"):]
    table = table[:table.index("\n\n")].replace("\\|", "\u2502")  # a \| inside a cell is not a column
    explained = {name.replace("\u2502", "|") for row in table_rows(table)
                 for name in re.findall(r"`([^`]+)`", row[0])}
    remaining = {i["name"] for i in items if i["set"] is False and i["exposure"] not in (None, "0.0")}
    assert remaining, "the tool's JSON output changed shape"
    assert sorted(remaining - explained) == [], "admin.md does not explain these items"


def test_the_score_check_can_fail(tmp_path, monkeypatch):
    """Without the bounding set the unit scores above 7.5 (8.4 with systemd 257)."""
    bare = tmp_path / "bare" / "tpassd.service"
    bare.parent.mkdir()
    bare.write_text("\n".join(ln for ln in UNIT.read_text().splitlines()
                              if not ln.startswith("CapabilityBoundingSet=")))
    monkeypatch.setattr(sys.modules[__name__], "UNIT", bare)
    score, _ = _security(tmp_path)
    assert score > 7.5


def test_the_devcluster_reads_the_bounding_set_as_systemd_does():
    from torchpass.devcluster.tpassd_node import bounded_argv, unit_bounding_set
    from torchpass.errors import DevclusterError

    two = "[Service]\nCapabilityBoundingSet=CAP_KILL\nCapabilityBoundingSet=CAP_SYS_ADMIN CAP_KILL\n"
    assert unit_bounding_set(two) == ["kill", "sys_admin"]  # lines add up
    assert unit_bounding_set(two + "CapabilityBoundingSet=\nCapabilityBoundingSet=CAP_CHOWN\n") == ["chown"]
    assert unit_bounding_set("[Unit]\nCapabilityBoundingSet=CAP_KILL\n[Service]\nCapabilityBoundingSet=\n") == []
    for bad in ("[Service]\nType=notify\n", "[Service]\nCapabilityBoundingSet=~CAP_SYS_TIME\n",
                "[Service]\nCapabilityBoundingSet=SYS_ADMIN\n"):
        with pytest.raises(DevclusterError):
            unit_bounding_set(bad)
    argv = bounded_argv(["/opt/tpassd", "--config", "x"], UNIT)
    assert argv[0] == "/usr/bin/setpriv" and argv[-4:] == ["--", "/opt/tpassd", "--config", "x"]
    assert argv[1].startswith("--bounding-set=-all,+chown,")
