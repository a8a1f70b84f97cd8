"""gpunode.tomlsubset against tomllib: for every document it reads, the same document (types
and key order too); for every other, None, and tomllib decides. Over the tests' TOML files,
cases at each rule's edge, and seeded random mutations of them all."""

from __future__ import annotations

import random
import tomllib
from typing import Any

import pytest

from conftest import TEST_DATA
from gpunode import tomlsubset
from gpunode.errors import FileError
from gpunode.platform.tomlread import loads_toml
from gpunode_testing import fixtures

FILES = sorted(TEST_DATA.rglob("*.toml"))
CORPUS = {str(p.relative_to(TEST_DATA)): p.read_bytes().decode("utf-8", "replace")
          for p in FILES}
CORPUS["fixtures.FLATCAR_CONTAINERD_CONFIG"] = fixtures.FLATCAR_CONTAINERD_CONFIG

EDGES = [
    "", "\n", "# only a comment", "a = 1 # and one\n", "a=1", "\t a \t=\t 1 \t\n",
    'a = ""\nb = \'\'\n', '"" = 1\n', "'' = 2\n", '"a.b" = 1\n', "1234 = 5\n", "a-b_c = 1\n",
    "a = +0\nb = -0\nc = 0\nd = -17\ne = 99999999999999999999999\n",
    "a = 00\n", "a = 01\n", "a = 1_000\n", "a = 0x1F\n", "a = 0o17\n", "a = 0b1\n",
    "a = 1.5\nb = -0.0\nc = 1e5\nd = 1E-05\ne = 6.02e+23\nf = 0.02\n",
    "a = 1.\n", "a = .5\n", "a = 1.e5\n", "a = inf\n", "a = nan\n", "a = -inf\n",
    "a = true\nb = false\n", "a = True\n", "a = trueish\n", "a = truefalse\n",
    "a = 1979-05-27\n", "a = 07:32:00\n", "a = 1979-05-27T07:32:00Z\n",
    'a = "x\\ty"\n', 'a = "\\u00e9"\n', 'a = """x"""\n', "a = '''x'''\n", 'a = "x\n"\n',
    'a = "tab\there"\n', "a = 'C:\\path'\n", 'a = "é ü 日本"\n', 'a = "#not a comment"\n',
    "a = [1, 2, 3]\n", "a = [ ]\n", "a = []\n", "a = [1,]\n", "a = [,]\n", "a = [1 2]\n",
    "a = [\n  1, # one\n  2,\n  # between\n]\n", "a = [[1], [[2]], 'x', {b = 1}]\n",
    "a = {}\n", "a = { }\n", "a = {b = 1, c = \"d\"}\n", "a = {b = 1,}\n", "a = {b = 1\n}\n",
    "a = {b = 1, b = 2}\n", "a = {b.c = 1}\n", "a = {b = {c = {}}}\n",
    "[a]\n[b]\n", "[a]\n[a]\n", "[a.b]\n[a]\n", "[a]\n[a.b]\n[a]\n", "[ a . b ]\n",
    '[a."b.c".\'d\']\nx = 1\n', "[a.]\n", "[]\n", "[a] x = 1\n", "[a]\nb = 1\n[a.b]\n",
    "a = {}\n[a]\n", "a = {}\n[a.b]\n", "a = [1]\n[a]\n", "a = [1]\n[a.b]\n",
    "[a.b]\nc = 1\n[a]\nb = 2\n", "a = 1\na = 2\n", "a.b = 1\n", "a = \n", "= 1\n",
    "a = 1 b = 2\n", "a = 1\r\n", "a = 1\x00\n", "# \x01\na = 1\n", "a = 1\x7f\n",
    "[[a]]\nb = 1\n[[a]]\nb = 2\n", "[[a]]\n[a.b]\nc = 1\n[[a]]\n", "[[a.b]]\n[[a.b]]\n",
    "[a]\n[[a]]\n", "[[a]]\n[a]\n", "a = []\n[[a]]\n", "[[a]]\n[[a.b]]\n[a.b.c]\nd = 1\n",
    "[[ a ]]\n", "[[a]\n", "[[a]] # c\n", "a = \"x\" # trailing\n# end without newline",
    "a = 1\n\n\n   \n\t\n", "\ufeffa = 1\n",
    "a = " + "[" * 20 + "]" * 20 + "\n", "a = " + "[" * 16 + "]" * 16 + "\n",
    "a = " + "{b = " * 17 + "1" + "}" * 17 + "\n",
]


