"""NVIDIA's real driver files as Debian packages them, for tests about what a driver ships.

What it is for: gpunode finds a driver's user-space (libraries, binaries, GSP firmware), mounts
it into containers by CDI and loads its kernel modules. Stand-ins made by the tests can only
have the shapes the tests' authors thought of; the real files have the SONAMEs, the
dependencies, the sizes and the firmware names a node really has (e.g. libnvidia-gpucomp's
SONAME is its full version, libcuda dlopen()s libnvidia-ptxjitcompiler.so.1).

Where they come from: Debian's contrib, non-free and non-free-firmware archives, fetched like
the containerd .debs (containerd_bins: `apt-get download` against a private apt state whose
one source is the suite's `contrib non-free non-free-firmware`; the machine's apt state is never
touched), unpacked with `dpkg -x` into one tree, the documentation left out:

- "550": the production branch, from trixie (a stable release, so the version holds still),
  else sid. The whole user-space a full install has, capability by capability as NVIDIA's
  container toolkit names them (compute, utility, video, graphics, display, ngx), the GSP
  firmware, nvidia-persistenced, and both kernel module sources (`/usr/src/nvidia-kernel.tar.xz`,
  `/usr/src/nvidia-open-kernel.tar.xz`: nvidia_modules compiles them).
- "535": the previous data-centre branch, from bookworm (Debian 12's own driver, package
  names without an infix): compute, utility and the firmware.
- "535-tesla": the same from trixie (else sid), whose 535 is the Tesla branch, every package
  named with a `tesla-535` infix (`libnvidia-tesla-535-cuda1`, `nvidia-tesla-535-smi`, …).

Debian puts most libraries in /usr/lib/x86_64-linux-gnu/nvidia/current (its alternatives
directory), some in /usr/lib/x86_64-linux-gnu, nvidia-smi and nvidia-debugdump in
/usr/lib/nvidia/current: gpunode_testing.real_driver lays them out as a node has them. Layout:

    $GPUNODE_TEST_CACHE/nvidia/<release>/<version>/      (default /var/cache/gpunode-tests)
        root/        the packages unpacked over each other (dpkg -x), docs left out
        BUILD        JSON: release, version, suite, each package's .deb and size, the download
                     and unpack seconds, the recipe (a hash of this file)

It is fetched in a temporary directory next to it and renamed into place, so a tree that exists
is complete. An flock on nvidia/<release>/.lock makes concurrent pytest processes fetch once. A
cached tree is used without asking the network as long as BUILD names this file's recipe; remove
the directory to pick up a newer version of the branch.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from real import cache
from real.containerd_bins import FETCH_TIMEOUT_S, _private_apt, _run

COMPONENTS = "contrib non-free non-free-firmware"

# Debian packages of one driver's user-space, by the NVIDIA_DRIVER_CAPABILITIES set whose
# libraries or binaries they carry (libnvidia-container src/nvc_info.c: utility_libs,
# compute_libs, video_libs, graphics_libs(_glvnd), ngx_libs; display: the X driver).
COMPUTE = ("libcuda1", "libcudadebugger1", "libnvidia-ptxjitcompiler1", "libnvidia-nvvm4",
           "libnvidia-pkcs11-openssl3", "libnvidia-allocator1", "nvidia-opencl-icd",
           "nvidia-cuda-mps")
UTILITY = ("libnvidia-ml1", "libnvidia-cfg1", "nvidia-smi", "nvidia-driver-bin",
           "nvidia-persistenced")
VIDEO = ("libnvcuvid1", "libnvidia-encode1", "libnvidia-opticalflow1", "nvidia-vdpau-driver")
GRAPHICS = ("libnvidia-eglcore", "libnvidia-glcore", "libnvidia-glvkspirv", "libnvidia-rtcore",
            "libnvoptix1", "libnvidia-fbc1", "libegl-nvidia0", "libglx-nvidia0",
            "libgles-nvidia1", "libgles-nvidia2", "libnvidia-api1", "libnvidia-gpucomp",
            "nvidia-egl-common", "nvidia-vulkan-common")
NGX = ("libnvidia-ngx1",)
DISPLAY = ("xserver-xorg-video-nvidia",)
FIRMWARE = ("firmware-nvidia-gsp",)
KERNEL_SOURCES = ("nvidia-kernel-source", "nvidia-open-kernel-source")
# Debian's Tesla 535 branch (trixie, sid): the same files under an infixed package name, in
# /usr/lib/x86_64-linux-gnu/nvidia/tesla-535 and /usr/lib/nvidia/tesla-535.
TESLA_535 = ("libnvidia-tesla-535-cuda1", "libnvidia-tesla-535-cudadebugger1",
             "libnvidia-tesla-535-ptxjitcompiler1", "libnvidia-tesla-535-nvvm4",
             "libnvidia-tesla-535-pkcs11-openssl3", "libnvidia-tesla-535-allocator1",
             "nvidia-tesla-535-opencl-icd", "libnvidia-tesla-535-ml1", "libnvidia-tesla-535-cfg1",
             "nvidia-tesla-535-smi", "nvidia-tesla-535-driver-bin", "nvidia-persistenced",
             "firmware-nvidia-tesla-535-gsp")


@dataclass(frozen=True)
class Release:
    """One driver branch: where Debian has it and which of its packages the tests need."""

    name: str
    branch: str  # the upstream version's first field every package must have ("550")
    suites: tuple[str, ...]  # tried in order; the first that has the branch is used
    packages: tuple[str, ...]
    # packages built from another source than the driver, whose version may differ (bookworm's
    # nvidia-persistenced is 535.171.04 beside a 535.261.03 driver)
    own_version: tuple[str, ...] = ("nvidia-persistenced",)


RELEASES = {
    "550": Release("550", "550", ("trixie", "sid"),
                   COMPUTE + UTILITY + VIDEO + GRAPHICS + NGX + DISPLAY + FIRMWARE
                   + KERNEL_SOURCES),
    "535": Release("535", "535", ("bookworm",), COMPUTE + UTILITY + FIRMWARE),
    "535-tesla": Release("535-tesla", "535", ("trixie", "sid"), TESLA_535),
}

# Left out of the unpacked tree: documentation, and what only dpkg's own bookkeeping reads.
SKIPPED = ("usr/share/doc", "usr/share/man", "usr/share/lintian", "usr/share/bug")


class DriverFetchError(RuntimeError):
    """The driver's packages could not be fetched or are not what the release says."""


