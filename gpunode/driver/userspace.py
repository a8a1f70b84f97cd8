"""The driver root: where the loaded driver's user-space is (libraries, binaries, firmware).

Found once (`find`), recorded in the driver step's boot record (`record_fields`), read by
the rest (the CDI spec, `driver status`). Only files of the *loaded* driver's version count:
a library for another version (a stale install, a sysext of another branch) is never taken.

Which files (sources, read for their facts, no code copied):
- libraries: libnvidia-container's lists per NVIDIA_DRIVER_CAPABILITIES name
  (`src/nvc_info.c`: `utility_libs`, `compute_libs`, `video_libs`, `graphics_libs` with
  `graphics_libs_glvnd`, `ngx_libs`; "display" has none there), plus the toolkit's
  libnvidia-vulkan-producer (`internal/discover/graphics.go`), each as
  `lib<name>.so.<version>`, the version-suffix rule of the NVIDIA container toolkit's CDI
  generator (`pkg/nvcdi/driver-nvml.go`, `getVersionLibs`: "*.so." + version), with the
  SONAME each file names (driver/elf.py). Only 64-bit ELF shared objects: Gentoo's multilib
  puts the 32-bit copies in /usr/lib (the ebuild's COMPAT32); a file that is no readable
  ELF shared object, or names a SONAME that is not its own library's, is left out, named.
- binaries: the toolkit's `newDriverBinariesDiscoverer` (same file) without the IMEX tools.
- firmware: `nvidia/<version>/gsp*.bin` in the kernel's firmware search path (the toolkit's
  `getFirmwareSearchPaths`: firmware_class.path, then /lib/firmware/updates/<kernel>,
  /lib/firmware/updates, /lib/firmware/<kernel>, /lib/firmware).
- config files (the system layout only: the others ship none): the EGL vendor file, OptiX's
  nvoptix.bin, the Vulkan ICD and layer files, the X.Org snippets and the OpenCL ICD the
  toolkit's `newGraphicsConfigsDiscoverer` and `newVulkanConfigsDiscover` look for, in /etc,
  /usr/local/share and /usr/share (`root.Driver.Configs`), each mounted where it does.
- IPC: the persistenced and fabric-manager sockets in /run or /var/run, and the MPS pipe
  directory /tmp/nvidia-mps (`internal/discover/ipc.go`), when present.

Where (LAYOUTS, in the order tried; the first holding libcuda and libnvidia-ml of the version
is the driver root):
- `system` ("/"): the Flatcar driver sysext (flatcar/scripts `build_library/extra_sysexts.sh`
  builds `x11-drivers/nvidia-drivers` into it; the ebuild's `src_install` puts libraries in
  /usr/$(get_libdir) = /usr/lib64, `*_BINARY` in /usr/bin, firmware in
  /lib/firmware/nvidia/${PV}, which is /usr/lib/firmware on Flatcar's merged /usr — and
  `build_sysext` keeps only /usr), and the distributions' own library directories.
- `nvidia.service` (/opt/nvidia/<version>/<kernel>): Flatcar's own build
  (`x11-drivers/nvidia-drivers-service/files/bin/setup-nvidia`,
  `copy_nvidia_build_artifacts`): `*.so.*` in <root>/usr/lib64, binaries in /opt/bin, no
  firmware (it builds the proprietary modules only).
- `prebuilt` (<driver.prebuilt_dirs>/<kernel>): gpunode's own convention beside the modules:
  lib/ (or lib64/), bin/, firmware/nvidia/<version>/.
- `build` (/opt/gpunode/drivers/<kernel>/<version>-<flavour>): the `build` strategy's cache
  entry (driver/cache.py), which holds the user-space extracted from the same installer as its
  modules (driver/extracted.py) in lib/, bin/, firmware/nvidia/<version>/. Only an entry the
  cache finds usable counts (its manifest of this kernel and version, every file with its
  recorded sha256: a tampered libcuda is never mounted into a container), and of it only the
  files its manifest lists; an entry refused is named in the error.
Every read goes through the Host, so `--root` holds and a link out of the root is refused.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpunode.config import DriverConfig
from gpunode.driver import cache, elf
from gpunode.errors import DriverError, GpunodeError
from gpunode.gpu import driverinfo
from gpunode.platform import flatcar, kernelinfo
from gpunode.platform.host import Host

UTILITY_LIBRARIES = ("libnvidia-ml", "libnvidia-cfg", "libnvidia-nscq")
COMPUTE_LIBRARIES = (
    "libcuda", "libcudadebugger", "libnvidia-opencl", "libnvidia-gpucomp",
    "libnvidia-ptxjitcompiler", "libnvidia-fatbinaryloader", "libnvidia-allocator",
    "libnvidia-compiler", "libnvidia-pkcs11", "libnvidia-pkcs11-openssl3", "libnvidia-nvvm",
    "libnvidia-tileiras",
)
# The driver's libraries by NVIDIA_DRIVER_CAPABILITIES name (config.CDI_CAPABILITIES)
CAPABILITY_LIBRARIES: dict[str, tuple[str, ...]] = {
    "utility": UTILITY_LIBRARIES,
    "compute": COMPUTE_LIBRARIES,
    "video": ("libvdpau_nvidia", "libnvidia-encode", "libnvidia-opticalflow", "libnvcuvid"),
    "graphics": ("libnvidia-eglcore", "libnvidia-glcore", "libnvidia-tls", "libnvidia-glsi",
                 "libnvidia-fbc", "libnvidia-ifr", "libnvidia-rtcore", "libnvoptix",
                 "libGLX_nvidia", "libEGL_nvidia", "libGLESv2_nvidia", "libGLESv1_CM_nvidia",
                 "libnvidia-glvkspirv", "libnvidia-cbl", "libnvidia-vulkan-producer"),
    "ngx": ("libnvidia-ngx",),
    "display": (),  # nvc_info.c: "Display libraries are not needed"; its X.Org files: CONFIGS
}
ALL_LIBRARIES = tuple(name for names in CAPABILITY_LIBRARIES.values() for name in names)
# What the build strategy extracts from the installer (driver/build.py, extracted.py)
LIBRARIES = UTILITY_LIBRARIES + COMPUTE_LIBRARIES
REQUIRED = ("libcuda", "libnvidia-ml")  # without them there is no CUDA and no NVML
BINARIES = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control",
            "nvidia-cuda-mps-server")
BINARY_CAPABILITY = {"nvidia-smi": "utility", "nvidia-debugdump": "utility",  # nvc_info.c
                     "nvidia-persistenced": "utility", "nvidia-cuda-mps-control": "compute",
                     "nvidia-cuda-mps-server": "compute"}
# (path under a config directory, where it is mounted in the container, capability)
CONFIGS = (
    *((f, "/usr/share", "graphics") for f in (
        "glvnd/egl_vendor.d/10_nvidia.json", "nvidia/nvoptix.bin")),
    *((f, "/usr/share", "display") for f in (
        "X11/xorg.conf.d/10-nvidia.conf", "X11/xorg.conf.d/nvidia-drm-outputclass.conf")),
    ("OpenCL/vendors/nvidia.icd", "/etc", "compute"),
    *((f, "/etc", "graphics") for f in (
        "vulkan/icd.d/nvidia_icd.json", "vulkan/icd.d/nvidia_layers.json",
        "vulkan/implicit_layer.d/nvidia_layers.json", "vulkan/icd.d/nvidia_icd.x86_64.json")),
)
CONFIG_DIRS = ("/etc", "/usr/local/share", "/usr/share")
PERSISTENCED_SOCKET = "/run/nvidia-persistenced/socket"
FABRICMANAGER_SOCKET = "/run/nvidia-fabricmanager/socket"
MPS_PIPE_DIR = "/tmp/nvidia-mps"
FIRMWARE_CLASS_PATH = "/sys/module/firmware_class/parameters/path"
KERNEL_FIRMWARE_DIRS = ("/lib/firmware/updates/{kernel}", "/lib/firmware/updates",
                        "/lib/firmware/{kernel}", "/lib/firmware")


@dataclass(frozen=True)
class DriverRoot:
    """Where the loaded driver's user-space is: the files of its own version, and only those."""

    version: str                  # the loaded driver's version (driverinfo)
    root: str                     # host path it was found under ("/" or e.g. a prebuilt dir)
    libraries: tuple[str, ...]    # host paths of the versioned driver libraries, sorted
    binaries: tuple[str, ...]     # host paths of the driver's binaries present, sorted
    firmware: tuple[str, ...]     # host paths of nvidia/<version>/gsp_*.bin present, sorted
    persistenced_socket: str | None = None  # /run/nvidia-persistenced/socket when present
    sonames: dict[str, str] = field(default_factory=dict)  # library → its DT_SONAME
    configs: tuple[ConfigFile, ...] = ()  # the config files present (CONFIGS)
    fabricmanager_socket: str | None = None  # /run/nvidia-fabricmanager/socket when present
    mps_pipe_dir: str | None = None  # /tmp/nvidia-mps when present


