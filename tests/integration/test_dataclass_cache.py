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

# Every dataclass of every gpunode module, as a class: each entry of its __dict__ in order (a
# function by its code, defaults, annotations, closure and names; a repr's wrapper and what it
# wraps; the fields, each Field as it prints), the object addresses left out.
SHAPES = """\
import dataclasses, importlib, json, marshal, pkgutil, re, sys, types
from gpunode import dataclass_cache
installed = None if sys.argv[1] == "none" else \\
    dataclass_cache.install(__import__("pathlib").Path(sys.argv[1]))
replayed = []
if dataclass_cache._process_class is not None:
    from gpunode import dataclass_recipes
    replay = dataclass_recipes.replay
    def counting(cls, *args):
        replayed.append(cls.__qualname__)
        return replay(cls, *args)
    dataclass_recipes.replay = counting
import gpunode

def function(f, cls):
    wrapped = getattr(f, "__wrapped__", None)
    if wrapped is not None:
        return {"wraps": function(wrapped, cls), "wrapper": f.__qualname__}
    return {"name": [f.__name__, f.__qualname__], "code": marshal.dumps(f.__code__).hex(),
            "defaults": repr(f.__defaults__), "kwdefaults": repr(f.__kwdefaults__),
            "annotations": repr(f.__annotations__), "globals": f.__globals__["__name__"],
            "closure": ["cls" if c.cell_contents is cls else repr(c.cell_contents)
                        for c in f.__closure__ or ()]}

def shape(cls):
    entries = []
    for key, value in cls.__dict__.items():
        if isinstance(value, types.FunctionType):
            value = function(value, cls)
        elif key == "__dataclass_fields__":
            value = [[name, repr(f), str(f._field_type)] for name, f in value.items()]
        elif key in ("__dict__", "__weakref__"):
            value = type(value).__name__
        else:
            value = repr(value)
        entries.append([key, value])
    return re.sub(r"0x[0-9a-f]+", "0x", json.dumps(entries))

shapes = {}
for info in pkgutil.walk_packages(gpunode.__path__, "gpunode."):
    if info.name.endswith("__main__"):
        continue
    module = importlib.import_module(info.name)
    for name, value in vars(module).items():
        if isinstance(value, type) and dataclasses.is_dataclass(value) and \\
                value.__module__ == info.name:
            shapes[f"{info.name}.{name}"] = shape(value)

@dataclasses.dataclass(frozen=True)  # no file holds its code, nor a docstring of its own
class Outside:
    count: int
    names: list[str] = dataclasses.field(default_factory=list)

shapes["Outside"] = shape(Outside)
print(json.dumps({"installed": installed, "shapes": shapes, "replayed": len(replayed),
                  "doc": Outside.__doc__}))
"""

HITS = """\
import builtins, dataclasses, json
from gpunode import dataclass_cache, dataclass_recipes
installed = dataclass_cache.install()
kept_exec, texts, compiled, replayed = dataclasses.exec, [], [], []
def counting(source, globals=None, locals=None):
    texts.append(type(source) is str)
    return kept_exec(source, globals, locals)
def compiling(*args, **kwargs):
    compiled.append(args[0])
    return builtins.compile(*args, **kwargs)
replay = dataclass_recipes.replay
def replaying(cls, params, steps):
    replayed.append(cls.__qualname__)
    texts.extend(step[0] == "fn" for step in steps)  # each a text's kept code
    return replay(cls, params, steps)
dataclasses.exec = counting
dataclass_cache.compile = dataclass_recipes.compile = compiling
dataclass_recipes.replay = replaying
import gpunode.cli.run, gpunode.pipeline.boot, gpunode.containerd.step, gpunode.driver.step
print(json.dumps({"installed": installed, "hits": sum(texts) - len(compiled),
                  "misses": len(compiled), "loaded": sorted(dataclass_cache._code),
                  "left": sorted(dataclass_cache._sections), "replayed": len(replayed)}))
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
    assert with_cache["doc"] == "Outside(count: int, names: list[str] = <factory>)"
    if sys.version_info[:2] == (3, 11):  # every class but those of a module binding ClassVar
        assert int(with_cache["replayed"]) > 100  # type: ignore[call-overload]
    assert (absent["replayed"], without["replayed"]) == (0, 0)


def test_the_boot_s_imports_take_every_method_from_the_kept_code() -> None:
    """`make setup` wrote the virtualenv's file (gpunode/__pycache__), as the sysext build
    writes the image's."""
    seen = run(HITS)
    assert seen["installed"] is True
    assert seen["misses"] == 0 and int(seen["hits"]) > 300  # type: ignore[call-overload]
    if sys.version_info[:2] == (3, 11):  # and the classes made from their recipes
        assert int(seen["replayed"]) > 50  # type: ignore[call-overload]
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
               "import dataclasses, gpunode.pipeline.boot; "
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
    sections["gpunode.platform.host"] = b"garbage"
    broken = tmp_path / "broken.marshal"
    broken.write_bytes(marshal.dumps(sections))
    seen = run(SHAPES, str(broken))
    assert seen["installed"] is True
    assert seen["shapes"] == run(SHAPES, "none")["shapes"]


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="recipes are kept for 3.11 only")
@pytest.mark.parametrize("damage", ["shape", "steps", "step", "name", "section"])
def test_a_recipe_that_does_not_fit_leaves_the_class_to_dataclasses(
        tmp_path: Path, damage: str) -> None:
    """A recipe whose shape is not the class's (the class changed since the file was
    written), or that is not a recipe at all: those classes are made by `dataclasses`, the
    same as without the file, and nothing fails."""
    whole = tmp_path / "whole.marshal"
    subprocess.run([sys.executable, "-c", "import sys; from gpunode import dataclass_cache; "
                    "dataclass_cache.write(sys.argv[1])", str(whole)], check=True)
    sections = marshal.loads(whole.read_bytes())
    texts, recipes = marshal.loads(sections["gpunode.config"])
    assert len(recipes) > 5
    for qualname, (shape, steps) in recipes.items():
        if damage == "shape":  # one annotation fewer than the class has
            recipes[qualname] = ((shape[0], shape[1][1:], *shape[2:]), steps)
        elif damage == "steps":
            recipes[qualname] = (shape, ["not", "steps"])
        elif damage == "step":  # a text's code that is not code
            recipes[qualname] = (shape, (*steps, ("fn", "__init__", "x = 1", (), "set")))
        elif damage == "name":  # a creator's name dataclasses never gives a value
            recipes[qualname] = (shape, (*steps, ("fn", "__init__", compile(
                "pass", "<string>", "exec"), ("os",), "set")))
    kept = (texts, recipes) if damage != "section" else (texts, recipes, "more")
    sections["gpunode.config"] = marshal.dumps(kept)
    broken = tmp_path / "broken.marshal"
    broken.write_bytes(marshal.dumps(sections))
    seen, none = run(SHAPES, str(broken)), run(SHAPES, "none")
    assert seen["shapes"] == none["shapes"]
    assert 100 < int(seen["replayed"]) < int(run(SHAPES, str(whole))["replayed"])  # type: ignore[call-overload]
