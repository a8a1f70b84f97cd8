"""Which way the NVIDIA modules get loaded on this boot: a pure decision from observed facts.

auto, in order: already loaded → verify only; a merged Flatcar driver sysext → modprobe; one
baked into the image that drives the GPUs → merge it, then modprobe; prebuilt modules for the
running kernel → load them; a cached build for this kernel, driver and flavour → load it;
building allowed → build, then load; else fail with a hint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpunode.platform import flatcar

if TYPE_CHECKING:
    from gpunode.driver.branches import BranchChoice

STRATEGIES = ("auto", "flatcar-sysext", "prebuilt", "build", "external")


@dataclass(frozen=True)
class DriverFacts:
    """What the host offers for loading the driver, observed before a strategy is chosen."""

    kernel: str
    loaded_version: str | None  # from /proc/driver/nvidia/version
    merged_sysexts: tuple[str, ...]  # flatcar-nvidia-drivers-* extension names
    prebuilt_dir: str | None  # a directory with nvidia.ko for the running kernel
    cache_entry: str | None  # a usable cached build for kernel + driver + flavour
    build_enabled: bool
    baked: BranchChoice | None = None  # a baked driver sysext to merge, and why this one
    baked_refusal: str | None = None  # why none of the baked driver sysexts drives the GPUs


@dataclass(frozen=True)
class Choice:
    """How the NVIDIA modules get loaded on this boot, and why; action "fail" when nothing can."""

    strategy: str  # the strategy that will act (never "auto")
    action: str  # "verify", "load", "activate" (merge a baked sysext, load), "build", "fail"
    reason: str
    source: str | None = None  # sysext name or module directory
    hint: str = ""


def choose(configured: str, facts: DriverFacts) -> Choice:
    if facts.loaded_version is not None:
        strategy = "external" if configured in ("auto", "external") else configured
        return Choice(strategy, "verify", f"NVIDIA {facts.loaded_version} is already loaded")
    if configured == "external":
        return Choice("external", "fail", "driver.strategy is external, and no NVIDIA driver is "
                      "loaded", hint="whatever owns the driver on this node has not loaded it; "
                      "see its logs, or set driver.strategy = \"auto\"")
    candidates = {
        "flatcar-sysext": _sysext,
        "prebuilt": _prebuilt,
        "build": _cached_or_build,
    }
    if configured != "auto":
        return candidates[configured](facts)
    for name in ("flatcar-sysext", "prebuilt", "build"):
        choice = candidates[name](facts)
        if choice.action != "fail":
            return choice
    baked = f" ({facts.baked_refusal})" if facts.baked_refusal else ""
    return Choice("auto", "fail", f"nothing can provide the NVIDIA modules for kernel "
                  f"{facts.kernel}: no Flatcar driver sysext is merged{baked}, no prebuilt "
                  "modules, no cached build, and building is not enabled",
                  hint="enable the Flatcar driver sysext (driver.sysext, next boot), ship "
                  "modules in a driver.prebuilt_dirs directory, or set driver.build.enabled")


def _sysext(facts: DriverFacts) -> Choice:
    if facts.merged_sysexts:
        name = facts.merged_sysexts[0]
        return Choice("flatcar-sysext", "load", f"the Flatcar driver sysext {name} is merged",
                      source=name)
    if facts.baked:
        return Choice("flatcar-sysext", "activate", f"the driver sysext {facts.baked.reason} "
                      "is baked into the image: merging it, no download",
                      source=f"flatcar-{facts.baked.baked.name}")
    if facts.baked_refusal:
        return Choice("flatcar-sysext", "fail", facts.baked_refusal,
                      hint="bake a driver sysext for these GPUs ('gpunode image bake'), or "
                      "unset driver.sysext / driver.flavour")
    return Choice("flatcar-sysext", "fail", "no flatcar-nvidia-drivers sysext is merged",
                  hint=f"it is enabled in {flatcar.ENABLED_SYSEXT} and the initramfs "
                  "fetches it at the next boot; reboot the node")


def _prebuilt(facts: DriverFacts) -> Choice:
    if facts.prebuilt_dir:
        return Choice("prebuilt", "load", f"prebuilt modules for {facts.kernel} in "
                      f"{facts.prebuilt_dir}", source=facts.prebuilt_dir)
    return Choice("prebuilt", "fail", f"no prebuilt nvidia.ko for kernel {facts.kernel} in "
                  "driver.prebuilt_dirs",
                  hint=f"put the modules under <dir>/{facts.kernel}/ in one of driver."
                  "prebuilt_dirs")


def _cached_or_build(facts: DriverFacts) -> Choice:
    if facts.cache_entry:
        return Choice("build", "load", f"a cached build for {facts.kernel} exists",
                      source=facts.cache_entry)
    if facts.build_enabled:
        return Choice("build", "build", f"no cached build for kernel {facts.kernel}: building "
                      "once (later boots of this kernel load the cache)")
    return Choice("build", "fail", f"no cached build for kernel {facts.kernel}, and "
                  "driver.build.enabled is false",
                  hint="set driver.build.enabled = true (with checksums for the downloads), "
                  "or run 'gpunode driver build'")
