"""The optional artifacts of `gpunode image bake` (gpunode/bake/extras.py names them): the
toolkit sysext, prebuilt module sets and a driver built for the image's kernel. Planned
read-only with the rest (`plan`), fetched, verified, unpacked or built before anything is
placed (`stage`, last of the bake's stages: the build takes minutes, a wrong digest
seconds), then placed (`place`), each recorded in the bake manifest (`entries`).

Where they go, and why:

- The toolkit sysext `<name>` (flatcar/sysext-bakery's `nvidia-runtime`, the NVIDIA Container
  Toolkit): `/opt/extensions/<name>/<file>`, linked from `/etc/extensions/<name>.raw` — the
  bakery's own placement (docs/nvidia_runtime.md's Butane snippet; lib/sysupdate.conf.tmpl:
  `Target Path=/opt/extensions/<name>`, `MatchPattern=<name>-@v-%a.raw`,
  `CurrentSymlink=/etc/extensions/<name>.raw`), so a sysupdate config added later finds it.
  Its binaries land in /usr/bin, where containerd.runtime_path's default already points:
  no agent config key changes.
- A prebuilt set for kernel K: unpacked into `<first of driver.prebuilt_dirs>/K/`, where the
  driver step's `prebuilt` strategy and the driver root (driver/userspace.py, layout
  `prebuilt`: *.ko, lib/, bin/, firmware/nvidia/<version>/) look. Unpacked into
  `.K.bake.gpunode-tmp` beside it (gpunode/bake/archive.py checks every member), then renamed.
- A build for kernel K, the agent config's driver.version and a flavour: the build strategy's
  cache entry `/opt/gpunode/drivers/K/<version>-<flavour>/`, made by driver/build.py's own
  `build()` (staged and published by one rename there), which a booting node finds usable and
  loads: strategy build, action load, no compile.

An artifact whose place already holds what the bake config pins is not fetched, unpacked or
built again; one no longer baked (an earlier bake's manifest names it) is removed.
"""

from __future__ import annotations

import hashlib
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from gpunode.bake import archive, fetch
from gpunode.bake import config as bake_config
from gpunode.bake.extras import Extras, toolkit_version
from gpunode.bake.place import Placement, make_dirs
from gpunode.config import DEFAULT_CONFIG_PATH, AgentConfig, BuildConfig, DriverConfig
from gpunode.driver import build as driver_build
from gpunode.driver import cache, modules
from gpunode.errors import (
    BakeArchiveError,
    BakeConfigError,
    BakeError,
    DriverBuildError,
    GpunodeError,
)
from gpunode.platform.host import Host
from gpunode.platform.nodepaths import TEMP_SUFFIX

EXTENSIONS_DIR = "/opt/extensions"
EXTENSIONS = "/etc/extensions"
TOOLKIT, PREBUILT, BUILD = "toolkit-sysext", "prebuilt-modules", "driver-build"
_LIBCUDA = re.compile(r"lib(?:64)?/libcuda\.so\.(\d+\.\d+(?:\.\d+)?)")


@dataclass
class Toolkit:
    """The toolkit sysext as the bake plans it: its place, and whether it must be fetched."""

    name: str
    path: str
    sha512: str
    source: bake_config.Source
    version: str | None
    fetch: bool

    @property
    def link(self) -> str:
        return f"{EXTENSIONS}/{self.name}.raw"

    @property
    def stage(self) -> str:
        directory, _, name = self.path.rpartition("/")
        return f"{directory}/.{name}.bake{TEMP_SUFFIX}"


@dataclass
class ModuleSet:
    """A prebuilt module set as planned: its kernel's directory, and whether to fetch it."""

    kernel: str
    path: str  # <prebuilt dir>/<kernel>
    sha512: str  # of the archive
    source: bake_config.Source
    files: dict[str, str]  # path in the set → sha256 (the set in place, or once unpacked)
    fetch: bool

    def _beside(self, what: str) -> str:
        base, _, kernel = self.path.rpartition("/")
        return f"{base}/.{kernel}.{what}{TEMP_SUFFIX}"

    @property
    def archive(self) -> str:
        return self._beside("tar.bake")

    @property
    def staged(self) -> str:
        return self._beside("bake")

    @property
    def version(self) -> str | None:
        return next((m.group(1) for f in sorted(self.files) if (m := _LIBCUDA.fullmatch(f))),
                    None)


