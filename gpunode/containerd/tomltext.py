"""TOML as data and as text, for the containerd config edit and its undo: one key change
(`Change`), dotted-path get/set, tomlkit's in-place edit, [header] blocks, the parse-back check,
and line hunks that let an undo give back the exact bytes."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpunode.errors import EditError, FileError
from gpunode.platform.tomlread import loads_toml


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



def table_block(path: tuple[str, ...], table: Mapping[str, Any], comment: str) -> str:
    """`table` under its [header] at `path` (its parents as dotted headers only), written by
    tomlkit, after the `comment` line."""
    import tomlkit

    doc = tomlkit.document()
    node: Any = doc
    for key in path[:-1]:
        parent = tomlkit.table(is_super_table=True)
        node.add(key, parent)
        node = parent
    node.add(path[-1], tomlkit.item(table))
    return _commented(comment, tomlkit.dumps(doc))


def render_document(doc: Mapping[str, Any], comment: str) -> str:
    """A whole document, written by tomlkit, after the `comment` line."""
    import tomlkit

    return _commented(comment, tomlkit.dumps(doc))


def _commented(comment: str, text: str) -> str:
    return f"{comment}\n{text}" if comment else text


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
