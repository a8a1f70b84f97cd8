"""Undoing the containerd config edit: only the values still as gpunode wrote them, byte for
byte where the recorded line hunks are still found, and a word for every value kept."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpunode.containerd import edit, schema, tomltext
from gpunode.platform.tomlread import loads_toml


@dataclass(frozen=True)
class Kept:
    """A change gpunode recorded but does not undo: the value was changed by someone since."""

    change: tomltext.Change
    current: Any

    def describe(self) -> str:
        where = ".".join(tomltext.quote_key(k) for k in self.change.path)
        if isinstance(self.change.after, Mapping) and self.change.before is None:
            if self.current is None:
                return f"{where}: already removed"
            differs = ", ".join(_differences(self.change.after, self.current)) or "its layout"
            return (f"kept the table {where}: it was changed since gpunode added it "
                    f"(differs in {differs})")
        if self.current is None:
            return f"kept {where} absent: it was removed since gpunode set it"
        return (f"kept {where} = {tomltext.show(self.current)}: it was changed since gpunode "
                f"set it to {tomltext.show(self.change.after)}")


@dataclass(frozen=True)
class Reverted:
    """A containerd config with gpunode's changes undone where they still stand; a value someone
    changed since is kept."""

    text: str
    undone: tuple[tomltext.Change, ...]  # (path, the value gpunode wrote, the value put back)
    kept: tuple[Kept, ...]

    @property
    def changed(self) -> bool:
        return bool(self.undone)

    def describe(self) -> list[str]:
        lines = []
        for change in self.undone:
            where = ".".join(tomltext.quote_key(k) for k in change.path)
            if change.after is None:
                lines.append(f"remove {where}")
            else:
                lines.append(f"set {where} = {tomltext.show(change.after)} (back from "
                             f"{tomltext.show(change.before)})")
        return lines + [k.describe() for k in self.kept]


def revert(text: str, added_runtime: str | None, changes: tuple[tomltext.Change, ...], file: str,
           hunks: tuple[tuple[tomltext.Hunk, ...], ...] = ()) -> Reverted:
    """Undo what `configure` recorded, and only where the value is still what gpunode wrote.

    `changes` are in the order gpunode made them; a whole table it added is one change whose
    `after` is the table (`added_runtime` alone, from a ledger that predates that, removes the
    runtime as it is). A value someone changed since is kept and said so.

    The text: `hunks` are the line changes each configure made (`text_hunks`); reversed where
    they are still found as written, they give back every byte gpunode changed (blank lines
    tomlkit added included) and no other. That text is used when it parses to exactly the
    document the key-level undo gives; otherwise the key-level edit's text (tomlkit for
    values, gpunode's appended block cut out) is."""
    doc = edit.parse(text, file)
    version = schema.config_version(doc)
    if added_runtime is not None:
        path = (*schema.runtimes_path(version), added_runtime)
        current = tomltext.get_path(doc, path)
        if current is not None and not any(c.path == path for c in changes):
            changes = (*changes, tomltext.Change(path, None, current))
    expected = copy.deepcopy(doc)
    undo: list[tomltext.Change] = []
    kept: list[Kept] = []
    for change in reversed(changes):
        current = tomltext.get_path(expected, change.path)
        if current == change.before:
            continue  # already as it was
        value = _undo_value(change, current)
        if value is _KEEP:
            kept.append(Kept(change, current))
            continue
        undo.append(tomltext.Change(change.path, current, value))
        tomltext.set_path(expected, change.path, value)
    if not undo:
        return Reverted(text, (), tuple(kept))
    exact = tomltext.unapply(text, hunks) if hunks else None
    if exact is not None and tomltext.parses_to_pruned(exact, expected):
        return Reverted(exact, tuple(undo), tuple(kept))
    new_text = text
    tables = [c for c in undo if c.after is None and isinstance(c.before, Mapping)]
    values = [c for c in undo if c not in tables]
    if values:
        new_text = tomltext.tomlkit_edit(new_text, values, None, file)
    for table in tables:
        new_text = _remove_table(new_text, table.path, file)
    # A table gpunode's key was the only content of stays as an empty header; empty tables
    # mean nothing to containerd, so they do not count as a difference.
    if not tomltext.parses_to_pruned(new_text, expected):
        tomltext.verify(new_text, expected, file)
    return Reverted(new_text, tuple(undo), tuple(kept))


_KEEP = object()


def _undo_value(change: tomltext.Change, current: Any) -> Any:
    """The value to put back, or _KEEP when the current value is no longer gpunode's."""
    if current == change.after:
        return change.before
    before = change.before if change.before is not None else []
    after = change.after
    if (isinstance(before, list) and isinstance(after, list) and isinstance(current, list)
            and after[: len(before)] == before):
        # gpunode appended to a list (imports): take out what it appended, keep the rest
        added = after[len(before):]
        if added and all(item in current for item in added):
            rest = [item for item in current if item not in added]
            return rest if rest or change.before is not None else None
    return _KEEP


def _remove_table(text: str, path: tuple[str, ...], file: str) -> str:
    """The text without the table at `path`: gpunode's appended block cut out exactly when it
    is recognisable, else through tomlkit (its comment line dropped too)."""
    name = path[-1]
    without = _remove_block(text, path, name)
    expected = loads_toml(text, file, edit._unparsable)
    tomltext.set_path(expected, path, None)
    if without is not None and tomltext.parses_to_pruned(without, expected):
        return without
    return _strip_block_comment(tomltext.tomlkit_edit(text, [], path, file), name)


def _remove_block(text: str, path: tuple[str, ...], name: str) -> str | None:
    """Cut the block gpunode appended for runtime `name`: its comment line, its [headers] and
    their keys, and the blank line gpunode put before it. The block ends at the first comment
    or header that is not its own, and blank lines after it stay: what follows is not
    gpunode's. None when the block is not recognisable any more."""
    lines = text.splitlines(keepends=True)
    marker = edit.BLOCK_COMMENT.split("{name}")[0] + name + " runtime"
    start = next((i for i, line in enumerate(lines) if line.startswith(marker)), None)
    if start is None:
        return None
    header = "[" + ".".join(tomltext.quote_key(k) for k in path)
    end = start + 1
    while end < len(lines):
        line = lines[end].strip()
        if line.startswith("#") or (line.startswith("[") and not line.startswith(
                (header + "]", header + "."))):
            break
        end += 1
    while end > start + 1 and not lines[end - 1].strip():
        end -= 1
    if start > 0 and not lines[start - 1].strip():
        start -= 1
    return "".join(lines[:start] + lines[end:])


def _strip_block_comment(text: str, removed: str) -> str:
    """Drop the comment line gpunode wrote above a runtime it added, once the runtime is gone."""
    prefix = edit.BLOCK_COMMENT.split("{name}")[0] + removed + " runtime"
    return "".join(line for line in text.splitlines(keepends=True)
                   if not line.startswith(prefix))


def _differences(wrote: Any, now: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two tables."""
    if not (isinstance(wrote, Mapping) and isinstance(now, Mapping)):
        return [prefix] if wrote != now and prefix else []
    found: list[str] = []
    for key in sorted({*wrote, *now}):
        quoted = tomltext.quote_key(key)
        found += _differences(wrote.get(key), now.get(key),
                              f"{prefix}.{quoted}" if prefix else quoted)
    return found
