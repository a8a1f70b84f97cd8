"""What the loaded NVIDIA driver tells about itself under /proc, parsed into records."""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpunode.platform.host import Host
from gpunode.platform.integers import MAX_MAJOR, MAX_MINOR, parse_uint

PROC_NVIDIA = "/proc/driver/nvidia"

_VERSION_RE = re.compile(r"NVRM version:.*?Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)")
# A GPU UUID as the driver prints it (NVML's form): GPU- and 32 hex digits as 8-4-4-4-12.
UUID_RE = re.compile(r"GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
                     r"[0-9a-fA-F]{12}")
# Until the driver has initialized a GPU (its first client open, or persistence mode) it has no
# UUID to give and prints this instead (the open modules' kernel-open/nvidia/nv-procfs.c shows
# what the RM answers; the text is the RM's), with `Video BIOS: ??.??.??.??.??`; a GPU whose
# initialization failed (`RmInitAdapter failed!` in the kernel log) keeps it.
UNINITIALIZED_UUID = "GPU-????????-????-????-????-????????????"


@dataclass(frozen=True)
class DriverVersion:
    """The loaded driver's version and module flavour, as /proc/driver/nvidia/version says."""

    version: str  # "550.54.15"
    flavour: str  # "open" or "proprietary"


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as the loaded driver describes it under /proc/driver/nvidia/gpus."""

    address: str
    model: str | None
    minor: int | None
    # why the GPU's minor is not known: the file is missing or empty, has no 'Device Minor'
    # line, or one that is not a device minor; /dev/nvidiaN can then be neither made nor checked
    minor_problem: str | None = None
    # 'GPU UUID:', e.g. GPU-5a4f…, once the driver knows it: never the placeholder of a GPU not
    # initialized yet. The CDI spec names the GPU by it; gpu/init.py waits for it.
    uuid: str | None = None
    uuid_problem: str | None = None  # why `uuid` is None: not initialized yet, no line, garbage

    @property
    def initialized(self) -> bool:
        """The driver has initialized the GPU (it knows its UUID)."""
        return self.uuid is not None


def parse_version(text: str) -> DriverVersion | None:
    """/proc/driver/nvidia/version → version and flavour; None when it is not that file's shape."""
    match = _VERSION_RE.search(text)
    if match is None:
        return None
    flavour = "open" if "Open Kernel Module" in match.group(0) else "proprietary"
    return DriverVersion(version=match.group(1), flavour=flavour)


def parse_information(address: str, text: str | None) -> GpuInfo:
    """/proc/driver/nvidia/gpus/<address>/information: 'Key: <tabs> value' lines (None: the
    file is missing). Every GPU the driver lists has a 'Device Minor'; one without is a
    `minor_problem`, never a GPU quietly left without its /dev/nvidiaN."""
    shown = f"{PROC_NVIDIA}/gpus/{address}/information"
    if text is None or not text.strip():
        said = f"{shown} is {'missing' if text is None else 'empty'}"
        return GpuInfo(address=address, model=None, minor=None, minor_problem=(
            f"{said}: the GPU's device minor (and so /dev/nvidiaN) is not known"),
            uuid_problem=f"{said}: the GPU's UUID is not known")
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    raw = fields.get("Device Minor")
    minor = parse_uint(raw, MAX_MINOR)
    problem = None
    if raw is None:
        problem = (f"{shown} has no 'Device Minor' line: the GPU's device minor (and so "
                   "/dev/nvidiaN) is not known")
    elif minor is None:
        problem = (f"{shown}: 'Device Minor' is {raw[:80]!r}, expected an integer from 0 to "
                   f"{MAX_MINOR}")
    uuid, uuid_problem = _uuid(shown, fields.get("GPU UUID"))
    return GpuInfo(address=address, model=fields.get("Model") or None, minor=minor,
                   minor_problem=problem, uuid=uuid, uuid_problem=uuid_problem)


def _uuid(shown: str, raw: str | None) -> tuple[str | None, str | None]:
    """(the GPU's UUID, None) or (None, why it is not known)."""
    if raw is None or not raw:
        return None, f"{shown} has no 'GPU UUID' line"
    if "?" in raw:
        return None, (f"{shown} shows the placeholder UUID {raw[:60]!r}: the driver has not "
                      "initialized the GPU yet (it does on the GPU's first open, or with "
                      "persistence mode)")
    if not UUID_RE.fullmatch(raw):
        return None, f"{shown}: 'GPU UUID' is {raw[:80]!r}, not a GPU UUID (GPU-8-4-4-4-12 hex)"
    return raw, None


def parse_char_majors(text: str, problems: list[str] | None = None) -> dict[str, int]:
    """/proc/devices' "Character devices:" section → name → major. A line whose number is not
    a major (not ASCII digits, or above the kernel's 4095) is skipped, and told in `problems`."""
    majors: dict[str, int] = {}
    in_char = False
    for line in text.splitlines():
        if line.startswith("Character devices"):
            in_char = True
            continue
        if line.startswith("Block devices"):
            break
        if not in_char or not line.strip():
            continue
        number, _, name = line.strip().partition(" ")
        major = parse_uint(number, MAX_MAJOR)
        if major is not None and name.strip():
            majors.setdefault(name.strip(), major)
        elif problems is not None:
            problems.append(f"/proc/devices: {line.strip()!r} is not '<major> <name>' with a "
                            f"major from 0 to {MAX_MAJOR}")
    return majors


def nvidia_major(majors: dict[str, int]) -> int | None:
    """The driver registers its major as `nvidia-frontend`, some builds as `nvidia`."""
    return majors.get("nvidia-frontend", majors.get("nvidia"))


def read_gpu_infos(host: Host) -> dict[str, GpuInfo]:
    """address → info for every GPU the driver has bound."""
    return {address.lower(): parse_information(address.lower(), host.read_optional(path))
            for address, path in gpu_information_files(host).items()}


def gpu_information_files(host: Host) -> dict[str, str]:
    """address (as the driver names its directory) → its information file."""
    return {address: f"{PROC_NVIDIA}/gpus/{address}/information"
            for address in host.list_dir(f"{PROC_NVIDIA}/gpus")}


def printable(text: str, limit: int | None = None) -> str:
    """A line the kernel printed (it prints what the driver gives it): control characters
    become '?', for messages; at most `limit` characters."""
    return "".join(c if c.isprintable() else "?" for c in text)[:limit]
