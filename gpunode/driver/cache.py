"""The driver cache: one entry of built NVIDIA modules per kernel, driver and flavour.

An entry is `<CACHE_ROOT>/<kernel>/<driver>-<flavour>/`: the built `*.ko` files, flat, and
`manifest.json` (what was built, from which verified inputs, their digests). An entry is
*usable* only when its manifest parses, names the same kernel, driver and flavour, and every
module it lists is there with the recorded sha256: a half-copied or tampered entry is rebuilt,
never loaded.

A build (driver/build.py) stages its entry in a directory next to it
(`.staging-<driver>-<flavour>-<random>`) and publishes it by one rename (`publish`); staging
dirs left by a crash or a failed build are removed by the next build or prune under the same
lock (`remove_leftovers`). Builds serialise on an flock of `<CACHE_ROOT>/.lock` (`locked`).
Every file operation goes through the Host.
"""

from __future__ import annotations

import contextlib
import re
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gpunode import kernelinfo, log, records
from gpunode.errors import DriverBuildError
from gpunode.host import Host

CACHE_ROOT = "/opt/gpunode/drivers"
LOCK_FILE = f"{CACHE_ROOT}/.lock"
MANIFEST = "manifest.json"
SCHEMA_VERSION = 1
STAGING_PREFIX = ".staging-"

# Flavour → the directory of the extracted installer whose modules it builds. GRID is the
# proprietary source tree of NVIDIA's GRID installer (a different driver_url).
FLAVOUR_SOURCES = {"open": "kernel-open", "proprietary": "kernel", "grid": "kernel"}
MODULE_DIRS = ("/lib/modules", "/usr/lib/modules")

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")  # a kernel release or driver version


@dataclass(frozen=True)
class CacheEntry:
    path: str  # host path of the entry directory
    manifest: dict[str, Any]
    modules: tuple[str, ...]  # host paths of the .ko files, sorted by name


# -- names and manifests (pure) ------------------------------------------------------------------


def entry_path(kernel: str, driver: str, flavour: str) -> str:
    """The host path of the cache entry; names that could climb out of the cache are refused."""
    for what, value in (("kernel", kernel), ("driver version", driver)):
        if not NAME_RE.fullmatch(value):
            raise DriverBuildError("use", value, f"not a {what}: letters, digits, '.', '_', '+' "
                                   "or '-' only, starting with a letter or digit")
    if flavour not in FLAVOUR_SOURCES:
        raise DriverBuildError("use", flavour, "not a driver flavour",
                               hint=f"use one of {', '.join(FLAVOUR_SOURCES)}")
    return f"{CACHE_ROOT}/{kernel}/{driver}-{flavour}"


def is_module_name(name: str) -> bool:
    return bool(NAME_RE.fullmatch(name)) and name.endswith(".ko")


