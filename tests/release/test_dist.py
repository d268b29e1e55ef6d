"""What `make dist` writes: an sdist that carries everything a site builds and tests from, and a
wheel that carries what a node needs beside the code, with SPDX license metadata."""

from __future__ import annotations

import subprocess
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import torchpass

REPO = Path(__file__).resolve().parents[2]


def _one(dist_dir: Path, pattern: str) -> Path:
    found = sorted(dist_dir.glob(pattern))
    assert len(found) == 1, (pattern, found)
    return found[0]


def tracked(prefix: str) -> set[str]:
    """The checkout's files under ``prefix`` that git tracks."""
    out = subprocess.run(["git", "-C", str(REPO), "ls-files", prefix], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_the_sdist_carries_the_plugin_sources_contrib_docs_tests_and_the_license(dist_dir):
    sdist = _one(dist_dir, f"torchpass-{torchpass.__version__}.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for prefix in ("slurm_spank/", "contrib/", "docs/", "tests/"):
        missing = sorted(p for p in tracked(prefix) if p not in names)
        assert not missing, f"the sdist lacks {missing[:10]}"
    assert {"LICENSE", "pyproject.toml", "Makefile", "setup.py"} <= names
    built = [n for n in names if n.endswith((".o", ".so", ".pyc")) or n in ("slurm_spank/tpass-init",)]
    assert not built, f"build outputs in the sdist: {built[:10]}"


def test_the_wheel_carries_the_boot_file_the_default_policy_and_contrib(dist_dir):
    wheel = _one(dist_dir, f"torchpass-{torchpass.__version__}-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta = Parser().parsestr(zf.read(f"torchpass-{torchpass.__version__}.dist-info/METADATA").decode())
    assert "torchpass/runtime/boot/sitecustomize.py" in names
    assert "tpassd/policy_default.toml" in names
    contrib = {"torchpass/" + p for p in tracked("contrib/")}
    assert contrib and contrib <= names, sorted(contrib - names)
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert f"torchpass-{torchpass.__version__}.dist-info/licenses/LICENSE" in names
    assert not any(n.startswith(("tests/", "slurm_spank/")) for n in names)
