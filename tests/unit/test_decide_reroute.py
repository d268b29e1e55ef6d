"""The rail plan: a used rail unusable on any node of the job leaves at once; a rail comes back
only after restore_after_s of continuous health (time moved by hand)."""

from torchpass.coordinator.decide_reroute import decide_rails, initial_plan

RAILS = ("rail0", "rail1")
NODES = ("node1", "node2")
RESTORE = 30.0


def health(**bad):
    """Every (node, rail) healthy but those given as node_rail=state."""
    out = {(n, r): "healthy" for n in NODES for r in RAILS}
    for key, state in bad.items():
        node, rail = key.split("_")
        out[(node, rail)] = state
    return out


def step(plan, now, h):
    return decide_rails(now, plan, RAILS, NODES, h, RESTORE)


def test_all_healthy_keeps_every_rail():
    d = step(initial_plan(RAILS), 0.0, health())
    assert d.action is None and d.plan.using == RAILS


def test_a_rail_down_on_one_node_is_left_by_every_rank_at_once():
    d = step(initial_plan(RAILS), 0.0, health(node2_rail0="failed"))
    assert d.action is not None
    assert d.action.rails == ("rail1",) and d.action.dropped == ("rail0",)
    assert "rail0 unusable on node2" in d.reason


def test_unknown_is_not_a_fault():
    d = step(initial_plan(RAILS), 0.0, health(node1_rail0="unknown"))
    assert d.action is None


def test_no_usable_rail_keeps_the_plan_for_the_node_failure_to_handle():
    d = step(initial_plan(RAILS), 0.0, health(node1_rail0="failed", node2_rail1="failed"))
    assert d.action is None and d.plan.using == RAILS
    assert "no data rail is usable" in d.reason


def test_a_rail_comes_back_only_after_the_hysteresis():
    d = step(initial_plan(RAILS), 0.0, health(node2_rail0="failed"))
    plan = d.plan
    plan = step(plan, 10.0, health()).plan  # back up at 10 s
    d = step(plan, 10.0 + RESTORE - 1, health())
    assert d.action is None and "back after 30 s" in d.reason
    d = step(d.plan, 10.0 + RESTORE, health())
    assert d.action is not None and d.action.rails == RAILS and d.action.restored == ("rail0",)
    assert d.plan.reroutes == 2


def test_five_flaps_in_a_minute_reroute_once():
    plan, reroutes, now = initial_plan(RAILS), 0, 0.0
    for _ in range(5):  # down 6 s, up 6 s, five times: one sample a second, as tpassd publishes
        for state in ["failed"] * 6 + ["healthy"] * 6:
            d = step(plan, now, health(node1_rail1=state))
            plan, now = d.plan, now + 1.0
            reroutes += d.action is not None
    assert reroutes == 1 and plan.using == ("rail0",)
    # then it stays up: back once, after the hysteresis
    while plan.using != RAILS and now < 200:
        d = step(plan, now, health())
        plan, now = d.plan, now + 1.0
        reroutes += d.action is not None
    assert plan.using == RAILS and reroutes == 2


def test_a_flapping_rail_that_tpassd_marks_degraded_is_unusable():
    d = step(initial_plan(RAILS), 0.0, health(node1_rail1="degraded"))
    assert d.action is not None and d.action.rails == ("rail0",)
