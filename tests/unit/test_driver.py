"""The driver step on fixture hosts: flavour, strategy, load order and parameters, device
nodes and verification. Loading a module is impossible here: `FakeKernel` stands in for the
kmod tools and, when nvidia is loaded, makes /proc look as the kernel would (the fixture's
own `load_driver`). tests/integration/test_kmod_tree.py runs the real kmod tools on a real
module tree."""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode.config import BuildConfig, DriverConfig
from gpunode.driver import devices, flavour, step, strategy
from gpunode.driver.modules import LoadError
from gpunode.gpu.detect import PciFunction, detect
from gpunode.platform.host import Host
from gpunode_testing import fixtures
from gpunode_testing.driver_files import OPEN_FIRMWARE, write_build_userspace, write_userspace
from helpers.driver_build import wanted_version
from helpers.fake_kernel import FakeKernel, stand_in_module

T4 = fixtures.MACHINES["nc4as-t4-v3"]
SYSEXT = "flatcar-nvidia-drivers-570"
RELEASE = f"/usr/lib/extension-release.d/extension-release.{SYSEXT}"


def kernel_for(host: Host, machine: fixtures.Machine = T4, **kw: object) -> FakeKernel:
    return FakeKernel(host.root, machine, **kw)


def prebuilt(host: Host, base: str = "/opt/nvidia/modules", machine: fixtures.Machine = T4,
             **module: object) -> str:
    """Stand-in modules of the machine's driver in <base>/<kernel>/ (what they say: `module`,
    see stand_in_module), and their user-space beside them as gpunode's prebuilt layout has it."""
    directory = f"{base}/{fixtures.KERNEL}"
    fields: dict[str, object] = {"version": machine.driver_version,
                                 "flavour": "open" if machine.open_modules else "proprietary",
                                 **module}
    for name in ("nvidia", "nvidia-uvm", "nvidia-modeset", "nvidia-drm", "nvidia-peermem"):
        path = host.root / directory.lstrip("/") / f"{name}.ko"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(stand_in_module(name, **fields))  # type: ignore[arg-type]
    write_userspace(host.root, str(fields["version"]), fields["flavour"] == "open",
                    lib_dir=f"{directory}/lib", bin_dir=f"{directory}/bin",
                    firmware_dir=f"{directory}/firmware/nvidia/{{version}}", dev_link=False)
    return directory


# -- flavour ---------------------------------------------------------------------------------


def gpu(device: str | None, address: str = "0001:00:00.0") -> PciFunction:
    return PciFunction(address, "10de", device, "10de", "0000", "030200", "gpu", None, None, None,
                       None)


@pytest.mark.parametrize(("device", "expected"), [
    ("1db4", "proprietary"),  # V100: pre-Turing
    ("1eb8", "proprietary"),  # T4: kept on proprietary like Azure and Bottlerocket
    ("20b5", "open"),  # A100
    ("2330", "open"),  # H100
    ("26b9", "open"),  # L40S
    ("2901", "open"),  # B200: Blackwell, open only
], ids=["V100", "T4", "A100", "H100", "L40S", "B200"])
def test_auto_flavour_per_gpu(device: str, expected: str) -> None:
    assert flavour.choose((gpu(device),), "auto", on_azure=False).flavour == expected


def test_a10_on_azure_needs_grid() -> None:
    assert flavour.choose((gpu("2236"),), "auto", on_azure=True).flavour == "grid"
    assert flavour.choose((gpu("2236"),), "auto", on_azure=False).flavour == "open"


def test_mixed_t4_and_a100_share_the_proprietary_modules() -> None:
    choice = flavour.choose((gpu("1eb8"), gpu("20b5", "0002:00:00.0")), "auto", False)
    assert choice.flavour == "proprietary"
    assert "mixed GPUs" in choice.reason


def test_mixed_v100_and_b200_cannot_share_a_flavour() -> None:
    with pytest.raises(flavour.FlavourError, match="no single driver flavour"):
        flavour.choose((gpu("1db4"), gpu("2901", "0002:00:00.0")), "auto", False)


@pytest.mark.parametrize(("device", "configured"), [("1db4", "open"), ("2901", "proprietary")],
                         ids=["open-on-V100", "proprietary-on-B200"])
def test_configured_flavour_a_gpu_cannot_run_is_refused(device: str, configured: str) -> None:
    with pytest.raises(flavour.FlavourError, match=f'driver.flavour = "{configured}" cannot'):
        flavour.choose((gpu(device),), configured, False)


def test_configured_open_on_t4_is_honoured() -> None:
    assert flavour.choose((gpu("1eb8"),), "open", False).flavour == "open"


# -- strategy --------------------------------------------------------------------------------


