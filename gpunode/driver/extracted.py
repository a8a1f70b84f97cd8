"""What a build extracted from NVIDIA's installer, checked before it enters the cache.

build.sh (run by the builder) unpacks the installer with `--extract-only` and copies into the
staging entry, next to the modules:
- `lib/`: `lib<name>.so.<driver>` for each name in driver/userspace.py's LIBRARIES that the
  installer has (the 64-bit copies at the top of the extracted tree; the 32-bit ones are in
  its `32/` directory and are not taken), plus their SONAME links, made by `ldconfig -n lib/`
  exactly as ldconfig makes them on an installed system;
- `bin/`: the binaries of userspace.BINARIES the installer has;
- `firmware/nvidia/<driver>/`: the installer's `firmware/gsp_*.bin`.

That layout of the extracted installer, and where an install puts each part, is what Flatcar's
own packaging reads (flatcar/scripts, commit ab6d76d): the nvidia-drivers ebuild
(sdk_container/src/third_party/portage-stable/x11-drivers/nvidia-drivers/, `src_install`)
installs from the extracted tree's `.manifest`, FIRMWARE files into /lib/firmware/nvidia/${PV}
and COMPAT32 libraries only for the 32-bit ABI; Flatcar's nvidia.service
(coreos-overlay/x11-drivers/nvidia-drivers-service/files/bin/setup-nvidia,
`copy_nvidia_build_artifacts`) copies `*.so.*` and nvidia-smi, nvidia-debugdump,
nvidia-persistenced, nvidia-cuda-mps-* from the top of the extracted tree.

`collect` trusts nothing the builder left: every entry is looked at without following links;
a library must be a regular 64-bit ELF file of a listed name and the driver's version, a link
must name a library beside it, a binary or firmware file must be a regular file; a FIFO, a
device, a link elsewhere or a file larger than any driver file is refused, as is a build
without libcuda and libnvidia-ml (an installer of another version), or open modules without
their GSP firmware. The cache manifest then records the sha256 of every file and every link's
target (driver/cache.py). Every read goes through the Host.
"""

from __future__ import annotations

import os
import stat

from gpunode.driver import cache, userspace
from gpunode.errors import ExtractedFileError, GpunodeError
from gpunode.platform.host import Host

_ELF64 = b"\x7fELF\x02"  # ELF magic and EI_CLASS = ELFCLASS64


def collect(host: Host, staging: str, driver: str, flavour: str,
            hint: str = "") -> tuple[dict[str, str], dict[str, str]]:
    """({path in the entry: sha256} of the user-space files, {link path: target} of the
    SONAME links) the builder left in `staging`; ExtractedFileError for anything else."""
    files: dict[str, str] = {}
    links: dict[str, str] = {}
    firmware = f"firmware/nvidia/{driver}"
    allowed = {"lib": _library_names(driver), "bin": set(userspace.BINARIES)}
    for directory in ("lib", "bin"):
        for name in _names(host, staging, directory, hint):
            rel = f"{directory}/{name}"
            st = _lstat(host, staging, rel, hint)
            if directory == "lib" and stat.S_ISLNK(st.st_mode):
                links[rel] = _link_target(host, staging, rel, hint)
                continue
            _require_regular(st, rel, hint)
            if name not in allowed[directory]:
                raise _refused(rel, f"is not a file gpunode extracts (the {directory}/ names "
                               f"are those of driver/userspace.py, of version {driver})", hint)
            if directory == "lib":
                _require_elf64(host, f"{staging}/{rel}", rel, hint)
            files[rel] = host.digest(f"{staging}/{rel}", "sha256")
    for rel, target in links.items():
        if f"lib/{target}" not in files:
            raise _refused(rel, f"links to {target!r}, which is no library in lib/", hint)
    for name in _names(host, staging, "firmware", hint):
        if name != "nvidia":
            raise _refused(f"firmware/{name}", f"is not {firmware}/", hint)
    for name in _names(host, staging, "firmware/nvidia", hint):
        if name != driver:
            raise _refused(f"firmware/nvidia/{name}", f"is not {firmware}/", hint)
    for name in _names(host, staging, firmware, hint):
        rel = f"{firmware}/{name}"
        _require_regular(_lstat(host, staging, rel, hint), rel, hint)
        if not (name.startswith("gsp") and name.endswith(".bin")
                and cache.is_name(name)):
            raise _refused(rel, "is not GSP firmware (gsp*.bin)", hint)
        files[rel] = host.digest(f"{staging}/{rel}", "sha256")
    _require_complete(files, driver, flavour, hint)
    return files, links


