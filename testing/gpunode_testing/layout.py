"""The package's module tree as docs/design.md shows it, made from the code: every package and
module with the first sentence of its docstring.

    python -m gpunode_testing.layout           # print the tree
    python -m gpunode_testing.layout --write   # put it into docs/design.md

tests/unit/test_layout.py checks that docs/design.md holds exactly this tree.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "gpunode"
DESIGN = REPO / "docs" / "design.md"
SECTION = "## The package, module by module"
WIDTH = 100
NAME_COLUMN = 22  # where a module's summary starts ("    " + name + padding)


def summary(path: Path) -> str:
    """The docstring's first sentence, on one line."""
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    paragraph = " ".join(docstring.split("\n\n", 1)[0].split())
    match = re.match(r"(.+?\.)(\s|$)", paragraph)
    return (match.group(1) if match else paragraph).rstrip(".")


def _entry(indent: str, name: str, text: str) -> list[str]:
    head = f"{indent}{name}"
    column = max(NAME_COLUMN, len(head) + 2)
    wrapped = textwrap.wrap(text, WIDTH - column) or [""]
    lines = [f"{head:<{column}}{wrapped[0]}".rstrip()]
    lines += [" " * column + more for more in wrapped[1:]]
    return lines


def tree(package: Path = PACKAGE) -> str:
    lines = [f"{package.name}/"]
    for path in sorted(package.glob("*.py")):
        if path.name not in ("__init__.py", "__main__.py"):
            lines += _entry("  ", path.name, summary(path))
    for sub in sorted(p for p in package.iterdir() if (p / "__init__.py").is_file()):
        lines += _entry("  ", f"{sub.name}/", summary(sub / "__init__.py"))
        for path in sorted(sub.glob("*.py")):
            if path.name != "__init__.py":
                lines += _entry("    ", path.name, summary(path))
    return "\n".join(lines) + "\n"


def documented(design: Path = DESIGN) -> str:
    """The first code block after SECTION in design.md."""
    section = design.read_text(encoding="utf-8").split(SECTION, 1)[1]
    return section.split("```\n", 2)[1]


def write(design: Path = DESIGN) -> None:
    text = design.read_text(encoding="utf-8")
    head, section = text.split(SECTION, 1)
    before, _, rest = section.partition("```\n")
    _, _, after = rest.partition("```\n")
    design.write_text(f"{head}{SECTION}{before}```\n{tree()}```\n{after}", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"update {DESIGN}")
    args = parser.parse_args(argv)
    if args.write:
        write()
    else:
        sys.stdout.write(tree())
    return 0


if __name__ == "__main__":
    sys.exit(main())
