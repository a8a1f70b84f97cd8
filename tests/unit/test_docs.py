"""The documentation: every relative link resolves, the README stays short, the config table
is what the config's dataclasses say, and no page sends users to a file they cannot see."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import REPO
from gpunode_testing import configdoc

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "ignition/README.md",
         REPO / "deploy/upstream/README.md"]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors (lowercase; spaces to '-'; other punctuation dropped) and
    explicit <a id> anchors."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    found = set(re.findall(r'<a id="([^"]+)"', text))
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


def links() -> list[tuple[Path, str]]:
    return [(page, target) for page in PAGES for target in LINK.findall(page.read_text())
            if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize(("page", "target"), links(),
                         ids=[f"{p.relative_to(REPO)}->{t}" for p, t in links()])
def test_every_relative_link_names_a_file_and_heading_that_exist(page: Path, target: str) -> None:
    path, _, anchor = target.partition("#")
    resolved = (page.parent / path).resolve() if path else page
    assert resolved.exists(), f"{page.relative_to(REPO)}: {target} does not exist"
    if anchor:
        assert anchor in anchors(resolved), f"{page.relative_to(REPO)}: no #{anchor} in {path}"


def test_readme_is_at_most_8_kb_and_starts_with_the_two_commands() -> None:
    readme = (REPO / "README.md").read_bytes()
    assert len(readme) <= 8 * 1024
    first_block = readme.decode().split("```sh\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split("#")[0].split("&& ")[-1].strip() for line in first_block] == [
        "make demo", "make test"]


def test_the_config_key_table_is_generated_from_the_config_dataclasses() -> None:
    current = configdoc.DOC.read_text()
    assert configdoc.render(current) == current, "run: python -m gpunode_testing.configdoc"


def test_every_config_key_is_in_the_table() -> None:
    table = configdoc.DOC.read_text()
    assert [k.dotted for k in configdoc.config_keys() if f"| `{k.dotted}` |" not in table] == []


def test_no_page_points_at_the_design_brief_or_an_issue() -> None:
    for page in PAGES:
        text = page.read_text()
        assert not re.search(r"DESIGN\.md|DESIGN §|shared/|\bissue \d", text), page.name
