"""`gpunode ignition`: the node snippet that installs gpunode, as Butane, Ignition or a CLC
(and, through gpunode.delivery.chart, as cluster-azure / cluster-aws values).

One model (files, links, units) rendered three ways, so the formats cannot drift: Butane
(`variant: flatcar`, `version: 1.0.0`), Ignition 3.3.0 JSON (what Butane emits for Flatcar), and
a Container Linux Config for Cluster API's `ignition.containerLinuxConfig.additionalConfig`
(appended to the Ignition 2.3 config CAPI generates; at most 32768 characters). The units are
embedded verbatim from gpunode's package data `gpunode/delivery/units/` (`units/` at the top of the
checkout links there): the single source the sysext ships too, so an installed gpunode renders
the same snippet from any working directory.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpunode import __version__, delivery, log
from gpunode.config import DEFAULT_CONFIG_PATH, MAX_CONFIG_BYTES, parse_text
from gpunode.driver import nouveau
from gpunode.errors import ConfigError, GpunodeError, HostError, InputRefused, UsageError
from gpunode.platform import flatcar
from gpunode.platform.host import Host

CLC_LIMIT = 32768
FORMATS, CHART_FORMATS = delivery.FORMATS, delivery.CHART_FORMATS
EXTENSIONS_DIR = "/opt/extensions/gpunode"
EXTENSION_LINK = "/etc/extensions/gpunode.raw"
UNIT_NAMES = ("gpunode.service", "gpunode-label.service", "gpunode-watch.service")


@dataclass(frozen=True)
class File:
    """One file the snippet puts on the node, given inline or fetched from a URL."""

    path: str
    mode: int = 0o644
    inline: str | None = None
    url: str | None = None
    sha512: str | None = None


@dataclass(frozen=True)
class Link:
    """One symlink the snippet makes on the node."""

    path: str
    target: str


@dataclass(frozen=True)
class Unit:
    """One systemd unit the snippet writes, enables or masks on the node."""

    name: str
    contents: str | None = None
    enabled: bool | None = None
    mask: bool = False


@dataclass(frozen=True)
class Snippet:
    """The node snippet that installs gpunode, before it is rendered in any format."""

    files: tuple[File, ...] = field(default=())
    links: tuple[Link, ...] = field(default=())
    units: tuple[Unit, ...] = field(default=())


UNITS_PACKAGE_DIR = "units"  # gpunode/delivery/units/: package data (pyproject.toml's package-data)


def packaged_unit(name: str) -> str:
    """A unit's text as gpunode's package data holds it: in a checkout, a wheel install or the
    sysext's bundle alike (importlib.resources; only `gpunode ignition` reads it)."""
    from importlib import resources

    resource = resources.files("gpunode.delivery").joinpath(UNITS_PACKAGE_DIR, name)
    try:
        return resource.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputRefused(str(resource), f"gpunode's packaged unit cannot be read: {exc}",
                           "reinstall gpunode, or name the units' directory with --units") \
            from None


# A snippet file may be as large as the agent config may be on the node (config.py): a config
# the node accepts is never refused here.
MAX_INPUT = MAX_CONFIG_BYTES


def read_input(host: Host, path: str) -> str:
    """A file for the snippet, read through the Host the way the node reads the agent config:
    a regular file (a FIFO would block, a device never ends), at most MAX_INPUT bytes, and
    UTF-8 text (Ignition carries text). Any read failure is an InputRefused (exit 2)."""
    try:
        text = host.read_optional(path, limit=MAX_INPUT, errors="strict")
    except HostError as exc:
        raise InputRefused(path, exc.reason, "give a regular file of UTF-8 text, at most "
                           f"{MAX_INPUT >> 20} MiB") from None
    if text is None:
        raise InputRefused(path, "does not exist")
    return text


def agent_config(path: str) -> str:
    """The agent config to install (path on this machine): a UTF-8 regular file read once
    through the Host, and refused now, exactly as the node would refuse it, if it is not
    valid (ConfigError, exit 2)."""
    try:
        text = read_input(Host(), path)
    except InputRefused as exc:
        raise ConfigError(path, None, exc.reason) from exc
    except GpunodeError as exc:  # the Host could not read it
        raise ConfigError(path, None, f"cannot be read: {exc}") from exc
    parse_text(text, path)
    return text


def checked_text(s: Snippet, fmt: str) -> str:
    """The snippet rendered, refused (exit 2) when a Container Linux Config would not fit
    Cluster API's additionalConfig."""
    text = render(s, fmt)
    if fmt == "clc":
        if len(text) > CLC_LIMIT:
            raise UsageError(f"the Container Linux Config is {len(text)} characters, over "
                             f"Cluster API's additionalConfig limit of {CLC_LIMIT}",
                             "shorten the agent config (comments, defaults), or deliver it "
                             "another way (format ignition or butane)")
        log.get().info("ignition.clc_size", characters=len(text), limit=CLC_LIMIT)
    return text


