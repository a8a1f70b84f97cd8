"""The containerd config edit: add or reconcile the nvidia runtime, surgically and provably.

Every edit is computed twice. First as plain data: what the parsed document must be afterwards
(`expected`). Then as text: a new runtime is appended as a block of TOML, changed values go
through tomlkit so comments, order and quoting elsewhere stay byte-identical. The new text is
accepted only if parsing it gives exactly `expected`; tomlkit has known quirks with dotted keys
and indented tables, and this check turns any of them into a refusal instead of a wrong file.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpunode.containerd import schema
from gpunode.errors import EditError, FileError
from gpunode.tomlread import loads_toml

FALLBACK_RUNTIME: dict[str, Any] = {"runtime_type": "io.containerd.runc.v2"}
BLOCK_COMMENT = "# Added by gpunode: {name} runtime, a copy of '{source}' running {binary}."
DEFAULT_COMMENT = ("# Added by gpunode: containerd's built-in default runtime '{name}', written "
                   "out because containerd 1.x drops its built-in runtimes once a file sets any.")


@dataclass(frozen=True)
class RuntimeSpec:
    name: str = "nvidia"
    binary: str = "/usr/bin/nvidia-container-runtime"
    set_as_default: bool = False
    enable_cdi: bool = False
    cdi_spec_dirs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Change:
    """One key gpunode set: its dotted path and the value before (None: it was absent)."""

    path: tuple[str, ...]
    before: Any
    after: Any

    def describe(self) -> str:
        where = ".".join(_quote_key(k) for k in self.path)
        if self.before is None and isinstance(self.after, Mapping):
            return (f"add runtime '{self.path[-1]}' ({where}): containerd's built-in default, "
                    "written out so that it survives the new runtime")
        if self.before is None:
            return f"add {where} = {_show(self.after)}"
        return f"set {where} = {_show(self.after)} (was {_show(self.before)})"


@dataclass(frozen=True)
class Edit:
    text: str
    version: int
    added_runtime: str | None = None  # name of a runtime table gpunode created, if any
    source_runtime: str | None = None
    changes: tuple[Change, ...] = field(default=())

    @property
    def changed(self) -> bool:
        return bool(self.changes) or self.added_runtime is not None

    def describe(self) -> list[str]:
        lines = []
        if self.added_runtime:
            lines.append(f"add runtime '{self.added_runtime}' (a copy of '{self.source_runtime}')")
        return lines + [c.describe() for c in self.changes]


def _unparsable(file: str, reason: str, line: int | None) -> EditError:
    return EditError(file, reason, line,
                     "fix the file by hand; gpunode does not edit what it cannot parse")


def parse(text: str, file: str) -> dict[str, Any]:
    """The document, strictly parsed; refusals name the line and say what is wrong."""
    doc = loads_toml(text, file, _unparsable)
    try:
        schema.config_version(doc)
    except schema.SchemaError as exc:
        raise EditError(file, str(exc)) from exc
    return doc


def _read(text: str, file: str) -> tuple[dict[str, Any], int, dict[str, Mapping[str, Any]]]:
    """The parsed document, its version and its runtimes, or a refusal naming the file."""
    doc = parse(text, file)
    try:
        return doc, schema.config_version(doc), schema.runtimes(doc)
    except schema.SchemaError as exc:
        raise EditError(file, str(exc)) from exc


def configure(text: str, spec: RuntimeSpec, file: str,
              effective: Mapping[str, Any] | None = None, daemon: schema.Daemon | None = None,
              imports: Imports = ()) -> Edit:
    """The edit that gives `text` the runtime `spec` describes; unchanged text when containerd
    already has it.

    `effective` is containerd's own `config dump` of the file, when it could be had: containerd
    fills built-in defaults into `runc` (2.x merges them under the file's values), and a new
    runtime name gets none, so the copy takes the source's non-zero effective values too.
    `daemon` is the containerd version that reads the file (None: unknown, then every version
    that reads this config version is considered), `imports` the files the main file imports,
    in containerd's load order (per version, where versions resolve them differently): the edit
    is judged by what containerd makes of all of them."""
    # containerd 2.x refuses a file that starts with a byte order mark; 1.x skips it, so
    # gpunode keeps one it finds. Known to be 2.x: refused here, with the fix. Version unknown:
    # the 2.x views carry it as their problem (schema.effective), so the edit is refused as
    # for any reader that would not use it — gpunode never claims a runtime some containerd
    # that may read the file would not start with.
    bom = text.startswith(schema.BOM)
    if bom and daemon is not None and daemon >= (2, 0):
        raise EditError(file, f"starts with a UTF-8 byte order mark, which {schema.show(daemon)} "
                        "refuses ('invalid character at start of key')",
                        hint="remove the first 3 bytes of the file")
    body = text.removeprefix(schema.BOM)
    doc, version, runtimes = _read(body, file)
    changes: list[Change] = []
    if not doc:
        # An empty (or comment-only) file means no settings at all; as version 1 containerd 2.x
        # would ignore a runtime written into it, as version 2 every containerd reads it.
        changes.append(Change(("version",), None, 2))
        version, doc = 2, {}
    versions = readers(version, daemon)
    before = _views(schema.Layer(file, doc, bom), imports, versions, file)
    expected = copy.deepcopy(doc)
    if changes:
        expected["version"] = 2
    source_name, source = _source_runtime(doc, runtimes, before, spec.name)
    rt_path = (*schema.runtimes_path(version), spec.name)
    added = None
    if spec.name not in runtimes and _satisfied(before, spec):
        return Edit(text=text, version=version)  # an imported file already has it
    if spec.name not in runtimes:
        builtin = schema.BUILTIN_DEFAULT_NAME
        for view in before:
            dropped = (view.origin.get(builtin) == schema.BUILTIN and not _defined_in(doc, version))
            # An empty runtimes table has already replaced 1.x's built-in map: the default
            # runtime 'runc' is gone before gpunode adds anything, and writing it back is what
            # the file's own default_runtime_name asks for.
            emptied = view.default_name == builtin and builtin not in view.runtimes
            if (builtin not in runtimes and (dropped or emptied)
                    and schema.replaces_builtin_runtimes(view.daemon) is not False):
                # Setting any runtime replaces 1.x's built-in map: write the built-in runc out
                # too, and copy the new runtime from exactly what is written.
                table = _builtin_copy(builtin, effective, version, daemon)
                changes.append(Change((*schema.runtimes_path(version), builtin), None, table))
                if source_name == builtin or emptied:
                    source_name, source, effective = builtin, table, None
                break
        _set(expected, rt_path, _new_runtime(source, source_name, spec, version, effective))
        added = spec.name
    else:
        current = runtimes[spec.name]
        options = current.get("options", {})
        if not isinstance(options, Mapping):
            raise EditError(file, f"'{'.'.join((*rt_path, 'options'))}' is not a table")
        key = schema.binary_key(current)
        if key is None:
            raise EditError(file, f"runtime '{spec.name}' has runtime_type "
                            f"'{schema.runtime_type(current)}', whose shim runs no OCI runtime "
                            "binary gpunode could point at the NVIDIA runtime",
                            hint="give the NVIDIA runtime another name (--runtime-name), or "
                            "set its runtime_type to io.containerd.runc.v2")
        if options.get(key) != spec.binary:
            _refuse_taking_over(before, spec, options.get(key), file)
            changes.append(Change((*rt_path, "options", key), options.get(key), spec.binary))
        for name, value in dict(source.get("options", {})).items():
            if name not in options and name not in ("BinaryName", "Runtime"):
                changes.append(Change((*rt_path, "options", name), None, copy.deepcopy(value)))
    changes += _cri_settings(doc, spec, version)
    for change in changes:
        _set(expected, change.path, change.after)
    after = _views(schema.Layer(file, expected, bom), imports, versions, file)
    _check(after, before, spec, file, daemon)
    edit = Edit(text=text, version=version, added_runtime=added, source_runtime=source_name,
                changes=tuple(changes))
    if not edit.changed:
        return edit
    new_text = _render(body, changes, added and (rt_path, _get(expected, rt_path)), spec,
                       source_name, expected, file)
    return Edit(text=schema.BOM + new_text if bom else new_text, version=version,
                added_runtime=added, source_runtime=source_name, changes=tuple(changes))


def _refuse_taking_over(views: list[schema.View], spec: RuntimeSpec, binary: object,
                        file: str) -> None:
    """Pointing the runtime every pod uses by default (or runc) at the NVIDIA runtime would put
    every pod of the node through it: never what a runtime name means — unless that runtime is
    already the NVIDIA one by its name or binary (a default `nvidia` runtime at an old path, as
    the toolkit's own tests have it, is reconciled)."""
    defaults = {view.default_name for view in views} | {schema.BUILTIN_DEFAULT_NAME}
    already_nvidia = "nvidia" in spec.name or (
        isinstance(binary, str) and "nvidia" in binary.rpartition("/")[2])
    if spec.name in defaults and not already_nvidia:
        raise EditError(file, f"runtime '{spec.name}' is containerd's default runtime (or runc): "
                        f"making it run {spec.binary} would put every pod of the node through "
                        "the NVIDIA runtime",
                        hint="give the NVIDIA runtime a name of its own (--runtime-name nvidia, "
                        "the default); --set-as-default makes that one the default if wanted")


Imports = Sequence[schema.Layer] | Mapping[schema.Daemon, Sequence[schema.Layer]]


def readers(version: int, daemon: schema.Daemon | None) -> tuple[schema.Daemon, ...]:
    """The containerd versions whose view of the file counts: the known one, else each
    behaviour that reads this config version (1: 1.x only, 3: 2.x only)."""
    if daemon is not None:
        return (daemon,)
    return tuple(d for d in schema.KNOWN_BEHAVIOURS
                 if (version != 1 or d < (2, 0)) and (version != 3 or d >= (2, 0)))


def _views(main: schema.Layer, imports: Imports, daemons: tuple[schema.Daemon, ...],
           file: str) -> list[schema.View]:
    try:
        views = [schema.effective([main, *(imports.get(daemon, ()) if isinstance(imports, Mapping)
                                           else imports)], daemon) for daemon in daemons]
    except schema.SchemaError as exc:
        raise EditError(file, str(exc)) from exc
    for view in views:
        if view.problem is not None:
            raise EditError(file, view.problem, hint="fix the config first: gpunode edits only a "
                            "config that containerd reads as written")
    return views


def _defined_in(doc: Mapping[str, Any], version: int) -> bool:
    """Whether the file declares a runtimes table at all (1.x then has no built-in runc)."""
    try:
        return isinstance(schema.lookup(doc, schema.runtimes_path(version)), Mapping)
    except schema.SchemaError:
        return True


def _satisfied(views: list[schema.View], spec: RuntimeSpec) -> bool:
    return all(_unmet(view, spec) is None for view in views)


def _unmet(view: schema.View, spec: RuntimeSpec) -> str | None:
    """What containerd `view` lacks of the spec, or None when it has all of it."""
    runtime = view.runtimes.get(spec.name)
    if runtime is None:
        return f"it has no runtime '{spec.name}'"
    binary = schema.runtime_binary(runtime)
    if binary != spec.binary:
        return f"runtime '{spec.name}' runs {binary or 'no configured binary'}, not {spec.binary}"
    if spec.set_as_default and view.default_name != spec.name:
        return f"its default runtime is '{view.default_name}'"
    if spec.enable_cdi and view.cri.get("enable_cdi") is not True:
        return "CDI is not enabled"
    if spec.cdi_spec_dirs and view.cri.get("cdi_spec_dirs") != list(spec.cdi_spec_dirs):
        return f"cdi_spec_dirs is {view.cri.get('cdi_spec_dirs')}"
    return None


def _check(after: list[schema.View], before: list[schema.View], spec: RuntimeSpec, file: str,
           daemon: schema.Daemon | None) -> None:
    """Refuse an edit that containerd would not see as written: an imported file that wins."""
    for view, was in zip(after, before, strict=True):
        unmet = _unmet(view, spec)
        lost = (was.default_name in was.runtimes and view.default_name not in view.runtimes)
        if unmet is None and not lost:
            continue
        who = schema.show(view.daemon)
        if daemon is None:
            who = f"{schema.behaviour(view.daemon)} (its version cannot be asked here)"
        hint = ("put the runtime into the imported file by hand, or move that file's CRI "
                "settings into this one, then run gpunode again")
        legacy = schema.lookup(view.cri, ("containerd", "default_runtime"))
        if view.cri_file not in (None, file):
            why = (f"{who} lets the CRI plugin table of {view.cri_file}, which this file imports, "
                   "replace this file's whole CRI table (containerd#5837, merged only from 2.1)")
        elif view.origin.get(spec.name) not in (None, file, schema.BUILTIN):
            why = (f"{view.origin[spec.name]}, which this file imports, sets runtime "
                   f"'{spec.name}' too and {who} reads it after this file")
        elif (spec.set_as_default and isinstance(legacy, Mapping)
              and schema.runtime_type(legacy) and view.daemon < (2, 0)):
            why = (f"{who} makes the deprecated default_runtime table the default runtime "
                   "whatever default_runtime_name says")
            hint = ("move default_runtime into a runtimes.<name> table and name it in "
                    "default_runtime_name, then run gpunode again")
        elif lost:
            why = f"{who} would lose the default runtime '{view.default_name}'"
            hint = "define the default runtime in the file, then run gpunode again"
        else:
            why = f"for {who}"
            hint = "report the file's layout as a bug; meanwhile add the runtime by hand"
        raise EditError(file, f"gpunode's change would not take effect: {why}; after it, "
                        f"{unmet or 'the default runtime is gone'}", hint=hint)


def _builtin_copy(name: str, effective: Mapping[str, Any] | None, version: int,
                  daemon: schema.Daemon | None) -> dict[str, Any]:
    """containerd's built-in default runtime as a table: from its own dump when there is one,
    else the built-in of that version (tests/data/containerd/defaults)."""
    try:
        dumped = schema.runtimes(effective).get(name) if effective is not None else None
    except schema.SchemaError:
        dumped = None
    if dumped is None or (effective or {}).get("version", 1) != version:
        return schema.builtin_runc(daemon)
    table = {k: copy.deepcopy(v) for k, v in dumped.items() if k != "options" and v not in _ZERO}
    options = dumped.get("options")
    if isinstance(options, Mapping):
        table["options"] = copy.deepcopy(dict(options))
    return table


def configure_dropin(text: str, spec: RuntimeSpec, file: str, dropin_path: str,
                     effective: Mapping[str, Any] | None = None) -> tuple[Edit, str]:
    """Drop-in mode: the runtime (and CDI/default settings) in a file of its own that the main
    config imports. Only for containerd >= 2.1, which merges imported plugin tables; older ones
    let an imported CRI table replace the main file's whole CRI table (containerd#5837).

    Returns the edit of the main file (an `imports` entry, when none matches yet) and the
    drop-in's full text, which gpunode owns and rewrites as a whole."""
    doc, version, runtimes = _read(text, file)
    views = _views(schema.Layer(file, doc, text.startswith(schema.BOM)), (),
                   (schema.MERGES_FROM,), file)
    source_name, source = _source_runtime(doc, runtimes, views, spec.name)
    dropin: dict[str, Any] = {"version": version} if "version" in doc else {}
    rt_path = (*schema.runtimes_path(version), spec.name)
    _set(dropin, rt_path, _new_runtime(source, source_name, spec, version, effective))
    for change in _cri_settings({}, spec, version):
        _set(dropin, change.path, change.after)
    dropin_text = _render_document(dropin, BLOCK_COMMENT.format(
        name=spec.name, source=source_name, binary=spec.binary))
    _verify(dropin_text, dropin, dropin_path)

    patterns = doc.get("imports", [])
    if not isinstance(patterns, list):
        raise EditError(file, "'imports' is not a list")
    if any(schema.import_matches(file, str(p), dropin_path) for p in patterns):
        return Edit(text=text, version=version), dropin_text
    change = Change(("imports",), patterns or None, [*patterns, dropin_path])
    expected = copy.deepcopy(doc)
    _set(expected, change.path, change.after)
    new_text = _tomlkit_edit(text, [change], None, file)
    _verify(new_text, expected, file)
    return Edit(text=new_text, version=version, changes=(change,)), dropin_text


# -- pure helpers --------------------------------------------------------------------------------


def _source_runtime(doc: Mapping[str, Any], runtimes: Mapping[str, Mapping[str, Any]],
                    views: list[schema.View], name: str) -> tuple[str, Mapping[str, Any]]:
    """The runtime to copy: the default one, else runc, else crun, else a plain runc v2 shim;
    only one whose shim runs a binary gpunode can point elsewhere (not kata, not the legacy
    linux shim on 2.x, which has none). The file's own table when it has one."""
    view = views[0]
    for candidate in (view.default_name, "runc", "crun"):
        table = runtimes.get(candidate) or view.runtimes.get(candidate)
        if candidate == name or table is None or schema.binary_key(table) is None:
            continue
        if schema.runtime_type(table) == schema.LEGACY_LINUX and view.daemon >= (2, 0):
            continue
        return candidate, table
    return "io.containerd.runc.v2 defaults", FALLBACK_RUNTIME


def _new_runtime(source: Mapping[str, Any], source_name: str, spec: RuntimeSpec, version: int,
                 effective: Mapping[str, Any] | None) -> dict[str, Any]:
    runtime = copy.deepcopy(dict(source))
    if effective is not None:
        _fill_from_effective(runtime, effective, source_name, version)
    if not schema.runtime_type(runtime):
        runtime["runtime_type"] = schema.RUNC_V2  # what containerd runs for an empty type
    options = runtime.setdefault("options", {})
    key = schema.binary_key(runtime) or "BinaryName"
    options[key] = spec.binary
    if key != "BinaryName" and "BinaryName" in options:
        options["BinaryName"] = spec.binary  # ignored by the legacy shim; not left contradicting
    return runtime


def _cri_settings(doc: Mapping[str, Any], spec: RuntimeSpec, version: int) -> list[Change]:
    """Default runtime and CDI keys the spec asks for, where `doc` does not have them yet."""
    cri = schema.cri_path(version)
    changes: list[Change] = []
    if spec.set_as_default:
        _want(doc, (*cri, "containerd", "default_runtime_name"), spec.name, changes)
    if spec.enable_cdi:
        _want(doc, (*cri, "enable_cdi"), True, changes)
    if spec.cdi_spec_dirs:
        _want(doc, (*cri, "cdi_spec_dirs"), list(spec.cdi_spec_dirs), changes)
    return changes


# Runtime keys whose name differs between config versions (containerd's v2 → v3 migration).
_V3_TO_V2_KEYS = {"sandboxer": "sandbox_mode"}


def _fill_from_effective(runtime: dict[str, Any], effective: Mapping[str, Any], source: str,
                         version: int) -> None:
    """Add the source runtime's effective non-zero values that the file leaves to defaults."""
    try:
        dumped = schema.runtimes(effective).get(source)
        dumped_version = schema.config_version(effective)
    except schema.SchemaError:
        return
    if dumped is None:
        return
    for key, value in dumped.items():
        if dumped_version == 3 and version < 3:
            key = _V3_TO_V2_KEYS.get(key, key)
        if key == "options" and isinstance(value, Mapping):
            # A free-form map for the shim: containerd shows (and passes) exactly its entries,
            # zero values included, so the copy takes them all.
            options = runtime.setdefault("options", {})
            for name, option in value.items():
                if name not in options and name not in ("BinaryName", "Runtime"):
                    options[name] = copy.deepcopy(option)
        elif key not in runtime and value not in _ZERO:  # struct fields: zero is the default
            runtime[key] = copy.deepcopy(value)


_ZERO: tuple[Any, ...] = ("", 0, False, [], {})


def _want(doc: Mapping[str, Any], path: tuple[str, ...], value: Any, changes: list[Change]) -> None:
    current = schema.lookup(doc, path)
    if current != value:
        changes.append(Change(path, current, value))


def _get(doc: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(doc, Mapping) or key not in doc:
            return None
        doc = doc[key]
    return doc


def _set(doc: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
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


def _delete(doc: dict[str, Any], path: tuple[str, ...]) -> None:
    _set(doc, path, None)


# -- text ----------------------------------------------------------------------------------------


def _render(text: str, changes: list[Change], new_table: Any, spec: RuntimeSpec,
            source_name: str, expected: dict[str, Any], file: str) -> str:
    # New tables (the runtime, a default runtime written out) are appended as [header] blocks;
    # values inside existing tables go through tomlkit.
    blocks = [c for c in changes if c.before is None and isinstance(c.after, Mapping)]
    values = [c for c in changes if c not in blocks]
    base = _tomlkit_edit(text, values, None, file) if values else text
    tables = ([(new_table[0], new_table[1], BLOCK_COMMENT.format(
        name=spec.name, source=source_name, binary=spec.binary))] if new_table else [])
    tables += [(c.path, c.after, DEFAULT_COMMENT.format(name=c.path[-1])) for c in blocks]
    if tables:
        appended = base.rstrip("\n") + "".join(
            "\n\n" + _table_block(path, table, comment).rstrip("\n")
            for path, table, comment in tables) + "\n"
        if _parses_to(appended.lstrip("\n"), expected):
            return appended.lstrip("\n")
        # e.g. runtimes written as an inline table, which no [header] may extend
        base = _tomlkit_edit(base, [Change(path, None, table) for path, table, _ in tables],
                             None, file)
    _verify(base, expected, file)
    return base


def _table_block(path: tuple[str, ...], table: Mapping[str, Any], comment: str) -> str:
    """`table` as [header] sections: scalars first, then each sub-table under its own header."""
    import tomlkit

    scalars = [f"{_quote_key(k)} = {tomlkit.item(v).as_string()}" for k, v in table.items()
               if not isinstance(v, Mapping)]
    subtables = [(k, v) for k, v in table.items() if isinstance(v, Mapping)]
    lines = [comment] if comment else []
    if scalars or not subtables or comment:  # a table with only sub-tables needs no header
        lines.append("[" + ".".join(_quote_key(k) for k in path) + "]")
    text = "\n".join(lines + scalars) + "\n" if lines or scalars else ""
    for key, value in subtables:
        sub = _table_block((*path, key), value, "")
        text += ("\n" if text else "") + sub
    return text


def _render_document(doc: Mapping[str, Any], comment: str) -> str:
    """A whole document: top-level keys, then every table under its own [header]."""
    import tomlkit

    lines = [comment] + [f"{_quote_key(k)} = {tomlkit.item(v).as_string()}"
                         for k, v in doc.items() if not isinstance(v, Mapping)]
    text = "\n".join(lines) + "\n"
    for key, value in doc.items():
        if isinstance(value, Mapping):
            text += "\n" + _table_block((key,), value, "")
    return text


def _tomlkit_edit(text: str, changes: list[Change], delete: tuple[str, ...] | None,
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


def _parses_to(text: str, expected: dict[str, Any]) -> bool:
    try:
        return _same(loads_toml(text, "<edited>"), expected)
    except FileError:
        return False


def _same(a: Any, b: Any) -> bool:
    """Equality of parsed TOML where nan equals nan (TOML has it; `nan != nan` in Python)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _verify(text: str, expected: dict[str, Any], file: str) -> None:
    if not _parses_to(text, expected):
        raise EditError(file, "gpunode could not express this change without altering other "
                        "settings, so it changed nothing",
                        hint="add the runtime by hand, or report the file's layout as a bug")


_BARE_KEY = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def _quote_key(key: str) -> str:
    return key if key and set(key) <= _BARE_KEY else '"' + key.replace('"', '\\"') + '"'


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return str(value)


# -- revert --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kept:
    """A change gpunode recorded but does not undo: the value was changed by someone since."""

    change: Change
    current: Any

    def describe(self) -> str:
        where = ".".join(_quote_key(k) for k in self.change.path)
        if isinstance(self.change.after, Mapping) and self.change.before is None:
            if self.current is None:
                return f"{where}: already removed"
            differs = ", ".join(_differences(self.change.after, self.current)) or "its layout"
            return (f"kept the table {where}: it was changed since gpunode added it "
                    f"(differs in {differs})")
        if self.current is None:
            return f"kept {where} absent: it was removed since gpunode set it"
        return (f"kept {where} = {_show(self.current)}: it was changed since gpunode set it to "
                f"{_show(self.change.after)}")


@dataclass(frozen=True)
class Reverted:
    text: str
    undone: tuple[Change, ...]  # (path, the value gpunode wrote, the value put back)
    kept: tuple[Kept, ...]

    @property
    def changed(self) -> bool:
        return bool(self.undone)

    def describe(self) -> list[str]:
        lines = []
        for change in self.undone:
            where = ".".join(_quote_key(k) for k in change.path)
            if change.after is None:
                lines.append(f"remove {where}")
            else:
                lines.append(f"set {where} = {_show(change.after)} (back from "
                             f"{_show(change.before)})")
        return lines + [k.describe() for k in self.kept]


def revert(text: str, added_runtime: str | None, changes: tuple[Change, ...], file: str,
           hunks: tuple[tuple[Hunk, ...], ...] = ()) -> Reverted:
    """Undo what `configure` recorded, and only where the value is still what gpunode wrote.

    `changes` are in the order gpunode made them; a whole table it added is one change whose
    `after` is the table (`added_runtime` alone, from a ledger that predates that, removes the
    runtime as it is). A value someone changed since is kept and said so.

    The text: `hunks` are the line changes each configure made (`text_hunks`); reversed where
    they are still found as written, they give back every byte gpunode changed (blank lines
    tomlkit added included) and no other. That text is used when it parses to exactly the
    document the key-level undo gives; otherwise the key-level edit's text (tomlkit for
    values, gpunode's appended block cut out) is."""
    doc = parse(text, file)
    version = schema.config_version(doc)
    if added_runtime is not None:
        path = (*schema.runtimes_path(version), added_runtime)
        current = _get(doc, path)
        if current is not None and not any(c.path == path for c in changes):
            changes = (*changes, Change(path, None, current))
    expected = copy.deepcopy(doc)
    undo: list[Change] = []
    kept: list[Kept] = []
    for change in reversed(changes):
        current = _get(expected, change.path)
        if current == change.before:
            continue  # already as it was
        value = _undo_value(change, current)
        if value is _KEEP:
            kept.append(Kept(change, current))
            continue
        undo.append(Change(change.path, current, value))
        _set(expected, change.path, value)
    if not undo:
        return Reverted(text, (), tuple(kept))
    exact = _unapply(text, hunks) if hunks else None
    if exact is not None and _parses_to_pruned(exact, expected):
        return Reverted(exact, tuple(undo), tuple(kept))
    new_text = text
    tables = [c for c in undo if c.after is None and isinstance(c.before, Mapping)]
    values = [c for c in undo if c not in tables]
    if values:
        new_text = _tomlkit_edit(new_text, values, None, file)
    for table in tables:
        new_text = _remove_table(new_text, table.path, file)
    # A table gpunode's key was the only content of stays as an empty header; empty tables
    # mean nothing to containerd, so they do not count as a difference.
    if not _parses_to_pruned(new_text, expected):
        _verify(new_text, expected, file)
    return Reverted(new_text, tuple(undo), tuple(kept))


# One configure's line change: up to two lines of context before it (as gpunode wrote them),
# the lines it replaced, and the lines it wrote.
Hunk = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]
MAX_HUNK_LINES = 50_000  # beyond that the line diff costs more than it saves


def text_hunks(before: str, after: str) -> list[Hunk]:
    """The line changes that turn `before` into `after` (empty for a huge file)."""
    from difflib import SequenceMatcher

    a, b = _split_lines(before), _split_lines(after)
    if len(a) > MAX_HUNK_LINES:
        return []
    return [(tuple(b[max(0, j1 - 2):j1]), tuple(a[i1:i2]), tuple(b[j1:j2]))
            for tag, i1, i2, j1, j2 in SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
            if tag != "equal"]


def _unapply(text: str, runs: tuple[tuple[Hunk, ...], ...]) -> str | None:
    """`text` with each hunk reversed (the last configure's first, bottom up), or None when
    one is not found exactly once as gpunode wrote it."""
    lines = _split_lines(text)
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


def _split_lines(text: str) -> list[str]:
    parts = text.split("\n")
    return [part + "\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def pruned(doc: Any) -> Any:
    """The document without empty tables (at any depth)."""
    if not isinstance(doc, Mapping):
        return doc
    kept = {key: pruned(value) for key, value in doc.items()}
    return {key: value for key, value in kept.items() if value != {} or not isinstance(
        doc[key], Mapping)}


def _parses_to_pruned(text: str, expected: dict[str, Any]) -> bool:
    try:
        return bool(pruned(loads_toml(text, "<edited>")) == pruned(expected))
    except FileError:
        return False


_KEEP = object()


def _undo_value(change: Change, current: Any) -> Any:
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
    expected = loads_toml(text, file, _unparsable)
    _set(expected, path, None)
    if without is not None and _parses_to_pruned(without, expected):
        return without
    return _strip_block_comment(_tomlkit_edit(text, [], path, file), name)


def _remove_block(text: str, path: tuple[str, ...], name: str) -> str | None:
    """Cut the block gpunode appended for runtime `name`: its comment line, its [headers] and
    their keys, and the blank line gpunode put before it. The block ends at the first comment
    or header that is not its own, and blank lines after it stay: what follows is not
    gpunode's. None when the block is not recognisable any more."""
    lines = text.splitlines(keepends=True)
    marker = BLOCK_COMMENT.split("{name}")[0] + name + " runtime"
    start = next((i for i, line in enumerate(lines) if line.startswith(marker)), None)
    if start is None:
        return None
    header = "[" + ".".join(_quote_key(k) for k in path)
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
    prefix = BLOCK_COMMENT.split("{name}")[0] + removed + " runtime"
    return "".join(line for line in text.splitlines(keepends=True)
                   if not line.startswith(prefix))


def _differences(wrote: Any, now: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two tables."""
    if not (isinstance(wrote, Mapping) and isinstance(now, Mapping)):
        return [prefix] if wrote != now and prefix else []
    found: list[str] = []
    for key in sorted({*wrote, *now}):
        found += _differences(wrote.get(key), now.get(key),
                              f"{prefix}.{_quote_key(key)}" if prefix else _quote_key(key))
    return found
