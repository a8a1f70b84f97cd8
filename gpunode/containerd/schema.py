"""The one place that knows where things live in a containerd config, per config version.

Nobody else spells `doc["plugins"][...]`: callers ask for the CRI plugin table or the runtimes.
It is longer than most modules because it is also the one place that knows what each
containerd version makes of those tables (built-ins, merges, imports, its dump), each rule
beside the paths it reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpunode.platform import tomlread

# version → name of the CRI plugin table that holds runtimes (containerd#5837 and the v3 split)
CRI_PLUGIN: dict[int, str] = {
    1: "cri",
    2: "io.containerd.grpc.v1.cri",
    3: "io.containerd.cri.v1.runtime",
}


# containerd configs are kilobytes; gpunode parses a file several times per edit (pure-Python
# TOML, about 1 s per MiB), so every read of a containerd config (the main file, its imports,
# its backup) is capped at this size: one refusal, whatever the size beyond it.
MAX_CONFIG_BYTES = 1 << 20
BOM = tomlread.BOM  # containerd 1.x skips a UTF-8 byte order mark; 2.x refuses the file
CONFIG_HINT = ("a containerd config is a regular UTF-8 file of at most "
               f"{MAX_CONFIG_BYTES >> 20} MiB, normally a few KiB: fix or replace it (move "
               "registry settings to config_path directories, hosts.toml, if that is what "
               "filled it), then run gpunode again")


class SchemaError(ValueError):
    """The document is not a containerd config gpunode understands; the message says why."""


def config_version(doc: Mapping[str, Any]) -> int:
    """No `version` key means 1; 2 and 3 are what containerd 1.x and 2.x write."""
    version = doc.get("version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version not in CRI_PLUGIN:
        raise SchemaError(f"'version' is {version!r}; gpunode understands 1 (or no version), 2 "
                          "and 3")
    return version


def cri_path(version: int) -> tuple[str, ...]:
    return ("plugins", CRI_PLUGIN[version])


def runtimes_path(version: int) -> tuple[str, ...]:
    return (*cri_path(version), "containerd", "runtimes")


def lookup(doc: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    """The value at `path`, or None when any part is missing; a non-table on the way is an error."""
    node: Any = doc
    for depth, key in enumerate(path):
        if not isinstance(node, Mapping):
            raise SchemaError(f"'{'.'.join(path[:depth])}' is not a table")
        node = node.get(key)
        if node is None:
            return None
    return node


def runtimes(doc: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """name → runtime table of the document's CRI plugin (empty when there are none)."""
    path = runtimes_path(config_version(doc))
    table = lookup(doc, path)
    if table is None:
        return {}
    if not isinstance(table, Mapping):
        raise SchemaError(f"'{'.'.join(path)}' is not a table")
    return {name: rt for name, rt in table.items() if isinstance(rt, Mapping)}


def binary_name(runtime: Mapping[str, Any]) -> str | None:
    options = runtime.get("options")
    value = options.get("BinaryName") if isinstance(options, Mapping) else None
    return value if isinstance(value, str) and value else None


# -- what a runtime runs -------------------------------------------------------------------------

RUNC_V2 = "io.containerd.runc.v2"
# Shims that run an OCI runtime binary named in their options: runc v1/v2 read
# `options.BinaryName` (runc's options.proto), the legacy linux shim reads `options.Runtime`
# (runctypes.RuncOptions). Any other type (kata, gVisor, wasm...) runs its own thing.
LEGACY_LINUX = "io.containerd.runtime.v1.linux"
BINARY_KEY: dict[str, str] = {RUNC_V2: "BinaryName", "io.containerd.runc.v1": "BinaryName",
                              LEGACY_LINUX: "Runtime"}


def runtime_type(runtime: Mapping[str, Any]) -> str:
    value = runtime.get("runtime_type")
    return value if isinstance(value, str) else ""


def binary_key(runtime: Mapping[str, Any]) -> str | None:
    """The option the runtime's shim runs as the OCI runtime, None for a shim that runs none.

    An empty type is what gpunode writes as runc v2 in a copy, so it counts as BinaryName."""
    kind = runtime_type(runtime)
    return BINARY_KEY.get(kind or RUNC_V2)


