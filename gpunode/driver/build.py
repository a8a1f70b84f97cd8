"""Build the NVIDIA kernel modules once per kernel, driver and flavour, and cache the result.

A cache entry is `<CACHE_ROOT>/<kernel>/<driver>-<flavour>/`: the built `*.ko` files, flat, and
`manifest.json` (what was built, from which verified inputs, their digests). An entry is
*usable* only when its manifest parses, names the same kernel, driver and flavour, and every
module it lists is there with the recorded sha256: a half-copied or tampered entry is rebuilt,
never loaded.

A build runs in a staging directory next to the entry (`.staging-<driver>-<flavour>-<random>`),
writes the manifest last and becomes visible by one rename, so a crash at any point leaves no
usable-looking entry. A refused download leaves nothing; a failed build leaves its build.log
(its inputs are deleted at once); a crash leaves its staging dir. The next build (or prune)
removes those under the same lock: one cleanup path, exercised by every failure. Builds
serialise on an flock of `<CACHE_ROOT>/.lock`; the one that waited finds the other's entry.

`plan_build()` is pure (names checked, URLs rendered, checksums required); `build()` acts.
The real downloads (`UrlFetcher`) and the real compiler (`NspawnBuilder`, the Flatcar developer
container under systemd-nspawn) cannot run in this project's test environment: no network to
Flatcar's or NVIDIA's servers, no Flatcar image, no GPU. Tests use file:// URLs and a fake
builder; NspawnBuilder's argv and build.sh are pinned by tests, not run.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from gpunode import command, envfile, log, records
from gpunode.errors import DriverBuildError, GpunodeError, HostError
from gpunode.host import Host

if TYPE_CHECKING:
    from gpunode.config import BuildConfig

CACHE_ROOT = "/opt/gpunode/drivers"
LOCK_FILE = f"{CACHE_ROOT}/.lock"
MANIFEST = "manifest.json"
SCHEMA_VERSION = 1
STAGING_PREFIX = ".staging-"
WORK_DIR = ".work"  # inside the staging dir: downloads, build.sh, build.log; gone on success
INSTALLER_NAME = "nvidia-installer.run"
DEV_CONTAINER_NAME = "flatcar_developer_container.bin"
BUILD_SCRIPT = "build.sh"
BUILD_LOG = "build.log"

# Flavour → the directory of the extracted installer whose modules it builds. GRID is the
# proprietary source tree of NVIDIA's GRID installer (a different driver_url).
FLAVOUR_SOURCES = {"open": "kernel-open", "proprietary": "kernel", "grid": "kernel"}
DIGEST_LENGTHS = {"sha256": 64, "sha512": 128}
URL_SCHEMES = ("http", "https", "file")

RELEASE_FILE = "/usr/share/flatcar/release"
OS_RELEASE = "/etc/os-release"
UPDATE_CONFS = ("/etc/flatcar/update.conf", "/usr/share/flatcar/update.conf")
DEFAULT_BOARD = "amd64-usr"
DEFAULT_GROUP = "stable"
MODULE_DIRS = ("/lib/modules", "/usr/lib/modules")
RUNNING_KERNEL = "/proc/sys/kernel/osrelease"

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")  # a kernel release or driver version
_PLACEHOLDER_RE = re.compile(r"\{([A-Za-z_]+)\}")
_CHUNK = 1 << 20


# -- records -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildInputs:
    kernel: str  # the kernel release to build for ("6.6.95-flatcar")
    driver: str  # the NVIDIA driver version ("570.195.03")
    flavour: str  # "open", "proprietary" or "grid"
    dev_container_url: str  # template; see render_url
    dev_container_sha512: str | None  # of the file as downloaded (the .bz2 for Flatcar's)
    driver_url: str  # template
    driver_sha256: str | None
    allow_unverified: bool = False  # a missing checksum is a warning instead of a refusal


@dataclass(frozen=True)
class FlatcarFacts:
    """What URL templates may name about the host: {version}, {board}, {group}."""

    version: str | None  # None off Flatcar
    board: str = DEFAULT_BOARD
    group: str = DEFAULT_GROUP


@dataclass(frozen=True)
class Download:
    role: str  # "dev_container" or "driver": the key in the manifest's "inputs"
    url: str  # rendered
    algorithm: str  # "sha512" or "sha256"
    expected: str | None  # lowercase hex; None only when unverified downloads are allowed
    filename: str  # its name in the work directory


@dataclass(frozen=True)
class BuildPlan:
    kernel: str
    driver: str
    flavour: str
    entry: str  # host path of the cache entry
    dev_container: Download
    installer: Download

    def describe(self) -> list[str]:
        lines = [f"build NVIDIA {self.driver} ({self.flavour}) modules for kernel {self.kernel} "
                 f"into {self.entry}"]
        for d in (self.dev_container, self.installer):
            check = f"{d.algorithm} {d.expected}" if d.expected else "UNVERIFIED"
            lines.append(f"download {d.url} ({check})")
        return lines


@dataclass(frozen=True)
class CacheEntry:
    path: str  # host path of the entry directory
    manifest: dict[str, Any]
    modules: tuple[str, ...]  # host paths of the .ko files, sorted by name


@dataclass(frozen=True)
class BuildResult:
    entry: CacheEntry
    cache_hit: bool
    seconds: float


# -- pure: names, facts, URLs, plan, manifest ----------------------------------------------------


def entry_path(kernel: str, driver: str, flavour: str) -> str:
    """The host path of the cache entry; names that could climb out of the cache are refused."""
    for what, value in (("kernel", kernel), ("driver version", driver)):
        if not _NAME_RE.fullmatch(value):
            raise DriverBuildError("use", value, f"not a {what}: letters, digits, '.', '_', '+' "
                                   "or '-' only, starting with a letter or digit")
    if flavour not in FLAVOUR_SOURCES:
        raise DriverBuildError("use", flavour, "not a driver flavour",
                               hint=f"use one of {', '.join(FLAVOUR_SOURCES)}")
    return f"{CACHE_ROOT}/{kernel}/{driver}-{flavour}"


def facts_from(release: str | None, os_release: str | None,
               update_confs: Sequence[str | None]) -> FlatcarFacts:
    """Flatcar's release file first, then os-release; the first update.conf naming GROUP."""
    rel = envfile.values(release or "")
    osr = envfile.values(os_release or "")
    version = rel.get("FLATCAR_RELEASE_VERSION") or osr.get("VERSION") or None
    board = rel.get("FLATCAR_RELEASE_BOARD") or osr.get("FLATCAR_BOARD") or DEFAULT_BOARD
    groups = (envfile.values(text or "").get("GROUP") for text in update_confs)
    group = next((g for g in groups if g), DEFAULT_GROUP)
    return FlatcarFacts(version=version, board=board, group=group)


