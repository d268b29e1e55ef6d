"""pytest (rootdir-based, no packages) imports every test module by its basename: two files of
the same name under tests/unit and tests/integration make the whole run fail at collection
("import file mismatch"), which a run of one directory alone never shows."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def duplicate_basenames(root: Path) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("test_*.py")):
        seen[path.name].append(str(path.relative_to(root)))
    return {name: paths for name, paths in seen.items() if len(paths) > 1}


def test_no_two_test_modules_share_a_basename():
    assert duplicate_basenames(TESTS) == {}


def test_the_check_finds_a_shared_basename(tmp_path):
    for d in ("unit", "integration"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "test_same.py").write_text("")
    assert duplicate_basenames(tmp_path) == {"test_same.py": ["integration/test_same.py", "unit/test_same.py"]}
