"""The kernel's firmware search path for the modules about to load.

nvidia.ko names the firmware it asks the kernel's loader for in its .modinfo (driver/modinfo.py):
`nvidia/<version>/gsp_tu10x.bin` and `gsp_ga10x.bin` for 550, in both flavours. The open
modules cannot start a GPU without it; the proprietary ones load it under their default GSP
policy (`NVreg_EnableGpuFirmware`) on the GPUs that support it, and run without it only when
that parameter is 0. The loader looks for each file in firmware_class.path first, then
/lib/firmware/updates/<kernel>, /lib/firmware/updates, /lib/firmware/<kernel> and /lib/firmware
(the kernel's Documentation/driver-api/firmware/fw_search_path.rst; the NVIDIA container
toolkit's `getFirmwareSearchPaths` searches the same). On Flatcar /lib/firmware is the
read-only /usr, so modules that bring their own firmware need the parameter: prebuilt modules
keep it beside them (`<dir>/<kernel>/firmware/nvidia/<version>/`), a build's cache entry in its
`firmware/` (driver/cache.py); a merged or baked driver sysext puts it in /lib/firmware itself.

Before the modules load, `plan` decides and `apply` writes
/sys/module/firmware_class/parameters/path (one value, written without a newline, as NixOS's
firmware module does with `echo -n`):
- nothing when the kernel finds every file the modules name already;
- the modules' own firmware directory when it has the missing files and the parameter is
  empty;
- a refusal (FirmwarePathError) when the parameter is someone else's: gpunode never overwrites
  another's setting (NVIDIA's driver container likewise keeps a path that is set: "A search
  path is already configured … Retaining the current configuration");
- a refusal (FirmwareMissing) naming the module and the file when nothing has it.
Through the Host: under --root the parameter is a file in the fixture tree.
"""

from __future__ import annotations

import stat
from collections.abc import Iterable
from dataclasses import dataclass

from gpunode import log
from gpunode.driver import userspace
from gpunode.driver.modinfo import ModuleInfo
from gpunode.errors import FirmwareMissing, FirmwarePathError, GpunodeError
from gpunode.platform.host import Host

PARAMETER = userspace.FIRMWARE_CLASS_PATH
GSP_OFF = "NVreg_EnableGpuFirmware=0"  # the proprietary modules' switch to run without GSP


@dataclass(frozen=True)
class FirmwarePath:
    """The firmware search path to set so that the kernel finds the firmware the modules name."""

    path: str  # what firmware_class.path is set to (a host path)
    names: tuple[str, ...]  # the files found only there, relative to it

    def describe(self) -> str:
        return (f"set the kernel's firmware search path ({PARAMETER}) to {self.path} (for "
                f"{', '.join(self.names)})")


def plan(host: Host, infos: Iterable[ModuleInfo], came_with: str | None, kernel: str,
         optional: bool = False) -> FirmwarePath | None:
    """What the modules about to load need so that the kernel finds their firmware: None when
    it does already (or `optional`: the proprietary modules told to run without GSP);
    the modules' own firmware directory `came_with` otherwise. FirmwarePathError when the
    parameter is someone else's; FirmwareMissing when nothing has a file."""
    wanted = {name: info.path for info in infos for name in info.firmware}
    if optional or not wanted:
        return None
    current = _parameter(host)
    searched = ([current] if current else []) + kernel_dirs(kernel)
    missing = [n for n in wanted if not any(_has(host, d, n) for d in searched)]
    if not missing:
        return None
    if came_with is None or not all(_has(host, came_with, n) for n in missing):
        name = next(n for n in missing if came_with is None or not _has(host, came_with, n))
        where = ", ".join(host.display(d) for d in searched + ([came_with] if came_with else []))
        raise FirmwareMissing(
            f"{host.display(wanted[name])} names the firmware {name}, which is in none of "
            f"{where}", "ship the firmware with the modules (firmware/nvidia/<version>/ beside "
            "them) or put it where the kernel looks; the proprietary modules run without it "
            f"with driver.module_params.nvidia = \"{GSP_OFF}\"")
    _require_settable(host, current, came_with, missing[0],
                      f"{host.display(wanted[missing[0]])} names the firmware {missing[0]}")
    return FirmwarePath(came_with, tuple(sorted(missing)))


def plan_build(host: Host, entry: str, version: str, kernel: str) -> FirmwarePath | None:
    """Before a build: the search path its modules will need for their GSP firmware (decided
    again once they exist and say which files they name), refused now, not after minutes of
    compiling, when the parameter is someone else's."""
    current = _parameter(host)
    if any(_has_gsp(host, f"{d}/nvidia/{version}")
           for d in ([current] if current else []) + kernel_dirs(kernel)):
        return None
    name = f"nvidia/{version}/gsp_*.bin"
    _require_settable(host, current, f"{entry}/firmware", name,
                      f"the modules of NVIDIA {version} name their GSP firmware {name}")
    return FirmwarePath(f"{entry}/firmware", (f"nvidia/{version}/gsp_*.bin",))


def apply(host: Host, wanted: FirmwarePath) -> None:
    """Point the kernel's firmware search at the modules' firmware."""
    host.write_attribute(PARAMETER, wanted.path.encode())
    log.get().info("driver.firmware_path_set", parameter=PARAMETER, path=wanted.path,
                   firmware=list(wanted.names))


def kernel_dirs(kernel: str) -> list[str]:
    """The kernel's own firmware directories, in its search order."""
    return [d.format(kernel=kernel) for d in userspace.KERNEL_FIRMWARE_DIRS]


def _require_settable(host: Host, current: str | None, came_with: str, name: str,
                      what: str) -> None:
    """FirmwarePathError unless gpunode may point the parameter at `came_with`: the kernel has
    it, and it is empty or `came_with` already."""
    if current is None:
        raise FirmwarePathError(
            f"{what}, which only {host.display(came_with)} has, and this kernel has no "
            f"firmware search path parameter ({host.display(PARAMETER)})",
            f"copy {came_with}/{name.rpartition('/')[0]} to /lib/firmware/"
            f"{name.rpartition('/')[0]}, where the kernel looks, or use a kernel with the "
            "firmware loader (firmware_class)")
    if current and current != came_with:
        log.get().warning("driver.firmware_path_taken", parameter=PARAMETER, value=current,
                          wanted=came_with)
        raise FirmwarePathError(
            f"{what}, which only {host.display(came_with)} has, but the kernel's firmware "
            f"search path ({host.display(PARAMETER)}) is already set to {current}; gpunode "
            "does not overwrite it",
            f"clear it (write an empty value to {PARAMETER}, or drop firmware_class.path= "
            f"from the kernel command line), or copy {came_with}/{name.rpartition('/')[0]} "
            f"under {current}")


def _parameter(host: Host) -> str | None:
    """firmware_class.path: its value (empty when unset), None when the kernel has none."""
    try:
        current = host.read_optional(PARAMETER)
    except GpunodeError as exc:
        raise FirmwarePathError(f"cannot read the kernel's firmware search path: {exc}") from exc
    return None if current is None else current.strip()


def _has(host: Host, directory: str, name: str) -> bool:
    """Whether `directory` has the firmware file `name` (a relative path without '..')."""
    parts = name.split("/")
    if name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        return False
    try:
        st = host.stat(f"{directory}/{name}")
    except GpunodeError:
        return False
    return st is not None and stat.S_ISREG(st.st_mode)


def _has_gsp(host: Host, directory: str) -> bool:
    try:
        return any(n.startswith("gsp") and n.endswith(".bin") and _has(host, directory, n)
                   for n in host.list_dir(directory))
    except GpunodeError:
        return False