@dataclass(frozen=True)
class DriverFiles:
    """A fetched driver: its packages unpacked into `root`, and their version."""

    release: str
    version: str  # the upstream version, e.g. "550.163.01"
    root: Path
    build: dict[str, object]

    def kernel_source(self, flavour: str) -> Path:
        """The module source tarball of "open" or "proprietary" (nvidia-*-kernel-source)."""
        name = {"open": "nvidia-open-kernel.tar.xz", "proprietary": "nvidia-kernel.tar.xz"}[flavour]
        path = self.root / "usr" / "src" / name
        if not path.is_file():
            raise DriverFetchError(f"release {self.release} has no {flavour} module source "
                                   f"({path}): its package list has no kernel sources")
        return path


def cache_root(release: str) -> Path:
    """Where one release lives; GPUNODE_TEST_CACHE moves the whole test cache."""
    return cache.root() / "nvidia" / release


def recipe() -> str:
    """What a cached tree must have been fetched by: a hash of this file's text."""
    return cache.file_recipe(__file__)


def ensure_driver(release: str) -> DriverFiles:
    """The release's driver files, fetched and unpacked the first time; no network after."""
    if release not in RELEASES:
        raise ValueError(f"unknown release {release!r}; expected one of {sorted(RELEASES)}")
    base = cache_root(release)
    with cache.locked(base):
        found = _cached(base, release)
        if found is None:
            found = _fetch(base, RELEASES[release])
    return found


def _cached(base: Path, release: str) -> DriverFiles | None:
    found = cache.newest(base, recipe(), "version", "fetched")
    if found is None:
        return None
    directory, build = found
    return DriverFiles(release, build["version"], directory / "root", build)


