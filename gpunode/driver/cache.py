"""The driver cache: one entry of a built NVIDIA driver per kernel, driver and flavour.

An entry is `<CACHE_ROOT>/<kernel>/<driver>-<flavour>/`:
- the built `*.ko` files, flat;
- the driver's user-space from the same installer (build.sh extracts it): `lib/` (the
  libraries of driver/userspace.py's list, `lib<name>.so.<driver>`, and their SONAME links as
  `ldconfig -n` makes them), `bin/` (nvidia-smi and the other binaries) and
  `firmware/nvidia/<driver>/gsp_*.bin` (the GSP firmware; the open modules ask the kernel for
  `nvidia/<driver>/gsp_<chip>.bin`, so `firmware/` is the firmware search path of the entry);
- `manifest.json`: what was built, from which verified inputs, and the sha256 of every module
  (`modules`) and user-space file (`userspace`, by path relative to the entry), and every
  SONAME link's target (`links`).

An entry is *usable* only when its manifest parses, names the same kernel, driver and flavour,
and every module and user-space file it lists is there, a regular file with the recorded
sha256, and every link points where it says: a half-copied or tampered entry is rebuilt,
never loaded.

Hashing a whole entry (hundreds of MB) on every boot and every `status` would cost more than
the rest of either, so an entry is verified *fully* (the sha256 of every file against the
manifest) only after its build, on demand (`gpunode driver verify`), and whenever the cheap
check cannot vouch for it. A full verification leaves a stamp in the entry (`STAMP`): when,
and the device, inode, size, mtime and ctime of the manifest it checked against and of each
file as it was when hashed. The cheap check compares those with each file's lstat
now: any difference — a file replaced (new inode), rewritten (size, mtime, and ctime, which no
one can set back), copied elsewhere (device, inode), a manifest changed, a stamp missing or
not understood — makes it a full verification, whose verdict counts. As git does for its
index, a file whose ctime is within `SETTLED_NS` of the stamp's time is never trusted from
the stamp (a second write in the same clock tick can leave its times as they were): it makes
a full verification too. Boot, which acts, writes a new stamp after a full verification
passed (`restamp`); `plan`, `status` and the other readers write nothing. The stamp is a
cache of a verdict, not a signature: whoever may rewrite the entry may rewrite it too (and the
manifest), which is why `gpunode driver verify` ignores it.

An entry of schema_version 1 (gpunode before builds carried the user-space) is unusable the
same way: its node would have modules but no libcuda, so it is rebuilt (or, with building
disabled, refused with that reason), never silently used.

A build (driver/build.py) stages its entry in a directory next to it
(`.staging-<driver>-<flavour>-<random>`) and publishes it by one rename (`publish`); staging
dirs left by a crash or a failed build are removed by the next build or prune under the same
lock (`remove_leftovers`). Builds serialise on an flock of `<CACHE_ROOT>/.lock` (`locked`).
Every file operation goes through the Host.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gpunode import log
from gpunode.errors import DriverBuildError, HostError
from gpunode.platform import kernelinfo, records, timestamps
from gpunode.platform.host import Host

CACHE_ROOT = "/opt/gpunode/drivers"
LOCK_FILE = f"{CACHE_ROOT}/.lock"
MANIFEST = "manifest.json"
STAMP = ".verified.json"  # in the entry: what its last full verification saw
STAMP_SCHEMA = 1
SETTLED_NS = 2_000_000_000  # a file changed this close to the stamp is hashed, never trusted
SCHEMA_VERSION = 2
MODULES_ONLY_SCHEMA = 1  # manifests of builds that had no user-space
REQUIRED_LIBRARIES = ("libcuda", "libnvidia-ml")  # driver/userspace.py's REQUIRED
STAGING_PREFIX = ".staging-"

# Flavour → the directory of the extracted installer whose modules it builds. GRID is the
# proprietary source tree of NVIDIA's GRID installer (a different driver_url).
FLAVOUR_SOURCES = {"open": "kernel-open", "proprietary": "kernel", "grid": "kernel"}
MODULE_DIRS = ("/lib/modules", "/usr/lib/modules")

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._+-]*"  # a kernel release or driver version
# No file of a driver comes near this (libcuda, libnvidia-nvvm and gsp_ga10x.bin are ~100 MB);
# a larger one is refused before it is hashed.
MAX_FILE_BYTES = 1 << 30


@dataclass(frozen=True)
class CacheEntry:
    """A driver cache entry found usable for the kernel, driver and flavour asked: safe to load."""

    path: str  # host path of the entry directory
    manifest: dict[str, Any]
    modules: tuple[str, ...]  # host paths of the .ko files, sorted by name
    # how it was found usable: "stamp" (the cheap check) or "full" (every file hashed), and
    # the stat of each file as verified (entry-relative path → _key), for a new stamp
    verified: str = "full"
    seen: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def userspace(self, directory: str) -> tuple[str, ...]:
        """Host paths of the user-space files the manifest lists under `directory` ("lib",
        "bin", "firmware/nvidia/<driver>"), sorted: only those, never what else is there."""
        prefix = directory.rstrip("/") + "/"
        return tuple(f"{self.path}/{rel}" for rel in sorted(self.manifest.get("userspace", {}))
                     if rel.startswith(prefix) and "/" not in rel[len(prefix):])

    @property
    def firmware_dir(self) -> str:
        """The entry's firmware search path: it holds nvidia/<driver>/gsp_*.bin."""
        return f"{self.path}/firmware"


