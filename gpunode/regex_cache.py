"""The compiled form of the regular expressions a command compiles, kept across processes in
gpunode.dataclass_cache's file, as a .pyc keeps code.

`re` parses and compiles each pattern in Python. A boot or a status compiles about 20 at
import: tomllib's number and date patterns, string.Template's, json's, dataclasses' and
gpunode's own. That was ~6 ms of each process here, more than anything else the standard
library does at import. What re hands to `_sre.compile` (the pattern's flags, its code and its
groups) depends only on the pattern, its flags and the interpreter (`_sre.MAGIC`,
`_sre.CODESIZE`, the Python version). So `Recorder`, run while the file is written, keeps
those arguments for each pattern compiled. It keeps them only where the pattern they make
equals re's own (`Pattern.__eq__` compares the flags and the code). `install` gives
`re._compiler` a `compile` that builds a kept pattern from them directly; any other pattern is
compiled as before. `_sre.compile` checks the code it is given, so a damaged file raises
there, and the pattern is then compiled by re.
"""

from __future__ import annotations

import _sre
import sys

TYPE_CHECKING = False  # typing for type checkers only (docs/design.md, the boot path)
if TYPE_CHECKING:
    from typing import Any

SECTION = "(re)"  # its key in the file's {module: section} (no module is named so)
_kept: dict[tuple[Any, int], tuple[Any, ...]] = {}  # (pattern, flags) -> _sre.compile's rest
_original: Any = None  # re._compiler.compile, where install() put _compile


def stamp() -> tuple[Any, ...]:
    """What the kept arguments depend on besides the patterns."""
    return (sys.version_info[:2], _sre.MAGIC, _sre.CODESIZE)


def install(kept: Any) -> bool:
    """Use `kept` (a Recorder's `kept()`, unmarshalled): True when it is for this interpreter
    and now in use."""
    global _original
    if _original is not None or type(kept) is not tuple or len(kept) != 2 \
            or kept[0] != stamp() or type(kept[1]) is not dict:
        return False
    from re import _compiler

    _kept.update(kept[1])
    _original = _compiler.compile
    _compiler.compile = _compile
    return True


def _compile(pattern: Any, flags: int = 0) -> Any:
    """re._compiler.compile: a kept pattern made from its kept arguments, any other by re."""
    kept = _kept.get((pattern, flags)) if type(pattern) in (str, bytes) else None
    if kept is not None:
        try:
            return _sre.compile(pattern, *kept)
        except (TypeError, ValueError, RuntimeError):  # not this _sre's arguments after all
            pass
    return _original(pattern, flags)


class Recorder:
    """Keeps what re gives `_sre.compile` for each pattern compiled while it is installed."""

    def __init__(self) -> None:
        self._kept: dict[tuple[Any, int], tuple[Any, ...]] = {}
        self._original: Any = None

    def install(self) -> None:
        import re
        from re import _compiler

        self._original = _compiler.compile
        _compiler.compile = self._compile
        re.purge()  # patterns compiled before now are compiled again, and kept

    def uninstall(self) -> None:
        from re import _compiler

        _compiler.compile = self._original

    def kept(self) -> tuple[Any, ...]:
        return (stamp(), dict(self._kept))

    def _compile(self, pattern: Any, flags: int = 0) -> Any:
        from re import _compiler

        made = self._original(pattern, flags)
        if type(pattern) in (str, bytes) and type(flags) is int \
                and not flags & _compiler.SRE_FLAG_DEBUG:
            import contextlib

            with contextlib.suppress(Exception):  # another re than 3.11's: compiled each use
                rest = _arguments(pattern, flags)
                if _sre.compile(pattern, *rest) == made:
                    self._kept[(pattern, flags)] = rest
        return made


def _arguments(pattern: Any, flags: int) -> tuple[Any, ...]:
    """What re._compiler.compile hands to _sre.compile after the pattern (3.11, 3.12), in
    plain ints: the code holds re's named opcodes, an int subclass marshal refuses."""
    from re import _compiler, _parser

    parsed = _parser.parse(pattern, flags)
    code = _compiler._code(parsed, flags)
    groupindex = {str(name): int(index) for name, index in parsed.state.groupdict.items()}
    indexgroup: list[Any] = [None] * parsed.state.groups
    for name, index in groupindex.items():
        indexgroup[index] = name
    return (int(flags | parsed.state.flags), [int(c) for c in code],
            int(parsed.state.groups - 1), groupindex, tuple(indexgroup))
