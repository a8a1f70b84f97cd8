"""NVIDIA's real kernel modules, compiled here once per test cache, never loaded.

What it is for: tests about loading modules (which modules, in which order, with which firmware,
whether they fit the running kernel) must see what the real `.ko` files say in their .modinfo
(vermagic, license → flavour, version, firmware, depends) and what depmod/modprobe make of them.

How: Debian's module sources (nvidia_driver: `nvidia-open-kernel-source` → the open modules,
`nvidia-kernel-source` → the proprietary ones, each a tarball in /usr/src) are compiled against
Debian bookworm's headers of the kernel the kmod tree has (kmod_tree: the same kernel release,
so the modules and the real in-tree modules agree on vermagic and symbol CRCs). The headers are
three packages, fetched with the private apt setup of containerd_bins and unpacked with
`dpkg -x`: `linux-headers-<kver>` (the output tree: .config, Module.symvers, generated headers;
its Makefile includes the source tree by an absolute /usr/src path, pointed into our tree here),
`linux-headers-<abi>-common` (the source tree) and `linux-kbuild-<major.minor>` (scripts, modpost,
fixdep). NVIDIA's Makefile is told both trees, as it wants for a split tree:

    make SYSSRC=<…-common> SYSOUT=<…-amd64> modules

The compiler is the one the kernel's .config names (CONFIG_CC_VERSION_TEXT: gcc-12 on bookworm).
The modules are then stripped of debug info (`strip --strip-debug`, as distributions ship them:
nvidia.ko goes from about 235 MB to 13 MB) and checked with the real `modinfo`: vermagic of this
kernel, the flavour's license, the driver's version. Layout:

    $GPUNODE_TEST_CACHE/nvidia-modules/<kver>/<version>-<flavour>/  (default: /var/cache/…)
        nvidia.ko, nvidia-uvm.ko, nvidia-modeset.ko, nvidia-drm.ko, nvidia-peermem.ko (stripped)
        BUILD    JSON: kernel, headers, driver version, flavour, each module's size before and
                 after stripping, the build's wall and CPU seconds, the recipe (RECIPE)

The headers themselves stay in the cache too, installed as Debian installs them (`ensure_headers`:
$GPUNODE_TEST_CACHE/kernel-headers/<kver>/root/, ~85 MB), for the test that runs gpunode's
build.sh against a real split tree.

Built in a temporary directory next to it and renamed into place, so a directory that exists is
complete; an flock on nvidia-modules/.lock makes concurrent builds wait for one another. A
cached build is used without the network or a compiler as long as its BUILD names RECIPE and
it is for the kmod tree's kernel.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from real import cache
from real.containerd_bins import FETCH_TIMEOUT_S, _private_apt, _run
from real.kmod_tree import SUITE, ensure_module_tree, kmod_tool
from real.nvidia_driver import ensure_driver

FLAVOURS = ("open", "proprietary")
LICENSES = {"open": "Dual MIT/GPL", "proprietary": "NVIDIA"}  # nvidia.ko's, by flavour
MODULES = ("nvidia.ko", "nvidia-uvm.ko", "nvidia-modeset.ko", "nvidia-drm.ko",
           "nvidia-peermem.ko")
BUILD_TIMEOUT_S = 3600  # a build takes ~4 min of CPU
RECIPE = "1"  # bump when _build, _kernel_trees, _unpack_source or _check change what is built


class ModuleBuildError(RuntimeError):
    """The modules could not be built, or are not what they should be."""


@dataclass(frozen=True)
class BuiltModules:
    """Compiled modules of one driver version and flavour for one kernel."""

    directory: Path  # holds the stripped .ko files
    kernel: str
    version: str
    flavour: str
    build: dict[str, object]

    def module(self, name: str) -> Path:
        """The .ko of a module name ("nvidia_uvm" or "nvidia-uvm" → nvidia-uvm.ko)."""
        path = self.directory / (name.removesuffix(".ko").replace("_", "-") + ".ko")
        if not path.is_file():
            raise KeyError(f"no {path.name} in {self.directory}")
        return path


def cache_root() -> Path:
    return cache.root() / "nvidia-modules"


def recipe() -> str:
    """What a cached build must have been made by. Not a hash of this file, as the other
    fetchers use: a build costs minutes of two cores, so only a change of the build or of the
    checks (bump RECIPE) makes a new one."""
    return RECIPE


def ensure_modules(flavour: str, release: str = "550") -> BuiltModules:
    """The release's modules of `flavour` for the kmod tree's kernel, compiled the first time."""
    if flavour not in FLAVOURS:
        raise ValueError(f"unknown flavour {flavour!r}; expected one of {FLAVOURS}")
    tree = ensure_module_tree()
    driver = ensure_driver(release)
    base = cache_root()
    final = base / tree.kver / f"{driver.version}-{flavour}"
    built = _cached(final)  # a build is renamed into place whole: no lock needed to use one
    if built is not None:
        return built
    with cache.locked(base):
        built = _cached(final)
        if built is None:
            headers = _headers_version(tree.root / "BUILD", tree.kver)
            built = _build(final, tree.kver, headers, driver.kernel_source(flavour),
                           driver.version, flavour)
    return built


def _cached(final: Path) -> BuiltModules | None:
    build = cache.read_build(final)
    if build is None or build.get("recipe") != recipe():
        return None
    return BuiltModules(final, build["kernel"], build["version"], build["flavour"], build)


def _headers_version(marker: Path, kver: str) -> str:
    """The Debian version of the headers package the kmod tree was built with."""
    package = json.loads(marker.read_text()).get("headers", "")
    match = re.fullmatch(rf"linux-headers-{re.escape(kver)}_([^_]+)_amd64\.deb", package)
    if not match:
        raise ModuleBuildError(f"{marker} names no linux-headers-{kver} package ({package!r})")
    return match.group(1)


def _build(final: Path, kver: str, headers_version: str, source: Path, version: str,
           flavour: str) -> BuiltModules:
    final.parent.mkdir(parents=True, exist_ok=True)
    cache.remove_leftovers(final.parent, f".build-{final.name}-*", ".stale-*")
    work = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".build-{final.name}-"))
    try:
        started = time.monotonic()
        sysout, syssrc = _kernel_trees(work, kver, headers_version)
        fetched = time.monotonic()
        kbuild_dir = _unpack_source(work, source)
        cpu_before = _children_cpu()
        _run(["make", f"-j{os.cpu_count() or 1}", f"SYSSRC={syssrc}", f"SYSOUT={sysout}",
              "modules"], f"compiling the {flavour} NVIDIA {version} modules for {kver} failed",
             cwd=kbuild_dir, timeout=BUILD_TIMEOUT_S)
        compiled = time.monotonic()
        cpu = _children_cpu() - cpu_before
        out = work / "out"
        out.mkdir()
        sizes = {}
        for name in MODULES:
            built = kbuild_dir / name
            if not built.is_file():
                raise ModuleBuildError(f"make left no {name} in {kbuild_dir}")
            unstripped = built.stat().st_size
            _run(["strip", "--strip-debug", "-o", out / name, built], f"strip {name} failed")
            sizes[name] = {"unstripped": unstripped, "stripped": (out / name).stat().st_size}
        _check(out, kver, version, flavour)
        build = {
            "kernel": kver,
            "headers": headers_version,
            "version": version,
            "flavour": flavour,
            "source": source.name,
            "modules": sizes,
            "fetch_seconds": round(fetched - started, 1),
            "compile_seconds": round(compiled - fetched, 1),
            "compile_cpu_seconds": round(cpu, 1),
            "cpus": os.cpu_count(),
            "recipe": recipe(),
        }
        (out / "BUILD").write_text(json.dumps(build, indent=1) + "\n")
        cache.put_in_place(out, final, stale_prefix=".stale-")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return BuiltModules(final, kver, version, flavour, build)


def ensure_headers() -> Path:
    """A root holding the kmod tree's kernel headers as Debian installs them, for build.sh:
    /lib/modules/<kver>/build and /source (absolute links into /usr/src), the output tree
    /usr/src/linux-headers-<kver>, the source tree /usr/src/linux-headers-<abi>-common and
    /usr/lib/linux-kbuild-<series> (~85 MB), cached in $GPUNODE_TEST_CACHE/kernel-headers/<kver>/
    (the output tree's Makefile includes the source tree's by this cached path). Unpacked in a
    directory next to it and renamed into place, under the same lock as the module builds."""
    tree = ensure_module_tree()
    final = cache_root().parent / "kernel-headers" / tree.kver
    if (final / "BUILD").is_file():
        return final / "root"
    with cache.locked(final.parent):
        if (final / "BUILD").is_file():
            return final / "root"
        work = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".fetch-{tree.kver}-"))
        try:
            headers = _headers_version(tree.root / "BUILD", tree.kver)
            sysout, _ = _kernel_trees(work, tree.kver, headers)
            makefile = sysout / "Makefile"
            makefile.write_text(makefile.read_text().replace(f"{work}/kernel/",
                                                             f"{final}/root/"))
            staged = work / "staged"
            staged.mkdir()
            (work / "kernel").replace(staged / "root")
            (staged / "BUILD").write_text(json.dumps({"kernel": tree.kver,
                                                      "headers": headers}) + "\n")
            shutil.rmtree(final, ignore_errors=True)
            staged.replace(final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final / "root"


def _kernel_trees(work: Path, kver: str, version: str) -> tuple[Path, Path]:
    """Fetch and unpack the kernel's headers; (SYSOUT: the -amd64 tree, SYSSRC: -common)."""
    abi = kver.removesuffix("-amd64")  # 6.1.0-50
    series = ".".join(kver.split(".")[:2])  # 6.1
    packages = [f"linux-headers-{kver}", f"linux-headers-{abi}-common", f"linux-kbuild-{series}"]
    (work / "apt").mkdir()
    apt = _private_apt(work / "apt", SUITE)
    _run([*apt, "update", "-o", "APT::Update::Error-Mode=any"],
         f"apt-get update for Debian {SUITE} failed (network or mirror down?)",
         timeout=FETCH_TIMEOUT_S)
    debs_dir = work / "debs"
    debs_dir.mkdir()
    _run([*apt, "download", *(f"{name}={version}" for name in packages)],
         f"apt-get download {' '.join(packages)} ({version}) from Debian {SUITE} failed",
         cwd=debs_dir, timeout=FETCH_TIMEOUT_S)
    kernel = work / "kernel"
    for deb in sorted(debs_dir.glob("*.deb")):
        _run(["dpkg", "-x", deb, kernel], f"dpkg -x {deb.name} failed")
    src = kernel / "usr" / "src"
    sysout, syssrc = src / f"linux-headers-{kver}", src / f"linux-headers-{abi}-common"
    makefile = sysout / "Makefile"
    text = makefile.read_text()
    absolute = f"/usr/src/linux-headers-{abi}-common/"
    if absolute not in text:
        raise ModuleBuildError(f"{makefile} does not include {absolute}Makefile:\n{text}")
    makefile.write_text(text.replace(absolute, f"{syssrc}/"))
    return sysout, syssrc


