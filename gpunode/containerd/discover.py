"""Which config file containerd really uses, and what runtimes it defines (read-only).

The answer comes from containerd.service itself: `--config`/`-c` in ExecStart, with variables
such as Flatcar's CONTAINERD_CONFIG expanded; containerd's own default otherwise.
"""

from __future__ import annotations

import glob
import tomllib
from dataclasses import dataclass
from typing import Any

from gpunode.containerd import schema
from gpunode.errors import FileError
from gpunode.host import Host
from gpunode.systemd import Systemd
from gpunode.systemd_unit import expand_words, read_unit
from gpunode.tomlread import error_line

CONTAINERD_UNIT = "containerd.service"
CONTAINERD_DEFAULT_CONFIG = "/etc/containerd/config.toml"


class ContainerdConfigError(FileError):
    """containerd's config cannot be read or understood; carries file, line and reason."""


@dataclass(frozen=True)
class ActiveConfig:
    path: str
    reason: str  # how the path was found, for `status` and logs
    # The config argument as the unit writes it ("${CONTAINERD_CONFIG}" on Flatcar), and the
    # unexpanded ExecStart: what a drop-in must override to point containerd elsewhere.
    raw_flag: str | None = None
    raw_exec: tuple[str, ...] = ()


def active_config(host: Host, systemd: Systemd | None = None) -> ActiveConfig:
    """The file containerd uses: from systemd's loaded unit on a live host, else unit files."""
    if systemd is not None:
        live = systemd.exec_start(CONTAINERD_UNIT)
        if live is not None:
            argv = expand_words(live.argv, live.environment)
            flag = config_flag(argv)
            reason = f"systemd runs '{' '.join(argv)}'"
            if flag is None:
                return ActiveConfig(CONTAINERD_DEFAULT_CONFIG, reason + "; containerd's default",
                                    raw_exec=live.argv)
            return ActiveConfig(flag, reason, config_flag(list(live.argv)), live.argv)
    unit = read_unit(host, CONTAINERD_UNIT)
    if unit.fragment is None:
        return ActiveConfig(CONTAINERD_DEFAULT_CONFIG,
                            f"no {CONTAINERD_UNIT}; containerd's default")
    flag = config_flag(list(unit.exec_start))
    if flag is None:
        return ActiveConfig(CONTAINERD_DEFAULT_CONFIG,
                            f"{CONTAINERD_UNIT} ExecStart has no --config; containerd's default",
                            raw_exec=unit.exec_start_raw)
    dropins = f" + {len(unit.dropins)} drop-in(s)" if unit.dropins else ""
    return ActiveConfig(flag, f"{CONTAINERD_UNIT}{dropins} runs '{' '.join(unit.exec_start)}'",
                        config_flag(list(unit.exec_start_raw)), unit.exec_start_raw)


def config_flag(argv: list[str]) -> str | None:
    """The value of containerd's --config / -c option, in any of its spellings."""
    for i, word in enumerate(argv):
        for flag in ("--config", "-c"):
            if word == flag and i + 1 < len(argv):
                return argv[i + 1]
            if word.startswith(flag + "="):
                return word[len(flag) + 1 :]
    return None


def load_config(host: Host, path: str) -> dict[str, Any]:
    """The parsed TOML document; a parse error names the file and line."""
    shown = host.display(path)
    text = host.read_optional(path)
    if text is None:
        raise ContainerdConfigError(shown, "does not exist")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ContainerdConfigError(shown, f"not valid TOML: {exc}", error_line(exc)) from exc


def runtime_tables(host: Host, path: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """name → (file that defines it, runtime table), across the main file and its `imports`.

    An imported file that defines a runtime wins over the main file, as in containerd's merge.
    """
    doc = load_config(host, path)
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    for file, part in [(path, doc), *_imports(host, path, doc)]:
        try:
            for name, table in schema.runtimes(part).items():
                found[name] = (file, dict(table))
        except schema.SchemaError as exc:
            raise ContainerdConfigError(host.display(file), str(exc)) from exc
    return found


def _imports(host: Host, path: str, doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    patterns = doc.get("imports", [])
    if not isinstance(patterns, list):
        raise ContainerdConfigError(host.display(path), "'imports' is not a list")
    base = path.rpartition("/")[0]
    real_root = str(host.root).rstrip("/")
    parts: list[tuple[str, dict[str, Any]]] = []
    for pattern in map(str, patterns):
        absolute = pattern if pattern.startswith("/") else f"{base}/{pattern}"
        for real in sorted(glob.glob(real_root + absolute)):
            file = real[len(real_root) :]
            parts.append((file, load_config(host, file)))
    return parts
