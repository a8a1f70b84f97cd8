"""Detection: the NVIDIA PCI functions of a host, as plain records.

Two readers yield the same records: pyudev on a live host (`--root /`), plain sysfs files under
any other root. Parsing is shared and pure, so the two cannot drift apart.

A function whose `vendor` attribute is missing, unreadable or not four hex digits cannot be
told NVIDIA or not. It is never silently dropped: when its class says it could be a GPU or
NVSwitch (display 03xx or bridge 0680xx), or the class cannot be read either, its address is
in `Detection.undecided` and its problem in `problems`; so is an NVIDIA function whose class
cannot be read (it may be a GPU). `status` then fails `pci_scan` (the
node is not-ready, not no-gpu), and `boot` and `plan` refuse to decide (`require_decided`):
recording "no-gpu" for a node that may have a GPU would hide it, and loading a driver for a
device nobody can identify would be a guess. A function with a valid vendor other than 10de
is simply not NVIDIA, whatever else it reports. A missing PCI tree (/sys not mounted, a wrong
--root) is undecided the same way: nothing was looked at, which is not "no GPU".
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from gpunode.errors import HostError, UndecidedError
from gpunode.gpu.pciids import NVIDIA_VENDOR_ID, nvidia_names
from gpunode.platform.host import Host
from gpunode.platform.integers import parse_int, parse_uint
from gpunode.platform.nodepaths import SYSFS_PCI_DEVICES

KINDS = ("gpu", "nvswitch", "audio", "other")


@dataclass(frozen=True)
class PciFunction:
    """One NVIDIA PCI function of the host, as udev or sysfs describes it."""

    address: str
    vendor_id: str
    device_id: str | None
    subsystem_vendor_id: str | None
    subsystem_device_id: str | None
    class_code: str | None  # six hex digits, e.g. "030200"; None when unreadable
    kind: str  # one of KINDS
    product_name: str | None
    numa_node: int | None
    driver: str | None
    iommu_group: int | None
    # attributes that could not be read or parsed (each also one of Detection.problems)
    unreadable: tuple[str, ...] = ()


# Attributes gpunode only shows (`detect`, scheduling hints): one that cannot be read is a
# warning in status's pci_scan. The others decide something — vendor and class whether it is
# an NVIDIA GPU, a GPU's driver link whether it is usable (vfio-pci), a GPU's device id the
# driver flavour (driver/flavour.py; cosmetic only where driver.flavour is pinned).
COSMETIC_ATTRIBUTES = frozenset({"numa_node", "iommu_group", "subsystem_vendor",
                                 "subsystem_device"})


@dataclass(frozen=True)
class Detection:
    """The host's NVIDIA PCI functions as detected, and what could not be read or decided."""

    functions: tuple[PciFunction, ...]
    nouveau_loaded: bool
    names_source: str  # the pci.ids path the names came from, or "builtin"
    source: str  # "udev" or "sysfs"
    # "<address or path>: what could not be read or parsed", in the order found
    problems: tuple[str, ...] = field(default=())
    # functions that may be NVIDIA GPUs but whose vendor cannot be read (module docstring)
    undecided: tuple[str, ...] = field(default=())

    @property
    def gpus(self) -> tuple[PciFunction, ...]:
        return tuple(f for f in self.functions if f.kind == "gpu")

    @property
    def nvswitches(self) -> tuple[PciFunction, ...]:
        return tuple(f for f in self.functions if f.kind == "nvswitch")

    @property
    def vfio_gpus(self) -> tuple[PciFunction, ...]:
        return tuple(f for f in self.gpus if f.driver == "vfio-pci")

    @property
    def usable_gpus(self) -> tuple[PciFunction, ...]:
        """The GPUs containers can use: every one not reserved for VM passthrough (vfio-pci)."""
        return tuple(f for f in self.gpus if f.driver != "vfio-pci")

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "names_source": self.names_source,
            "gpu_count": len(self.gpus),
            "nvswitch_count": len(self.nvswitches),
            "nouveau_loaded": self.nouveau_loaded,
            "vfio_gpus": [f.address for f in self.vfio_gpus],
            "problems": list(self.problems),
            "undecided": list(self.undecided),
            "functions": [asdict(f) for f in self.functions],
        }


def classify(class_code: str | None) -> str:
    """gpu (VGA 0300xx or 3D 0302xx), nvswitch (bridge 0680xx), audio (0403xx) or other."""
    if class_code is None:
        return "other"
    prefix = class_code[:4]
    if prefix in ("0300", "0302"):
        return "gpu"
    if prefix == "0680":
        return "nvswitch"
    if prefix == "0403":
        return "audio"
    return "other"


# An attribute reader: name → stripped text or None when the attribute does not exist.
ReadAttr = Callable[[str], str | None]
ReadLink = Callable[[str], str | None]