def _unpack_source(work: Path, tarball: Path) -> Path:
    """Unpack Debian's module source tarball; the directory holding its top Kbuild file."""
    target = work / "source"
    target.mkdir()
    _run(["tar", "-xf", tarball, "-C", target], f"unpacking {tarball} failed")
    found = sorted(path.parent for path in target.glob("*/*/Kbuild"))
    if len(found) != 1:
        raise ModuleBuildError(f"expected one modules/<name>/Kbuild in {tarball}, found {found}")
    return found[0]


def _check(directory: Path, kver: str, version: str, flavour: str) -> None:
    """What the real modinfo reads from the stripped modules is what they must be."""
    modinfo = kmod_tool("modinfo")
    problems = []
    for name in MODULES:
        path = directory / name
        vermagic = _run([modinfo, "-F", "vermagic", path], f"modinfo {name} failed").strip()
        if vermagic.split(" ")[0] != kver:
            problems.append(f"{name}: vermagic {vermagic!r} is not for {kver}")
        found = _run([modinfo, "-F", "version", path], f"modinfo {name} failed").strip()
        if found != version:
            problems.append(f"{name}: version {found!r}, expected {version}")
    license_ = _run([modinfo, "-F", "license", directory / "nvidia.ko"], "modinfo failed").strip()
    if license_ != LICENSES[flavour]:
        problems.append(f"nvidia.ko: license {license_!r}, the {flavour} modules' is "
                        f"{LICENSES[flavour]!r}")
    if problems:
        raise ModuleBuildError("the built modules are not what they should be:\n  "
                               + "\n  ".join(problems))


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def module_tree(built: BuiltModules, target: Path, subdir: str = "extra") -> Path:
    """A module tree in `target` for `modprobe -d target -S <kernel>` and `depmod -b`: the kmod
    tree's real Debian modules (hard links, so it costs no space) with `built`'s real NVIDIA
    modules in lib/modules/<kernel>/<subdir>/ instead of kmod_tree's stand-ins, and depmod run
    with the kernel's Module.symvers (-e -E: an unknown symbol or CRC would be reported)."""
    tree = ensure_module_tree()
    if tree.kver != built.kernel:
        raise ModuleBuildError(f"the modules are built for {built.kernel}, the kmod tree is "
                               f"{tree.kver}: remove {built.directory} to rebuild")
    moddir = target / "lib" / "modules" / tree.kver
    moddir.parent.mkdir(parents=True, exist_ok=True)
    _run(["cp", "-al", tree.moddir, moddir], f"cp -al {tree.moddir} failed")
    shutil.rmtree(moddir / "extra", ignore_errors=True)  # kmod_tree's stand-ins
    (moddir / subdir).mkdir(parents=True, exist_ok=True)
    for name in MODULES:
        os.link(built.directory / name, moddir / subdir / name)
    (target / "depmod.d").mkdir(exist_ok=True)
    (target / "modprobe.d").mkdir(exist_ok=True)
    for generated in moddir.glob("modules.*"):
        if generated.name not in ("modules.order", "modules.builtin", "modules.builtin.modinfo"):
            generated.unlink()  # hard links into the kmod tree: never rewrite them in place
    argv = [kmod_tool("depmod"), "-C", target / "depmod.d", "-b", target, "-e", "-E",
            tree.symvers, tree.kver]
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=300)
    if result.returncode != 0 or result.stderr.strip():
        raise ModuleBuildError(f"depmod -e -E on the tree with the real modules (exit code "
                               f"{result.returncode}) said:\n{result.stderr or result.stdout}")
    return target
