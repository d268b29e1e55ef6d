"""What torchpass reads from slurm.conf itself: the settings Slurm's JSON output does not carry
(munged's socket, PrivateData, SlurmUser). One reader, used by the coordinator and tpassd."""

from __future__ import annotations

import os
import pwd
import re
from pathlib import Path


def _slurm_conf_text(conf: str | None = None) -> str | None:
    path = conf or os.environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf"
    try:
        return Path(path).read_text()
    except OSError:
        return None


def slurm_munge_socket(conf: str | None = None) -> str | None:
    """The munged socket Slurm itself uses (AuthInfo=socket=... in slurm.conf), if it names one."""
    text = _slurm_conf_text(conf)
    m = re.search(r"^\s*AuthInfo\s*=.*?\bsocket=([^,\s]+)", text or "", re.M | re.I)
    return m.group(1) if m else None


def job_privacy(conf: str | None = None) -> tuple[bool, frozenset[int]]:
    """(jobs are private, admin uids) from slurm.conf: PrivateData=jobs (or all) hides a job from
    everyone but its owner and the admins: root and SlurmUser. An unreadable slurm.conf: private."""
    text = _slurm_conf_text(conf)
    admins = {0}
    if text is None:
        return True, frozenset(admins)
    m = re.search(r"^\s*SlurmUser\s*=\s*(\S+)", text, re.M | re.I)
    if m:
        try:
            admins.add(int(m.group(1)) if m.group(1).isdigit() else pwd.getpwnam(m.group(1)).pw_uid)
        except KeyError:
            pass
    flags: set[str] = set()
    for pm in re.finditer(r"^\s*PrivateData\s*=\s*(\S+)", text, re.M | re.I):
        flags |= {f.strip().lower() for f in pm.group(1).split(",")}
    return bool(flags & {"jobs", "all"}), frozenset(admins)


def task_plugins(conf: str | None = None) -> tuple[str, ...] | None:
    """slurm.conf's TaskPlugin list (e.g. ("task/cgroup", "task/affinity")); None when slurm.conf
    cannot be read, () when it sets none."""
    text = _slurm_conf_text(conf)
    if text is None:
        return None
    m = re.search(r"^\s*TaskPlugin\s*=\s*(\S+)", text, re.M | re.I)
    return tuple(p.strip() for p in m.group(1).split(",") if p.strip()) if m else ()
