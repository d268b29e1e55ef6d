"""contrib/prometheus: the alert rules load (`promtool check rules`) and fire as their tests say
(`promtool test rules`: each alert on its input series, with its labels and annotations, and not
on the series beside it). Which names they use is checked against tpassd's real output in
test_prometheus.py."""

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONTRIB = REPO / "contrib" / "prometheus"


def promtool(*args: str) -> subprocess.CompletedProcess:
    path = shutil.which("promtool")
    assert path, "promtool is missing: apt-get install -t trixie promtool (scripts/install-system-deps.sh does)"
    return subprocess.run([path, *args], cwd=CONTRIB, capture_output=True, text=True, timeout=60)


def test_the_alert_rules_load():
    out = promtool("check", "rules", "torchpass.rules.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 8 rules found" in out.stdout


def test_the_alert_rules_fire_as_their_tests_say():
    out = promtool("test", "rules", "torchpass.rules.test.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_a_broken_rule_fails_its_test(tmp_path):
    """The tests can fail: with the failed-node alert's state changed, promtool test rules says so."""
    rules = (CONTRIB / "torchpass.rules.yml").read_text()
    assert 'tpassd_node_health{state="failed"}' in rules
    (tmp_path / "torchpass.rules.yml").write_text(rules.replace('{state="failed"}', '{state="unknown"}'))
    shutil.copy(CONTRIB / "torchpass.rules.test.yml", tmp_path)
    out = subprocess.run([shutil.which("promtool") or "promtool", "test", "rules", "torchpass.rules.test.yml"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "TorchpassNodeFailed" in out.stdout + out.stderr