@dataclass(frozen=True)
class ConfigFile:
    """A config file of the driver's and where a container gets it."""

    path: str            # host path
    container_path: str  # where the toolkit mounts it
    capability: str


def capability(path: str) -> str | None:
    """The capability (CAPABILITY_LIBRARIES) of a library file or binary, by its name."""
    name = path.rpartition("/")[2]
    if name in BINARY_CAPABILITY:
        return BINARY_CAPABILITY[name]
    stem = name.split(".so", 1)[0]
    return next((c for c, names in CAPABILITY_LIBRARIES.items() if stem in names), None)


@dataclass(frozen=True)
class Layout:
    """One place a driver's user-space lands. `root` may name {version}, {kernel}, {prebuilt};
    the directories are host paths, or relative to the root."""

    name: str
    root: str
    libraries: tuple[str, ...]
    binaries: tuple[str, ...]
    firmware: tuple[str, ...] = ()


LAYOUTS = (
    Layout("system", "/", ("/usr/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib",
                           # libvdpau_nvidia, where VDPAU looks (the toolkit looks there too)
                           "/usr/lib64/vdpau", "/usr/lib/x86_64-linux-gnu/vdpau"),
           ("/usr/bin", "/usr/sbin")),
    Layout(flatcar.NVIDIA_UNIT, "/opt/nvidia/{version}/{kernel}", ("usr/lib64",), ("/opt/bin",)),
    Layout("prebuilt", "{prebuilt}/{kernel}", ("lib", "lib64"), ("bin",),
           ("firmware/nvidia/{version}",)),
    Layout("build", cache.CACHE_ROOT + "/{kernel}/{version}-{flavour}", ("lib",), ("bin",),
           ("firmware/nvidia/{version}",)),
)


