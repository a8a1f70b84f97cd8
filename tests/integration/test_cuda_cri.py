"""A CUDA program in a Kubernetes pod reaches NVIDIA's real libcuda through gpunode's CDI spec.

The T4 fixture node carries Debian's real 550 user-space in the Flatcar driver sysext layout
(gpunode_testing.real_driver) and boots in the real-systemd namespace with containerd 2.1
(gpunode_testing.cri, as tests/integration/test_cri_containerd.py does): gpunode.service
configures containerd and writes the CDI spec, then the test makes the kubelet's calls over the
CRI socket. The container's image (gpunode_testing.cuda_probe) has glibc, busybox, libcudart and
a host-only CUDA program; nothing of the driver. Given `nvidia.com/gpu=0` through CRI's
CDIDevices, the program loads the real libcuda (driver 12040) and, this machine having no GPU,
finds no device (cudaErrorNoDevice); without the device the runtime finds no driver at all.
One file of the node is a stand-in: nvidia-smi (see `node`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpunode_testing import cri, cuda_probe, fixtures, real_driver
from gpunode_testing.cri import CriNode
from gpunode_testing.systemd_ns import MACHINE_PATHS
from real.containerd_bins import ensure_binary
from real.nvidia_driver import ensure_driver

pytestmark = pytest.mark.allow_paths(*MACHINE_PATHS, *cuda_probe.MACHINE_PATHS)

T4 = "nc4as-t4-v3"
CUDA_12_4 = 12040  # what the 550 libcuda answers


@pytest.fixture(scope="module")
def node() -> Iterator[CriNode]:
    """The T4 node on the real 550 files, booted once, with the CUDA image imported."""
    driver = ensure_driver("550")
    source = real_driver.read_source(driver.root, driver.version)
    containerd = ensure_binary("2")
    workdir = cri.work_directory("cuda-cri")
    try:
        rootfs = cuda_probe.make_rootfs(workdir / "cuda-rootfs", cuda_probe.ensure_probe())
        cuda_probe.build_image(workdir / "cuda.tar", rootfs)

        def build(root: Path, options: fixtures.Options) -> None:
            real_driver.build_node(T4, root, source, "sysext", options=options)

        with cri.cri_node(workdir, T4, containerd.path, build=build,
                          images=[workdir / "cuda.tar"]) as booted:
            yield booted
    finally:
        cri.remove_work_directory(workdir)


def uuid(root: Path) -> str:
    (info,) = root.glob("proc/driver/nvidia/gpus/*/information")
    return info.read_text().split("GPU UUID:")[1].split()[0]


def run_probe(node: CriNode, name: str, devices: list[str]) -> cuda_probe.Answer:
    pod = node.cri.run_pod(name, runtime_handler="nvidia", log_directory=node.logs / name)
    ran = node.cri.run(pod, "probe", cuda_probe.PROBE_PATH, cdi_devices=devices,
                       image=cuda_probe.IMAGE)
    assert ran.exit_code == 0, ran.output
    return cuda_probe.parse(ran.output)


def test_a_cuda_program_in_a_pod_given_gpu_0_loads_the_real_libcuda(node: CriNode) -> None:
    """CreateContainer with CDIDevices nvidia.com/gpu=0: the CUDA 12.9 runtime in the pod
    finds the driver's libcuda where gpunode's spec mounted it, libcuda answers CUDA 12.4 and
    reports no device (none answers on this machine)."""
    answer = run_probe(node, "gpu", ["nvidia.com/gpu=0"])
    assert (answer.runtime, answer.driver) == (cuda_probe.RUNTIME_VERSION, CUDA_12_4)
    assert answer.devices_error == "cudaErrorNoDevice"


def test_the_same_pod_without_a_gpu_has_no_driver(node: CriNode) -> None:
    """Without a CDI device nothing of the driver reaches the container: the runtime finds no
    libcuda (driver version 0, cudaErrorInsufficientDriver)."""
    answer = run_probe(node, "nogpu", [])
    assert answer.driver == 0 and answer.devices_error == "cudaErrorInsufficientDriver"
