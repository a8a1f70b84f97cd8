"""The NVIDIA driver's user-space in a fixture tree: libraries with their SONAME links,
binaries, GSP firmware, laid out as a real install puts them (gpunode/driver/userspace.py
names the layouts and their sources), and each GPU's UUID.

The files are stand-ins: a library is the smallest 64-bit ELF shared object that names its
SONAME as the real one does, a binary a shell script. The default layout is the Flatcar driver
sysext's (/usr/lib64, /usr/bin, /lib/firmware/nvidia/<version>).
"""

from __future__ import annotations

import hashlib
import shlex
import struct
from pathlib import Path

# name → SONAME suffix, as the driver's libraries carry them (libnvidia-gpucomp and the
# versioned-SONAME ones have no separate link)
LIBRARIES = {
    "libcuda": "1", "libnvidia-ml": "1", "libnvidia-ptxjitcompiler": "1", "libnvidia-nvvm": "4",
    "libnvidia-opencl": "1", "libnvidia-cfg": "1", "libnvidia-allocator": "1",
    "libcudadebugger": "1", "libnvidia-gpucomp": None, "libnvidia-pkcs11-openssl3": None,
}
BINARIES = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control",
            "nvidia-cuda-mps-server")
OPEN_FIRMWARE = ("gsp_ga10x.bin", "gsp_tu10x.bin")
# nvidia-persistenced's stand-in daemonizes as the daemon does (the parent exits once the
# daemon's pid file is written, /run/nvidia-persistenced/nvidia-persistenced.pid) and stays, so
# that a node booted in the real-systemd harness has a persistenced systemd keeps running; it
# initializes no GPU. The daemon is a fork of this script: its comm is the script's name.
PERSISTENCED_STAND_IN = """\
#!/bin/sh
mkdir -p /run/nvidia-persistenced
( exec </dev/null >/dev/null 2>&1; trap 'exit 0' TERM; while :; do sleep 3600; done ) &
echo $! > /run/nvidia-persistenced/nvidia-persistenced.pid
"""


def elf_library(soname: str | None = None) -> bytes:
    """The smallest 64-bit x86-64 shared object the loader's headers allow (an ELF header, a
    PT_LOAD and a PT_DYNAMIC program header, a dynamic table, its string table) whose
    DT_SONAME is `soname` (None: it has none); binutils' `readelf -d` reads it
    (tests/unit/test_driver_elf.py)."""
    strtab = b"\0" + (soname.encode() + b"\0" if soname else b"")
    tags = [(5, 0), (10, len(strtab))] + ([(14, 1)] if soname else []) + [(0, 0)]  # STRTAB,
    dynamic_at = 64 + 2 * 56                                            # STRSZ, SONAME, NULL
    strtab_at = dynamic_at + 16 * len(tags)
    tags[0] = (5, strtab_at)  # an address, which the PT_LOAD below maps to the same offset
    size = strtab_at + len(strtab)
    header = (b"\x7fELF\x02\x01\x01\x00" + b"\0" * 8
              + struct.pack("<HHIQQQIHHHHHH", 3, 0x3E, 1, 0, 64, 0, 0, 64, 56, 2, 64, 0, 0))
    load = struct.pack("<IIQQQQQQ", 1, 4, 0, 0, 0, size, size, 0x1000)  # PT_LOAD, PF_R
    dynamic = struct.pack("<IIQQQQQQ", 2, 4, dynamic_at, dynamic_at, dynamic_at,
                          16 * len(tags), 16 * len(tags), 8)  # PT_DYNAMIC
    return header + load + dynamic + b"".join(struct.pack("<qQ", *t) for t in tags) + strtab


ELF64_LIBRARY = elf_library()  # a library without a SONAME


def write_userspace(root: Path, version: str, open_modules: bool, lib_dir: str = "/usr/lib64",
                    bin_dir: str = "/usr/bin",
                    firmware_dir: str | None = "/lib/firmware/nvidia/{version}",
                    dev_link: bool = True) -> None:
    """The versioned libraries and their links in `lib_dir`, the binaries in `bin_dir`, and
    for the open modules the GSP firmware in `firmware_dir` (None: none). `dev_link`: the
    libcuda.so link an install adds (ldconfig makes only the SONAME links)."""
    libs = root / lib_dir.lstrip("/")
    libs.mkdir(parents=True, exist_ok=True)
    for name, soname in LIBRARIES.items():
        file = f"{name}.so.{version}"
        (libs / file).write_bytes(elf_library(f"{name}.so.{soname}" if soname else file))
        if soname is not None:
            _link(libs / f"{name}.so.{soname}", f"{name}.so.{version}")
    if dev_link:
        _link(libs / "libcuda.so", "libcuda.so.1")
    bins = root / bin_dir.lstrip("/")
    bins.mkdir(parents=True, exist_ok=True)
    for name in BINARIES:
        (bins / name).write_text(PERSISTENCED_STAND_IN if name == "nvidia-persistenced"
                                 else "#!/bin/sh\n")
        (bins / name).chmod(0o755)
    if open_modules and firmware_dir is not None:
        firmware = root / firmware_dir.format(version=version).lstrip("/")
        firmware.mkdir(parents=True, exist_ok=True)
        for name in OPEN_FIRMWARE:
            (firmware / name).write_bytes(b"GSP firmware stand-in\n")


def write_build_userspace(entry: Path, version: str) -> None:
    """The user-space of a build's cache entry (driver/cache.py) under `entry`: lib/ with the
    SONAME links `ldconfig -n` makes, bin/, firmware/nvidia/<version>/."""
    write_userspace(entry, version, True, lib_dir="/lib", bin_dir="/bin",
                    firmware_dir="/firmware/nvidia/{version}", dev_link=False)


def gpu_uuid(machine: str, address: str) -> str:
    """A GPU UUID as the driver prints it (GPU-8-4-4-4-12 hex), fixed per machine and GPU."""
    h = hashlib.sha256(f"{machine}/{address}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _link(link: Path, target: str) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)


def install_lines(fixture: Path) -> list[str]:
    """Shell lines that put a fixture's driver user-space (the sysext layout: only the files
    write_userspace makes, never the fixture's other stand-ins such as /usr/bin/containerd) on
    the live root of a namespace whose /usr is a copy-on-write overlay."""
    names = {"usr/lib64": lambda n: n.startswith(tuple(LIBRARIES)),
             "usr/bin": BINARIES.__contains__, "lib/firmware/nvidia": lambda n: True}
    lines = []
    for directory, wanted in names.items():
        files = sorted(p for p in (fixture / directory).glob("*") if wanted(p.name))
        if files:
            lines += [f"mkdir -p /{directory}",
                      f"cp -a {' '.join(shlex.quote(str(f)) for f in files)} /{directory}/"]
    return lines