def runtime_binary(runtime: Mapping[str, Any]) -> str | None:
    """The binary the runtime's shim runs, or None when the shim runs no configurable one."""
    key = binary_key(runtime)
    options = runtime.get("options")
    value = options.get(key) if key and isinstance(options, Mapping) else None
    return value if isinstance(value, str) and value else None


# -- what each containerd version does (checked against real binaries in
# tests/integration/test_containerd_real.py; the defaults are tests/data/containerd/defaults/) ----

Daemon = tuple[int, int]  # (major, minor) of the containerd binary; None where unknown

MERGES_FROM = (2, 1)  # containerd#5837: imported plugin tables merge from 2.1, replace before
# 1.x decodes a file's `runtimes` map *over* the built-in one, so a file that sets any runtime
# has no built-in runc; 2.x merges them (2.0 is not tested, and assumed to behave like 1.x where
# that assumption is the safe one: writing runc explicitly is harmless when maps merge).
RUNTIMES_MERGE_FROM = (2, 1)

# The built-in runtime every containerd has when the file sets none: `config default` of each
# version, reduced to what a copy must carry (non-zero fields; options in full, as containerd
# passes them to the shim).
BUILTIN_DEFAULT_NAME = "runc"
_RUNC_OPTIONS_1X: dict[str, Any] = {
    "BinaryName": "", "CriuImagePath": "", "CriuPath": "", "CriuWorkPath": "", "IoGid": 0,
    "IoUid": 0, "NoNewKeyring": False, "NoPivotRoot": False, "Root": "", "ShimCgroup": "",
    "SystemdCgroup": False}
BUILTIN_RUNC: dict[Daemon, dict[str, Any]] = {
    (1, 6): {"runtime_type": RUNC_V2, "options": _RUNC_OPTIONS_1X},
    (1, 7): {"runtime_type": RUNC_V2, "sandbox_mode": "podsandbox", "options": _RUNC_OPTIONS_1X},
    (2, 1): {"runtime_type": RUNC_V2, "options": {
        k: v for k, v in _RUNC_OPTIONS_1X.items() if k not in ("CriuPath", "NoPivotRoot")}},
}
_1X = ((1, 6), (1, 7))
# The versions whose `config dump` of a file's runtimes gpunode knows from the files alone
# (`reading`): every input of tests/integration/test_containerd_dump.py is configured alike
# from their real dump and from that reading. For these the dump need not be asked; for any
# other version it still is.
KNOWN_DEFAULTS = frozenset(BUILTIN_RUNC)
# What a dump shows of the built-in runc beyond BUILTIN_RUNC: 2.1's sandboxer, which a copy
# into a version 2 file writes as sandbox_mode (BUILTIN_RUNC is written out as either version).
_DUMPED_RUNC: dict[Daemon, dict[str, Any]] = {(2, 1): {"sandboxer": "podsandbox"}}


def builtin_runc(daemon: Daemon | None) -> dict[str, Any]:
    """The built-in runc of `daemon`, or (unknown version) what every 1.x has in common: a
    runtime written this way is the built-in one wherever it is read."""
    if daemon in BUILTIN_RUNC:
        table = BUILTIN_RUNC[daemon]
        return {k: dict(v) if isinstance(v, Mapping) else v for k, v in table.items()}
    tables = [BUILTIN_RUNC[v] for v in _1X]
    common = {k: v for k, v in tables[0].items() if k != "options"
              and all(t.get(k) == v for t in tables)}
    options = {k: v for k, v in tables[0]["options"].items()
               if all(t["options"].get(k) == v for t in tables)}
    return {**common, "options": options}


def reading(view: View) -> dict[str, Any]:
    """The runtimes of containerd `view.daemon`'s `config dump`, shaped as that dump (version 3
    from 2.0 on, else 2), for a version in KNOWN_DEFAULTS: what a copy takes from the dump."""
    version = 3 if view.daemon >= (2, 0) else 2
    runtimes = {name: dict(table) for name, table in view.runtimes.items()}
    extra = _DUMPED_RUNC.get(view.daemon)
    if extra and view.origin.get(BUILTIN_DEFAULT_NAME) is not None:
        runtimes[BUILTIN_DEFAULT_NAME] = _deep_merge(extra, runtimes[BUILTIN_DEFAULT_NAME])
    dump: dict[str, Any] = {"version": version}
    node = dump
    for key in runtimes_path(version)[:-1]:
        node = node.setdefault(key, {})
    node["runtimes"] = runtimes
    return dump


