"""`gpunode image bake`: gpunode's sysext, a Flatcar driver sysext and the node's config put
into an image root, so a node booted from it downloads and compiles nothing.

Where things go, and why:

- gpunode's sysext: `/opt/extensions/gpunode/<file>`, linked from `/etc/extensions/gpunode.raw`
  (as the Ignition snippet places it, gpunode/delivery/ignition.py).
- A Flatcar driver sysext `<name>`: `/etc/flatcar/sysext/flatcar-<name>-<VERSION>.raw`,
  `<name>` listed in `/etc/flatcar/enabled-sysext.conf`, linked from
  `/etc/extensions/flatcar-<name>.raw`. Flatcar's initramfs (flatcar/bootengine,
  dracut/99setup-root/initrd-setup-root-after-ignition, "Manage optional Flatcar extensions")
  reads every name in enabled-sysext.conf, looks for exactly that file (VERSION from the
  image's /usr/lib/os-release) and downloads it only when it is missing; then it makes that
  link itself. A baked file is therefore used as it is, until an OS update changes VERSION.
- Several driver sysexts (an image for several GPU generations): each file in the same place,
  none listed in enabled-sysext.conf and none linked — the initramfs would link every listed
  one, and systemd-sysext would overlay their modules. At boot the driver step picks the one
  the node's GPUs need (gpunode/driver/branches.py) and merges it from /run/extensions.
- Flatcar's `nvidia.service` masked, the nouveau blacklist, the agent config (optional), and
  gpunode's units enabled (`multi-user.target.wants/` links to the sysext's own units).
- The bake manifest `/etc/gpunode/baked.json`: what was baked, its version, sha512 and source.

Everything is checked before anything is written: the bake config, the image's os-release,
every path the bake will write (gpunode/bake/place.py), each artifact (fetched into a temporary
name beside its place and verified there). Only then are the artifacts renamed into place, the
small files and links written (each only when its bytes or target differ) and the manifest
last; a change that fails there undoes the ones before it. A second bake with the same
inputs fetches nothing and writes nothing. No process runs (but the builder of a `[build]`,
in its own container) and no service is asked: the build host's kernel and services are never
touched, whatever the root. The optional artifacts (toolkit sysext, prebuilt modules, a build):
gpunode/bake/optional.py.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any

from gpunode import __version__, log
from gpunode.bake import config as bake_config
from gpunode.bake import extras, fetch, optional, place
from gpunode.bake.manifest import MANIFEST, OS_RELEASES, SCHEMA_VERSION
from gpunode.config import DEFAULT_CONFIG_PATH
from gpunode.delivery.ignition import EXTENSION_LINK, EXTENSIONS_DIR, UNIT_NAMES
from gpunode.driver import branches, nouveau
from gpunode.driver.branches import SYSEXT_DIR, driver_path
from gpunode.errors import BakeConfigError, ConfigError, GpunodeError, HostError, UsageError
from gpunode.platform import envfile, flatcar, nodelock
from gpunode.platform.host import Host
from gpunode.platform.nodepaths import TEMP_SUFFIX

EXTENSIONS = "/etc/extensions"
AGENT_CONFIG = DEFAULT_CONFIG_PATH
UNIT_DIR = "/etc/systemd/system"
WANTS_DIR = f"{UNIT_DIR}/multi-user.target.wants"
SYSEXT_UNITS = "/usr/lib/systemd/system"  # where gpunode's sysext ships its units
UPDATE_CONFS = ("/etc/flatcar/update.conf", "/usr/share/flatcar/update.conf")


@dataclass(frozen=True)
class Image:
    """The image's own facts, from its files."""

    os_id: str
    version: str | None
    board: str | None
    group: str | None
    kernel: str | None  # the one /usr/lib/modules/<release> of the image, if exactly one


@dataclass(frozen=True)
class Placed:
    """One artifact: where it goes and what it must be."""

    what: str  # gpunode-sysext, driver-sysext
    name: str
    path: str
    sha512: str
    source: bake_config.Source
    version: str | None
    fetch: bool  # False: the file in place already has this sha512
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def stage(self) -> str:
        directory, _, name = self.path.rpartition("/")
        return f"{directory}/.{name}.bake{TEMP_SUFFIX}"


