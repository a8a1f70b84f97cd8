"""Small helpers for reading TOML with the standard library (cheap to import at boot)."""

from __future__ import annotations

import re
import tomllib

_LINE_RE = re.compile(r"at line (\d+)")


def error_line(exc: tomllib.TOMLDecodeError) -> int | None:
    """The line tomllib names in its message ("... (at line 3, column 7)")."""
    match = _LINE_RE.search(str(exc))
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