def replaces_builtin_runtimes(daemon: Daemon | None) -> bool | None:
    """Whether a file's runtimes map replaces the built-in one; None: depends on the version."""
    return None if daemon is None else daemon < RUNTIMES_MERGE_FROM


def behaviour(daemon: Daemon) -> str:
    """One of KNOWN_BEHAVIOURS as the range of versions it stands for."""
    return "containerd 2.1+" if daemon >= MERGES_FROM else show(daemon)


def show(daemon: Daemon | None) -> str:
    if daemon is None:
        return "containerd (version unknown)"
    return f"containerd {daemon[0]}.{daemon[1]}"


# -- imports: which files containerd reads, and how it merges them -------------------------------


def go_match(pattern: str, name: str) -> bool:
    """Go's filepath.Match, which containerd's imports use: '*' and '?' never match '/',
    '[...]' is a class ('^' negates, '\\' escapes); a malformed pattern raises ValueError."""
    import re

    out, i = [], 0
    while i < len(pattern):
        char = pattern[i]
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "\\":
            if i + 1 == len(pattern):
                raise ValueError(f"malformed pattern {pattern!r}: trailing '\\'")
            i += 1
            out.append(re.escape(pattern[i]))
        elif char == "[":
            end = pattern.find("]", i + 2 if pattern[i + 1 : i + 2] == "^" else i + 1)
            body = pattern[i + 1 : end] if end > i else ""
            if end < 0 or not body or body == "^":
                raise ValueError(f"malformed pattern {pattern!r}: unclosed '['")
            negate = body.startswith("^")
            body = body[1:] if negate else body
            out.append("[" + ("^/" if negate else "") + body.replace("\\", "\\\\") + "]")
            i = end
        else:
            out.append(re.escape(char))
        i += 1
    return re.fullmatch("".join(out), name, re.DOTALL) is not None


# containerd 1.6 globs a relative pattern as written, so against its working directory
# (systemd's "/"), but joins a relative literal path with the importing file's directory; 1.7
# and later join both with that directory (checked against each in test_containerd_real.py).
CWD = "/"


def import_path(parent: str, pattern: str, daemon: Daemon | None = None) -> str:
    """An `imports` entry as containerd resolves it: cleaned, relative to the importing file
    (containerd 1.6's globs: to its working directory)."""
    import posixpath

    path = posixpath.normpath(pattern)
    if not path.startswith("/"):
        glob_16 = daemon is not None and daemon < (1, 7) and "*" in pattern
        base = CWD if glob_16 else posixpath.dirname(parent)
        path = posixpath.normpath(posixpath.join(base, path))
    return path


def import_matches(parent: str, pattern: str, path: str) -> bool:
    """Whether containerd reading `parent` would load `path` through `pattern`: a pattern is a
    glob only when it contains '*' (containerd's resolveImports), else a literal path."""
    resolved = import_path(parent, pattern)
    if "*" not in resolved:
        return resolved == path
    parts, names = resolved.split("/"), path.split("/")
    try:
        return len(parts) == len(names) and all(
            go_match(part, name) for part, name in zip(parts, names, strict=True))
    except ValueError:
        return False


@dataclass(frozen=True)
class Layer:
    """One file containerd reads: the main config or an import; `doc` None: it is missing."""

    file: str
    doc: Mapping[str, Any] | None
    bom: bool = False  # the file starts with a UTF-8 byte order mark (2.x refuses it)


@dataclass(frozen=True)
class View:
    """What one containerd version makes of the files: its CRI runtimes and settings."""

    daemon: Daemon
    cri: Mapping[str, Any]  # the effective CRI plugin table, runtimes included
    runtimes: Mapping[str, Mapping[str, Any]]  # what containerd runs, built-ins included
    origin: Mapping[str, str]  # runtime name → the file it comes from ("built-in")
    cri_file: str | None  # before 2.1: the file whose CRI table replaced all others
    problem: str | None = None  # why this version would not use the CRI settings as written

    @property
    def default_name(self) -> str:
        name = lookup(self.cri, ("containerd", "default_runtime_name"))
        return name if isinstance(name, str) and name else BUILTIN_DEFAULT_NAME


BUILTIN = "built-in"
# The behaviours gpunode knows, for when the version is unknown: 1.6, 1.7 and 2.1+.
KNOWN_BEHAVIOURS: tuple[Daemon, ...] = ((1, 6), (1, 7), (2, 1))


