"""Reading gpunode's own JSON records (the containerd ledger and journal, the boot record, an
API server's answers) the one way: parsed without ever crashing, then every key checked.

`loads_json` turns any input, however deep or broken, into a document or one error naming the
file; `Reader` checks a document's keys one by one, each problem one message naming the key
("<file>: key 'changes[0].path' is a number (3), expected a non-empty list of strings").
Callers pass the error class their command reports (a ledger error fails a step, exit 1).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any, NoReturn

# Nothing gpunode writes or reads nests deeper than a dozen levels (a containerd runtime's
# options inside a ledger change); the parsers recurse, so a deeper document is refused before
# anything walks it (Python's own limit, about 1000 frames, is not a limit on input).
MAX_DEPTH = 100
TOO_DEEP = f"nested too deeply (more than {MAX_DEPTH} levels), which gpunode does not read"

ErrorFactory = Callable[[str], Exception]


class _NotFinite(ValueError):
    """A number JSON (RFC 8259) does not have: NaN, Infinity, or one too large for a double."""


def _constant(name: str) -> float:
    raise _NotFinite(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotFinite(f"{text[:40]} is too large for a number gpunode reads")
    return value


def loads_json(data: bytes | str, shown: str, error: ErrorFactory = ValueError) -> Any:
    """The JSON document in `data`; anything else (not UTF-8, not JSON, nested too deeply, a
    NaN or Infinity that Python's json accepts but JSON has not, a number that overflows to
    infinity, an integer longer than Python converts) is error("<shown>: not JSON (...)")."""
    try:
        document = json.loads(data, parse_constant=_constant, parse_float=_finite)
    except ValueError as exc:  # not UTF-8, not JSON, not finite, an integer of 4300+ digits
        raise error(f"{shown}: not JSON ({exc})") from None
    except RecursionError:
        raise error(f"{shown}: not JSON for gpunode: {TOO_DEEP}") from None
    if too_deep(document):
        raise error(f"{shown}: not JSON for gpunode: {TOO_DEEP}")
    return document


def too_deep(document: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether lists and dicts nest deeper than `limit` (walked without recursion)."""
    pending: list[tuple[Any, int]] = [(document, 0)]
    while pending:
        node, depth = pending.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth >= limit:
            return True
        pending += [(child, depth + 1) for child in children
                    if isinstance(child, dict | list)]
    return False


def is_int(value: Any) -> bool:
    """A JSON integer: `true` is not 1 here (bool is an int subclass in Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


class Reader:
    """Typed access to a JSON object's keys; a missing or wrong-typed key is one error."""

    def __init__(self, document: dict[str, Any], shown: str, error: ErrorFactory) -> None:
        self.document = document
        self.shown = shown
        self.error = error

    def fail(self, key: str, problem: str) -> NoReturn:
        raise self.error(f"{self.shown}: key '{key}' {problem}")

    def get(self, key: str, default_absent: bool = False) -> tuple[bool, Any]:
        if key not in self.document:
            if not default_absent:
                self.fail(key, "is missing")
            return False, None
        return True, self.document[key]

    def schema(self, key: str, expected: int) -> None:
        """The record's schema version is exactly the integer `expected`."""
        _, value = self.get(key, default_absent=True)
        if not is_int(value) or value != expected:
            self.fail(key, f"is {short(value)}, expected {expected}")

    def text(self, key: str, optional: bool = False, default_absent: bool = False) -> Any:
        _, value = self.get(key, default_absent)
        if value is None and optional:
            return None
        if not isinstance(value, str) or not value:
            self.fail(key, f"is {kind(value)}, expected a non-empty string"
                      + (" or null" if optional else ""))
        return value

    def path(self, key: str, optional: bool = False, default_absent: bool = False) -> Any:
        value = self.text(key, optional, default_absent)
        if value is not None and not absolute(value):
            self.fail(key, f"is {value!r}, expected an absolute path")
        return value

    def flag(self, key: str) -> bool:
        _, value = self.get(key, default_absent=True)
        if value is None:
            return False
        if not isinstance(value, bool):
            self.fail(key, f"is {kind(value)}, expected true or false")
        return bool(value)

    def paths(self, key: str, default_absent: bool = True) -> list[str]:
        _, value = self.get(key, default_absent=default_absent)
        if value is None and default_absent:
            return []
        if not isinstance(value, list) or not all(absolute(v) for v in value):
            self.fail(key, f"is {kind(value)}, expected a list of absolute paths")
        return list(value)


def absolute(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("/") and "\0" not in value


def short(value: Any) -> str:
    """A value as JSON, cut to 60 characters, for messages that quote it."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def kind(value: Any) -> str:
    """A JSON value as a message names it: "null", "a boolean", "a number (3)", "a list", …"""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"a string ({value!r})" if value else "an empty string"
    if isinstance(value, list):
        return "a list"
    return "an object"