# -- names and manifests (pure) ------------------------------------------------------------------


def is_name(value: str) -> bool:
    """One path component that cannot climb out of its directory: letters, digits, '.', '_',
    '+' and '-', starting with a letter or digit (a kernel release, a driver version, a file
    of a cache entry)."""
    return re.fullmatch(NAME_PATTERN, value) is not None


def entry_path(kernel: str, driver: str, flavour: str) -> str:
    """The host path of the cache entry; names that could climb out of the cache are refused."""
    for what, value in (("kernel", kernel), ("driver version", driver)):
        if not is_name(value):
            raise DriverBuildError("use", value, f"not a {what}: letters, digits, '.', '_', '+' "
                                   "or '-' only, starting with a letter or digit")
    if flavour not in FLAVOUR_SOURCES:
        raise DriverBuildError("use", flavour, "not a driver flavour",
                               hint=f"use one of {', '.join(FLAVOUR_SOURCES)}")
    return f"{CACHE_ROOT}/{kernel}/{driver}-{flavour}"


def is_module_name(name: str) -> bool:
    return is_name(name) and name.endswith(".ko")


def userspace_path_problem(rel: str, driver: str) -> str | None:
    """Why `rel` is not a user-space path an entry may hold: lib/<name>, bin/<name> or
    firmware/nvidia/<driver>/<name>, each name a plain file name."""
    parts = rel.split("/")
    if (len(parts) == 2 and parts[0] in ("lib", "bin")) or \
            (len(parts) == 4 and parts[:3] == ["firmware", "nvidia", driver]):
        return None if is_name(parts[-1]) else f"{parts[-1]!r} is not a file name"
    return f"not under lib/, bin/ or firmware/nvidia/{driver}/"


