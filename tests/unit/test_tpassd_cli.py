"""tpassctl nodes / inject against an in-process tpassd (CliRunner)."""

import json
import time

from click.testing import CliRunner

from tpassctl.nodes_cmd import inject, nodes
from tpassd.daemon import Tpassd
from tpassd.testing import fake_node_config


def test_nodes_and_inject(tmp_path, munge):
    d = Tpassd(fake_node_config(tmp_path, "node2", munge.socket, interval_s=0.2, collector_timeout_s=0.1,
                                metrics_port=-1)).start()
    try:
        ep = f"node2=tcp://127.0.0.1:{d.ports()['control_port']}"
        dead = "node9=tcp://127.0.0.1:1"
        r = CliRunner()
        args = ["--endpoint", ep, "--munge-socket", munge.socket]
        time.sleep(0.5)
        out = r.invoke(nodes, args + ["--endpoint", dead, "--json", "--timeout", "0.3"])
        assert out.exit_code == 3, out.output  # a tpassd did not answer: not a healthy cluster
        assert json.loads(out.output)["error"] == {"code": "unreachable",
                                                   "message": "no answer from the tpassd of node9"}
        rows = {n["node"]: n for n in json.loads(out.output)["nodes"]}
        assert rows["node2"]["state"] == "healthy" and rows["node2"]["last_heartbeat_age_s"] < 1.0
        assert rows["node9"]["state"] == "unknown" and "no reply" in rows["node9"]["reasons"][0]
        out = r.invoke(inject, args + ["--node", "node2", "--fault", "ecc-sbe-storm", "--gpu", "3"])
        assert out.exit_code == 0 and "gpu3: 500 correctable ECC errors" in out.output, out.output
        time.sleep(0.3)
        out = r.invoke(nodes, args + ["--json"])
        row = json.loads(out.output)["nodes"][0]
        assert row["state"] == "degraded" and "SBE ECC storm" in row["reasons"][0]
        assert row["components"]["gpu3"] == "degraded"
        text = r.invoke(nodes, args)
        assert text.exit_code == 0 and "node2" in text.output and "degraded" in text.output
        # --check for NHC: degraded is unhealthy at the default threshold, not at "failed"
        assert r.invoke(nodes, args + ["--check"]).exit_code == 1
        assert r.invoke(nodes, args + ["--check=failed"]).exit_code == 0
        unknown = r.invoke(nodes, args + ["--endpoint", dead, "--check=failed", "--timeout", "0.3", "--json"])
        assert unknown.exit_code == 3 and json.loads(unknown.output)["error"]["code"] == "unknown", unknown.output
        listed = r.invoke(nodes, args + ["--endpoint", dead, "--state", "unknown", "--json", "--timeout", "0.3"])
        assert [n["node"] for n in json.loads(listed.output)["nodes"]] == ["node9"]
        assert r.invoke(inject, args + ["--node", "node2", "--fault", "clear"]).exit_code == 0
        time.sleep(0.5)
        assert json.loads(r.invoke(nodes, args + ["--json"]).output)["nodes"][0]["state"] == "healthy"
        bad = r.invoke(inject, args + ["--node", "node2", "--fault", "xid79", "--gpu", "42"])
        assert bad.exit_code != 0 and "no GPU 42" in bad.output
        assert r.invoke(inject, args + ["--node", "node2", "--fault", "meteor"]).exit_code == 2
        assert r.invoke(nodes, ["--endpoint", "garbage"]).exit_code == 2
    finally:
        d.stop()


def test_missing_criu_is_shown_as_migration_unavailable_not_as_ill_health(tmp_path, munge):
    from dataclasses import replace

    cfg = fake_node_config(tmp_path, "node3", munge.socket, interval_s=0.2, collector_timeout_s=0.1, metrics_port=-1)
    d = Tpassd(replace(cfg, criu_binary=str(tmp_path / "no-such-criu"))).start()
    try:
        args = ["--endpoint", f"node3=tcp://127.0.0.1:{d.ports()['control_port']}", "--munge-socket", munge.socket]
        time.sleep(0.4)
        r = CliRunner()
        row = json.loads(r.invoke(nodes, args + ["--json"]).output)["nodes"][0]
        assert row["state"] == "healthy", row
        assert row["checkpoint"]["state"] == "unavailable"
        assert row["checkpoint"]["detail"].startswith(f"criu not found at {tmp_path / 'no-such-criu'}: live migration")
        text = r.invoke(nodes, args).output
        assert "unavailable" in text and "migration unavailable: criu not found" in text
    finally:
        d.stop()


def test_installed_criu_is_ready(tmp_path, munge):
    d = Tpassd(fake_node_config(tmp_path, "node4", munge.socket, interval_s=0.2, collector_timeout_s=0.1,
                                metrics_port=-1)).start()
    try:
        args = ["--endpoint", f"node4=tcp://127.0.0.1:{d.ports()['control_port']}", "--munge-socket", munge.socket]
        time.sleep(0.4)  # the in-process daemon's first-tick log lines would land in the captured output
        row = json.loads(CliRunner().invoke(nodes, args + ["--json"]).output)["nodes"][0]
        assert row["checkpoint"]["state"] == "ready" and row["checkpoint"]["detail"].startswith("criu 4."), row
    finally:
        d.stop()


def test_nodes_shows_each_rail_only_where_nodes_have_rails(tmp_path, munge):
    # lo: the one interface every network namespace has; its operstate is "unknown" while up.
    d = Tpassd(fake_node_config(tmp_path, "node2", munge.socket, interval_s=0.2, collector_timeout_s=0.1,
                                metrics_port=-1, rails=("lo",))).start()
    try:
        args = ["--endpoint", f"node2=tcp://127.0.0.1:{d.ports()['control_port']}", "--munge-socket", munge.socket]
        time.sleep(0.5)
        r = CliRunner()
        row = json.loads(r.invoke(nodes, args + ["--json"]).output)["nodes"][0]
        assert row["rails"] == {"lo": "healthy"}, row
        text = r.invoke(nodes, args).output
        assert text.splitlines()[0].split() == ["NODE", "STATE", "HEARTBEAT", "MIGRATION", "RAILS", "REASONS"]
        assert "lo healthy" in text
    finally:
        d.stop()