def parse_function(
    address: str,
    read: ReadAttr,
    read_link: ReadLink,
    names: Mapping[str, str],
    problems: list[str],
) -> PciFunction:
    """One PCI function from its sysfs attributes; unreadable or unparseable values become None
    and a problem (the attribute named in `unreadable`), so one bad attribute never hides a
    GPU."""
    unreadable: list[str] = []

    def attr(name: str, required: bool = True) -> str | None:
        try:
            value = read(name)
        except HostError as exc:
            problems.append(f"{address}: {exc}")
            unreadable.append(name)
            return None
        if value is None and required:
            problems.append(f"{address}: no '{name}' attribute")
            unreadable.append(name)
        return value

    def hex_id(name: str, width: int) -> str | None:
        raw = attr(name)
        value = _hex_id(address, name, raw, width, problems)
        if raw is not None and value is None:
            unreadable.append(name)
        return value

    def link(name: str) -> str | None:
        try:
            return read_link(name)
        except HostError as exc:
            problems.append(f"{address}: {exc}")
            unreadable.append(name)
            return None

    vendor = hex_id("vendor", 4) or "unknown"
    device = hex_id("device", 4)
    class_code = hex_id("class", 6)
    product = names.get(device) if vendor == NVIDIA_VENDOR_ID and device else None
    subsystem_vendor = hex_id("subsystem_vendor", 4)
    subsystem_device = hex_id("subsystem_device", 4)
    found = len(problems)
    numa = _numa(address, attr("numa_node", required=False), problems)
    if len(problems) > found and "numa_node" not in unreadable:
        unreadable.append("numa_node")
    driver = _link_name(link("driver"))
    iommu_group = _int_or_none(_link_name(link("iommu_group")))
    return PciFunction(
        address=address,
        vendor_id=vendor,
        device_id=device,
        subsystem_vendor_id=subsystem_vendor,
        subsystem_device_id=subsystem_device,
        class_code=class_code,
        kind=classify(class_code),
        product_name=product,
        numa_node=numa,
        driver=driver,
        iommu_group=iommu_group,
        unreadable=tuple(unreadable),
    )


def _hex_id(address: str, name: str, raw: str | None, width: int,
            problems: list[str]) -> str | None:
    if raw is None:
        return None  # absent or unreadable: attr() has said so
    text = raw.lower().removeprefix("0x")
    if len(text) != width or any(c not in "0123456789abcdef" for c in text):
        problems.append(f"{address}: '{name}' is {raw!r}, expected 0x and {width} hex digits")
        return None
    return text


def _numa(address: str, raw: str | None, problems: list[str]) -> int | None:
    if raw is None:
        return None  # kernels without NUMA support have no numa_node attribute
    node = parse_int(raw, minimum=-1, maximum=1 << 16)
    if node is None:
        problems.append(f"{address}: 'numa_node' is {raw!r}, expected an integer (-1 for none)")
        return None
    return None if node < 0 else node


def _link_name(target: str | None) -> str | None:
    return target.rstrip("/").rpartition("/")[2] if target else None


def _int_or_none(text: str | None) -> int | None:
    return parse_uint(text)


def require_decided(detection: Detection) -> None:
    """Refuse to act on a detection where a possible GPU could not be identified."""
    if SYSFS_PCI_DEVICES in detection.undecided:
        raise UndecidedError(f"cannot look for NVIDIA GPUs: {detection.problems[0]}",
                             "run gpunode where sysfs is mounted, or point --root at the node's "
                             "root")
    if detection.undecided:
        problems = [p for p in detection.problems
                    if p.split(": ", 1)[0] in detection.undecided]
        raise UndecidedError(f"cannot tell whether {', '.join(detection.undecided)} "
                             f"{'is an' if len(detection.undecided) == 1 else 'are'} NVIDIA "
                             f"GPU{'' if len(detection.undecided) == 1 else 's'}: "
                             f"{'; '.join(problems)}")


def detect_decided(host: Host, use_udev: bool | None = None) -> Detection:
    """`detect`, refused (UndecidedError) when a possible GPU could not be identified: the one
    path every command that acts on the GPUs (driver load/build, boot) takes."""
    detection = detect(host, use_udev=use_udev)
    require_decided(detection)
    return detection


def undecided_reason(detection: Detection | None, error: str | None = None) -> str | None:
    """Why nobody can tell whether this host has NVIDIA GPUs (detection failed, or a possible
    GPU is unidentified), or None when the detection is decided. For callers that observed
    with `status.observe` (which keeps a failed detection as `detection_error`)."""
    if detection is None:
        return f"PCI detection failed: {error or 'no detection'}"
    try:
        require_decided(detection)
    except UndecidedError as exc:
        return str(exc)
    return None


# -- readers -------------------------------------------------------------------------------------