def typed(value: Any) -> Any:
    """A value with its types and key order made part of its equality (1 is not 1.0 or True,
    {"a", "b"} is not {"b", "a"})."""
    if isinstance(value, dict):
        return ("table", [(k, typed(v)) for k, v in value.items()])
    if isinstance(value, list):
        return ("array", [typed(v) for v in value])
    return (type(value).__name__, value)


def tomllib_reading(text: str) -> Any:
    try:
        return typed(tomllib.loads(text))
    except (tomllib.TOMLDecodeError, RecursionError):
        return "refused"


def check(text: str) -> bool:
    """Whether the subset read `text`; fails where it read it otherwise than tomllib."""
    doc = tomlsubset.loads(text)
    if doc is None:
        return False
    assert tomllib_reading(text) == typed(doc), f"read otherwise than tomllib: {text!r}"
    return True


@pytest.mark.parametrize("text", EDGES)
def test_each_edge_case_is_read_as_tomllib_reads_it_or_left_to_it(text: str) -> None:
    check(text)


def test_a_document_tomllib_refuses_is_always_left_to_it() -> None:
    refused = [text for text in EDGES if tomllib_reading(text) == "refused"]
    assert len(refused) > 30  # the edge cases include TOML's refusals
    assert [text for text in refused if tomlsubset.loads(text) is not None] == []


def test_the_documents_a_boot_reads_are_in_the_subset() -> None:
    """Flatcar's containerd config, containerd's own defaults (1.6, 1.7 with its arrays of
    tables, 2.1), and what gpunode writes into a config: else the subset saves nothing."""
    names = ["fixtures.FLATCAR_CONTAINERD_CONFIG",
             *(name for name in CORPUS if name.startswith("containerd/defaults/")),
             *(name for name in CORPUS if name.endswith("expected.toml")
               and "comments-and-formatting" not in name)]  # its dotted keys: tomllib's
    assert len(names) > 20
    assert [name for name in names if not check(CORPUS[name])] == []


def test_every_file_of_the_tests_is_read_as_tomllib_reads_it() -> None:
    read = [name for name, text in CORPUS.items() if check(text.removeprefix("\ufeff"))]
    assert len(read) > 0.8 * len(CORPUS)


ALPHABET = [*"[]{}=,.\"'# \t\n-+_:0123456789eExtruefalsinab", "\r", "\x00", "\\", "é"]


def mutations(text: str, rng: random.Random, count: int) -> list[str]:
    """Small edits of the kinds a hand edit or a damaged file makes: a character removed,
    added or replaced, a line doubled or dropped."""
    out = []
    for _ in range(count):
        kind = rng.randrange(5)
        at = rng.randrange(len(text) + 1)
        if kind == 0 and text:
            out.append(text[:at] + text[at + 1:])
        elif kind == 1:
            out.append(text[:at] + rng.choice(ALPHABET) + text[at:])
        elif kind == 2 and text:
            out.append(text[:at] + rng.choice(ALPHABET) + text[at + 1:])
        else:
            lines = text.split("\n")
            line = rng.randrange(len(lines))
            if kind == 3:
                lines.insert(line, lines[line])
            else:
                del lines[line]
            out.append("\n".join(lines))
    return out


def test_mutated_documents_are_read_as_tomllib_reads_them_or_left_to_it() -> None:
    rng = random.Random(20261202)
    texts = [*EDGES, *CORPUS.values()]
    read = left = 0
    for text in texts:
        for mutated in mutations(text, rng, 60 if len(text) < 4000 else 15):
            if check(mutated):
                read += 1
            else:
                left += 1
    assert read > 1000 and left > 1000  # both ways taken, many times


def test_loads_toml_words_an_error_as_tomllib_does() -> None:
    """A document outside the subset is tomllib's, its error included (file, reason, line)."""
    with pytest.raises(FileError) as caught:
        loads_toml("a = 1\n[b]\nc = 2\nc = 3\n", "/etc/x.toml")
    assert caught.value.line == 4
    assert "not valid TOML" in str(caught.value) and "/etc/x.toml" in str(caught.value)
    assert loads_toml("\ufeffa = 1.5e3\nb = 1979-05-27\n", "x")["a"] == 1500.0  # tomllib's
