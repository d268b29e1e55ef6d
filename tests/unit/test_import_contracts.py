"""Which package may import which (pyproject.toml [tool.importlinter],
docs/architecture.md "Module map"):

- torchpass is the shared library: it never imports tpassd or tpassctl;
- tpassd and tpassctl are independent programs, and neither loads torch;
- the coordinator's decision core loads no zmq and no structlog;
- programs that run as the job's user (the rank runtime, the coordinator, the
  rank wrapper, tpassctl's user commands) never import, even indirectly, code
  that runs as root (tpassd, the restore agent, the checkpoint service, the
  cgroup join), so the modules whose code runs as root are a closed set to
  audit. Two imports are excepted, each named in pyproject.toml with what
  removes it; the tests below keep the exceptions that narrow.

import-linter sees ``import`` statements only. Module names written as
strings (``-m package.module`` on a command line, ``"package.module:func"``
entry points, the sitecustomize directory put on PYTHONPATH) are checked by
the scanner below: each must name a module that exists, and follow the same
direction (code in torchpass/ may not start a tpassd module by name).
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("torchpass", "tpassd", "tpassctl")
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
# What each package's own files may name; files elsewhere (tests, C plugin,
# contrib, scripts) may name any package.
ALLOWED = {"torchpass": {"torchpass"}, "tpassd": {"torchpass", "tpassd"}, "tpassctl": {"torchpass", "tpassctl"}}

_PKG = "(?:" + "|".join(PACKAGES) + ")"
_MOD = rf"({_PKG}(?:\.\w+)*)"
# `-m pkg.mod` in a shell line, or "-m", "pkg.mod" in a Python/C argv.
RUN_MODULE = re.compile(rf"""-m(?:\s+|["']\s*,\s*["']){_MOD}\b""")
# "pkg.mod:func" (console-script entry points)
ENTRY_POINT = re.compile(rf"""["']{_MOD}:(\w+)["']""")
# a constant naming a module to run: RANKWRAP_MODULE = "pkg.mod"
MODULE_CONSTANT = re.compile(rf"""\b\w*MODULE\w*\s*=\s*["']{_MOD}["']""")
# a package directory in a path: site-packages/torchpass/runtime/boot, or a
# Python path join from the repository: REPO_ROOT / "torchpass" / "runtime" / "boot"
PATH_IN_TEXT = re.compile(rf"(?:^|[\s=\"'(]|site-packages/)({_PKG}(?:/\w+)+)")
PATH_JOIN = re.compile(rf"""(?:REPO\w*|parents\[\d+\]|parent)\s*/\s*["']({_PKG})["']((?:\s*/\s*["']\w+["'])+)""")
# Paths that only share the project's name (config, state and doc locations).
NOT_PACKAGE_PATH = re.compile(r"(/etc|/var/lib|/run|/usr/share/doc|/var/log)/$")

SCANNED_SUFFIXES = {".py", ".c", ".h", ".sh", ".service", ".conf", ".toml", ".in"}


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(cwd), "HOME": str(cwd)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def scanned_files(root: Path) -> list[Path]:
    """Python, C, shell, systemd, plugstack, TOML and Makefiles (not docs, not the venv)."""
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if not p.is_file() or any(part.startswith(".") and part != ".ci" for part in rel.parts) \
                or "__pycache__" in rel.parts or rel.parts[0] in ("build", "docs"):
            continue
        if p.suffix in SCANNED_SUFFIXES or p.name == "Makefile" or (rel.parts[0] == ".ci" and not p.suffix):
            out.append(p)
    return out


def _module_file(root: Path, module: str, runnable: bool) -> Path | None:
    base = root.joinpath(*module.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    init = base / ("__main__.py" if runnable else "__init__.py")
    return init if init.is_file() else None


def _defines(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            return True
    return False


def string_references(root: Path) -> list[tuple[str, int, str, str]]:
    """(file, line, kind, target) for every package module or directory named in a string."""
    refs = []
    for path in scanned_files(root):
        rel = str(path.relative_to(root))
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        # `-m` and its module may sit on two lines of an argv list
        for m in RUN_MODULE.finditer(text):
            refs.append((rel, text.count("\n", 0, m.start(1)) + 1, "-m", m.group(1)))
        for lineno, line in enumerate(text.splitlines(), 1):
            for m in MODULE_CONSTANT.finditer(line):
                refs.append((rel, lineno, "-m", m.group(1)))
            for m in ENTRY_POINT.finditer(line):
                refs.append((rel, lineno, "entry point", f"{m.group(1)}:{m.group(2)}"))
            for m in PATH_JOIN.finditer(line):
                parts = [m.group(1)] + re.findall(r"""["'](\w+)["']""", m.group(2))
                refs.append((rel, lineno, "path", "/".join(parts)))
            if path.suffix != ".py":  # Python's path strings are prose (docstrings, comments)
                for m in PATH_IN_TEXT.finditer(line):
                    if not NOT_PACKAGE_PATH.search(line[:m.start(1)]):
                        refs.append((rel, lineno, "path", m.group(1).rstrip("/")))
    return refs


def problems(root: Path, refs: list[tuple[str, int, str, str]]) -> list[str]:
    out = []
    for rel, lineno, kind, target in refs:
        where = f"{rel}:{lineno}: {kind} {target}"
        if kind == "-m":
            if _module_file(root, target, runnable=True) is None:
                out.append(f"{where}: no such runnable module")
        elif kind == "entry point":
            module, func = target.split(":")
            f = _module_file(root, module, runnable=False)
            if f is None or not _defines(f, func):
                out.append(f"{where}: no such module or function")
        elif not (root / target).exists() and not (root / f"{target}.py").exists():
            out.append(f"{where}: no such file or directory in the tree")
        owner = Path(rel).parts[0]
        named = re.split(r"[./:]", target)[0]
        if owner in ALLOWED and named not in ALLOWED[owner]:
            out.append(f"{where}: {owner} may not name {named} (allowed: {', '.join(sorted(ALLOWED[owner]))})")
    return out


def _copy_tree(dst: Path) -> Path:
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", dst / "pyproject.toml")
    return dst


def test_the_tree_keeps_the_import_contracts():
    proc = lint_imports(REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout and "5 kept" in proc.stdout, proc.stdout


@pytest.mark.parametrize("importer, imported", [
    ("torchpass", "tpassd.config"),  # the library reaching into the daemon
    ("torchpass", "tpassctl.cli"),
    ("tpassctl", "tpassd.drills"),  # one program importing the other
    ("tpassd", "tpassctl.cli"),
])
def test_a_reverse_import_breaks_the_contracts(tmp_path, importer, imported):
    tree = _copy_tree(tmp_path)
    (tree / importer / "reverse_probe.py").write_text(f"import {imported}  # deliberately wrong\n")
    proc = lint_imports(tree)
    assert proc.returncode != 0, proc.stdout
    # The copy is what was checked: the probe exists only there.
    assert f"{importer}.reverse_probe -> {imported}" in proc.stdout, proc.stdout


def test_the_decision_core_may_not_reach_zmq_even_indirectly(tmp_path):
    tree = _copy_tree(tmp_path)
    decide = tree / "torchpass" / "coordinator" / "decide.py"
    decide.write_text(decide.read_text() + "\nimport torchpass.zmqio  # deliberately wrong\n")
    proc = lint_imports(tree)
    assert proc.returncode != 0, proc.stdout
    assert "torchpass.coordinator.decide is not allowed to import zmq" in proc.stdout, proc.stdout
    assert "torchpass.coordinator.decide -> torchpass.zmqio" in proc.stdout, proc.stdout


@pytest.mark.parametrize("importer, imported", [
    ("torchpass/runtime/control.py", "torchpass.checkpoint.restore_agent"),  # the rank, directly
    ("torchpass/coordinator/executor.py", "torchpass.checkpoint.service"),  # the coordinator
    ("torchpass/checkpoint/restore_gate.py", "torchpass.checkpoint.cgroup_join"),
    ("tpassctl/status_cmd.py", "torchpass.checkpoint.restore_agent"),  # a user's tpassctl command
    # a part of tpassd's checkpoint service (tpassctl reads the manifests those records copy)
    ("tpassctl/snapshot_cmd.py", "torchpass.checkpoint.snapshot_records"),
])
def test_a_user_program_importing_root_code_breaks_the_contract(tmp_path, importer, imported):
    tree = _copy_tree(tmp_path)
    f = tree / importer
    f.write_text(f.read_text() + f"\nimport {imported}  # deliberately wrong\n")
    proc = lint_imports(tree)
    assert proc.returncode != 0, proc.stdout
    module = importer.removesuffix(".py").replace("/", ".")
    assert "programs that run as the job's user never import code that runs as root BROKEN" in proc.stdout, \
        proc.stdout
    assert f"{module} -> {imported}" in proc.stdout, proc.stdout


def test_the_rank_may_not_reach_root_code_through_a_shared_module(tmp_path):
    # Indirectly: the rank runtime imports a library module that imports the restore agent.
    tree = _copy_tree(tmp_path)
    (tree / "torchpass" / "bridge_probe.py").write_text("import torchpass.checkpoint.restore_agent\n")
    pg = tree / "torchpass" / "runtime" / "say.py"
    pg.write_text(pg.read_text() + "\nimport torchpass.bridge_probe  # deliberately wrong\n")
    proc = lint_imports(tree)
    assert proc.returncode != 0, proc.stdout
    assert "torchpass.runtime.say -> torchpass.bridge_probe" in proc.stdout, proc.stdout


def _imports_of(path: Path, module: str) -> list[str]:
    """The functions (or "<module>") of ``path`` that import ``module`` (either import form)."""
    tree = ast.parse(path.read_text())
    where: list[str] = []

    def visit(node, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else scope
            if isinstance(child, ast.Import) and any(a.name == module for a in child.names):
                where.append(scope)
            elif isinstance(child, ast.ImportFrom) and child.module is not None and (
                    child.module == module or any(f"{child.module}.{a.name}" == module for a in child.names)):
                where.append(scope)
            visit(child, inner)

    visit(tree, "<module>")
    return where


def test_the_root_only_contract_has_no_exceptions():
    import tomllib

    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (root_only,) = [c for c in contracts if c["id"] == "root-only"]
    assert root_only.get("ignore_imports", []) == []
    # The restore agent is a program of its own (tpass-restore-agent): the rank wrapper names the
    # agent's files from the layout and never imports it.
    rankwrap = REPO / "torchpass" / "checkpoint" / "rankwrap.py"
    assert _imports_of(rankwrap, "torchpass.checkpoint.restore_agent") == []
    # The job-manifest format has a module of its own, which tpassctl and the rank wrapper read.
    for user_side in (REPO / "tpassctl" / "snapshot_cmd.py", rankwrap):
        assert _imports_of(user_side, "torchpass.checkpoint.service") == []
    assert _imports_of(REPO / "tpassctl" / "snapshot_cmd.py", "torchpass.checkpoint.job_manifest") == ["<module>"]


def test_module_names_written_as_strings_exist_and_point_the_right_way():
    refs = string_references(REPO)
    found = {(kind, target) for _, _, kind, target in refs}
    # The scanner sees the ones that matter (if it stops seeing them, it is broken).
    assert ("entry point", "torchpass.checkpoint.rankwrap:main") in found
    assert ("entry point", "tpassd.main:main") in found
    assert ("path", "torchpass/runtime/boot") in found
    assert any(kind == "-m" for kind, _ in found), sorted(found)
    assert problems(REPO, refs) == []


def test_the_string_scanner_catches_a_wrong_name_and_a_reverse_start(tmp_path):
    tree = _copy_tree(tmp_path)
    m = "-" + "m"  # not spelled out, so this file is not itself a hit
    (tree / "torchpass" / "starts_daemon.py").write_text(
        f'ARGV = ["python3", "{m}", "tpassd.main"]\nGONE = ["python3", "{m}", "torchpass.no_such_module"]\n')
    (tree / "torchpass" / "names_daemon.py").write_text('DAEMON_MODULE = "tpassd.main"\n')
    (tree / "Makefile").write_text(f"run:\n\tpython3 {m} tpassctl.cli\n")
    (tree / "x.conf").write_text("runtime_path=/usr/lib/python3/site-packages/torchpass/runtime/no_boot\n")
    out = problems(tree, string_references(tree))
    assert any("torchpass/starts_daemon.py:1" in p and "may not name tpassd" in p for p in out), out
    assert any("torchpass/starts_daemon.py:2" in p and "no such runnable module" in p for p in out), out
    assert any("torchpass/names_daemon.py:1" in p and "may not name tpassd" in p for p in out), out
    assert any("x.conf:1" in p and "no such file" in p for p in out), out
    # python3 -m tpassctl.cli names a real module from outside the packages: allowed.
    assert not any(p.startswith("Makefile") for p in out), out


def test_the_module_map_in_docs_matches_the_tree():
    """docs/architecture.md "Module map" names every module and package of the
    three packages, and nothing that is not there."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    section = doc.split("\n## Module map", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(rf"`({_PKG}(?:/[\w.]+)*/?)`", section))
    tree = set()
    for pkg in PACKAGES:
        for f in (REPO / pkg).rglob("*.py"):
            rel = f.relative_to(REPO)
            tree.add(f"{rel.parent}/" if f.name == "__init__.py" else str(rel))
    assert sorted(tree - named) == [], "modules missing from the module map"
    assert sorted(n for n in named if not (REPO / n).exists()) == [], "the module map names what is not there"