def _fetch(base: Path, release: Release) -> DriverFiles:
    cache.remove_leftovers(base, "fetch-*", "stale-*")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=base, prefix="fetch-") as tmp_name:
        tmp = Path(tmp_name)
        suite, apt, versions = _pick_suite(tmp, release)
        version = _upstream(versions[release.packages[0]])
        debs = _download(tmp, apt, suite, release, versions)
        downloaded = time.monotonic() - started
        staging = tmp / "tree"
        (staging / "root").mkdir(parents=True)
        for deb in debs:
            _run(["dpkg", "-x", deb, staging / "root"], f"dpkg -x {deb.name} failed")
        for skipped in SKIPPED:
            shutil.rmtree(staging / "root" / skipped, ignore_errors=True)
        build = {
            "release": release.name,
            "version": version,
            "suite": suite,
            "packages": {deb.name.split("_")[0]: {"deb": deb.name, "bytes": deb.stat().st_size}
                         for deb in debs},
            "download_bytes": sum(deb.stat().st_size for deb in debs),
            "download_seconds": round(downloaded, 1),
            "unpack_seconds": round(time.monotonic() - started - downloaded, 1),
            "recipe": recipe(),
            "fetched": time.time(),
        }
        (staging / "BUILD").write_text(json.dumps(build, indent=1) + "\n")
        final = base / version
        cache.put_in_place(staging, final)
    cache.drop_others(base, final)
    return DriverFiles(release.name, version, final / "root", build)


def _pick_suite(tmp: Path, release: Release) -> tuple[str, list[str], dict[str, str]]:
    """The first suite that has every package of the branch: (suite, its apt-get command line,
    package → version)."""
    seen = []
    for suite in release.suites:
        state = tmp / f"apt-{suite}"
        state.mkdir()
        apt = _private_apt(state, suite, COMPONENTS)
        _run([*apt, "update", "-o", "APT::Update::Error-Mode=any"],
             f"apt-get update for Debian {suite} ({COMPONENTS}) failed (network or mirror down?)",
             timeout=FETCH_TIMEOUT_S)
        versions = _candidates(["apt-cache", *apt[1:]], release.packages)
        wrong = {name: version for name, version in versions.items()
                 if name not in release.own_version
                 and _upstream(version).split(".")[0] != release.branch}
        missing = sorted(set(release.packages) - set(versions))
        if not missing and not wrong and _same_driver(versions, release):
            return suite, apt, versions
        seen.append(f"{suite}: missing {missing}, other branches {wrong}")
    raise DriverFetchError(f"no Debian suite has NVIDIA {release.branch}'s packages "
                           f"({COMPONENTS}):\n  " + "\n  ".join(seen))


def _candidates(apt_cache: list[str], packages: tuple[str, ...]) -> dict[str, str]:
    """package → the candidate version `apt-cache show --no-all-versions` names."""
    shown = _run([*apt_cache, "show", "--no-all-versions", *packages],
                 "apt-cache show of the driver's packages failed (a package missing?)")
    versions = {}
    for record in shown.split("\n\n"):
        name = re.search(r"^Package: (\S+)$", record, re.MULTILINE)
        version = re.search(r"^Version: (\S+)$", record, re.MULTILINE)
        if name and version:
            versions[name.group(1)] = version.group(1)
    return versions


def _same_driver(versions: dict[str, str], release: Release) -> bool:
    """Every package of the driver's own source has one upstream version."""
    return len({_upstream(v) for name, v in versions.items()
                if name not in release.own_version and name not in KERNEL_SOURCES}) == 1


def _upstream(debian_version: str) -> str:
    """"550.163.01-2" → "550.163.01" (an epoch, if any, dropped)."""
    return debian_version.split(":")[-1].rsplit("-", 1)[0]


def _download(tmp: Path, apt: list[str], suite: str, release: Release,
              versions: dict[str, str]) -> list[Path]:
    target = tmp / "debs"
    target.mkdir()
    _run([*apt, "download", *(f"{name}={versions[name]}" for name in release.packages)],
         f"apt-get download of NVIDIA {release.branch} from Debian {suite} failed",
         cwd=target, timeout=FETCH_TIMEOUT_S)
    debs = sorted(target.glob("*.deb"))
    names = sorted(deb.name.split("_")[0] for deb in debs)
    if names != sorted(release.packages):
        raise DriverFetchError(f"apt-get download left {names}, expected "
                               f"{sorted(release.packages)}")
    return debs