def find(host: Host, version: str, *,
         prebuilt_dirs: tuple[str, ...] = DriverConfig.prebuilt_dirs) -> DriverRoot:
    """The user-space of the loaded driver `version`: the first layout (LAYOUTS) with libcuda
    and libnvidia-ml of that version. Raises DriverError naming where it looked (and what it
    found for other versions, or refused) when none has them."""
    try:
        kernel: str | None = kernelinfo.release(host)
    except DriverError:
        kernel = None  # the layouts keyed by kernel cannot be looked in; the message says so
    looked: list[str] = []
    notes: list[str] = []
    for layout, root in _roots(prebuilt_dirs, version, kernel):
        dirs = [_join(root, d) for d in layout.libraries]
        listed: set[str] | None = None  # a cache entry: only the files its manifest lists
        if layout.name == "build":
            if not _exists(host, root):
                continue
            listed = _entry_files(host, root, kernel or "", version, notes)
            if listed is None:
                continue
        looked += dirs
        libraries = _libraries(host, dirs, version, notes, listed)
        if all(name in libraries for name in REQUIRED):
            bin_dirs = [_join(root, d) for d in layout.binaries]
            return DriverRoot(
                version=version, root=root,
                libraries=tuple(sorted(path for path, _ in libraries.values())),
                binaries=_binaries(host, bin_dirs, listed),
                firmware=_firmware(host, [_join(root, d.format(version=version))
                                          for d in layout.firmware], version, kernel, listed),
                persistenced_socket=_ipc(host, PERSISTENCED_SOCKET, stat.S_ISSOCK),
                sonames={path: soname for path, soname in sorted(libraries.values()) if soname},
                configs=_configs(host) if layout.name == "system" else (),
                fabricmanager_socket=_ipc(host, FABRICMANAGER_SOCKET, stat.S_ISSOCK),
                mps_pipe_dir=_ipc(host, MPS_PIPE_DIR, stat.S_ISDIR))
        _other_versions(host, dirs, version, notes)
        if libraries:
            notes.append(f"{host.display(root)} has {len(libraries)} of its libraries but not "
                         f"{' or '.join(n for n in REQUIRED if n not in libraries)}")
    if kernel is None:
        notes.append("the running kernel is unknown, so /opt/nvidia/<version>/<kernel> and "
                     "the prebuilt directories were not looked in")
    wanted = " and ".join(f"{name}.so.{version}" for name in REQUIRED)
    raise DriverError(
        f"NVIDIA {version} is loaded, but its user-space is missing: {wanted} are in none "
        f"of {', '.join(host.display(d) for d in looked)}"
        + (f" ({'; '.join(dict.fromkeys(notes))})" if notes else ""),
        f"install the user-space of driver {version} with its modules: the Flatcar driver "
        f"sysext ships it in /usr/lib64, Flatcar's {flatcar.NVIDIA_UNIT} in /opt/nvidia/<version>/"
        "<kernel>/usr/lib64, a driver.prebuilt_dirs directory in <dir>/<kernel>/lib; a "
        "library of another version means the user-space and the loaded modules differ "
        "(reboot after a driver update); a driver.strategy = \"build\" node has it in its "
        f"cache entry ({cache.CACHE_ROOT}/<kernel>/<version>-<flavour>/lib): an entry "
        "refused or built by an older gpunode without it is rebuilt by 'gpunode driver "
        "build'")