@dataclass
class Built:
    """One driver build the bake plans into the image's cache: one kernel, driver and flavour."""

    inputs: driver_build.BuildInputs
    plan: driver_build.BuildPlan
    build: bool  # False: the image's cache has a usable entry already
    hit: bool = False  # the build found it made meanwhile


@dataclass
class Plan:
    """What the bake does with the optional artifacts, decided before anything is written."""

    toolkit: Toolkit | None = None
    prebuilt: list[ModuleSet] = field(default_factory=list)
    builds: list[Built] = field(default_factory=list)
    command: tuple[str, ...] = ()  # the builder's
    previous: dict[str, Any] = field(default_factory=dict)  # the last bake's manifest
    prebuilt_dirs: tuple[str, ...] = ()

    @property
    def paths(self) -> set[str]:
        return ({self.toolkit.path} if self.toolkit else set()) | \
            {s.path for s in self.prebuilt} | {b.plan.entry for b in self.builds}


# -- plan (read-only) ----------------------------------------------------------------------------


def plan(host: Host, config: bake_config.BakeConfig, extras: Extras, image: Any,
         agent_text: bytes | None) -> Plan:
    """Each optional artifact's place and whether it must be fetched or built; refusals of
    the bake config (exit 2) before anything is written."""
    previous = _previous(host)
    if not extras:
        return Plan(previous=previous)
    agent = _agent(host, agent_text)
    values = {k: v for k, v in (("version", image.version), ("board", image.board),
                                ("group", image.group)) if v}
    out = Plan(previous=previous, prebuilt_dirs=agent.driver.prebuilt_dirs)
    if extras.toolkit is not None:
        t = extras.toolkit
        source = bake_config.source(config, t, {**values, "name": t.name})
        path = f"{EXTENSIONS_DIR}/{t.name}/{source.file_name}"
        present = host.lstat(path) is not None and host.digest(path, "sha512") == t.sha512
        out.toolkit = Toolkit(t.name, path, t.sha512, source,
                              toolkit_version(t.name, source.file_name), not present)
    for p in extras.prebuilt:
        kernel = _kernel(config, p.kernel, image, f"{p.artifact.key}.kernel")
        if not agent.driver.prebuilt_dirs:
            raise BakeConfigError(config.file, f"{p.artifact.key}.kernel", "the agent config's "
                                  "driver.prebuilt_dirs is empty: the node would never look "
                                  "for prebuilt modules", config.line(p.artifact.key))
        path = f"{agent.driver.prebuilt_dirs[0].rstrip('/')}/{kernel}"
        source = bake_config.source(config, p.artifact, {**values, "name": kernel})
        files = _set_in_place(host, path, p.artifact.sha512, previous)
        if files is None and host.lstat(path) is not None and path not in _placed(previous):
            raise BakeError(f"{PREBUILT} {kernel}", source.shown, f"{host.display(path)} "
                            "exists and no earlier bake placed it: a bake replaces only what "
                            "it placed", "remove it, or list another directory first in the "
                            "agent config's driver.prebuilt_dirs")
        out.prebuilt.append(ModuleSet(kernel, path, p.artifact.sha512, source, files or {},
                                      files is None))
    if extras.build is not None:
        out.builds, out.command = _builds(host, config, extras, image, agent), \
            extras.build.command
    return out


