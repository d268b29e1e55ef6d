"""The sd_notify protocol as tpassd speaks it (tpassd/sd_notify.py), against a stand-in
NOTIFY_SOCKET: a unix datagram socket this test binds, as systemd does."""

from __future__ import annotations

import os
import socket

import pytest

from tpassd import sd_notify
from tpassd.sd_notify import Notifier, SampleWatchdog, samples_flow, watchdog_period_s


@pytest.fixture
def notify_socket(tmp_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(tmp_path / "notify"))
    s.settimeout(2)
    yield s
    s.close()


def test_a_message_is_one_datagram_of_key_value_lines(notify_socket):
    n = Notifier.from_environment({sd_notify.NOTIFY_SOCKET: notify_socket.getsockname()})
    assert n.enabled and n.send(READY=1, STATUS="serving node1")
    assert notify_socket.recv(4096) == b"READY=1\nSTATUS=serving node1\n"
    n.close()


def test_an_abstract_socket_is_named_with_an_at():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"tpassd-test-{os.getpid()}"
    s.bind(b"\0" + name.encode())
    s.settimeout(2)
    try:
        n = Notifier.from_environment({sd_notify.NOTIFY_SOCKET: "@" + name})
        assert n.send(WATCHDOG=1)
        assert s.recv(4096) == b"WATCHDOG=1\n"
        n.close()
    finally:
        s.close()


def test_the_variables_are_taken_out_of_the_environment_so_children_do_not_inherit_them(notify_socket):
    env = {sd_notify.NOTIFY_SOCKET: notify_socket.getsockname(), sd_notify.WATCHDOG_USEC: "30000000",
           sd_notify.WATCHDOG_PID: str(os.getpid()), "PATH": "/bin"}
    Notifier.from_environment(env).close()
    assert watchdog_period_s(env) == 30.0
    assert env == {"PATH": "/bin"}


def test_without_notify_socket_nothing_is_sent():
    n = Notifier.from_environment({})
    assert not n.enabled and n.send(READY=1) is False
    assert not Notifier.from_environment({sd_notify.NOTIFY_SOCKET: "vsock:2:1234"}).enabled


def test_a_lost_notification_is_logged_not_raised(tmp_path):
    n = Notifier(str(tmp_path / "nobody-listens"))
    assert n.send(READY=1) is False
    n.close()


@pytest.mark.parametrize("env, want", [
    ({}, None),
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "junk"}, None),
    ({"WATCHDOG_USEC": "4000000"}, 4.0),
    ({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
    ({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "77"}, 4.0),
])
def test_the_watchdog_period_is_for_this_process_only(env, want):
    assert watchdog_period_s(dict(env), pid=77) == want


def test_samples_flow_until_no_tick_ended_for_the_stale_time():
    assert samples_flow(now=10.0, last_tick_end=None, started=9.0, stale_after_s=2.5)  # the first tick is due
    assert not samples_flow(now=12.0, last_tick_end=None, started=9.0, stale_after_s=2.5)
    assert samples_flow(now=12.0, last_tick_end=11.0, started=0.0, stale_after_s=2.5)
    assert not samples_flow(now=13.6, last_tick_end=11.0, started=0.0, stale_after_s=2.5)


def test_the_watchdog_pings_while_ticks_end_and_stops_when_they_do_not(notify_socket):
    now = [100.0]
    last = [None]
    n = Notifier(notify_socket.getsockname())
    wd = SampleWatchdog(n, period_s=4.0, stale_after_s=2.5, last_tick_end=lambda: last[0], clock=lambda: now[0])
    assert wd.every_s == 2.0
    assert wd.check() and notify_socket.recv(64) == b"WATCHDOG=1\n"
    last[0] = 101.0
    now[0] = 103.0
    assert wd.check()
    now[0] = 103.6  # the sampler is stuck: 2.6 s since its last tick ended
    assert wd.check() is False and not wd.flowing
    last[0] = 103.7
    now[0] = 104.0
    assert wd.check() and wd.flowing
    notify_socket.settimeout(0.2)
    assert notify_socket.recv(64) == b"WATCHDOG=1\n"
    assert notify_socket.recv(64) == b"WATCHDOG=1\n"
    with pytest.raises(TimeoutError):
        notify_socket.recv(64)  # three pings, not four
    n.close()
