"""Every tpassctl command that talks to a peer, against each failure class, in text and under --json.

The exit status and the --json error code must be the documented ones (tpassctl/exit_codes.py):
scripts branch on them. Peers are real sockets where the class allows it: an unreachable
coordinator or tpassd is a registration or endpoint naming a closed loopback port. A refusal is
the peer's error reply (zmqio.request raising RemoteError, as it does for a real one); munge is
replaced by no credential, since this tier runs no munged.
"""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from torchpass import auth, zmqio
from torchpass.coordinator.server import write_registration
from torchpass.errors import RemoteError
from tpassctl.cli import EXIT_STATUS_EPILOG, cli
from tpassctl.exit_codes import CODES, Exit

DEAD = "tcp://127.0.0.1:9"  # the discard port: nothing listens on loopback here
JOB = 6

# command -> argv after "tpassctl" (JOB is a job of the caller's in the state directory)
COMMANDS = {
    "status": ["status", str(JOB), "--timeout", "0.2"],
    "events": ["events", str(JOB), "--timeout", "0.2"],
    "migrate": ["migrate", str(JOB), "--node", "node1", "--timeout", "0.2"],
    "snapshot": ["snapshot", str(JOB), "--timeout", "0.2"],
    "snapshots": ["snapshots", str(JOB), "--delete", "s1", "--endpoint", f"node1={DEAD}", "--timeout", "0.2"],
    "resume": ["resume", str(JOB)],
    "nodes": ["nodes", "--endpoint", f"node1={DEAD}", "--timeout", "0.2"],
    "inject": ["inject", "--node", "node1", "--fault", "clear", "--endpoint", f"node1={DEAD}", "--timeout", "0.2"],
}
# The documented outcome of each (command, failure class): (exit status, --json error code).
# None: the class cannot happen to the command (nodes and inject read no state directory;
# a snapshot to delete is found from the state directory before any peer is asked).
EXPECTED: dict[str, dict[str, tuple[int, str] | None]] = {
    "no_state_dir": {c: (2, "no_state_dir") for c in COMMANDS} | {"nodes": None, "inject": None},
    "unreachable": {"status": (3, "unreachable"), "events": (3, "unreachable"), "migrate": (3, "unreachable"),
                    "snapshot": (3, "unreachable"), "snapshots": None, "resume": (3, "unreachable"),
                    "nodes": (3, "unreachable"), "inject": (3, "unreachable")},
    "refused": {"status": (1, "refused"), "events": (1, "refused"), "migrate": (1, "refused"),
                "snapshot": (1, "refused"), "snapshots": None, "resume": None,
                "nodes": (1, "refused"), "inject": (1, "refused")},
    "not_found": {c: (4, "not_found") for c in COMMANDS},
    "usage": {c: (2, "usage") for c in COMMANDS},
}


class _Slurm:
    """slurmctld as the failure class has it: unreachable, or knowing no job."""

    def __init__(self, reachable: bool):
        self.reachable = reachable

    def job(self, job_id):
        if not self.reachable:
            from torchpass.errors import SlurmError
            raise SlurmError("slurmctld did not answer (SLURM_CONF points at no cluster)")
        return None

    def jobs(self, **_kw):
        return [] if self.reachable else self.job(0)


def _setup(failure: str, command: str, state, monkeypatch) -> list[str]:
    """The state directory and peers of the failure class; the argv to run."""
    monkeypatch.setenv("SLURM_CONF", str(state / "missing-slurm.conf"))
    monkeypatch.delenv("TORCHPASS_STATE_DIR", raising=False)
    monkeypatch.setenv("TORCHPASS_TPASSD_CONFIG", str(state / "no-tpassd.toml"))
    monkeypatch.setattr(auth, "credential_for", lambda *a, **k: None)
    monkeypatch.setattr(auth, "optional_credential_for", lambda *a, **k: None)
    import torchpass.slurm as slurm_pkg
    from tpassctl import follow, status_cmd
    slurm = _Slurm(reachable=failure != "unreachable")
    for mod in (status_cmd, follow, slurm_pkg):
        monkeypatch.setattr(mod, "client", lambda: slurm)
    argv = list(COMMANDS[command])
    state_dir = state / "state"
    if failure == "no_state_dir":
        return ["--state-dir", str(state / "nowhere"), *argv]
    if failure == "usage":
        return ["--state-dir", str(state_dir), *argv, "--no-such-flag"]
    (state_dir / "jobs").mkdir(parents=True)
    os.chmod(state_dir / "jobs", 0o755)
    if failure == "not_found":
        if command == "inject":  # a node no endpoint names
            argv[argv.index("--node") + 1] = "node7"
        elif command == "nodes":
            argv += ["--node", "node7"]
        return ["--state-dir", str(state_dir), *argv]
    write_registration(state_dir, JOB, {"job_id": JOB, "endpoint": DEAD, "pid": 1, "host": "h", "uid": os.getuid()})
    if command == "resume":  # a job stopped by torchpass, which slurmctld must release
        from torchpass import layout
        from torchpass.coordinator.stopped import stopped_text
        layout.stopped_file(state_dir, JOB).write_text(stopped_text(
            {"snapshot": "s1", "snapshot_step": 3, "step": 0, "generation": 1, "world_size": 2, "step_offset": 0}))
    if failure == "refused":
        def refuse(*_a, **_k):
            raise RemoteError("forbidden", "uid 1002 may not do this")
        monkeypatch.setattr(zmqio, "request", refuse)
    return ["--state-dir", str(state_dir), *argv]


CASES = [(f, c) for f, per in EXPECTED.items() for c, want in per.items() if want is not None]


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("failure,command", CASES, ids=[f"{c}-{f}" for f, c in CASES])
def test_every_command_fails_with_the_documented_status_and_code(tmp_path, monkeypatch, failure, command, as_json):
    argv = _setup(failure, command, tmp_path, monkeypatch)
    status, code = EXPECTED[failure][command]
    res = CliRunner().invoke(cli, argv + (["--json"] if as_json else []))
    assert res.exit_code == status, (argv, res.output)
    assert int(CODES[code]) == status
    if as_json:
        out = json.loads(res.stdout)  # one JSON document: a script parses it whatever happened
        assert out["error"]["code"] == code and out["error"]["message"], out
        assert "Error:" not in res.stdout
    else:
        assert "Error: " in res.output and "Traceback" not in res.output, res.output
        assert not res.stdout.lstrip().startswith("{"), res.stdout


def test_the_help_epilog_is_the_table():
    """--help documents every status and every code the table has."""
    for status in Exit:
        if status:
            assert f"  {int(status)}  " in EXIT_STATUS_EPILOG
    for code in CODES:
        assert code in EXIT_STATUS_EPILOG
    out = CliRunner().invoke(cli, ["--help"]).output
    assert "Exit status" in out and "4  not found" in out