def command(host: Host, args: argparse.Namespace) -> int:
    if args.config is not None:  # the global --config, before "image": an agent config
        raise UsageError(f"--config {args.config} before 'image' names an agent config, which "
                         "image bake does not read", "name the bake config after 'image bake' "
                         "(--config BAKE.toml), and the agent config to install in its [agent] "
                         "config")
    config = bake_config.load(args.bake_config)
    wanted = extras.parse(config)  # the optional artifacts' sections: [toolkit], …
    image = read_image(host)
    agent_text = _agent_config(config, host)
    with log.step("image.bake", root=str(host.root)) as fields:
        artifacts = plan(host, config, image)
        more = optional.plan(host, config, wanted, image, agent_text)
        with nodelock.held(host, "image bake", nodelock.WAIT_SECONDS):
            changed = apply(host, config, image, artifacts, agent_text, more)
        fields.update(changed=changed, fetched=[a.name for a in artifacts if a.fetch])
    for a in artifacts:
        print(f"{a.what} {a.name}: {host.display(a.path)} "
              f"({'fetched, sha512 verified' if a.fetch else 'in place, sha512 matches'})")
    for line in optional.describe(host, more):
        print(line)
    print("\n".join(f"changed {path}" for path in changed) if changed else
          "nothing changed: the image already holds this bake")
    return 0


def read_image(host: Host) -> Image:
    """The image's facts; a root without a readable os-release, or a Flatcar one whose
    VERSION, FLATCAR_BOARD or update GROUP is no plain name, is a UsageError (exit 2)."""
    release_path, text = _first_readable(host, OS_RELEASES)
    if text is None:
        raise UsageError(f"--root {host.root}: no os-release ({' or '.join(OS_RELEASES)}): "
                         "not the root of an OS image", "name the image's root directory (/ "
                         "inside the image-build machine)")
    release = envfile.values(text)
    update_path, update = None, {}
    for path in UPDATE_CONFS:
        found = _first_readable(host, (path,))[1]
        if found is not None and "GROUP" in envfile.values(found):
            update_path, update = path, envfile.values(found)
            break
    kernels = [k for k in host.list_dir("/usr/lib/modules") if host.exists(
        f"/usr/lib/modules/{k}/modules.dep") or host.exists(f"/usr/lib/modules/{k}/kernel")]
    image = Image(release.get("ID", ""), release.get("VERSION") or None,
                  release.get("FLATCAR_BOARD") or None, update.get("GROUP") or None,
                  kernels[0] if len(kernels) == 1 else None)
    if image.os_id == "flatcar":
        for key, noun, value, where in (
                ("VERSION", "version", image.version, release_path),
                ("FLATCAR_BOARD", "board", image.board, release_path),
                ("GROUP", "update group", image.group, update_path)):
            if value is not None and not bake_config.is_plain_value(value):
                raise UsageError(f"--root {host.root}: {host.display(str(where))} says "
                                 f"{key}={value!r}, which is not a Flatcar {noun} "
                                 "(letters, digits, '.', '_', '+', '-'): it would name files "
                                 "and URLs", "check the image's root: a Flatcar image's own "
                                 "files say e.g. VERSION=4459.2.1, FLATCAR_BOARD=amd64-usr, "
                                 "GROUP=stable")
    return image


def _first_readable(host: Host, paths: tuple[str, ...]) -> tuple[str | None, str | None]:
    """The first of `paths` that exists, and its text; one that exists but cannot be read
    (a FIFO, a directory, not UTF-8) is a UsageError naming it: the root is not an image."""
    for path in paths:
        try:
            text = host.read_optional(path)
        except HostError as exc:
            raise UsageError(f"--root {host.root}: {exc.path}: {exc.reason}", "name the "
                             "image's root directory; its os-release and update.conf are "
                             "small UTF-8 files") from None
        if text is not None:
            return path, text
    return None, None


def plan(host: Host, config: bake_config.BakeConfig, image: Image) -> list[Placed]:
    """Each artifact's place, and whether it must be fetched (read-only)."""
    gp = config.gpunode
    source = bake_config.source(config, gp, {})
    path = f"{EXTENSIONS_DIR}/{source.file_name}"
    version = source.file_name.removeprefix("gpunode-").partition("-")[0] or None
    out = [_placed(host, "gpunode-sysext", gp.name, path, gp.sha512, source, version)]
    if config.drivers and (image.os_id != "flatcar" or not image.version):
        raise BakeConfigError(config.file, f"{config.drivers[0].key}.name", "a Flatcar driver "
                              f"sysext needs a Flatcar image, but --root {host.root} has "
                              f"ID={image.os_id or '(none)'} VERSION={image.version or '(none)'} "
                              "in its os-release", config.line(f"{config.drivers[0].key}.name"))
    # One driver: Flatcar's initramfs links it and systemd-sysext merges it with the rest.
    # Several: none is enabled (the initramfs would link them all, and their modules would
    # overlay each other); the driver step merges the one the node's GPUs need at boot.
    enabled = len(config.drivers) == 1
    for d in config.drivers:
        values = {k: v for k, v in (("version", image.version), ("board", image.board),
                                    ("group", image.group), ("name", d.name)) if v}
        baked = branches.Baked(d.name, driver_path(d.name, str(image.version)))
        out.append(_placed(host, "driver-sysext", d.name, baked.path, d.sha512,
                           bake_config.source(config, d, values), image.version,
                           {"branch": str(baked.branch), "flavour": baked.flavour,
                            "link": driver_link(d.name) if enabled else None,
                            "activation": "initramfs" if enabled else "boot"}))
    return out


