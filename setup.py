"""The one thing pyproject.toml cannot say: the wheel carries contrib/ as package data.

contrib/ (the systemd units, the plugstack.conf and tpassd.toml templates, the Epilog helper) sits
at the top of the source tree, where a checkout's admin finds it beside slurm_spank/. An admin who
installs the wheel file gets the same files in torchpass/contrib/ of the installed package
(docs/admin.md, "1. The Python package").
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CONTRIB = Path(__file__).resolve().parent / "contrib"


class BuildPyWithContrib(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads contrib/ from the checkout itself
        if not CONTRIB.is_dir():
            raise SystemExit(f"setup.py: {CONTRIB} is missing; build from a checkout or the sdist")
        target = Path(self.build_lib) / "torchpass" / "contrib"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(CONTRIB, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": BuildPyWithContrib})
