"""Following a job while it runs: its events as they come (`events --follow`), and one
operation's phases until its outcome (`migrate`/`snapshot`/`resume --wait`).

Phase changes are not events: the coordinator records an operation's start
and its end (with ``phase_durations``), and job.status says the phase it is
in now. So a wait polls both: job.status for the live phase, job.events for
the end. A job's events come from its coordinator while it is registered,
else from the log it saved (STATE_DIR/jobs/J/events.json: saved after every
event and once more when the coordinator stops, just before it removes its
registration, so a gone registration means the saved log is final).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import click

from torchpass import auth, jobdir, layout, zmqio
from torchpass.errors import DependencyError, SlurmError, TorchpassError, UnreachableError
from torchpass.slurm import client

POLL_S = 0.25  # a phase lasts 0.1 s at the least (pause on 2 ranks); every poll is one request
SLURM_POLL_S = 2.0  # asking slurmctld is a process (scontrol) per poll: not every 0.25 s
SLURM_LIVE = ("PENDING", "CONFIGURING", "RUNNING")  # a job that may still have (or get) a coordinator


def saved_events(state_dir: Path, job_id: int) -> dict[str, Any] | None:
    """The event log a job's coordinator saved in STATE_DIR/jobs/J/events.json.

    Trusted only if the file belongs to the owner of jobs/J (made by the root plugin for the
    job's user) and is a plain file of one link, read without following a link (torchpass.jobdir).
    """
    try:
        events, _ = jobdir.read_events(state_dir, job_id)
    except (OSError, ValueError):
        return None
    return {"job_id": job_id, "endpoint": None, "reachable": False, "saved": str(layout.events_json(state_dir, job_id)),
            "events": [e for e in events if isinstance(e, dict)]}


def registration(state_dir: Path, job_id: int) -> dict[str, Any] | None:
    """The job's coordinator registration now (None: not up yet, or gone). The caller checked once
    that it may see the job (status_cmd.visible_job)."""
    try:
        fd, owner = jobdir.open_job_dir(state_dir, job_id)
    except OSError:
        return None
    try:
        return jobdir.registration(fd, job_id, owner)
    finally:
        os.close(fd)


def ask(info: dict[str, Any], job_id: int, type_: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    return zmqio.request(info["endpoint"], type_, body, timeout_s=timeout_s, retries=0,
                         auth=auth.optional_credential_for(type_, body, auth.job_target(job_id)))


def slurm_live(job_id: int) -> bool | None:
    """Whether Slurm may still run the job (pending or running); None when slurmctld cannot say."""
    try:
        job = client().job(job_id)
    except (SlurmError, DependencyError, TorchpassError):
        return None
    return job is not None and job.state in SLURM_LIVE


@dataclass
class Feed:
    """A job's events after ``seq``, from its coordinator or its saved log; ``ended`` once the job ended."""

    state_dir: Path
    job_id: int
    seq: int = 0
    timeout_s: float = 2.0
    ended: bool = False
    _slurm_asked: float = float("-inf")
    _slurm_says_live: bool | None = None

    def status(self) -> dict[str, Any] | None:
        """job.status now (None: no coordinator answers)."""
        info = registration(self.state_dir, self.job_id)
        if info is None:
            return None
        try:
            return ask(info, self.job_id, "job.status", {}, self.timeout_s)
        except TorchpassError:
            return None

    def poll(self) -> list[dict[str, Any]]:
        """The events since the last poll, in order. Sets ``ended`` when the job ended."""
        info = registration(self.state_dir, self.job_id)
        got: list[dict[str, Any]] | None = None
        if info is not None:
            try:
                body = {"since_seq": self.seq} if self.seq else {}
                got = ask(info, self.job_id, "job.events", body, self.timeout_s).get("events", [])
            except UnreachableError:
                got = None
        if got is None:
            saved = saved_events(self.state_dir, self.job_id)
            got = saved["events"] if saved else []
            live = self._slurm_live()
            # No coordinator answers: the job ended once Slurm no longer runs it. With no
            # registration (gone: its log was saved just before), also when slurmctld cannot say;
            # a job whose coordinator has not registered yet is starting, not ended.
            self.ended = live is False or (info is None and live is None and saved is not None)
        new = [e for e in got if isinstance(e, dict) and int(e.get("seq", 0) or 0) > self.seq]
        new.sort(key=lambda e: int(e.get("seq", 0) or 0))
        if new:
            self.seq = int(new[-1].get("seq", 0) or 0)
        return new

    def _slurm_live(self) -> bool | None:
        now = time.monotonic()
        if now - self._slurm_asked >= SLURM_POLL_S:
            self._slurm_asked, self._slurm_says_live = now, slurm_live(self.job_id)
        return self._slurm_says_live


class PhaseReport:
    """How a wait shows progress: a live line on a TTY, one line per phase otherwise, JSON lines
    under --json (each ``{"job_id", "id", "phase", "time"}``; the outcome is the last line)."""

    def __init__(self, as_json: bool, stream: TextIO | None = None, tty: bool | None = None):
        self.as_json = as_json
        self.stream = stream or click.get_text_stream("stdout")
        self.tty = (self.stream.isatty() if tty is None else tty) and not as_json
        self.last: tuple[str, str] | None = None
        self.live = False

    def phase(self, job_id: int, op_id: str, phase: str, age_s: float | None = None) -> None:
        changed = self.last != (op_id, phase)
        self.last = (op_id, phase)
        if self.as_json:
            if changed:
                self._line(json.dumps({"job_id": job_id, "id": op_id, "phase": phase, "time": time.time()}))
        elif self.tty:
            age = "" if age_s is None else f" ({age_s:.1f}s)"
            self.stream.write(f"\r\x1b[2K{op_id}: {phase}{age}")
            self.stream.flush()
            self.live = True
        elif changed:
            self._line(f"{op_id}: {phase}")

    def outcome(self, line: str, obj: dict[str, Any]) -> None:
        self._line(json.dumps(obj) if self.as_json else line)

    def _line(self, text: str) -> None:
        if self.live:
            self.stream.write("\r\x1b[2K")
            self.live = False
        self.stream.write(text + "\n")
        self.stream.flush()


def wait_for(feed: Feed, wait_s: float, report: PhaseReport, op_id: str,
             phase_of: Callable[[dict[str, Any] | None], tuple[str, float | None] | None],
             final: Callable[[dict[str, Any]], bool], clock: Callable[[], float] = time.monotonic,
             sleep: Callable[[float], None] = time.sleep) -> dict[str, Any] | None:
    """Show ``op_id``'s phases (``phase_of(job.status)``: (phase, seconds in it), or None) until an
    event for which ``final`` holds: that event; None after ``wait_s`` seconds, or when the job
    ended without one (then ``feed.ended``)."""
    deadline = clock() + wait_s
    while True:
        for ev in feed.poll():
            if final(ev):
                return ev
        if feed.ended:
            return None
        got = phase_of(feed.status())
        if got is not None:
            report.phase(feed.job_id, op_id, *got)
        if clock() >= deadline:
            return None
        sleep(POLL_S)


__all__ = ["Feed", "PhaseReport", "registration", "saved_events", "slurm_live", "wait_for"]
