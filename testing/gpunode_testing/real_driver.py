"""NVIDIA's real driver files laid out in a fixture host as a node has them.

The files come unpacked from Debian's packages (tests/real/nvidia_driver.py fetches them into the
test cache; `source` below is that tree) and the kernel modules compiled from Debian's sources
(tests/real/nvidia_modules.py). This module only reads them and places them, so that a fixture
node (gpunode_testing.fixtures) carries the real user-space where driver_files' stand-ins would
be. The layouts are the ones gpunode knows (gpunode/driver/userspace.py, LAYOUTS), each as its
source installs it (read in flatcar/scripts and gpunode, cited per function):

- `install_sysext`: Flatcar's official driver sysext (`flatcar-nvidia-drivers-<branch>[-open]`).
- `install_nvidia_service`: what Flatcar's own nvidia.service (setup-nvidia) leaves in /opt.
- `install_prebuilt`: gpunode's prebuilt directory, /opt/nvidia/modules/<kernel>/.
- `install_build_entry`: a build-cache entry as gpunode's build makes one (driver/cache.py).

Libraries are placed by file name (`lib<name>.so.<version>`, and `libnvidia-api.so.1`, the one
library of the driver without the version in its name); their SONAME links are made by the real
`ldconfig -n`, as on an installed system; libraries whose SONAME is their file name
(libnvidia-gpucomp, libnvidia-pkcs11-openssl3, libnvidia-glcore, …) get none. Files are hard
links into the test cache when it is on the same file system (a full 550 user-space is ~450 MB),
else copies: replace a file to change it, never write into one.

Library sets are chosen by NVIDIA_DRIVER_CAPABILITIES name (CAPABILITIES, from
NVIDIA/libnvidia-container src/nvc_info.c: utility_libs, compute_libs, video_libs,
graphics_libs + graphics_libs_glvnd, ngx_libs; display: the X server's driver files, which the
container toolkit's graphics discoverer mounts: internal/discover/graphics.go).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from dataclasses import replace as _replace
from pathlib import Path

from gpunode_testing import driver_files, fixtures

CAPABILITIES: dict[str, tuple[str, ...]] = {
    "utility": ("libnvidia-ml", "libnvidia-cfg", "libnvidia-nscq"),
    "compute": ("libcuda", "libcudadebugger", "libnvidia-opencl", "libnvidia-gpucomp",
                "libnvidia-ptxjitcompiler", "libnvidia-fatbinaryloader", "libnvidia-allocator",
                "libnvidia-compiler", "libnvidia-pkcs11", "libnvidia-pkcs11-openssl3",
                "libnvidia-nvvm", "libnvidia-tileiras"),
    "video": ("libvdpau_nvidia", "libnvidia-encode", "libnvidia-opticalflow", "libnvcuvid"),
    "graphics": ("libnvidia-eglcore", "libnvidia-glcore", "libnvidia-tls", "libnvidia-glsi",
                 "libnvidia-fbc", "libnvidia-ifr", "libnvidia-rtcore", "libnvoptix",
                 "libGLX_nvidia", "libEGL_nvidia", "libGLESv2_nvidia", "libGLESv1_CM_nvidia",
                 "libnvidia-glvkspirv", "libnvidia-cbl",
                 # NVAPI: in neither list of nvc_info.c; the toolkit mounts it only among its
                 # "explicit" libraries (pkg/nvcdi/driver-nvml.go, behind a feature flag)
                 "libnvidia-api"),
    "ngx": ("libnvidia-ngx",),
    "display": ("libglxserver_nvidia",),
}
ALL = tuple(CAPABILITIES)
# The default of NVIDIA's runtime hook when NVIDIA_DRIVER_CAPABILITIES is unset (toolkit
# internal/config/image/capabilities.go DefaultDriverCapabilities); `nvidia-ctk cdi generate`
# filters nothing: its spec mounts every `*.so.<version>` of the driver.
DEFAULT_CAPABILITIES = ("utility", "compute")

BINARIES = {  # nvc_info.c utility_bins, compute_bins
    "nvidia-smi": "utility", "nvidia-debugdump": "utility", "nvidia-persistenced": "utility",
    "nv-fabricmanager": "utility",
    "nvidia-cuda-mps-control": "compute", "nvidia-cuda-mps-server": "compute",
}
X_DRIVER = "nvidia_drv.so"  # display: the X server's driver module, no version in its name
# Where Debian's packages put the driver's files (its alternatives directories among them).
# (/usr/lib/nvidia/<flavour>: "current", or the branch of an infixed package, "tesla-535").
SOURCE_LIB_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib/nvidia")
SOURCE_BIN_DIRS = ("usr/bin", "usr/sbin", "usr/lib/nvidia/*")
KO_NAMES = ("nvidia.ko", "nvidia-uvm.ko", "nvidia-modeset.ko", "nvidia-drm.ko",
            "nvidia-peermem.ko")
BUILD_CACHE = "/opt/gpunode/drivers"  # gpunode/driver/cache.py CACHE_ROOT
PREBUILT_DIR = "/opt/nvidia/modules"  # gpunode's default driver.prebuilt_dirs


@dataclass(frozen=True)
class Library:
    """One library file of the driver."""

    path: Path  # in the source tree
    soname: str | None  # DT_SONAME as `readelf -d` reads it
    capability: str

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def stem(self) -> str:
        """"libcuda.so.550.163.01" → "libcuda"."""
        return self.name.split(".so")[0]


@dataclass(frozen=True)
class DriverSource:
    """The real files of one driver version, found in an unpacked package tree."""

    root: Path
    version: str
    libraries: tuple[Library, ...]
    binaries: dict[str, Path]  # name → file
    firmware: tuple[Path, ...]  # gsp_*.bin
    x_driver: Path | None

    def select(self, capabilities: Iterable[str] = ALL) -> tuple[Library, ...]:
        wanted = set(capabilities)
        unknown = wanted - set(CAPABILITIES)
        if unknown:
            raise ValueError(f"unknown capabilities {sorted(unknown)}; known: {ALL}")
        return tuple(lib for lib in self.libraries if lib.capability in wanted)


def read_source(root: Path, version: str) -> DriverSource:
    """The driver's files in `root` (Debian's packages unpacked there): only 64-bit ELF
    libraries of `version` (plus libnvidia-api.so.1), classified by capability."""
    libraries = []
    for directory in SOURCE_LIB_DIRS:
        for path in sorted((root / directory).rglob("*.so*")):
            if path.is_symlink() or not path.is_file() or not _is_elf64(path):
                continue
            if not (path.name.endswith(f".so.{version}") or path.name == "libnvidia-api.so.1"):
                continue
            capability = capability_of(path.name)
            if capability is not None:
                libraries.append(Library(path, soname(path), capability))
    binaries = {}
    for name in BINARIES:
        found = [path for pattern in SOURCE_BIN_DIRS for path in sorted(root.glob(pattern))
                 if (path / name).is_file()]
        if found:
            binaries[name] = found[0] / name
    firmware = tuple(sorted(path for directory in ("usr/lib/firmware", "lib/firmware")
                            for path in (root / directory / "nvidia" / version).glob("gsp_*.bin")))
    x_drivers = sorted(root.glob(f"usr/lib/**/{X_DRIVER}"))
    return DriverSource(root, version, tuple(libraries), binaries, firmware,
                        x_drivers[0] if x_drivers else None)


def capability_of(file_name: str) -> str | None:
    stem = file_name.split(".so")[0]
    for capability, stems in CAPABILITIES.items():
        if stem in stems:
            return capability
    return None


def soname(path: Path) -> str | None:
    """The library's DT_SONAME, read by binutils' readelf."""
    out = subprocess.run(["readelf", "-d", "--wide", str(path)], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    match = re.search(r"\(SONAME\)\s+Library soname: \[([^\]]+)\]", out)
    return match.group(1) if match else None


# -- the layouts ---------------------------------------------------------------------------------


def install_sysext(root: Path, source: DriverSource, *, kernel: str,
                   modules: Path | None = None, flavour: str = "open",
                   capabilities: Iterable[str] | None = None) -> Path:
    """Flatcar's driver sysext, merged: libraries in /usr/lib64, binaries in /usr/bin, firmware
    in /lib/firmware/nvidia/<version> (Flatcar's /lib is /usr/lib), the modules in
    /usr/lib/modules/<kernel>/video/ with a modprobe `install` hook each and no modules.dep
    (flatcar/scripts build_library/sysext_mangle_kmod: the sysext's modules.* files are deleted
    so that it cannot mask the base image's), and its extension-release file.

    The sysext is built with Flatcar's USE flags for x11-drivers/nvidia-drivers (-X -tools:
    coreos-overlay profiles/coreos/base/package.use.mask), so the ebuild skips libGLX_nvidia,
    libglxserver_nvidia, libnvidia-fbc, libvdpau_nvidia and the X driver: `capabilities`
    None means that set; name capabilities to take all their libraries instead."""
    name = f"flatcar-nvidia-drivers-{source.version.split('.')[0]}" + \
        ("-open" if flavour == "open" else "")
    libraries = source.select(ALL) if capabilities is None else source.select(capabilities)
    if capabilities is None:
        without_x = ("libGLX_nvidia", "libglxserver_nvidia", "libnvidia-fbc", "libvdpau_nvidia")
        libraries = tuple(lib for lib in libraries if lib.stem not in without_x)
    install_libraries(root / "usr/lib64", libraries, dev_link=True)
    _install_binaries(root / "usr/bin", source, BINARIES)
    _install_firmware(_merged_lib(root) / "firmware/nvidia" / source.version, source)
    _write(root / "usr/lib/extension-release.d" / f"extension-release.{name}",
           "ID=flatcar\nSYSEXT_LEVEL=1.0\nARCHITECTURE=x86-64\n")
    _write(root / "usr/lib/systemd/system/nvidia-persistenced.service", PERSISTENCED_UNIT)
    if modules is not None:
        video = root / "usr/lib/modules" / kernel / "video"
        _install_modules(video, modules)
        helper = f"/usr/libexec/_{name}_modprobe_helper"
        _write(root / helper.lstrip("/"), "#!/bin/bash\n# stand-in: the real helper mounts an "
               "overlay with the sysext's modules over /usr/lib/modules and runs depmod\n", 0o755)
        # one pair per .ko file, named as the file is (sysext_mangle_kmod: `%f` less `.ko`)
        lines = [f"install {ko[:-3]} {helper} {ko[:-3]}\nremove {ko[:-3]} {helper} -r {ko[:-3]}\n"
                 for ko in KO_NAMES if (video / ko).exists()]
        _write(root / "usr/lib/modprobe.d" / f"10-{name}-kmod-sysext.conf", "".join(lines))
    return root / "usr/lib64"


def install_nvidia_service(root: Path, source: DriverSource, *, kernel: str,
                           modules: Path | None = None) -> Path:
    """What Flatcar's nvidia.service leaves after its first boot (coreos-overlay
    x11-drivers/nvidia-drivers-service/files/bin/setup-nvidia): every `*.so.*` of the
    installer in /opt/nvidia/<version>/<kernel>/usr/lib64 with the SONAME links `ldconfig`
    made there (its ld.so.conf.d/nvidia.conf names /opt/nvidia/current/usr/lib64), the binaries
    in /opt/bin, the (proprietary) modules in …/usr/lib/modules/<kernel>/video/, the
    /opt/nvidia/current link; no firmware (it copies none)."""
    base = root / "opt/nvidia" / source.version / kernel
    lib64 = base / "usr/lib64"
    install_libraries(lib64, source.select(ALL), dev_link=False)
    _install_binaries(root / "opt/bin", source, BINARIES)
    if modules is not None:
        _install_modules(base / "usr/lib/modules" / kernel / "video", modules)
    _write(base / "usr/lib/extension-release.d/extension-release.nvidia-driver",
           "ID=flatcar\nSYSEXT_LEVEL=1.0\n")
    current = root / "opt/nvidia/current"
    if current.is_symlink() or current.exists():
        current.unlink()
    current.symlink_to(f"{source.version}/{kernel}")
    _write(root / "etc/ld.so.conf.d/nvidia.conf", "/opt/nvidia/current/usr/lib64\n")
    return lib64


def install_prebuilt(root: Path, source: DriverSource, *, kernel: str, modules: Path,
                     directory: str = PREBUILT_DIR,
                     capabilities: Iterable[str] = ALL) -> Path:
    """gpunode's prebuilt layout (driver/userspace.py "prebuilt"): the modules in
    <directory>/<kernel>/, beside them lib/ (libraries and SONAME links), bin/ and
    firmware/nvidia/<version>/."""
    base = root / directory.lstrip("/") / kernel
    _install_modules(base, modules)
    install_libraries(base / "lib", source.select(capabilities), dev_link=False)
    _install_binaries(base / "bin", source, BINARIES)
    _install_firmware(base / "firmware/nvidia" / source.version, source)
    return base


def install_build_entry(root: Path, source: DriverSource, *, kernel: str, flavour: str,
                        modules: Path, module_source: Path | None = None,
                        capabilities: Iterable[str] = DEFAULT_CAPABILITIES) -> Path:
    """A build-cache entry as gpunode's build publishes it (driver/cache.py): the modules flat,
    lib/ with the libraries and their `ldconfig -n` links, bin/, firmware/nvidia/<version>/,
    and manifest.json (schema_version 2) with the sha256 of every file and each link's
    target. By default the compute and utility libraries, the set gpunode's build extracts
    from the installer today. `module_source` (the tarball the modules came from) is
    recorded as the build's verified driver input."""
    entry = root / BUILD_CACHE.lstrip("/") / kernel / f"{source.version}-{flavour}"
    started = time.time()
    _install_modules(entry, modules)
    install_libraries(entry / "lib", source.select(capabilities), dev_link=False)
    _install_binaries(entry / "bin", source, BINARIES)
    _install_firmware(entry / "firmware/nvidia" / source.version, source)
    files = {path.relative_to(entry).as_posix(): _sha256(path)
             for path in sorted(entry.rglob("*")) if path.is_file() and not path.is_symlink()}
    modules_sha = {rel: digest for rel, digest in files.items() if rel.endswith(".ko")}
    userspace = {rel: digest for rel, digest in files.items() if not rel.endswith(".ko")}
    links = {path.relative_to(entry).as_posix(): os.readlink(path)
             for path in sorted((entry / "lib").iterdir()) if path.is_symlink()}
    inputs = {}
    if module_source is not None:
        inputs["driver"] = {"url": f"file://{module_source}", "sha256": _sha256(module_source),
                            "verified": True}
    manifest = {
        "schema_version": 2, "kernel": kernel, "driver": source.version, "flavour": flavour,
        "flatcar_version": None, "modules": modules_sha, "userspace": userspace,
        "links": links, "inputs": inputs,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "build_seconds": round(time.time() - started, 3),
    }
    _write(entry / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return entry


def write_uninitialized_gpus(root: Path) -> list[Path]:
    """Make every GPU of a fixture node read as the driver shows it before the GPU was opened
    once (no persistence mode, no client yet): the UUID and the VBIOS version are placeholders
    (fixtures.uninitialize_gpus). Returns the files changed."""
    return fixtures.uninitialize_gpus(root)


UNINITIALIZED_UUID = fixtures.UNINITIALIZED_UUID
UNINITIALIZED_VBIOS = fixtures.UNINITIALIZED_VBIOS

# NVIDIA/nvidia-persistenced init/systemd/nvidia-persistenced.service.template with the user
# the Gentoo ebuild (Flatcar's) puts in (`sed s/__USER__/nvpd/`).
PERSISTENCED_UNIT = """\
[Unit]
Description=NVIDIA Persistence Daemon
Wants=syslog.target
IgnoreOnIsolate=true

[Service]
Type=forking
ExecStart=/usr/bin/nvidia-persistenced --user nvpd
ExecStopPost=/bin/rm -rf /var/run/nvidia-persistenced

[Install]
WantedBy=multi-user.target
"""


# -- helpers -------------------------------------------------------------------------------------


def install_libraries(directory: Path, libraries: Iterable[Library], *,
                      dev_link: bool = False) -> None:
    """The libraries in `directory` with the SONAME links `ldconfig -n` makes (and the
    libcuda.so link an install adds, with `dev_link`)."""
    directory.mkdir(parents=True, exist_ok=True)
    for lib in libraries:
        _place(lib.path, directory / lib.name)
    # ldconfig -n: only this directory, links only, no cache written (implies -N)
    subprocess.run(["ldconfig", "-n", str(directory)], check=True, capture_output=True,
                   timeout=60, env={**os.environ, "PATH": f"{os.environ.get('PATH', '')}:/sbin"})
    if dev_link and (directory / "libcuda.so.1").exists():
        _symlink(directory / "libcuda.so", "libcuda.so.1")


def _install_binaries(directory: Path, source: DriverSource, names: Iterable[str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        if name in source.binaries:
            _place(source.binaries[name], directory / name)


def _install_firmware(directory: Path, source: DriverSource) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for firmware in source.firmware:
        _place(firmware, directory / firmware.name)


def _install_modules(directory: Path, modules: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name in KO_NAMES:
        if (modules / name).is_file():
            _place(modules / name, directory / name)


def _merged_lib(root: Path) -> Path:
    """Where /lib's files go: /usr/lib on a merged-/usr root (Flatcar's /lib links there),
    made so when the fixture has no /lib yet; a /lib directory of the fixture is used as is."""
    lib = root / "lib"
    if not lib.exists() and not lib.is_symlink():
        (root / "usr/lib").mkdir(parents=True, exist_ok=True)
        lib.symlink_to("usr/lib")
    return lib


def _place(source: Path, target: Path) -> None:
    """A hard link to `source` (a copy across file systems); what was at `target` goes."""
    if target.is_symlink() or target.exists():
        target.unlink()
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _symlink(link: Path, target: str) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _is_elf64(path: Path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(5) == b"\x7fELF\x02"


# -- fixture nodes on the real files -------------------------------------------------------------

LAYOUTS = ("sysext", "nvidia.service", "prebuilt", "build")


def build_node(machine_name: str, root: Path, source: DriverSource, layout: str, *,
               state: str = "driver", modules: Path | None = None, flavour: str = "open",
               kernel: str | None = None, options: fixtures.Options | None = None) -> Path:
    """A fixture node (gpunode_testing.fixtures) whose driver is `source`'s real files in
    `layout` instead of driver_files' stand-ins: its /proc names the real version (and the
    modules' flavour), the stand-in libraries, binaries and firmware are gone. `kernel` is
    the node's running kernel (default: the fixtures' Flatcar kernel); `modules` (a directory
    of .ko files) is required by the prebuilt and build layouts. `options` (fixtures.Options)
    override `state`; their `extra` files are written too."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    if layout in ("prebuilt", "build") and modules is None:
        raise ValueError(f"the {layout} layout needs the modules")
    machine = _replace(fixtures.MACHINES[machine_name], driver_version=source.version,
                      open_modules=flavour == "open")
    kernel = kernel or fixtures.KERNEL
    options = options or fixtures.Options(state=state)
    osrelease = {"/proc/sys/kernel/osrelease": kernel + "\n"}
    fixtures.build(machine, root, _replace(options, extra={**options.extra, **osrelease}))
    _remove_stand_ins(root, source.version)
    if layout == "sysext":
        install_sysext(root, source, kernel=kernel, modules=modules, flavour=flavour)
    elif layout == "nvidia.service":
        install_nvidia_service(root, source, kernel=kernel, modules=modules)
    elif layout == "prebuilt":
        assert modules is not None
        install_prebuilt(root, source, kernel=kernel, modules=modules)
    else:
        assert modules is not None
        install_build_entry(root, source, kernel=kernel, flavour=flavour, modules=modules)
    return root


def _remove_stand_ins(root: Path, version: str) -> None:
    """What driver_files.write_userspace put in the fixture's sysext layout, gone."""
    lib64 = root / "usr/lib64"
    for name, suffix in driver_files.LIBRARIES.items():
        for file in (f"{name}.so.{version}", f"{name}.so.{suffix}", f"{name}.so"):
            if (lib64 / file).is_symlink() or (lib64 / file).exists():
                (lib64 / file).unlink()
    for name in driver_files.BINARIES:
        if (root / "usr/bin" / name).exists():
            (root / "usr/bin" / name).unlink()
    shutil.rmtree(root / "lib/firmware/nvidia" / version, ignore_errors=True)
