"""The job Python's source copy (torchpass/devcluster/jobpython.py): world-readable,
refreshed file by file, and a missing venv named with what to run."""

from __future__ import annotations

import os
import stat

import pytest

from torchpass.devcluster import jobpython
from torchpass.errors import DevclusterError


def _repo(root):
    for pkg in ("torchpass", "tpassd", "tpassctl"):
        (root / pkg / "sub").mkdir(parents=True)
        (root / pkg / "__init__.py").write_text(f"# {pkg}\n")
        (root / pkg / "sub" / "mod.py").write_text("x = 1\n")
        (root / pkg / "__pycache__").mkdir()
        (root / pkg / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\0")
    (root / "tpassd" / "run.sh").write_text("#!/bin/sh\n")
    (root / "tpassd" / "run.sh").chmod(0o700)
    (root / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (root / "README.md").write_text("readme\n")
    (root / "LICENSE").write_text("license\n")
    return root


def test_sync_copies_readable_files_then_only_what_changed(tmp_path):
    old = os.umask(0o077)  # a root with a strict umask still makes files every user reads
    try:
        repo, venv = _repo(tmp_path / "repo"), tmp_path / "venv"
        first = jobpython.sync_sources(repo, venv)
        src = venv / "src"
        assert first == 3 * 2 + 1 + 3  # two modules per package, run.sh, pyproject, README and LICENSE
        assert (src / "LICENSE").read_text() == "license\n"  # pyproject's license-files names it
        assert (src / "torchpass" / "sub" / "mod.py").read_text() == "x = 1\n"
        assert not (src / "torchpass" / "__pycache__").exists()
        assert stat.S_IMODE((src / "torchpass" / "sub" / "mod.py").stat().st_mode) == 0o644
        assert stat.S_IMODE((src / "tpassd" / "run.sh").stat().st_mode) == 0o755
        assert stat.S_IMODE((src / "torchpass" / "sub").stat().st_mode) == 0o755
        assert stat.S_IMODE(src.stat().st_mode) == 0o755

        assert jobpython.sync_sources(repo, venv) == 0  # nothing changed: nothing copied

        (repo / "torchpass" / "sub" / "mod.py").write_text("x = 22\n")
        (repo / "torchpass" / "new.py").write_text("y = 2\n")
        (repo / "tpassd" / "sub" / "mod.py").unlink()
        assert jobpython.sync_sources(repo, venv) == 3
        assert (src / "torchpass" / "sub" / "mod.py").read_text() == "x = 22\n"
        assert (src / "torchpass" / "new.py").exists()
        assert not (src / "tpassd" / "sub" / "mod.py").exists()
    finally:
        os.umask(old)


def test_a_missing_job_venv_says_what_to_run(tmp_path):
    with pytest.raises(DevclusterError, match=r"does not exist; run 'make jobvenv' as root") as exc:
        jobpython.ensure(tmp_path / "jobvenv", create=False, repo=_repo(tmp_path / "repo"))
    assert "\n" not in str(exc.value)
    with pytest.raises(DevclusterError, match="make jobvenv"):
        jobpython.check_usable(tmp_path / "jobvenv" / "bin" / "python", ["nobody"])


def test_the_job_venv_location_can_be_moved_per_checkout(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHPASS_JOB_VENV", raising=False)
    assert jobpython.job_venv() == jobpython.DEFAULT_JOB_VENV
    monkeypatch.setenv("TORCHPASS_JOB_VENV", str(tmp_path / "v2"))
    assert jobpython.job_venv() == tmp_path / "v2"