def loaded_root(host: Host, prebuilt_dirs: tuple[str, ...] = DriverConfig.prebuilt_dirs,
                ) -> tuple[DriverRoot | None, str | None]:
    """The loaded driver's user-space, or why there is none (for `driver status`)."""
    try:
        version = driverinfo.parse_version(
            host.read_optional(f"{driverinfo.PROC_NVIDIA}/version") or "")
        if version is None:
            return None, "no NVIDIA driver is loaded"
        return find(host, version.version, prebuilt_dirs=prebuilt_dirs), None
    except GpunodeError as exc:
        return None, f"{exc}" + (f" ({exc.hint})" if exc.hint else "")


def system_versions(host: Host) -> tuple[str, ...]:
    """The driver versions whose libcuda the system's library directories hold (the `system`
    layout: the Flatcar driver sysext's and the distributions' place), sorted: what a node
    whose loaded driver has no user-space of its own has instead (`gpunode metrics`)."""
    found: set[str] = set()
    for directory in LAYOUTS[0].libraries:
        for entry in _entries(host, directory, []):
            version = _other_version(entry)
            if version is not None and entry.startswith("libcuda."):
                found.add(version)
    return tuple(sorted(found))


def record_fields(found: DriverRoot) -> dict[str, Any]:
    """The boot record's `driver_root`: where, and how many of each (not every path)."""
    return {"root": found.root, "libraries": len(found.libraries),
            "binaries": len(found.binaries), "firmware": len(found.firmware),
            "configs": len(found.configs),
            "persistenced_socket": found.persistenced_socket is not None,
            "fabricmanager_socket": found.fabricmanager_socket is not None,
            "mps_pipe_dir": found.mps_pipe_dir is not None}


def describe(found: DriverRoot) -> str:
    """One line for people: `driver status`."""
    ipc = [what for what, there in (("persistenced socket", found.persistenced_socket),
                                    ("fabric-manager socket", found.fabricmanager_socket),
                                    ("MPS pipe directory", found.mps_pipe_dir)) if there]
    return (f"{found.root} ({len(found.libraries)} libraries, {len(found.binaries)} binaries, "
            f"{len(found.firmware)} firmware files"
            + (f", {len(found.configs)} config files" if found.configs else "")
            + "".join(f", {what}" for what in ipc) + ")")


