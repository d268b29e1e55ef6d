"""The runtime's modules import each other in one direction only:
no cycle, counting imports inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

import torchpass.runtime

RUNTIME = Path(torchpass.runtime.__file__).parent
PKG = "torchpass.runtime"


def runtime_imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted(RUNTIME.rglob("*.py")):
        rel = path.relative_to(RUNTIME).with_suffix("")
        name = ".".join((PKG, *rel.parts)).removesuffix(".__init__")
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            deps |= {m for m in mods if m.startswith(PKG + ".")}
        graph[name] = deps
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> list[str] | None:
        if m in path:
            return path[path.index(m):] + [m]
        if m in done:
            return None
        for d in sorted(graph[m]):
            found = visit(d, path + [m])
            if found:
                return found
        done.add(m)
        return None

    for m in sorted(graph):
        found = visit(m, [])
        if found:
            return found
    return None


def test_the_runtime_has_no_import_cycle():
    graph = runtime_imports()
    assert {"torchpass.runtime.hook", "torchpass.runtime.control", "torchpass.runtime.pg"} <= set(graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
