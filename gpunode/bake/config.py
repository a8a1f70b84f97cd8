"""The bake config of `gpunode image bake`: typed, validated once, refused with file, key, line.

```toml
[gpunode]                      # required: gpunode's sysext
source = "https://…/gpunode-0.2.0-x86-64.raw"   # http(s) URL, file:// URL, or a path
sha512 = "…"                   # 128 lowercase hex digits

[[driver]]                     # none or more: Flatcar's official driver sysexts
name = "nvidia-drivers-570-open"   # as enabled-sysext.conf names it (several: one per
                                   # generation, chosen per node at boot: docs/image-bake.md)
source = "https://{group}.release.flatcar-linux.net/{board}/{version}/flatcar-{name}.raw"
sha512 = "…"

[agent]
config = "gpunode.toml"        # optional: installed as /etc/gpunode/config.toml (checked first)

[download]
timeout = 60                   # seconds a download may stall, 1 to 600
attempts = 3                   # tries per download, 1 to 10
deadline = 1800                # seconds for one artifact, every attempt together, 1 to 86400
```

A relative path is relative to the bake config's own directory. `{version}`, `{board}`,
`{group}` and `{name}` in a driver's source are the image's Flatcar version, board and update
group and the driver's name (docs/cli.md). Every refusal is a BakeConfigError (exit 2) naming
the file, the key (`driver[2].sha512`) and its line.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpunode.driver.branches import NAME as DRIVER_NAME
from gpunode.errors import BakeConfigError, HostError
from gpunode.platform.host import Host
from gpunode.platform.tomlread import key_line, loads_toml

MAX_BAKE_CONFIG = 1 << 20
DEFAULT_DEADLINE = 1800  # seconds: a 400 MB driver sysext at 250 kB/s, retries included
PLACEHOLDERS = ("version", "board", "group", "name")
_SHA512 = re.compile(r"[0-9a-f]{128}")
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*\.raw")
# What the image's os-release and update.conf values must look like to fill a placeholder (and
# name a file): one plain name (Flatcar's are "4459.2.1", "amd64-usr", "stable"), never a path.
_PLAIN_VALUE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
_VALUE_KEYS = {"version": "VERSION", "board": "FLATCAR_BOARD", "group": "GROUP"}
_SECTIONS = {"gpunode": ("source", "sha512"), "driver": ("name", "source", "sha512"),
             "agent": ("config",), "download": ("timeout", "attempts", "deadline")}
# The optional artifacts' sections: read and checked by gpunode/bake/extras.py.
_SECTIONS |= {"toolkit": ("name", "source", "sha512"),
              "prebuilt": ("kernel", "source", "sha512"),
              "build": ("enabled", "flavours", "kernel", "driver_url", "driver_sha256",
                        "dev_container_url", "dev_container_sha512", "command")}


@dataclass(frozen=True)
class Source:
    """Where an artifact comes from: a URL (http, https) or a file on the baking machine."""

    url: str | None  # http(s)
    path: str | None  # absolute, on the machine gpunode runs on (file:// or a path)
    text: str  # as written in the bake config (a driver's: placeholders expanded)

    @property
    def shown(self) -> str:
        """For messages and the manifest: no query string, no user or password."""
        if self.url is None:
            return str(self.path)
        parts = urllib.parse.urlsplit(self.url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
        return urllib.parse.urlunsplit((parts.scheme, host + port, parts.path, "", ""))

    @property
    def file_name(self) -> str:
        return (urllib.parse.urlsplit(self.url).path if self.url else str(self.path)) \
            .rpartition("/")[2]


@dataclass(frozen=True)
class Artifact:
    """One artifact the bake config pins, as written there (its source not yet expanded)."""

    key: str  # "gpunode", "driver[1]": where the bake config names it
    name: str  # "gpunode", "nvidia-drivers-570-open"
    source: str  # as written (a driver's may hold placeholders)
    sha512: str


@dataclass(frozen=True)
class BakeConfig:
    """A bake config, validated; its text is kept so that later refusals can name a key's line."""

    file: str
    base: Path  # the bake config's directory: relative sources are relative to it
    gpunode: Artifact
    drivers: tuple[Artifact, ...]
    agent_config: str | None  # absolute path on this machine
    timeout: int = 60
    attempts: int = 3
    text: str = ""
    deadline: int = DEFAULT_DEADLINE

    def line(self, key: str) -> int | None:
        return _line(self.text, key)


def load(path: str) -> BakeConfig:
    """The bake config at `path` (a path on the machine gpunode runs on), validated."""
    shown = str(Path(path).absolute())
    try:
        text = Host().read_optional(shown, limit=MAX_BAKE_CONFIG, errors="strict")
    except HostError as exc:
        raise BakeConfigError(shown, None, f"cannot be read: {exc.reason}") from None
    if text is None:
        raise BakeConfigError(shown, None, "does not exist")
    return parse(text, shown)


