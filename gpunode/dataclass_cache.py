"""Compiled code for the methods `dataclasses` generates, kept across processes like a .pyc.

Python 3.11 and 3.12 build every dataclass's `__init__`, `__repr__`, `__eq__`, `__hash__`,
`__setattr__` and `__delattr__` from source text at import, one `exec` of a fresh string each:
a boot imports ~65 dataclasses, ~370 such functions, ~30 ms of compiling on the test machine,
a fifth of the whole process. The text depends only on the class's fields, so its compiled
code can be kept: `write` imports every gpunode module once, keeping each text's code object,
and marshals them (as a .pyc holds code) to gpunode/__pycache__/dataclasses.<tag>.marshal,
one section per module; `install`, called by the entry point before the pipeline's imports,
reads that file and gives the `dataclasses` module an `exec` that runs the kept code for a
text it has and compiles any other. A module's section is unmarshalled at its first class:
a boot imports about half of gpunode's dataclasses, and making every code object of the file
cost ~3 ms of its start. Same text, same code: the classes are exactly what `dataclasses`
makes without it, and a class that changed since the file was written is simply compiled.
The sysext build and `make setup` write the file; without it (or from another Python, or in
an older gpunode's format) nothing changes.

On 3.11 a section also keeps each class's recipe (gpunode.dataclass_recipes): what
`dataclasses` did to it, done again without finding its fields or writing its texts, for a
class whose shape is the recorded one; `install` puts `_process` in the place of
`dataclasses._process_class` for that (~6% of the instructions of a boot or a status). A
recipe holds its methods' code itself, and the section keeps as texts only the rest.

On 3.11 `install` also imports `dataclasses` without `inspect` (with ast, dis and tokenize,
~8 ms of every command that imports dataclasses): `dataclasses` uses it only to write the
docstring of a class that has none, and every gpunode dataclass has its own (a test holds
them to it). `_Inspect` stands in for it there; a class without a docstring, gpunode's or
anyone's, gets the real module at that moment and the same text.
"""

from __future__ import annotations

import builtins
import marshal
import os
import sys
import types

from gpunode import regex_cache

TYPE_CHECKING = False  # typing for type checkers only (docs/design.md, the boot path)
if TYPE_CHECKING:
    from typing import Any

VERSIONS = ((3, 11), (3, 12))  # 3.13 builds a class's methods in one exec already
CACHE = os.path.join(os.path.dirname(os.path.realpath(__file__)), "__pycache__",
                     f"dataclasses.{sys.implementation.cache_tag}.marshal")  # no pathlib: boot
LIMIT = 16 << 20  # the file is ~0.8 MB
_sections: dict[str, bytes] = {}  # module -> its texts' code, marshalled, not yet needed
_code: dict[str, dict[str, Any]] = {}  # module -> {text: code}, from its first class on
_recipes: dict[str, dict[str, Any]] = {}  # module -> {qualname: recipe} (dataclass_recipes)
_process_class: Any = None  # dataclasses' own, where install() put _process in its place


def install(path: str | os.PathLike[str] = CACHE) -> bool:
    """True when the kept code is in use; False (nothing changed) where there is none, it
    cannot be read, or this Python is not one it applies to."""
    if sys.version_info[:2] not in VERSIONS or _sections or _code:
        return bool(_sections or _code)
    from gpunode.platform import safeio

    try:  # a regular file only (a FIFO would hang the boot), within a bound
        kept = marshal.loads(safeio.read(os.fspath(path), LIMIT))
    except (OSError, safeio.Refused, ValueError, EOFError, TypeError):
        kept = None
    if not isinstance(kept, dict) or not kept or \
            not all(type(section) is bytes for section in kept.values()):
        _import_dataclasses()
        return False  # not this format (a file an older gpunode wrote: its own whole)
    _patterns(kept.pop(regex_cache.SECTION, None))  # before the imports that compile them
    _import_dataclasses()
    import dataclasses

    _sections.update(kept)
    dataclasses.exec = _exec  # type: ignore[attr-defined]  # a module global shadows the builtin
    if sys.version_info[:2] == (3, 11):  # the internals dataclass_recipes knows
        global _process_class
        _process_class = dataclasses._process_class  # type: ignore[attr-defined]
        dataclasses._process_class = _process  # type: ignore[attr-defined]
    return True


def _patterns(section: bytes | None) -> None:
    """The kept regular expressions in use (gpunode.regex_cache), where the file has them."""
    if section is not None:
        try:
            kept = marshal.loads(section)
        except (ValueError, EOFError, TypeError):
            return  # compiled by re, as without the file
        regex_cache.install(kept)


def _process(cls: type, *params: Any) -> type:
    """`dataclasses._process_class`, or its recorded steps again for a class whose shape is
    the one recorded (dataclass_recipes)."""
    _kept(cls.__module__)  # its module's section read: the recipes with it
    recipe = _recipes.get(cls.__module__, {}).get(cls.__qualname__)
    if recipe is not None:
        from gpunode import dataclass_recipes

        if type(recipe) is tuple and len(recipe) == 2 and dataclass_recipes.usable(recipe[1]) \
                and dataclass_recipes.shape(cls, params) == recipe[0]:
            return dataclass_recipes.replay(cls, params, recipe[1])
    return _process_class(cls, *params)  # type: ignore[no-any-return]


