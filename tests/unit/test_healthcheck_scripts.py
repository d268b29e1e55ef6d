"""contrib/slurm/torchpass-healthcheck (slurm.conf HealthCheckProgram) and contrib/nhc/torchpass.nhc
(NHC's check_torchpass_health), run as they are installed: bash, with ``tpassctl`` and ``scontrol``
stand-ins on PATH that print what a tpassd and slurmctld would and record every argv they get.

Each case checks the exact ``scontrol update`` issued, or that none was: failed drains (never
DOWN, also while a job runs), degraded and unknown only report, a reason of another tool stays.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEALTHCHECK = REPO / "contrib" / "slurm" / "torchpass-healthcheck"
NHC_FILE = REPO / "contrib" / "nhc" / "torchpass.nhc"
NODE = "n3"

# tpassctl nodes --check=failed exits 1 for a failed node, 3 for one whose health is not known,
# else 0 (tpassctl/nodes_cmd.py verdict, tpassctl/exit_codes.py).
TPASSCTL_STUB = """#!/bin/bash
printf '%s\\n' "$*" >> "$STUB_LOG/tpassctl.argv"
cat "$STUB_LOG/tpassctl.json"
exit "$(cat "$STUB_LOG/tpassctl.rc")"
"""
SCONTROL_STUB = """#!/bin/bash
printf '%s\\0' "$@" >> "$STUB_LOG/scontrol.argv"; printf '\\n' >> "$STUB_LOG/scontrol.argv"
if [ "$1" = show ]; then cat "$STUB_LOG/node.json"; fi
exit 0
"""


def tpassd_answer(state: str, reasons: list[str], rc: int, *, reachable: bool = True) -> tuple[dict, int]:
    row = {"node": NODE, "endpoint": "tcp://10.0.0.3:718", "state": state, "reachable": reachable,
           "reasons": reasons, "components": {}}
    doc = {"t": 1.0, "nodes": [row]}
    if rc:
        doc["error"] = {"code": "unhealthy" if rc == 1 else "unknown", "message": f"{NODE}: {state}"}
    return doc, rc


def slurm_node(state: list[str], reason: str = "") -> dict:
    return {"nodes": [{"name": NODE, "state": state, "reason": reason}]}


@pytest.fixture
def stubs(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("tpassctl", TPASSCTL_STUB), ("scontrol", SCONTROL_STUB)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log_dir = tmp_path / "log"
    log_dir.mkdir()

    def set_up(answer: tuple[dict, int], node: dict | None = None) -> None:
        (log_dir / "tpassctl.json").write_text(json.dumps(answer[0]))
        (log_dir / "tpassctl.rc").write_text(str(answer[1]))
        (log_dir / "node.json").write_text(json.dumps(node or slurm_node(["IDLE"])))

    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "STUB_LOG": str(log_dir), "HOME": str(tmp_path),
           "TORCHPASS_HEALTHCHECK_CONFIG": str(tmp_path / "no-such-config"), "TORCHPASS_HEALTHCHECK": str(HEALTHCHECK)}

    class Stubs:
        def __init__(self):
            self.env, self.set_up, self.log = env, set_up, log_dir

        def scontrol_calls(self) -> list[list[str]]:
            f = log_dir / "scontrol.argv"
            lines = f.read_text().splitlines() if f.exists() else []
            return [line.rstrip("\0").split("\0") for line in lines]

        def updates(self) -> list[list[str]]:
            return [c for c in self.scontrol_calls() if c[:1] == ["update"]]

        def tpassctl_calls(self) -> list[str]:
            f = log_dir / "tpassctl.argv"
            return f.read_text().splitlines() if f.exists() else []

    return Stubs()


def healthcheck(stubs, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(HEALTHCHECK), *args], env={**stubs.env, "SLURMD_NODENAME": NODE, **env},
                          capture_output=True, text=True, timeout=30)


def drain(reason: str) -> list[str]:
    return ["update", f"NodeName={NODE}", "State=DRAIN", f"Reason={reason}"]


def test_a_healthy_node_is_left_alone_and_tpassd_is_asked_through_tpassctl_nodes_check(stubs):
    stubs.set_up(tpassd_answer("healthy", [], 0))
    r = healthcheck(stubs)
    assert r.returncode == 0, r.stdout + r.stderr
    assert stubs.updates() == []
    assert stubs.tpassctl_calls() == [f"nodes --node {NODE} --check=failed --json --timeout 5"]


def test_a_degraded_node_is_reported_not_drained(stubs):
    stubs.set_up(tpassd_answer("degraded", ["gpu0 ECC SBE storm (120/h)"], 0))
    r = healthcheck(stubs)
    assert r.returncode == 0
    assert "degraded (not drained): gpu0 ECC SBE storm (120/h)" in r.stdout
    assert stubs.scontrol_calls() == []


def test_a_failed_node_is_drained_with_tpassds_reasons(stubs):
    stubs.set_up(tpassd_answer("failed", ["gpu0 Xid 79 (fell off the bus)", "ib mlx5_0/1 down"], 1))
    r = healthcheck(stubs)
    assert r.returncode == 1, r.stdout + r.stderr
    assert stubs.updates() == [drain("torchpass: gpu0 Xid 79 (fell off the bus); ib mlx5_0/1 down")]
    assert "failed, drained: gpu0 Xid 79" in r.stdout


def test_a_failed_node_running_a_job_is_drained_never_set_down(stubs):
    stubs.set_up(tpassd_answer("failed", ["gpu1 lost"], 1), slurm_node(["ALLOCATED"]))
    r = healthcheck(stubs)
    assert r.returncode == 1
    assert stubs.updates() == [drain("torchpass: gpu1 lost")]
    assert not any("State=DOWN" in a for c in stubs.scontrol_calls() for a in c)


def test_an_unknown_health_is_reported_not_drained_by_default(stubs):
    stubs.set_up(tpassd_answer("unknown", ["no reply from tcp://10.0.0.3:718 after 5.0 s"], 3, reachable=False))
    r = healthcheck(stubs)
    assert r.returncode == 3
    assert "health not known (not drained): no reply from tcp://10.0.0.3:718" in r.stdout
    assert stubs.scontrol_calls() == []


def test_an_unknown_health_drains_when_configured(stubs, tmp_path):
    stubs.set_up(tpassd_answer("unknown", ["no reply"], 3, reachable=False))
    config = tmp_path / "healthcheck.conf"
    config.write_text("TORCHPASS_HEALTHCHECK_UNKNOWN=drain\n")
    r = healthcheck(stubs, TORCHPASS_HEALTHCHECK_CONFIG=str(config))
    assert r.returncode == 3
    assert stubs.updates() == [drain("torchpass: health not known: no reply")]


def test_another_tools_drain_reason_is_kept_and_our_own_is_refreshed(stubs):
    stubs.set_up(tpassd_answer("failed", ["gpu0 Xid 79"], 1), slurm_node(["IDLE", "DRAIN"], "bad DIMM, ticket 42"))
    r = healthcheck(stubs)
    assert r.returncode == 1
    assert stubs.updates() == []
    assert "kept (bad DIMM, ticket 42)" in r.stdout
    stubs.set_up(tpassd_answer("failed", ["gpu0 Xid 79"], 1), slurm_node(["IDLE", "DRAIN"], "torchpass: gpu0 Xid 48"))
    healthcheck(stubs)
    assert stubs.updates() == [drain("torchpass: gpu0 Xid 79")]


def test_the_reason_is_one_printable_line_cut_to_tpassds_200_characters(stubs):
    stubs.set_up(tpassd_answer("failed", ["a\x1b[31mb\nc", "x" * 300], 1))
    healthcheck(stubs)
    (update,) = stubs.updates()
    reason = update[-1].removeprefix("Reason=")
    assert reason.startswith("torchpass: a [31mb c; xxx") and len(reason) == 200 and reason.isprintable()


def test_the_endpoint_setting_asks_that_tpassd_without_slurm(stubs):
    stubs.set_up(tpassd_answer("healthy", [], 0))
    healthcheck(stubs, TORCHPASS_HEALTHCHECK_ENDPOINT="tcp://127.0.0.1:718")
    assert stubs.tpassctl_calls() == [f"nodes --node {NODE} --check=failed --json --timeout 5 "
                                      f"--endpoint {NODE}=tcp://127.0.0.1:718"]


def test_a_wrong_setting_is_refused(stubs):
    stubs.set_up(tpassd_answer("failed", ["x"], 1))
    r = healthcheck(stubs, TORCHPASS_HEALTHCHECK_UNKNOWN="down")
    assert r.returncode == 2 and "must be report or drain" in r.stdout
    assert stubs.scontrol_calls() == [] and stubs.tpassctl_calls() == []


# --- NHC: the real file sourced in bash, with NHC's die and log reduced to recording lines -----
NHC_HARNESS = """
die() { echo "DIE $*"; return "${1:-1}"; }
log() { echo "LOG $*"; }
source "$NHC_FILE"
check_torchpass_health
echo "RC $?"
"""


def nhc(stubs, **env: str) -> list[str]:
    r = subprocess.run(["bash", "-c", NHC_HARNESS], env={**stubs.env, "NHC_FILE": str(NHC_FILE),
                                                        "HOSTNAME_S": NODE, **env},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


@pytest.mark.parametrize("state, reasons, rc, node, nhc_out, update", [
    ("healthy", [], 0, ["IDLE"], ["RC 0"], None),
    ("degraded", ["gpu0 ECC SBE storm"], 0, ["IDLE"],
     ["LOG check_torchpass_health:  degraded (not drained): gpu0 ECC SBE storm", "RC 0"], None),
    ("failed", ["gpu0 Xid 79"], 1, ["IDLE"],
     ["DIE 1 torchpass: failed, drained: gpu0 Xid 79", "RC 1"], "torchpass: gpu0 Xid 79"),
    ("failed", ["gpu0 Xid 79"], 1, ["MIXED"],
     ["DIE 1 torchpass: failed, drained: gpu0 Xid 79", "RC 1"], "torchpass: gpu0 Xid 79"),
    ("unknown", ["no reply"], 3, ["IDLE"],
     ["LOG check_torchpass_health:  health not known (not drained): no reply", "RC 0"], None),
], ids=["healthy", "degraded", "failed", "job-running", "unknown"])
def test_nhc_check_function(stubs, state, reasons, rc, node, nhc_out, update):
    stubs.set_up(tpassd_answer(state, reasons, rc), slurm_node(node))
    assert nhc(stubs) == nhc_out
    assert stubs.updates() == ([] if update is None else [drain(update)])


def test_nhc_dies_on_unknown_health_when_configured_to_drain(stubs):
    stubs.set_up(tpassd_answer("unknown", ["no reply"], 3))
    assert nhc(stubs, TORCHPASS_HEALTHCHECK_UNKNOWN="drain") == [
        "LOG check_torchpass_health:  unknown, drained: health not known: no reply",
        "DIE 1 torchpass: unknown, drained: health not known: no reply", "RC 1"]
    assert stubs.updates() == [drain("torchpass: health not known: no reply")]


def test_nhc_dies_when_the_check_itself_is_broken(stubs, tmp_path):
    out = nhc(stubs, TORCHPASS_HEALTHCHECK=str(tmp_path / "missing"))
    assert out[0].startswith(f"DIE 1 torchpass: {tmp_path / 'missing'} failed (exit 127)") and out[1] == "RC 1"


def test_the_scripts_are_installed_executable_and_never_resume_or_down_a_node():
    assert os.access(HEALTHCHECK, os.X_OK)
    for f in (HEALTHCHECK, NHC_FILE):
        code = "\n".join(line for line in f.read_text().splitlines() if not line.lstrip().startswith("#"))
        assert "RESUME" not in code and "State=DOWN" not in code and "UNDRAIN" not in code
