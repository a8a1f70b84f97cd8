"""The CDI spec gpunode itself generates (gpunode/cdi/spec.py, from a fixture T4 node with its
driver loaded) is one podman accepts and applies: the container sees the GPU's device node with the
driver's numbers, the driver's libraries at the paths CUDA images look in, nvidia-smi on the
bin path, and the GPU by its UUID as well as its index. The spec is made for the node mounted
at the fixture root, so its host paths are re-rooted there before podman reads it; nothing else
of it is changed. Harness: gpunode_testing.podman (and tests/integration/test_podman_cdi.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import HostFactory
from gpunode.cdi import node as cdinode
from gpunode.cdi import spec as cdi
from gpunode.gpu import driverinfo
from gpunode_testing import podman

pytestmark = pytest.mark.allow_paths(str(podman.BUSYBOX))
LIB64 = "/usr/local/nvidia/lib64"


def run(tmp_path: Path, spec_dir: Path, device: str, script: str) -> str:
    rootfs = podman.make_rootfs(tmp_path / f"rootfs-{device.replace('/', '_')}")
    rc, out, err = podman.run_with_cdi(spec_dir, device, ["/bin/sh", "-c", script], rootfs,
                                       tmp_path / "podman")
    assert rc == 0, f"podman exit {rc}\nstdout:\n{out}\nstderr:\n{err}"
    return out


def test_podman_gives_a_container_the_gpu_gpunodes_spec_declares(
        podman_ready: None, make_host: HostFactory, tmp_path: Path) -> None:
    host = make_host("nc4as-t4-v3", "driver")
    document = cdinode.generate(host)
    spec_dir = tmp_path / "cdi"
    spec_dir.mkdir()
    (spec_dir / "nvidia.yaml").write_text(yaml.safe_dump(podman.rerooted(document, host.root)))
    (uuid,) = [info.uuid for info in driverinfo.read_gpu_infos(host).values()]
    version = driverinfo.parse_version(
        (host.root / "proc/driver/nvidia/version").read_text())
    assert version is not None
    versioned = f"{LIB64}/libcuda.so.{version.version}"
    out = run(tmp_path, spec_dir, f"{cdi.KIND}=0", f"ls -l /dev/nvidia0 /dev/nvidiactl; "
              f"cmp {LIB64}/libcuda.so.1 {versioned} && echo same-library; "
              "ls /usr/local/nvidia/bin/nvidia-smi")
    assert "195,   0 " in out or "195, 0 " in out, out
    assert "same-library" in out and "/usr/local/nvidia/bin/nvidia-smi" in out, out
    by_uuid = run(tmp_path, spec_dir, f"{cdi.KIND}={uuid}", "ls -l /dev/nvidia0")
    assert "195," in by_uuid, by_uuid