class _Inspect(types.ModuleType):
    """`dataclasses`' own name for `inspect` on 3.11: the real module, imported at the first
    attribute asked for."""

    def __getattr__(self, name: str) -> Any:
        import inspect  # the real one: the stand-in left sys.modules at once

        return getattr(inspect, name)


def _import_dataclasses() -> None:
    # 3.12 and later call inspect.get_annotations for every dataclass: nothing to defer there
    if sys.version_info[:2] != (3, 11) or "dataclasses" in sys.modules \
            or "inspect" in sys.modules:
        return
    sys.modules["inspect"] = _Inspect("inspect")
    try:
        import dataclasses  # noqa: F401  # binds the stand-in as its `inspect`
    finally:
        del sys.modules["inspect"]


def _exec(source: Any, globals: dict[str, Any] | None = None,
          locals: dict[str, Any] | None = None) -> None:
    if globals is None:  # exec's default: the caller's globals (here, dataclasses')
        globals = sys._getframe(1).f_globals
    # dataclasses runs each text in the globals of the class's module
    code = _kept(globals.get("__name__")).get(source) if type(source) is str else None
    if code is None:  # compiled as `dataclasses` compiles it: not with this module's
        code = compile(source, "<string>", "exec", dont_inherit=True)  # __future__ flags
    builtins.exec(code, globals, locals)


def _kept(module: str | None) -> dict[str, Any]:
    """The kept code of `module`'s texts, its section unmarshalled at the first ask ({}: none,
    or a section that cannot be read, whose texts are then compiled)."""
    code = _code.get(module or "")
    if code is None:
        section = _sections.pop(module or "", None)
        try:
            kept = marshal.loads(section) if section is not None else ({}, {})
        except (ValueError, EOFError, TypeError):
            kept = ({}, {})
        if type(kept) is not tuple or len(kept) != 2 or \
                not all(isinstance(part, dict) for part in kept):
            kept = ({}, {})  # not this format: compiled, made by dataclasses
        code, _recipes[module or ""] = kept
        _code[module or ""] = code
    return code


def write(path: str | os.PathLike[str] = CACHE) -> int:
    """Import every gpunode module, keeping the code of each text `dataclasses` runs, and
    write it to `path`, a section per module (a temporary file renamed over it); the number
    of texts kept."""
    # First, so that the standard modules imported from here on (dataclasses, tomllib, json,
    # string, shlex) compile their patterns under it: write runs in a process of its own.
    patterns = regex_cache.Recorder()
    patterns.install()
    import importlib
    import pkgutil
    import tomllib  # noqa: F401  # for a document outside gpunode.tomlsubset: its patterns too
    from pathlib import Path

    import gpunode
    from gpunode import dataclass_recipes

    kept: dict[str, dict[str, Any]] = {}

    def keep(source: Any, globals: dict[str, Any] | None = None,
             locals: dict[str, Any] | None = None) -> None:
        if globals is None:
            globals = sys._getframe(2).f_globals  # (called through the recorder's exec)
        if type(source) is str:
            # dont_inherit: not this module's `from __future__ import annotations` (exec of
            # the text compiles it with none either: the annotations stay objects)
            texts = kept.setdefault(globals["__name__"], {})
            source = texts.setdefault(source, compile(source, "<string>", "exec",
                                                      dont_inherit=True))
        builtins.exec(source, globals, locals)

    recorder = dataclass_recipes.Recorder()
    originals = recorder.install(keep)
    try:
        for module in pkgutil.walk_packages(gpunode.__path__, "gpunode."):
            if not module.name.endswith("__main__"):  # running that would run gpunode
                importlib.import_module(module.name)
    finally:
        recorder.uninstall(originals)
        patterns.uninstall()
    recipes = recorder.recipes if sys.version_info[:2] == (3, 11) else {}
    sections = {}
    for module, texts in kept.items():
        # A recipe's steps hold their texts' code, and the section keeps as texts only those
        # no recipe holds: a boot would unmarshal each text (~40% of a section) for nothing.
        used: set[str] = set()
        compiled = {qualname: (shape, tuple(_compiled(step, texts, used) for step in steps))
                    for qualname, (shape, steps) in recipes.get(module, {}).items()}
        sections[module] = marshal.dumps(
            ({text: code for text, code in texts.items() if text not in used}, compiled))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_bytes(marshal.dumps({
        **sections, regex_cache.SECTION: marshal.dumps(patterns.kept())}))
    partial.replace(path)
    return sum(len(texts) for texts in kept.values())


def _compiled(step: tuple[Any, ...], texts: dict[str, Any], used: set[str]) -> tuple[Any, ...]:
    """A recipe's step as the file keeps it: a method's text as its code."""
    if step[0] != "fn":
        return step
    used.add(step[2])
    return (*step[:2], texts[step[2]], *step[3:])


if __name__ == "__main__":
    print(f"{CACHE}: {write()} texts' code kept")
