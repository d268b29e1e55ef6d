"""A rank registers again with a coordinator that does not know it (one its supervisor restarted on
the same address after the last one died): running or paused, and a paused rank gets its resume."""

from __future__ import annotations

import threading
import time

import zmq

from test_coordinator_server import RESUME
from test_never_left_paused import FakePG
from test_runtime_control import Recording, start_link, wait_for
from torchpass.coordinator.job_record import JobState
from torchpass.coordinator.server import CoordinatorServer
from torchpass.runtime.link_state import LinkState
from torchpass.runtime.pg import Rendezvous


def _serve(port: int = 0) -> tuple[CoordinatorServer, threading.Thread]:
    end = time.monotonic() + 10
    while True:  # the stopped server's socket is closed by zmq's I/O thread, a moment later
        try:
            server = CoordinatorServer(JobState(job_id=7, spares=1), bind_address="127.0.0.1", port=port,
                                       wall=lambda: 1e9, driver=Recording(7, time.monotonic))
            break
        except zmq.ZMQError:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)
    t = threading.Thread(target=server.serve, daemon=True)
    t.start()
    return server, t


def _restart(server: CoordinatorServer, t: threading.Thread) -> tuple[CoordinatorServer, threading.Thread]:
    port = server.port
    server.stop()
    t.join(5)
    return _serve(port)


def test_a_running_rank_registers_again_with_a_restarted_coordinator():
    first, t = _serve()
    link = start_link(f"tcp://127.0.0.1:{first.port}")
    try:
        wait_for(lambda: link.registered and 1 in first.state.ranks, "registered")
        second, t = _restart(first, t)
        try:
            took = wait_for(lambda: 1 in second.state.ranks, "registered with the restarted coordinator", 10.0)
            # A report in flight when the first one stopped is given up after request_timeout_s (5 s).
            assert took < 5.0 + 3.0
            wait_for(lambda: link._state is LinkState.REPORTING, "reporting again", 5.0)
        finally:
            second.stop()
            t.join(5)
    finally:
        link.stop()


def test_a_paused_rank_registers_again_and_gets_its_resume_from_the_restarted_coordinator():
    first, t = _serve()
    pg = FakePG(size=2, rank=1)
    link = start_link(f"tcp://127.0.0.1:{first.port}", pg)
    try:
        wait_for(lambda: link.registered and 1 in first.state.ranks, "registered")
        pg.paused = True  # quiesced at T when its coordinator dies
        second, t = _restart(first, t)
        try:
            second.later(lambda: second.driver.executor.commands.__setitem__(1, dict(RESUME)))
            wait_for(lambda: 1 in second.state.ranks, "registered with the restarted coordinator", 10.0)
            wait_for(lambda: pg.resumes, "the resume from the restarted coordinator", 10.0)
            assert pg.resumes[0] == (3, Rendezvous("127.0.0.1", 29500))
        finally:
            second.stop()
            t.join(5)
    finally:
        link.stop()