def driver_link(name: str) -> str:
    return f"{EXTENSIONS}/flatcar-{name}.raw"


def _placed(host: Host, what: str, name: str, path: str, sha512: str,
            source: bake_config.Source, version: str | None,
            extra: dict[str, Any] | None = None) -> Placed:
    present = host.lstat(path) is not None and host.digest(path, "sha512") == sha512
    return Placed(what, name, path, sha512, source, version, not present, extra or {})


def _agent_config(config: bake_config.BakeConfig, host: Host) -> bytes | None:
    """The agent config to install, refused now (exit 2) when the node would refuse it. None:
    the image keeps its own, which must then be one the node accepts (ConfigError, exit 2)."""
    if config.agent_config is None:
        from gpunode.config import load_config

        load_config(host)
        return None
    from gpunode.delivery import ignition

    try:
        return ignition.agent_config(config.agent_config).encode()
    except ConfigError as exc:
        raise BakeConfigError(config.file, "agent.config", f"{exc}",
                              config.line("agent.config")) from None


def apply(host: Host, config: bake_config.BakeConfig, image: Image, artifacts: list[Placed],
          agent_text: bytes | None, more: optional.Plan | None = None) -> list[str]:
    """Check every path the bake will write, fetch and verify every artifact that must be,
    then place them all; what changed. `more`: the optional artifacts
    (gpunode/bake/optional.py), staged last, placed first. A refusal before the placement
    leaves nothing; one during it is undone (gpunode/bake/place.py)."""
    more = more or optional.Plan()
    previous = _previous(host)
    files, links = _small_files(host, artifacts, previous, agent_text)
    stale = _stale(previous, artifacts)
    more_links, more_paths = optional.touched(more)
    for path in [*files, MANIFEST]:
        place.check_file(host, path)
    for path in [*links, *more_links]:
        place.check_link(host, path)
    for path in [a.path for a in artifacts] + stale + more_paths:
        place.check_rename(host, path)
    staged: list[Placed] = []
    made: list[str] = []  # directories made for the stages: removed again when one fails
    try:
        for a in artifacts:
            if a.fetch:
                made += place.make_dirs(host, a.path.rpartition("/")[0])
                fetch.stage(host, a.stage, a.source, a.sha512, f"{a.what} {a.name}",
                            config.timeout, config.attempts, config.deadline)
                staged.append(a)
        optional.stage(host, config, more)  # removes what it made itself when it fails
    except BaseException:
        _remove_stages(host, staged, made)
        raise
    placement = place.Placement(host)
    changed: list[str] = []
    try:
        for a in staged:
            placement.rename(a.stage, a.path)
            changed.append(host.display(a.path))
        changed += optional.place(host, more, placement)
        for path, data in files.items():
            if host.read_optional_bytes(path) != data:
                placement.write(path, data)
                changed.append(host.display(path))
        for path, target in links.items():
            if host.read_link(path) != target:
                placement.link(path, target)
                changed.append(host.display(path))
        for old in stale:
            placement.remove(old)
            changed.append(f"removed {host.display(old)}")
        manifest = render_manifest(image, artifacts, agent_text, config,
                                   optional.entries(host, more))
        if host.read_optional_bytes(MANIFEST) != manifest:
            placement.write(MANIFEST, manifest)
            changed.append(host.display(MANIFEST))
    except BaseException:
        placement.rollback()
        optional.unstage(host, more)
        _remove_stages(host, staged, made)
        raise
    placement.commit()
    return changed


def _remove_stages(host: Host, staged: list[Placed], made: list[str]) -> None:
    for a in staged:
        host.remove(a.stage)
    for directory in reversed(made):
        host.remove_dir(directory)


