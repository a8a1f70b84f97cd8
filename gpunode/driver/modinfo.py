"""What each NVIDIA module says about itself (its `.modinfo`), and whether that fits this node.

Every `.ko` carries a `.modinfo` section of `key=value` strings that modpost writes: `vermagic`
(the kernel release the module was built for, then its build options), `license`, `version`,
`firmware` (each file it asks the kernel's firmware loader for) and `depends` (the modules it
needs, by file name). The kernel refuses a module whose vermagic is not its own only at insmod
time, with "Exec format error"; reading it first lets gpunode refuse by name, before anything
is loaded, and report the flavour the modules really are.

Read with kmod's `modinfo -0 FILE…`: the same library that loads the modules reads them, so a
compressed `.ko.xz`/`.ko.zst` reads as the kernel's module loader would see it. Given a path of
an existing regular `*.ko*` file, modinfo reads that file and nothing of the running kernel
(kmod tools/modinfo.c `is_module_filename`); a path it cannot read would be taken for a module
*name* and looked up in the running kernel's tree, so callers pass only files they found, and
each answer's `filename` must be the path asked for.

Facts the checks rest on (DESIGN.md §4, read from Debian's 550 modules compiled here):
nvidia.ko's license is "Dual MIT/GPL" for the open modules and "NVIDIA" for the proprietary
ones (nvidia-uvm is "Dual MIT/GPL" in both, so only nvidia.ko tells); vermagic starts with the
kernel release (`6.1.0-50-amd64 SMP preempt mod_unload modversions`); every module of one
build has the driver's version; nvidia.ko of both flavours names `nvidia/<version>/gsp_*.bin`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpunode.driver import flavour as flavours
from gpunode.errors import ModuleRefused

# nvidia.ko's license → the flavour of the modules (GRID's nvidia.ko is NVIDIA's proprietary
# tree too: the license cannot tell it from the proprietary driver).
LICENSE_FLAVOURS = {"Dual MIT/GPL": "open", "NVIDIA": "proprietary"}


@dataclass(frozen=True)
class ModuleInfo:
    """One module file's .modinfo, as far as gpunode checks it."""

    path: str  # host path of the file
    vermagic: str
    license: str | None
    version: str | None
    firmware: tuple[str, ...] = ()  # "nvidia/550.163.01/gsp_ga10x.bin", relative to a search dir
    depends: tuple[str, ...] = ()  # module names, "-" as "_"

    @property
    def kernel(self) -> str:
        """The kernel release the module was built for: vermagic's first word."""
        return self.vermagic.split(" ", 1)[0]


@dataclass(frozen=True)
class Fit:
    """Modules found fit to load: their flavour and version, and why that flavour."""

    flavour: str
    version: str
    reason: str


def parse(text: str) -> list[dict[str, list[str]]]:
    """`modinfo -0 FILE…` output → one {field: [values]} per file, in order. Each field ends
    with NUL; kmod 30 writes the .modinfo strings as they are (`key=value`) and its own
    fields (`filename`, `parm`) as `key:<padding>value`. A file's fields start with
    `filename`."""
    blocks: list[dict[str, list[str]]] = []
    for field in text.split("\0"):
        match = _FIELD.match(field.lstrip("\n"))
        if match is None:
            continue
        key, value = match.groups()
        if key == "filename":
            blocks.append({})
        if blocks:
            blocks[-1].setdefault(key, []).append(value.strip())
    return blocks


_FIELD = re.compile(r"([A-Za-z0-9_.-]+)(?::[ \t]*|=)(.*)", re.DOTALL)


def from_fields(path: str, fields: Mapping[str, list[str]]) -> ModuleInfo:
    """A ModuleInfo of one file's fields (parse()'s block, or a test's)."""
    def one(key: str) -> str | None:
        values = fields.get(key) or []
        return values[0] if values else None

    depends = [d.strip().replace("-", "_") for v in fields.get("depends", []) for d in v.split(",")]
    return ModuleInfo(path=path, vermagic=one("vermagic") or "", license=one("license"),
                      version=one("version"), firmware=tuple(fields.get("firmware", [])),
                      depends=tuple(d for d in depends if d))


