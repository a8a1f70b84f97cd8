"""The containerd config edit: add or reconcile the nvidia runtime, surgically and provably.

Every edit is computed twice. First as plain data: what the parsed document must be afterwards
(`expected`). Then as text: a new runtime is appended as a block of TOML, changed values go
through tomlkit so comments, order and quoting elsewhere stay byte-identical. The new text is
accepted only if parsing it gives exactly `expected`; tomlkit has known quirks with dotted keys
and indented tables, and this check turns any of them into a refusal instead of a wrong file.

The TOML helpers (data and text) are in tomltext.py; undoing an edit is undo.py.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpunode.containerd import schema, tomltext
from gpunode.containerd.tomltext import Change
from gpunode.errors import EditError
from gpunode.platform.tomlread import loads_toml

FALLBACK_RUNTIME: dict[str, Any] = {"runtime_type": "io.containerd.runc.v2"}
BLOCK_COMMENT = "# Added by gpunode: {name} runtime, a copy of '{source}' running {binary}."
DEFAULT_COMMENT = ("# Added by gpunode: containerd's built-in default runtime '{name}', written "
                   "out because containerd 1.x drops its built-in runtimes once a file sets any.")


@dataclass(frozen=True)
class RuntimeSpec:
    """The NVIDIA runtime a containerd config must define, with the CRI settings beside it."""

    name: str = "nvidia"
    binary: str = "/usr/bin/nvidia-container-runtime"
    set_as_default: bool = False
    enable_cdi: bool = False
    cdi_spec_dirs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Edit:
    """A containerd config's new text, and what changed in it to get there."""

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
    runtime name gets none, so the copy takes the source's non-zero effective values too. For a
    `daemon` whose defaults gpunode knows (schema.KNOWN_DEFAULTS) its views give the same
    values, and the dump need not be asked.
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
    before = views_of(schema.Layer(file, doc, bom), imports, versions, file)
    if effective is None and daemon in schema.KNOWN_DEFAULTS:
        effective = schema.reading(before[0])  # what its dump would show (no need to ask)
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
        tomltext.set_path(expected, rt_path,
                          _new_runtime(source, source_name, spec, version, effective))
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
    changes += cri_settings(doc, spec, version)
    for change in changes:
        tomltext.set_path(expected, change.path, change.after)
    after = views_of(schema.Layer(file, expected, bom), imports, versions, file)
    _check(after, before, spec, file, daemon)
    edit = Edit(text=text, version=version, added_runtime=added, source_runtime=source_name,
                changes=tuple(changes))
    if not edit.changed:
        return edit
    new_table = added and (rt_path, tomltext.get_path(expected, rt_path))
    new_text = _render(body, changes, new_table, spec, source_name, expected, file)
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


def views_of(main: schema.Layer, imports: Imports, daemons: tuple[schema.Daemon, ...],
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
                     effective: Mapping[str, Any] | None = None,
                     extra: Sequence[RuntimeSpec] = (),
                     daemon: schema.Daemon | None = None) -> tuple[Edit, str]:
    """Drop-in mode: the runtime (and CDI/default settings) in a file of its own that the main
    config imports. Only for containerd >= 2.1, which merges imported plugin tables; older ones
    let an imported CRI table replace the main file's whole CRI table (containerd#5837).
    `effective` and `daemon` as for `configure`.

    Returns the edit of the main file (an `imports` entry, when none matches yet) and the
    drop-in's full text, which gpunode owns and rewrites as a whole."""
    doc, version, runtimes = _read(text, file)
    views = views_of(schema.Layer(file, doc, text.startswith(schema.BOM)), (),
                   (schema.MERGES_FROM,), file)
    if effective is None and daemon in schema.KNOWN_DEFAULTS:
        effective = schema.reading(views[0])
    source_name, source = _source_runtime(doc, runtimes, views, spec.name)
    dropin: dict[str, Any] = {"version": version} if "version" in doc else {}
    rt_path = (*schema.runtimes_path(version), spec.name)
    for one in (spec, *extra):  # extra: the toolkit's mode runtimes (wiring.py), copies alike
        tomltext.set_path(dropin, (*rt_path[:-1], one.name),
                          _new_runtime(source, source_name, one, version, effective))
    for change in cri_settings({}, spec, version):
        tomltext.set_path(dropin, change.path, change.after)
    dropin_text = tomltext.render_document(dropin, BLOCK_COMMENT.format(
        name=spec.name, source=source_name, binary=spec.binary))
    tomltext.verify(dropin_text, dropin, dropin_path)

    patterns = doc.get("imports", [])
    if not isinstance(patterns, list):
        raise EditError(file, "'imports' is not a list")
    if any(schema.import_matches(file, str(p), dropin_path) for p in patterns):
        return Edit(text=text, version=version), dropin_text
    change = Change(("imports",), patterns or None, [*patterns, dropin_path])
    expected = copy.deepcopy(doc)
    tomltext.set_path(expected, change.path, change.after)
    new_text = tomltext.tomlkit_edit(text, [change], None, file)
    tomltext.verify(new_text, expected, file)
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


def cri_settings(doc: Mapping[str, Any], spec: RuntimeSpec, version: int) -> list[Change]:
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


def _render(text: str, changes: list[Change], new_table: Any, spec: RuntimeSpec,
            source_name: str, expected: dict[str, Any], file: str) -> str:
    # New tables (the runtime, a default runtime written out) are appended as [header] blocks;
    # values inside existing tables go through tomlkit.
    blocks = [c for c in changes if c.before is None and isinstance(c.after, Mapping)]
    values = [c for c in changes if c not in blocks]
    base = tomltext.tomlkit_edit(text, values, None, file) if values else text
    tables = ([(new_table[0], new_table[1], BLOCK_COMMENT.format(
        name=spec.name, source=source_name, binary=spec.binary))] if new_table else [])
    tables += [(c.path, c.after, DEFAULT_COMMENT.format(name=c.path[-1])) for c in blocks]
    if tables:
        appended = base.rstrip("\n") + "".join(
            "\n\n" + tomltext.table_block(path, table, comment).rstrip("\n")
            for path, table, comment in tables) + "\n"
        if tomltext.parses_to(appended.lstrip("\n"), expected):
            return appended.lstrip("\n")
        # e.g. runtimes written as an inline table, which no [header] may extend
        base = tomltext.tomlkit_edit(base, [Change(path, None, table) for path, table, _ in tables],
                             None, file)
    tomltext.verify(base, expected, file)
    return base