# -- the search ----------------------------------------------------------------------------------


def _roots(prebuilt_dirs: tuple[str, ...], version: str,
           kernel: str | None) -> list[tuple[Layout, str]]:
    roots: list[tuple[Layout, str]] = []
    for layout in LAYOUTS:
        if "{kernel}" in layout.root and kernel is None:
            continue
        bases = prebuilt_dirs if "{prebuilt}" in layout.root else ("",)
        flavours = cache.FLAVOUR_SOURCES if "{flavour}" in layout.root else ("",)
        roots += [(layout, layout.root.format(version=version, kernel=kernel, flavour=flavour,
                                              prebuilt=base.rstrip("/")))
                  for base in bases for flavour in flavours]
    return roots


def _entry_files(host: Host, root: str, kernel: str, version: str,
                 notes: list[str]) -> set[str] | None:
    """The host paths of the user-space a usable cache entry lists; None (and a note saying
    why) for an entry the cache refuses: a tampered, missing or modules-only one."""
    flavour = root.rpartition("-")[2]
    try:
        entry, problem = cache.check_entry(host, root, kernel, version, flavour)
    except GpunodeError as exc:
        entry, problem = None, str(exc)
    if entry is None:
        notes.append(f"the build cache entry {host.display(root)} is refused: {problem}")
        return None
    return {f"{root}/{rel}" for rel in entry.manifest["userspace"]}


def _exists(host: Host, path: str) -> bool:
    try:
        return host.lstat(path) is not None
    except GpunodeError:
        return False


def _join(root: str, path: str) -> str:
    return path if path.startswith("/") else f"{root.rstrip('/')}/{path}"


def _libraries(host: Host, dirs: list[str], version: str, notes: list[str],
               listed: set[str] | None = None) -> dict[str, tuple[str, str | None]]:
    """name → (host path of lib<name>.so.<version>, its SONAME), the first directory's
    winning (of those in `listed`, when given). Each name is looked up, not found in a
    listing: the library directories hold a thousand files or more, and listing them cost
    milliseconds of every boot (tens, the first time, through the overlay a system extension
    merges)."""
    found: dict[str, tuple[str, str | None]] = {}
    suffix = f".so.{version}"
    for directory in dirs:
        for name in ALL_LIBRARIES:
            path = f"{directory}/{name}{suffix}"
            if name in found or (listed is not None and path not in listed) \
                    or not _exists(host, path):
                continue
            soname, problem = _read_library(host, path, name)
            if problem:
                notes.append(f"{host.display(path)} {problem}")
            else:
                found[name] = (path, soname)
    return found


def _other_versions(host: Host, dirs: list[str], version: str, notes: list[str]) -> None:
    """Why a layout without the libraries may still matter: the required ones of another
    driver version in its directories (a stale install, or modules and user-space that
    differ), each named in `notes`. Only listed when the version's own are missing."""
    for directory in dirs:
        for entry in _entries(host, directory, notes):
            if (other := _other_version(entry)) and other != version:
                notes.append(f"{host.display(directory)} has {entry} ({other}, not {version})")


def _other_version(entry: str) -> str | None:
    """The version of a required library of another driver ('libcuda.so.535.104.05')."""
    for name in REQUIRED:
        rest = entry.removeprefix(f"{name}.so.")
        if rest != entry and rest.count(".") >= 1 and rest.replace(".", "").isdigit():
            return rest
    return None


# What each library file said, by the file's identity: the watch regenerates the spec every
# pass, and a file whose inode, size and mtime are the same need not be parsed again.
_READ: dict[tuple[int, int, int, int], elf.Library] = {}


