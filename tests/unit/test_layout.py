"""The package keeps the shape docs/design.md shows: small modules (none over ~450 lines unless
its docstring says why it is longer), every module listed there with what lives in it, and
every dataclass with a docstring of its own."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "gpunode"
TEST_SUPPORT = REPO / "testing" / "gpunode_testing"
LIMIT = 460  # "~450": a few lines of slack, not a second budget
REASON = re.compile(r"longer than .*(because|on purpose)", re.IGNORECASE | re.DOTALL)
DESIGN = REPO / "docs" / "design.md"


def modules(package: Path = PACKAGE) -> list[Path]:
    return sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", modules() + modules(TEST_SUPPORT),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_a_module_is_small_or_says_why_not(path: Path) -> None:
    text = path.read_text()
    lines = text.count("\n")
    docstring = ast.get_docstring(ast.parse(text)) or ""
    assert lines <= LIMIT or REASON.search(docstring), (
        f"{path.relative_to(REPO)} has {lines} lines: split it, or say why it is longer "
        "('longer than … because …') in its docstring")


def listed_in_design() -> set[str]:
    """The tree in docs/design.md as paths: '  driver/' opens a package, '    step.py' is in it."""
    section = DESIGN.read_text().split("## The package, module by module", 1)[1].split("\n## ")[0]
    listed, package = set(), ""
    for line in section.splitlines():
        if match := re.match(r"^  (\w+)/\s*$", line):
            package = match.group(1) + "/"
        elif match := re.match(r"^(  |    )(\w+\.py)\s", line):
            listed.add((package if match.group(1) == "    " else "") + match.group(2))
    return listed


def test_design_md_lists_every_module_of_the_package() -> None:
    listed = listed_in_design()
    present = {str(p.relative_to(PACKAGE)) for p in modules()
               if p.name not in ("__init__.py", "__main__.py")}
    assert present - listed == set(), "add them to docs/design.md's module list"
    assert listed - present == set(), "docs/design.md lists modules that are gone"


def _is_dataclass_decorator(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    return (isinstance(target, ast.Name) and target.id == "dataclass") or (
        isinstance(target, ast.Attribute) and target.attr == "dataclass")


def test_every_dataclass_has_a_docstring_of_its_own() -> None:
    """Python 3.11's dataclasses writes one for a class without, with `inspect` (~8 ms of
    every command, which gpunode.dataclass_cache keeps from loading)."""
    missing = [f"{path.relative_to(REPO)}:{node.lineno} {node.name}"
               for path in modules() for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.ClassDef) and ast.get_docstring(node) is None
               and any(_is_dataclass_decorator(d) for d in node.decorator_list)]
    assert missing == []
