"""The TOML that containerd's configs and gpunode's agent config are written in, read without
tomllib: `loads` gives the document tomllib gives, or None for anything it does not take, which
tomllib then reads (and words the error for, where it is not TOML).

Why: tomllib is ~15% of a GPU node's boot, and not for its parsing (the documents are ~1 KB):
importing it imports typing, datetime and string, about 0.7x Python's own start here
(valgrind instructions). Flatcar's containerd config, a `containerd config dump` and what
gpunode writes are tables of plain keys, quoted strings without escapes, decimal integers,
floats, booleans, arrays, inline tables and arrays of tables: that subset is read here.

Everything else is None, never a guess: escapes, multi-line strings, dates, inf and nan,
numbers in another base or with underscores, dotted keys in an assignment, a carriage return
or any other control character, values nested deeper than `MAX_NESTING`. So is everything
TOML refuses: a key or table defined twice, a table extending an inline table or a value, a
trailing comma in an inline table, a value followed by more than a comment.
tests/unit/test_tomlsubset.py holds `loads` to tomllib's result, key order included, over the
tests' TOML documents and thousands of their mutations.
"""

from __future__ import annotations

import re

TYPE_CHECKING = False  # typing's import is most of what this module saves (tomllib's)
if TYPE_CHECKING:
    from typing import Any

MAX_NESTING = 16  # arrays and inline tables in one value; deeper: tomllib (and records.too_deep)

# Control characters other than tab and line feed: TOML refuses most of them anywhere, and a
# carriage return (CRLF) is left to tomllib rather than read right here.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_SPACE = re.compile(r"[ \t]*")
# Blank and comment lines (between a document's lines and an array's values), then spaces and a
# comment that ends the text
_BLANK = re.compile(r"(?:[ \t]*(?:#[^\n]*)?\n)*[ \t]*(?:#[^\n]*\Z)?")
_KEY = re.compile(r"[A-Za-z0-9_-]+|\"[^\"\\\n]*\"|'[^'\n]*'")
_END = re.compile(r"[ \t]*(?:#[^\n]*)?(?:\n|\Z)")  # what may follow a value or a header
# A one-line string without escapes, a decimal integer or float (group 1: its fraction or
# exponent), a boolean; a number or a word only where a delimiter follows (1_000, 0x1F, inf,
# 1979-05-27 and "trueish" are none of these)
_ATOM = re.compile(r"\"(?!\"\")[^\"\\\n]*\"|'(?!'')[^'\n]*'"
                   r"|(?:[+-]?(?:0|[1-9][0-9]*)(\.[0-9]+(?:[eE][+-]?[0-9]+)?|[eE][+-]?[0-9]+)?"
                   r"|true|false)(?=[ \t\n#,\]}]|\Z)")


class _Other(Exception):
    """Not in the subset: tomllib reads it."""


def loads(text: str) -> dict[str, Any] | None:
    """The document `text` holds, exactly as tomllib.loads gives it, or None (tomllib's turn)."""
    if _CONTROL.search(text):
        return None
    try:
        return _Reader(text).document()
    except _Other:
        return None


