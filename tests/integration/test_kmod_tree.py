"""Real kmod tools on a real Debian module tree with fake NVIDIA modules (real/kmod_tree.py).

These pin down what gpunode's loader relies on, as depmod/modprobe/modinfo really behave:
the order `modprobe` loads the NVIDIA modules and the kernel modules they need in, that module
parameters reach the insmod line, what `modinfo -F depends` says (by name and by path), and the
error for a module that is not there. Nothing is loaded: modprobe runs with --dry-run, against
the cached tree (`-d ROOT -S KVER`) and an empty config directory (`-C`), so the machine's own
/lib/modules and /etc/modprobe.d play no part. CI builds the tree beforehand with
tests/real/fetch_kmod_tree.py. A failed build fails these tests: they must not quietly skip.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from real.kmod_tree import (
    FAKE_MODULES,
    NVIDIA_MODULES,
    ModuleTree,
    ensure_module_tree,
    kmod_tool,
)

MODPROBE = kmod_tool("modprobe")
MODINFO = kmod_tool("modinfo")
DEPMOD = kmod_tool("depmod")

DRM = "kernel/drivers/gpu/drm/drm.ko"
DRM_KMS_HELPER = "kernel/drivers/gpu/drm/drm_kms_helper.ko"
IB_CORE = "kernel/drivers/infiniband/core/ib_core.ko"
NVIDIA = "extra/nvidia.ko"
NVIDIA_UVM = "extra/nvidia-uvm.ko"
NVIDIA_MODESET = "extra/nvidia-modeset.ko"
NVIDIA_DRM = "extra/nvidia-drm.ko"
NVIDIA_PEERMEM = "extra/nvidia-peermem.ko"

# A GPU's modalias as udev passes it to modprobe (an H100, class 0302: 3D controller).
GPU_MODALIAS = "pci:v000010DEd00002330sv000010DEsd000016C1bc03sc02i00"


@pytest.fixture(scope="module")
def tree() -> ModuleTree:
    try:
        return ensure_module_tree()
    except Exception as err:  # network, mirror or missing tools: a failure, never a skip
        failure = str(err)
    # Outside the except block: the message once, without a chained traceback.
    pytest.fail(
        f"could not build the kmod test tree (tests/real/kmod_tree.py; run "
        f"tests/real/fetch_kmod_tree.py to see it alone): {failure}",
        pytrace=False,
    )


def modprobe(tree: ModuleTree, *args: str | Path, config: Path | None = None):
    """`modprobe --dry-run` against the tree, with no configuration but `config`."""
    argv = [MODPROBE, "-C", config or tree.modprobe_config, "-d", tree.root, "-S", tree.kver]
    return run([*argv, "--dry-run", *args])


def modinfo(tree: ModuleTree, *args: str | Path):
    return run([MODINFO, "-b", tree.root, "-k", tree.kver, *args])


def run(argv: list[str | Path]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=120, check=False
    )


def insmod_lines(tree: ModuleTree, *modules: str, params: str = "") -> str:
    """What --show-depends prints: one `insmod PATH PARAMS` line per module, the last one with
    the parameters (there is a space after the path even without any)."""
    lines = [f"insmod {tree.moddir / m} " for m in modules]
    lines[-1] += params
    return "".join(line + "\n" for line in lines)


def test_nvidia_drm_loads_after_drm_and_nvidia_modeset(tree: ModuleTree) -> None:
    done = modprobe(tree, "--show-depends", "nvidia_drm")

    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == insmod_lines(
        tree, DRM, DRM_KMS_HELPER, NVIDIA, NVIDIA_MODESET, NVIDIA_DRM
    )


def test_dashes_and_underscores_name_the_same_module(tree: ModuleTree) -> None:
    dashes = modprobe(tree, "--show-depends", "nvidia-drm")

    assert dashes.returncode == 0
    assert dashes.stdout == modprobe(tree, "--show-depends", "nvidia_drm").stdout


def test_nvidia_uvm_loads_after_nvidia(tree: ModuleTree) -> None:
    done = modprobe(tree, "--show-depends", "nvidia_uvm")

    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == insmod_lines(tree, NVIDIA, NVIDIA_UVM)


def test_nvidia_peermem_loads_after_ib_core_and_nvidia(tree: ModuleTree) -> None:
    done = modprobe(tree, "--show-depends", "nvidia_peermem")

    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == insmod_lines(tree, IB_CORE, NVIDIA, NVIDIA_PEERMEM)


def test_nvidia_alone_has_no_dependencies(tree: ModuleTree) -> None:
    done = modprobe(tree, "--show-depends", "nvidia")

    assert (done.returncode, done.stdout) == (0, insmod_lines(tree, NVIDIA))


def test_parameters_go_on_the_modules_own_insmod_line(tree: ModuleTree) -> None:
    nvidia = modprobe(tree, "--show-depends", "nvidia", "NVreg_EnableGpuFirmware=0")
    drm = modprobe(tree, "--show-depends", "nvidia_drm", "modeset=1", "fbdev=1")

    assert nvidia.returncode == 0
    assert nvidia.stdout == insmod_lines(tree, NVIDIA, params="NVreg_EnableGpuFirmware=0")
    assert drm.returncode == 0
    assert drm.stdout == insmod_lines(
        tree, DRM, DRM_KMS_HELPER, NVIDIA, NVIDIA_MODESET, NVIDIA_DRM, params="modeset=1 fbdev=1"
    )


def test_options_from_the_config_reach_the_insmod_line(tree: ModuleTree, tmp_path: Path) -> None:
    (tmp_path / "nvidia.conf").write_text("options nvidia-drm modeset=1\n")

    done = modprobe(tree, "--show-depends", "nvidia_drm", "fbdev=1", config=tmp_path)

    assert done.returncode == 0
    assert done.stdout.splitlines()[-1] == f"insmod {tree.moddir / NVIDIA_DRM} modeset=1 fbdev=1"


def test_modinfo_depends_by_name_and_by_path(tree: ModuleTree) -> None:
    by_name = modinfo(tree, "-F", "depends", "nvidia_drm")
    by_path = run([MODINFO, "-F", "depends", tree.module_path("nvidia_drm")])

    # modpost writes the file names of the modules it depends on: nvidia-modeset, with a dash.
    assert (by_name.returncode, by_name.stdout) == (0, "drm,drm_kms_helper,nvidia-modeset\n")
    assert (by_path.returncode, by_path.stdout) == (0, "drm,drm_kms_helper,nvidia-modeset\n")
    assert modinfo(tree, "-F", "depends", "nvidia").stdout == "\n"  # no dependencies
    assert modinfo(tree, "-F", "depends", "nvidia_peermem").stdout == "ib_core,nvidia\n"


def test_modinfo_shows_the_parameters_and_the_kernels_vermagic(tree: ModuleTree) -> None:
    params = modinfo(tree, "-p", "nvidia_drm")
    nvidia = modinfo(tree, "-p", "nvidia")
    vermagic = modinfo(tree, "-F", "vermagic", "nvidia")
    real_vermagic = run([MODINFO, "-F", "vermagic", tree.moddir / DRM])

    assert params.returncode == 0
    assert params.stdout == (
        "fbdev:Create a framebuffer device (1 = enable, 0 = disable (default)) (EXPERIMENTAL) "
        "(bool)\n"
        "modeset:Enable atomic kernel modesetting (1 = enable, 0 = disable (default)) (bool)\n"
    )
    assert "NVreg_EnableGpuFirmware: (int)" in nvidia.stdout.splitlines()
    assert vermagic.stdout.startswith(tree.kver + " ")
    assert vermagic.stdout == real_vermagic.stdout


def test_missing_module_is_modprobes_fatal_error(tree: ModuleTree) -> None:
    done = modprobe(tree, "--show-depends", "nvidia_nonexistent")

    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr == (
        f"modprobe: FATAL: Module nvidia_nonexistent not found in directory {tree.moddir}\n"
    )


def test_missing_module_is_modinfos_error(tree: ModuleTree) -> None:
    done = modinfo(tree, "-F", "depends", "nvidia_nonexistent")

    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == "modinfo: ERROR: Module nvidia_nonexistent not found.\n"


def test_gpu_modalias_matches_nouveau_and_nvidia_unless_nouveau_is_blacklisted(
    tree: ModuleTree, tmp_path: Path
) -> None:
    both = modprobe(tree, "--show-depends", GPU_MODALIAS)
    (tmp_path / "blacklist-nouveau.conf").write_text("blacklist nouveau\n")
    blacklisted = modprobe(tree, "--show-depends", GPU_MODALIAS, config=tmp_path)

    assert both.returncode == 0
    loaded = [line.split()[1] for line in both.stdout.splitlines()]
    assert str(tree.moddir / "kernel/drivers/gpu/drm/nouveau/nouveau.ko") in loaded
    assert loaded[-1] == str(tree.moddir / NVIDIA)
    assert (blacklisted.returncode, blacklisted.stdout) == (0, insmod_lines(tree, NVIDIA))


def test_plain_depmod_computes_the_same_dependencies_without_warnings(tree: ModuleTree) -> None:
    # -n: the files on stdout, nothing written; -C: no depmod.d of the machine.
    done = run([DEPMOD, "-C", tree.root / "depmod.d", "-n", "-b", tree.root, tree.kver])

    assert (done.returncode, done.stderr) == (0, "")
    fake_paths = {f"extra/{m.file}" for m in FAKE_MODULES}
    computed = [line for line in done.stdout.splitlines() if line.split(":", 1)[0] in fake_paths]
    on_disk = [
        line
        for line in (tree.moddir / "modules.dep").read_text().splitlines()
        if line.split(":", 1)[0] in fake_paths
    ]
    assert computed == on_disk
    assert len(computed) == len(NVIDIA_MODULES)
    assert f"{NVIDIA_DRM}: {NVIDIA_MODESET} {NVIDIA} {DRM_KMS_HELPER} {DRM}" in computed
