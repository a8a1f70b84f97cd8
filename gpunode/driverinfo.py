"""What the loaded NVIDIA driver tells about itself under /proc, parsed into records."""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpunode.host import Host

PROC_NVIDIA = "/proc/driver/nvidia"

_VERSION_RE = re.compile(r"NVRM version:.*?Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)")


@dataclass(frozen=True)
class DriverVersion:
    version: str  # "550.54.15"
    flavour: str  # "open" or "proprietary"


@dataclass(frozen=True)
class GpuInfo:
    address: str
    model: str | None
    minor: int | None


def parse_version(text: str) -> DriverVersion | None:
    """/proc/driver/nvidia/version → version and flavour; None when it is not that file's shape."""
    match = _VERSION_RE.search(text)
    if match is None:
        return None
    flavour = "open" if "Open Kernel Module" in match.group(0) else "proprietary"
    return DriverVersion(version=match.group(1), flavour=flavour)


def parse_information(address: str, text: str) -> GpuInfo:
    """/proc/driver/nvidia/gpus/<address>/information: 'Key: <tabs> value' lines."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    minor = fields.get("Device Minor", "")
    return GpuInfo(address=address, model=fields.get("Model") or None,
                   minor=int(minor) if minor.isdigit() else None)


def parse_char_majors(text: str) -> dict[str, int]:
    """/proc/devices' "Character devices:" section → name → major."""
    majors: dict[str, int] = {}
    in_char = False
    for line in text.splitlines():
        if line.startswith("Character devices"):
            in_char = True
            continue
        if line.startswith("Block devices"):
            break
        number, _, name = line.strip().partition(" ")
        if in_char and number.isdigit() and name:
            majors.setdefault(name.strip(), int(number))
    return majors


def nvidia_major(majors: dict[str, int]) -> int | None:
    """The driver registers its major as `nvidia-frontend`, some builds as `nvidia`."""
    return majors.get("nvidia-frontend", majors.get("nvidia"))


def read_gpu_infos(host: Host) -> dict[str, GpuInfo]:
    """address → info for every GPU the driver has bound."""
    infos: dict[str, GpuInfo] = {}
    for address in host.list_dir(f"{PROC_NVIDIA}/gpus"):
        text = host.read_optional(f"{PROC_NVIDIA}/gpus/{address}/information") or ""
        infos[address.lower()] = parse_information(address.lower(), text)
    return infos