def facts(**kw: object) -> strategy.DriverFacts:
    base = {"kernel": fixtures.KERNEL, "loaded_version": None, "merged_sysexts": (),
            "prebuilt_dir": None, "cache_entry": None, "build_enabled": False}
    return strategy.DriverFacts(**{**base, **kw})


@pytest.mark.parametrize(("given", "strategy_name", "action"), [
    ({"loaded_version": "570.1"}, "external", "verify"),
    ({"merged_sysexts": ("flatcar-nvidia-drivers-570",), "prebuilt_dir": "/p"},
     "flatcar-sysext", "load"),
    ({"prebuilt_dir": "/p", "cache_entry": "/c"}, "prebuilt", "load"),
    ({"cache_entry": "/c", "build_enabled": True}, "build", "load"),
    ({"build_enabled": True}, "build", "build"),
    ({}, "auto", "fail"),
], ids=["loaded", "sysext", "prebuilt", "cache-hit", "build", "nothing"])
def test_auto_picks_the_first_usable_way(given: dict[str, object], strategy_name: str,
                                         action: str) -> None:
    choice = strategy.choose("auto", facts(**given))
    assert (choice.strategy, choice.action) == (strategy_name, action)
    assert choice.reason
    assert choice.action != "fail" or choice.hint


def test_configured_strategy_does_not_fall_through() -> None:
    choice = strategy.choose("prebuilt", facts(cache_entry="/c"))
    assert (choice.strategy, choice.action) == ("prebuilt", "fail")


# -- plan and apply on fixture hosts ---------------------------------------------------------


def test_loaded_driver_is_verified_and_nodes_are_made(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "driver", dev_nodes="plain")
    kernel = kernel_for(host)
    the_plan = step.plan(host, DriverConfig(), detect(host), kernel)
    assert (the_plan.choice.strategy, the_plan.choice.action) == ("external", "verify")
    assert "make /dev/nvidiactl (195:255): not a character device" in the_plan.describe()
    outcome = step.apply(host, the_plan, DriverConfig(), kernel)
    assert kernel.calls == []
    assert outcome.version == "550.127.08"
    assert "/dev/nvidiactl (195:255): not a character device" in outcome.nodes


def test_sysext_modules_are_modprobed_in_order_with_parameters(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "bare", extra={RELEASE: "ID=flatcar\n"})
    config = DriverConfig(extra_modules=("nvidia_drm",),
                          module_params={"nvidia": "NVreg_EnableGpuFirmware=0",
                                         "nvidia_drm": "modeset=1"})
    kernel = kernel_for(host)
    the_plan = step.plan(host, config, detect(host), kernel)
    assert the_plan.choice.source == SYSEXT
    outcome = step.apply(host, the_plan, config, kernel)
    assert kernel.calls == [("modprobe", "nvidia", "NVreg_EnableGpuFirmware=0"),
                            ("modprobe", "nvidia_uvm"), ("modprobe", "nvidia_modeset"),
                            ("modprobe", "nvidia_drm", "modeset=1")]
    assert outcome.loaded == ("nvidia", "nvidia_uvm", "nvidia_modeset", "nvidia_drm")


def test_prebuilt_modules_are_insmodded_after_their_kernel_dependencies(
    make_host: HostFactory,
) -> None:
    host = make_host("nc4as-t4-v3", "bare")
    directory = prebuilt(host)
    config = DriverConfig(extra_modules=("nvidia_drm",))
    kernel = kernel_for(host)
    the_plan = step.plan(host, config, detect(host), kernel)
    assert (the_plan.choice.strategy, the_plan.choice.source) == ("prebuilt", directory)
    step.apply(host, the_plan, config, kernel)
    real = str(host.root) + directory
    assert kernel.calls == [("insmod", f"{real}/nvidia.ko"), ("insmod", f"{real}/nvidia-uvm.ko"),
                            ("insmod", f"{real}/nvidia-modeset.ko"), ("modprobe", "drm"),
                            ("modprobe", "drm_kms_helper"), ("insmod", f"{real}/nvidia-drm.ko")]


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of character devices needs root")
def test_device_nodes_are_real_with_majors_minors_modes_and_char_links(
    make_host: HostFactory,
) -> None:
    machine = fixtures.MACHINES["nd96amsr-a100-v4"]
    host = make_host(machine, "bare", extra={RELEASE: "ID=flatcar\n"})
    kernel = kernel_for(host, machine)
    step.apply(host, step.plan(host, DriverConfig(), detect(host), kernel), DriverConfig(), kernel)
    expected = {"nvidiactl": (195, 255), "nvidia-modeset": (195, 254), "nvidia-uvm": (508, 0),
                "nvidia-uvm-tools": (508, 1), **{f"nvidia{i}": (195, i) for i in range(8)}}
    for name, numbers in expected.items():
        st = os.lstat(host.root / "dev" / name)
        assert stat.S_ISCHR(st.st_mode)
        assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == numbers
        assert stat.S_IMODE(st.st_mode) == 0o666
        link = host.root / f"dev/char/{numbers[0]}:{numbers[1]}"
        assert os.readlink(link) == f"../{name}"
    # idempotent: nothing to redo on a second pass
    assert step.make_nodes(host) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of character devices needs root")
