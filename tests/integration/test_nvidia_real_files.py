"""What NVIDIA's real driver files are, as Debian ships them and as they compile here.

These pin down the facts gpunode's driver handling is built on, read from the real files
(tests/real/nvidia_driver.py fetches Debian's 550 and 535 packages, Tesla 535 too;
tests/real/nvidia_modules.py compiles the 550 module sources against the kmod tree's kernel):
which libraries a full install
has per NVIDIA_DRIVER_CAPABILITIES set, their SONAMEs (the names the dynamic loader asks for),
the GSP firmware the modules name, and what modinfo, depmod and modprobe read from the modules.
CI fetches and compiles beforehand (make fetch-nvidia); a failed fetch fails these tests.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gpunode_testing import real_driver
from real.kmod_tree import kmod_tool
from real.nvidia_driver import ensure_driver
from real.nvidia_modules import BuiltModules, module_tree

MODINFO = kmod_tool("modinfo")
MODPROBE = kmod_tool("modprobe")

# Each 550 library by capability, as read_source classifies the real files (file stems).
LIBRARIES_550 = {
    "utility": {"libnvidia-ml", "libnvidia-cfg"},
    "compute": {"libcuda", "libcudadebugger", "libnvidia-opencl", "libnvidia-gpucomp",
                "libnvidia-ptxjitcompiler", "libnvidia-allocator", "libnvidia-pkcs11-openssl3",
                "libnvidia-nvvm"},
    "video": {"libvdpau_nvidia", "libnvidia-encode", "libnvidia-opticalflow", "libnvcuvid"},
    "graphics": {"libnvidia-eglcore", "libnvidia-glcore", "libnvidia-tls", "libnvidia-glsi",
                 "libnvidia-fbc", "libnvidia-rtcore", "libnvoptix", "libGLX_nvidia",
                 "libEGL_nvidia", "libGLESv2_nvidia", "libGLESv1_CM_nvidia",
                 "libnvidia-glvkspirv", "libnvidia-api"},
    "ngx": {"libnvidia-ngx"},
    "display": {"libglxserver_nvidia"},
}
# SONAMEs other than lib<name>.so.1: the full version (no link is ever made for those), or
# another major number. libglxserver_nvidia (an X server module) has none.
FULL_VERSION_SONAME = {"libnvidia-gpucomp", "libnvidia-pkcs11-openssl3", "libnvidia-eglcore",
                       "libnvidia-glcore", "libnvidia-glsi", "libnvidia-glvkspirv",
                       "libnvidia-rtcore", "libnvidia-tls"}
OTHER_SONAMES = {"libnvidia-nvvm": "libnvidia-nvvm.so.4", "libEGL_nvidia": "libEGL_nvidia.so.0",
                 "libGLX_nvidia": "libGLX_nvidia.so.0",
                 "libGLESv2_nvidia": "libGLESv2_nvidia.so.2", "libglxserver_nvidia": None}
# Each module's license by flavour: the license of nvidia.ko tells the flavour.
LICENSES = {
    "open": {"nvidia.ko": "Dual MIT/GPL", "nvidia-uvm.ko": "Dual MIT/GPL",
             "nvidia-modeset.ko": "Dual MIT/GPL", "nvidia-drm.ko": "Dual MIT/GPL",
             "nvidia-peermem.ko": "Dual BSD/GPL"},
    "proprietary": {"nvidia.ko": "NVIDIA", "nvidia-uvm.ko": "Dual MIT/GPL",
                    "nvidia-modeset.ko": "NVIDIA", "nvidia-drm.ko": "MIT",
                    "nvidia-peermem.ko": "Linux-OpenIB"},
}
DEPENDS = {"nvidia.ko": "drm", "nvidia-uvm.ko": "nvidia", "nvidia-modeset.ko": "video,nvidia",
           "nvidia-drm.ko": "drm,drm_kms_helper,nvidia-modeset",
           # without MLNX_OFED's peer-memory API in ib_core, peermem builds as an empty shell
           "nvidia-peermem.ko": ""}


def modinfo(field: str, path: Path) -> list[str]:
    out = subprocess.run([MODINFO, "-F", field, str(path)], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return out.splitlines()


def test_a_full_550_install_has_27_versioned_libraries_10_of_them_compute_and_utility(
        source: real_driver.DriverSource) -> None:
    """Debian's 550 user-space, classified by NVIDIA_DRIVER_CAPABILITIES set as libnvidia-
    container does, is 27 `lib*.so.<version>` libraries (+ the X server's module and
    libnvidia-api.so.1), of which compute and utility are 10."""
    found = {cap: {lib.stem for lib in source.select([cap])} for cap in real_driver.ALL}
    assert found == LIBRARIES_550
    versioned = [lib for lib in source.select(real_driver.ALL)
                 if lib.name.endswith(f".so.{source.version}")
                 and lib.capability != "display"]
    assert len(versioned) == 27
    assert len(source.select(real_driver.DEFAULT_CAPABILITIES)) == 10


def test_the_sonames_are_what_the_loader_asks_for_not_one_rule(
        source: real_driver.DriverSource) -> None:
    """Most SONAMEs are lib<name>.so.1, but eight libraries carry the full version as their
    SONAME (libnvidia-gpucomp, libnvidia-pkcs11-openssl3 among them), nvvm is .so.4, EGL and
    GLX .so.0, GLESv2 .so.2: a `.so.1` name for those is one the loader never asks for."""
    for lib in source.libraries:
        if lib.stem in FULL_VERSION_SONAME:
            expected: str | None = lib.name
        else:
            expected = OTHER_SONAMES.get(lib.stem, f"{lib.stem}.so.1")
        assert lib.soname == expected, lib.name


def test_libcuda_asks_the_loader_for_its_helpers_by_their_sonames(
        source: real_driver.DriverSource) -> None:
    """libcuda's DT_NEEDED entries are glibc's only; the driver libraries it needs it
    dlopen()s by name, and each name is that library's SONAME: libnvidia-ptxjitcompiler.so.1,
    libnvidia-nvvm.so.4 and libnvidia-pkcs11-openssl3.so.<version>, the full version."""
    libs = {lib.stem: lib for lib in source.libraries}
    dynamic = subprocess.run(["readelf", "-d", str(libs["libcuda"].path)], capture_output=True,
                             text=True, check=True, timeout=60).stdout
    needed = {line.split("[")[1].rstrip("]") for line in dynamic.splitlines() if "(NEEDED)" in line}
    assert needed <= {"libm.so.6", "libc.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
                      "ld-linux-x86-64.so.2"}
    strings = set(subprocess.run(["strings", str(libs["libcuda"].path)], capture_output=True,
                                 text=True, check=True, timeout=120).stdout.splitlines())
    for helper in ("libnvidia-ptxjitcompiler", "libnvidia-nvvm", "libnvidia-pkcs11-openssl3"):
        assert libs[helper].soname in strings, helper


@pytest.mark.parametrize("release", ["535", "535-tesla"])
def test_the_535_branch_has_libcuda_nvml_and_nvidia_smi(release: str) -> None:
    """Debian's 535 gives a second branch, as bookworm's driver and as trixie's Tesla 535
    (packages with a tesla-535 infix): libcuda, NVML, nvidia-smi and the GSP firmware, all of
    one 535 version."""
    driver = ensure_driver(release)
    source = real_driver.read_source(driver.root, driver.version)
    assert driver.version.startswith("535.")
    stems = {lib.stem: lib.soname for lib in source.libraries}
    assert stems["libcuda"] == "libcuda.so.1" and stems["libnvidia-ml"] == "libnvidia-ml.so.1"
    assert "nvidia-smi" in source.binaries
    assert [f.name for f in source.firmware] == ["gsp_ga10x.bin", "gsp_tu10x.bin"]


def test_the_modules_carry_vermagic_license_version_and_the_firmware_debian_ships(
        compiled: BuiltModules, source: real_driver.DriverSource) -> None:
    """Each compiled module says, in its .modinfo, the kernel it was built for, its flavour's
    license and the driver version; nvidia.ko names exactly the GSP firmware files Debian's
    firmware-nvidia-gsp ships (both flavours name them)."""
    for name, license_ in LICENSES[compiled.flavour].items():
        path = compiled.module(name)
        (vermagic,) = modinfo("vermagic", path)
        assert vermagic.split()[0] == compiled.kernel, name
        assert modinfo("license", path) == [license_], name
        assert modinfo("version", path) == [source.version], name
        assert modinfo("depends", path) == [DEPENDS[name]], name
    firmware = sorted(modinfo("firmware", compiled.module("nvidia")))
    assert firmware == sorted(f"nvidia/{source.version}/{f.name}" for f in source.firmware)


def test_the_modules_are_stripped_of_debug_info_as_distributions_ship_them(
        compiled: BuiltModules) -> None:
    """Stripped, every module is smaller than what the compiler left (and keeps its .modinfo,
    see above); the open nvidia.ko, all of it compiled here, shrinks more than tenfold, the
    proprietary one is mostly NVIDIA's prebuilt object, which has no debug info to lose."""
    sizes = compiled.build["modules"]
    assert isinstance(sizes, dict)
    for name, size in sizes.items():
        assert compiled.module(name).stat().st_size == size["stripped"] < size["unstripped"]
    if compiled.flavour == "open":
        assert sizes["nvidia.ko"]["stripped"] * 10 < sizes["nvidia.ko"]["unstripped"]


def test_real_modprobe_loads_the_real_modules_after_the_kernel_modules_they_need(
        compiled: BuiltModules, tmp_path: Path) -> None:
    """depmod reads the real modules' symbol dependencies: modprobe would load drm and its
    helpers, then nvidia, then nvidia-modeset (after video), then nvidia-drm."""
    root = module_tree(compiled, tmp_path / "tree")
    out = subprocess.run([MODPROBE, "-C", str(root / "modprobe.d"), "-d", str(root), "-S",
                          compiled.kernel, "--dry-run", "--show-depends", "nvidia_drm"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    order = [Path(line.split()[1]).name for line in out.splitlines()
             if line.startswith("insmod ")]
    assert order[-3:] == ["nvidia.ko", "nvidia-modeset.ko", "nvidia-drm.ko"], out
    for kernel_module in ("drm.ko", "drm_kms_helper.ko", "video.ko"):
        assert order.index(kernel_module) < order.index("nvidia-drm.ko"), out
    assert order.index("drm.ko") < order.index("nvidia.ko"), out