def _small_files(host: Host, artifacts: list[Placed], previous: dict[str, Any],
                 agent_text: bytes | None) -> tuple[dict[str, bytes], dict[str, str]]:
    """The small files (path → bytes) and links (path → target) the bake writes, from what
    the image holds now (read here, before anything is fetched)."""
    links = {EXTENSION_LINK: artifacts[0].path, f"{UNIT_DIR}/{flatcar.NVIDIA_UNIT}": "/dev/null",
             **{f"{WANTS_DIR}/{unit}": f"{SYSEXT_UNITS}/{unit}" for unit in UNIT_NAMES},
             **{a.extra["link"]: a.path for a in artifacts[1:] if a.extra["link"]}}
    files = {nouveau.BLACKLIST_FILE: nouveau.BLACKLIST_TEXT.encode()}
    drivers = artifacts[1:]
    enabled_names = [a.name for a in drivers if a.extra["link"]]
    enabled = _enabled_sysexts(host, enabled_names, _old_drivers(previous, artifacts) + [
        a.name for a in drivers if not a.extra["link"]])
    if enabled is not None:
        files[flatcar.ENABLED_SYSEXT] = enabled
    if agent_text is not None:
        files[AGENT_CONFIG] = agent_text
    return files, links


def _previous(host: Host) -> dict[str, Any]:
    """The manifest of the last bake, as far as it can be read ({} when none or unreadable:
    then nothing of an earlier bake is removed)."""
    from gpunode.bake import manifest

    try:
        return manifest.read(host) or {}
    except GpunodeError as exc:  # a damaged manifest: nothing known to clean up; rewritten
        log.get().warning("bake.manifest_unreadable", exc=exc)
        return {}


def _old_drivers(previous: dict[str, Any], artifacts: list[Placed]) -> list[str]:
    baked = {a.name for a in artifacts[1:]}
    return [str(a.get("name")) for a in previous.get("artifacts", [])
            if a.get("what") == "driver-sysext" and a.get("name") not in baked]


def _stale(previous: dict[str, Any], artifacts: list[Placed]) -> list[str]:
    """Files and links an earlier bake placed that this one replaces or no longer bakes."""
    current = {a.path for a in artifacts} | {a.extra.get("link") for a in artifacts}
    stale = []
    for a in previous.get("artifacts", []):
        if a.get("what") not in ("gpunode-sysext", "driver-sysext"):
            continue
        for key in ("path", "link"):
            path = a.get(key)
            if isinstance(path, str) and path.startswith((EXTENSIONS_DIR + "/", SYSEXT_DIR + "/",
                                                          EXTENSIONS + "/flatcar-")) \
                    and path not in current and ".." not in path:
                stale.append(path)
    return stale


def _enabled_sysexts(host: Host, names: list[str], dropped: list[str]) -> bytes | None:
    """enabled-sysext.conf with the baked names listed once, earlier bakes' drivers that are
    no longer baked taken out, every other line as it was; None: no file needed."""
    text = host.read_optional(flatcar.ENABLED_SYSEXT)
    if text is None and not names:
        return None
    text = text or ""
    lines = [line for line in text.splitlines()
             if line.partition("#")[0].strip() not in dropped]
    listed = {line.partition("#")[0].strip() for line in lines}
    lines += [name for name in names if name not in listed]
    return ("\n".join(lines) + "\n").encode() if lines else b""


def render_manifest(image: Image, artifacts: list[Placed], agent_text: bytes | None,
                    config: bake_config.BakeConfig,
                    more: list[dict[str, Any]] | None = None) -> bytes:
    import hashlib

    entries: list[dict[str, Any]] = [
        {"what": a.what, "name": a.name, "version": a.version, "path": a.path,
         "sha512": a.sha512, "source": a.source.shown, **a.extra} for a in artifacts]
    entries += more or []  # the optional artifacts (gpunode/bake/optional.py)
    if agent_text is not None:
        entries.append({"what": "agent-config", "name": "config.toml", "version": None,
                        "path": AGENT_CONFIG, "sha512": hashlib.sha512(agent_text).hexdigest(),
                        "source": config.agent_config})
    document = {"schema_version": SCHEMA_VERSION, "baked_by": f"gpunode {__version__}",
                "os": {"id": image.os_id, "version": image.version, "board": image.board,
                       "kernel": image.kernel},
                "artifacts": entries,
                "units": {"masked": [flatcar.NVIDIA_UNIT], "enabled": list(UNIT_NAMES)},
                "files": [nouveau.BLACKLIST_FILE, flatcar.ENABLED_SYSEXT]}
    return (json.dumps(document, indent=2) + "\n").encode()
