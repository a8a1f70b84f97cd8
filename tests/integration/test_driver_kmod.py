"""gpunode's load plans, resolved by the real kmod tools on a real module tree (Debian's
kernel plus NVIDIA stand-in modules with real symbol dependencies): modprobe is run with
--dry-run --show-depends, so nothing is loaded, and what it would insmod is asserted. The
plans of a directory of modules, on NVIDIA's real ones: test_driver_modules_real.py."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field

import pytest

from conftest import HostFactory
from gpunode.config import DriverConfig
from gpunode.driver import modules, step
from gpunode.driver.modinfo import ModuleInfo
from gpunode.gpu.detect import detect
from real.kmod_tree import ModuleTree, ensure_module_tree, kmod_tool


@pytest.fixture(scope="module")
def tree() -> ModuleTree:
    return ensure_module_tree()


@dataclass
class DryRunKmod:
    """The real kmod tools against the tree: modinfo for real, modprobe --dry-run, and an
    insmod step resolved as modprobe would (so every call yields the insmod lines it implies)."""

    tree: ModuleTree
    insmods: list[str] = field(default_factory=list)

    def modinfo(self, paths: list[str]) -> dict[str, ModuleInfo]:
        return modules.KmodTools().modinfo(paths)

    def run(self, argv: tuple[str, ...]) -> None:
        if argv[0] == "insmod":  # by path: record it as the kernel would receive it
            self.insmods.append(" ".join(argv))
            return
        done = subprocess.run(
            [kmod_tool("modprobe"), "-C", str(self.tree.modprobe_config), "-d",
             str(self.tree.root), "-S", self.tree.kver, "--dry-run", "--show-depends",
             *argv[1:]], capture_output=True, text=True, check=False)
        if done.returncode:
            from gpunode.platform.command import CommandFailed

            raise CommandFailed(argv, done.returncode, done.stderr)
        self.insmods += [line.strip() for line in done.stdout.splitlines()]


def short(lines: list[str], tree: ModuleTree) -> list[str]:
    return [line.replace(f"{tree.moddir}/", "").replace("insmod ", "") for line in lines]


def test_sysext_plan_resolves_through_real_modprobe_in_dependency_order(
    make_host: HostFactory, tree: ModuleTree
) -> None:
    release = "/usr/lib/extension-release.d/extension-release.flatcar-nvidia-drivers-570"
    host = make_host("nc4as-t4-v3", "bare", extra={release: "ID=flatcar\n"})
    config = DriverConfig(extra_modules=("nvidia_drm",),
                          module_params={"nvidia": "NVreg_EnableGpuFirmware=0"})
    kmod = DryRunKmod(tree)
    the_plan = step.plan(host, config, detect(host), kmod)
    modules.execute(host, the_plan.load, kmod)
    assert short(kmod.insmods, tree) == [
        "extra/nvidia.ko NVreg_EnableGpuFirmware=0",
        "extra/nvidia.ko", "extra/nvidia-uvm.ko",
        "extra/nvidia.ko", "extra/nvidia-modeset.ko",
        "kernel/drivers/gpu/drm/drm.ko", "kernel/drivers/gpu/drm/drm_kms_helper.ko",
        "extra/nvidia.ko", "extra/nvidia-modeset.ko", "extra/nvidia-drm.ko"]


def test_a_module_modprobe_cannot_find_fails_with_its_message(
    make_host: HostFactory, tree: ModuleTree
) -> None:
    host = make_host("nc4as-t4-v3", "bare")
    plan = modules.LoadPlan((modules.LoadStep("nvidia_missing", ("modprobe", "nvidia_missing")),))
    with pytest.raises(modules.LoadError, match="Module nvidia_missing not found in directory"):
        modules.execute(host, plan, DryRunKmod(tree))
