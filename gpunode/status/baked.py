"""A baked image as status and plan see it: the bake manifest (/etc/gpunode/baked.json), and
whether the node still runs what was baked.

The driver sysext of a bake is the file of one Flatcar version
(/etc/flatcar/sysext/flatcar-<name>-<VERSION>.raw): after an OS update without a re-bake the
initramfs finds no file for the new VERSION and downloads one at boot, and the baked modules
no longer match the running kernel. That is a warning (the node still works, with a download),
never a failure. The same for the baked prebuilt module sets and builds (gpunode/bake/
optional.py): modules of one kernel each, which a node running another kernel cannot load
(`kernel_drift`). No manifest: no check at all (a node provisioned by Ignition).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpunode.bake import manifest
from gpunode.errors import GpunodeError
from gpunode.platform import kernelinfo
from gpunode.platform.host import Host
from gpunode.status.facts import OK, WARN, Check, Failure


@dataclass(frozen=True)
class BakeFacts:
    """A baked image as status sees it: the bake manifest, and what the node runs now."""

    baked: manifest.Baked | None
    error: Failure | None  # the manifest is there but cannot be read
    kernel: str | None  # the running kernel
    os_version: str | None  # the node's Flatcar version now
    missing: tuple[str, ...] = ()  # baked artifacts no longer in place


def observe(host: Host) -> BakeFacts | None:
    """None when the image was not baked (no manifest)."""
    try:
        baked = manifest.load(host)
    except GpunodeError as exc:
        return BakeFacts(None, Failure.of(exc), None, None)
    if baked is None:
        return None
    kernel = (host.read_optional(kernelinfo.RELEASE) or "").strip() or None
    missing = tuple(a.path for a in baked.artifacts if host.lstat(a.path) is None)
    return BakeFacts(baked, None, kernel, manifest.os_version(host), missing)


def check(facts: BakeFacts | None) -> list[Check]:
    if facts is None:
        return []
    if facts.baked is None:
        return [Check("bake", WARN, f"bake manifest unreadable: {facts.error}",
                      "bake the image again ('gpunode image bake') to rewrite it",
                      facts.error.code if facts.error else None)]
    baked = facts.baked
    drift = mismatch(facts)
    if drift:
        return [Check("bake", WARN, f"baked {baked.describe()}, but {drift}: the driver "
                      "sysext for this version is downloaded at boot",
                      "bake the image again for this OS version ('gpunode image bake')")]
    other = kernel_drift(facts)
    if other:
        return [Check("bake", WARN, f"baked {baked.describe()}, but {other}: its modules do "
                      "not load on this kernel, and the node needs another driver source (a "
                      "download or a compile at boot)",
                      "bake the image again for this kernel ('gpunode image bake')")]
    if facts.missing:
        return [Check("bake", WARN, f"baked {baked.describe()}, but {', '.join(facts.missing)} "
                      "is gone", "bake the image again ('gpunode image bake')")]
    return [Check("bake", OK, f"baked {baked.describe()}: no download at boot")]


def mismatch(facts: BakeFacts) -> str | None:
    """How the running node differs from what was baked, or None."""
    baked = facts.baked
    if baked is None or not baked.drivers():
        return None
    if baked.kernel and facts.kernel and baked.kernel != facts.kernel:
        return f"the running kernel is {facts.kernel}, not the baked {baked.kernel}"
    if baked.os_version and facts.os_version and baked.os_version != facts.os_version:
        return f"the node runs Flatcar {facts.os_version}, not the baked {baked.os_version}"
    return None


def kernel_drift(facts: BakeFacts) -> str | None:
    """The running kernel is none of those the baked prebuilt sets and builds are for."""
    bound = facts.baked.kernel_bound() if facts.baked else ()
    kernels = sorted({str(a.kernel) for a in bound})
    if not kernels or not facts.kernel or facts.kernel in kernels:
        return None
    return (f"the running kernel is {facts.kernel}, not {' or '.join(kernels)} (the baked "
            f"{' and '.join(sorted({a.what.replace('-', ' ') for a in bound}))})")


def plan_note(host: Host) -> str | None:
    """The line `plan` prints for a baked image, None for one that is not."""
    facts = observe(host)
    if facts is None:
        return None
    if facts.baked is None:
        return f"bake: manifest unreadable: {facts.error}"
    drift = mismatch(facts)
    if drift:
        return f"bake: baked {facts.baked.describe()}, but {drift}: a download at boot"
    other = kernel_drift(facts)
    if other:
        return f"bake: baked {facts.baked.describe()}, but {other}: not used"
    return f"bake: baked {facts.baked.describe()}: baked, no download"
