"""Every tpassd port is configurable, and tpassd's callers read the ports from tpassd's own
configuration (torchpass/tpassd_ports.py). Without it, callers would use the defaults of torchpass/ports.py
whatever tpassd was configured with."""

from __future__ import annotations

import socket

import pytest

from torchpass import ports
from torchpass.errors import ConfigError
from torchpass.tpassd_ports import CONFIG_ENV, TpassdPorts, tpassd_config_path, tpassd_ports
from tpassd.config import load_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_defaults_without_a_file(tmp_path):
    assert tpassd_ports(tmp_path / "absent.toml", environ={}) == TpassdPorts(
        ports.TPASSD_PUB_PORT, ports.TPASSD_CONTROL_PORT, ports.TPASSD_METRICS_PORT)


def test_tpassd_and_its_callers_read_the_same_file_and_environment(tmp_path):
    f = tmp_path / "tpassd.toml"
    f.write_text('pub_port = 17717\ncontrol_port = 17718\nmetrics_port = -1\nnvml_provider = "none"\n')
    for environ in ({CONFIG_ENV: str(f)}, {CONFIG_ENV: str(f), "TPASSD_CONTROL_PORT": "27718"}):
        assert tpassd_config_path(environ) == f
        cfg = load_config(None, environ=environ)  # tpassd's own default path is the same
        got = tpassd_ports(environ=environ)
        assert (got.pub_port, got.control_port, got.metrics_port) == (cfg.pub_port, cfg.control_port,
                                                                      cfg.metrics_port)
        assert got.pub_port == 17717 and got.control_port == int(environ.get("TPASSD_CONTROL_PORT", 17718))


@pytest.mark.parametrize("text, why", [("control_port = 0\n", "ephemeral"), ('pub_port = "x"\n', "integer"),
                                       ("metrics_port = 70000\n", "metrics_port")])
def test_unusable_ports_are_refused_with_one_line(tmp_path, text, why):
    f = tmp_path / "tpassd.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=why) as e:
        tpassd_ports(f, environ={})
    assert "\n" not in str(e.value)


def test_a_tpassd_on_non_default_ports_is_reached_by_a_caller_that_reads_its_config(tmp_path, munge):
    from dataclasses import asdict

    from tpassd.daemon import Tpassd
    from tpassd.testing import call, fake_node_config

    pub, ctl = free_port(), free_port()
    base = fake_node_config(tmp_path, "node1", munge.socket)
    f = tmp_path / "tpassd.toml"
    keep = ("node_name", "bind_address", "nvml_provider", "sysfs_root", "state_dir", "snapshot_dir", "munge_socket")
    f.write_text("".join(f'{k} = "{v}"\n' for k, v in asdict(base).items() if k in keep)
                 + f"pub_port = {pub}\ncontrol_port = {ctl}\nmetrics_port = -1\n")
    environ = {CONFIG_ENV: str(f)}
    node = Tpassd(load_config(None, environ=environ)).start()
    try:
        p = tpassd_ports(environ=environ)
        assert node.ports()["control_port"] == p.control_port == ctl and node.ports()["pub_port"] == pub
        assert call(f"tcp://127.0.0.1:{p.control_port}", "node1", "tpassd.health", munge_socket=munge.socket)
    finally:
        node.stop()


def test_default_ports_are_below_1024_so_no_user_can_take_them_while_tpassd_restarts():
    """While tpassd restarts, a user who binds its port answers the coordinators (or the scrape) in
    its place. Below 1024 only root may bind: tried here as tpuser1, for each default port."""
    import subprocess
    import sys

    from torchpass.ports import TPASSD_CONTROL_PORT, TPASSD_METRICS_PORT, TPASSD_PUB_PORT

    for port in (TPASSD_PUB_PORT, TPASSD_CONTROL_PORT, TPASSD_METRICS_PORT):
        assert 0 < port < 1024, port
        squat = subprocess.run(
            ["runuser", "-u", "tpuser1", "--", sys.executable, "-I", "-c",
             f"import socket; s = socket.socket(); s.bind(('127.0.0.1', {port})); print('bound')"],
            capture_output=True, text=True, timeout=30)
        assert squat.returncode != 0 and "Permission denied" in squat.stderr, (port, squat.stdout, squat.stderr)
