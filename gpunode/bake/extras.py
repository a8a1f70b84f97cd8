"""The bake config's optional artifacts: `[toolkit]`, `[[prebuilt]]` and `[build]`, typed and
checked as the rest of the bake config is (gpunode/bake/config.py): every refusal a
BakeConfigError (exit 2) naming the file, the key (`prebuilt[2].kernel`) and its line.

```toml
[toolkit]                        # flatcar/sysext-bakery's nvidia-runtime sysext
name = "nvidia-runtime"          # optional; the bakery's name
source = "https://extensions.flatcar.org/extensions/nvidia-runtime-v1.17.5-x86-64.raw"
sha512 = "…"

[[prebuilt]]                     # none or more: one kernel's modules (and user-space), a tar
kernel = "6.6.95-flatcar"        # optional: the image's one /usr/lib/modules/<release>
source = "nvidia-570.195.03-6.6.95-flatcar.tar.gz"
sha512 = "…"

[build]                          # compile the driver for the image's kernel into its cache
enabled = true
flavours = ["open"]              # optional where the agent config pins driver.flavour
kernel = "6.6.95-flatcar"        # optional: the image's kernel
driver_sha256 = "…"              # NVIDIA's installer of the agent config's driver.version
dev_container_sha512 = "…"       # Flatcar's developer container of the image's version
driver_url = "…"                 # optional: NVIDIA's download server (driver.build's default)
dev_container_url = "…"          # optional: Flatcar's release server (driver.build's default)
command = ["systemd-nspawn", …]  # optional: the builder, as driver.build.command
```

Sources take the placeholders of a driver's source ({version}, {board}, {group}, {name});
[build]'s URLs those of driver.build ({version}, {board}, {group}, {kernel}, {driver}). A
relative path is relative to the bake config's directory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gpunode.bake import config as bake_config
from gpunode.bake.config import Artifact, BakeConfig
from gpunode.config import BuildConfig
from gpunode.driver.cache import is_name
from gpunode.driver.flavour import FLAVOURS
from gpunode.errors import BakeConfigError
from gpunode.platform.tomlread import loads_toml

DEFAULT_TOOLKIT = "nvidia-runtime"  # flatcar/sysext-bakery nvidia-runtime.sysext
# The bakery's file names: <name>-<version>-<arch>.raw (lib/generate.sh, `_create_sysupdate`:
# MatchPattern <name>-@v-%a.raw), arch as systemd names it.
ARCHES = ("x86-64", "arm64")
_TOOLKIT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_LENGTHS = {"sha256": 64, "sha512": 128}
_HEX = {algorithm: re.compile(f"[0-9a-f]{{{n}}}") for algorithm, n in _LENGTHS.items()}


@dataclass(frozen=True)
class Prebuilt:
    """One `[[prebuilt]]` table: the module set of one kernel, the image's unless named."""

    artifact: Artifact  # key "prebuilt[1]"; name: the kernel as written, or ""
    kernel: str | None  # None: the image's kernel


@dataclass(frozen=True)
class Build:
    """An enabled `[build]` table: the driver to compile into the image's cache, and from what."""

    kernel: str | None  # None: the image's kernel
    flavours: tuple[str, ...]  # empty: the agent config's driver.flavour
    driver_url: str
    driver_sha256: str
    dev_container_url: str
    dev_container_sha512: str
    command: tuple[str, ...]


@dataclass(frozen=True)
class Extras:
    """The optional artifacts a bake config names; false when it names none."""

    toolkit: Artifact | None = None
    prebuilt: tuple[Prebuilt, ...] = ()
    build: Build | None = None

    def __bool__(self) -> bool:
        return bool(self.toolkit or self.prebuilt or self.build)


def parse(config: BakeConfig) -> Extras:
    """The optional artifacts the bake config names (its text was checked as TOML already)."""
    doc = loads_toml(config.text, config.file,
                     lambda f, reason, line: BakeConfigError(f, None, reason, line))
    toolkit = _toolkit(config, doc["toolkit"]) if "toolkit" in doc else None
    prebuilt_doc = doc.get("prebuilt", [])
    if not isinstance(prebuilt_doc, list):
        raise _refuse(config, "prebuilt", "must be an array of tables ([[prebuilt]])")
    prebuilt = tuple(_prebuilt(config, value, f"prebuilt[{i}]")
                     for i, value in enumerate(prebuilt_doc, 1))
    seen: dict[str | None, str] = {}
    for p in prebuilt:
        if p.kernel in seen:
            raise _refuse(config, f"{p.artifact.key}.kernel", "names the same kernel as "
                          f"{seen[p.kernel]} (the image's, when not named): one module set "
                          "per kernel")
        seen[p.kernel] = p.artifact.key
    build = _build(config, doc["build"]) if "build" in doc else None
    return Extras(toolkit, prebuilt, build)


def _toolkit(config: BakeConfig, value: Any) -> Artifact:
    table = _table(config, value, "toolkit", "toolkit", required=("source", "sha512"))
    name = _string(config, table.get("name", DEFAULT_TOOLKIT), "toolkit.name")
    if not _TOOLKIT_NAME.fullmatch(name) or name == "gpunode" or name.startswith("flatcar-"):
        raise _refuse(config, "toolkit.name", f"{name!r} is not a sysext name gpunode may "
                      "place: letters, digits, '.', '_', '-', not gpunode nor flatcar-… "
                      f"(default {DEFAULT_TOOLKIT})")
    artifact = Artifact("toolkit", name, _string(config, table["source"], "toolkit.source"),
                        _digest(config, table["sha512"], "toolkit.sha512", "sha512"))
    file_name = bake_config.source(config, artifact, {}).file_name
    if toolkit_version(name, file_name) is None:
        raise _refuse(config, "toolkit.source", f"must name a file like {name}-v1.17.5-"
                      f"x86-64.raw ({name}-<version>-<{'|'.join(ARCHES)}>.raw, as the "
                      f"sysext-bakery names it; it keeps that name in /opt/extensions/{name})")
    return artifact


