"""The driver root: where the loaded driver's user-space is (libraries, binaries, firmware).

Found once (`find`), recorded in the driver step's boot record (`record_fields`), read by
the rest (the CDI spec, `driver status`). Only files of the *loaded* driver's version count:
a library for another version (a stale install, a sysext of another branch) is never taken.

Which files (sources, read for their facts, no code copied):
- libraries: the compute and utility sets of libnvidia-container's `src/nvc_info.c`
  (`compute_libs`, `utility_libs`: libcuda, libnvidia-ml, …), each as
  `lib<name>.so.<version>`, the version-suffix rule of the NVIDIA container toolkit's CDI
  generator (`pkg/nvcdi/driver-nvml.go`, `getVersionLibs`: "*.so." + version). Only 64-bit
  ELF files: Gentoo's multilib puts the 32-bit copies in /usr/lib (the ebuild's COMPAT32).
- binaries: the toolkit's `newDriverBinariesDiscoverer` (same file) without the IMEX tools.
- firmware: `nvidia/<version>/gsp*.bin` in the kernel's firmware search path (the toolkit's
  `getFirmwareSearchPaths`: firmware_class.path, then /lib/firmware/updates/<kernel>,
  /lib/firmware/updates, /lib/firmware/<kernel>, /lib/firmware).
- the persistenced socket: /run/nvidia-persistenced/socket (`internal/discover/ipc.go`).

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

import stat
from dataclasses import dataclass
from typing import Any

from gpunode.config import DriverConfig
from gpunode.driver import cache
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
LIBRARIES = UTILITY_LIBRARIES + COMPUTE_LIBRARIES
REQUIRED = ("libcuda", "libnvidia-ml")  # without them there is no CUDA and no NVML
BINARIES = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control",
            "nvidia-cuda-mps-server")
PERSISTENCED_SOCKET = "/run/nvidia-persistenced/socket"
FIRMWARE_CLASS_PATH = "/sys/module/firmware_class/parameters/path"
KERNEL_FIRMWARE_DIRS = ("/lib/firmware/updates/{kernel}", "/lib/firmware/updates",
                        "/lib/firmware/{kernel}", "/lib/firmware")
_ELF64 = b"\x7fELF\x02"  # ELF magic and EI_CLASS = ELFCLASS64


@dataclass(frozen=True)
class DriverRoot:
    """Where the loaded driver's user-space is: the files of its own version, and only those."""

    version: str                  # the loaded driver's version (driverinfo)
    root: str                     # host path it was found under ("/" or e.g. a prebuilt dir)
    libraries: tuple[str, ...]    # host paths of the versioned driver libraries, sorted
    binaries: tuple[str, ...]     # host paths of the driver's binaries present, sorted
    firmware: tuple[str, ...]     # host paths of nvidia/<version>/gsp_*.bin present, sorted
    persistenced_socket: str | None = None  # /run/nvidia-persistenced/socket when present


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
    Layout("system", "/", ("/usr/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib"),
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
                version=version, root=root, libraries=tuple(sorted(libraries.values())),
                binaries=_binaries(host, bin_dirs, listed),
                firmware=_firmware(host, [_join(root, d.format(version=version))
                                          for d in layout.firmware], version, kernel, listed),
                persistenced_socket=_socket(host, PERSISTENCED_SOCKET))
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
            "persistenced_socket": found.persistenced_socket is not None}


def describe(found: DriverRoot) -> str:
    """One line for people: `driver status`."""
    return (f"{found.root} ({len(found.libraries)} libraries, {len(found.binaries)} binaries, "
            f"{len(found.firmware)} firmware files"
            + (", persistenced socket" if found.persistenced_socket else "") + ")")


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
               listed: set[str] | None = None) -> dict[str, str]:
    """name → host path of lib<name>.so.<version>, the first directory's winning (of those
    in `listed`, when given). Each name is looked up, not found in a listing: the library
    directories hold a thousand files or more, and listing them cost milliseconds of every
    boot (tens, the first time, through the overlay a system extension merges)."""
    found: dict[str, str] = {}
    suffix = f".so.{version}"
    for directory in dirs:
        for name in LIBRARIES:
            path = f"{directory}/{name}{suffix}"
            if name in found or (listed is not None and path not in listed) \
                    or not _exists(host, path):
                continue
            problem = _not_a_library(host, path)
            if problem:
                notes.append(f"{host.display(path)} {problem}")
            else:
                found[name] = path
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


def _not_a_library(host: Host, path: str) -> str | None:
    """Why `path` is no 64-bit shared library (a FIFO, a link out of the root, a 32-bit one)."""
    try:
        chunks = host.read_chunks(path, size=len(_ELF64))
        head = next(chunks, b"")
        chunks.close()  # type: ignore[attr-defined]
    except GpunodeError as exc:
        return f"is refused: {exc}"
    if head != _ELF64:
        return ("is a 32-bit library" if head[:4] == _ELF64[:4]
                else "is not an ELF shared library")
    return None


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


def _socket(host: Host, path: str) -> str | None:
    try:
        st = host.stat(path)
    except GpunodeError:
        return None
    return path if st is not None and stat.S_ISSOCK(st.st_mode) else None