def effective(layers: list[Layer], daemon: Daemon) -> View:
    """containerd `daemon`'s view of the main file and its imports (layers in load order).

    1.x: the last non-zero `version` wins; a plugin table of a later file replaces the earlier
    one whole (containerd#5837). 2.x: each file's own version counts (a version 1 file's CRI
    settings are dropped); from 2.1 plugin tables merge key by key, later files winning.

    Before any of that, two things make a version use no CRI settings at all: 2.x refuses a
    file that starts with a byte order mark (1.x skips it), and a CRI plugin named in
    `disabled_plugins` is never loaded (the names each version honours: DISABLES_CRI)."""
    if daemon >= (2, 0):
        marked = next((layer.file for layer in layers if layer.bom and layer.doc is not None),
                      None)
        if marked is not None:
            return _broken(daemon, f"{marked} starts with a UTF-8 byte order mark, which "
                           "containerd 2.x refuses ('invalid character at start of key'; 1.x "
                           "skips it): remove the file's first 3 bytes")
    disabled = _disabled_cri(layers, daemon)
    if disabled is not None:
        return _broken(daemon, disabled)
    problem = None
    if daemon < (2, 0):
        missing = next((layer.file for layer in layers if layer.doc is None), None)
        if missing is not None:
            return _broken(daemon, f"imported file {missing} does not exist: {show(daemon)} "
                           "refuses to start")
        docs = [layer for layer in layers if layer.doc is not None]
        version = 1
        for layer in docs:
            version = _version_or(layer.doc, version)
        if version == 3:
            return _broken(daemon, f"{show(daemon)} does not read config version 3")
        key = CRI_PLUGIN[version]
        cri, cri_file = {}, None
        for layer in docs:
            table = _plugin(layer, key)
            if table is not None:
                cri, cri_file = table, layer.file
    else:
        docs = [layer for layer in layers if layer.doc is not None]
        versions = {_version_or(layer.doc, 1) for layer in docs}
        cri_files = [layer for layer in docs if _touches_cri(layer)]
        if len(versions - {1}) > 1 and cri_files:
            return _broken(daemon, "the files mix config versions 2 and 3, which containerd "
                           "2.x merges inconsistently; give every file the same version")
        cri, cri_file = {}, None
        for layer in docs:
            version = _version_or(layer.doc, 1)
            if version == 1:
                if _touches_cri(layer, 1):
                    problem = (f"{layer.file} is a version 1 config (no 'version' key): "
                               f"{show(daemon)} ignores its CRI settings")
                continue
            table = _plugin(layer, CRI_PLUGIN[version])
            if table is None:
                continue
            cri = _deep_merge(cri, table) if daemon >= MERGES_FROM else dict(table)
            cri_file = layer.file
    view = _runtimes_view(daemon, cri, cri_file, layers if daemon >= MERGES_FROM else None)
    return dataclasses.replace(view, problem=problem) if problem else view


# `disabled_plugins` entries that leave containerd without a CRI plugin. 1.x matches a version
# 1 file's entries against plugin IDs and a version 2 file's against URIs, exactly
# (case-sensitively). 2.x migrates a version 1 file's "cri" to io.containerd.grpc.v1.cri (a URI
# there stays as it is), and its CRI gRPC service needs both the runtime and the images plugin,
# so disabling any of the three leaves it out ("failed to load plugin ... no plugins registered
# for io.containerd.cri.v1.runtime" in 2.1's daemon log, run with each of them). Checked against
# containerd 1.6, 1.7 and 2.1 in tests/integration/test_containerd_real.py: 1.x's `config dump`
# omits a plugin it disables; 2.x's shows the migrated list. A version 2 or 3 file must name
# plugins by URI: a short name ("cri") makes every version refuse the file.
_CRI_2X = frozenset({"io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime",
                     "io.containerd.cri.v1.images"})
DISABLES_CRI: dict[tuple[str, int], frozenset[str]] = {
    ("1.x", 1): frozenset({"cri"}), ("1.x", 2): frozenset({"io.containerd.grpc.v1.cri"}),
    ("2.x", 1): _CRI_2X | {"cri"}, ("2.x", 2): _CRI_2X, ("2.x", 3): _CRI_2X,
}


