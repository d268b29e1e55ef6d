"""A restore step started before its snapshot exists: it waits at a gate.

Launching the restore job step (``srun --overlap`` on the spare, then a
Python start and the restore wrapper's imports) takes ~0.2-0.5 s on the
2-core devcluster, and every rank of the job stands still while it happens
if it starts only after the dump. So the executor starts the step as soon as
the pause is armed (the ranks still train on to T, then the source is
dumped) with this module in front of the restore wrapper:

    python -m torchpass.checkpoint.restore_gate GO_FILE TIMEOUT_S -- <rankwrap args>

It imports the restore wrapper, then polls GO_FILE (on the job's state
directory, shared like the hold files: torchpass.layout.restore_go_file). The executor writes it atomically:

* ``restore IMAGES``: run ``rankwrap --restore IMAGES <rankwrap args>`` in
  this process (the step is then exactly the usual restore step);
* ``cancel``: the move was called off (rollback, another target); exit 0.

With neither within TIMEOUT_S it exits 0 (the coordinator is gone). The
restore wrapper verifies the snapshot as always: the gate adds no trust.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

# The gate opens when the dump is done; every rank stands still until the restore begins.
POLL_S = 0.002


def read_gate(path: str | os.PathLike) -> str:
    try:
        return Path(path).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return ""


def write_gate(path: str | os.PathLike, text: str) -> None:
    """Atomically (a reader never sees half a path)."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, p)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[2] != "--":
        sys.stderr.write("usage: python -m torchpass.checkpoint.restore_gate GO_FILE TIMEOUT_S -- ARGS\n")
        return 2
    go, timeout_s, rest = argv[0], float(argv[1]), argv[3:]
    # Imported now, while the ranks are still on their way to T: not after.
    from torchpass.checkpoint import criu, rankwrap  # noqa: F401

    deadline = time.monotonic() + timeout_s
    while True:
        text = read_gate(go)
        if text.startswith("restore "):
            return rankwrap.main(["--restore", text[len("restore "):], *rest])
        if text == "cancel":
            return 0
        if time.monotonic() > deadline:
            sys.stderr.write(f"torchpass: restore gate {go}: no go within {timeout_s:g}s; not restoring\n")
            return 0
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main())
