"""When the coordinator's supervisor starts it again: a pure decision (``decide_restart``).

::

    child exits ─┬─ the supervisor was told to stop (SIGTERM: the batch step ends) ──► DONE
                 ├─ exit status 0 (the job ended; the coordinator stops itself) ─────► DONE
                 ├─ the first start never reported its address ─────────────────────► DONE (the plugin
                 │                                                                    reports the failure)
                 ├─ a restart died before it reported ready (a crash loop) ──────────► GIVE_UP
                 ├─ policy.coordinator_restarts restarts used ────────────────────────► GIVE_UP
                 └─ otherwise (killed, crashed) ─────────────────────────────────────► RESTART after
                                                                                      RESTART_DELAY_S x 2^n

The delay stays well under the ranks' own patience: a rank notes ``coordinator.lost`` after 30 s
without an answer, and the restarted coordinator listens again about 1-2 s after the death on the
2-core development VM (Python and zmq imports).
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass

RESTART_DELAY_S = 0.2
RESTART_DELAY_MAX_S = 5.0


class SupervisorAction(enum.StrEnum):
    RESTART = "restart"
    GIVE_UP = "give_up"
    DONE = "done"


@dataclass(frozen=True)
class ChildExit:
    """How one coordinator process ended (``os.waitstatus``): ``code`` or ``signal`` is set."""

    code: int | None
    signal: int | None
    ready: bool  # it had reported its address (listening)

    def text(self) -> str:
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            return f"killed by {name}"
        return f"exit status {self.code}"


@dataclass(frozen=True)
class RestartDecision:
    action: SupervisorAction
    reason: str
    delay_s: float = 0.0


def decide_restart(ended: ChildExit, restarts: int, limit: int, stopping: bool) -> RestartDecision:
    """What to do after the coordinator process ended; ``restarts`` made so far, ``limit`` allowed
    (policy ``coordinator_restarts``); ``stopping``: the supervisor itself was told to stop."""
    how = ended.text()
    if stopping:
        return RestartDecision(SupervisorAction.DONE, f"the coordinator stopped ({how}) as asked")
    if ended.signal is None and ended.code == 0:
        return RestartDecision(SupervisorAction.DONE, "the coordinator ended (exit status 0)")
    if not ended.ready and restarts == 0:
        return RestartDecision(SupervisorAction.DONE, f"the coordinator did not start ({how})")
    if not ended.ready:
        return RestartDecision(SupervisorAction.GIVE_UP, f"restart {restarts} of the coordinator {how} before it "
                               "listened: not restarting a crash loop; the job is unprotected")
    if restarts >= limit:
        return RestartDecision(SupervisorAction.GIVE_UP, f"the coordinator {how}; its {limit} restarts "
                               "(policy coordinator_restarts) are used up: the job is unprotected")
    delay = min(RESTART_DELAY_MAX_S, RESTART_DELAY_S * 2 ** restarts)
    return RestartDecision(SupervisorAction.RESTART, f"the coordinator {how}: restart {restarts + 1} of {limit}",
                           delay)


__all__ = ["RESTART_DELAY_MAX_S", "RESTART_DELAY_S", "ChildExit", "RestartDecision", "SupervisorAction",
           "decide_restart"]
