"""The driver step on NVIDIA's real 550 modules: what it reads of them, what it would load and
in which order, and what it refuses, checked against the real kmod tools.

The modules are Debian's 550 sources compiled here for Debian's 6.1.0-50-amd64
(tests/real/nvidia_modules.py); the nodes are fixture nodes (gpunode_testing.real_driver) whose
running kernel is that release and whose driver files are Debian's real ones, in gpunode's
layouts. gpunode reads the modules with the real `modinfo` (KmodTools); nothing is loaded:
`DryRun` records each insmod and resolves each modprobe with the real
`modprobe --dry-run --show-depends` on a module tree holding the same modules (module_tree),
where the real `depmod -b` computed their dependencies.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpunode.config import DriverConfig
from gpunode.driver import firmware, modules, step
from gpunode.driver.modinfo import ModuleInfo
from gpunode.errors import CommandFailed, FirmwareMissing, ModuleRefused
from gpunode.gpu.detect import detect
from gpunode.platform.host import Host
from gpunode_testing import fixtures, real_driver
from real.kmod_tree import kmod_tool
from real.nvidia_modules import BuiltModules, ensure_modules, module_tree

A100 = "nc24ads-a100-v4"  # open modules by default (Ampere)
T4 = "nc4as-t4-v3"  # proprietary by default, runs open too (flavour.py)
V100 = "nc6s-v3"  # Volta: proprietary modules only
PARAMETER = "/sys/module/firmware_class/parameters/path"
PREBUILT = "/opt/nvidia/modules"
WANTED = ("nvidia", "nvidia_uvm", "nvidia_modeset", "nvidia_drm")


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory, open_modules: BuiltModules) -> Path:
    """Debian's module tree with the real open modules in extra/, depmod'ed (-e -E)."""
    return module_tree(open_modules, tmp_path_factory.mktemp("tree"))


@dataclass
class DryRun:
    """The real modinfo (KmodTools); each insmod recorded with the firmware search path as it
    was then (loading nvidia makes the fixture show a loaded driver, as FakeKernel does); each
    modprobe resolved by the real modprobe --dry-run on `tree`."""

    root: Path
    machine: fixtures.Machine
    kernel: str
    tree: Path | None = None
    calls: list[tuple[str, ...]] = field(default_factory=list)
    parameter: list[str] = field(default_factory=list)  # firmware_class.path at each call
    resolved: list[str] = field(default_factory=list)

    def modinfo(self, paths: list[str]) -> dict[str, ModuleInfo]:
        return modules.KmodTools().modinfo(paths)

    def run(self, argv: tuple[str, ...]) -> None:
        self.calls.append(argv)
        self.parameter.append((self.root / PARAMETER.lstrip("/")).read_text())
        if argv[0] == "modprobe" and self.tree is not None:
            done = subprocess.run([kmod_tool("modprobe"), "-C", str(self.tree / "modprobe.d"),
                                   "-d", str(self.tree), "-S", self.kernel, "--dry-run",
                                   "--show-depends", *argv[1:]],
                                  capture_output=True, text=True, check=False, timeout=60)
            if done.returncode:
                raise CommandFailed(argv, done.returncode, done.stderr)
            self.resolved += [Path(line.split()[1]).name for line in done.stdout.splitlines()
                              if line.startswith("insmod ")]
        if argv[0] == "insmod" and Path(argv[1]).name == "nvidia.ko":
            fixtures.load_driver(self.root, self.machine)


def node(tmp_path: Path, source: real_driver.DriverSource, built: BuiltModules, *,
         machine: str = A100, layout: str = "prebuilt", kernel: str | None = None,
         flavour: str | None = None) -> Host:
    """A bare fixture node (no driver loaded) running the modules' kernel (or `kernel`), with
    the real modules and user-space in `layout`."""
    root = real_driver.build_node(machine, tmp_path / machine, source, layout, state="bare",
                                  modules=built.directory, flavour=flavour or built.flavour,
                                  kernel=kernel or built.kernel)
    return Host(root)


def kmod_for(host: Host, machine: str, built: BuiltModules, tree: Path | None = None) -> DryRun:
    return DryRun(host.root, fixtures.MACHINES[machine], built.kernel, tree)


def modinfo(field_name: str, path: Path) -> list[str]:
    out = subprocess.run([kmod_tool("modinfo"), "-F", field_name, str(path)],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return out.splitlines()


# -- what gpunode reads, and what the kmod tools say --------------------------------------------


def test_gpunode_reads_what_the_real_modinfo_reads(tmp_path: Path,
                                                   source: real_driver.DriverSource,
                                                   compiled: BuiltModules) -> None:
    """Through KmodTools, each module's vermagic, license, version, firmware and depends are
    exactly what `modinfo -F` prints for it, for both flavours."""
    paths = [str(compiled.module(m)) for m in (*WANTED, "nvidia_peermem")]
    infos = modules.KmodTools().modinfo(paths)
    for path in paths:
        info = infos[path]
        assert info.vermagic == modinfo("vermagic", Path(path))[0].strip()
        assert [info.license] == modinfo("license", Path(path))
        assert [info.version] == modinfo("version", Path(path)) == [source.version]
        assert list(info.firmware) == modinfo("firmware", Path(path))
        assert ",".join(info.depends) == modinfo("depends", Path(path))[0].replace("-", "_")
    assert sorted(infos[paths[0]].firmware) == sorted(
        f"nvidia/{source.version}/{f.name}" for f in source.firmware)


def test_the_plan_loads_in_the_order_depmod_and_modprobe_resolve(
        tmp_path: Path, source: real_driver.DriverSource, open_modules: BuiltModules,
        tree: Path) -> None:
    """The prebuilt plan insmods the NVIDIA modules in the order real modprobe would load them
    from a depmod'ed tree, after a modprobe of each kernel module their .modinfo names (drm,
    video): each of those is in the module's modules.dep line, and resolving them with the
    real modprobe --dry-run loads them (and what they need) before the NVIDIA module."""
    host = node(tmp_path, source, open_modules)
    kmod = kmod_for(host, A100, open_modules, tree)
    config = DriverConfig(extra_modules=("nvidia_drm",))
    the_plan = step.plan(host, config, detect(host), kmod)
    base = f"{PREBUILT}/{open_modules.kernel}"
    assert [" ".join(s.argv) for s in the_plan.load.steps] == [
        "modprobe drm", f"insmod {base}/nvidia.ko", f"insmod {base}/nvidia-uvm.ko",
        "modprobe video", f"insmod {base}/nvidia-modeset.ko", "modprobe drm_kms_helper",
        f"insmod {base}/nvidia-drm.ko"]
    shown = subprocess.run([kmod_tool("modprobe"), "-C", str(tree / "modprobe.d"), "-d",
                            str(tree), "-S", open_modules.kernel, "--dry-run", "--show-depends",
                            "nvidia_drm", "nvidia_uvm"],
                           capture_output=True, text=True, check=True, timeout=60).stdout
    order = [Path(line.split()[1]).name for line in shown.splitlines()
             if line.startswith("insmod ")]
    nvidia_order = [n for n in order if n.startswith("nvidia")]
    planned = [Path(s.argv[1]).name for s in the_plan.load.steps if s.argv[0] == "insmod"]
    assert [n for n in planned if n in nvidia_order] == [
        n for n in nvidia_order if n in planned] == ["nvidia.ko", "nvidia-modeset.ko",
                                                     "nvidia-drm.ko"], shown
    dep = (tree / "lib/modules" / open_modules.kernel / "modules.dep").read_text()
    for insmod, kernel_module in (("nvidia.ko", "drm.ko"), ("nvidia-modeset.ko", "video.ko"),
                                  ("nvidia-drm.ko", "drm_kms_helper.ko")):
        line = next(x for x in dep.splitlines() if x.startswith(f"extra/{insmod}:"))
        assert f"/{kernel_module}" in line, line
    modules.execute(host, the_plan.load, kmod)
    for kernel_module in ("drm.ko", "video.ko", "drm_kms_helper.ko"):
        assert kernel_module in kmod.resolved


def test_prebuilt_open_modules_get_the_firmware_path_beside_them(
        tmp_path: Path, source: real_driver.DriverSource, compiled: BuiltModules) -> None:
    """The kernel finds no nvidia/550.163.01/gsp_*.bin on the node; prebuilt modules of
    either flavour (both name it) bring it in firmware/ beside them: the plan points the
    kernel's firmware search path there, and boot writes it before it insmods nvidia.ko."""
    machine = A100 if compiled.flavour == "open" else T4
    host = node(tmp_path, source, compiled, machine=machine)
    kmod = kmod_for(host, machine, compiled)
    the_plan = step.plan(host, DriverConfig(), detect(host), kmod)
    came_with = f"{PREBUILT}/{compiled.kernel}/firmware"
    names = ", ".join(sorted(f"nvidia/{source.version}/{f.name}" for f in source.firmware))
    assert the_plan.describe()[1] == (f"set the kernel's firmware search path ({PARAMETER}) "
                                      f"to {came_with} (for {names})")
    assert the_plan.flavour.flavour == compiled.flavour
    assert f"nvidia.ko's license '{'Dual MIT/GPL' if compiled.flavour == 'open' else 'NVIDIA'}'" \
        in the_plan.flavour.reason
    outcome = step.apply(host, the_plan, DriverConfig(), kmod)
    first = next(i for i, argv in enumerate(kmod.calls) if argv[0] == "insmod")
    assert kmod.parameter[first] == came_with  # set before nvidia.ko loads
    assert outcome.flavour == compiled.flavour


