"""A real Debian kernel module tree plus fake NVIDIA modules, for the real kmod tools.

What it is for: gpunode loads the NVIDIA modules with `modprobe` (which resolves dependencies
from modules.dep) or with `insmod` by path after `modinfo -F depends`. Tests must see what the
real depmod/modprobe/modinfo make of a module tree, without loading anything, so they run the
tools against this tree with `modprobe -d ROOT -S KVER --dry-run` and `modinfo -b ROOT -k KVER`.

Where it comes from: Debian bookworm's current generic kernel (`linux-image-amd64` names it)
and the matching `linux-headers-<kver>` for Module.symvers, fetched with the private apt setup
of containerd_bins (own sources list, lists, cache and dpkg status; the machine's apt state is
never touched) and unpacked with `dpkg -x`. Only `lib/modules/<kver>/` of the image is kept.
The generic flavour, not `-cloud-amd64`: the cloud kernel is built without DRM (no drm.ko, no
drm_kms_helper.ko), so nvidia_drm could not depend on the real DRM modules there.

The fake NVIDIA modules (extra/nvidia*.ko) are ELF relocatable objects assembled with `as`,
laid out as the 6.1 kbuild lays out a module, so that depmod finds their dependencies from
symbols exactly as it does for real modules (kmod 30, libkmod-elf.c):

- exports: for each exported symbol, a `__ksymtab` entry (PREL32: value, name, namespace), its
  name in `__ksymtab_strings`, and a `__crc_<sym>` symbol pointing at its CRC in `__kcrctab`.
  The kernel has CONFIG_MODVERSIONS, and depmod takes a module's exports from its `__crc_*`
  symbols when there are any (falling back to `__ksymtab_strings` only when there are none).
- imports: undefined symbols in `.symtab` (here `call <sym>` in init_module), plus `__versions`
  entries (CRC, name) for each one and for module_layout, with the CRCs the real kernel has
  (Module.symvers for vmlinux and the in-tree modules; the fake exports use crc32 of the name).
- `.modinfo`: name, vermagic copied from a real module of the tree, license, version, depends
  (as modpost writes it: file names, so "nvidia-modeset"), parm/parmtype, aliases, firmware.

The build is checked with `depmod -e -E Module.symvers`: any unknown symbol or CRC mismatch is a
warning, and any warning fails the build; then each fake module's modules.dep entry must be
exactly the modules its spec says it depends on. Layout of the cache:

    $GPUNODE_TEST_CACHE/kmod/<kver>/                   (default /var/cache/gpunode-tests)
        lib/modules/<kver>/{kernel,extra,modules.dep,...}   ROOT for modprobe -d / depmod -b
        lib/modules/<kver>/extra/nvidia*.ko                 the fake NVIDIA modules
        Module.symvers, modprobe.d/ (empty: pass as -C), src/ (the fakes' .s files),
        BUILD (the marker, JSON: kver, package, recipe)

It is built in a temporary directory next to it and renamed into place, so a tree that exists
is complete. An flock on kmod/.lock makes concurrent pytest processes build once. A cached tree
is reused without asking the network, as long as BUILD names the recipe of this file (a hash of
its text); an edit of this file rebuilds it. Remove the directory to pick up a newer kernel.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from real import cache
from real.containerd_bins import FETCH_TIMEOUT_S, _private_apt, _run

SUITE = "bookworm"
METAPACKAGE = "linux-image-amd64"  # Depends on linux-image-<kver> of the current ABI

# The version the fake modules claim; no real file of that driver is involved.
FAKE_DRIVER_VERSION = "550.127.05"
FAKE_LICENSE = "Dual MIT/GPL"  # the open kernel modules' license

# A real module of the tree, whose vermagic the fake modules copy.
VERMAGIC_FROM = "kernel/drivers/gpu/drm/drm.ko"

MODULE_STRUCT_SIZE = 0x380  # sizeof(struct module) in Debian's 6.1 (.gnu.linkonce.this_module)
MODULE_NAME_OFFSET = 24  # offsetof(struct module, name) on x86_64
MODVERSION_NAME_LEN = 56  # struct modversion_info: u64 crc + char name[64 - 8]


class KmodTreeError(RuntimeError):
    """The tree could not be built or is not what the recipe says."""


@dataclass(frozen=True)
class FakeModule:
    """One fake NVIDIA module: what it exports, imports and says in .modinfo."""

    file: str  # file name under extra/, e.g. "nvidia-drm.ko"
    exports: tuple[str, ...] = ()
    imports: tuple[str, ...] = ()  # symbols of vmlinux, of real modules or of other fakes
    depends: tuple[str, ...] = ()  # modules (file names, as modpost writes them) imports need
    params: tuple[tuple[str, str, str], ...] = ()  # (name, type, description or "")
    info: tuple[tuple[str, str], ...] = ()  # further .modinfo key=value entries

    @property
    def name(self) -> str:
        """The module name (KBUILD_MODNAME): nvidia-drm.ko is nvidia_drm."""
        return self.file.removesuffix(".ko").replace("-", "_")


NVIDIA_UVM_EXPORTS = (
    "nvUvmInterfaceRegisterUvmCallbacks",
    "nvUvmInterfaceDeRegisterUvmOps",
    "nvUvmInterfaceSessionCreate",
    "nvUvmInterfaceSessionDestroy",
)
NVIDIA_P2P_EXPORTS = (
    "nvidia_p2p_get_pages",
    "nvidia_p2p_put_pages",
    "nvidia_p2p_free_page_table",
    "nvidia_p2p_dma_map_pages",
    "nvidia_p2p_dma_unmap_pages",
)

FAKE_MODULES: tuple[FakeModule, ...] = (
    FakeModule(
        file="nvidia.ko",
        exports=(*NVIDIA_UVM_EXPORTS, "nvidia_get_rm_ops", *NVIDIA_P2P_EXPORTS),
        imports=("_printk", "__pci_register_driver", "pci_unregister_driver"),
        params=(
            ("NVreg_OpenRmEnableUnsupportedGpus", "int", ""),
            ("NVreg_EnableGpuFirmware", "int", ""),
            ("NVreg_RegistryDwords", "charp", ""),
            ("rm_firmware_active", "charp", ""),
        ),
        info=(
            ("alias", "char-major-195-*"),
            ("alias", "pci:v000010DEd*sv*sd*bc03sc00i00*"),
            ("alias", "pci:v000010DEd*sv*sd*bc03sc02i00*"),
            ("firmware", f"nvidia/{FAKE_DRIVER_VERSION}/gsp_ga10x.bin"),
            ("firmware", f"nvidia/{FAKE_DRIVER_VERSION}/gsp_tu10x.bin"),
        ),
    ),
    FakeModule(
        file="nvidia-uvm.ko",
        imports=("_printk", *NVIDIA_UVM_EXPORTS[:3]),
        depends=("nvidia",),
        params=(
            ("uvm_ats_mode", "int", "Set to 0 to disable ATS (Address Translation Services)."),
            ("uvm_disable_hmm", "bool", "Force-disable HMM functionality in the UVM driver."),
        ),
    ),
    FakeModule(
        file="nvidia-modeset.ko",
        exports=("nvKmsKapiGetFunctionsTable",),
        imports=("_printk", "nvidia_get_rm_ops"),
        depends=("nvidia",),
        params=(
            ("output_rounding_fix", "bool", ""),
            ("disable_vrr_memclk_switch", "bool", ""),
        ),
    ),
    FakeModule(
        file="nvidia-drm.ko",
        imports=(
            "_printk",
            "nvKmsKapiGetFunctionsTable",
            # drm.ko
            "drm_dev_alloc",
            "drm_dev_register",
            "drm_dev_unregister",
            "drm_dev_put",
            "drm_mode_config_reset",
            # drm_kms_helper.ko
            "drm_atomic_helper_check",
            "drm_atomic_helper_commit",
            "drm_helper_mode_fill_fb_struct",
            "drm_kms_helper_poll_init",
        ),
        depends=("drm", "drm_kms_helper", "nvidia-modeset"),
        params=(
            (
                "modeset",
                "bool",
                "Enable atomic kernel modesetting (1 = enable, 0 = disable (default))",
            ),
            (
                "fbdev",
                "bool",
                "Create a framebuffer device (1 = enable, 0 = disable (default)) (EXPERIMENTAL)",
            ),
        ),
    ),
    FakeModule(
        file="nvidia-peermem.ko",
        # Upstream ib_core has no ib_register_peer_memory_client (MLNX_OFED only): a real export.
        imports=("_printk", *NVIDIA_P2P_EXPORTS, "ib_register_client", "ib_unregister_client"),
        depends=("ib_core", "nvidia"),
        params=(
            (
                "peerdirect_support",
                "int",
                "Set level of support for Peer-direct, 0 [default] or "
                "1 [legacy, for example MLNX_OFED 4.9 LTS]",
            ),
        ),
    ),
)

NVIDIA_MODULES = tuple(m.name for m in FAKE_MODULES)
FAKE_DIR = "extra"


@dataclass(frozen=True)
class ModuleTree:
    """A built tree, for `modprobe -d root -S kver`, `depmod -b root kver`, `modinfo -b root -k
    kver`; the fake NVIDIA modules are in nvidia_dir."""

    root: Path
    kver: str
    package: str = field(default="", compare=False)  # the kernel .deb it came from

    @property
    def moddir(self) -> Path:
        """root/lib/modules/<kver>: where modules.dep and the modules are."""
        return self.root / "lib" / "modules" / self.kver

    @property
    def nvidia_dir(self) -> Path:
        """The directory of the fake NVIDIA .ko files (a 'modules from a directory' source too)."""
        return self.moddir / FAKE_DIR

    @property
    def symvers(self) -> Path:
        """The kernel's Module.symvers (CRCs of vmlinux and of the in-tree modules' exports)."""
        return self.root / "Module.symvers"

    @property
    def modprobe_config(self) -> Path:
        """An empty config directory: `modprobe -C` it to ignore the machine's modprobe.d."""
        return self.root / "modprobe.d"

    def module_path(self, name: str) -> Path:
        """The fake .ko of an NVIDIA module name ("nvidia_drm" → extra/nvidia-drm.ko)."""
        for module in FAKE_MODULES:
            if module.name == name.replace("-", "_"):
                return self.nvidia_dir / module.file
        raise KeyError(f"{name!r} is not one of the fake NVIDIA modules {NVIDIA_MODULES}")