def _disabled_cri(layers: list[Layer], daemon: Daemon) -> str | None:
    """Why `daemon` loads no CRI plugin from these files' `disabled_plugins`, or None.

    1.x appends every file's list and matches it as the resulting (last non-zero) version
    says; 2.x migrates each file by its own version. gpunode never edits the list: a CRI
    plugin someone disabled is theirs to enable."""
    docs = [layer for layer in layers if layer.doc is not None]
    final = 1
    for layer in docs:
        final = _version_or(layer.doc or {}, final)
    for layer in docs:
        listed = (layer.doc or {}).get("disabled_plugins")
        if not isinstance(listed, list):
            continue
        version = _version_or(layer.doc or {}, 1) if daemon >= (2, 0) else final
        bad = next((n for n in listed if version >= 2 and isinstance(n, str)
                    and len(n.split(".")) < 4), None)
        if bad is not None:  # containerd's ValidateV2: "invalid disabled plugin URI"
            return (f"{layer.file} lists '{bad}' in disabled_plugins, which a version "
                    f"{version} config must name by URI (io.containerd.<type>.<id>): "
                    "containerd refuses to start ('invalid disabled plugin URI'); use "
                    "the plugin's URI or remove the entry")
        names = DISABLES_CRI.get(("2.x" if daemon >= (2, 0) else "1.x", version), frozenset())
        name = next((n for n in listed if isinstance(n, str) and n in names), None)
        if name is not None:
            return (f"{layer.file} lists '{name}' in disabled_plugins, so containerd loads no "
                    "CRI plugin and the kubelet can run no pod, with any runtime: remove "
                    f"'{name}' from disabled_plugins (gpunode never edits that list), then run "
                    "gpunode again")
    return None


def _broken(daemon: Daemon, problem: str) -> View:
    return View(daemon, {}, {}, {}, None, problem)


def _version_or(doc: Mapping[str, Any], default: int) -> int:
    version = doc.get("version")
    return version if isinstance(version, int) and version in CRI_PLUGIN else default


def _plugin(layer: Layer, key: str) -> dict[str, Any] | None:
    plugins = (layer.doc or {}).get("plugins")
    table = plugins.get(key) if isinstance(plugins, Mapping) else None
    return dict(table) if isinstance(table, Mapping) else None


def _touches_cri(layer: Layer, version: int | None = None) -> bool:
    version = version or _version_or(layer.doc or {}, 1)
    return _plugin(layer, CRI_PLUGIN[version]) is not None


def _deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _runtimes_view(daemon: Daemon, cri: Mapping[str, Any], cri_file: str | None,
                   merged_layers: list[Layer] | None) -> View:
    containerd = cri.get("containerd")
    containerd = containerd if isinstance(containerd, Mapping) else {}
    table = containerd.get("runtimes")
    declared = {n: rt for n, rt in table.items() if isinstance(rt, Mapping)} \
        if isinstance(table, Mapping) else None
    runtimes: dict[str, Mapping[str, Any]] = {}
    origin: dict[str, str] = {}
    if declared is None or daemon >= RUNTIMES_MERGE_FROM:
        runtimes[BUILTIN_DEFAULT_NAME] = builtin_runc(daemon)
        origin[BUILTIN_DEFAULT_NAME] = BUILTIN
    for name, runtime in (declared or {}).items():
        runtimes[name] = _deep_merge(runtimes.get(name, {}), runtime) \
            if daemon >= RUNTIMES_MERGE_FROM else runtime
        origin[name] = cri_file or ""
    if merged_layers is not None:  # 2.1+: a runtime comes from the last file that sets it
        for layer in merged_layers:
            version = _version_or(layer.doc or {}, 1)
            names = lookup(_plugin(layer, CRI_PLUGIN[version]) or {}, ("containerd", "runtimes")) \
                if version != 1 else None
            for name in names if isinstance(names, Mapping) else ():
                origin[name] = layer.file
    legacy = containerd.get("default_runtime")
    if daemon < (2, 0) and isinstance(legacy, Mapping) and runtime_type(legacy):
        # 1.x: a typed (deprecated) default_runtime becomes the default runtime "default".
        runtimes["default"] = legacy
        origin["default"] = cri_file or ""
        cri = _deep_merge(cri, {"containerd": {"default_runtime_name": "default"}})
    return View(daemon, cri, runtimes, origin, cri_file)
