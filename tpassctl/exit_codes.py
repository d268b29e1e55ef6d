"""tpassctl's exit statuses and error codes: one table for every command that talks to a peer.

Scripts (NHC, cron, a site's drain tooling) branch on the exit status, and under
``--json`` on the error's symbolic code; both come from here:

====  ============  ==========================================================
exit  codes         meaning
====  ============  ==========================================================
0     -             done; the answer is on stdout
1     failed,       the command ran and the outcome is a failure: a migration
      refused,      or snapshot failed or was rolled back, a peer refused the
      unhealthy     request, or (``nodes --check``) a node is unhealthy
2     usage,        the command line is wrong, or no state directory is where
      no_state_dir  it says (pass ``--state-dir``)
3     unreachable,  a peer (coordinator, tpassd, slurmctld) did not answer, a
      timeout,      ``--wait`` ran out of time, or (``nodes --check``) a node's
      unknown       health is not known
4     not_found     no such job (another user's job reads as not found, as
                    Slurm's PrivateData=jobs does), node or snapshot
====  ============  ==========================================================

goodput and devcluster talk to no peer and keep click's 0/1/2.
"""

from __future__ import annotations

import json
from enum import IntEnum
from typing import Any

import click

from torchpass.errors import AuthError, ConfigError, DependencyError, RemoteError, TorchpassError, UnreachableError


class Exit(IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    NO_ANSWER = 3
    NOT_FOUND = 4


# symbolic code (the "code" of a --json error) -> exit status
CODES: dict[str, Exit] = {
    "failed": Exit.FAILED,
    "refused": Exit.FAILED,
    "unhealthy": Exit.FAILED,
    "usage": Exit.USAGE,
    "no_state_dir": Exit.USAGE,
    "unreachable": Exit.NO_ANSWER,
    "timeout": Exit.NO_ANSWER,
    "unknown": Exit.NO_ANSWER,
    "not_found": Exit.NOT_FOUND,
}

# A coordinator's or tpassd's error reply (RemoteError.code) that means "no such thing".
REMOTE_NOT_FOUND = frozenset({"not_found", "unknown_job", "unknown_snapshot", "unknown_node"})


class CliError(click.ClickException):
    """A one-line failure with its symbolic code; its exit status comes from CODES."""

    def __init__(self, message: str, code: str = "failed"):
        if code not in CODES:
            raise ValueError(f"unknown tpassctl error code {code!r}")
        super().__init__(message)
        self.code = code
        self.exit_code = int(CODES[code])


def finish(as_json: bool, payload: dict[str, Any], failure: CliError | None) -> None:
    """End a command whose answer may come with a failure: under --json one object, the answer
    and ``error`` beside it; in text the answer was printed, the failure's line goes to stderr."""
    if as_json:
        out = dict(payload)
        if failure is not None:
            out["error"] = {"code": failure.code, "message": failure.format_message()}
        click.echo(json.dumps(out, indent=1))
    elif failure is not None:
        click.echo(f"Error: {failure.format_message()}", err=True)
    if failure is not None:
        raise click.exceptions.Exit(failure.exit_code)


def code_of_torchpass_error(exc: TorchpassError) -> str:
    """The symbolic code of an error from the torchpass library."""
    if isinstance(exc, UnreachableError):
        return "unreachable"
    if isinstance(exc, RemoteError):
        return "not_found" if exc.code in REMOTE_NOT_FOUND else "refused"
    if isinstance(exc, AuthError):
        return "refused"
    if isinstance(exc, ConfigError):
        return "usage"
    if isinstance(exc, DependencyError):
        return "failed"
    return "failed"


def as_cli_error(exc: BaseException) -> CliError:
    """Any failure a command can end with, as a CliError (code and exit status from the table)."""
    if isinstance(exc, CliError):
        return exc
    if isinstance(exc, click.UsageError):  # BadParameter, NoSuchOption, a missing argument
        return CliError(exc.format_message(), "usage")
    if isinstance(exc, click.ClickException):
        return CliError(exc.format_message(), "usage" if exc.exit_code == 2 else "failed")
    if isinstance(exc, TorchpassError):
        return CliError(str(exc), code_of_torchpass_error(exc))
    raise TypeError(f"not a tpassctl failure: {exc!r}")


__all__ = ["CODES", "CliError", "Exit", "as_cli_error", "code_of_torchpass_error", "finish"]