def test_wrong_device_node_is_replaced(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "driver")
    fixtures.make_char_device(host.root, "/dev/nvidia0", 195, 7, real=True)
    assert step.make_nodes(host) == ["/dev/nvidia0 (195:0): is 195:7, expected 195:0"]


def test_mig_capability_nodes_follow_the_driver(make_host: HostFactory) -> None:
    host = make_host("nc24ads-a100-v4", "driver", extra={
        "/proc/driver/nvidia/capabilities/mig/config": "DeviceFileMinor: 1\nDeviceFileMode: 256\n",
        "/proc/driver/nvidia/capabilities/mig/monitor": "DeviceFileMinor: 2\n"})
    majors = {"nvidia-frontend": 195, "nvidia-uvm": 508, "nvidia-caps": 509}
    nodes = devices.wanted(majors, [0], True, devices.capabilities(host))
    assert [n.path for n in nodes][-2:] == ["/dev/nvidia-caps/nvidia-cap1",
                                            "/dev/nvidia-caps/nvidia-cap2"]


def test_missing_uvm_major_is_a_clear_error() -> None:
    with pytest.raises(devices.MissingMajor, match="no nvidia-uvm major"):
        devices.wanted({"nvidia": 195}, [0], False, {})


def test_failed_load_keeps_stderr_and_the_kernels_nvrm_lines(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "bare")
    prebuilt(host)
    kernel = kernel_for(host, fail="nvidia")
    the_plan = step.plan(host, DriverConfig(), detect(host), kernel)
    with pytest.raises(LoadError) as info:
        step.apply(host, the_plan, DriverConfig(), kernel)
    message = str(info.value)
    assert "Failed to load 'nvidia': insmod: ERROR: could not insert 'nvidia'" in message
    assert "kernel: NVRM: API mismatch: the client has the version 570.1" in message
    assert "usb" not in message


def test_nouveau_stops_the_step_before_anything_is_loaded(make_host: HostFactory) -> None:
    host = make_host("t4-nouveau", "bare")
    with pytest.raises(step.DriverError, match="nouveau module is loaded") as info:
        step.plan(host, DriverConfig(), detect(host), kernel_for(host))
    assert "blacklist nouveau" in info.value.hint


def test_nothing_usable_fails_with_a_hint(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "bare")
    with pytest.raises(step.DriverError, match="nothing can provide") as info:
        step.plan(host, DriverConfig(), detect(host), kernel_for(host))
    assert "driver.build.enabled" in info.value.hint


def test_sysext_strategy_enables_the_sysext_for_the_next_boot(make_host: HostFactory) -> None:
    host = make_host("nc24ads-a100-v4", "bare")
    config = DriverConfig(strategy="flatcar-sysext")
    the_plan = step.plan(host, config, detect(host), kernel_for(host))
    assert the_plan.sysext_line == "nvidia-drivers-570-open"
    with pytest.raises(step.DriverError, match=r"was added to /etc/flatcar/enabled-sysext\.conf"):
        step.apply(host, the_plan, config, kernel_for(host))
    assert (host.root / "etc/flatcar/enabled-sysext.conf").read_text() == \
        "nvidia-drivers-570-open\n"
    # Until the reboot: listed but not merged, a plain failure, and the line is not added twice.
    with pytest.raises(step.DriverError, match="no flatcar-nvidia-drivers sysext is merged"):
        step.plan(host, config, detect(host), kernel_for(host))
    assert (host.root / "etc/flatcar/enabled-sysext.conf").read_text() == \
        "nvidia-drivers-570-open\n"


def test_gpu_the_driver_does_not_see_fails_verification(make_host: HostFactory) -> None:
    machine = fixtures.MACHINES["nd96amsr-a100-v4"]
    host = make_host(machine, "bare", extra={RELEASE: "ID=flatcar\n"})
    broken = replace(machine, functions=tuple(f for f in machine.functions
                                              if f.address != "0003:00:00.0"))
    kernel = FakeKernel(host.root, broken)  # the driver comes up without one GPU
    the_plan = step.plan(host, DriverConfig(), detect(host), kernel)
    with pytest.raises(step.DriverError, match=r"the driver does not see 0003:00:00\.0"):
        step.apply(host, the_plan, DriverConfig(), kernel)


