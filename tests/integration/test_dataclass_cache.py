"""gpunode.dataclass_cache: the compiled code of dataclass methods kept across processes
makes the very classes `dataclasses` makes without it, is used by the boot's imports, and a
broken file changes nothing. Each case runs in a fresh interpreter: install() changes the
process's `dataclasses` module."""

from __future__ import annotations

import json
import marshal
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Every dataclass of every gpunode module: its generated methods' code, field by field.
SHAPES = """\
import dataclasses, importlib, json, pkgutil, sys
from gpunode import dataclass_cache
installed = None if sys.argv[1] == "none" else \\
    dataclass_cache.install(__import__("pathlib").Path(sys.argv[1]))
import gpunode

def shape(value, module):
    methods = {m: [f.__code__.co_code.hex(), repr(f.__code__.co_consts),
                   f.__code__.co_names, f.__code__.co_varnames, f.__code__.co_flags,
                   repr(f.__annotations__),
                   f.__globals__ is vars(module) or f.__globals__["__name__"]]
               for m in ("__init__", "__repr__", "__eq__", "__hash__", "__setattr__",
                         "__delattr__")
               if (f := getattr(value.__dict__.get(m), "__wrapped__",
                                value.__dict__.get(m))) is not None
               and hasattr(f, "__code__")}
    return {"doc": value.__doc__, **methods}

shapes = {}
for info in pkgutil.walk_packages(gpunode.__path__, "gpunode."):
    if info.name.endswith("__main__"):
        continue
    module = importlib.import_module(info.name)
    for name, value in vars(module).items():
        if isinstance(value, type) and dataclasses.is_dataclass(value) and \\
                value.__module__ == info.name:
            shapes[f"{info.name}.{name}"] = shape(value, module)

@dataclasses.dataclass(frozen=True)  # no file holds its code, nor a docstring of its own
class Outside:
    count: int
    names: list[str] = dataclasses.field(default_factory=list)

shapes["Outside"] = shape(Outside, sys.modules[__name__])
print(json.dumps({"installed": installed, "shapes": shapes}))
"""

HITS = """\
import builtins, dataclasses, json
from gpunode import dataclass_cache
installed = dataclass_cache.install()
kept_exec, texts, compiled = dataclasses.exec, [], []
def counting(source, globals=None, locals=None):
    texts.append(type(source) is str)
    return kept_exec(source, globals, locals)
def compiling(*args, **kwargs):
    compiled.append(args[0])
    return builtins.compile(*args, **kwargs)
dataclasses.exec, dataclass_cache.compile = counting, compiling
import gpunode.clirun, gpunode.boot, gpunode.containerd.step, gpunode.driver.step
print(json.dumps({"installed": installed, "hits": sum(texts) - len(compiled),
                  "misses": len(compiled), "loaded": sorted(dataclass_cache._code),
                  "left": sorted(dataclass_cache._sections)}))
"""


def run(code: str, *args: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def test_the_kept_code_makes_the_same_classes(tmp_path: Path) -> None:
    cache = tmp_path / "kept.marshal"
    done = subprocess.run([sys.executable, "-c", "import sys, pathlib; from gpunode import "
                           "dataclass_cache; print(dataclass_cache.write(pathlib.Path("
                           "sys.argv[1])))", str(cache)], capture_output=True, text=True,
                          check=True)
    assert int(done.stdout) > 300
    with_cache = run(SHAPES, str(cache))
    absent = run(SHAPES, str(tmp_path / "absent.marshal"))
    without = run(SHAPES, "none")
    assert (with_cache["installed"], absent["installed"]) == (True, False)
    assert len(with_cache["shapes"]) > 100  # type: ignore[arg-type]
    assert with_cache["shapes"] == without["shapes"]
    assert absent["shapes"] == without["shapes"]
    outside = with_cache["shapes"]["Outside"]  # type: ignore[index]
    assert outside["doc"] == "Outside(count: int, names: list[str] = <factory>)"


def test_the_boot_s_imports_take_every_method_from_the_kept_code() -> None:
    """`make setup` wrote the virtualenv's file (gpunode/__pycache__), as the sysext build
    writes the image's."""
    seen = run(HITS)
    assert seen["installed"] is True
    assert seen["misses"] == 0 and int(seen["hits"]) > 300  # type: ignore[call-overload]
    # Only the sections of the modules imported were unmarshalled, each at its first class.
    assert "gpunode.containerd.step" in seen["loaded"]  # type: ignore[operator]
    assert "gpunode.bake.manifest" in seen["left"]  # type: ignore[operator]
    assert not set(seen["loaded"]) & set(seen["left"])  # type: ignore[arg-type]


@pytest.mark.parametrize("content", [b"", b"garbage", b"\xe9" * 100, b"[]",
                                     b"\xfa\x01\x00\x00\x00",  # a marshalled list, truncated
                                     # an older gpunode's format: {text: code}, no sections
                                     marshal.dumps({"x": compile("pass", "<s>", "exec")}),
                                     "fifo", "directory", "huge"])
def test_a_broken_file_changes_nothing(tmp_path: Path, content: bytes | str) -> None:
    cache = tmp_path / "broken.marshal"
    if content == "fifo":
        os.mkfifo(cache)  # nobody writes: reading it would hang
    elif content == "directory":
        cache.mkdir()
    elif content == "huge":
        with cache.open("wb") as out:
            out.truncate(17 << 20)
    else:
        assert isinstance(content, bytes)
        cache.write_bytes(content)
    seen = run("import json, sys, pathlib; from gpunode import dataclass_cache; "
               "ok = dataclass_cache.install(pathlib.Path(sys.argv[1])); "
               "import dataclasses, gpunode.boot; "
               "print(json.dumps({'installed': ok, 'patched': hasattr(dataclasses, 'exec')}))",
               str(cache))
    assert seen == {"installed": False, "patched": False}


def test_a_section_that_cannot_be_read_is_compiled(tmp_path: Path) -> None:
    """One module's section broken, the rest whole: that module's classes are compiled as
    `dataclasses` compiles them, the others' taken from the file."""
    whole = tmp_path / "whole.marshal"
    subprocess.run([sys.executable, "-c", "import sys; from gpunode import dataclass_cache; "
                    "dataclass_cache.write(sys.argv[1])", str(whole)], check=True)
    sections = marshal.loads(whole.read_bytes())
    sections["gpunode.host"] = b"garbage"
    broken = tmp_path / "broken.marshal"
    broken.write_bytes(marshal.dumps(sections))
    assert run(SHAPES, str(broken)) == run(SHAPES, "none") | {"installed": True}