def test_proprietary_modules_told_to_run_without_gsp_need_no_firmware(
        tmp_path: Path, source: real_driver.DriverSource) -> None:
    """With NVreg_EnableGpuFirmware=0 the proprietary modules run without GSP firmware, as
    NVIDIA's driver container also skips the path then: no firmware, no refusal."""
    built = ensure_modules("proprietary")
    host = node(tmp_path, source, built, machine=T4)
    shutil.rmtree(host.path(f"{PREBUILT}/{built.kernel}/firmware"))
    config = DriverConfig(module_params={"nvidia": firmware.GSP_OFF})
    the_plan = step.plan(host, config, detect(host), kmod_for(host, T4, built))
    assert the_plan.firmware is None
    assert the_plan.load.steps[1].argv[-1] == firmware.GSP_OFF


# -- refusals ------------------------------------------------------------------------------------


def test_open_modules_for_a_t4_configured_proprietary_are_refused_by_name(
        tmp_path: Path, source: real_driver.DriverSource, open_modules: BuiltModules) -> None:
    """A T4 node pinned to the proprietary modules (driver.flavour) is offered the open ones:
    refused, naming nvidia.ko and its license, before anything is loaded."""
    host = node(tmp_path, source, open_modules, machine=T4)
    kmod = kmod_for(host, T4, open_modules)
    path = f"{PREBUILT}/{open_modules.kernel}/nvidia.ko"
    with pytest.raises(ModuleRefused, match=re.escape(
            f"Refused to load '{path}': its license is 'Dual MIT/GPL', so these are the open "
            "modules, and driver.flavour is \"proprietary\"")):
        step.plan(host, DriverConfig(flavour="proprietary"), detect(host), kmod)
    assert kmod.calls == []