def test_build_enabled_without_cache_plans_a_build(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "bare")
    config = DriverConfig(build=BuildConfig(enabled=True))
    the_plan = step.plan(host, config, detect(host), kernel_for(host))
    assert (the_plan.choice.strategy, the_plan.choice.action) == ("build", "build")
    assert the_plan.describe()[1] == (f"build nvidia, nvidia_uvm, nvidia_modeset for "
                                      f"{fixtures.KERNEL}, then check and load them")


# -- build strategy through the step ---------------------------------------------------------


@dataclass
class ModuleBuilder:
    """A builder that 'compiles' by writing module files and the user-space build.sh extracts;
    the real one needs a Flatcar node."""

    calls: int = 0

    def build(self, workdir: Path, dev_container: Path, driver_installer: Path, kernel: str,
              flavour: str, out_dir: Path) -> None:
        self.calls += 1
        version = wanted_version(workdir)
        for name in ("nvidia", "nvidia-uvm", "nvidia-modeset"):
            firmware = (tuple(f"nvidia/{version}/{f}" for f in OPEN_FIRMWARE)
                        if name == "nvidia" else ())
            (out_dir / f"{name}.ko").write_bytes(stand_in_module(
                name, version=version, flavour=flavour, kernel=kernel, firmware=firmware))
        write_build_userspace(out_dir, version)


def build_config(host: Host) -> DriverConfig:
    import bz2
    import hashlib

    from gpunode.config import BuildConfig

    mirror = host.root / "srv/mirror"
    mirror.mkdir(parents=True)
    image = bz2.compress(b"developer container image")
    (mirror / "dev.bin.bz2").write_bytes(image)
    (mirror / "driver.run").write_bytes(b"#!/bin/sh\n# NVIDIA installer\n")
    return DriverConfig(build=BuildConfig(
        enabled=True, dev_container_url="file:///srv/mirror/dev.bin.bz2",
        dev_container_sha512=hashlib.sha512(image).hexdigest(),
        driver_url="/srv/mirror/driver.run",
        driver_sha256=hashlib.sha256(b"#!/bin/sh\n# NVIDIA installer\n").hexdigest()))


def test_build_once_then_every_later_boot_loads_the_cache(make_host: HostFactory) -> None:
    from gpunode.driver import builders

    host = make_host("nc4as-t4-v3", "bare")
    config = build_config(host)
    builder = ModuleBuilder()
    adapters = (builders.UrlFetcher(host), builder)

    kernel = kernel_for(host)
    first = step.plan(host, config, detect(host), kernel)
    assert first.choice.action == "build"
    outcome = step.apply(host, first, config, kernel, adapters)
    entry = f"/opt/gpunode/drivers/{fixtures.KERNEL}/{config.version}-proprietary"
    assert outcome.source == entry
    assert builder.calls == 1
    assert [argv[0] for argv in kernel.calls] == ["insmod"] * 3

    # The next boot of the same kernel: the driver is gone again (a reboot), the cache is not.
    rebooted = make_host("nc4as-t4-v3", "bare")
    shutil.copytree(host.root / "opt/gpunode", rebooted.root / "opt/gpunode", symlinks=True)
    second = step.plan(rebooted, config, detect(rebooted), kernel_for(rebooted))
    assert (second.choice.action, second.choice.source) == ("load", entry)
    step.apply(rebooted, second, config, kernel_for(rebooted), adapters)
    assert builder.calls == 1


def test_driver_autoloaded_without_uvm_gets_the_missing_modules(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "driver", extra={RELEASE: "ID=flatcar\n"})
    modules_file = host.root / "proc/modules"
    modules_file.write_text("".join(line + "\n" for line in modules_file.read_text().splitlines()
                                    if not line.startswith("nvidia_uvm ")))
    kernel = kernel_for(host)
    the_plan = step.plan(host, DriverConfig(), detect(host), kernel)
    assert the_plan.choice.action == "verify"
    assert the_plan.load.describe() == ["modprobe nvidia_uvm"]
    step.apply(host, the_plan, DriverConfig(), kernel)
    assert kernel.calls == [("modprobe", "nvidia_uvm")]


def test_auto_flavour_refuses_a_gpu_whose_device_id_cannot_be_read() -> None:
    with pytest.raises(flavour.FlavourError, match=r"PCI device id of the GPU at 0001:00:00.0"):
        flavour.choose((gpu(None),), "auto", False)


def test_a_pinned_flavour_drives_a_gpu_whose_device_id_cannot_be_read() -> None:
    assert flavour.choose((gpu(None),), "open", False).flavour == "open"