def toolkit_version(name: str, file_name: str) -> str | None:
    """'v1.17.5' of 'nvidia-runtime-v1.17.5-x86-64.raw'; None for another name."""
    arches = "|".join(re.escape(a) for a in ARCHES)
    match = re.fullmatch(rf"{re.escape(name)}-([A-Za-z0-9._+]+)-(?:{arches})\.raw", file_name)
    return match.group(1) if match else None


def _prebuilt(config: BakeConfig, value: Any, key: str) -> Prebuilt:
    table = _table(config, value, key, "prebuilt", required=("source", "sha512"))
    kernel = _kernel(config, table, key)
    artifact = Artifact(key, kernel or "", _string(config, table["source"], f"{key}.source"),
                        _digest(config, table["sha512"], f"{key}.sha512", "sha512"))
    bake_config.source(config, artifact, {})  # the form and the placeholders' names, now
    return Prebuilt(artifact, kernel)


def _build(config: BakeConfig, value: Any) -> Build | None:
    table = _table(config, value, "build", "build",
                   required=("enabled", "driver_sha256", "dev_container_sha512"))
    enabled = table["enabled"]
    if not isinstance(enabled, bool):
        raise _refuse(config, "build.enabled", f"must be true or false, not "
                      f"{type(enabled).__name__} ({enabled!r})")
    flavours = _strings(config, table.get("flavours", []), "build.flavours")
    for flavour in flavours:
        if flavour not in FLAVOURS:
            raise _refuse(config, "build.flavours", f"{flavour!r} is not a driver flavour; "
                          f"valid are {', '.join(FLAVOURS)}")
    if len(set(flavours)) != len(flavours):
        raise _refuse(config, "build.flavours", "names a flavour twice")
    defaults = BuildConfig()
    urls = {key: _url(config, _string(config, table.get(key, getattr(defaults, key)),
                                      f"build.{key}"), f"build.{key}")
            for key in ("driver_url", "dev_container_url")}
    command = _strings(config, table.get("command", []), "build.command")
    if not enabled:
        return None
    return Build(_kernel(config, table, "build"), tuple(flavours), urls["driver_url"],
                 _digest(config, table["driver_sha256"], "build.driver_sha256", "sha256"),
                 urls["dev_container_url"],
                 _digest(config, table["dev_container_sha512"], "build.dev_container_sha512",
                         "sha512"),
                 tuple(command))


def _url(config: BakeConfig, value: str, key: str) -> str:
    """A relative path is relative to the bake config's directory, as every source is."""
    if not value or not value.isprintable() or value != value.strip():
        raise _refuse(config, key, f"{value!r}: must be a URL or a path, without spaces "
                      "around it or control characters")
    if value.startswith(("http://", "https://")):
        problem = bake_config.url_problem(value)
        if problem:
            raise _refuse(config, key, f"{bake_config.masked(value)!r}: {problem}")
    return value if "://" in value or value.startswith("/") else str(config.base / value)


def _kernel(config: BakeConfig, table: dict[str, Any], key: str) -> str | None:
    if "kernel" not in table:
        return None
    kernel = _string(config, table["kernel"], f"{key}.kernel")
    if not is_name(kernel):
        raise _refuse(config, f"{key}.kernel", f"{kernel!r} is not a kernel release like "
                      "6.6.95-flatcar (letters, digits, '.', '_', '+', '-')")
    return kernel


def _table(config: BakeConfig, value: Any, key: str, section: str,
           required: tuple[str, ...]) -> dict[str, Any]:
    shape = f"[[{section}]]" if section == "prebuilt" else f"[{section}]"
    if not isinstance(value, dict):
        raise _refuse(config, key, f"must be a table ({shape}), not {type(value).__name__}")
    valid = bake_config._SECTIONS[section]
    for name in value:
        if name not in valid:
            raise _refuse(config, f"{key}.{name}", f"unknown key; valid keys in {shape} are "
                          f"{', '.join(valid)}")
    for name in required:
        if name not in value:
            raise _refuse(config, f"{key}.{name}", f"missing: {shape} needs "
                          f"{', '.join(required)}", line_of=key)
    return value


def _string(config: BakeConfig, value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise _refuse(config, key, f"must be a string, not {type(value).__name__} ({value!r})")
    return value


def _strings(config: BakeConfig, value: Any, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _refuse(config, key, f"must be an array of strings, not {value!r}")
    return value


def _digest(config: BakeConfig, value: Any, key: str, algorithm: str) -> str:
    text = _string(config, value, key)
    if not _HEX[algorithm].fullmatch(text):
        raise _refuse(config, key, f"must be {_LENGTHS[algorithm]} lowercase hex digits "
                      f"(the artifact's {algorithm})")
    return text


def _refuse(config: BakeConfig, key: str, reason: str,
            line_of: str | None = None) -> BakeConfigError:
    return BakeConfigError(config.file, key, reason, config.line(line_of or key))