def test_open_modules_on_a_t4_under_auto_load_and_report_open(
        tmp_path: Path, source: real_driver.DriverSource, open_modules: BuiltModules) -> None:
    """Under driver.flavour = "auto" a T4 prefers the proprietary modules but runs the open ones
    (flavour.py): the open modules shipped for it load, and the flavour reported is theirs."""
    host = node(tmp_path, source, open_modules, machine=T4)
    the_plan = step.plan(host, DriverConfig(), detect(host), kmod_for(host, T4, open_modules))
    assert the_plan.flavour.flavour == "open"
    assert re.search(r"T4.* prefers proprietary, runs open too", the_plan.flavour.reason)


def test_open_modules_for_a_v100_are_refused_by_name(
        tmp_path: Path, source: real_driver.DriverSource, open_modules: BuiltModules) -> None:
    """A V100 (Volta) cannot run the open modules at all: refused, naming nvidia.ko, its
    license and the GPU."""
    host = node(tmp_path, source, open_modules, machine=V100, flavour="open")
    with pytest.raises(ModuleRefused, match=r"nvidia\.ko': its license is 'Dual MIT/GPL', so "
                       r"these are the open modules, and the .*V100.* at 0001:00:00\.0 cannot "
                       r"run them: volta GPUs are supported by the proprietary modules only"):
        step.plan(host, DriverConfig(), detect(host), kmod_for(host, V100, open_modules))


def test_modules_of_another_kernel_filed_under_the_running_one_are_refused_by_name(
        tmp_path: Path, source: real_driver.DriverSource, open_modules: BuiltModules) -> None:
    """Modules built for 6.1.0-50-amd64, filed under /opt/nvidia/modules/6.12.102-flatcar/ on a
    node running 6.12.102-flatcar: refused, naming the file and both kernels."""
    host = node(tmp_path, source, open_modules, kernel="6.12.102-flatcar")
    kmod = kmod_for(host, A100, open_modules)
    with pytest.raises(ModuleRefused, match=re.escape(
            f"Refused to load '{PREBUILT}/6.12.102-flatcar/nvidia.ko': its vermagic is "
            "'6.1.0-50-amd64 SMP preempt mod_unload modversions', built for kernel "
            "6.1.0-50-amd64, and this node runs 6.12.102-flatcar")):
        step.plan(host, DriverConfig(), detect(host), kmod)
    assert kmod.calls == []


def test_modules_whose_firmware_is_nowhere_are_refused_by_name(
        tmp_path: Path, source: real_driver.DriverSource, open_modules: BuiltModules) -> None:
    """Prebuilt open modules shipped without their firmware, on a node whose /lib/firmware has
    none either: refused, naming nvidia.ko and the file it asks for."""
    host = node(tmp_path, source, open_modules)
    shutil.rmtree(host.path(f"{PREBUILT}/{open_modules.kernel}/firmware"))
    with pytest.raises(FirmwareMissing, match=re.escape(
            f"{PREBUILT}/{open_modules.kernel}/nvidia.ko names the firmware "
            f"nvidia/{source.version}/gsp_")):
        step.plan(host, DriverConfig(), detect(host), kmod_for(host, A100, open_modules))


