"""The kernel's firmware search path for the open modules of a build.

The open kernel modules cannot start a GPU without its GSP firmware: nvidia.ko asks the
kernel's firmware loader for `nvidia/<version>/gsp_<chip>.bin` (the open modules' sources:
`NV_FIRMWARE_PATH_FOR_FILENAME(f)` = "nvidia/" NV_VERSION_STRING "/" f in
kernel-open/nvidia/nv.c, the chip's file name from nv-firmware.h). The loader looks in
firmware_class.path first, then /lib/firmware/updates/<kernel>, /lib/firmware/updates,
/lib/firmware/<kernel> and /lib/firmware (the kernel's
Documentation/driver-api/firmware/fw_search_path.rst). On Flatcar /lib/firmware is the
read-only /usr, so Flatcar's own nvidia.service builds the proprietary modules only ("TODO:
open requires firmware loading", flatcar/scripts,
coreos-overlay/x11-drivers/nvidia-drivers-service/files/bin/install-nvidia).

A build's cache entry holds `firmware/nvidia/<version>/gsp_*.bin` (driver/cache.py), so the
entry's `firmware/` directory is a search path the loader can use. Before the open modules of
a cache entry are loaded, `plan` decides, and `apply` writes
/sys/module/firmware_class/parameters/path (one value, written without a newline, as NixOS's
firmware module does with `echo -n`):
- nothing when the kernel already finds the firmware of the version (its search path has it);
- the entry's firmware/ when the parameter is empty;
- a refusal (FirmwarePathError) when someone else set it to a place without the firmware:
  gpunode never overwrites another's setting.
Through the Host: under --root the parameter is a file in the fixture tree.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass

from gpunode import log
from gpunode.driver import userspace
from gpunode.errors import DriverError, FirmwarePathError, GpunodeError
from gpunode.platform.host import Host

PARAMETER = userspace.FIRMWARE_CLASS_PATH


@dataclass(frozen=True)
class FirmwarePath:
    """The firmware search path to set so that the kernel finds the open modules' GSP firmware."""

    path: str  # what firmware_class.path is set to: the entry's firmware/ (a host path)
    version: str

    def describe(self) -> str:
        return (f"set the kernel's firmware search path ({PARAMETER}) to {self.path} (the GSP "
                f"firmware nvidia/{self.version}/gsp_*.bin of the open modules)")


def plan(host: Host, entry: str, version: str, kernel: str | None,
         built: bool = True) -> FirmwarePath | None:
    """What the open modules of the cache entry `entry` need before they load; None when the
    kernel finds their firmware already. `built`: the entry exists (else a build makes it
    first, and its firmware is checked then). FirmwarePathError when the path is taken."""
    target = f"{entry}/firmware"
    if _kernel_finds(host, version, kernel):
        return None
    try:
        current = host.read_optional(PARAMETER)
    except GpunodeError as exc:
        raise FirmwarePathError(f"cannot read the kernel's firmware search path: {exc}",
                                _HINT.format(version=version)) from exc
    if current is None:
        raise FirmwarePathError(
            f"the open modules of NVIDIA {version} need their GSP firmware, and this kernel "
            f"has no firmware search path parameter ({host.display(PARAMETER)})",
            _HINT.format(version=version))
    current = current.strip()
    if current == target or (current and _has_gsp(host, f"{current}/nvidia/{version}")):
        return None  # already ours, or someone else's that has the firmware
    if current:
        log.get().warning("driver.firmware_path_taken", parameter=PARAMETER, value=current,
                          wanted=target)
        raise FirmwarePathError(
            f"the open modules of NVIDIA {version} need their GSP firmware from {target}, but "
            f"the kernel's firmware search path ({host.display(PARAMETER)}) is already set to "
            f"{current}, which has no nvidia/{version}/gsp_*.bin; gpunode does not overwrite it",
            f"clear it (write an empty value to {PARAMETER}, or drop firmware_class.path= "
            f"from the kernel command line) or copy {target}/nvidia/{version} under {current}")
    if built and not _has_gsp(host, f"{target}/nvidia/{version}"):
        raise DriverError(f"the cache entry {host.display(entry)} has no GSP firmware in "
                          f"firmware/nvidia/{version}", "rebuild it: gpunode driver build")
    return FirmwarePath(target, version)


def apply(host: Host, wanted: FirmwarePath) -> None:
    """Point the kernel's firmware search at the entry, unless something changed since the
    plan (planned again: the same refusals)."""
    host.write_attribute(PARAMETER, wanted.path.encode())
    log.get().info("driver.firmware_path_set", parameter=PARAMETER, path=wanted.path)


_HINT = ("put the GSP firmware (the entry's firmware/nvidia/{version}) where the kernel looks "
         "(/lib/firmware/nvidia/{version}), or use the proprietary modules "
         "(driver.flavour = \"proprietary\")")


def _kernel_finds(host: Host, version: str, kernel: str | None) -> bool:
    return any(_has_gsp(host, f"{d.format(kernel=kernel)}/nvidia/{version}")
               for d in userspace.KERNEL_FIRMWARE_DIRS if kernel is not None or "{kernel}" not in d)


def _has_gsp(host: Host, directory: str) -> bool:
    try:
        for name in host.list_dir(directory):
            st = host.stat(f"{directory}/{name}")
            if name.startswith("gsp") and name.endswith(".bin") and st is not None \
                    and stat.S_ISREG(st.st_mode):
                return True
    except GpunodeError:
        return False
    return False
