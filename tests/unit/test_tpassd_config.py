"""tpassd config and policy: defaults, unknown keys named, --check-config."""

import pytest

from torchpass.errors import ConfigError
from tpassd.config import TpassdConfig, load_config
from tpassd.main import main
from tpassd.policy import DEFAULT_POLICY_FILE, Policy, load_policy


def test_default_policy_file_matches_dataclass_defaults():
    assert load_policy(DEFAULT_POLICY_FILE) == Policy()


def test_policy_unknown_key_and_bad_values(tmp_path):
    f = tmp_path / "p.toml"
    f.write_text("[ib]\nflap_cnt = 3\n")
    with pytest.raises(ConfigError, match="flap_cnt"):
        load_policy(f)
    f.write_text("[ib]\nlink_down_severity = \"sick\"\n")
    with pytest.raises(ConfigError, match="link_down_severity"):
        load_policy(f)
    f.write_text("[xid]\nfailed = [79]\ndegraded = [79]\n")
    with pytest.raises(ConfigError, match="both"):
        load_policy(f)
    f.write_text("[ecc]\nsbe_storm_count = 7\n")
    assert load_policy(f).ecc.sbe_storm_count == 7


def test_config_layers_and_unknown_keys(tmp_path):
    f = tmp_path / "tpassd.toml"
    f.write_text('interval_s = 2.0\nnvml_provider = "fake"\n')
    cfg = load_config(f, flags={"pub_port": 1234}, environ={"TPASSD_FAKE_GPUS": "3"})
    assert (cfg.interval_s, cfg.nvml_provider, cfg.fake_gpus, cfg.pub_port) == (2.0, "fake", 3, 1234)
    f.write_text("intervall_s = 2.0\n")
    with pytest.raises(ConfigError, match="intervall_s"):
        load_config(f)
    f.write_text('nvml_provider = "maybe"\n')
    with pytest.raises(ConfigError, match="nvml_provider"):
        load_config(f)
    assert load_config(tmp_path / "absent.toml") == TpassdConfig()


def test_check_config_cli(tmp_path, capsys):
    f = tmp_path / "tpassd.toml"
    f.write_text("interval_s = 0.5\ncollector_timeout_s = 0.25\n")
    assert main(["--check-config", "--config", str(f)]) == 0
    assert '"interval_s": 0.5' in capsys.readouterr().out
    f.write_text("bogus_key = 1\n")
    assert main(["--check-config", "--config", str(f)]) == 2
    assert "bogus_key" in capsys.readouterr().err
    assert main(["--check-config", "--config", str(tmp_path / "nope.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_example_config_is_valid():
    from pathlib import Path

    ex = Path(__file__).resolve().parents[2] / "contrib" / "tpassd.toml.example"
    assert main(["--check-config", "--config", str(ex)]) == 0


def test_fixture_sysfs_is_refused_for_the_real_sys(tmp_path, capsys):
    f = tmp_path / "tpassd.toml"
    f.write_text('sysfs_root = "/sys"\nnvml_provider = "fake"\n')
    assert main(["--config", str(f), "--fixture-sysfs"]) == 2
    assert "--fixture-sysfs needs a sysfs_root other than /sys" in capsys.readouterr().err


def test_ports_and_drill_kinds_are_defined_once():
    """tpassd's ports live in torchpass/ports.py and the drill kinds in
    torchpass/drill_kinds.py: no other module of the three packages spells them."""
    import ast
    from pathlib import Path

    from torchpass import drill_kinds, ports
    from tpassd import drills

    repo = Path(__file__).resolve().parents[2]
    numbers = {ports.TPASSD_PUB_PORT, ports.TPASSD_CONTROL_PORT, ports.TPASSD_METRICS_PORT}
    spelled: dict[str, list[str]] = {}
    for pkg in ("torchpass", "tpassd", "tpassctl"):
        for f in sorted((repo / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Constant) and type(node.value) is int and node.value in numbers:
                    spelled.setdefault("ports", []).append(f"{f.relative_to(repo)}:{node.lineno}")
                # a collection of two or more kinds is a (second) definition of them
                if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and sum(
                        isinstance(e, ast.Constant) and e.value in drill_kinds.KINDS for e in node.elts) >= 2:
                    spelled.setdefault("kinds", []).append(f"{f.relative_to(repo)}:{node.lineno}")
    assert {p.split(":")[0] for p in spelled["ports"]} == {"torchpass/ports.py"}, spelled["ports"]
    assert {p.split(":")[0] for p in spelled["kinds"]} == {"torchpass/drill_kinds.py"}, spelled["kinds"]
    assert drills.KINDS is drill_kinds.KINDS
    # The example config shows the same defaults.
    example = load_config(repo / "contrib" / "tpassd.toml.example", required_file=True)
    assert (example.pub_port, example.control_port, example.metrics_port) == (
        ports.TPASSD_PUB_PORT, ports.TPASSD_CONTROL_PORT, ports.TPASSD_METRICS_PORT)
    assert (TpassdConfig().pub_port, TpassdConfig().control_port, TpassdConfig().metrics_port) == (
        ports.TPASSD_PUB_PORT, ports.TPASSD_CONTROL_PORT, ports.TPASSD_METRICS_PORT)
