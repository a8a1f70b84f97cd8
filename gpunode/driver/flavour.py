"""Which kernel modules a GPU needs: open or proprietary (or GRID), from its PCI device id.

Facts (NVIDIA's open-gpu-kernel-modules README and the peers' choices): the open modules
support Turing and newer only; Blackwell supports only the open modules; NVIDIA recommends
open from R560 on Turing to Hopper, while Azure and Bottlerocket keep T4 (and V100, which is
pre-Turing anyway) on proprietary. Azure's NVadsA10 v5 VMs get vGPU partitions of an A10 that
need NVIDIA's GRID driver.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpunode.errors import FlavourError

if TYPE_CHECKING:
    from gpunode.gpu.detect import PciFunction

# (first device id, last device id, architecture), most specific ranges first.
_ARCH_RANGES: tuple[tuple[int, int, str], ...] = (
    (0x1D80, 0x1DFF, "volta"),  # GV100 (V100)
    (0x15F0, 0x15FF, "pascal"),  # GP100 (P100)
    (0x1340, 0x17FF, "maxwell"),
    (0x1B00, 0x1D7F, "pascal"),
    (0x1E00, 0x1FFF, "turing"),
    (0x2180, 0x21FF, "turing"),
    (0x2000, 0x20FF, "ampere"),
    (0x2200, 0x22FF, "ampere"),
    (0x2300, 0x233F, "hopper"),
    (0x2400, 0x25FF, "ampere"),
    (0x2600, 0x28FF, "ada-lovelace"),
    (0x2900, 0x2FFF, "blackwell"),
)

PRE_TURING = frozenset({"maxwell", "pascal", "volta"})
# Turing and newer GPUs that the peers keep on the proprietary modules by default.
PROPRIETARY_BY_DEFAULT = {"1eb8": "Tesla T4"}
# Device ids that need the GRID driver on Azure VMs (vGPU partitions).
GRID_ON_AZURE = {"2236": "A10 (Azure NVadsA10 v5 vGPU partition)"}
AZURE_VENDOR = "Microsoft Corporation"

FLAVOURS = ("open", "proprietary", "grid")


@dataclass(frozen=True)
class Need:
    """What one GPU needs: `required` flavours it can run, and the one to prefer."""

    address: str
    name: str
    architecture: str
    supported: frozenset[str]
    preferred: str
    why: str


@dataclass(frozen=True)
class FlavourChoice:
    """The one driver flavour for all of the node's GPUs, and why."""

    flavour: str
    reason: str


def architecture(device_id: str | None) -> str:
    if not device_id:
        return "unknown"
    value = int(device_id, 16)
    return next((arch for low, high, arch in _ARCH_RANGES if low <= value <= high), "unknown")


def need(gpu: PciFunction, on_azure: bool) -> Need:
    device = gpu.device_id or ""
    arch = architecture(device)
    name = gpu.product_name or f"10de:{device}"
    if on_azure and device in GRID_ON_AZURE:
        return Need(gpu.address, name, arch, frozenset({"grid"}), "grid",
                    f"{GRID_ON_AZURE[device]} needs the GRID driver")
    if arch in PRE_TURING:
        return Need(gpu.address, name, arch, frozenset({"proprietary", "grid"}), "proprietary",
                    f"{arch} GPUs are supported by the proprietary modules only")
    if arch == "blackwell":
        return Need(gpu.address, name, arch, frozenset({"open", "grid"}), "open",
                    "Blackwell GPUs are supported by the open modules only")
    if device in PROPRIETARY_BY_DEFAULT:
        return Need(gpu.address, name, arch, frozenset(FLAVOURS), "proprietary",
                    f"{PROPRIETARY_BY_DEFAULT[device]} is kept on the proprietary modules, as "
                    "Azure and Bottlerocket do")
    return Need(gpu.address, name, arch, frozenset(FLAVOURS), "open",
                f"{arch} GPUs: NVIDIA recommends the open modules (R560 and later)")


def choose(gpus: tuple[PciFunction, ...], configured: str, on_azure: bool) -> FlavourChoice:
    """One flavour for all GPUs of the node, or a FlavourError that says which GPU objects."""
    needs = [need(g, on_azure) for g in gpus]
    if configured != "auto":
        refusing = [n for n in needs if configured not in n.supported]
        if refusing:
            n = refusing[0]
            raise FlavourError(f"driver.flavour = \"{configured}\" cannot drive {n.name} at "
                               f"{n.address}: {n.why}",
                               f"set driver.flavour to {' or '.join(sorted(n.supported))}, or "
                               "\"auto\"")
        return FlavourChoice(configured, "configured (driver.flavour)")
    unknown = [g.address for g in gpus if g.device_id is None]
    if unknown:
        # Open or proprietary depends on the generation, which only the device id tells:
        # picking one anyway would be a guess that leaves the GPU without a driver.
        raise FlavourError(
            f"cannot choose the driver flavour: the PCI device id of the GPU at "
            f"{', '.join(unknown)} cannot be read ('gpunode detect' shows why), and open or "
            "proprietary modules depend on the GPU's generation",
            "set driver.flavour in the agent config (\"open\" for Turing and newer, "
            "\"proprietary\" for Volta and older), or check the device with "
            "'lspci -nn -s ADDRESS' and the kernel log")
    # GRID is a different driver: auto takes it only where a GPU needs it.
    candidates = {"open", "proprietary"} | {n.preferred for n in needs if n.preferred == "grid"}
    common = frozenset(candidates).intersection(*(n.supported for n in needs))
    if not common:
        names = "; ".join(f"{n.name}: {n.why}" for n in needs)
        raise FlavourError(f"no single driver flavour drives every GPU of this node ({names})",
                           "split these GPUs across node pools, one generation each")
    preferred = {n.preferred for n in needs}
    if len(preferred) == 1 and preferred <= common:
        return FlavourChoice(needs[0].preferred, needs[0].why)
    # Mixed preferences: the first of proprietary, open, grid that every GPU supports.
    flavour = next(f for f in ("proprietary", "open", "grid") if f in common)
    return FlavourChoice(flavour, "mixed GPUs: " + "; ".join(
        f"{n.name} prefers {n.preferred}" for n in needs) + f"; {flavour} drives them all")