def kmod_tool(name: str) -> str:
    """Path of a kmod tool (depmod, modprobe, modinfo): in /usr/sbin, which a user's PATH may
    lack. The bare name when it is nowhere, so that running it says what is missing."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    return found or name


def cache_root() -> Path:
    """Where the trees live; GPUNODE_TEST_CACHE moves the whole test cache (CI may cache it)."""
    return cache.root() / "kmod"


def recipe() -> str:
    """What a cached tree must have been built by: a hash of this file's text."""
    return cache.file_recipe(__file__)


def ensure_module_tree() -> ModuleTree:
    """The cached tree, built (fetched, assembled, depmod'ed) the first time; needs no network
    once built."""
    base = cache_root()
    with cache.locked(base):
        tree = _cached(base)
        if tree is None:
            tree = _build(base)
    return tree


def _cached(base: Path) -> ModuleTree | None:
    """The newest complete tree of the current recipe, if any."""
    found = cache.newest(base, recipe(), "kver", "built")
    if found is None:
        return None
    root, built = found
    return ModuleTree(root, built["kver"], built.get("package", ""))


def _build(base: Path) -> ModuleTree:
    """Fetch, unpack, add the fakes and depmod in a temporary directory; rename into place."""
    cache.remove_leftovers(base, "fetch-*", "build-*", "stale-*")
    with tempfile.TemporaryDirectory(dir=base, prefix="fetch-") as tmp_name:
        tmp = Path(tmp_name)
        image, headers, kver = _fetch(tmp)
        staging = Path(tempfile.mkdtemp(dir=base, prefix="build-"))
        try:
            try:
                _assemble_tree(staging, image, headers, kver)
            except FileNotFoundError as err:
                raise KmodTreeError(
                    f"building the kmod tree needs kmod (depmod, modinfo), binutils (as) and "
                    f"dpkg: {err}"
                ) from err
            built = {
                "kver": kver,
                "package": image.name,
                "headers": headers.name,
                "recipe": recipe(),
                "built": time.time(),
            }
            (staging / "BUILD").write_text(json.dumps(built, indent=1) + "\n")
            final = base / kver
            staging.chmod(0o755)  # mkdtemp made it private
            cache.put_in_place(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    cache.drop_others(base, final)  # trees of older recipes (other kernels too) are dead
    return ModuleTree(final, kver, image.name)


def _fetch(tmp: Path) -> tuple[Path, Path, str]:
    """Download linux-image-<kver> and linux-headers-<kver> of Debian SUITE; (image, headers,
    kver)."""
    apt = _private_apt(tmp, SUITE)
    apt_cache = ["apt-cache", *apt[1:]]
    try:
        _run(
            [*apt, "update", "-o", "APT::Update::Error-Mode=any"],
            f"apt-get update for Debian {SUITE} failed (network or mirror down?)",
            timeout=FETCH_TIMEOUT_S,
        )
        shown = _run(
            [*apt_cache, "show", "--no-all-versions", METAPACKAGE],
            f"apt-cache show {METAPACKAGE} (Debian {SUITE}) failed",
        )
        package, version, kver = _image_package(shown)
        _run(
            [*apt, "download", f"{package}={version}", f"linux-headers-{kver}={version}"],
            f"apt-get download {package} linux-headers-{kver} from Debian {SUITE} failed",
            cwd=tmp,
            timeout=FETCH_TIMEOUT_S,
        )
    except FileNotFoundError as err:
        raise KmodTreeError(f"building the kmod tree needs apt-get and dpkg: {err}") from err
    image = _one(tmp, f"{package}_*.deb")
    headers = _one(tmp, f"linux-headers-{kver}_*.deb")
    return image, headers, kver


def _image_package(shown: str) -> tuple[str, str, str]:
    """(package, version, kver) from `apt-cache show` of the metapackage: its Depends."""
    depends = re.search(r"^Depends:\s*(.+)$", shown, re.MULTILINE)
    match = depends and re.match(
        r"(linux-image-(\d[^\s,(]*))\s*\(=\s*([^)\s]+)\)", depends.group(1)
    )
    if not match:
        raise KmodTreeError(f"no 'linux-image-<kver> (= version)' in {METAPACKAGE}:\n{shown}")
    return match.group(1), match.group(3), match.group(2)


def _one(directory: Path, pattern: str) -> Path:
    found = sorted(directory.glob(pattern))
    if len(found) != 1:
        raise KmodTreeError(f"expected one {pattern} in {directory}, found {found}")
    return found[0]


def _assemble_tree(staging: Path, image: Path, headers: Path, kver: str) -> None:
    """Unpack the Debian modules into staging, add the fakes, run depmod and check it all."""
    unpacked = staging / "unpacked"
    unpacked.mkdir()
    _run(["dpkg", "-x", image, unpacked / "image"], f"dpkg -x {image.name} failed")
    _run(["dpkg", "-x", headers, unpacked / "headers"], f"dpkg -x {headers.name} failed")
    modules = unpacked / "image" / "lib" / "modules"
    kvers = sorted(p.name for p in modules.iterdir()) if modules.is_dir() else []
    if kvers != [kver]:
        raise KmodTreeError(f"{image.name} has lib/modules/{kvers}, expected [{kver!r}]")
    symvers_src = unpacked / "headers" / "usr" / "src" / f"linux-headers-{kver}" / "Module.symvers"
    if not symvers_src.is_file():
        raise KmodTreeError(f"{headers.name} has no {symvers_src.relative_to(unpacked)}")
    moddir = staging / "lib" / "modules" / kver
    moddir.parent.mkdir(parents=True)
    (modules / kver).replace(moddir)
    symvers = staging / "Module.symvers"
    symvers_src.replace(symvers)
    shutil.rmtree(unpacked)
    (staging / "modprobe.d").mkdir()
    (staging / "depmod.d").mkdir()

    vermagic = _run(
        [kmod_tool("modinfo"), "-F", "vermagic", moddir / VERMAGIC_FROM],
        f"modinfo of {VERMAGIC_FROM} failed (is kmod installed?)",
    ).rstrip("\n")
    if not vermagic.startswith(kver + " "):
        raise KmodTreeError(f"vermagic {vermagic!r} of {VERMAGIC_FROM} is not for {kver}")
    crcs = _symvers_crcs(symvers)
    fake_dir = moddir / FAKE_DIR
    fake_dir.mkdir()
    for module in FAKE_MODULES:
        source = staging / "src" / (module.file.removesuffix(".ko") + ".s")
        source.parent.mkdir(exist_ok=True)
        source.write_text(module_assembly(module, vermagic, crcs))
        _run(
            ["as", "--64", "-o", fake_dir / module.file, source],
            f"assembling the fake {module.file} failed (is binutils installed?)",
        )

    # -e -E: every undefined symbol must resolve and every CRC match, or depmod warns.
    result = subprocess.run(
        [kmod_tool("depmod"), "-C", staging / "depmod.d", "-b", staging, "-e", "-E", symvers, kver],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode != 0 or result.stderr.strip():
        raise KmodTreeError(
            f"depmod -e -E on the new tree (exit code {result.returncode}) said:\n"
            f"{result.stderr or result.stdout}"
        )
    _check_dependencies(moddir)


def _symvers_crcs(symvers: Path) -> dict[str, int]:
    """symbol → CRC from Module.symvers ("0xcrc\tsymbol\tmodule\texport\tnamespace")."""
    crcs = {}
    for line in symvers.read_text().splitlines():
        fields = line.split("\t")
        if len(fields) >= 3:
            crcs[fields[1]] = int(fields[0], 16)
    return crcs


def fake_crc(symbol: str) -> int:
    """The CRC a fake module's export carries (what genksyms would compute, made up)."""
    return zlib.crc32(symbol.encode())


def module_assembly(module: FakeModule, vermagic: str, kernel_crcs: dict[str, int]) -> str:
    """GNU as source of one fake module; see the module docstring for what depmod reads."""
    fake_crcs = {sym: fake_crc(sym) for m in FAKE_MODULES for sym in m.exports}
    crcs = {**kernel_crcs, **fake_crcs}
    missing = [sym for sym in module.imports if sym not in crcs]
    if missing:
        raise KmodTreeError(f"{module.file} imports {missing}, which nothing in the kernel exports")
    out = [f'\t.file\t"{module.file.removesuffix(".ko")}.c"']

    out += ["", '\t.section\t.text,"ax",@progbits']
    for sym in module.exports:
        out += [
            "\t.p2align 4",
            f"\t.globl\t{sym}",
            f"\t.type\t{sym}, @function",
            f"{sym}:",
            "\txorl\t%eax, %eax",
            "\tret",
            f"\t.size\t{sym}, .-{sym}",
        ]
    out += [
        "",
        '\t.section\t.init.text,"ax",@progbits',
        "\t.globl\tinit_module",
        "\t.type\tinit_module, @function",
        "init_module:",
        *[f"\tcall\t{sym}" for sym in module.imports],  # undefined symbols: the dependencies
        "\txorl\t%eax, %eax",
        "\tret",
        "\t.size\tinit_module, .-init_module",
        '\t.section\t.exit.text,"ax",@progbits',
        "\t.globl\tcleanup_module",
        "\t.type\tcleanup_module, @function",
        "cleanup_module:",
        "\tret",
        "\t.size\tcleanup_module, .-cleanup_module",
    ]

    for sym in module.exports:  # EXPORT_SYMBOL(sym), as include/linux/export.h of 6.1 does it
        out += [
            "",
            '\t.section\t__ksymtab_strings,"aMS",@progbits,1',
            f"__kstrtab_{sym}:",
            f'\t.asciz\t"{sym}"',
            f"__kstrtabns_{sym}:",
            '\t.asciz\t""',
            '\t.section\t__ksymtab,"a"',
            "\t.balign\t4",
            f"__ksymtab_{sym}:",
            f"\t.long\t{sym} - .",
            f"\t.long\t__kstrtab_{sym} - .",
            f"\t.long\t__kstrtabns_{sym} - .",
            '\t.section\t__kcrctab,"a"',
            "\t.balign\t4",
            f"__crc_{sym}:",
            f"\t.long\t{fake_crcs[sym]:#010x}",
        ]

    versions = [s for s in ("module_layout",) if s in kernel_crcs] + list(module.imports)
    out += ["", '\t.section\t__versions,"a"', "\t.balign\t32"]
    for sym in versions:
        if len(sym) >= MODVERSION_NAME_LEN:
            raise KmodTreeError(f"symbol name too long for __versions: {sym}")
        out += [
            f"\t.quad\t{crcs[sym]:#010x}",
            f'\t.ascii\t"{sym}"',
            f"\t.zero\t{MODVERSION_NAME_LEN - len(sym)}",
        ]

    out += ["", '\t.section\t.modinfo,"a"']
    out += [f'\t.asciz\t"{_escape(entry)}"' for entry in modinfo_entries(module, vermagic)]

    out += [
        "",
        '\t.section\t.gnu.linkonce.this_module,"aw",@progbits',
        "\t.balign\t64",
        "\t.globl\t__this_module",
        "\t.type\t__this_module, @object",
        f"\t.size\t__this_module, {MODULE_STRUCT_SIZE}",
        "__this_module:",
        f"\t.zero\t{MODULE_NAME_OFFSET}",
        f'\t.ascii\t"{module.name}"',
        f"\t.zero\t{MODULE_STRUCT_SIZE - MODULE_NAME_OFFSET - len(module.name)}",
        "",
        '\t.section\t.note.GNU-stack,"",@progbits',
        "",
    ]
    return "\n".join(out)


def modinfo_entries(module: FakeModule, vermagic: str) -> list[str]:
    """The .modinfo strings, in the order modinfo shows them for a kbuild module."""
    entries = [f"version={FAKE_DRIVER_VERSION}", f"license={FAKE_LICENSE}"]
    entries += [f"{key}={value}" for key, value in module.info]
    for name, kind, description in module.params:
        if description:
            entries.append(f"parm={name}:{description}")
        entries.append(f"parmtype={name}:{kind}")
    entries += [
        f"srcversion={hashlib.md5(module.file.encode()).hexdigest()[:23].upper()}",
        f"depends={','.join(module.depends)}",
        "retpoline=Y",
        f"name={module.name}",
        f"vermagic={vermagic}",
    ]
    return entries


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def dependency_lines(moddir: Path) -> dict[str, str]:
    """modules.dep lines of the fake NVIDIA modules, by module name."""
    lines = {}
    for line in (moddir / "modules.dep").read_text().splitlines():
        path = line.split(":", 1)[0]
        if path.startswith(FAKE_DIR + "/"):
            lines[_modname(path)] = line
    return lines


def _modname(path: str) -> str:
    return Path(path).name.split(".ko")[0].replace("-", "_")


def _check_dependencies(moddir: Path) -> None:
    """Each fake's modules.dep entry must name exactly the modules of its spec (and theirs)."""
    dep: dict[str, list[str]] = {}
    for line in (moddir / "modules.dep").read_text().splitlines():
        path, _, deps = line.partition(":")
        dep[_modname(path)] = [_modname(d) for d in deps.split()]
    problems = []
    for module in FAKE_MODULES:
        if module.name not in dep:
            problems.append(f"{module.file} is not in modules.dep")
            continue
        direct = {d.replace("-", "_") for d in module.depends}
        closure = set(direct)
        for name in direct:
            closure.update(dep.get(name, []))
        if set(dep[module.name]) != closure:
            problems.append(
                f"{module.name}: modules.dep has {sorted(dep[module.name])}, "
                f"the spec wants {sorted(closure)}"
            )
    if problems:
        raise KmodTreeError("depmod computed other dependencies:\n  " + "\n  ".join(problems))
