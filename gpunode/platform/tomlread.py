"""Reading TOML the one way (tomllib), every error worded with the file and its line."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from typing import Any

from gpunode.errors import FileError
from gpunode.platform.records import TOO_DEEP, too_deep

_LINE = re.compile(r"at line (\d+)")  # in tomllib's messages


BOM = "\ufeff"  # some editors write one; it carries nothing (containerd 1.x skips it too)

# How a caller's error is made: (file, reason, line) → the exception its command reports.
FileErrorFactory = Callable[[str, str, int | None], Exception]


def loads_toml(text: str, file: str, error: FileErrorFactory = FileError) -> dict[str, Any]:
    """The TOML document in `text` (a leading byte order mark dropped), or one error naming
    `file` and the line: not TOML, or nested too deeply for gpunode (tomllib recurses into
    inline arrays and tables, and so does everything that walks a document after it)."""
    text = text.removeprefix(BOM)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise error(file, f"not valid TOML: {exc}", error_line(exc)) from None
    except RecursionError:
        raise error(file, f"not valid for gpunode: {TOO_DEEP}", None) from None
    if too_deep(doc):
        raise error(file, f"not valid for gpunode: {TOO_DEEP}", None)
    return doc


def error_line(exc: tomllib.TOMLDecodeError) -> int | None:
    """The line tomllib names in its message ("... (at line 3, column 7)")."""
    match = _LINE.search(str(exc))
    return int(match.group(1)) if match else None


def key_line(text: str, section: str, key: str) -> int | None:
    """The line where `key` is assigned inside `[section]`, for messages about its value."""
    current = ""
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if line.startswith("[") and not line.startswith("[["):
            current = line.strip("[] ").replace('"', "")
            continue
        name = line.partition("=")[0].strip().strip('"')
        if "=" in line and current == section and name == key:
            return number
    return None
