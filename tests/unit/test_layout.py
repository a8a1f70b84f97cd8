"""The package keeps the shape docs/design.md shows: a package per concern, a handful of modules
at the top, no module over 500 lines, and the design's module tree made from the code
(gpunode_testing.layout)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from conftest import REPO
from gpunode_testing import layout

PACKAGE = REPO / "gpunode"
TEST_SUPPORT = REPO / "testing" / "gpunode_testing"
LIMIT = 500
TOP_LEVEL_LIMIT = 20
REASON = re.compile(r"longer than .*(because|on purpose)", re.IGNORECASE | re.DOTALL)


def modules(package: Path = PACKAGE) -> list[Path]:
    return sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_module_of_the_package_is_over_500_lines(path: Path) -> None:
    lines = path.read_text().count("\n")
    assert lines <= LIMIT, f"{path.relative_to(REPO)} has {lines} lines: split it by concern"


@pytest.mark.parametrize("path", modules(TEST_SUPPORT), ids=lambda p: str(p.relative_to(REPO)))
def test_a_test_support_module_is_small_or_says_why_not(path: Path) -> None:
    text = path.read_text()
    lines = text.count("\n")
    docstring = ast.get_docstring(ast.parse(text)) or ""
    assert lines <= LIMIT or REASON.search(docstring), (
        f"{path.relative_to(REPO)} has {lines} lines: split it, or say why it is longer "
        "('longer than … because …') in its docstring")


def test_the_top_of_the_package_holds_only_what_every_part_uses() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_LEVEL_LIMIT, top


def test_every_module_and_package_says_what_it_is_for() -> None:
    missing = [str(p.relative_to(REPO)) for p in modules()
               if p.name != "__main__.py" and not layout.summary(p)]
    assert missing == []


def test_design_md_shows_the_module_tree_made_from_the_code() -> None:
    """`python -m gpunode_testing.layout --write` remakes it."""
    assert layout.documented() == layout.tree()