def _builds(host: Host, config: bake_config.BakeConfig, extras: Extras, image: Any,
            agent: AgentConfig) -> list[Built]:
    b = extras.build
    assert b is not None
    kernel = _kernel(config, b.kernel, image, "build.kernel")
    pinned = agent.driver.flavour
    flavours = b.flavours or ((pinned,) if pinned != "auto" else ())
    if not flavours:
        raise BakeConfigError(config.file, "build.flavours", "missing: the agent config's "
                              "driver.flavour is auto, so the node picks the flavour by its "
                              "GPUs; name those to build (open for Turing and newer, "
                              "proprietary for Volta and older, both for a mixed pool)",
                              config.line("build"))
    if pinned != "auto" and set(flavours) != {pinned}:
        raise BakeConfigError(config.file, "build.flavours", f"the agent config pins "
                              f"driver.flavour = {pinned!r}: a node would never load "
                              f"{', '.join(f for f in flavours if f != pinned)}",
                              config.line("build.flavours"))
    facts = driver_build.host_facts(host)
    try:
        _builder(b.command)  # a typo in the builder's placeholders, now
        out = []
        for flavour in flavours:
            inputs = driver_build.BuildInputs(
                kernel=kernel, driver=agent.driver.version, flavour=flavour,
                dev_container_url=b.dev_container_url,
                dev_container_sha512=b.dev_container_sha512, driver_url=b.driver_url,
                driver_sha256=b.driver_sha256)
            planned = driver_build.plan_build(inputs, facts)
            entry, _ = cache.check_entry(host, planned.entry, kernel, inputs.driver, flavour)
            out.append(Built(inputs, planned, entry is None))
    except DriverBuildError as exc:
        raise BakeConfigError(config.file, "build", str(exc), config.line("build")) from None
    return out


def _kernel(config: bake_config.BakeConfig, named: str | None, image: Any, key: str) -> str:
    if named:
        return named
    if image.kernel is None:
        raise BakeConfigError(config.file, key, "missing: the image has no single "
                              "/usr/lib/modules/<release> to take the kernel from; name it "
                              "(e.g. kernel = \"6.6.95-flatcar\")", config.line(key.split(".")[0]))
    return str(image.kernel)


def _agent(host: Host, agent_text: bytes | None) -> AgentConfig:
    """The agent config the node will read: the bake's, else the image's own (both checked
    already by image._agent_config)."""
    from gpunode.config import load_config, parse_text

    if agent_text is not None:
        return parse_text(agent_text.decode(), host.display(DEFAULT_CONFIG_PATH))
    return load_config(host)


def _builder(command: tuple[str, ...]) -> Any:
    """The real fetcher and builder (driver/builders.py); the fetcher reads file:// sources
    and paths on the baking machine, as every other bake source is read."""
    from gpunode.driver import builders

    return builders.default_adapters(BuildConfig(command=command))


def _previous(host: Host) -> dict[str, Any]:
    from gpunode.bake import manifest

    try:
        return manifest.read(host) or {}
    except GpunodeError:
        return {}  # image.py warns about it once


def _placed(previous: dict[str, Any]) -> set[str]:
    """The prebuilt sets' directories the last bake placed."""
    return {a.get("path") for a in previous.get("artifacts", [])
            if isinstance(a, dict) and a.get("what") == PREBUILT}


def _set_in_place(host: Host, path: str, sha512: str,
                  previous: dict[str, Any]) -> dict[str, str] | None:
    """The files of the prebuilt set in place, when an earlier bake unpacked this archive
    there and every file is still as it was unpacked (and nothing else is there)."""
    entry = next((a for a in previous.get("artifacts", []) if isinstance(a, dict)
                  and a.get("what") == PREBUILT and a.get("path") == path
                  and a.get("sha512") == sha512), None)
    files = entry.get("files") if entry else None
    if not isinstance(files, dict) or not files:
        return None
    try:
        return files if archive.tree(host, path) == files else None
    except GpunodeError:
        return None


# -- stage: fetch, verify, unpack, build; nothing placed yet -------------------------------------