def parse(text: str, shown: str) -> BakeConfig:
    doc = loads_toml(text, shown, lambda f, reason, line: BakeConfigError(f, None, reason, line))
    for name in doc:
        if name not in _SECTIONS:
            raise BakeConfigError(shown, name, "unknown section; valid sections are "
                                  f"{', '.join(_SECTIONS)}", _line(text, name))
    if "gpunode" not in doc:
        raise BakeConfigError(shown, "gpunode", "missing: the bake config names gpunode's "
                              "sysext in [gpunode] (source and sha512)")
    gpunode = _artifact(doc["gpunode"], "gpunode", "gpunode", text, shown)
    drivers_doc = doc.get("driver", [])
    if not isinstance(drivers_doc, list):
        raise BakeConfigError(shown, "driver", "must be an array of tables ([[driver]])",
                              _line(text, "driver"))
    drivers = tuple(_artifact(d, f"driver[{i}]", None, text, shown)
                    for i, d in enumerate(drivers_doc, 1))
    seen: set[str] = set()
    for d in drivers:
        if d.name in seen:
            raise BakeConfigError(shown, f"{d.key}.name", f"{d.name!r} is baked twice; name "
                                  "each driver sysext once", _line(text, f"{d.key}.name"))
        seen.add(d.name)
    agent = _table(doc.get("agent", {}), "agent", text, shown)
    download = _table(doc.get("download", {}), "download", text, shown)
    base = Path(shown).parent
    agent_config = None
    if "config" in agent:
        value = _string(agent["config"], "agent.config", text, shown)
        agent_config = str(base / value) if not value.startswith("/") else value
    timeout = _integer(download.get("timeout", 60), "download.timeout", 1, 600, text, shown)
    attempts = _integer(download.get("attempts", 3), "download.attempts", 1, 10, text, shown)
    deadline = _integer(download.get("deadline", DEFAULT_DEADLINE), "download.deadline", 1,
                        86400, text, shown)
    config = BakeConfig(shown, base, gpunode, drivers, agent_config, timeout, attempts, text,
                        deadline)
    for driver in drivers:
        source(config, driver, {})  # the placeholders' names and the form, before any work
    if not _FILE_NAME.fullmatch(source(config, gpunode, {}).file_name):
        raise BakeConfigError(shown, "gpunode.source", "must name a file like "
                              "gpunode-0.2.0-x86-64.raw (it keeps that name in "
                              "/opt/extensions/gpunode)", _line(text, "gpunode.source"))
    return config


def source(config: BakeConfig, artifact: Artifact, values: dict[str, str]) -> Source:
    """The artifact's source with the placeholders filled from `values`, checked."""
    key = f"{artifact.key}.source"
    text = artifact.source
    if artifact.key != "gpunode":
        stray = re.sub(r"\{[^{}]*\}", "", text)
        if "{" in stray or "}" in stray:
            raise BakeConfigError(config.file, key, f"{text!r}: a '{{' or '}}' that opens or "
                                  "closes no placeholder; placeholders are "
                                  f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)} (a brace "
                                  "in a URL is written %7B, %7D)", config.line(key))
        for name in re.findall(r"\{([^{}]*)\}", text):
            if name not in PLACEHOLDERS:
                raise BakeConfigError(config.file, key, f"unknown placeholder {{{name}}}; "
                                      f"valid are {', '.join('{' + p + '}' for p in PLACEHOLDERS)}",
                                      config.line(key))
            if name not in values and values:
                raise BakeConfigError(config.file, key, f"{{{name}}} cannot be filled: the "
                                      "image's os-release does not say it", config.line(key))
            if name in values and not is_plain_value(values[name]):
                raise BakeConfigError(config.file, key, f"{{{name}}} cannot be filled: the "
                                      f"image says {_VALUE_KEYS.get(name, name)}="
                                      f"{values[name]!r}, which is no plain name (letters, "
                                      "digits, '.', '_', '+', '-')", config.line(key))
        for name, value in values.items():
            text = text.replace(f"{{{name}}}", value)
    return _parse_source(text, config, key)


def is_plain_value(value: str) -> bool:
    """Whether an os-release or update.conf value may fill a placeholder or name a file."""
    return _PLAIN_VALUE.fullmatch(value) is not None and ".." not in value


def _parse_source(text: str, config: BakeConfig, key: str) -> Source:
    def refuse(reason: str) -> BakeConfigError:
        return BakeConfigError(config.file, key, f"{masked(text)!r}: {reason}",
                               config.line(key))

    if not text or not text.isprintable() or text != text.strip():
        raise refuse("must be a URL or a path, without spaces around it or control characters")
    if "://" not in text:
        return Source(None, str(config.base / text) if not text.startswith("/") else text, text)
    try:
        parts = urllib.parse.urlsplit(text)
        parts.port  # noqa: B018 -- parses it: ValueError for a bad port
    except ValueError as exc:
        raise refuse(f"not a URL: {exc}") from None
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise refuse("a file:// URL names a local absolute path (file:///path)")
        return Source(None, urllib.parse.unquote(parts.path), text)
    if parts.scheme not in ("http", "https"):
        raise refuse("the bake fetches http, https or file URLs, or a path")
    problem = url_problem(text)
    if problem:
        raise refuse(problem)
    return Source(text, None, text)