def detect(host: Host, vendor: str | None = NVIDIA_VENDOR_ID,
           use_udev: bool | None = None) -> Detection:
    """PCI functions of `vendor` (None: all), via udev on a live host, else via sysfs files."""
    if use_udev is None:
        use_udev = host.is_live
    elif use_udev and not host.is_live:
        # udev answers for the machine gpunode runs on, never for the tree under --root.
        from gpunode import log  # lazily, as in _load_pyudev

        log.get().warning("detect.udev_not_under_root", root=str(host.root), fallback="sysfs",
                          reason="udev sees this machine's devices, not the root's")
        use_udev = False
    names, names_source = nvidia_names(host)
    problems: list[str] = []
    undecided: list[str] = []
    udev = _load_pyudev() if use_udev else None
    if udev is not None:
        functions = list(_from_udev(udev, vendor, names, problems, undecided))
        source = "udev"
    else:
        functions = list(_from_sysfs(host, vendor, names, problems, undecided))
        source = "sysfs"
    functions.sort(key=lambda f: f.address)
    # An NVIDIA function whose class cannot be read may be a GPU just the same.
    undecided += [f.address for f in functions
                  if f.class_code is None and f.vendor_id == NVIDIA_VENDOR_ID]
    try:
        nouveau = module_loaded(host, "nouveau")
    except HostError as exc:  # /proc/modules a FIFO, say: listed, as every unreadable file is
        problems.append(f"{exc.path}: {exc.reason}; cannot tell whether nouveau is loaded")
        nouveau = False
    return Detection(
        functions=tuple(functions),
        nouveau_loaded=nouveau,
        names_source=names_source,
        source=source,
        problems=tuple(problems),
        undecided=tuple(sorted(undecided)),
    )


def _from_sysfs(host: Host, vendor: str | None, names: Mapping[str, str],
                problems: list[str], undecided: list[str]) -> Iterable[PciFunction]:
    if not host.exists(SYSFS_PCI_DEVICES):
        # Not "no GPU": nothing was looked at, so any GPU of this node would be hidden.
        problems.append(f"{host.display(SYSFS_PCI_DEVICES)}: does not exist; is sysfs mounted "
                        "(and --root the node's root)?")
        undecided.append(SYSFS_PCI_DEVICES)
        return
    for address in host.list_dir(SYSFS_PCI_DEVICES):
        try:
            device = host.directory(f"{SYSFS_PCI_DEVICES}/{address}")
        except HostError as exc:
            problems.append(f"{address}: {exc}")
            undecided.append(address)
            continue
        if _wanted(address, device.read, vendor, problems, undecided):
            yield parse_function(address, device.read, device.read_link, names, problems)


def _load_pyudev() -> Any:
    """pyudev, or None where it or libudev is missing: sysfs then gives the same records."""
    try:
        import pyudev  # only a live host pays for loading libudev

        pyudev.Context()
    except ImportError as exc:
        from gpunode import log

        log.get().warning("detect.udev_unavailable", reason=str(exc), fallback="sysfs")
        return None
    return pyudev


def _from_udev(pyudev: Any, vendor: str | None, names: Mapping[str, str],
               problems: list[str], undecided: list[str]) -> Iterable[PciFunction]:
    for dev in pyudev.Context().list_devices(subsystem="pci"):
        device = _UdevDevice(dev)
        if _wanted(dev.sys_name, device.read, vendor, problems, undecided):
            yield parse_function(dev.sys_name, device.read, device.read_link, names, problems)


@dataclass(frozen=True)
class _UdevDevice:
    """A pyudev device read with the same answers HostDir gives for a sysfs directory."""

    dev: Any

    def read(self, name: str) -> str | None:
        try:
            return str(self.dev.attributes.asstring(name)).strip()
        except KeyError:
            return None
        except OSError as exc:
            path = f"{self.dev.sys_path}/{name}"
            raise HostError("read", path, exc.strerror or str(exc)) from exc

    def read_link(self, name: str) -> str | None:
        path = os.path.join(self.dev.sys_path, name)
        try:
            return os.readlink(path)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.ENOENT):
                return None  # not a link / not bound: the same answer sysfs gives
            raise HostError("read link", path, exc.strerror or str(exc)) from exc


def _wanted(address: str, read: ReadAttr, vendor: str | None, problems: list[str],
            undecided: list[str]) -> bool:
    """Whether the function is of `vendor`; one whose vendor cannot be read or parsed is a
    problem, and undecided when it could be a GPU (module docstring)."""
    if vendor is None:
        return True
    why = None
    try:
        raw = read("vendor")
    except HostError as exc:
        raw, why = None, str(exc)
    if raw is not None:
        text = raw.lower().removeprefix("0x")
        if len(text) == 4 and all(c in "0123456789abcdef" for c in text):
            return text == vendor
        why = f"'vendor' is {raw!r}, expected 0x and 4 hex digits"
    why = why or "no 'vendor' attribute"
    problems.append(f"{address}: {why}; cannot tell whether it is NVIDIA")
    try:
        class_code = _hex_id(address, "class", read("class"), 6, [])
    except HostError:
        class_code = None
    if class_code is None or classify(class_code) in ("gpu", "nvswitch"):
        undecided.append(address)
    return False


def module_loaded(host: Host, name: str) -> bool:
    return name in loaded_modules(host)


def loaded_modules(host: Host) -> set[str]:
    """Loaded kernel modules: /proc/modules (what lsmod reads), else — a kernel without it —
    the /sys/module entries whose initstate is "live"."""
    text = host.read_optional("/proc/modules")
    if text is not None:
        return {line.split(" ", 1)[0] for line in text.splitlines() if line}
    return {name for name in host.list_dir("/sys/module")
            if (host.read_optional(f"/sys/module/{name}/initstate") or "").strip() == "live"}