def make_manifest(kernel: str, driver: str, flavour: str, flatcar_version: str | None,
                  modules: Mapping[str, str], inputs: Mapping[str, dict[str, Any]],
                  built_at: datetime, seconds: float) -> dict[str, Any]:
    """The manifest of a finished build: modules (name → sha256) and its inputs (role →
    url, digest, whether it was verified)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "kernel": kernel,
        "driver": driver,
        "flavour": flavour,
        "flatcar_version": flatcar_version,
        "modules": dict(sorted(modules.items())),
        "inputs": dict(inputs),
        "built_at": records.utc_timestamp(built_at.timestamp()),
        "build_seconds": round(seconds, 3),
    }


def manifest_problem(manifest: Any, kernel: str, driver: str, flavour: str) -> str | None:
    """Why a parsed manifest does not describe this entry; None when its shape is right."""
    if not isinstance(manifest, dict) or manifest.get("schema_version") != SCHEMA_VERSION:
        return f"not a schema_version {SCHEMA_VERSION} manifest"
    for key, want in (("kernel", kernel), ("driver", driver), ("flavour", flavour)):
        if manifest.get(key) != want:
            return f"its {key} is {manifest.get(key)!r}, not {want!r}"
    modules = manifest.get("modules")
    if not isinstance(modules, dict) or not modules:
        return "it lists no modules"
    for name, digest in modules.items():
        if not is_module_name(name) or not isinstance(digest, str):
            return f"module entry {name!r} is malformed"
    return None


# -- lookup --------------------------------------------------------------------------------------


def find_usable(host: Host, kernel: str, driver: str, flavour: str) -> CacheEntry | None:
    """The entry for these names if it is complete and every module has its recorded sha256.

    Hashes every module (tens of MB: a fraction of a second), so call it once per boot.
    """
    entry, problem = check_entry(host, entry_path(kernel, driver, flavour), kernel, driver,
                                 flavour)
    if problem is not None:
        log.get().warning("driver.cache.unusable",
                          entry=host.display(entry_path(kernel, driver, flavour)), reason=problem)
    return entry


def check_entry(host: Host, path: str, kernel: str, driver: str,
                flavour: str) -> tuple[CacheEntry | None, str | None]:
    """(the entry, None) when usable; (None, why not) when it is there but unusable;
    (None, None) when there is none."""
    text = host.read_optional(f"{path}/{MANIFEST}")
    if text is None:
        return None, ("it has no manifest.json" if host.lstat(path) is not None else None)
    try:
        manifest = records.loads_json(text, "manifest.json")
    except ValueError as exc:  # not JSON, or nested too deeply to read
        return None, str(exc)
    problem = manifest_problem(manifest, kernel, driver, flavour)
    if problem is None:
        problem = _modules_problem(host, path, manifest["modules"])
    if problem is not None:
        return None, problem
    names = sorted(manifest["modules"])
    return CacheEntry(path, manifest, tuple(f"{path}/{name}" for name in names)), None


def _modules_problem(host: Host, path: str, modules: Mapping[str, str]) -> str | None:
    for name, recorded in sorted(modules.items()):
        module = f"{path}/{name}"
        st = host.stat(module)
        if st is None or not stat.S_ISREG(st.st_mode):
            return f"{name} is missing"
        actual = host.digest(module, "sha256")
        if actual != recorded:
            return f"{name} has sha256 {actual}, the manifest says {recorded}"
    return None


def installed_kernels(host: Host) -> set[str]:
    """Kernel releases with a module tree, plus the running kernel."""
    kernels = {name for directory in MODULE_DIRS for name in host.list_dir(directory)
               if NAME_RE.fullmatch(name)}
    running = (host.read_optional(kernelinfo.RELEASE) or "").strip()
    if running:
        kernels.add(running)
    return kernels


# -- lock, publish, prune ------------------------------------------------------------------------


@contextlib.contextmanager
def locked(host: Host) -> Iterator[None]:
    """An exclusive flock of the cache, held for the whole build or prune; a build that has to
    wait logs it once and waits as long as the other takes (a build takes minutes)."""
    def waiting(note: str) -> None:
        log.get().info("driver.build.waiting", lock=host.display(LOCK_FILE),
                       reason="another driver build holds the cache")

    with host.lock(LOCK_FILE, wait=None, on_wait=waiting, mode=0o644):
        yield


def publish(host: Host, staging: str, final: str) -> None:
    """Make the staged entry visible in one rename. An unusable entry already there (the
    caller checked under the lock) is first renamed aside as a staging dir, then removed."""
    if host.lstat(final) is not None:
        aside = f"{staging}-replaced"
        host.rename(final, aside)
        host.remove_tree(aside)
    host.rename(staging, final)


def remove_leftovers(host: Host) -> list[str]:
    """Staging dirs of builds that crashed or failed; call only under the cache lock."""
    removed = []
    for kernel in host.list_dir(CACHE_ROOT):
        if kernel.startswith("."):
            continue
        for name in host.list_dir(f"{CACHE_ROOT}/{kernel}"):
            if name.startswith(STAGING_PREFIX):
                path = f"{CACHE_ROOT}/{kernel}/{name}"
                log.get().info("driver.build.leftover_removed", path=host.display(path))
                host.remove_tree(path)
                removed.append(path)
    return removed


def prune(host: Host, installed_kernels: set[str]) -> list[str]:
    """Remove the entries of kernels not in `installed_kernels`, and any leftover staging dirs.

    Returns the host paths removed. An empty set is refused: it would empty the whole cache,
    and is what a host without /proc or /lib/modules (a wrong --root) would give.
    """
    if not installed_kernels:
        raise DriverBuildError("prune", host.display(CACHE_ROOT), "no installed kernel is known",
                               hint="pass the running kernel at least (installed_kernels())")
    if not host.exists(CACHE_ROOT):
        return []
    removed: list[str] = []
    with locked(host):
        for kernel in host.list_dir(CACHE_ROOT):
            path = f"{CACHE_ROOT}/{kernel}"
            if kernel.startswith(".") or kernel in installed_kernels or not _is_dir(host, path):
                continue
            host.remove_tree(path)
            removed.append(path)
        removed += remove_leftovers(host)
    for path in removed:
        log.get().info("driver.cache.pruned", path=host.display(path))
    return removed


def _is_dir(host: Host, path: str) -> bool:
    st = host.lstat(path)
    return st is not None and stat.S_ISDIR(st.st_mode)
