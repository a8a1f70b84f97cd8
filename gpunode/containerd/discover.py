"""Which config file containerd really uses, and what runtimes it defines (read-only).

The answer comes from containerd.service itself: `--config`/`-c` in ExecStart, with variables
such as Flatcar's CONTAINERD_CONFIG expanded; containerd's own default otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpunode.containerd import schema
from gpunode.errors import ContainerdConfigError, HostError
from gpunode.platform.host import Host
from gpunode.platform.systemd import Systemd
from gpunode.platform.systemd_unit import (
    environment_files,
    expand_words,
    read_unit,
    strip_exec_prefix,
)
from gpunode.platform.tomlread import loads_toml

CONTAINERD_UNIT = "containerd.service"
CONTAINERD_DEFAULT_CONFIG = "/etc/containerd/config.toml"


@dataclass(frozen=True)
class ActiveConfig:
    """The config file containerd really uses, and how containerd.service points it there."""

    path: str
    reason: str  # how the path was found, for `status` and logs
    # The config argument as the unit writes it ("${CONTAINERD_CONFIG}" on Flatcar), and the
    # unexpanded ExecStart: what a drop-in must override to point containerd elsewhere.
    raw_flag: str | None = None
    raw_exec: tuple[str, ...] = ()
    env_files: tuple[str, ...] = ()  # the unit's EnvironmentFile= paths

    @property
    def binary(self) -> str:
        """The containerd executable ExecStart runs, or the usual one when none is known."""
        return strip_exec_prefix(self.raw_exec[0]) if self.raw_exec else "/usr/bin/containerd"


def active_config(host: Host, systemd: Systemd | None = None) -> ActiveConfig:
    """The file containerd uses: from systemd's loaded unit on a live host, else unit files."""
    if systemd is not None:
        live = systemd.exec_start(CONTAINERD_UNIT)
        if live is not None:
            env = {**live.environment, **environment_files(host, live.environment_files)}
            argv = expand_words(live.argv, env)
            flag = config_flag(argv)
            reason = f"systemd runs '{' '.join(argv)}'"
            if flag is None:
                return ActiveConfig(CONTAINERD_DEFAULT_CONFIG, reason + "; containerd's default",
                                    raw_exec=live.argv, env_files=live.environment_files)
            raw = config_flag(list(live.argv))
            return ActiveConfig(_absolute(flag, raw, f"systemd's {CONTAINERD_UNIT}"), reason, raw,
                                live.argv, live.environment_files)
    unit = read_unit(host, CONTAINERD_UNIT)
    if unit.fragment is None:
        return ActiveConfig(CONTAINERD_DEFAULT_CONFIG,
                            f"no {CONTAINERD_UNIT}; containerd's default")
    flag = config_flag(list(unit.exec_start))
    if flag is None:
        return ActiveConfig(CONTAINERD_DEFAULT_CONFIG,
                            f"{CONTAINERD_UNIT} ExecStart has no --config; containerd's default",
                            raw_exec=unit.exec_start_raw, env_files=unit.environment_files)
    dropins = f" + {len(unit.dropins)} drop-in(s)" if unit.dropins else ""
    raw = config_flag(list(unit.exec_start_raw))
    return ActiveConfig(_absolute(flag, raw, host.display(unit.fragment)),
                        f"{CONTAINERD_UNIT}{dropins} runs '{' '.join(unit.exec_start)}'", raw,
                        unit.exec_start_raw, unit.environment_files)


def _absolute(flag: str, raw: str | None, unit: str) -> str:
    """The config path ExecStart gives, or a refusal that says how it came out wrong (an
    unset variable such as Flatcar's CONTAINERD_CONFIG expands to nothing)."""
    if flag.startswith("/"):
        return flag
    how = f"'{raw}' expands to '{flag}'" if raw is not None and raw != flag else f"is '{flag}'"
    raise ContainerdConfigError(unit, f"ExecStart's --config {how}, not an absolute path",
                                hint="set the variable it names (an Environment= line or a "
                                "drop-in), or give --config an absolute path")


