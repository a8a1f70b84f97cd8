"""gpunode.regex_cache: the regular expressions a command compiles, kept in the dataclass
cache's file, make patterns equal to the ones `re` compiles (`Pattern.__eq__` compares the
flags and the code), spare the boot's imports re's compiler, and a damaged section changes
nothing. Each case runs in a fresh interpreter: install() changes the process's `re`."""

from __future__ import annotations

import json
import marshal
import subprocess
import sys
from pathlib import Path

import pytest

# In a process with the file installed: every kept pattern as `re` makes it now, against the
# pattern re's own compiler makes; and how many patterns re had to parse for the boot's imports.
CHECK = """\
import json, marshal, sys
from gpunode import dataclass_cache, regex_cache
import re
from re import _parser
parsed = []
parse = _parser.parse
def counting(pattern, flags=0, *rest):
    parsed.append(str(pattern)[:40])
    return parse(pattern, flags, *rest)
_parser.parse = counting
installed = dataclass_cache.install(sys.argv[1])  # (pathlib would compile urllib's first)
import gpunode.pipeline.boot, gpunode.cli.run, gpunode.containerd.step, gpunode.driver.step, tomllib, json
imports_parsed = list(parsed)
kept = dict(regex_cache._kept)
own = regex_cache._original or re._compiler.compile
differ = [str(p)[:60] for (p, flags) in kept if re.compile(p, flags) != own(p, flags)]
print(json.dumps({"installed": installed, "kept": len(kept), "differ": differ,
                  "imports_parsed": imports_parsed,
                  "in_use": regex_cache._original is not None}))
"""


def run(cache: Path) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", CHECK, str(cache)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("regex") / "whole.marshal"
    subprocess.run([sys.executable, "-c", "import sys; from gpunode import dataclass_cache; "
                    "dataclass_cache.write(sys.argv[1])", str(path)], check=True)
    return path


def test_kept_patterns_are_re_s_own_and_the_boot_s_imports_compile_none(whole: Path) -> None:
    seen = run(whole)
    assert seen["installed"] is True and seen["in_use"] is True
    assert int(seen["kept"]) > 30  # type: ignore[call-overload]
    assert seen["differ"] == []
    # tomllib's, json's, string.Template's, dataclasses' and gpunode's module-level patterns
    assert seen["imports_parsed"] == []


def _with_section(whole: Path, tmp_path: Path, section: bytes | None) -> Path:
    sections = marshal.loads(whole.read_bytes())
    if section is None:
        del sections["(re)"]
    else:
        sections["(re)"] = section
    path = tmp_path / "changed.marshal"
    path.write_bytes(marshal.dumps(sections))
    return path


def _damaged_code(whole: Path) -> bytes:
    stamp, patterns = marshal.loads(marshal.loads(whole.read_bytes())["(re)"])
    for key, (flags, code, groups, groupindex, indexgroup) in patterns.items():
        patterns[key] = (flags, [99, *code[1:]], groups, groupindex, indexgroup)  # no opcode
    return marshal.dumps((stamp, patterns))


@pytest.mark.parametrize("damage", ["none", "garbage", "stamp", "code", "shape"])
def test_a_damaged_section_leaves_the_patterns_to_re(whole: Path, tmp_path: Path,
                                                      damage: str) -> None:
    section = {"none": None, "garbage": b"\x00garbage",
               "stamp": marshal.dumps(((3, 0), 0, 0, {})),
               "code": _damaged_code(whole),
               "shape": marshal.dumps([1, 2, 3])}[damage]
    seen = run(_with_section(whole, tmp_path, section))
    assert seen["installed"] is True  # the dataclass code is still used
    assert seen["differ"] == []
    if damage != "code":  # not in use at all; with code _sre refuses, re compiles each
        assert seen["in_use"] is False and seen["kept"] == 0
    else:
        assert seen["in_use"] is True
