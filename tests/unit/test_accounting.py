"""torchpass.accounting: the ``torchpass: ...`` part of a job's AdminComment, built from the job's
event log (which its owner can write) and merged into what other tools wrote there."""

from __future__ import annotations

import pytest

from torchpass import accounting as acc


def mig(kind, node, target, outcome, paused=None):
    durations = {} if paused is None else {"paused": paused, "total": paused + 1}
    return {"seq": 1, "time": 0.0, "kind": kind, "message": "free text the owner could write | torchpass: x",
            "data": {"migration": "m1", "node": node, "target": target, "outcome": outcome,
                     "phase_durations": durations}}


def ev(kind, **data):
    return {"seq": 1, "time": 0.0, "kind": kind, "message": "", "data": data}


EXAMPLE = [ev("rank.registered", rank=0), mig("migration.completed", "n3", "n7", "completed", 0.61),
           mig("migration.rolled_back", "n5", "n8", "rolled_back", 2.0), ev("snapshot.completed", snapshot="s1"),
           ev("migration.cancelled", node="n1", outcome="cancelled")]


def test_the_part_counts_in_order_with_each_migration():
    assert acc.render(acc.summarize(EXAMPLE)) == "torchpass: mig 2 (n3->n7 ok 0.6s; n5->n8 rolled_back); snap 1"


def test_reroutes_relaunches_and_a_log_with_no_migration():
    events = [ev("link.rerouted"), ev("link.restored"), ev("job.relaunched", relaunch=1), ev("snapshot.completed")]
    assert acc.render(acc.summarize(events)) == "torchpass: snap 1; reroute 2; relaunch 1"
    assert acc.summarize([ev("rank.registered"), ev("migration.rejected", outcome="rejected")]).empty


def test_nothing_the_owner_wrote_reaches_the_field_as_text():
    forged = [mig("migration.completed", "n1 | site: evil", "n\x1b2", "completed", float("nan")),
              mig("migration.completed", "n1", "n2", "pwned; rm -rf", 1.0),
              mig("migration.completed", ["n1"], None, "completed", -3), "not an event", {"kind": 5},
              {"kind": "migration.completed", "data": "x"}]
    part = acc.render(acc.summarize(forged))
    assert part == "torchpass: mig 2 (?->? ok; ?->? ok)"
    assert acc.SEPARATOR not in part and part.isprintable()


def test_the_part_is_capped_and_keeps_the_newest_migrations():
    events = [mig("migration.completed", f"node{i:03d}", f"spare{i:03d}", "completed", 0.5) for i in range(40)]
    events.append(ev("snapshot.completed"))
    part = acc.render(acc.summarize(events))
    assert len(part) <= acc.PART_MAX
    assert part.startswith("torchpass: mig 40 (...; ") and part.endswith("node039->spare039 ok 0.5s); snap 1")
    assert "node000" not in part
    assert acc.render(acc.summarize(events), limit=30) == "torchpass: mig 40; snap 1"


def test_merge_keeps_other_tools_parts_and_replaces_ours_where_it_stands():
    part = "torchpass: mig 1 (a->b ok 0.1s)"
    assert acc.merge("", part) == part
    assert acc.merge("site: foo", part) == "site: foo | torchpass: mig 1 (a->b ok 0.1s)"
    assert acc.merge("site: foo | torchpass: snap 1 | audit: ok", part) == \
        "site: foo | torchpass: mig 1 (a->b ok 0.1s) | audit: ok"
    assert acc.merge("torchpass: old | x | torchpass: older", part) == f"{part} | x"
    # another tool's text is kept byte for byte, odd spacing included
    assert acc.merge("  weird|text ", part) == "  weird|text  | torchpass: mig 1 (a->b ok 0.1s)"
    with pytest.raises(ValueError):
        acc.merge("site: foo", "site: bar")


def test_the_fields_are_the_ones_scontrol_lets_root_update():
    assert acc.DEFAULT_FIELD in acc.FIELDS and set(acc.FIELDS) == {"AdminComment", "Comment"}