def config_flag(argv: list[str]) -> str | None:
    """The value of containerd's --config / -c option, in any of its spellings."""
    for i, word in enumerate(argv):
        for flag in ("--config", "-c"):
            if word == flag and i + 1 < len(argv):
                return argv[i + 1]
            if word.startswith(flag + "="):
                return word[len(flag) + 1 :]
    return None


def read_config(host: Host, path: str) -> str | None:
    """A containerd config's text (strict UTF-8, at most schema.MAX_CONFIG_BYTES), or None when
    it does not exist; anything else (too large, not UTF-8, a FIFO) is one refusal naming it."""
    try:
        return host.read_optional(path, limit=schema.MAX_CONFIG_BYTES, errors="strict")
    except HostError as exc:
        raise ContainerdConfigError(host.display(path), exc.reason,
                                    hint=schema.CONFIG_HINT) from None


def load_config(host: Host, path: str) -> dict[str, Any]:
    """The parsed TOML document; a parse error names the file and line."""
    shown = host.display(path)
    text = read_config(host, path)
    if text is None:
        raise ContainerdConfigError(shown, "does not exist")
    return loads_toml(text, shown, ContainerdConfigError)


def starts_with_bom(host: Host, path: str) -> bool:
    """Whether the config starts with a UTF-8 byte order mark (containerd 2.x refuses it)."""
    text = read_config(host, path)
    return text is not None and text.startswith(schema.BOM)


def load_layer(host: Host, path: str) -> schema.Layer:
    """One existing config file as containerd reads it: its document and whether it has a BOM."""
    shown = host.display(path)
    text = read_config(host, path)
    if text is None:
        raise ContainerdConfigError(shown, "does not exist")
    return schema.Layer(path, loads_toml(text, shown, ContainerdConfigError),
                        text.startswith(schema.BOM))


def load_layers(host: Host, path: str, doc: dict[str, Any] | None = None,
                parent: str | None = None, daemon: schema.Daemon | None = None,
                bom: bool = False) -> list[schema.Layer]:
    """The main file and every file it imports, recursively, in the order containerd loads
    them (breadth first, each pattern's matches sorted, each file once). `doc`: the main file's
    document when the caller has it (e.g. as gpunode is about to write it); `parent`: the path
    relative imports resolve against, when it is not `path` (a copy about to be made); `daemon`:
    the containerd version whose resolution of relative imports counts (1.6 differs); `bom`:
    whether the main file given as `doc` starts with a byte order mark."""
    first = schema.Layer(path, doc, bom) if doc is not None else load_layer(host, path)
    main = first.doc or {}
    layers = [first]
    loaded = {path}
    pending = _resolve(host, parent or path, main, daemon)
    while pending:
        file = pending.pop(0)
        if file in loaded:
            continue
        loaded.add(file)
        layer = load_layer(host, file) if host.exists(file) else schema.Layer(file, None)
        layers.append(layer)
        if layer.doc is not None:
            pending += _resolve(host, file, dict(layer.doc), daemon)
    return layers


def _resolve(host: Host, parent: str, doc: dict[str, Any],
             daemon: schema.Daemon | None) -> list[str]:
    """A file's `imports` as containerd's resolveImports reads them: a pattern is globbed (Go's
    filepath.Glob: '*' does not cross '/') only when it contains '*', else taken literally."""
    patterns = doc.get("imports", [])
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise ContainerdConfigError(host.display(parent), "'imports' is not a list of paths")
    files: list[str] = []
    for pattern in patterns:
        path = schema.import_path(parent, pattern, daemon)
        if "*" not in path:
            files.append(path)
            continue
        try:
            files += go_glob(host, path)
        except ValueError as exc:
            raise ContainerdConfigError(host.display(parent), f"imports: {exc}",
                                        hint="containerd refuses it too; fix the pattern") from exc
    return files


def go_glob(host: Host, pattern: str) -> list[str]:
    """Go's filepath.Glob of an absolute pattern, over the host's tree (under its root)."""
    schema.go_match(pattern, "")  # a malformed pattern is an error, as in Go
    return host.glob(pattern, schema.go_match)