def host_facts(host: Host) -> FlatcarFacts:
    """The node's Flatcar version, board and update group (defaults off Flatcar)."""
    return facts_from(host.read_optional(RELEASE_FILE), host.read_optional(OS_RELEASE),
                      [host.read_optional(path) for path in UPDATE_CONFS])


def render_url(template: str, facts: FlatcarFacts, kernel: str, driver: str) -> str:
    """Fill {version}, {board}, {group}, {kernel} and {driver}; anything else is refused."""
    values = {"version": facts.version, "board": facts.board, "group": facts.group,
              "kernel": kernel, "driver": driver}
    return _fill(template, values, "render URL",
                 hint="run on Flatcar, or give the URL without {version}")


def _fill(template: str, values: Mapping[str, str | None], verb: str, hint: str) -> str:
    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in values:
            raise DriverBuildError(verb, template, f"unknown placeholder {{{name}}}",
                                   hint=f"placeholders are {', '.join(sorted(values))}")
        filled = values[name]
        if filled is None:
            raise DriverBuildError(verb, template, f"{{{name}}} is unknown on this host",
                                   hint=hint)
        return filled

    return _PLACEHOLDER_RE.sub(value, template)


def plan_build(inputs: BuildInputs, facts: FlatcarFacts) -> BuildPlan:
    """What a build would download and where it would put the modules; nothing touched."""
    entry = entry_path(inputs.kernel, inputs.driver, inputs.flavour)
    dev_url = render_url(inputs.dev_container_url, facts, inputs.kernel, inputs.driver)
    driver_url = render_url(inputs.driver_url, facts, inputs.kernel, inputs.driver)
    dev_name = DEV_CONTAINER_NAME + (".bz2" if _url_path(dev_url).endswith(".bz2") else "")
    return BuildPlan(
        kernel=inputs.kernel, driver=inputs.driver, flavour=inputs.flavour, entry=entry,
        dev_container=_download("dev_container", dev_url, "sha512", inputs.dev_container_sha512,
                                dev_name, inputs.allow_unverified),
        installer=_download("driver", driver_url, "sha256", inputs.driver_sha256,
                            INSTALLER_NAME, inputs.allow_unverified))


