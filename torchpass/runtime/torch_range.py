"""Which torch the rank runtime patches: the minor versions CI runs.

The runtime replaces torch internals (``init_process_group``, the c10d backend registry, the
group bookkeeping of ``distributed_c10d``, torchrun's store client), which change between torch
minor releases. So it patches only a torch whose ``major.minor`` CI runs (``TESTED``, the same
range as pyproject's ``runtime`` extra; tests/unit/test_torch_range.py checks they agree).
Any other torch: nothing is patched, the rank says so in one line, trains as without torchpass,
and its coordinator records ``job.unprotected`` with the reason.

A site that tested another minor version itself names it in ``$TORCHPASS_ALLOW_TORCH``
(``2.11`` or ``2.11,2.12``, set for the job's tasks): the runtime then patches it, says so in
one line, and the coordinator records it (``tpassctl status``, ``torch_override``).
Importing this loads nothing (no torch).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass

from torchpass import envnames

# The torch minor versions CI runs (pyproject: runtime = ["torch>=2.13,<2.14", ...]).
TESTED: tuple[tuple[int, int], ...] = ((2, 13),)
_VERSION = re.compile(r"(\d+)\.(\d+)(?:[.+a-z].*)?")


class Support(enum.Enum):
    TESTED = "tested"  # a minor version CI runs: patched
    SITE_ALLOWED = "site_allowed"  # outside the range, named in $TORCHPASS_ALLOW_TORCH: patched
    UNTESTED = "untested"  # outside the range: nothing patched, the job unprotected
    UNKNOWN = "unknown"  # a version string that names no major.minor: nothing patched


@dataclass(frozen=True)
class Verdict:
    support: Support
    version: str
    why: str  # the rank's one line (without "torchpass: "); "" for a tested torch

    @property
    def patch(self) -> bool:
        return self.support in (Support.TESTED, Support.SITE_ALLOWED)


def tested_text() -> str:
    return ", ".join(f"{a}.{b}" for a, b in TESTED)


def minor_of(version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version string ("2.13.0+cpu", "2.11.0a0+git..."), or None."""
    m = _VERSION.fullmatch(version.strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_allowed(value: str) -> tuple[set[tuple[int, int]], list[str]]:
    """The minor versions ``$TORCHPASS_ALLOW_TORCH`` names, and the items that name none."""
    allowed, bad = set(), []
    for item in (x.strip() for x in value.split(",")):
        if not item:
            continue
        m = re.fullmatch(r"(\d+)\.(\d+)", item)
        if m:
            allowed.add((int(m.group(1)), int(m.group(2))))
        else:
            bad.append(item)
    return allowed, bad


def judge(version: str, env: Mapping[str, str]) -> Verdict:
    """What the runtime does with torch ``version`` under ``env``'s site override."""
    minor = minor_of(version)
    if minor is None:
        return Verdict(Support.UNKNOWN, version, f"torch {version!r} names no version the runtime was tested "
                                                 f"with ({tested_text()}); it patches nothing")
    if minor in TESTED:
        return Verdict(Support.TESTED, version, "")
    value = env.get(envnames.ALLOW_TORCH, "")
    allowed, bad = parse_allowed(value)
    if minor in allowed:
        return Verdict(Support.SITE_ALLOWED, version,
                       f"torch {version} is outside the tested range ({tested_text()}); patched because "
                       f"{envnames.ALLOW_TORCH}={value}")
    also = ""
    if value:
        junk = f"; not a version: {', '.join(bad)}" if bad else ""
        also = f" ({envnames.ALLOW_TORCH}={value!r} does not name {minor[0]}.{minor[1]}{junk})"
    return Verdict(Support.UNTESTED, version,
                   f"torch {version} is outside the tested range ({tested_text()}){also}; the runtime patches "
                   f"nothing")


def of_loaded_torch(env: Mapping[str, str]) -> Verdict:
    """The verdict for the torch this process loaded (``$TORCHPASS_TEST_TORCH_VERSION`` stands in
    for its version in tests: one torch is installed where they run)."""
    import torch

    version = env.get(envnames.TEST_TORCH_VERSION) or str(torch.__version__)
    return judge(version, env)
