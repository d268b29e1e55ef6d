"""The job Python: the interpreter that devcluster jobs (training, the rank
wrapper, the coordinator) run as ordinary users.

Root's own Python may live where other users cannot read it (pyenv under a
0700 /root), and so may the checkout (a CI clone under /root). Job users get a
virtualenv made from the system Python at a fixed readable place
(``/opt/torchpass-dev/jobvenv``), with torch from the same wheels as the
developer venv, and torchpass installed editable from a read-only *copy* of
this checkout's packages (``<venv>/src``). Refreshing that copy only copies the
files that changed (about 0.1 s), so ``make`` and every devcluster bring-up
keep jobs on this checkout's code; pip runs again only when pyproject.toml
changes (new console scripts or dependencies). A non-editable reinstall would
cost a wheel build (several seconds) on every source change instead.

``python -m torchpass.devcluster.jobpython [--venv DIR] [--find-links DIR]``
creates or refreshes it (``make jobvenv``).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torchpass
from torchpass import envnames
from torchpass.errors import DevclusterError

DEFAULT_JOB_VENV = Path("/opt/torchpass-dev/jobvenv")
SYSTEM_PYTHON = "/usr/bin/python3"
# What is copied: the three packages (job scripts copy the examples they run themselves).
_PACKAGES = ("torchpass", "tpassd", "tpassctl")
_SKIP = {"__pycache__", ".pytest_cache"}
_HINT = "run 'make jobvenv' as root (a venv from /usr/bin/python3 that every job user can read)"


def job_venv() -> Path:
    """The job venv: TORCHPASS_JOB_VENV (a second checkout keeps its own), else the default."""
    return Path(os.environ.get(envnames.JOB_VENV) or DEFAULT_JOB_VENV)


def checkout_root() -> Path | None:
    """The checkout this torchpass was imported from, or None for an installed copy."""
    root = Path(torchpass.__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() and (root / "slurm_spank").is_dir() else None


def _copy_tree(src: Path, dst: Path) -> int:
    """Make ``dst`` a world-readable copy of ``src``; copy only what changed. Returns files copied."""
    changed = 0
    dst.mkdir(mode=0o755, parents=True, exist_ok=True)
    os.chmod(dst, 0o755)
    wanted = set()
    for entry in os.scandir(src):
        if entry.name in _SKIP or entry.name.endswith((".pyc", ".egg-info")):
            continue
        wanted.add(entry.name)
        target = dst / entry.name
        if entry.is_dir(follow_symlinks=False):
            if target.is_symlink() or (target.exists() and not target.is_dir()):
                target.unlink()
            changed += _copy_tree(Path(entry.path), target)
        elif entry.is_file(follow_symlinks=False):
            st = entry.stat()
            try:
                tst = target.stat(follow_symlinks=False)
                same = tst.st_size == st.st_size and tst.st_mtime_ns == st.st_mtime_ns  # copy2 keeps it
            except FileNotFoundError:
                same = False
            if not same:
                tmp = dst / f".{entry.name}.tmp"
                shutil.copy2(entry.path, tmp)
                os.chmod(tmp, 0o755 if st.st_mode & 0o111 else 0o644)
                os.replace(tmp, target)
                changed += 1
    for entry in os.scandir(dst):
        if entry.name not in wanted:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
            changed += 1
    return changed


def sync_sources(repo: Path, venv: Path) -> int:
    """Copy the checkout's packages into ``venv/src``; the number of files that changed."""
    src = venv / "src"
    src.mkdir(mode=0o755, parents=True, exist_ok=True)
    os.chmod(src, 0o755)
    changed = 0
    for name in _PACKAGES:
        changed += _copy_tree(repo / name, src / name)
    # pyproject.toml's license-files names LICENSE: the editable install fails without it.
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if not (src / name).exists() or (repo / name).read_bytes() != (src / name).read_bytes():
            shutil.copyfile(repo / name, src / name)
            os.chmod(src / name, 0o644)
            changed += 1
    return changed


def _pip(venv: Path, args: list[str]) -> None:
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                           "--disable-pip-version-check", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        err = " ".join((proc.stderr or proc.stdout).split())[-400:]
        raise DevclusterError(f"pip install {' '.join(args)} into {venv} failed: {err}; check the package sources")


