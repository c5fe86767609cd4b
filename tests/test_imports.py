"""The package's modules import one another one way: no circle, counting imports inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pipeline"


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that `path` imports anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {name for name in found if name in known and known[name] != path}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each circle a depth-first walk meets, as its modules in import order."""
    state: dict[str, int] = {}  # 1: on the walk's path, 2: done
    path: list[str] = []
    found: list[list[str]] = []

    def walk(name: str) -> None:
        state[name] = 1
        path.append(name)
        for other in sorted(graph[name]):
            if state.get(other) == 1:
                found.append(path[path.index(other) :] + [other])
            elif other not in state:
                walk(other)
        path.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name)
    return found


def test_no_import_circles():
    known = module_names()
    graph = {name: imports(path, known) for name, path in known.items()}
    assert graph["pipeline.engine.loader"] >= {"pipeline.engine.runner"}  # the walk sees real imports
    assert circles(graph) == []


def test_a_circle_is_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]