def stage(host: Host, config: bake_config.BakeConfig, the_plan: Plan) -> None:
    """Everything the plan must fetch, unpacked and built, beside its place; on any failure
    whatever this made is removed again (a build's own staging is driver/build.py's)."""
    made: list[str] = []
    try:
        t = the_plan.toolkit
        if t is not None and t.fetch:
            made += make_dirs(host, t.path.rpartition("/")[0])
            _sweep(host, t.path)
            fetch.stage(host, t.stage, t.source, t.sha512, f"{TOOLKIT} {t.name}",
                        config.timeout, config.attempts, config.deadline)
        for s in the_plan.prebuilt:
            if s.fetch:
                made += make_dirs(host, s.path.rpartition("/")[0])
                _sweep(host, s.path)
                _unpack(host, config, s)
        pending = [b for b in the_plan.builds if b.build]
        if pending:
            fetcher, builder = _builder(the_plan.command)
            for b in pending:
                result = driver_build.build(host, b.inputs, fetcher, builder,
                                            driver_build.host_facts(host))
                b.hit = result.cache_hit
    except BaseException:
        if the_plan.toolkit is not None:
            host.remove(the_plan.toolkit.stage)
        for s in the_plan.prebuilt:
            host.remove(s.archive)
            host.remove_tree(s.staged)
        for directory in reversed(made):
            host.remove_dir(directory)
        raise


def _unpack(host: Host, config: bake_config.BakeConfig, s: ModuleSet) -> None:
    what = f"{PREBUILT} {s.kernel}"
    fetch.stage(host, s.archive, s.source, s.sha512, what, config.timeout, config.attempts,
                config.deadline)
    host.make_dirs(s.staged)
    s.files = archive.unpack(host, s.archive, s.staged, what, s.source.shown)
    host.remove(s.archive)
    if "nvidia" not in modules.module_files(host, s.staged):
        raise BakeArchiveError(what, s.source.shown, "holds no nvidia.ko; nothing of the "
                               "archive was placed", "put the modules (nvidia.ko, "
                               "nvidia-uvm.ko, nvidia-modeset.ko) at the archive's top")


def _sweep(host: Host, path: str) -> None:
    """What a killed bake left beside `path`: its stages and their temporary files."""
    directory, _, name = path.rpartition("/")
    for entry in host.list_dir(directory):
        if entry.startswith(f".{name}.") and entry.endswith(TEMP_SUFFIX):
            host.remove_tree(f"{directory}/{entry}")


# -- place ---------------------------------------------------------------------------------------


def touched(the_plan: Plan) -> tuple[list[str], list[str]]:
    """What place() will write — (links, paths renamed into place or removed) — for the bake
    to check before anything is fetched (gpunode/bake/place.py)."""
    t = the_plan.toolkit
    paths = ([t.path] if t else []) + [s.path for s in the_plan.prebuilt] + \
        [b.plan.entry for b in the_plan.builds] + _stale(the_plan)
    return ([t.link] if t else []), paths


def place(host: Host, the_plan: Plan, placement: Placement) -> list[str]:
    """Rename what was staged into place, link the toolkit, remove what an earlier bake
    placed that this one no longer bakes, each through `placement` (gpunode/bake/place.py:
    undone when a later change fails); what changed."""
    changed = []
    t = the_plan.toolkit
    if t is not None:
        if t.fetch:
            placement.rename(t.stage, t.path)
            changed.append(host.display(t.path))
        if host.read_link(t.link) != t.path:
            placement.link(t.link, t.path)
            changed.append(host.display(t.link))
    for s in the_plan.prebuilt:
        if s.fetch:
            placement.rename(s.staged, s.path)
            changed.append(host.display(s.path))
    for b in the_plan.builds:
        if b.build and not b.hit:
            placement.built(b.plan.entry)  # published by driver/build.py while staging
            changed.append(host.display(b.plan.entry))
    for path in _stale(the_plan):
        placement.remove(path)
        changed.append(f"removed {host.display(path)}")
        parent = path.rpartition("/")[0]
        if parent.startswith((f"{EXTENSIONS_DIR}/", f"{cache.CACHE_ROOT}/")):
            placement.remove_dir(parent)  # the old toolkit's or kernel's directory, if empty
    return changed


