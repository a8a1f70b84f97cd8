"""Build the NVIDIA kernel modules once per kernel, driver and flavour, into the driver cache.

`plan_build()` is pure (names checked, URLs rendered, checksums required); `build()` acts: it
returns the usable cache entry (driver/cache.py) for the inputs, or downloads the installer and
the Flatcar developer container, checks their digests, runs the builder, and publishes the new
entry. A build runs in a staging directory next to the entry, writes the manifest last and
becomes visible by one rename, so a crash at any point leaves no usable-looking entry. A
refused download leaves nothing; a failed build leaves its build.log (its inputs are deleted at
once); a crash leaves its staging dir. The next build (or prune) removes those under the cache
lock: one cleanup path, exercised by every failure. The one that waited for the lock finds the
other's entry.

The fetcher and builder are adapters passed in (the real ones: driver/builders.py). They get
real paths, resolved here through the Host; every other file operation is the Host's.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from gpunode import log
from gpunode.driver import cache
from gpunode.errors import DriverBuildError, GpunodeError
from gpunode.platform import envfile
from gpunode.platform.host import Host

if TYPE_CHECKING:
    from gpunode.config import DriverConfig

WORK_DIR = ".work"  # inside the staging dir: downloads, build.sh, build.log; gone on success
INSTALLER_NAME = "nvidia-installer.run"
WANTED_LIST = "userspace.list"  # in the work dir: the driver version and the files to extract
DEV_CONTAINER_NAME = "flatcar_developer_container.bin"
BUILD_LOG = "build.log"

DIGEST_LENGTHS = {"sha256": 64, "sha512": 128}
URL_SCHEMES = ("http", "https", "file")

RELEASE_FILE = "/usr/share/flatcar/release"
OS_RELEASE = "/etc/os-release"
UPDATE_CONFS = ("/etc/flatcar/update.conf", "/usr/share/flatcar/update.conf")
DEFAULT_BOARD = "amd64-usr"
DEFAULT_GROUP = "stable"

_PLACEHOLDER_RE = re.compile(r"\{([A-Za-z_]+)\}")


# -- records -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildInputs:
    """The inputs of one driver build: what it is for, and what it is made from."""

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
    """One file a build downloads into its work directory, and the digest it must have."""

    role: str  # "dev_container" or "driver": the key in the manifest's "inputs"
    url: str  # rendered
    algorithm: str  # "sha512" or "sha256"
    expected: str | None  # lowercase hex; None only when unverified downloads are allowed
    filename: str  # its name in the work directory


@dataclass(frozen=True)
class BuildPlan:
    """One build as planned, checked before any download: its cache entry and its downloads."""

    kernel: str
    driver: str
    flavour: str
    entry: str  # host path of the cache entry
    dev_container: Download
    installer: Download

    def describe(self) -> list[str]:
        lines = [f"build NVIDIA {self.driver} ({self.flavour}) modules and user-space for kernel "
                 f"{self.kernel} into {self.entry}"]
        for d in (self.dev_container, self.installer):
            check = f"{d.algorithm} {d.expected}" if d.expected else "UNVERIFIED"
            lines.append(f"download {d.url} ({check})")
        return lines


@dataclass(frozen=True)
class BuildResult:
    """The usable cache entry a build gave, found there already or just built."""

    entry: cache.CacheEntry
    cache_hit: bool
    seconds: float


def inputs_for(config: DriverConfig, kernel: str, flavour: str) -> BuildInputs:
    """The inputs `driver.build` gives for this kernel and flavour: the one place they are
    assembled, for `gpunode driver build` and the driver step alike."""
    b = config.build
    return BuildInputs(
        kernel=kernel, driver=config.version, flavour=flavour,
        dev_container_url=b.dev_container_url, dev_container_sha512=b.dev_container_sha512,
        driver_url=b.driver_url, driver_sha256=b.driver_sha256,
        allow_unverified=b.allow_unverified)


# -- pure: facts, URLs, plan ---------------------------------------------------------------------


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
    return fill(template, values, "render URL",
                 hint="run on Flatcar, or give the URL without {version}")


def fill(template: str, values: Mapping[str, str | None], verb: str, hint: str) -> str:
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
    entry = cache.entry_path(inputs.kernel, inputs.driver, inputs.flavour)
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
    entry, _ = cache.check_entry(host, plan.entry, plan.kernel, plan.driver, plan.flavour)
    if entry is None:
        with cache.locked(host):
            entry = cache.find_usable(host, plan.kernel, plan.driver, plan.flavour)  # meanwhile?
            if entry is None:
                cache.remove_leftovers(host)
                entry = _build_entry(host, plan, fetcher, builder, facts)
                return BuildResult(entry, False, time.monotonic() - started)
    log.get().info("driver.build.cache_hit", entry=host.display(entry.path))
    return BuildResult(entry, True, time.monotonic() - started)


def _build_entry(host: Host, plan: BuildPlan, fetcher: Fetcher, builder: Builder,
                 facts: FlatcarFacts) -> cache.CacheEntry:
    started = time.monotonic()
    kernel_dir = plan.entry.rsplit("/", 1)[0]
    staging = (f"{kernel_dir}/{cache.STAGING_PREFIX}{plan.driver}-{plan.flavour}-"
               f"{os.urandom(4).hex()}")
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
        host.remove_tree(staging)  # refused or failed downloads: nothing worth keeping
        raise
    host.write_atomic(f"{work}/{WANTED_LIST}", wanted_list(plan.driver).encode())
    _run_builder(host, builder, plan, work, image, installer, staging)
    from gpunode.driver import extracted  # only a build checks what the builder extracted

    try:
        modules = _collect_modules(host, plan, staging)
        files, links = extracted.collect(host, staging, plan.driver, plan.flavour,
                                         hint=f"see {host.display(work)}/{BUILD_LOG}")
    except GpunodeError:
        _keep_only_the_log(host, staging, work)  # a refused result: nothing of it is kept
        raise
    host.remove_tree(work)
    digests = {"dev_container": image_digest, "driver": installer_digest}
    manifest = cache.make_manifest(
        plan.kernel, plan.driver, plan.flavour, facts.version, modules,
        {d.role: {"url": d.url, d.algorithm: digests[d.role], "verified": d.expected is not None}
         for d in (plan.dev_container, plan.installer)},
        datetime.now(UTC), time.monotonic() - started, files, links)
    for name in (*modules, *files):  # the builder's files reach the disk before the rename
        host.fsync(f"{staging}/{name}")
    for directory in extracted.directories(files):
        host.fsync(f"{staging}/{directory}")
    host.fsync(staging)
    host.write_atomic(f"{staging}/{cache.MANIFEST}",
                      (json.dumps(manifest, indent=2) + "\n").encode())  # last: marks it whole
    cache.publish(host, staging, plan.entry)
    # Verified once, fully, as published (its stamp makes the next boots' checks cheap).
    entry, problem = cache.verify(host, plan.entry, plan.kernel, plan.driver, plan.flavour)
    if entry is None:
        raise DriverBuildError("verify", host.display(plan.entry), f"the entry just built is "
                               f"not usable: {problem}", hint="did something change it while "
                               "it was published? build again")
    log.get().info("driver.build.done", entry=host.display(plan.entry),
                   modules=sorted(modules), userspace_files=len(files),
                   build_seconds=manifest["build_seconds"])
    return entry


def wanted_list(driver: str) -> str:
    """What build.sh extracts from the installer (driver/userspace.py's lists): `version V`,
    then `lib <name>` and `bin <name>` lines."""
    from gpunode.driver import userspace

    return "".join([f"version {driver}\n", *(f"lib {name}\n" for name in userspace.LIBRARIES),
                    *(f"bin {name}\n" for name in userspace.BINARIES)])


def _fetch_verified(host: Host, fetcher: Fetcher, download: Download,
                    work: str) -> tuple[str, str]:
    """Download into the work dir and check its digest; a mismatch deletes the file. Returns
    the host path of the file and its digest."""
    path = f"{work}/{download.filename}"
    log.get().info("driver.build.download", input=download.role, url=download.url)
    try:
        fetcher.fetch(download.url, host.path(path))
    except OSError as exc:  # a Fetcher other than UrlFetcher, failing plainly
        raise DriverBuildError("download", download.url, exc.strerror or str(exc)) from exc
    actual = host.digest(path, download.algorithm)
    if download.expected is None:
        log.get().warning("driver.build.unverified", input=download.role, url=download.url,
                          **{download.algorithm: actual})
    elif actual != download.expected:
        host.remove(path)
        raise DriverBuildError("verify", download.url, f"{download.algorithm} is {actual}, "
                               f"expected {download.expected}",
                               hint="the download is corrupt or the file changed upstream: "
                               "check the URL and the configured checksum")
    return path, actual


def _unpack(host: Host, path: str) -> str:
    """Flatcar publishes the developer container bzip2-compressed; nspawn needs the raw image.

    Python's bz2 (single-threaded) instead of lbzip2: no program to depend on, at the cost of
    a minute or so for the image.
    """
    if not path.endswith(".bz2"):
        return path
    target = path.removesuffix(".bz2")
    try:
        host.write_atomic(target, _bunzip(host.read_chunks(path)))
    except (OSError, EOFError) as exc:  # what bz2 raises for data that is not (whole) bzip2
        raise DriverBuildError("unpack", host.display(path), str(exc),
                               hint="the download is truncated or not bzip2") from exc
    host.remove(path)
    return target


def _bunzip(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The decompressed bytes of bzip2 data, which may be several streams one after another
    (lbzip2 and pbzip2 write those), as bz2.open reads them."""
    import bz2  # only a build needs it

    decompressor = bz2.BZ2Decompressor()
    fed = seen = False  # the current stream has data but no end yet; any data at all
    for chunk in chunks:
        while chunk:
            fed = seen = True
            out = decompressor.decompress(chunk)
            if out:
                yield out
            if not decompressor.eof:
                break
            chunk = decompressor.unused_data  # the next stream, if any
            decompressor, fed = bz2.BZ2Decompressor(), False
    if fed:
        raise EOFError("Compressed file ended before the end-of-stream marker was reached")
    if not seen:
        raise EOFError("the file is empty")


def _run_builder(host: Host, builder: Builder, plan: BuildPlan, work: str, image: str,
                 installer: str, staging: str) -> None:
    """A failed build keeps its build.log in the staging dir until the next build or prune
    removes it; the gigabytes of inputs and intermediate files go at once."""
    try:
        builder.build(host.path(work), host.path(image), host.path(installer), plan.kernel,
                      plan.flavour, host.path(staging))
    except (GpunodeError, OSError) as exc:
        _keep_only_the_log(host, staging, work)
        raise DriverBuildError(
            "build", f"NVIDIA {plan.driver} ({plan.flavour}) for kernel {plan.kernel}", str(exc),
            hint=f"its log stays in {host.display(work)}/{BUILD_LOG} (if the builder wrote one) "
            "until the next 'gpunode driver build' or prune removes it") from exc


def _keep_only_the_log(host: Host, staging: str, work: str) -> None:
    """A failed or refused build: its log stays (until the next build or prune removes the
    staging dir), its inputs and whatever it made go at once."""
    for name in host.list_dir(staging):
        if name != WORK_DIR:
            host.remove_tree(f"{staging}/{name}")
    for name in host.list_dir(work):
        if name != BUILD_LOG:
            host.remove_tree(f"{work}/{name}")


def _collect_modules(host: Host, plan: BuildPlan, out: str) -> dict[str, str]:
    """name → sha256 of every .ko the builder left; refused without nvidia.ko."""
    modules = {name: host.digest(f"{out}/{name}", "sha256")
               for name in host.list_dir(out)
               if cache.is_module_name(name) and _is_regular(host, f"{out}/{name}")}
    if "nvidia.ko" not in modules:
        found = ", ".join(sorted(modules)) or "no .ko files"
        raise DriverBuildError("build", f"NVIDIA {plan.driver} ({plan.flavour}) for kernel "
                               f"{plan.kernel}", f"the builder left no nvidia.ko ({found})",
                               hint=f"see {host.display(out)}/{WORK_DIR}/{BUILD_LOG}")
    return modules


def _is_regular(host: Host, path: str) -> bool:
    st = host.lstat(path)
    return st is not None and stat.S_ISREG(st.st_mode)