# -- the checks (pure) ---------------------------------------------------------------------------


def flavour_of(info: ModuleInfo) -> str:
    """The flavour nvidia.ko's license says; ModuleRefused for a license of neither."""
    found = LICENSE_FLAVOURS.get(info.license or "")
    if found is None:
        raise ModuleRefused(info.path, "license", repr(info.license),
                            "neither the open modules' ('Dual MIT/GPL') nor the proprietary "
                            "ones' ('NVIDIA')", "is this NVIDIA's nvidia.ko?")
    return found


def check(infos: Mapping[str, ModuleInfo], kernel: str, needs: Iterable[flavours.Need],
          configured: str, claimed: str | None = None,
          version: str | None = None) -> Fit | None:
    """Whether the modules about to load (name → info, nvidia among them or already loaded)
    fit this node: each built for `kernel`, all of one version (`version` when the source
    names one: a cache entry), and nvidia.ko's flavour one every GPU can run, the configured
    one (driver.flavour, unless "auto") and the one their source claims (a cache entry's, a
    sysext's name). The Fit (None when nvidia.ko is not among them); ModuleRefused naming
    the file and both values otherwise."""
    for info in infos.values():
        if info.kernel != kernel:
            raise ModuleRefused(info.path, "vermagic", repr(info.vermagic),
                                f"built for kernel {info.kernel or '(none)'}, and this node "
                                f"runs {kernel}", _REBUILD)
    nvidia = infos.get("nvidia")
    expected = version or (nvidia.version if nvidia else None)
    for info in infos.values():
        if expected is not None and info.version != expected:
            wanted = (f"not {expected}, the version of the {'source' if version else 'nvidia.ko'}"
                      " it came with")
            raise ModuleRefused(info.path, "version", str(info.version), wanted,
                                "ship the modules of one driver version together, with their "
                                "user-space")
    if nvidia is None or not nvidia.version:
        return None
    found = flavour_of(nvidia)
    reported = ("grid" if found == "proprietary" and "grid" in (configured, claimed)
                else found)
    said = f"nvidia.ko's license '{nvidia.license}': the {found} modules"
    if claimed is not None and _family(claimed) != found:
        raise ModuleRefused(nvidia.path, "license", repr(nvidia.license),
                            f"so these are the {found} modules, not the {claimed} ones their "
                            "source says they are", "rebuild them ('gpunode driver build') or "
                            "replace them")
    if configured != "auto" and _family(configured) != found:
        raise ModuleRefused(nvidia.path, "license", repr(nvidia.license),
                            f"so these are the {found} modules, and driver.flavour is "
                            f"\"{configured}\"", f"ship the {configured} modules, or set "
                            f"driver.flavour = \"{found}\" (or \"auto\")")
    notes = []
    for need in needs:
        if reported not in need.supported:
            raise ModuleRefused(nvidia.path, "license", repr(nvidia.license),
                                f"so these are the {found} modules, and the {need.name} at "
                                f"{need.address} cannot run them: {need.why}",
                                f"ship the {' or '.join(sorted(need.supported - {'grid'}))} "
                                "modules for this node")
        if need.preferred != reported:
            notes.append(f"{need.name} prefers {need.preferred}, runs {reported} too")
    return Fit(reported, nvidia.version, said + (f" ({'; '.join(dict.fromkeys(notes))})"
                                                 if notes else ""))


def _family(flavour: str) -> str:
    """The kernel source tree of a flavour: GRID is built from the proprietary one."""
    return "open" if flavour == "open" else "proprietary"


_REBUILD = ("modules are built for one kernel release: ship (or build) them for the running "
            "kernel, under <prebuilt dir>/<uname -r>/")
