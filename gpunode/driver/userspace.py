"""The driver's user-space on the node (a "driver root"): libraries, binaries, GSP firmware.

A small finder for the CDI spec (gpunode/cdi.py): the versioned compute and utility libraries
in the usual library directories, nvidia-smi and friends, and the firmware of this driver
version. Only what it finds is recorded; libcuda and libnvidia-ml are required.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpunode.errors import DriverError
from gpunode.host import Host

LIB_DIRS = ("/usr/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib")
BIN_DIRS = ("/usr/bin", "/opt/bin")
LIBRARIES = ("libcuda", "libnvidia-ml", "libnvidia-ptxjitcompiler", "libnvidia-nvvm")
REQUIRED = ("libcuda", "libnvidia-ml")
BINARIES = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control",
            "nvidia-cuda-mps-server")
PERSISTENCED_SOCKET = "/run/nvidia-persistenced/socket"


@dataclass(frozen=True)
class DriverRoot:
    version: str
    root: str
    libraries: tuple[str, ...]  # host paths of versioned libs (lib*.so.<version>), sorted
    binaries: tuple[str, ...]  # host paths of nvidia-smi etc., sorted
    firmware: tuple[str, ...]  # host paths of gsp_*.bin, sorted
    persistenced_socket: str | None = None


def find(host: Host, version: str) -> DriverRoot:
    libraries: dict[str, str] = {}
    for name in LIBRARIES:
        for directory in LIB_DIRS:
            path = f"{directory}/{name}.so.{version}"
            if host.stat(path) is not None:
                libraries[name] = path
                break
    missing = [name for name in REQUIRED if name not in libraries]
    if missing:
        raise DriverError(f"the driver's user-space for {version} is not on the node: no "
                          f"{', '.join(f'{n}.so.{version}' for n in missing)} in "
                          f"{', '.join(LIB_DIRS)}", "install the driver's libraries with its "
                          "modules (the Flatcar driver sysext carries both)")
    binaries = {name: f"{d}/{name}" for name in BINARIES for d in reversed(BIN_DIRS)
                if host.is_executable_file(f"{d}/{name}")}
    firmware = sorted(f"/lib/firmware/nvidia/{version}/{entry}"
                      for entry in host.list_dir(f"/lib/firmware/nvidia/{version}")
                      if entry.startswith("gsp_") and entry.endswith(".bin"))
    socket = PERSISTENCED_SOCKET if host.stat(PERSISTENCED_SOCKET) is not None else None
    return DriverRoot(version=version, root="/", libraries=tuple(sorted(libraries.values())),
                      binaries=tuple(sorted(binaries.values())), firmware=tuple(firmware),
                      persistenced_socket=socket)