def unstage(host: Host, the_plan: Plan) -> None:
    """What stage() left that place() did not take: removed after a refused placement."""
    for path in [the_plan.toolkit.stage] if the_plan.toolkit else []:
        host.remove(path)
    for s in the_plan.prebuilt:
        host.remove_tree(s.staged)


def _stale(the_plan: Plan) -> list[str]:
    """The paths an earlier bake's manifest names for these kinds that this bake does not
    place, each only where this bake would put such a thing (a manifest is no licence to
    remove anything else)."""
    current = the_plan.paths | ({the_plan.toolkit.link} if the_plan.toolkit else set())
    bases = {d.rstrip("/") for d in (*the_plan.prebuilt_dirs, *DriverConfig.prebuilt_dirs)}
    name = r"[A-Za-z0-9][A-Za-z0-9._+-]*"
    allowed = {
        TOOLKIT: (rf"{EXTENSIONS_DIR}/(?!gpunode/){name}/{name}\.raw",
                  rf"{EXTENSIONS}/(?!gpunode\.raw$|flatcar-){name}\.raw"),
        PREBUILT: tuple(rf"{re.escape(base)}/{name}" for base in bases if base),
        BUILD: (rf"{cache.CACHE_ROOT}/{name}/{name}",),
    }
    stale = []
    for a in the_plan.previous.get("artifacts", []):
        if not isinstance(a, dict) or a.get("what") not in allowed:
            continue
        for key in ("path", "link"):
            path = a.get(key)
            if isinstance(path, str) and path not in current and ".." not in path.split("/") \
                    and any(re.fullmatch(p, path) for p in allowed[a["what"]]):
                stale.append(path)
    return stale


# -- the manifest and the output -----------------------------------------------------------------


def entries(host: Host, the_plan: Plan) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    t = the_plan.toolkit
    if t is not None:
        out.append({"what": TOOLKIT, "name": t.name, "version": t.version, "path": t.path,
                    "sha512": t.sha512, "source": t.source.shown, "link": t.link})
    for s in the_plan.prebuilt:
        out.append({"what": PREBUILT, "name": s.kernel, "version": s.version, "path": s.path,
                    "sha512": s.sha512, "source": s.source.shown, "kernel": s.kernel,
                    "files": dict(sorted(s.files.items()))})
    for b in the_plan.builds:
        data = host.read_bytes(f"{b.plan.entry}/{cache.MANIFEST}")
        out.append({"what": BUILD, "name": f"{b.inputs.driver}-{b.inputs.flavour}",
                    "version": b.inputs.driver, "path": b.plan.entry,
                    "sha512": hashlib.sha512(data).hexdigest(),
                    "source": _shown(b.plan.installer.url), "kernel": b.inputs.kernel,
                    "flavour": b.inputs.flavour,
                    "dev_container": _shown(b.plan.dev_container.url)})
    return out


def describe(host: Host, the_plan: Plan) -> list[str]:
    """One line per optional artifact, as the bake prints them."""
    lines = []
    t = the_plan.toolkit
    if t is not None:
        lines.append(f"{TOOLKIT} {t.name}: {host.display(t.path)} "
                     f"({'fetched, sha512 verified' if t.fetch else 'in place, sha512 matches'})")
    lines += [f"{PREBUILT} {s.kernel}: {host.display(s.path)} "
              f"({'fetched, sha512 verified, unpacked' if s.fetch else 'in place, as unpacked'})"
              for s in the_plan.prebuilt]
    lines += [f"{BUILD} {b.inputs.driver}-{b.inputs.flavour} for {b.inputs.kernel}: "
              f"{host.display(b.plan.entry)} "
              f"({'built' if b.build and not b.hit else 'in the cache, usable'})"
              for b in the_plan.builds]
    return lines


def _shown(url: str) -> str:
    """A URL without its query string, user or password (as bake_config.Source shows one)."""
    if "://" not in url:
        return url
    parts = urllib.parse.urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return urllib.parse.urlunsplit((parts.scheme, (parts.hostname or "") + port, parts.path,
                                    "", ""))