def _read_library(host: Host, path: str, name: str) -> tuple[str | None, str | None]:
    """(its SONAME, None) for a 64-bit shared library of `name`; (None, why not) for
    anything else: a FIFO, a link out of the root, a 32-bit copy, a file no ELF reader can
    read, or one naming another library's SONAME (which would shadow that library, libc.so.6
    say, in a container that searches the driver's directory first)."""
    try:
        with host.open_file(path) as stream:
            st = os.fstat(stream.fileno())
            key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            library = _READ.get(key) or _READ.setdefault(key, elf.read(stream))
    except GpunodeError as exc:
        return None, f"is refused: {exc}"
    except elf.NotALibrary as exc:
        return None, str(exc)
    if library.bits != 64:
        return None, "is a 32-bit library"
    if library.soname is not None and not library.soname.startswith(f"{name}.so"):
        return None, f"names the SONAME {library.soname!r}, not one of {name}'s"
    return library.soname, None


def _binaries(host: Host, dirs: list[str], listed: set[str] | None = None) -> tuple[str, ...]:
    found: dict[str, str] = {}
    for directory in dirs:
        for name in BINARIES:  # looked up, as the libraries are (/usr/bin: a thousand files)
            path = f"{directory}/{name}"
            if listed is not None and path not in listed:
                continue
            if name not in found and _executable(host, path):
                found[name] = path
    return tuple(sorted(found.values()))


def _firmware(host: Host, own: list[str], version: str, kernel: str | None,
              listed: set[str] | None = None) -> tuple[str, ...]:
    """gsp*.bin of the version: the layout's own directories (only the `listed` files of
    them, when given), then the kernel's search path (firmware_class.path first), each file
    name once, and a directory reached twice (/lib is /usr/lib on Flatcar) once."""
    dirs = list(own)
    try:
        custom = (host.read_optional(FIRMWARE_CLASS_PATH) or "").strip()
    except GpunodeError:
        custom = ""
    if custom.startswith("/"):
        dirs.append(f"{custom.rstrip('/')}/nvidia/{version}")
    dirs += [f"{d.format(kernel=kernel)}/nvidia/{version}" for d in KERNEL_FIRMWARE_DIRS
             if kernel is not None or "{kernel}" not in d]
    found: dict[str, str] = {}
    seen: set[str] = set()
    for directory in dirs:
        try:
            real = host.real(directory)
        except GpunodeError:
            continue
        if real in seen:
            continue
        seen.add(real)
        for entry in _entries(host, directory, []):
            path = f"{directory}/{entry}"
            if listed is not None and directory in own and path not in listed:
                continue
            if (entry.startswith("gsp") and entry.endswith(".bin") and entry not in found
                    and _regular(host, path)):
                found[entry] = path
    return tuple(sorted(found.values()))


def _entries(host: Host, directory: str, notes: list[str]) -> list[str]:
    try:
        return host.list_dir(directory)
    except GpunodeError as exc:
        notes.append(str(exc))
        return []


def _regular(host: Host, path: str) -> bool:
    try:
        st = host.stat(path)
    except GpunodeError:
        return False
    return st is not None and stat.S_ISREG(st.st_mode)


def _executable(host: Host, path: str) -> bool:
    try:
        return host.is_executable_file(path)
    except GpunodeError:
        return False


def _ipc(host: Host, path: str, kind: Callable[[int], bool]) -> str | None:
    """`path` (or the same under /var/run, where the toolkit looks next) when it is there,
    of `kind` (a socket, a directory) and itself, not a link; in /tmp also root's. These are
    mounted writable into every GPU container, and /tmp is anyone's: a /tmp/nvidia-mps that
    another user made, or a link there to somewhere else, would hand containers that place.
    (In /run only root makes entries; persistenced's socket may be its --user's.)"""
    for candidate in (path, path.replace("/run/", "/var/run/", 1)) if path.startswith(
            "/run/") else (path,):
        try:
            st = host.lstat(candidate)
        except GpunodeError:
            continue
        if st is not None and kind(st.st_mode) and (
                st.st_uid == 0 or not candidate.startswith("/tmp/")):
            return candidate
    return None


def _configs(host: Host) -> tuple[ConfigFile, ...]:
    """The config files of CONFIGS that are there, each the first found in CONFIG_DIRS."""
    found = []
    for rel, inside, what in CONFIGS:
        path = next((f"{d}/{rel}" for d in CONFIG_DIRS if _regular(host, f"{d}/{rel}")), None)
        if path is not None:
            found.append(ConfigFile(path, f"{inside}/{rel}", what))
    return tuple(found)
