"""driver/modinfo.py: reading `modinfo -0` and deciding whether modules fit, as pure functions.
The real modinfo on the real modules: tests/integration/test_driver_modules_real.py."""

from __future__ import annotations

import pytest

from gpunode.driver import flavour, modinfo
from gpunode.driver.modinfo import ModuleInfo
from gpunode.errors import ModuleRefused
from gpunode.gpu.detect import PciFunction

KERNEL = "6.1.0-50-amd64"
VERMAGIC = f"{KERNEL} SMP preempt mod_unload modversions"
# kmod 30's `modinfo -0 nvidia-uvm.ko nvidia.ko`, shortened: its own fields as "key:  value",
# the .modinfo strings as they are ("key=value"), each ended by NUL
OUTPUT = ("filename:       /m/nvidia-uvm.ko\0version=550.163.01\0license=Dual MIT/GPL\0"
          f"depends=nvidia\0name=nvidia_uvm\0vermagic={VERMAGIC} \0"
          "parm:           uvm_ats_mode:Set to 0 to disable ATS (int)\0"
          "filename:       /m/nvidia.ko\0import_ns=DMA_BUF\0version=550.163.01\0"
          "license=Dual MIT/GPL\0firmware=nvidia/550.163.01/gsp_tu10x.bin\0"
          "firmware=nvidia/550.163.01/gsp_ga10x.bin\0depends=drm\0name=nvidia\0"
          f"vermagic={VERMAGIC} \0")


def info(name: str, license_: str = "Dual MIT/GPL", kernel: str = KERNEL,
         version: str = "550.163.01") -> ModuleInfo:
    return ModuleInfo(f"/m/{name}.ko", f"{kernel} SMP mod_unload", license_, version)


def need(device: str) -> flavour.Need:
    return flavour.need(PciFunction("0001:00:00.0", "10de", device, "10de", "0000", "030200",
                                    "gpu", None, None, None, None), False)


def test_modinfo_output_reads_as_one_record_per_file_with_every_firmware() -> None:
    """Both field shapes kmod writes are read; a file's record starts at its filename."""
    blocks = modinfo.parse(OUTPUT)
    assert [b["filename"] for b in blocks] == [["/m/nvidia-uvm.ko"], ["/m/nvidia.ko"]]
    nvidia = modinfo.from_fields("/m/nvidia.ko", blocks[1])
    assert nvidia == ModuleInfo("/m/nvidia.ko", VERMAGIC, "Dual MIT/GPL", "550.163.01",
                                ("nvidia/550.163.01/gsp_tu10x.bin",
                                 "nvidia/550.163.01/gsp_ga10x.bin"), ("drm",))
    assert modinfo.from_fields("/m/nvidia-uvm.ko", blocks[0]).depends == ("nvidia",)


@pytest.mark.parametrize(("license_", "expected"), [("Dual MIT/GPL", "open"),
                                                     ("NVIDIA", "proprietary")])
def test_nvidia_kos_license_tells_the_flavour(license_: str, expected: str) -> None:
    fit = modinfo.check({"nvidia": info("nvidia", license_)}, KERNEL, [need("20b5")], "auto")
    assert fit is not None and fit.flavour == expected


def test_a_license_of_neither_flavour_is_refused() -> None:
    with pytest.raises(ModuleRefused, match=r"its license is 'GPL', neither the open"):
        modinfo.check({"nvidia": info("nvidia", "GPL")}, KERNEL, [], "auto")


def test_another_kernels_module_is_refused_naming_it_and_both_kernels() -> None:
    with pytest.raises(ModuleRefused, match=r"'/m/nvidia_uvm.ko': its vermagic is '6.6.60-"
                       r"flatcar SMP mod_unload', built for kernel 6.6.60-flatcar, and this "
                       r"node runs 6.1.0-50-amd64"):
        modinfo.check({"nvidia": info("nvidia"), "nvidia_uvm": info("nvidia_uvm",
                                                                    kernel="6.6.60-flatcar")},
                      KERNEL, [], "auto")


def test_modules_of_two_versions_are_refused() -> None:
    with pytest.raises(ModuleRefused, match=r"nvidia_uvm.ko': its version is 550.144.06, not "
                       r"550.163.01, the version of the nvidia.ko"):
        modinfo.check({"nvidia": info("nvidia"), "nvidia_uvm": info("nvidia_uvm",
                                                                    version="550.144.06")},
                      KERNEL, [], "auto")


def test_grid_is_what_proprietary_modules_are_where_grid_is_asked_for() -> None:
    """GRID's nvidia.ko is NVIDIA's proprietary tree too: its license cannot tell them apart."""
    fit = modinfo.check({"nvidia": info("nvidia", "NVIDIA")}, KERNEL, [], "grid")
    assert fit is not None and fit.flavour == "grid"


def test_modules_without_nvidia_ko_decide_no_flavour() -> None:
    """nvidia already loaded, nvidia_uvm still to load: it is checked, no flavour decided."""
    assert modinfo.check({"nvidia_uvm": info("nvidia_uvm")}, KERNEL, [], "auto") is None