def masked(text: str) -> str:
    """A source as a message may show it: a user and password in a URL replaced by '***'."""
    if "@" not in text or "://" not in text:
        return text
    scheme, _, rest = text.partition("://")
    netloc, slash, path = rest.partition("/")
    return f"{scheme}://***@{netloc.rpartition('@')[2]}{slash}{path}" if "@" in netloc \
        else text


def url_problem(text: str) -> str | None:
    """Why an http(s) URL cannot be fetched as written, or None. What urllib would fail on
    late and obscurely is refused here: characters outside ASCII (urllib sends none: the host
    is written in its xn-- form, the path percent-encoded), spaces and control characters,
    and a user or password (urllib sends no credentials from a URL, and gpunode sends none:
    a redirect would carry them to another host)."""
    parts = urllib.parse.urlsplit(text)
    if not parts.hostname:
        return "it names no host"
    if parts.username is not None or parts.password is not None:
        return ("a user or password in the URL: gpunode sends no credentials; put the file "
                "where it can be fetched without, or fetch it first and name the file")
    odd = next((c for c in text if not c.isascii() or not c.isprintable() or c.isspace()),
               None)
    if odd is not None:
        where = "host" if odd in (parts.hostname or "") else "URL"
        how = ("write the host in its ASCII (xn--) form" if where == "host" else
               "percent-encode it (a space is %20, é is %C3%A9)")
        return f"the {where} holds {odd!r}, which a URL cannot carry as it is: {how}"
    return None


def _artifact(value: Any, key: str, name: str | None, text: str, shown: str) -> Artifact:
    section = "gpunode" if key == "gpunode" else "driver"
    table = _table(value, key, text, shown, section)
    for wanted in _SECTIONS[section]:
        if wanted not in table:
            raise BakeConfigError(shown, f"{key}.{wanted}", "missing: "
                                  f"[{section if section == 'gpunode' else '[driver]'}] "
                                  f"needs {', '.join(_SECTIONS[section])}", _line(text, key))
    strings = {k: _string(table[k], f"{key}.{k}", text, shown) for k in _SECTIONS[section]}
    if not _SHA512.fullmatch(strings["sha512"]):
        raise BakeConfigError(shown, f"{key}.sha512", "must be 128 lowercase hex digits (the "
                              "artifact's sha512)", _line(text, f"{key}.sha512"))
    if name is None:
        name = strings["name"]
        if not re.fullmatch(DRIVER_NAME, name):
            raise BakeConfigError(shown, f"{key}.name", f"{name!r} is not a Flatcar driver "
                                  "sysext: nvidia-drivers-<branch> or nvidia-drivers-<branch>-"
                                  "open (e.g. nvidia-drivers-570-open)", _line(text, f"{key}.name"))
    return Artifact(key, name, strings["source"], strings["sha512"])


def _table(value: Any, key: str, text: str, shown: str, section: str | None = None
           ) -> dict[str, Any]:
    section = section or key
    if not isinstance(value, dict):
        raise BakeConfigError(shown, key, f"must be a table ([{section}]), not "
                              f"{type(value).__name__}", _line(text, key))
    for name in value:
        if name not in _SECTIONS[section]:
            raise BakeConfigError(shown, f"{key}.{name}", f"unknown key; valid keys in "
                                  f"[{section}] are {', '.join(_SECTIONS[section])}",
                                  _line(text, f"{key}.{name}"))
    return value


def _string(value: Any, key: str, text: str, shown: str) -> str:
    if not isinstance(value, str):
        raise BakeConfigError(shown, key, f"must be a string, not {type(value).__name__} "
                              f"({value!r})", _line(text, key))
    return value


def _integer(value: Any, key: str, low: int, high: int, text: str, shown: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BakeConfigError(shown, key, f"must be an integer from {low} to {high}, not "
                              f"{value!r}", _line(text, key))
    return value


def _line(text: str, key: str) -> int | None:
    """The line of `section.key`, `driver[N].key` (the N-th [[driver]] table) or a section."""
    head, _, name = key.partition(".")
    match = re.fullmatch(r"(\w+)\[(\d+)\]", head)
    if match is None:
        return key_line(text, head, name) if name else (key_line(text, "", head)
                                                        or _header(text, head, 1))
    start = _header(text, match.group(1), int(match.group(2)))
    if start is None or not name:
        return start
    lines = text.splitlines()
    for number in range(start + 1, len(lines) + 1):
        line = lines[number - 1].strip()
        if line.startswith("["):
            break
        if line.partition("=")[0].strip().strip('"') == name and "=" in line:
            return number
    return start


def _header(text: str, section: str, nth: int) -> int | None:
    count = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        if raw.strip().replace(" ", "") in (f"[{section}]", f"[[{section}]]"):
            count += 1
            if count == nth:
                return number
    return None
