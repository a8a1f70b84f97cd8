"""Which of the driver sysexts baked into the image drives this node's GPUs: a pure choice.

An image for several node pools may carry several of Flatcar's driver sysexts (one branch per
GPU generation). Each GPU rules some out by flavour (gpunode/driver/flavour.py: Blackwell runs
the open modules only, Volta and older the proprietary ones only) and by branch:

- Blackwell needs R570 or later: R570 is the first branch with Blackwell support (NVIDIA's
  R570 release notes; Phoronix, "first public R570 Linux driver build … works with the
  GeForce RTX 5090").
- Maxwell, Pascal and Volta are driven by R580 at the latest: "The release 580 series will be
  the last to support GPUs based on the Maxwell, Pascal, and Volta architectures" (NVIDIA's
  Unix graphics feature deprecation schedule).

Flatcar's own branches start at 535, which drives every other generation in this table; GRID
has no Flatcar sysext at all. Among the sysexts that drive every GPU, the node's flavour
(flavour.choose: the peers' defaults, or driver.flavour) comes first, then the newest branch.
`driver.sysext` pins one: it must be baked and must drive every GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpunode.driver.flavour import Need
from gpunode.errors import DriverError

# Flatcar's driver sysext names (flatcar/scripts build_library/extra_sysexts.sh).
NAME = r"nvidia-drivers-([0-9]{1,6})(-open)?"  # compiled when first used (re keeps it)
SYSEXT_DIR = "/etc/flatcar/sysext"  # where Flatcar's initramfs looks (docs/image-bake.md)
# architecture → (oldest branch that drives it, newest branch that still does); None: no bound.
SUPPORT: dict[str, tuple[int | None, int | None]] = {
    "blackwell": (570, None),
    "volta": (None, 580),
    "pascal": (None, 580),
    "maxwell": (None, 580),
}


@dataclass(frozen=True)
class Baked:
    """One driver sysext baked into the image for the OS version it runs."""

    name: str  # nvidia-drivers-570-open, as enabled-sysext.conf names it
    path: str  # /etc/flatcar/sysext/flatcar-<name>-<VERSION>.raw

    @property
    def branch(self) -> int:
        return int(_match(self.name).group(1))

    @property
    def flavour(self) -> str:
        return "open" if _match(self.name).group(2) else "proprietary"


@dataclass(frozen=True)
class BranchChoice:
    """The baked driver sysext chosen for this node's GPUs, and why."""

    baked: Baked
    reason: str


def driver_path(name: str, version: str) -> str:
    """Where Flatcar's initramfs looks for the driver sysext `name` of OS version `version`."""
    return f"{SYSEXT_DIR}/flatcar-{name}-{version}.raw"


def _match(name: str) -> re.Match[str]:
    match = re.fullmatch(NAME, name)
    if match is None:
        raise ValueError(f"{name!r} is not a Flatcar driver sysext name")
    return match


def objection(baked: Baked, need: Need) -> str | None:
    """Why `baked` cannot drive the GPU of `need`; None when it can."""
    if baked.flavour not in need.supported:
        return f"{need.name} at {need.address}: {need.why}"
    oldest, newest = SUPPORT.get(need.architecture, (None, None))
    if oldest is not None and baked.branch < oldest:
        return f"{need.name} at {need.address}: {need.architecture} GPUs need R{oldest} or later"
    if newest is not None and baked.branch > newest:
        return (f"{need.name} at {need.address}: R{newest} is the last branch that drives "
                f"{need.architecture} GPUs")
    return None


def choose(needs: list[Need], baked: list[Baked], flavour: str, configured_flavour: str,
           pin: str | None) -> BranchChoice:
    """The baked sysext for these GPUs, or a DriverError that says why each one is not."""
    if pin is not None:
        pinned = next((b for b in baked if b.name == pin), None)
        if pinned is None:
            raise DriverError(f"driver.sysext pins {pin}, which is not baked into this image "
                              f"(baked: {', '.join(b.name for b in baked)})",
                              "pin one of the baked sysexts, or bake this one "
                              "(gpunode image bake)")
        baked = [pinned]
    objections: dict[str, str] = {}
    fitting = []
    for b in baked:
        why = next((w for n in needs if (w := objection(b, n)) is not None), None)
        if why is None and configured_flavour not in ("auto", b.flavour):
            why = f"driver.flavour is {configured_flavour}"
        if why is None:
            fitting.append(b)
        else:
            objections[b.name] = why
    if not fitting:
        words = "; ".join(f"{name}: {why}" for name, why in objections.items())
        raise DriverError(f"no driver sysext baked into this image drives this node's GPUs "
                          f"({words})", "bake a branch and flavour these GPUs support (gpunode "
                          "image bake), or unset driver.sysext / driver.flavour")
    best = max(fitting, key=lambda b: (b.flavour == flavour, b.branch))
    if pin is not None:
        why = "pinned by driver.sysext"
    elif best.flavour == flavour:
        why = f"{flavour} modules, the newest baked branch that drives every GPU"
    else:
        why = f"no baked {flavour} branch drives every GPU; {best.flavour} does"
    return BranchChoice(best, f"{best.name} ({why})")
