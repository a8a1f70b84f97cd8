"""Fixture hosts: a node's sysfs, /proc, /dev and /etc as files, built from a few lines of data.

A machine is a list of PCI functions plus a few facts; a state says how far the node got
(`bare`: just booted, nothing loaded; `driver`: NVIDIA driver loaded and device nodes made;
`ready`: containerd configured, daemons running, device plugin registered). The attribute files
use the kernel's exact formats, so the same readers run against a fixture and a real node.

    python -m gpunode_testing.fixtures build nc4as-t4-v3 --state ready DIR
    python -m gpunode_testing.fixtures list

Longer than 450 lines because a quarter of it is data (the machines and their PCI functions)
kept next to the writers that turn it into files, so a reader sees both at once.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

STATES = ("bare", "driver", "ready")
KERNEL = "6.6.60-flatcar"  # the fixture node's running kernel (uname -r)

NVIDIA = "10de"
CLASS_3D = "030200"
CLASS_NVSWITCH = "068000"


@dataclass(frozen=True)
class Fn:
    """One PCI function. `driver` None on an NVIDIA function means "nvidia once it is loaded"."""

    address: str
    device: str
    vendor: str = NVIDIA
    cls: str = CLASS_3D
    subsystem: str = "10de:0000"
    driver: str | None = None
    numa: int = -1
    iommu: int | None = None
    revision: str = "a1"
    vgpu: bool = False  # its configuration space carries NVIDIA's vGPU signature


@dataclass(frozen=True)
class Machine:
    name: str
    description: str
    functions: tuple[Fn, ...]
    dmi_product: str = "Virtual Machine"
    dmi_vendor: str = "Microsoft Corporation"
    driver_version: str = "550.127.08"
    open_modules: bool = False
    nouveau: bool = False  # the nouveau module is loaded (it then holds the GPUs)
    states: tuple[str, ...] = STATES

    @property
    def gpus(self) -> tuple[Fn, ...]:
        return tuple(f for f in self.functions if f.vendor == NVIDIA and f.cls[:4] in ("0300",
                                                                                        "0302"))


def gpu(address: str, device: str, subsystem: str = "10de:0000", **kw: object) -> Fn:
    return Fn(address=address, device=device, subsystem=subsystem, **kw)  # type: ignore[arg-type]


def other(address: str, vendor: str, device: str, cls: str, driver: str | None = None) -> Fn:
    return Fn(address=address, device=device, vendor=vendor, cls=cls, subsystem=f"{vendor}:0000",
              driver=driver)


# Hyper-V guests show few PCI functions: the accelerated-networking NIC and the GPUs (vPCI).
AZURE_NIC = other("c3c1:00:02.0", "15b3", "101a", "020000", driver="mlx5_core")

MACHINES: dict[str, Machine] = {m.name: m for m in (
    Machine("azure-d4s-v5", "Azure Standard_D4s_v5: CPU only", (AZURE_NIC,), states=("bare",)),
    Machine("nc4as-t4-v3", "Azure Standard_NC4as_T4_v3: 1x Tesla T4",
            (AZURE_NIC, gpu("0001:00:00.0", "1eb8", "10de:12a2", iommu=1))),
    Machine("nc24ads-a100-v4", "Azure Standard_NC24ads_A100_v4: 1x A100 PCIe 80GB",
            (AZURE_NIC, gpu("0001:00:00.0", "20b5", "10de:1533", numa=0, iommu=1)),
            open_modules=True),
    Machine("nd96amsr-a100-v4", "Azure Standard_ND96amsr_A100_v4: 8x A100 SXM4 80GB, 6 NVSwitch",
            (AZURE_NIC,
             *(gpu(f"{i + 1:04x}:00:00.0", "20b2", "10de:1463", numa=i // 4, iommu=i + 1)
               for i in range(8)),
             *(Fn(f"{i + 9:04x}:00:00.0", "1af1", cls=CLASS_NVSWITCH, numa=i // 3, iommu=i + 9)
               for i in range(6))),
            open_modules=True),
    Machine("nvads-a10-v5", "Azure Standard_NV36ads_A10_v5: 1x A10 (GRID driver)",
            (AZURE_NIC, gpu("0002:00:00.0", "2236", "10de:1482", iommu=1, vgpu=True)),
            driver_version="550.144.06"),
    Machine("t4-nouveau", "Tesla T4 still held by nouveau (no blacklist)",
            (AZURE_NIC, gpu("0001:00:00.0", "1eb8", "10de:12a2", driver="nouveau", iommu=1)),
            nouveau=True, states=("bare",)),
    Machine("nc40ads-h100-v5", "Azure Standard_NC40ads_H100_v5: 1x H100 NVL",
            (AZURE_NIC, gpu("0001:00:00.0", "2321", "10de:1839", numa=0, iommu=1)),
            driver_version="570.172.08", open_modules=True),
    Machine("nc6s-v3", "Azure Standard_NC6s_v3: 1x Tesla V100 PCIe 16GB",
            (AZURE_NIC, gpu("0001:00:00.0", "1db4", "10de:1214", iommu=1))),
    Machine("hgx-b200", "A bare-metal HGX B200 node: 8x B200",
            tuple(gpu(f"{i + 1:04x}:00:00.0", "2901", "10de:1999", numa=i // 4, iommu=i + 1)
                  for i in range(8)),
            dmi_product="HGX B200", dmi_vendor="Supermicro", driver_version="570.172.08",
            open_modules=True),
    Machine("mixed-t4-a100", "A bare-metal node with a Tesla T4 and an A100 PCIe",
            (gpu("0000:3b:00.0", "1eb8", "10de:12a2", iommu=1),
             gpu("0000:af:00.0", "20b5", "10de:1533", numa=1, iommu=2)),
            dmi_product="PowerEdge R750", dmi_vendor="Dell Inc."),
    Machine("mixed-v100-b200", "A bare-metal node with a V100 and a B200: no driver drives both",
            (gpu("0000:3b:00.0", "1db4", "10de:1214", iommu=1),
             gpu("0000:af:00.0", "2901", "10de:1999", numa=1, iommu=2)),
            dmi_product="PowerEdge R760", dmi_vendor="Dell Inc.", states=("bare",)),
    Machine("a100-vfio", "2x A100 PCIe, the second bound to vfio-pci for passthrough",
            (AZURE_NIC, gpu("0001:00:00.0", "20b5", "10de:1533", iommu=1),
             gpu("0002:00:00.0", "20b5", "10de:1533", driver="vfio-pci", iommu=2)),
            open_modules=True),
)}


def with_extra_functions(machine: Machine, count: int) -> Machine:
    """The machine plus `count` non-NVIDIA functions (a busy bare-metal PCI tree)."""
    extra = tuple(other(f"0000:{bus:02x}:{dev:02x}.{fn}", "8086", "0d57", "060000")
                  for n in range(count) for bus, dev, fn in [(1 + n // 32 // 8, n // 8 % 32,
                                                               n % 8)])
    return replace(machine, functions=machine.functions + extra)


# -- building ------------------------------------------------------------------------------------


@dataclass
class Options:
    state: str = "ready"
    dev_nodes: str = "auto"  # "auto": real char devices when root, else plain files
    pci_ids: bool = True  # write a small pci.ids with the NVIDIA names
    flat_sysfs: bool = False  # device directories directly in /sys/bus/pci/devices
    extra: dict[str, str] = field(default_factory=dict)  # host path → content, written last


def build(machine: Machine, root: Path, options: Options | None = None) -> Path:
    options = options or Options()
    if options.state not in STATES:
        raise ValueError(f"state must be one of {', '.join(STATES)}, not {options.state!r}")
    loaded = options.state in ("driver", "ready") and not machine.nouveau
    root.mkdir(parents=True, exist_ok=True)
    _write(root, "/etc/os-release", FLATCAR_OS_RELEASE)
    _write(root, "/sys/class/dmi/id/product_name", machine.dmi_product + "\n")
    _write(root, "/sys/class/dmi/id/sys_vendor", machine.dmi_vendor + "\n")
    _write(root, "/proc/sys/kernel/osrelease", KERNEL + "\n")
    # the firmware loader's search path parameter, empty as a kernel boots without
    # firmware_class.path= (Flatcar's kernel has the loader built in)
    _write(root, "/sys/module/firmware_class/parameters/path", "\n")
    _write(root, "/proc/sys/kernel/hostname", f"{machine.name}-vmss000000\n")
    _write(root, "/proc/stat", f"cpu  1 0 1 100 0 0 0 0 0 0\nbtime {BOOT_TIME}\n")
    for fn in machine.functions:
        _write_function(root, fn, False, options.flat_sysfs)
    _write(root, "/proc/modules", _modules(machine, False))
    _write_sys_modules(root, machine, False)
    _write(root, "/proc/devices", _devices(False))
    if options.pci_ids:
        _write(root, "/usr/share/misc/pci.ids", PCI_IDS_EXCERPT)
    _write_containerd_base(root)
    if loaded:
        load_driver(root, machine, options.flat_sysfs)
        _write_nodes(root, machine, options)
    if options.state == "ready":
        _write_ready(root, machine)
        _write_cdi_spec(root)
    if options.state in ("driver", "ready"):
        _write_process(root, 812, "containerd", "/usr/bin/containerd --config "
                       "/etc/containerd/config.toml")
        _write_process(root, 1033, "kubelet", "/opt/bin/kubelet --config "
                       "/var/lib/kubelet/config.yaml")
    for path, content in options.extra.items():
        _write(root, path, content)
    return root


def _write(root: Path, path: str, content: str | bytes, mode: int = 0o644) -> Path:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        content = content.encode()
    target.write_bytes(content)
    target.chmod(mode)
    return target


def _link(root: Path, path: str, target: str) -> None:
    link = root / path.lstrip("/")
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink():
        link.unlink()
    link.symlink_to(target)


def _write_function(root: Path, fn: Fn, loaded: bool, flat: bool = False) -> None:
    """One PCI function as the kernel shows it: the device directory under /sys/devices and a
    link to it in /sys/bus/pci/devices. `flat` puts the directory itself in
    /sys/bus/pci/devices (links relative to there), so the tree can be bind-mounted over a
    real /sys/bus/pci/devices, whose ../../../devices has no such device."""
    domain_bus = fn.address.rsplit(":", 1)[0]
    devdir = (f"/sys/bus/pci/devices/{fn.address}" if flat
              else f"/sys/devices/pci{domain_bus}/{fn.address}")
    up = "../../.." if not flat else "../../../.."  # from the device directory to /sys
    sub_vendor, sub_device = fn.subsystem.split(":")
    attrs = {
        "vendor": f"0x{fn.vendor}", "device": f"0x{fn.device}",
        "subsystem_vendor": f"0x{sub_vendor}", "subsystem_device": f"0x{sub_device}",
        "class": f"0x{fn.cls}", "numa_node": str(fn.numa), "revision": f"0x{fn.revision}",
        "modalias": f"pci:v0000{fn.vendor.upper()}d0000{fn.device.upper()}sv0000"
                    f"{sub_vendor.upper()}sd0000{sub_device.upper()}bc{fn.cls[:2].upper()}"
                    f"sc{fn.cls[2:4].upper()}i{fn.cls[4:].upper()}",
    }
    driver = fn.driver or ("nvidia" if loaded and fn.vendor == NVIDIA else None)
    uevent = [f"PCI_CLASS={int(fn.cls, 16):X}", f"PCI_ID={fn.vendor.upper()}:{fn.device.upper()}",
              f"PCI_SUBSYS_ID={sub_vendor.upper()}:{sub_device.upper()}",
              f"PCI_SLOT_NAME={fn.address}", f"MODALIAS={attrs['modalias']}"]
    if driver:
        uevent.insert(0, f"DRIVER={driver}")
    attrs["uevent"] = "\n".join(uevent)
    for name, value in attrs.items():
        _write(root, f"{devdir}/{name}", value + "\n")
    if fn.vendor == NVIDIA:
        _write(root, f"{devdir}/config", config_space(fn))
    _link(root, f"{devdir}/subsystem", f"{up}/bus/pci")
    if not flat:
        _link(root, f"/sys/bus/pci/devices/{fn.address}",
              f"../../../devices/pci{domain_bus}/{fn.address}")
    if driver:
        (root / f"sys/bus/pci/drivers/{driver}").mkdir(parents=True, exist_ok=True)
        _link(root, f"{devdir}/driver", f"{up}/bus/pci/drivers/{driver}")
    elif (root / devdir.lstrip("/") / "driver").is_symlink():
        (root / devdir.lstrip("/") / "driver").unlink()
    if fn.iommu is not None:
        (root / f"sys/kernel/iommu_groups/{fn.iommu}/devices").mkdir(parents=True, exist_ok=True)
        _link(root, f"{devdir}/iommu_group", f"{up}/kernel/iommu_groups/{fn.iommu}")


def config_space(fn: Fn) -> bytes:
    """The function's 256-byte PCI configuration header: ids, class, and one vendor-specific
    capability (id 0x09) at 0x60, which on a vGPU starts with NVIDIA's "VF" signature (GFD's
    test, NVIDIA/k8s-device-plugin internal/vgpu)."""
    config = bytearray(256)
    config[0:4] = bytes.fromhex(fn.vendor)[::-1] + bytes.fromhex(fn.device)[::-1]
    config[0x06] = 0x10  # status: a capability list follows
    config[0x08] = int(fn.revision, 16)
    config[0x09:0x0C] = bytes.fromhex(fn.cls)[::-1]
    config[0x34] = 0x60
    record = b"VF" + bytes([0x01, 0x02, 0x00, 0x00]) if fn.vgpu else bytes(17)
    config[0x60:0x63] = bytes([0x09, 0x00, 3 + len(record)])
    config[0x63:0x63 + len(record)] = record
    return bytes(config)


BASE_MODULES = ["ext4 1060864 1 - Live 0x0000000000000000", "hv_netvsc 98304 0 - Live "
                "0x0000000000000000", "mlx5_core 2097152 0 - Live 0x0000000000000000"]


def _modules(machine: Machine, loaded: bool) -> str:
    lines = list(BASE_MODULES)
    if machine.nouveau:
        lines.insert(0, "nouveau 2818048 0 - Live 0x0000000000000000")
    if loaded:
        lines[:0] = ["nvidia_uvm 1531904 0 - Live 0x0000000000000000 (POE)",
                     "nvidia_modeset 1343488 0 - Live 0x0000000000000000 (POE)",
                     "nvidia 56786944 2 nvidia_uvm,nvidia_modeset, Live 0x0000000000000000 (POE)"]
    return "\n".join(lines) + "\n"


def _write_sys_modules(root: Path, machine: Machine, loaded: bool) -> None:
    """/sys/module/<name>/initstate for every module /proc/modules lists (the same facts)."""
    for line in _modules(machine, loaded).splitlines():
        _write(root, f"/sys/module/{line.split(' ', 1)[0]}/initstate", "live\n")


NVIDIA_MAJOR, UVM_MAJOR, CAPS_MAJOR = 195, 508, 509


def _devices(loaded: bool) -> str:
    chars = ["  1 mem", "  4 /dev/vc/0", "  4 tty", "  5 /dev/tty", "  5 /dev/console",
             " 10 misc", " 89 i2c", "180 usb", "226 drm"]
    if loaded:
        chars += [f"{NVIDIA_MAJOR} nvidia-frontend", f"{UVM_MAJOR} nvidia-uvm",
                  f"{CAPS_MAJOR} nvidia-caps"]
    return ("Character devices:\n" + "\n".join(chars) +
            "\n\nBlock devices:\n  7 loop\n  8 sd\n259 blkext\n")


def load_driver(root: Path, machine: Machine, flat: bool = False) -> None:
    """What the kernel shows once the NVIDIA modules are loaded (GPUs bound to nvidia, modules,
    majors, /proc/driver/nvidia) and their user-space (driver_files). No device nodes: udev
    does not make them all; gpunode does."""
    from gpunode_testing.driver_files import gpu_uuid, write_userspace
    for fn in machine.functions:
        _write_function(root, fn, True, flat)
    _write(root, "/proc/modules", _modules(machine, True))
    _write_sys_modules(root, machine, True)
    _write(root, "/proc/devices", _devices(True))
    module = ("NVIDIA UNIX Open Kernel Module for x86_64" if machine.open_modules
              else "NVIDIA UNIX x86_64 Kernel Module")
    _write(root, "/proc/driver/nvidia/version",
           f"NVRM version: {module}  {machine.driver_version}  Release Build  "
           "(dvs-builder@U16-I3-B03-4-3)  Thu Oct 24 23:07:50 UTC 2024\n"
           "GCC version:  gcc version 13.3.1 20240614 (Gentoo 13.3.1_p20240614 p17)\n")
    names = {"1eb8": "Tesla T4", "20b5": "NVIDIA A100 80GB PCIe", "20b2": "NVIDIA A100-SXM4-80GB",
             "2236": "NVIDIA A10"}
    for minor, g in enumerate(_usable(machine)):
        _write(root, f"/proc/driver/nvidia/gpus/{g.address}/information",
               f"Model: \t\t {names.get(g.device, 'NVIDIA Graphics Device')}\nIRQ:   \t\t 0\n"
               f"GPU UUID: \t {gpu_uuid(machine.name, g.address)}\n"
               f"Video BIOS: \t {VBIOS}\nBus Type: \t PCIe\nDMA Size: \t 47 bits\n"
               f"DMA Mask: \t 0x7fffffffffff\nBus Location: \t {g.address}\n"
               f"Device Minor: \t {minor}\nGPU Excluded:\t No\n")
    write_userspace(root, machine.driver_version, machine.open_modules)


# What the driver shows of a GPU it has not initialized yet (no client has opened it, no
# persistence mode): gpunode/gpu/driverinfo.py UNINITIALIZED_UUID says where it comes from.
UNINITIALIZED_UUID = "GPU-????????-????-????-????-????????????"
UNINITIALIZED_VBIOS = "??.??.??.??.??"
VBIOS = "92.00.00.00.01"


def uninitialize_gpus(root: Path) -> list[Path]:
    """Every GPU of a fixture node as the driver shows it right after the modules loaded: the
    UUID and the VBIOS version are placeholders. Returns the files changed."""
    return [_set_info(info, UNINITIALIZED_UUID, UNINITIALIZED_VBIOS)
            for info in sorted(root.glob("proc/driver/nvidia/gpus/*/information"))]


def initialize_gpu(root: Path, machine: Machine, address: str) -> None:
    """The GPU at `address` as the driver shows it once it initialized it: its UUID (the one
    load_driver gives it) and VBIOS version back. A stand-in for the kernel's part of a first
    open or of nvidia-persistenced, for tests (gpunode cannot initialize a fixture's GPU)."""
    from gpunode_testing.driver_files import gpu_uuid

    _set_info(root / f"proc/driver/nvidia/gpus/{address}/information",
              gpu_uuid(machine.name, address), VBIOS)


def _set_info(info: Path, uuid: str, vbios: str) -> Path:
    import re

    text = re.sub(r"^GPU UUID: \t .*$", f"GPU UUID: \t {uuid}", info.read_text(),
                  flags=re.MULTILINE)
    info.write_text(re.sub(r"^Video BIOS: \t .*$", f"Video BIOS: \t {vbios}", text,
                           flags=re.MULTILINE))
    return info


def _write_cdi_spec(root: Path) -> None:
    """The CDI spec gpunode boot writes, made by gpunode itself from the tree."""
    from gpunode.cdi import node as cdinode
    from gpunode.cdi import spec as cdi
    from gpunode.platform.host import Host

    host = Host(root)
    cdinode.write(host, cdi.SPEC_PATH, cdi.render(cdinode.generate(host)))


def _usable(machine: Machine) -> list[Fn]:
    return [g for g in machine.gpus if g.driver is None]


def _write_nodes(root: Path, machine: Machine, options: Options) -> None:
    nodes = {"/dev/nvidiactl": (NVIDIA_MAJOR, 255), "/dev/nvidia-modeset": (NVIDIA_MAJOR, 254),
             "/dev/nvidia-uvm": (UVM_MAJOR, 0), "/dev/nvidia-uvm-tools": (UVM_MAJOR, 1)}
    nodes |= {f"/dev/nvidia{minor}": (NVIDIA_MAJOR, minor)
              for minor in range(len(_usable(machine)))}
    real = options.dev_nodes == "char" or (options.dev_nodes == "auto" and os.geteuid() == 0)
    for path, (major, minor) in nodes.items():
        make_char_device(root, path, major, minor, real)
        # and its /dev/char link, as gpunode's driver step leaves it (runc looks devices up there)
        link = root / f"dev/char/{major}:{minor}"
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(f"..{path.removeprefix('/dev')}")


def make_char_device(root: Path, path: str, major: int, minor: int, real: bool) -> None:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() or target.is_symlink():
        target.unlink()
    if real:
        os.mknod(target, stat.S_IFCHR | 0o666, os.makedev(major, minor))
        os.chmod(target, 0o666)  # mknod applies the umask
    else:
        target.write_text(f"char {major}:{minor}\n")


# The fixture node booted at this time; its daemons started 10 s later and its config files are
# older than both, so a config changed after containerd started (a pending restart) shows.
BOOT_TIME = 1764400000


def _settle(path: Path) -> None:
    os.utime(path, (BOOT_TIME, BOOT_TIME), follow_symlinks=False)


def _write_containerd_base(root: Path) -> None:
    _write(root, "/usr/lib/systemd/system/containerd.service", FLATCAR_CONTAINERD_UNIT)
    _settle(_write(root, "/usr/share/containerd/config.toml", FLATCAR_CONTAINERD_CONFIG))
    _write(root, "/usr/bin/containerd", "#!/bin/sh\n", mode=0o755)


def _write_ready(root: Path, machine: Machine) -> None:
    for tool in ("nvidia-container-runtime", "nvidia-container-runtime-hook",
                 "nvidia-container-cli"):  # the toolkit's runtime and its legacy mode's helpers
        _write(root, f"/usr/bin/{tool}", "#!/bin/sh\n", mode=0o755)
    _settle(_write(root, "/etc/containerd/config.toml", FLATCAR_CONTAINERD_CONFIG + NVIDIA_RUNTIME))
    _write(root, "/etc/systemd/system/containerd.service.d/10-gpunode.conf",
           "[Service]\nEnvironment=CONTAINERD_CONFIG=/etc/containerd/config.toml\n")
    from gpunode.containerd import extras, ledger  # what `boot` writes beside the config

    _write(root, ledger.MEMLOCK_DROPIN, extras.MEMLOCK_TEXT)
    socket = root / "var/lib/kubelet/device-plugins/nvidia-gpu.sock"
    socket.parent.mkdir(parents=True, exist_ok=True)
    if not socket.exists():
        os.mknod(socket, stat.S_IFSOCK | 0o600)
    outcome = "ok" if machine.gpus else "no-gpu"
    # the steps of a GPU node's boot, as the pipeline records them
    steps = [{"name": n, "outcome": "ok", "duration_ms": ms, "error": None, "hint": None}
             for n, ms in (("detect", 3.1), ("driver", 412.0), ("gpu_init", 1650.0),
                           ("cdi", 2.2), ("containerd", 18.4))]
    _write(root, "/run/gpunode/state.json", json.dumps(
        {"schema_version": 1, "started_at": "2026-11-29T08:00:01Z",
         "finished_at": "2026-11-29T08:00:02Z", "outcome": outcome,
         "steps": steps if machine.gpus else steps[:1]}, indent=2) + "\n")


def _write_process(root: Path, pid: int, name: str, cmdline: str) -> None:
    # The fields psutil reads: /proc/PID/stat (name in parentheses, then 50 fields), cmdline.
    fields = ["S", "1", str(pid), str(pid)] + ["0"] * 17 + ["1000"] + ["0"] * 30
    _write(root, f"/proc/{pid}/stat", f"{pid} ({name}) {' '.join(fields)}\n")
    _write(root, f"/proc/{pid}/comm", name + "\n")
    _write(root, f"/proc/{pid}/cmdline", cmdline.replace(" ", "\0") + "\0")
    _write(root, f"/proc/{pid}/status", f"Name:\t{name}\nState:\tS (sleeping)\nPid:\t{pid}\n"
           f"PPid:\t1\nUid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\n")


FLATCAR_OS_RELEASE = """\
NAME="Flatcar Container Linux by Kinvolk"
ID=flatcar
ID_LIKE=coreos
VERSION=4459.2.1
VERSION_ID=4459.2.1
BUILD_ID=2025-11-20-0001
SYSEXT_LEVEL=1.0
PRETTY_NAME="Flatcar Container Linux by Kinvolk 4459.2.1 (Oklo)"
ANSI_COLOR="38;5;75"
HOME_URL="https://flatcar.org/"
BUG_REPORT_URL="https://issues.flatcar.org"
FLATCAR_BOARD="amd64-usr"
CPE_NAME="cpe:2.3:o:flatcar-linux:flatcar_linux:4459.2.1:*:*:*:*:*:*:*"
"""

FLATCAR_CONTAINERD_UNIT = """\
[Unit]
Description=containerd container runtime
After=network.target

[Service]
Delegate=yes
Environment=CONTAINERD_CONFIG=/usr/share/containerd/config.toml
ExecStartPre=mkdir -p /run/docker/libcontainerd
ExecStartPre=ln -fs /run/containerd/containerd.sock /run/docker/libcontainerd/docker-containerd.sock
ExecStart=/usr/bin/containerd --config ${CONTAINERD_CONFIG}
KillMode=process
Restart=always
# (lots of restarts are fine: containerd owns no state that a restart loses)
RestartSec=5
LimitNOFILE=1048576
LimitNPROC=infinity
LimitCORE=infinity
TasksMax=infinity
OOMScoreAdjust=-999
Type=notify

[Install]
WantedBy=multi-user.target
"""

FLATCAR_CONTAINERD_CONFIG = """\
version = 2

# persistent data location
root = "/var/lib/containerd"
# runtime state information
state = "/run/containerd"
# set containerd as a subreaper on linux when it is not running as PID 1
subreaper = true
# set containerd's OOM score
oom_score = -999
disabled_plugins = []

# grpc configuration
[grpc]
address = "/run/containerd/containerd.sock"
# socket uid
uid = 0
# socket gid
gid = 0

[plugins."io.containerd.grpc.v1.cri"]
# enable SELinux labeling
enable_selinux = true

[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
# setting runc.options unsets parent settings
runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
SystemdCgroup = true
"""

NVIDIA_RUNTIME = """
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]
runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]
BinaryName = "/usr/bin/nvidia-container-runtime"
SystemdCgroup = true
"""

# The NVIDIA lines of pci.ids for the devices above, in pci.ids' own format.
PCI_IDS_EXCERPT = """\
#	List of PCI ID's (excerpt written by gpunode_testing.fixtures)
10de  NVIDIA Corporation
\t1af1  GA100 [A100 NVSwitch]
\t1db4  GV100GL [Tesla V100 PCIe 16GB]
\t1eb8  TU104GL [Tesla T4]
\t\t10de 12a2  Tesla T4
\t20b2  GA100 [A100 SXM4 80GB]
\t20b5  GA100 [A100 PCIe 80GB]
\t2236  GA102GL [A10]
\t2321  GH100 [H100 NVL]
\t2901  GB100 [B200]
10df  Emulex Corporation
\t0720  OneConnect NIC (Skyhawk)
"""


# -- command line --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpunode_testing.fixtures",
                                     description="Build fixture host trees for gpunode.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="list the machines and their states")
    b = commands.add_parser("build", help="write a machine's host tree into DIR")
    b.add_argument("machine", choices=sorted(MACHINES))
    b.add_argument("dir", type=Path)
    b.add_argument("--state", choices=STATES, default="ready")
    b.add_argument("--extra-functions", type=int, default=0, metavar="N",
                   help="add N non-NVIDIA PCI functions")
    args = parser.parse_args(argv)
    if args.command == "list":
        for m in MACHINES.values():
            print(f"{m.name:20} {'/'.join(m.states):18} {m.description}")
        return 0
    machine = with_extra_functions(MACHINES[args.machine], args.extra_functions)
    if args.state not in machine.states:
        parser.error(f"{machine.name} has states {', '.join(machine.states)}")
    build(machine, args.dir, Options(state=args.state))
    print(f"built {machine.name} ({args.state}) in {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