def test_a_firmware_path_someone_else_set_is_kept_and_the_modules_refused(
        tmp_path: Path, source: real_driver.DriverSource, open_modules: BuiltModules) -> None:
    """firmware_class.path already names another directory without the firmware: gpunode
    refuses with a hint and leaves the parameter as it was."""
    host = node(tmp_path, source, open_modules)
    host.path(PARAMETER).write_text("/vendor/firmware\n")
    with pytest.raises(step.DriverError, match="already set to /vendor/firmware; gpunode does "
                       "not overwrite it"):
        step.plan(host, DriverConfig(), detect(host), kmod_for(host, A100, open_modules))
    assert host.path(PARAMETER).read_text() == "/vendor/firmware\n"


# -- the other layouts ---------------------------------------------------------------------------


def test_a_build_cache_entry_labelled_with_another_flavour_is_refused(
        tmp_path: Path, source: real_driver.DriverSource, open_modules: BuiltModules) -> None:
    """A cache entry of the proprietary flavour whose nvidia.ko is the open one (its manifest
    and checksums are right: a mislabelled build) is refused by nvidia.ko's license."""
    host = node(tmp_path, source, open_modules, machine=T4, layout="build",
                flavour="proprietary")
    config = DriverConfig(version=source.version, strategy="build")
    with pytest.raises(ModuleRefused, match=r"license is 'Dual MIT/GPL', so these are the open "
                       r"modules, not the proprietary ones their source says they are"):
        step.plan(host, config, detect(host), kmod_for(host, T4, open_modules))


def test_a_build_cache_entrys_modules_load_with_its_firmware(
        tmp_path: Path, source: real_driver.DriverSource, open_modules: BuiltModules) -> None:
    """The real modules in a real cache entry: checked, and the kernel pointed at the entry's
    firmware/ before nvidia.ko loads."""
    host = node(tmp_path, source, open_modules, layout="build")
    config = DriverConfig(version=source.version, strategy="build")
    the_plan = step.plan(host, config, detect(host), kmod_for(host, A100, open_modules))
    entry = f"/opt/gpunode/drivers/{open_modules.kernel}/{source.version}-open"
    assert (the_plan.choice.action, the_plan.choice.source) == ("load", entry)
    assert the_plan.firmware is not None and the_plan.firmware.path == f"{entry}/firmware"


def test_a_merged_sysexts_modules_are_read_where_it_put_them(
        tmp_path: Path, source: real_driver.DriverSource, compiled: BuiltModules) -> None:
    """The Flatcar driver sysext's modules in /usr/lib/modules/<kernel>/video/ are checked like
    any others (a -open sysext with proprietary modules is refused); its firmware is in
    /lib/firmware, where the kernel finds it: no search path to set."""
    host = node(tmp_path, source, compiled, layout="sysext", flavour="open")
    kmod = kmod_for(host, A100, compiled)
    if compiled.flavour == "open":
        the_plan = step.plan(host, DriverConfig(), detect(host), kmod)
        assert the_plan.firmware is None and the_plan.flavour.flavour == "open"
        assert [s.argv[0] for s in the_plan.load.steps] == ["modprobe"] * 3
    else:
        with pytest.raises(ModuleRefused, match=r"/usr/lib/modules/.*/video/nvidia\.ko': its "
                           r"license is 'NVIDIA', so these are the proprietary modules, not "
                           r"the open ones"):
            step.plan(host, DriverConfig(), detect(host), kmod)


def test_a_module_missing_beside_a_loaded_driver_is_checked_before_modprobe(
        tmp_path: Path, source: real_driver.DriverSource, open_modules: BuiltModules) -> None:
    """udev loaded nvidia, never nvidia_uvm: the step modprobes what is missing from the
    merged sysext, after reading it where the sysext put it: modules of another kernel are
    refused by name there too."""
    root = real_driver.build_node(A100, tmp_path / "node", source, "sysext", state="driver",
                                  modules=open_modules.directory, kernel="6.12.102-flatcar")
    proc_modules = root / "proc/modules"
    proc_modules.write_text("".join(line + "\n" for line in proc_modules.read_text().splitlines()
                                    if not line.startswith("nvidia_uvm ")))
    host = Host(root)
    with pytest.raises(ModuleRefused, match=re.escape(
            "Refused to load '/usr/lib/modules/6.12.102-flatcar/video/nvidia-uvm.ko': its "
            "vermagic is '6.1.0-50-amd64 SMP preempt mod_unload modversions'")):
        step.plan(host, DriverConfig(), detect(host), kmod_for(host, A100, open_modules))