class _Reader:
    """One pass over the text; `pos` is where the next token starts."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.root: dict[str, Any] = {}
        # ids of the tables a header defined, of those no header may add to (inline tables),
        # and of the arrays [[headers]] made: TOML's rules for defining a table once
        self.defined: set[int] = set()
        self.frozen: set[int] = set()
        self.arrays: set[int] = set()

    def document(self) -> dict[str, Any]:
        size = len(self.text)
        table = self.root
        while True:
            self._skip(_BLANK)
            if self.pos >= size:
                return self.root
            if self.text.startswith("[", self.pos):
                table = self._header()
            else:
                self._assignment(table)
            self._line_end()

    def _header(self) -> dict[str, Any]:
        """[table] or [[array of tables]]: the table that the lines after it fill."""
        brackets = "[[" if self.text.startswith("[[", self.pos) else "["
        self.pos += len(brackets)
        path = self._keys()
        if not self.text.startswith(brackets.replace("[", "]"), self.pos):
            raise _Other
        self.pos += len(brackets)
        table = self.root
        for key in path[:-1]:
            table = self._descend(table, key)
        last = table.get(path[-1])
        if brackets == "[[":
            if last is None:
                last = table[path[-1]] = []
                self.arrays.add(id(last))
            elif type(last) is not list or id(last) not in self.arrays:
                raise _Other  # a table, or an array value: TOML refuses it
            last.append({})
            last = last[-1]
        elif last is None:
            last = table[path[-1]] = {}
        elif type(last) is not dict or id(last) in self.defined or id(last) in self.frozen:
            raise _Other  # defined twice, or a value: TOML refuses it
        self.defined.add(id(last))
        return last

    def _descend(self, table: dict[str, Any], key: str) -> dict[str, Any]:
        """The table `key` names inside a header's path (created where there is none; the last
        one of an array of tables)."""
        child = table.get(key)
        if child is None:
            child = table[key] = {}
        elif type(child) is list and id(child) in self.arrays:
            child = child[-1]
        elif type(child) is not dict or id(child) in self.frozen:
            raise _Other
        return child

    def _keys(self) -> list[str]:
        """A dotted key inside a header, with the spaces TOML allows around its parts."""
        keys = [self._key()]
        while True:
            self._skip(_SPACE)
            if not self.text.startswith(".", self.pos):
                return keys
            self.pos += 1
            keys.append(self._key())

    def _key(self) -> str:
        self._skip(_SPACE)
        match = _KEY.match(self.text, self.pos)
        if match is None:
            raise _Other
        self.pos = match.end()
        key = match.group()
        return key[1:-1] if key[0] in "\"'" else key

    def _assignment(self, table: dict[str, Any]) -> None:
        key = self._key()
        self._skip(_SPACE)
        if not self.text.startswith("=", self.pos) or key in table:
            raise _Other  # a dotted key, no value, or a key defined twice
        self.pos += 1
        table[key] = self._value(0)

    def _value(self, nesting: int) -> Any:
        self._skip(_SPACE)
        match = _ATOM.match(self.text, self.pos)
        if match is not None:
            self.pos = match.end()
            atom = match.group()
            if atom[0] in "\"'":
                return atom[1:-1]
            if atom[0] in "tf":
                return atom == "true"
            return int(atom) if match.group(1) is None else float(atom)  # as tomllib makes them
        if nesting >= MAX_NESTING:
            raise _Other
        if self.text.startswith("[", self.pos):
            return self._array(nesting + 1)
        if self.text.startswith("{", self.pos):
            return self._inline_table(nesting + 1)
        raise _Other

    def _array(self, nesting: int) -> list[Any]:
        self.pos += 1
        items: list[Any] = []
        while True:
            self._skip(_BLANK)
            if self.text.startswith("]", self.pos):
                self.pos += 1
                return items
            items.append(self._value(nesting))
            self._skip(_BLANK)
            if self.text.startswith(",", self.pos):
                self.pos += 1
            elif not self.text.startswith("]", self.pos):
                raise _Other

    def _inline_table(self, nesting: int) -> dict[str, Any]:
        self.pos += 1
        table: dict[str, Any] = {}
        self.frozen.add(id(table))
        self._skip(_SPACE)
        if self.text.startswith("}", self.pos):
            self.pos += 1
            return table
        while True:
            key = self._key()
            self._skip(_SPACE)
            if not self.text.startswith("=", self.pos) or key in table:
                raise _Other
            self.pos += 1
            table[key] = self._value(nesting)
            self._skip(_SPACE)
            if self.text.startswith("}", self.pos):
                self.pos += 1
                return table
            if not self.text.startswith(",", self.pos):
                raise _Other  # (a newline, or a trailing comma's "}" after it: not TOML 1.0)
            self.pos += 1

    def _skip(self, pattern: re.Pattern[str]) -> None:
        """Past what `pattern` (one that matches the empty string too) matches here."""
        self.pos = pattern.match(self.text, self.pos).end()  # type: ignore[union-attr]

    def _line_end(self) -> None:
        match = _END.match(self.text, self.pos)
        if match is None:
            raise _Other
        self.pos = match.end()