def make_manifest(kernel: str, driver: str, flavour: str, flatcar_version: str | None,
                  modules: Mapping[str, str], inputs: Mapping[str, dict[str, Any]],
                  built_at: datetime, seconds: float, userspace: Mapping[str, str],
                  links: Mapping[str, str]) -> dict[str, Any]:
    """The manifest of a finished build: modules (name → sha256), user-space files (path in
    the entry → sha256), SONAME links (path → target) and its inputs (role → url, digest,
    whether it was verified)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "kernel": kernel,
        "driver": driver,
        "flavour": flavour,
        "flatcar_version": flatcar_version,
        "modules": dict(sorted(modules.items())),
        "userspace": dict(sorted(userspace.items())),
        "links": dict(sorted(links.items())),
        "inputs": dict(inputs),
        "built_at": timestamps.utc_timestamp(built_at.timestamp()),
        "build_seconds": round(seconds, 3),
    }


def manifest_problem(manifest: Any, kernel: str, driver: str, flavour: str) -> str | None:
    """Why a parsed manifest does not describe this entry; None when its shape is right."""
    if isinstance(manifest, dict) and manifest.get("schema_version") == MODULES_ONLY_SCHEMA:
        return ("it was built by an older gpunode with the modules only, without the driver's "
                "user-space (libcuda, nvidia-smi, GSP firmware)")
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
    return _userspace_shape_problem(manifest.get("userspace"), manifest.get("links"), driver)


def _userspace_shape_problem(files: Any, links: Any, driver: str) -> str | None:
    if not isinstance(files, dict) or not isinstance(links, dict):
        return "it lists no user-space"
    for rel, digest in files.items():
        problem = userspace_path_problem(rel, driver)
        if problem is None and not (isinstance(digest, str)
                                    and re.fullmatch(r"[0-9a-f]{64}", digest)):
            problem = "its sha256 is malformed"
        if problem:
            return f"user-space entry {rel!r} is malformed: {problem}"
    for name in REQUIRED_LIBRARIES:
        if f"lib/{name}.so.{driver}" not in files:
            return f"it lists no lib/{name}.so.{driver}"
    for rel, target in links.items():
        if not (rel.startswith("lib/") and userspace_path_problem(rel, driver) is None
                and isinstance(target, str) and f"lib/{target}" in files):
            return f"link entry {rel!r} is malformed (a lib/ link to a listed library)"
    return None


# -- lookup --------------------------------------------------------------------------------------


def find_usable(host: Host, kernel: str, driver: str, flavour: str) -> CacheEntry | None:
    """The entry for these names if it is complete and every file has its recorded sha256
    (check_entry: cheap while its stamp vouches for it)."""
    entry, problem = check_entry(host, entry_path(kernel, driver, flavour), kernel, driver,
                                 flavour)
    if problem is not None:
        log.get().warning("driver.cache.unusable",
                          entry=host.display(entry_path(kernel, driver, flavour)), reason=problem)
    return entry


def check_entry(host: Host, path: str, kernel: str, driver: str, flavour: str,
                full: bool = False) -> tuple[CacheEntry | None, str | None]:
    """(the entry, None) when usable; (None, why not) when it is there but unusable;
    (None, None) when there is none. Cheap when the entry's stamp vouches for every file;
    else (and always with `full`) every file is hashed."""
    text = host.read_optional(f"{path}/{MANIFEST}")
    if text is None:
        return None, ("it has no manifest.json" if host.lstat(path) is not None else None)
    try:
        manifest = records.loads_json(text, "manifest.json")
    except ValueError as exc:  # not JSON, or nested too deeply to read
        return None, str(exc)
    problem = manifest_problem(manifest, kernel, driver, flavour)
    if problem is not None:
        return None, problem
    files = {**manifest["modules"], **manifest["userspace"]}
    seen = {} if full else _stamped(host, path, files)
    verified = "stamp" if seen else "full"
    if not seen:
        seen, problem = _files_problem(host, path, files)
    problem = problem or _links_problem(host, path, manifest["links"])
    if problem is not None:
        return None, problem
    names = sorted(manifest["modules"])
    return CacheEntry(path, manifest, tuple(f"{path}/{name}" for name in names), verified,
                      tuple(sorted(seen.items()))), None


def verify(host: Host, path: str, kernel: str, driver: str,
           flavour: str) -> tuple[CacheEntry | None, str | None]:
    """The full verification (check_entry with every file hashed, whatever the stamp says),
    then the stamp: written when it passed, removed when it did not, so that the next cheap
    check cannot vouch for an entry found bad."""
    entry, problem = check_entry(host, path, kernel, driver, flavour, full=True)
    if entry is not None:
        restamp(host, entry)
    elif host.lstat(f"{path}/{STAMP}") is not None:
        host.remove(f"{path}/{STAMP}")
    return entry, problem


def restamp(host: Host, entry: CacheEntry) -> bool:
    """Write the stamp of an entry found usable by a full verification, so that the next
    checks are cheap; nothing when the stamp vouched for it already, or when a file changed
    since it was hashed (the next check hashes it again). True when written."""
    if entry.verified != "full":
        return False
    import json

    seen = dict(entry.seen)
    manifest = _key(host.lstat(f"{entry.path}/{MANIFEST}"))
    if manifest is None or any(_key(host.lstat(f"{entry.path}/{rel}")) != key
                               for rel, key in seen.items()):
        return False
    stamp = {"schema_version": STAMP_SCHEMA, "manifest": list(manifest),
             "stamped_ns": time.time_ns(), "files": {rel: list(k) for rel, k in seen.items()}}
    host.write_atomic(f"{entry.path}/{STAMP}", (json.dumps(stamp, indent=1) + "\n").encode())
    log.get().info("driver.cache.stamped", entry=host.display(entry.path), files=len(seen))
    return True


def refresh(host: Host, path: str, kernel: str, driver: str) -> None:
    """Boot, having loaded the modules of the entry `path`: a new stamp when its check had to
    hash it (changed since its stamp, or never stamped), so that the next boot's is cheap. A
    read-only cache keeps every boot's check full, and says so."""
    entry, _ = check_entry(host, path, kernel, driver, path.rpartition("-")[2])
    try:
        if entry is not None:
            restamp(host, entry)
    except HostError as exc:
        log.get().warning("driver.cache.unstamped", entry=host.display(path), error=str(exc))