def directories(files: dict[str, str]) -> list[str]:
    """The directories of the entry holding these files, deepest first (to fsync)."""
    dirs = {rel.rpartition("/")[0] for rel in files}
    dirs |= {d.rpartition("/")[0] for d in list(dirs) if "/" in d}
    dirs |= {"firmware"} if any(d.startswith("firmware/") for d in dirs) else set()
    return sorted(dirs, key=lambda d: (-d.count("/"), d))


def _library_names(driver: str) -> set[str]:
    return {f"{name}.so.{driver}" for name in userspace.LIBRARIES}


def _require_complete(files: dict[str, str], driver: str, flavour: str, hint: str) -> None:
    missing = [f"{name}.so.{driver}" for name in cache.REQUIRED_LIBRARIES
               if f"lib/{name}.so.{driver}" not in files]
    if missing:
        raise _refused("lib", f"has no {' or '.join(missing)}", _installer_hint(driver, hint))
    if flavour == "open" and not any(rel.startswith("firmware/") for rel in files):
        raise _refused(f"firmware/nvidia/{driver}", "has no GSP firmware (gsp_*.bin), "
                       "without which the open modules cannot start a GPU",
                       _installer_hint(driver, hint))


def _names(host: Host, staging: str, directory: str, hint: str) -> list[str]:
    st: os.stat_result | None = _lstat(host, staging, directory, hint, missing_ok=True)
    if st is None:
        return []
    if not stat.S_ISDIR(st.st_mode):
        raise _refused(directory, "is not a directory", hint)
    try:
        return host.list_dir(f"{staging}/{directory}")
    except GpunodeError as exc:
        raise _refused(directory, f"cannot be listed ({exc})", hint) from exc


def _lstat(host: Host, staging: str, rel: str, hint: str,
           missing_ok: bool = False) -> os.stat_result:
    try:
        st = host.lstat(f"{staging}/{rel}")
    except GpunodeError as exc:
        raise _refused(rel, f"cannot be read ({exc})", hint) from exc
    if st is None and not missing_ok:
        raise _refused(rel, "vanished while it was checked", hint)
    return st  # type: ignore[return-value]  # None only where missing_ok asks for it


def _require_regular(st: os.stat_result, rel: str, hint: str) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise _refused(rel, "is a symlink: the build copies files, never links to elsewhere",
                       hint)
    if not stat.S_ISREG(st.st_mode):
        raise _refused(rel, "is not a regular file", hint)
    if st.st_size > cache.MAX_FILE_BYTES:
        raise _refused(rel, f"is {st.st_size} bytes, more than any driver file "
                       f"({cache.MAX_FILE_BYTES})", hint)


def _require_elf64(host: Host, path: str, rel: str, hint: str) -> None:
    try:
        chunks = host.read_chunks(path, size=len(_ELF64))
        head = next(chunks, b"")
        chunks.close()  # type: ignore[attr-defined]
    except GpunodeError as exc:
        raise _refused(rel, f"cannot be read ({exc})", hint) from exc
    if head != _ELF64:
        raise _refused(rel, "is a 32-bit library" if head[:4] == _ELF64[:4]
                       else "is not an ELF shared library", hint)


def _link_target(host: Host, staging: str, rel: str, hint: str) -> str:
    try:
        target = host.read_link(f"{staging}/{rel}")
    except GpunodeError as exc:
        raise _refused(rel, f"cannot be read ({exc})", hint) from exc
    name = rel.removeprefix("lib/")
    if target is None or "/" in target or not cache.is_name(target) \
            or not cache.is_name(name):
        raise _refused(rel, f"links to {target!r}: a SONAME link names a library beside it",
                       hint)
    return target


def _installer_hint(driver: str, hint: str) -> str:
    return (f"is driver.build.driver_url the installer of NVIDIA {driver}?"
            + (f" ({hint})" if hint else ""))


def _refused(rel: str, cause: str, hint: str) -> ExtractedFileError:
    return ExtractedFileError("cache extracted", rel, cause, hint=hint or "see the build's log")
