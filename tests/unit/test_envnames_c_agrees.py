"""The TORCHPASS_* environment variable names are defined once per language: torchpass.envnames
for Python, slurm_spank/envnames.h for C. The two agree, every name the plugin uses is in both,
and no other source file spells a name itself (a renamed variable would otherwise keep working
on one side and silently stop on the other)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from torchpass import envnames

ROOT = Path(__file__).resolve().parents[2]
SPANK_DIR = ROOT / "slurm_spank"
DEFINE = re.compile(r'^#define\s+TPASS_ENV_([A-Z0-9_]+)\s+"([^"\\]*)"\s*$', re.M)
NAME = re.compile(r"TORCHPASS_[A-Z0-9_]*")

# Python files that still spell names themselves, each with the reason it may.
PYTHON_SPELLS = {
    # runs first in every Python process of a task and imports torchpass only when these say so
    "torchpass/runtime/boot/sitecustomize.py",
}


def c_names() -> dict[str, str]:
    return dict(DEFINE.findall((SPANK_DIR / "envnames.h").read_text()))


def c_string_literals(c_source: str) -> list[str]:
    no_comments = re.sub(r"/\*.*?\*/|//[^\n]*", " ", c_source, flags=re.S)
    return re.findall(r'"((?:[^"\\\n]|\\.)*)"', no_comments)


def python_names_spelled(source: str) -> list[str]:
    """String constants of a Python file that are, or start with, a TORCHPASS_ name (code, not
    docstrings: a docstring may name a variable)."""
    tree = ast.parse(source)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
            and NAME.match(n.value) and (NAME.fullmatch(n.value) or n.value.startswith(envnames.PREFIX)
                                          and "=" in n.value and " " not in n.value.split("=", 1)[0])]


def test_every_c_name_equals_the_python_one():
    names = c_names()
    assert len(names) >= 15, names
    for name, value in names.items():
        assert hasattr(envnames, name), f"envnames.h defines TPASS_ENV_{name} but torchpass.envnames has no {name}"
        assert getattr(envnames, name) == value, (
            f"TPASS_ENV_{name} is {value!r} in envnames.h but torchpass.envnames.{name} is {getattr(envnames, name)!r}")


def test_every_name_the_plugin_uses_is_defined_in_c():
    defined = set(c_names().values())
    missing = sorted(envnames.PLUGIN_NAMES - defined)
    assert missing == [], f"torchpass.envnames.PLUGIN_NAMES lists names envnames.h does not define: {missing}"
    extra = sorted(defined - envnames.PLUGIN_NAMES)
    assert extra == [], f"envnames.h defines names torchpass.envnames.PLUGIN_NAMES does not list: {extra}"


def test_every_python_name_is_a_torchpass_name_and_unique():
    values = [v for k, v in vars(envnames).items() if k.isupper() and isinstance(v, str) and k != "PREFIX"]
    assert all(v.startswith(envnames.PREFIX) for v in values)
    assert len(values) == len(set(values)), "two envnames constants hold the same name"
    assert set(values) == envnames.ALL


def test_no_c_file_spells_a_name():
    offenders = [f"{src.name}: \"{lit}\"" for src in sorted(SPANK_DIR.glob("*.[ch]")) if src.name != "envnames.h"
                 for lit in c_string_literals(src.read_text()) if "TORCHPASS_" in lit]
    assert offenders == [], f"use the TPASS_ENV_* names of envnames.h instead: {offenders}"


def test_no_python_file_spells_a_name():
    offenders = []
    for top in ("torchpass", "tpassd", "tpassctl"):
        for src in sorted((ROOT / top).rglob("*.py")):
            rel = src.relative_to(ROOT).as_posix()
            if rel == "torchpass/envnames.py" or rel in PYTHON_SPELLS:
                continue
            offenders += [f"{rel}: {v!r}" for v in python_names_spelled(src.read_text())]
    assert offenders == [], f"use torchpass.envnames instead: {offenders}"


def test_the_checks_see_a_spelled_name():
    """The scans find a name in code and skip comments and docstrings."""
    assert c_string_literals('/* "TORCHPASS_X" */ getenv("TORCHPASS_JOB_ID");') == ["TORCHPASS_JOB_ID"]
    src = '"""TORCHPASS_DOC is documented."""\nx = env.get("TORCHPASS_JOB_ID")  # "TORCHPASS_C"\ny = "TORCHPASS_A=1"\n'
    assert sorted(python_names_spelled(src)) == ["TORCHPASS_A=1", "TORCHPASS_JOB_ID"]
