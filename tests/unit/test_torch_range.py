"""The torch versions the rank runtime patches (torchpass/runtime/torch_range.py): the range
pyproject's runtime extra names, and what a site may add."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from torchpass import envnames
from torchpass.runtime import torch_range
from torchpass.runtime.torch_range import Support, judge, minor_of

ROOT = Path(__file__).resolve().parents[2]


def test_the_runtime_extra_takes_exactly_the_tested_minor_versions():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["runtime"]
    (spec,) = [d for d in deps if d.startswith("torch")]
    lows = [(a, b) for a, b in torch_range.TESTED]
    lo, hi = min(lows), max(lows)
    assert spec == f"torch>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}"
    assert sorted(lows) == [(lo[0], m) for m in range(lo[1], hi[1] + 1)], "the range has a gap"


@pytest.mark.parametrize("version, minor", [("2.13.0", (2, 13)), ("2.13.1+cpu", (2, 13)), ("2.11.0a0+git1234", (2, 11)),
                                            ("2.14.0.dev20261201", (2, 14)), ("junk", None), ("2", None)])
def test_minor_of(version, minor):
    assert minor_of(version) == minor


def test_a_tested_torch_is_patched_without_a_word():
    v = judge("2.13.0+cpu", {})
    assert v.support is Support.TESTED and v.patch and v.why == ""


def test_another_torch_is_not_patched_and_says_why():
    v = judge("2.11.0", {})
    assert v.support is Support.UNTESTED and not v.patch
    assert v.why == "torch 2.11.0 is outside the tested range (2.13); the runtime patches nothing"
    assert not judge("nightly", {}).patch


def test_a_site_may_allow_the_minor_versions_it_tested():
    env = {envnames.ALLOW_TORCH: "2.11, 2.12"}
    v = judge("2.11.0", env)
    assert v.support is Support.SITE_ALLOWED and v.patch
    assert v.why == "torch 2.11.0 is outside the tested range (2.13); patched because TORCHPASS_ALLOW_TORCH=2.11, 2.12"
    other = judge("2.10.1", {envnames.ALLOW_TORCH: "2.11,2.x"})
    assert not other.patch
    assert "TORCHPASS_ALLOW_TORCH='2.11,2.x' does not name 2.10; not a version: 2.x" in other.why