def _stamped(host: Host, path: str, files: Mapping[str, str]) -> dict[str, tuple[int, ...]]:
    """{file: its stat key} when the stamp vouches for the manifest and every file it lists
    (each one's lstat as stamped, and settled before the stamp); {} otherwise."""
    try:
        raw = host.read_optional(f"{path}/{STAMP}", limit=1 << 20)
        stamp = records.loads_json(raw, STAMP) if raw is not None else None
    except (ValueError, HostError):
        return {}  # unreadable or not JSON: the full check decides
    if not (isinstance(stamp, dict) and stamp.get("schema_version") == STAMP_SCHEMA
            and isinstance(stamp.get("stamped_ns"), int) and isinstance(stamp.get("manifest"), list)
            and isinstance(stamp.get("files"), dict) and set(stamp["files"]) == set(files)):
        return {}
    seen: dict[str, tuple[int, ...]] = {}
    for rel in (MANIFEST, *files):
        try:
            key = _key(host.lstat(f"{path}/{rel}"))
        except HostError:
            return {}
        recorded = stamp["manifest"] if rel == MANIFEST else stamp["files"][rel]
        if key is None or list(key) != recorded or key[4] >= stamp["stamped_ns"] - SETTLED_NS:
            return {}
        seen[rel] = key
    del seen[MANIFEST]
    return seen


def _key(st: os.stat_result | None) -> tuple[int, ...] | None:
    """What the stamp records of a regular file: device, inode, size, mtime, ctime (ns)."""
    if st is None or not stat.S_ISREG(st.st_mode):
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _files_problem(host: Host, path: str,
                   files: Mapping[str, str]) -> tuple[dict[str, tuple[int, ...]], str | None]:
    """Each listed module and user-space file hashed: ({file: its stat key as hashed}, None),
    or why one is not as recorded: missing, not a regular file (a link, a FIFO: never
    followed, never opened), too large, or another sha256."""
    seen: dict[str, tuple[int, ...]] = {}
    for name, recorded in sorted(files.items()):
        file = f"{path}/{name}"
        try:
            st = host.lstat(file)
            if st is None:
                return seen, f"{name} is missing"
            if not stat.S_ISREG(st.st_mode):
                return seen, f"{name} is not a regular file"
            if st.st_size > MAX_FILE_BYTES:
                return seen, f"{name} is {st.st_size} bytes, more than any driver file"
            actual = digest(host, file, st)
        except HostError as exc:
            return seen, f"{name} cannot be read ({exc})"
        if actual != recorded:
            return seen, f"{name} has sha256 {actual}, the manifest says {recorded}"
        key = _key(st)
        assert key is not None  # a regular file, as checked above
        seen[name] = key
    return seen, None


def _links_problem(host: Host, path: str, links: Mapping[str, str]) -> str | None:
    for name, target in sorted(links.items()):
        try:
            actual = host.read_link(f"{path}/{name}")
        except HostError as exc:
            return f"{name} cannot be read ({exc})"
        if actual != target:
            return (f"{name} is missing" if actual is None
                    else f"{name} points to {actual!r}, the manifest says {target!r}")
    return None


def digest(host: Host, path: str, st: Any = None) -> str:
    """The sha256 of a cache file, hashed once per process while the file is unchanged (same
    inode, size, mtime and ctime): a boot checks an entry in its plan, again when it finds
    the user-space and when it writes the CDI spec, and hashes its hundreds of MB once.
    A file changed in the last seconds is always hashed (as git treats "racily clean" files):
    a second write within the clock's granularity can leave its times as they were."""
    st = st if st is not None else host.lstat(path)
    if st is None or time.time_ns() - st.st_ctime_ns < SETTLED_NS:
        return host.digest(path, "sha256")
    key = (host.display(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
           st.st_ctime_ns)
    if key not in _DIGESTS:
        _DIGESTS[key] = host.digest(path, "sha256")
    return _DIGESTS[key]


_DIGESTS: dict[tuple[Any, ...], str] = {}


def installed_kernels(host: Host) -> set[str]:
    """Kernel releases with a module tree, plus the running kernel."""
    kernels = {name for directory in MODULE_DIRS for name in host.list_dir(directory)
               if is_name(name)}
    running = (host.read_optional(kernelinfo.RELEASE) or "").strip()
    if running:
        kernels.add(running)
    return kernels


def entries(host: Host) -> list[tuple[str, str, str, str]]:
    """(host path, kernel, driver, flavour) of every entry directory in the cache, sorted;
    staging dirs and other dot-names are not entries."""
    found = []
    for kernel in sorted(host.list_dir(CACHE_ROOT)):
        if kernel.startswith(".") or not _is_dir(host, f"{CACHE_ROOT}/{kernel}"):
            continue
        for name in sorted(host.list_dir(f"{CACHE_ROOT}/{kernel}")):
            driver, _, flavour = name.rpartition("-")
            if not name.startswith(".") and _is_dir(host, f"{CACHE_ROOT}/{kernel}/{name}"):
                found.append((f"{CACHE_ROOT}/{kernel}/{name}", kernel, driver, flavour))
    return found


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
