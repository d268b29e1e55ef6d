"""structlog set-up shared by every torchpass program.

JSON lines to stdout when stdout is not a TTY (journald and Slurm job logs
keep them verbatim), a readable console renderer on a TTY. Call configure()
once at program start; tests use structlog.testing.capture_logs instead.

Under systemd (stdout is journald's stream) each line starts with its
sd-daemon(3) priority, ``<3>`` for an error, ``<4>`` a warning, ``<6>``
info: journald reads it as the line's priority and strips it (the unit's
``SyslogLevelPrefix=yes``, systemd's default), so ``journalctl -p warning``
shows tpassd's warnings and errors. Elsewhere (a file, a pipe, Slurm's job
log) lines carry no prefix.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any, TextIO

import structlog

JOURNAL_STREAM = "JOURNAL_STREAM"

# syslog's priorities (sd-daemon(3)), by structlog's level names. ``exception`` is ``error``
# with a traceback; a name not listed is logged as ``notice``.
PRIORITY = {"critical": 2, "error": 3, "exception": 3, "warning": 4, "warn": 4, "notice": 5, "info": 6,
            "debug": 7}
NOTICE = 5


def journal_stream(stream: TextIO, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``stream`` is the one systemd connected to journald: ``$JOURNAL_STREAM`` is that
    stream's ``DEVICE:INODE`` (systemd.exec(5)). Compared with the stream itself, not merely
    present: a process started by a service (slurmd's children, a coordinator whose output goes
    to a file) inherits the variable with another stdout."""
    value = (os.environ if environ is None else environ).get(JOURNAL_STREAM, "")
    dev, _, ino = value.partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat(stream.fileno())
    except (AttributeError, OSError, ValueError):  # no file descriptor (a StringIO), or closed
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


def priority_prefix(level: str) -> str:
    """The sd-daemon prefix of a line at ``level``: ``<3>`` for "error"."""
    return f"<{PRIORITY.get(level.lower(), NOTICE)}>"


def _prefixed(renderer: Any) -> Any:
    def render(logger: Any, method_name: str, event_dict: dict[str, Any]) -> str:
        level = str(event_dict.get("level", method_name))
        return priority_prefix(level) + renderer(logger, method_name, event_dict)

    return render


def configure(level: str = "info", *, json: bool | None = None, stream=None,
              journal_prefix: bool | None = None) -> None:
    """``journal_prefix``: start each line with its sd-daemon priority; None: when ``stream`` is
    journald's (``journal_stream``)."""
    stream = stream if stream is not None else sys.stdout
    if json is None:
        json = not stream.isatty()
    if journal_prefix is None:
        journal_prefix = journal_stream(stream)
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        numeric = logging.INFO
    renderer = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    )
    if journal_prefix:
        renderer = _prefixed(renderer)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )


def say(text: str, level: str = "error", stream: TextIO | None = None) -> None:
    """One plain line (a program's own message before or besides its structured log, e.g.
    ``tpassd: <config error>``), with its priority when ``stream`` is journald's."""
    stream = stream if stream is not None else sys.stderr
    print((priority_prefix(level) if journal_stream(stream) else "") + text, file=stream, flush=True)


def get_logger(name: str):
    return structlog.get_logger(name)
