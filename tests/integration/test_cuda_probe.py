"""A real CUDA program reaches NVIDIA's real libcuda: on this machine, and in a podman container
given GPU 0 by the CDI spec gpunode generates for a node on the real 550 files.

The program (gpunode_testing.cuda_probe) is host code compiled with gcc against PyPI's CUDA
12.9 runtime; it prints the runtime's version, the driver's (read from libcuda) and what
cudaGetDeviceCount answers. This machine has no GPU, so the furthest a working setup gets is
libcuda loaded and asked (driver 12040 for the 550 branch) and no device found
(cudaErrorNoDevice); without libcuda the runtime says cudaErrorInsufficientDriver. In the
container nothing but gpunode's spec brings libcuda and the device nodes: the image has glibc,
busybox, the program and libcudart only. gpunode runs as a process (`cdi generate`); its spec is
re-rooted at the fixture node before podman reads it (gpunode_testing.podman).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpunode_testing import cuda_probe, podman, real_driver
from real.nvidia_driver import ensure_driver
from real.nvidia_modules import ensure_modules

pytestmark = pytest.mark.allow_paths(*cuda_probe.MACHINE_PATHS)

T4 = "nc4as-t4-v3"
CUDA_12_4, CUDA_12_2 = 12040, 12020  # what the 550 and the 535 libcuda answer


@pytest.fixture(scope="module")
def probe() -> cuda_probe.Probe:
    return cuda_probe.ensure_probe()


def libcuda_dir(tmp_path: Path, release: str) -> Path:
    """A directory with the release's real libcuda and its helpers, as a node has them."""
    driver = ensure_driver(release)
    source = real_driver.read_source(driver.root, driver.version)
    real_driver.install_libraries(tmp_path / "lib", source.select(["compute"]))
    return tmp_path / "lib"


def test_without_libcuda_the_runtime_reports_an_insufficient_driver(
        probe: cuda_probe.Probe) -> None:
    """With no driver library to load, the CUDA 12.9 runtime knows its own version only and
    cudaGetDeviceCount answers cudaErrorInsufficientDriver."""
    answer = cuda_probe.run_here(probe, None)
    assert (answer.runtime, answer.driver) == (cuda_probe.RUNTIME_VERSION, 0)
    assert answer.devices_error == "cudaErrorInsufficientDriver"


@pytest.mark.parametrize(("release", "cuda"), [("550", CUDA_12_4), ("535", CUDA_12_2),
                                               ("535-tesla", CUDA_12_2)])
def test_the_real_libcuda_answers_its_cuda_version_and_finds_no_gpu_here(
        probe: cuda_probe.Probe, tmp_path: Path, release: str, cuda: int) -> None:
    """With the real libcuda on the library path the runtime loads it: the driver answers its
    CUDA version, and with no GPU on this machine cudaGetDeviceCount says cudaErrorNoDevice."""
    answer = cuda_probe.run_here(probe, libcuda_dir(tmp_path, release))
    assert (answer.runtime, answer.driver, answer.driver_error) == (
        cuda_probe.RUNTIME_VERSION, cuda, "cudaSuccess")
    assert answer.devices_error == "cudaErrorNoDevice"


@pytest.mark.parametrize("layout", ["sysext", "nvidia.service", "prebuilt", "build"])
def test_a_podman_container_given_gpu_0_by_gpunodes_spec_reaches_the_real_libcuda(
        podman_ready: None, probe: cuda_probe.Probe, source: real_driver.DriverSource,
        tmp_path: Path, layout: str) -> None:
    """In a container whose only driver files are what gpunode's spec mounts (for a T4 node on
    the real 550 user-space in `layout`), the CUDA program loads libcuda, which answers 12040,
    and finds no GPU (this machine has none)."""
    flavour = "proprietary" if layout == "nvidia.service" else "open"
    modules = ensure_modules(flavour).directory if layout in ("prebuilt", "build") else None
    root = real_driver.build_node(T4, tmp_path / "node", source, layout, flavour=flavour,
                                  modules=modules)
    done = subprocess.run([sys.executable, "-m", "gpunode", "--root", str(root), "--log-format",
                           "json", "cdi", "generate"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    spec_dir = tmp_path / "cdi"
    spec_dir.mkdir()
    (spec_dir / "nvidia.yaml").write_text(
        yaml.safe_dump(podman.rerooted(yaml.safe_load(done.stdout), root)))
    rootfs = cuda_probe.make_rootfs(tmp_path / "rootfs", probe)
    rc, out, err = podman.run_with_cdi(spec_dir, "nvidia.com/gpu=0", cuda_probe.command(),
                                       rootfs, tmp_path / "podman")
    assert rc == 0, f"podman exit {rc}\nstdout:\n{out}\nstderr:\n{err}"
    answer = cuda_probe.parse(out)
    assert (answer.runtime, answer.driver) == (cuda_probe.RUNTIME_VERSION, CUDA_12_4), out
    assert answer.devices_error == "cudaErrorNoDevice", out


def test_the_probe_image_is_an_oci_layout_of_the_same_bytes_every_build(
        probe: cuda_probe.Probe, tmp_path: Path) -> None:
    """The image for containerd (`ctr images import`) is an OCI layout whose digest depends on
    its content only, so two builds of one root file system are the same image."""
    rootfs = cuda_probe.make_rootfs(tmp_path / "rootfs", probe)
    first = cuda_probe.build_image(tmp_path / "a.tar", rootfs)
    assert cuda_probe.build_image(tmp_path / "b.tar", rootfs) == first
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()