def check_url(url: str) -> None:
    """A URL Ignition fetches as written: Ignition (Go's url.Parse) refuses control characters,
    bad ports and %-escapes; spaces and non-ASCII must be percent-encoded to reach a server."""
    problem = None
    if any(not (0x20 < ord(c) < 0x7f) for c in url):
        problem = ("it holds a space, a control character or a non-ASCII character; "
                   "percent-encode them (a space is %20)")
    else:
        try:
            parts = urllib.parse.urlsplit(url)
            parts.port  # noqa: B018 -- parses it: ValueError for 'abc' or 99999
        except ValueError as exc:
            problem = str(exc)
        else:
            if parts.scheme not in ("http", "https", "s3", "tftp", "gs"):
                problem = "Ignition fetches http(s), s3, gs or tftp URLs"
            elif not parts.hostname:
                problem = "it names no host"
            elif re.search(r"%(?![0-9A-Fa-f]{2})", url):
                problem = "a '%' that does not start a %XX escape"
    if problem:
        raise UsageError(f"--sysext-url {url!r}: not a URL Ignition can fetch: {problem}",
                         "give the image's full URL, e.g. https://host/path/gpunode-"
                         f"{__version__}-x86-64.raw")


def snippet(sysext_url: str, sysext_sha512: str, agent_config: str | None,
            units: Path | None = None, version: str = __version__,
            host: Host | None = None) -> Snippet:
    if len(sysext_sha512) != 128 or any(c not in "0123456789abcdef" for c in sysext_sha512):
        raise UsageError("--sysext-sha512 must be the image's sha512: 128 lowercase hex digits "
                         "(the .sha512 file `make sysext` writes)")
    check_url(sysext_url)
    image = f"{EXTENSIONS_DIR}/gpunode-{version}-x86-64.raw"
    files = [File(image, 0o644, url=sysext_url, sha512=sysext_sha512),
             File(nouveau.BLACKLIST_FILE, 0o644, inline=nouveau.BLACKLIST_TEXT)]
    if agent_config is not None:
        files.append(File(DEFAULT_CONFIG_PATH, 0o644, inline=agent_config))
    embedded = []
    for name in UNIT_NAMES:
        if units is None:
            text = packaged_unit(name)
        else:
            try:
                text = read_input(host or Host(), str(units.absolute() / name))
            except InputRefused as exc:
                raise InputRefused(exc.path, exc.reason, exc.hint or "--units names the "
                                   f"directory holding {' and '.join(UNIT_NAMES)}; leave it "
                                   "out to embed the units installed with gpunode") from exc
        embedded.append(Unit(name, text, enabled=True))
    return Snippet(files=tuple(files), links=(Link(EXTENSION_LINK, image),),
                   units=(Unit(flatcar.NVIDIA_UNIT, mask=True), *embedded))


# -- renderings ----------------------------------------------------------------------------------


def to_butane(s: Snippet) -> dict[str, Any]:
    def file(f: File) -> dict[str, Any]:
        contents: dict[str, Any] = ({"inline": f.inline} if f.inline is not None else
                                    {"source": f.url,
                                     "verification": {"hash": f"sha512-{f.sha512}"}})
        return {"path": f.path, "mode": f.mode, "contents": contents}

    return {"variant": "flatcar", "version": "1.0.0",
            "storage": {"files": [file(f) for f in s.files],
                        "links": [{"path": ln.path, "target": ln.target, "hard": False}
                                  for ln in s.links]},
            "systemd": {"units": [_unit(u, "enabled") for u in s.units]}}


def to_ignition(s: Snippet) -> dict[str, Any]:
    def file(f: File) -> dict[str, Any]:
        contents: dict[str, Any] = (
            {"source": "data:," + urllib.parse.quote(f.inline, safe="")}
            if f.inline is not None else
            {"source": f.url, "verification": {"hash": f"sha512-{f.sha512}"}})
        return {"path": f.path, "mode": f.mode, "overwrite": True, "contents": contents}

    return {"ignition": {"version": "3.3.0"},
            "storage": {"files": [file(f) for f in s.files],
                        "links": [{"path": ln.path, "target": ln.target, "hard": False,
                                   "overwrite": True} for ln in s.links]},
            "systemd": {"units": [_unit(u, "enabled") for u in s.units]}}


def to_clc(s: Snippet) -> dict[str, Any]:
    def file(f: File) -> dict[str, Any]:
        contents: dict[str, Any] = (
            {"inline": f.inline} if f.inline is not None else
            {"remote": {"url": f.url, "verification": {"hash": {"function": "sha512",
                                                                "sum": f.sha512}}}})
        return {"path": f.path, "filesystem": "root", "mode": f.mode, "contents": contents}

    return {"storage": {"files": [file(f) for f in s.files],
                        "links": [{"path": ln.path, "filesystem": "root", "target": ln.target,
                                   "hard": False} for ln in s.links]},
            "systemd": {"units": [_unit(u, "enabled") for u in s.units]}}


def _unit(u: Unit, enable_key: str) -> dict[str, Any]:
    out: dict[str, Any] = {"name": u.name}
    if u.mask:
        out["mask"] = True
    if u.enabled is not None:
        out[enable_key] = u.enabled
    if u.contents is not None:
        out["contents"] = u.contents
    return out


def render(s: Snippet, fmt: str) -> str:
    if fmt == "ignition":
        return json.dumps(to_ignition(s), indent=2) + "\n"
    import yaml

    document = to_butane(s) if fmt == "butane" else to_clc(s)
    return yaml.dump(document, Dumper=literal_dumper(), sort_keys=False, width=1000)


def literal_dumper() -> type:
    """A SafeDumper that writes multi-line text (unit files, configs) as | blocks."""
    import yaml

    class LiteralDumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    LiteralDumper.add_representer(str, text)
    return LiteralDumper
