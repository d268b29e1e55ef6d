"""The coordinator's policy: defaults, named policy files, unknown keys and bad values rejected."""

from __future__ import annotations

import pytest

from torchpass.coordinator.policy import CoordinatorPolicy, load_policy
from torchpass.errors import ConfigError


def test_default_is_built_in_and_valid(tmp_path):
    p = load_policy("default", policies_dir=tmp_path / "none")
    assert p == CoordinatorPolicy()
    assert p.migrate_on == ("degraded", "failed") and p.spare_strategies == ("hot", "expand", "companion")
    assert p.max_pause_s() > p.pause_timeout_s


def test_named_policy_overrides_defaults_and_flags_win(tmp_path):
    (tmp_path / "fast.toml").write_text('pause_timeout_s = 5\nspare_strategies = ["hot", "companion"]\n'
                                        'migrate_on = ["degraded"]\n')
    p = load_policy("fast", policies_dir=tmp_path, flags={"stall_s": 42})
    assert (p.pause_timeout_s, p.spare_strategies, p.migrate_on, p.stall_s) == (
        5.0, ("hot", "companion"), ("degraded",), 42.0)
    assert p.dump_timeout_s == CoordinatorPolicy().dump_timeout_s


def test_site_default_file_is_applied(tmp_path):
    (tmp_path / "default.toml").write_text("max_spare_attempts = 4\n")
    assert load_policy(policies_dir=tmp_path).max_spare_attempts == 4


def test_missing_named_policy_lists_what_exists(tmp_path):
    (tmp_path / "fast.toml").write_text("")
    with pytest.raises(ConfigError, match=r"policy 'slow' not found: no .*slow.toml; available: default, fast"):
        load_policy("slow", policies_dir=tmp_path)


@pytest.mark.parametrize("text,msg", [
    ("pause_timout_s = 5\n", "unknown key(s) pause_timout_s"),
    ('migrate_on = ["degraded", "unknown"]\n', "unknown health is never a reason to migrate"),
    ('spare_strategies = ["hot", "borrow"]\n', "unknown strategy borrow"),
    ('spare_strategies = ["hot", "hot"]\n', "lists a strategy twice"),
    ("pause_timeout_s = 0\n", "pause_timeout_s must be > 0"),
    ("pause_margin_collectives = 0\n", "pause_margin_collectives must be >= 1"),
    ("max_spare_attempts = 0\n", "max_spare_attempts must be >= 1"),
    ('stall_s = "soon"\n', "stall_s: expected a number"),
    ('rendezvous_ports = "32767-30000"\n', "rendezvous_ports: '32767-30000' is not a port range"),
    ('rendezvous_ports = "80"\n', "rendezvous_ports: '80' is not a port range"),
])
def test_bad_policy_files_are_rejected_by_name(tmp_path, text, msg):
    (tmp_path / "bad.toml").write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_policy("bad", policies_dir=tmp_path)
    assert msg in str(exc.value)


def test_policy_names_cannot_escape_the_directory(tmp_path):
    with pytest.raises(ConfigError, match="policy name '../etc/passwd' is invalid"):
        load_policy("../etc/passwd", policies_dir=tmp_path)


def test_the_documented_policy_file_is_the_defaults(tmp_path):
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "coordinator.md").read_text()
    block = doc.split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "documented.toml").write_text(block)
    assert load_policy("documented", policies_dir=tmp_path) == CoordinatorPolicy()
    import dataclasses

    documented = {line.split("=")[0].strip() for line in block.splitlines() if "=" in line and not line.startswith("#")}
    assert documented == {f.name for f in dataclasses.fields(CoordinatorPolicy)}


def test_hold_deadline_is_computed_unless_a_test_policy_sets_it(tmp_path):
    """A paused rank's own deadline (docs/coordinator.md, "Never left paused"): 3630 s by default."""
    from torchpass.coordinator.rank_commands import hold_deadline_s

    assert hold_deadline_s(CoordinatorPolicy()) == CoordinatorPolicy().max_pause_s() + 60.0 == 3630.0
    (tmp_path / "short.toml").write_text("hold_deadline_s = 20\n")
    assert hold_deadline_s(load_policy("short", policies_dir=tmp_path)) == 20.0
    (tmp_path / "bad.toml").write_text("hold_deadline_s = -1\n")
    with pytest.raises(ConfigError, match="hold_deadline_s must be >= 0"):
        load_policy("bad", policies_dir=tmp_path)
