"""The executor's dispatch table covers the contract: every action type ``decide`` may ask for
(``contract.Action``) has a handler, and nothing else does. An action without a handler would
be logged as failed and never performed, which no other test notices until that action is needed.
"""

from __future__ import annotations

import dataclasses
import typing

from torchpass.coordinator import contract as ct
from torchpass.coordinator.executor import FAILURE_OF, OWN_OUTCOMES, Executor
from torchpass.coordinator.job_record import JobState
from torchpass.coordinator.policy import CoordinatorPolicy

ACTIONS = set(typing.get_args(ct.Action))
OUTCOMES = set(typing.get_args(ct.Outcome))


def _executor(tmp_path) -> Executor:
    return Executor(JobState(job_id=7), state_dir=tmp_path, post=lambda o: None, policy=CoordinatorPolicy(),
                    prelaunch_restore=False)


def test_every_action_type_has_an_executor_handler(tmp_path):
    ex = _executor(tmp_path)
    try:
        assert len(ACTIONS) >= 20  # contract.Action is a Union of the action classes
        missing = sorted(a.__name__ for a in ACTIONS - set(ex.handlers))
        assert not missing, f"actions with no executor handler: {missing}"
        extra = sorted(a.__name__ for a in set(ex.handlers) - ACTIONS)
        assert not extra, f"handlers for types that are not contract.Action: {extra}"
        assert all(callable(h) for h in ex.handlers.values())
    finally:
        ex.close()


def test_a_failing_action_posts_an_outcome_of_the_contract():
    """FAILURE_OF names actions and outcomes of the contract only."""
    assert set(FAILURE_OF) <= ACTIONS
    for action, failed in FAILURE_OF.items():
        a = action(**{f.name: "x" for f in dataclasses.fields(action)})
        assert type(failed(a, "why")) in OUTCOMES


def test_the_executors_own_outcomes_never_reach_machine_apply(tmp_path):
    ex = _executor(tmp_path)
    try:
        assert not set(OWN_OUTCOMES) & OUTCOMES
        assert set(OWN_OUTCOMES) <= set(ex.observers)
    finally:
        ex.close()
