"""The gpunode package has no import cycle: no module needs, even lazily, one that needs it.

A function-level import or one under `if TYPE_CHECKING:` is a dependency all the same; a lazy
import only hides a cycle until someone moves it. The graph is read from the source (ast), not
from what a test run happened to import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "gpunode"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The gpunode modules `name` imports anywhere in its source: `from a import b` needs
    module a.b when there is one, else module a; a relative import is resolved first."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    needed: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            needed |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                needed.add(sub if sub in known else base)
    return {m for m in needed if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected group of modules (Tarjan), each as a path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_path_within(graph, group) for group in groups]


def _path_within(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest cycle through the group's first module, for the failure message."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    return sorted(group)


def test_the_package_has_no_import_cycle() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" → ".join(c) for c in cycles)


@pytest.mark.parametrize("source, expected", [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b", "a"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, [["a", "b", "c", "a"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
], ids=["two-modules", "three-modules", "a-chain-is-no-cycle"])
def test_the_walk_finds_a_cycle_of_any_length(source: dict[str, set[str]],
                                              expected: list[list[str]]) -> None:
    assert _cycles(source) == expected


def test_a_function_level_import_counts(tmp_path: Path) -> None:
    """A lazy import inside a function is read like a top-level one."""
    path = tmp_path / "mod.py"
    path.write_text("def f():\n    from gpunode.kube import label\n    import gpunode.status\n")
    assert _imports("gpunode.mod", path, {"gpunode.kube.label", "gpunode.status",
                                          "gpunode.kube"}) == {"gpunode.kube.label",
                                                               "gpunode.status"}
