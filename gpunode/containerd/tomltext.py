"""TOML as data and as text, for the containerd config edit and its undo: one key change
(`Change`), dotted-path get/set, tomlkit's in-place edit, [header] blocks, the parse-back check,
and line hunks that let an undo give back the exact bytes."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from gpunode.errors import EditError, FileError
from gpunode.platform.tomlread import loads_toml

TYPE_CHECKING = False  # typing for type checkers only (docs/design.md, the boot path)
if TYPE_CHECKING:
    from typing import Any


@dataclass(frozen=True)
class Change:
    """One key gpunode set: its dotted path and the value before (None: it was absent)."""

    path: tuple[str, ...]
    before: Any
    after: Any

    def describe(self) -> str:
        where = ".".join(quote_key(k) for k in self.path)
        if self.before is None and isinstance(self.after, Mapping):
            options = self.after.get("options")
            binary = options.get("BinaryName") if isinstance(options, Mapping) else None
            if binary:  # a runtime of gpunode's own (wiring.with_mode_runtimes)
                return f"add runtime '{self.path[-1]}' ({where}) running {binary}"
            return (f"add runtime '{self.path[-1]}' ({where}): containerd's built-in default, "
                    "written out so that it survives the new runtime")
        if self.before is None:
            return f"add {where} = {show(self.after)}"
        return f"set {where} = {show(self.after)} (was {show(self.before)})"


def get_path(doc: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(doc, Mapping) or key not in doc:
            return None
        doc = doc[key]
    return doc


def set_path(doc: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """Set a value; None removes it, and the tables it leaves empty (which no text shows)."""
    parents = [doc]
    for key in path[:-1]:
        doc = doc.setdefault(key, {})
        parents.append(doc)
    if value is not None:
        doc[path[-1]] = value
        return
    doc.pop(path[-1], None)
    for depth in range(len(path) - 1, 0, -1):
        if parents[depth]:
            break
        parents[depth - 1].pop(path[depth - 1], None)



_ESCAPES = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r", '"': '\\"',
            "\\": "\\\\"}


def value_text(value: Any) -> str:
    """`value` as TOML text, exactly as tomlkit writes it (`tomlkit.item(value).as_string()`).
    The strings, booleans, integers and arrays of them a runtime table holds are written here:
    tomlkit's import is ~10 ms of a first boot whose change only appends new tables."""
    text = _plain_text(value)
    if text is None:
        import tomlkit  # floats, dates, tables in arrays: tomlkit's own rules

        text = str(tomlkit.item(value).as_string())
    return text


def _plain_text(value: Any) -> str | None:
    if isinstance(value, bool):
        return "true" if value else "false"
    if type(value) is int:
        return str(value)
    if type(value) is str:
        return '"' + "".join(_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if c < " " or c == "\x7f"
                                                 else c) for c in value) + '"'
    if type(value) is list:
        items = [_plain_text(v) for v in value]
        return None if None in items else "[" + ", ".join(items) + "]"  # type: ignore[arg-type]
    return None


def table_block(path: tuple[str, ...], table: Mapping[str, Any], comment: str) -> str:
    """`table` as [header] sections: scalars first, then each sub-table under its own header."""
    scalars = [f"{quote_key(k)} = {value_text(v)}" for k, v in table.items()
               if not isinstance(v, Mapping)]
    subtables = [(k, v) for k, v in table.items() if isinstance(v, Mapping)]
    lines = [comment] if comment else []
    if scalars or not subtables or comment:  # a table with only sub-tables needs no header
        lines.append("[" + ".".join(quote_key(k) for k in path) + "]")
    text = "\n".join(lines + scalars) + "\n" if lines or scalars else ""
    for key, value in subtables:
        sub = table_block((*path, key), value, "")
        text += ("\n" if text else "") + sub
    return text


def render_document(doc: Mapping[str, Any], comment: str) -> str:
    """A whole document: top-level keys, then every table under its own [header]."""
    lines = [comment] + [f"{quote_key(k)} = {value_text(v)}"
                         for k, v in doc.items() if not isinstance(v, Mapping)]
    text = "\n".join(lines) + "\n"
    for key, value in doc.items():
        if isinstance(value, Mapping):
            text += "\n" + table_block((key,), value, "")
    return text


