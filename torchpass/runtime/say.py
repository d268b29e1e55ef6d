"""The runtime's one way to tell the user something: a ``torchpass: ...`` line on stderr.

Its own module so that hook.py, control.py and pg.py share it without
importing each other (and without importing torch).
"""

from __future__ import annotations

import sys


def say(msg: str) -> None:
    """Write ``torchpass: <msg>`` to stderr; never raises (a log line must not break training)."""
    try:
        sys.stderr.write(f"torchpass: {msg}\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - never break training over a log line
        pass
