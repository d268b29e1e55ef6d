"""The `tpassctl` click group. Each command lives in its own module.

Shared state goes on ``ctx.obj`` (a CliContext). Every command takes
``--json`` for scripts; errors are click exceptions with one line saying what
is wrong and what to do, and a non-zero exit code.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import click

from torchpass import __version__, envnames, logs
from torchpass.errors import TorchpassError
from tpassctl.devcluster_cmd import devcluster
from tpassctl.events_cmd import events
from tpassctl.goodput_cmd import goodput
from tpassctl.migrate_cmd import migrate
from tpassctl.nodes_cmd import inject, nodes
from tpassctl.snapshot_cmd import resume, snapshot, snapshots
from tpassctl.status_cmd import status


@dataclass
class CliContext:
    state_dir: Path
    verbose: bool


class TorchpassGroup(click.Group):
    """Turns TorchpassError anywhere below into a clean one-line error."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except TorchpassError as exc:
            raise click.ClickException(str(exc)) from None


@click.group(cls=TorchpassGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tpassctl")
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path, file_okay=False),
    envvar=envnames.STATE_DIR,
    default="/var/lib/torchpass",
    show_default=True,
    help="Shared torchpass state directory (where coordinators register). Env: TORCHPASS_STATE_DIR.",
)
@click.option("-v", "--verbose", is_flag=True, help="Log debug details to stderr.")
@click.pass_context
def cli(ctx: click.Context, state_dir: Path, verbose: bool) -> None:
    """torchpass: keep distributed PyTorch training running through hardware faults."""
    logs.configure("debug" if verbose else "warning", json=False, stream=sys.stderr)
    ctx.obj = CliContext(state_dir=state_dir, verbose=verbose)


for command in (devcluster, events, goodput, inject, migrate, nodes, resume, snapshot, snapshots, status):
    cli.add_command(command)


def main() -> None:
    cli(prog_name="tpassctl")


if __name__ == "__main__":
    main()