def tomlkit_edit(text: str, changes: list[Change], delete: tuple[str, ...] | None,
                  file: str) -> str:
    import tomlkit  # only an actual change pays for it

    try:
        doc = tomlkit.parse(text)
    except tomlkit.exceptions.ParseError as exc:
        # Valid TOML (tomllib read it) in a layout tomlkit cannot round-trip, e.g. dotted keys
        # and a [header] extending the same table.
        raise EditError(file, f"gpunode cannot edit this layout in place: {exc}",
                        hint="write the changed keys under their own [table] headers") from exc
    for change in changes:
        node: Any = doc
        for key in change.path[:-1]:
            if key not in node:
                node[key] = tomlkit.table()
            node = node[key]
        if change.after is None:
            del node[change.path[-1]]
        else:
            node[change.path[-1]] = change.after
    if delete:
        node = doc
        for key in delete[:-1]:
            node = node[key]
        del node[delete[-1]]
    return tomlkit.dumps(doc)


def parses_to(text: str, expected: dict[str, Any]) -> bool:
    try:
        return same(loads_toml(text, "<edited>"), expected)
    except FileError:
        return False


def same(a: Any, b: Any) -> bool:
    """Equality of parsed TOML where nan equals nan (TOML has it; `nan != nan` in Python)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def verify(text: str, expected: dict[str, Any], file: str) -> None:
    if not parses_to(text, expected):
        raise EditError(file, "gpunode could not express this change without altering other "
                        "settings, so it changed nothing",
                        hint="add the runtime by hand, or report the file's layout as a bug")


_BARE_KEY = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def quote_key(key: str) -> str:
    return key if key and set(key) <= _BARE_KEY else '"' + key.replace('"', '\\"') + '"'


def show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(show(v) for v in value) + "]"
    return str(value)


# One configure's line change: up to two lines of context before it (as gpunode wrote them),
# the lines it replaced, and the lines it wrote.
Hunk = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]


MAX_HUNK_LINES = 50_000  # beyond that the line diff costs more than it saves


def text_hunks(before: str, after: str) -> list[Hunk]:
    """The line changes that turn `before` into `after` (empty for a huge file)."""
    a, b = split_lines(before), split_lines(after)
    if len(a) > MAX_HUNK_LINES:
        return []
    if len(b) > len(a) and b[:len(a)] == a:
        # Lines only appended (a first boot's runtime tables): the one insert difflib finds
        # for it, without difflib's import (~1.5 ms of the first boot's critical path).
        return [(tuple(b[max(0, len(a) - 2):len(a)]), (), tuple(b[len(a):]))]
    from difflib import SequenceMatcher

    return [(tuple(b[max(0, j1 - 2):j1]), tuple(a[i1:i2]), tuple(b[j1:j2]))
            for tag, i1, i2, j1, j2 in SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
            if tag != "equal"]


def unapply(text: str, runs: tuple[tuple[Hunk, ...], ...]) -> str | None:
    """`text` with each hunk reversed (the last configure's first, bottom up), or None when
    one is not found exactly once as gpunode wrote it."""
    lines = split_lines(text)
    for run in reversed(runs):
        for context, old, new in reversed(run):
            needle = [*context, *new]
            hits = [i for i in range(len(lines) - len(needle) + 1)
                    if lines[i:i + len(needle)] == needle and (context or i == 0)]
            if len(hits) != 1:
                return None
            at = hits[0] + len(context)
            lines[at:at + len(new)] = old
    return "".join(lines)


def unified_diff(before: str, after: str, fromfile: str, tofile: str) -> str:
    """difflib's unified diff, with GNU diff's marker after a last line that has no newline
    (without it `patch` refuses the diff, or adds a newline the file never had)."""
    from difflib import unified_diff as diff

    lines = diff(split_lines(before), split_lines(after), fromfile=fromfile, tofile=tofile)
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
                   for line in lines)


def split_lines(text: str) -> list[str]:
    """Lines as `patch` counts them: split at newlines only (not at \\r, \\f, ...)."""
    parts = text.split("\n")
    return [part + "\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def pruned(doc: Any) -> Any:
    """The document without empty tables (at any depth)."""
    if not isinstance(doc, Mapping):
        return doc
    kept = {key: pruned(value) for key, value in doc.items()}
    return {key: value for key, value in kept.items() if value != {} or not isinstance(
        doc[key], Mapping)}


def parses_to_pruned(text: str, expected: dict[str, Any]) -> bool:
    try:
        return bool(pruned(loads_toml(text, "<edited>")) == pruned(expected))
    except FileError:
        return False