def ensure(venv: Path | None = None, *, find_links: str | None = None, repo: Path | None = None,
           create: bool = True) -> Path:
    """Create (if ``create``) or refresh the job venv from ``repo``; returns its python.

    Idempotent and fast when present: the sources are copied when they changed,
    pip runs only when the venv is new or pyproject.toml changed."""
    venv = Path(venv or job_venv())
    repo = repo or checkout_root()
    python = venv / "bin" / "python"
    old_umask = os.umask(0o022)  # everything here must be readable by job users
    try:
        venv.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        with open(venv.parent / f".{venv.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not python.exists():
                if not create:
                    raise DevclusterError(f"the job Python {python} does not exist; {_HINT}")
                if not Path(SYSTEM_PYTHON).exists():
                    raise DevclusterError(f"{SYSTEM_PYTHON} is missing; install python3 and python3-venv "
                                          "(scripts/install-system-deps.sh)")
                proc = subprocess.run([SYSTEM_PYTHON, "-m", "venv", str(venv)], capture_output=True, text=True)
                if proc.returncode != 0:
                    raise DevclusterError(f"{SYSTEM_PYTHON} -m venv {venv} failed: {proc.stderr.strip()[-300:]}; "
                                          "install python3-venv (scripts/install-system-deps.sh)")
            if repo is None or repo.resolve() == (venv / "src").resolve():
                return python  # an installed torchpass: nothing to refresh from
            sync_sources(repo, venv)
            stamp = venv / ".torchpass-pyproject"
            pyproject = (venv / "src" / "pyproject.toml").read_bytes()
            if not stamp.exists() or stamp.read_bytes() != pyproject:
                links = ["--find-links", find_links] if find_links else []
                # setuptools>=77 (pyproject's build requirement) once, then no build isolation:
                # a reinstall then needs no download.
                _pip(venv, [*links, "setuptools>=77", "wheel"])
                _pip(venv, [*links, "--no-build-isolation", "-e", f"{venv / 'src'}[runtime]"])
                stamp.write_bytes(pyproject)
            return python
    finally:
        os.umask(old_umask)


def check_usable(python: Path, users: list[str]) -> Path:
    """Every job user can run ``python`` and import torchpass and torch from it, or
    one line says what to run. Returns the torchpass.runtime directory it imports."""
    if not Path(python).exists():
        raise DevclusterError(f"the job Python {python} does not exist; {_HINT}")
    probe = ("import importlib.util, os, torchpass.runtime.hook; "
             "assert importlib.util.find_spec('torch'), 'torch is not installed'; "
             "print(os.path.dirname(torchpass.runtime.__file__))")
    runtime = None
    for user in users:
        proc = subprocess.run(["runuser", "-u", user, "--", str(python), "-c", probe],
                              capture_output=True, text=True, cwd="/", timeout=60)
        if proc.returncode != 0:
            err = (proc.stderr.strip().splitlines() or ["exit status %d" % proc.returncode])[-1]
            raise DevclusterError(f"job user {user} cannot use the job Python {python} ({err}); {_HINT}")
        runtime = Path(proc.stdout.strip().splitlines()[-1])
    if runtime is None:  # no job users: root runs it
        proc = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, cwd="/", timeout=60)
        if proc.returncode != 0:
            raise DevclusterError(f"the job Python {python} cannot import torchpass and torch; {_HINT}")
        runtime = Path(proc.stdout.strip().splitlines()[-1])
    return runtime


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m torchpass.devcluster.jobpython", description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, default=None,
                    help=f"where (default $TORCHPASS_JOB_VENV or {DEFAULT_JOB_VENV})")
    ap.add_argument("--find-links", default=None, help="a wheel directory for pip (e.g. /opt/wheels)")
    args = ap.parse_args(argv)
    try:
        python = ensure(args.venv, find_links=args.find_links)
    except DevclusterError as exc:
        print(f"jobvenv: {exc}", file=sys.stderr)
        return 1
    print(f"jobvenv: {python} ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