def _download(role: str, url: str, algorithm: str, expected: str | None, filename: str,
              allow_unverified: bool) -> Download:
    if not (url.startswith("/") or urllib.parse.urlsplit(url).scheme in URL_SCHEMES):
        raise DriverBuildError("download", url, "not an http(s):// or file:// URL, nor an "
                               "absolute path")
    if expected is None and not allow_unverified:
        raise DriverBuildError("download", url, f"no {algorithm} checksum is configured",
                               hint=f"set driver.build.{role}_{algorithm} (or, at your own "
                               "risk, driver.build.allow_unverified = true)")
    if expected is not None:
        expected = expected.strip().lower()
        if not re.fullmatch(f"[0-9a-f]{{{DIGEST_LENGTHS[algorithm]}}}", expected):
            raise DriverBuildError("verify", url, f"the configured {algorithm} '{expected}' is "
                                   f"not {DIGEST_LENGTHS[algorithm]} hex digits")
    return Download(role, url, algorithm, expected, filename)


def _url_path(url: str) -> str:
    return url if url.startswith("/") else urllib.parse.urlsplit(url).path


def make_manifest(plan: BuildPlan, facts: FlatcarFacts, modules: Mapping[str, str],
                  digests: Mapping[str, str], built_at: datetime, seconds: float) -> dict[str, Any]:
    """The manifest of a finished build. `digests`: role → digest of what was downloaded."""
    return {
        "schema_version": SCHEMA_VERSION,
        "kernel": plan.kernel,
        "driver": plan.driver,
        "flavour": plan.flavour,
        "flatcar_version": facts.version,
        "modules": dict(sorted(modules.items())),
        "inputs": {d.role: {"url": d.url, d.algorithm: digests[d.role],
                            "verified": d.expected is not None}
                   for d in (plan.dev_container, plan.installer)},
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
        if not _is_module_name(name) or not isinstance(digest, str):
            return f"module entry {name!r} is malformed"
    return None


def _is_module_name(name: str) -> bool:
    return bool(_NAME_RE.fullmatch(name)) and name.endswith(".ko")


# -- the cache: lookup, lock, prune --------------------------------------------------------------


def find_usable(host: Host, kernel: str, driver: str, flavour: str) -> CacheEntry | None:
    """The entry for these names if it is complete and every module has its recorded sha256.

    Hashes every module (tens of MB: a fraction of a second), so call it once per boot.
    """
    entry, problem = _check_entry(host, entry_path(kernel, driver, flavour), kernel, driver,
                                  flavour)
    if problem is not None:
        log.get().warning("driver.cache.unusable",
                          entry=host.display(entry_path(kernel, driver, flavour)), reason=problem)
    return entry


def _check_entry(host: Host, path: str, kernel: str, driver: str,
                 flavour: str) -> tuple[CacheEntry | None, str | None]:
    """(the entry, None) when usable; (None, why not) when it is there but unusable;
    (None, None) when there is none."""
    text = host.read_optional(f"{path}/{MANIFEST}")
    if text is None:
        return None, ("it has no manifest.json" if _lstat(host, path) is not None else None)
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
        actual = _file_digest(host, module, "sha256")
        if actual != recorded:
            return f"{name} has sha256 {actual}, the manifest says {recorded}"
    return None


def installed_kernels(host: Host) -> set[str]:
    """Kernel releases with a module tree, plus the running kernel."""
    kernels = {name for directory in MODULE_DIRS for name in host.list_dir(directory)
               if _NAME_RE.fullmatch(name)}
    running = (host.read_optional(RUNNING_KERNEL) or "").strip()
    if running:
        kernels.add(running)
    return kernels


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
    with _cache_lock(host):
        for kernel in host.list_dir(CACHE_ROOT):
            path = f"{CACHE_ROOT}/{kernel}"
            if kernel.startswith(".") or kernel in installed_kernels or not _is_dir(host, path):
                continue
            _remove_tree(host, path)
            removed.append(path)
        removed += _remove_leftovers(host)
    for path in removed:
        log.get().info("driver.cache.pruned", path=host.display(path))
    return removed


@contextlib.contextmanager
def _cache_lock(host: Host) -> Iterator[None]:
    """An exclusive flock of the cache, held for the whole build (released when fd closes).

    flock locks belong to the open file description, so two threads of one process that each
    open the file exclude each other just as two processes do.
    """
    host.make_dirs(CACHE_ROOT)
    shown = host.display(LOCK_FILE)
    try:
        fd = os.open(host.path(LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise HostError("open", shown, exc.strerror or str(exc)) from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.get().info("driver.build.waiting", lock=shown,
                           reason="another driver build holds the cache")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


# -- the build -----------------------------------------------------------------------------------


class Fetcher(Protocol):
    def fetch(self, url: str, dest_path: Path) -> None:
        """Put the content of `url` at `dest_path` (a real path), whole or not at all."""
        ...


class Builder(Protocol):
    def build(self, workdir: Path, dev_container: Path, driver_installer: Path, kernel: str,
              flavour: str, out_dir: Path) -> None:
        """Compile the modules; leave the `*.ko` files, flat, in `out_dir` (real paths)."""
        ...


def build(host: Host, inputs: BuildInputs, fetcher: Fetcher, builder: Builder,
          facts: FlatcarFacts) -> BuildResult:
    """The usable cache entry for `inputs`, built now unless it (or a concurrent build) has it."""
    started = time.monotonic()
    plan = plan_build(inputs, facts)
    # First without the lock: taking it needs a writable cache, a cache hit only a readable one.
    entry, _ = _check_entry(host, plan.entry, plan.kernel, plan.driver, plan.flavour)
    if entry is None:
        with _cache_lock(host):
            entry = find_usable(host, plan.kernel, plan.driver, plan.flavour)  # built meanwhile?
            if entry is None:
                _remove_leftovers(host)
                entry = _build_entry(host, plan, fetcher, builder, facts)
                return BuildResult(entry, False, time.monotonic() - started)
    log.get().info("driver.build.cache_hit", entry=host.display(entry.path))
    return BuildResult(entry, True, time.monotonic() - started)


def _build_entry(host: Host, plan: BuildPlan, fetcher: Fetcher, builder: Builder,
                 facts: FlatcarFacts) -> CacheEntry:
    started = time.monotonic()
    kernel_dir = plan.entry.rsplit("/", 1)[0]
    staging = f"{kernel_dir}/{STAGING_PREFIX}{plan.driver}-{plan.flavour}-{os.urandom(4).hex()}"
    work = f"{staging}/{WORK_DIR}"
    log.get().info("driver.build.start", kernel=plan.kernel, driver=plan.driver,
                   flavour=plan.flavour, staging=host.display(staging))
    host.make_dirs(work)
    try:
        # The installer first: a wrong driver checksum fails before gigabytes are fetched.
        installer, installer_digest = _fetch_verified(host, fetcher, plan.installer, work)
        image, image_digest = _fetch_verified(host, fetcher, plan.dev_container, work)
        image = _unpack(host, image)
    except BaseException:
        _remove_tree(host, staging)  # refused or failed downloads: nothing worth keeping
        raise
    _run_builder(host, builder, plan, work, image, installer, staging)
    modules = _collect_modules(host, plan, staging)
    _remove_tree(host, work)
    digests = {"dev_container": image_digest, "driver": installer_digest}
    manifest = make_manifest(plan, facts, modules, digests, datetime.now(UTC),
                             time.monotonic() - started)
    _fsync_files(host, staging, modules)
    host.write_atomic(f"{staging}/{MANIFEST}",
                      (json.dumps(manifest, indent=2) + "\n").encode())  # last: marks it whole
    _publish(host, staging, plan.entry)
    log.get().info("driver.build.done", entry=host.display(plan.entry),
                   modules=sorted(modules), build_seconds=manifest["build_seconds"])
    return CacheEntry(plan.entry, manifest, tuple(f"{plan.entry}/{n}" for n in sorted(modules)))


def _fetch_verified(host: Host, fetcher: Fetcher, download: Download,
                    work: str) -> tuple[Path, str]:
    """Download into the work dir and check its digest; a mismatch deletes the file."""
    path = f"{work}/{download.filename}"
    dest = host.path(path)
    log.get().info("driver.build.download", input=download.role, url=download.url)
    try:
        fetcher.fetch(download.url, dest)
    except OSError as exc:  # a Fetcher other than UrlFetcher, failing plainly
        raise DriverBuildError("download", download.url, exc.strerror or str(exc)) from exc
    actual = _file_digest(host, path, download.algorithm)
    if download.expected is None:
        log.get().warning("driver.build.unverified", input=download.role, url=download.url,
                          **{download.algorithm: actual})
    elif actual != download.expected:
        host.remove(path)
        raise DriverBuildError("verify", download.url, f"{download.algorithm} is {actual}, "
                               f"expected {download.expected}",
                               hint="the download is corrupt or the file changed upstream: "
                               "check the URL and the configured checksum")
    return dest, actual


def _unpack(host: Host, path: Path) -> Path:
    """Flatcar publishes the developer container bzip2-compressed; nspawn needs the raw image.

    Python's bz2 (single-threaded) instead of lbzip2: no program to depend on, at the cost of
    a minute or so for the image.
    """
    if path.suffix != ".bz2":
        return path
    import bz2  # only a build needs it

    target = path.with_suffix("")
    try:
        with bz2.open(path, "rb") as source, open(target, "wb") as out:
            shutil.copyfileobj(source, out, _CHUNK)
        path.unlink()
    except (OSError, EOFError) as exc:
        raise DriverBuildError("unpack", str(path), str(exc),
                               hint="the download is truncated or not bzip2") from exc
    return target


def _run_builder(host: Host, builder: Builder, plan: BuildPlan, work: str, image: Path,
                 installer: Path, staging: str) -> None:
    """A failed build keeps its build.log in the staging dir until the next build or prune
    removes it; the gigabytes of inputs and intermediate files go at once."""
    try:
        builder.build(host.path(work), image, installer, plan.kernel, plan.flavour,
                      host.path(staging))
    except (GpunodeError, OSError) as exc:
        for name in host.list_dir(work):
            if name != BUILD_LOG:
                _remove_any(host, f"{work}/{name}")
        raise DriverBuildError(
            "build", f"NVIDIA {plan.driver} ({plan.flavour}) for kernel {plan.kernel}", str(exc),
            hint=f"its log stays in {host.display(work)}/{BUILD_LOG} (if the builder wrote one) "
            "until the next 'gpunode driver build' or prune removes it") from exc


def _collect_modules(host: Host, plan: BuildPlan, out: str) -> dict[str, str]:
    """name → sha256 of every .ko the builder left; refused without nvidia.ko."""
    modules = {name: _file_digest(host, f"{out}/{name}", "sha256")
               for name in host.list_dir(out)
               if _is_module_name(name) and _is_regular(host, f"{out}/{name}")}
    if "nvidia.ko" not in modules:
        found = ", ".join(sorted(modules)) or "no .ko files"
        raise DriverBuildError("build", f"NVIDIA {plan.driver} ({plan.flavour}) for kernel "
                               f"{plan.kernel}", f"the builder left no nvidia.ko ({found})",
                               hint=f"see {host.display(out)}/{WORK_DIR}/{BUILD_LOG}")
    return modules


def _publish(host: Host, staging: str, final: str) -> None:
    """Make the staged entry visible in one rename. An unusable entry already there (the
    caller checked under the lock) is first renamed aside as a staging dir, then removed."""
    if _lstat(host, final) is not None:
        aside = f"{staging}-replaced"
        _rename(host, final, aside)
        _remove_tree(host, aside)
    _rename(host, staging, final)


def _remove_leftovers(host: Host) -> list[str]:
    """Staging dirs of builds that crashed or failed; call only under the cache lock."""
    removed = []
    for kernel in host.list_dir(CACHE_ROOT):
        if kernel.startswith("."):
            continue
        for name in host.list_dir(f"{CACHE_ROOT}/{kernel}"):
            if name.startswith(STAGING_PREFIX):
                path = f"{CACHE_ROOT}/{kernel}/{name}"
                log.get().info("driver.build.leftover_removed", path=host.display(path))
                _remove_tree(host, path)
                removed.append(path)
    return removed


# -- the real adapters (they cannot run in this project's tests) ---------------------------------


@dataclass(frozen=True)
class UrlFetcher:
    """Downloads with urllib: http(s) URLs, file:// URLs and absolute paths (a local mirror).

    file:// URLs and paths are *host* paths, read under `host`'s root like every other path.
    The content streams into a temporary file next to `dest_path`, renamed into place when
    complete. `timeout` bounds each network read; `deadline` the whole download.
    """

    host: Host = field(default_factory=Host)
    timeout: float = 60.0
    deadline: float = 1800.0

    def fetch(self, url: str, dest_path: Path) -> None:
        import http.client  # urllib's network side costs ~50 ms to import: only when fetching

        fd, temp = tempfile.mkstemp(prefix=f".{dest_path.name}.", suffix=".part",
                                    dir=dest_path.parent)
        try:
            with os.fdopen(fd, "wb") as out, self._open(url) as source:
                self._copy(source, out)
                out.flush()
                os.fsync(out.fileno())
            os.rename(temp, dest_path)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            _unlink_quietly(temp)
            raise DriverBuildError("download", url, _reason(exc),
                                   hint="check the node's network (or the mirror) and the "
                                   "URL in driver.build") from exc
        except BaseException:
            _unlink_quietly(temp)
            raise

    def _open(self, url: str) -> BinaryIO:
        local = _local_path(url)
        if local is not None:
            return open(self.host.path(local), "rb")
        import urllib.request

        request = urllib.request.Request(url, headers={"User-Agent": "gpunode"})
        return urllib.request.urlopen(request, timeout=self.timeout)

    def _copy(self, source: BinaryIO, out: BinaryIO) -> None:
        ends = time.monotonic() + self.deadline
        while chunk := source.read(_CHUNK):
            out.write(chunk)
            if time.monotonic() > ends:
                raise TimeoutError(f"not complete after {self.deadline:.0f} s")


def _local_path(url: str) -> str | None:
    """The host path a file:// URL or a plain path names; None for a network URL."""
    if url.startswith("/"):
        return url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "file":
        return None
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"file:// URL names another host ({parts.netloc})")
    return urllib.parse.unquote(parts.path)


DEFAULT_NSPAWN_COMMAND: tuple[str, ...] = (
    "systemd-nspawn", "--quiet", "--image={dev_container}", "--bind={workdir}:/work",
    "--bind={out_dir}:/out", "/bin/bash", f"/work/{BUILD_SCRIPT}", "{kernel}", "{flavour}",
)

# Written into the work dir and run inside the developer container (see NspawnBuilder).
BUILD_SH = f"""\
#!/bin/bash
# build.sh KERNEL FLAVOUR: written by gpunode (gpunode/driver/build.py) and run inside the
# Flatcar developer container, which has the kernel build tree of its Flatcar release.
#   /work  this script, the NVIDIA installer ({INSTALLER_NAME}) and build.log
#   /out   where the built *.ko files go, flat (the cache entry being staged)
# The installer is only unpacked (--extract-only: nothing is installed); the modules of
# kernel/ (proprietary, grid) or kernel-open/ (open) are built with the kernel's kbuild and
# copied to /out. Everything goes to /work/build.log; on failure its tail goes to stderr too.
set -euo pipefail
kernel="$1"
flavour="$2"
exec 3>&2 >/work/build.log 2>&1
trap 'rc=$?; if [ "$rc" -ne 0 ]; then tail -n 20 /work/build.log >&3; fi' EXIT

case "$flavour" in
  open) tree=kernel-open ;;
  proprietary|grid) tree=kernel ;;
  *) echo "unknown flavour '$flavour' (open, proprietary or grid)"; exit 2 ;;
esac

sysrc=""
for candidate in "/lib/modules/$kernel/build" "/usr/lib/modules/$kernel/build" /usr/src/linux; do
  if [ -f "$candidate/include/config/kernel.release" ] &&
     [ "$(cat "$candidate/include/config/kernel.release")" = "$kernel" ]; then
    sysrc="$candidate"
    break
  fi
done
if [ -z "$sysrc" ]; then
  echo "no prepared build tree for kernel $kernel in this developer container" \\
       "(it has: $(ls /lib/modules 2>/dev/null | tr '\\n' ' '))"
  exit 3
fi

rm -rf /work/extract
mkdir /work/extract
cd /work/extract
sh "/work/{INSTALLER_NAME}" --extract-only
src="$(find /work/extract -mindepth 1 -maxdepth 1 -type d | head -n 1)"
make -C "$src/$tree" SYSSRC="$sysrc" -j"$(nproc)" modules
cp "$src/$tree"/*.ko /out/
echo "built for $kernel ($flavour): $(cd /out && echo *.ko)"
"""


@dataclass(frozen=True)
class NspawnBuilder:
    """Compiles the modules in the Flatcar developer container with systemd-nspawn.

    `command` is an argv template (no shell) with placeholders {workdir}, {dev_container},
    {driver_installer}, {kernel}, {flavour} and {out_dir}; the default runs BUILD_SH.
    It needs root, systemd-nspawn, loop devices and the developer container of the node's own
    Flatcar release (its kernel build tree must be the running kernel's): it runs on a Flatcar
    node only, never in this project's tests, which pin its argv and script instead.
    """

    command: Sequence[str] = DEFAULT_NSPAWN_COMMAND
    timeout: float = 3600.0  # Flatcar's own nvidia.service takes 5-10 min; slow disks more

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", tuple(self.command or DEFAULT_NSPAWN_COMMAND))
        self.argv(Path("/w"), Path("/d"), Path("/i"), "k", "f", Path("/o"))  # refuse typos now

    def argv(self, workdir: Path, dev_container: Path, driver_installer: Path, kernel: str,
             flavour: str, out_dir: Path) -> list[str]:
        values = {"workdir": str(workdir), "dev_container": str(dev_container),
                  "driver_installer": str(driver_installer), "kernel": kernel,
                  "flavour": flavour, "out_dir": str(out_dir)}
        return [_fill(arg, values, "use builder command argument",
                      hint="set driver.build.command with those placeholders only")
                for arg in self.command]

    def build(self, workdir: Path, dev_container: Path, driver_installer: Path, kernel: str,
              flavour: str, out_dir: Path) -> None:
        if driver_installer != workdir / INSTALLER_NAME:
            raise DriverBuildError("build", str(driver_installer), "build.sh expects the "
                                   f"installer at /work/{INSTALLER_NAME}")
        # The paths are real ones build() resolved through the Host; writing here is its I/O.
        script = workdir / BUILD_SCRIPT
        script.write_text(BUILD_SH)
        script.chmod(0o755)
        argv = self.argv(workdir, dev_container, driver_installer, kernel, flavour, out_dir)
        log.get().info("driver.build.compile", argv=argv, timeout_s=self.timeout)
        command.run(argv, timeout=self.timeout)


def default_adapters(config: BuildConfig,
                     host: Host | None = None) -> tuple[UrlFetcher, NspawnBuilder]:
    """The real fetcher and builder for `driver.build` (an empty `command`: systemd-nspawn).
    Pass the Host so file:// mirrors resolve under --root; without it they are live paths."""
    return UrlFetcher(host or Host()), NspawnBuilder(command=config.command)


# -- file helpers missing from Host, kept here on top of host.path() -----------------------------


def _file_digest(host: Host, path: str, algorithm: str) -> str:
    try:
        with open(host.path(path), "rb") as f:
            return hashlib.file_digest(f, algorithm).hexdigest()
    except OSError as exc:
        raise HostError("read", host.display(path), exc.strerror or str(exc)) from exc


def _lstat(host: Host, path: str) -> os.stat_result | None:
    """lstat() of the entry itself, its parent resolved in the root; None when absent."""
    parent, _, name = path.rstrip("/").rpartition("/")
    try:
        return os.lstat(host.path(parent or "/") / name)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise HostError("stat", host.display(path), exc.strerror or str(exc)) from exc


def _is_dir(host: Host, path: str) -> bool:
    st = _lstat(host, path)
    return st is not None and stat.S_ISDIR(st.st_mode)


def _is_regular(host: Host, path: str) -> bool:
    st = _lstat(host, path)
    return st is not None and stat.S_ISREG(st.st_mode)


def _rename(host: Host, source: str, target: str) -> None:
    """rename(2) of a directory within one parent, then the parent fsynced: atomic and durable.
    Host has no rename; this is the cache's own."""
    real_target = host.path(target)
    try:
        os.rename(host.path(source), real_target)
        _fsync_path(real_target.parent)
    except OSError as exc:
        raise HostError("rename", f"{host.display(source)} to {host.display(target)}",
                        exc.strerror or str(exc)) from exc


def _remove_tree(host: Host, path: str) -> None:
    """Remove a directory tree (links inside are removed, never followed); gone already is fine.
    Host has no rmtree; this is the cache's own."""
    try:
        shutil.rmtree(host.path(path))
    except FileNotFoundError:
        return
    except OSError as exc:
        raise HostError("remove", host.display(path), exc.strerror or str(exc)) from exc


def _remove_any(host: Host, path: str) -> None:
    if _is_dir(host, path):
        _remove_tree(host, path)
    else:
        host.remove(path)


def _fsync_files(host: Host, directory: str, names: Mapping[str, str]) -> None:
    """The builder's files reach the disk before the rename makes them an entry."""
    try:
        for name in names:
            fd = os.open(host.path(f"{directory}/{name}"), os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_path(host.path(directory))
    except OSError as exc:
        raise HostError("sync", host.display(directory), exc.strerror or str(exc)) from exc


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    # Our own temporary file, and the download already failed: that error is what matters.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _reason(exc: BaseException) -> str:
    code = getattr(exc, "code", None)  # urllib.error.HTTPError, not imported up front
    if isinstance(code, int):
        return f"HTTP {code} {getattr(exc, 'reason', '')}".rstrip()
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    reason = getattr(exc, "reason", None)  # urllib.error.URLError
    return str(reason) if reason is not None else str(exc) or type(exc).__name__
