"""Where a rank's control link (``control.ControlLink``) is, and the one table of its legal moves.

::

    REGISTERING ──register answered──► REPORTING ──on_quiesced──► QUIESCED ──resume settled──► REPORTING
        ▲                                 │  ▲                       │  ▲
        │                       quiesced, │  └─hold file, no pause───┤  │ hold file appeared
        │                          hold   ▼                          ▼  │ (released)
        └──── woken "restored ID" ─────── HOLDING ◄──quiesced, hold──┘──┘
                                          │
      QUIESCED, HOLDING ── no resume by the pause's deadline ──► FELL_BACK (pauses refused for good)
      REPORTING, QUIESCED ── answered "not_found" (a restarted coordinator) ──► REGISTERING
      any state ── stop() ──► STOPPED

REGISTERING: no ``rank.register`` answered yet (at the start; and again for a copy restored from a
whole-job snapshot, which the new run's coordinator does not know). REPORTING: progress reports
and long polls go, commands come back. QUIESCED: stopped at T for an accepted pause; its deadline
runs (``ControlLink.deadline``). HOLDING: no ZeroMQ context, no socket, waiting for the hold file
(CRIU dumps the process now). FELL_BACK: resumed in place without the coordinator: the rank goes
on reporting but refuses every pause. The process group's own state (armed, at T, rebuilding) is
``pg.PGState``; this table is the link's.

An edge missing from the table is a bug: with ``TORCHPASS_STRICT_TRANSITIONS=1`` (the test suite
sets it) the move raises ``IllegalLinkTransition``; in production it is said in one line and taken,
since refusing it could leave a rank paused, which is worse than a wrong label.
"""

from __future__ import annotations

import enum
import os

from torchpass import envnames


class LinkState(enum.Enum):
    REGISTERING = "registering"
    REPORTING = "reporting"
    QUIESCED = "quiesced"
    HOLDING = "holding"
    FELL_BACK = "fell_back"
    STOPPED = "stopped"


S = LinkState
TRANSITIONS: dict[LinkState, frozenset[LinkState]] = {
    S.REGISTERING: frozenset({S.REPORTING, S.QUIESCED, S.STOPPED}),
    S.REPORTING: frozenset({S.QUIESCED, S.HOLDING, S.REGISTERING, S.STOPPED}),
    S.QUIESCED: frozenset({S.REPORTING, S.HOLDING, S.FELL_BACK, S.REGISTERING, S.STOPPED}),
    S.HOLDING: frozenset({S.QUIESCED, S.REPORTING, S.REGISTERING, S.FELL_BACK, S.STOPPED}),
    S.FELL_BACK: frozenset({S.STOPPED}),
    S.STOPPED: frozenset(),
}


class IllegalLinkTransition(RuntimeError):
    """A move of the control link that TRANSITIONS does not allow (strict mode only)."""


def strict() -> bool:
    return os.environ.get(envnames.STRICT_TRANSITIONS) == "1"


def check_transition(old: LinkState, new: LinkState) -> str | None:
    """None when ``old`` -> ``new`` is legal (or no move); else why not (raised in strict mode)."""
    if old is new or new in TRANSITIONS[old]:
        return None
    why = f"control link: illegal transition {old.value} -> {new.value}"
    if strict():
        raise IllegalLinkTransition(why)
    return why


__all__ = ["TRANSITIONS", "IllegalLinkTransition", "LinkState", "check_transition"]
