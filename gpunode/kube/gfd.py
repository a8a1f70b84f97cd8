"""The facts behind GFD's hardware labels, as tables with their sources, and the vGPU test.

NVIDIA's GPU feature discovery (NVIDIA/k8s-device-plugin internal/lm) asks NVML; gpunode labels
a node before any container runs, so it looks the same facts up here. A GPU or driver branch
that no table names gets no label: a missing label is honest, a guessed one is not.

- Compute capability and MIG per PCI device id: NVIDIA's "CUDA GPU Compute Capability" table
  (https://developer.nvidia.com/cuda-gpus) and the MIG user guide's "Supported GPUs"
  (https://docs.nvidia.com/datacenter/tesla/mig-user-guide/). GFD: internal/lm/resource.go
  `compute.major`/`compute.minor` from NVML's compute capability; internal/lm/nvml.go
  `mig.capable` true when any GPU is.
- The CUDA version a driver branch supports: the CUDA toolkit release notes, table "CUDA
  Toolkit and Corresponding Driver Versions"
  (https://docs.nvidia.com/cuda/cuda-toolkit-release-notes/): the toolkit each branch shipped
  with, which is what the driver reports (nvidia-smi's "CUDA Version", NVML's CUDA driver
  version). GFD: internal/lm/nvml.go `cuda.runtime-version.{major,minor,full}`.
- `gpu.mode` from the GPUs' PCI class: 0x030000 (VGA) graphics, 0x030200 (3D) compute, mixed
  or other unknown (internal/lm/nvml.go getModeForClasses).
- `vgpu.present`: a vGPU shows in its PCI configuration space a vendor-specific capability
  (id 0x09) whose bytes 3-4 are "VF" (internal/vgpu/vgpu.go IsVGPUDevice, pciutil.go
  GetVendorSpecificCapability); GFD needs all 256 bytes of the standard header (only root
  reads them from sysfs).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    """What NVIDIA's tables say of one GPU model, for GFD's compute and MIG labels."""

    product: str  # as NVIDIA's tables name it (for people reading this table)
    compute: tuple[int, int]
    mig: bool


# PCI device id → the GPU (the GPUs of DESIGN.md §4 and the fixtures' pci.ids).
GPUS: dict[str, Gpu] = {
    "1db4": Gpu("Tesla V100 PCIe 16GB", (7, 0), False),
    "1eb8": Gpu("Tesla T4", (7, 5), False),
    "20b0": Gpu("A100 SXM4 40GB", (8, 0), True),
    "20b2": Gpu("A100 SXM4 80GB", (8, 0), True),
    "20b5": Gpu("A100 PCIe 80GB", (8, 0), True),
    "2236": Gpu("A10", (8, 6), False),
    "2237": Gpu("A10G", (8, 6), False),
    "26b9": Gpu("L40S", (8, 9), False),
    "27b8": Gpu("L4", (8, 9), False),
    "2321": Gpu("H100 NVL", (9, 0), True),
    "2330": Gpu("H100 SXM5 80GB", (9, 0), True),
    "2331": Gpu("H100 PCIe", (9, 0), True),
    "2335": Gpu("H200 SXM 141GB", (9, 0), True),
    "2901": Gpu("B200", (10, 0), True),
}

# Driver branch (the version's first number) → the CUDA version it supports (major, minor).
# R565 is left out: no CUDA toolkit release names it in that table.
CUDA_BY_BRANCH: dict[int, tuple[int, int]] = {
    470: (11, 4), 495: (11, 5), 510: (11, 6), 515: (11, 7), 520: (11, 8), 525: (12, 0),
    530: (12, 1), 535: (12, 2), 545: (12, 3), 550: (12, 4), 555: (12, 5), 560: (12, 6),
    570: (12, 8), 575: (12, 9), 580: (13, 0),
}

CLASS_MODES = {"030000": "graphics", "030200": "compute"}

CONFIG_HEADER = 256  # the standard PCI configuration header GFD reads
_STATUS, _CAP_LIST_BIT, _CAP_POINTER, _VENDOR_CAP = 0x06, 0x10, 0x34, 0x09


def cuda_version(driver_version: str) -> tuple[int, int] | None:
    """The CUDA version the driver's branch supports, or None for a branch no table names."""
    branch = driver_version.partition(".")[0]
    return CUDA_BY_BRANCH.get(int(branch)) if branch.isdigit() else None


def gpu_mode(class_codes: list[str | None]) -> str:
    """GFD's `gpu.mode`: one class for all GPUs decides it, anything else is "unknown"."""
    if not class_codes or len(set(class_codes)) != 1:
        return "unknown"
    return CLASS_MODES.get(class_codes[0] or "", "unknown")


def mig_capable(device_ids: list[str | None]) -> bool | None:
    """True when any GPU is MIG-capable, False when every GPU is known not to be, None when
    an unknown GPU leaves it open."""
    known = [GPUS.get(d or "") for d in device_ids]
    if any(g is not None and g.mig for g in known):
        return True
    return None if any(g is None for g in known) else False


def is_vgpu(config: bytes | None) -> bool | None:
    """Whether a PCI function's configuration space shows NVIDIA's vGPU signature; None when
    it could not be read whole (missing, or the 64 bytes sysfs gives a non-root reader)."""
    if config is None or len(config) < CONFIG_HEADER:
        return None
    if not config[_STATUS] & _CAP_LIST_BIT:
        return False
    seen: set[int] = set()
    position = config[_CAP_POINTER]
    while position and position not in seen and position + 4 < CONFIG_HEADER:
        seen.add(position)
        cap_id, following = config[position], config[position + 1]
        if cap_id == 0xFF:  # a broken chain
            return False
        if cap_id == _VENDOR_CAP:
            return config[position + 3:position + 5] == b"VF"
        position = following
    return False


def vgpu_present(configs: list[bytes | None]) -> bool | None:
    """GFD's `vgpu.present` over every NVIDIA function: True when one is a vGPU, False when all
    were read and none is, None when one could not be read and none is."""
    found = [is_vgpu(c) for c in configs]
    if any(found):
        return True
    return None if any(f is None for f in found) or not found else False
