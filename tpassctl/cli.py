"""The `tpassctl` click group. Each command lives in its own module.

Shared state goes on ``ctx.obj`` (a tpassctl.context.CliContext). Every command
takes ``--json`` for scripts. Every failure ends with one line saying what is
wrong and what to do (under ``--json``: ``{"error": {"code", "message"}}`` on
stdout) and the exit status of tpassctl.exit_codes, the one table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from torchpass import __version__, logs
from torchpass.errors import TorchpassError
from tpassctl.context import STATE_DIR_HELP, CliContext
from tpassctl.devcluster_cmd import devcluster
from tpassctl.events_cmd import events
from tpassctl.exit_codes import as_cli_error
from tpassctl.fleet_cmd import fleet
from tpassctl.goodput_cmd import goodput
from tpassctl.migrate_cmd import migrate
from tpassctl.nodes_cmd import inject, nodes
from tpassctl.snapshot_cmd import resume, snapshot, snapshots
from tpassctl.status_cmd import status

EXIT_STATUS_EPILOG = """\b
Exit status (every command but goodput and devcluster):
  0  done
  1  failed, rolled back or refused; with nodes --check: unhealthy
  2  usage: a bad command line, or no state directory where it says
  3  a peer (coordinator, tpassd, slurmctld) did not answer, --wait timed out;
     with nodes --check: a node's health is unknown
  4  not found: no such job (another user's job too), node or snapshot
Under --json a failure prints {"error": {"code": CODE, "message": ...}} on
stdout; CODE is one of failed, refused, unhealthy, usage, no_state_dir,
unreachable, timeout, unknown, not_found.
"""


def wants_json(args: list[str]) -> bool:
    """Whether the command line asks for JSON: then a failure is JSON too, even one click finds
    while parsing (a usage error), before any command has seen its own --json."""
    return "--json" in (args[:args.index("--")] if "--" in args else args)


class TorchpassGroup(click.Group):
    """Every failure below, as one line (or one JSON object) and the exit status of the table."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except TorchpassError as exc:
            raise as_cli_error(exc) from None

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        args = list(sys.argv[1:] if args is None else args)
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as exc:
            err = as_cli_error(exc)
            if wants_json(args):
                click.echo(json.dumps({"error": {"code": err.code, "message": err.format_message()}}))
            elif isinstance(exc, click.UsageError):
                exc.show()
            else:
                err.show()
            sys.exit(err.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=TorchpassGroup, context_settings={"help_option_names": ["-h", "--help"]},
             epilog=EXIT_STATUS_EPILOG)
@click.version_option(__version__, prog_name="tpassctl")
@click.option("--state-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help=STATE_DIR_HELP + " Also accepted after the subcommand.")
@click.option("-v", "--verbose", is_flag=True, help="Log debug details to stderr.")
@click.pass_context
def cli(ctx: click.Context, state_dir: Path | None, verbose: bool) -> None:
    """torchpass: keep distributed PyTorch training running through hardware faults."""
    logs.configure("debug" if verbose else "warning", json=False, stream=sys.stderr)
    ctx.obj = CliContext(verbose=verbose, state_dir_flag=state_dir)


for command in (devcluster, events, fleet, goodput, inject, migrate, nodes, resume, snapshot, snapshots, status):
    cli.add_command(command)


def main() -> None:
    cli(prog_name="tpassctl")


if __name__ == "__main__":
    main()
