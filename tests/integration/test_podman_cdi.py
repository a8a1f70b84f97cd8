"""podman (Debian's, a real CDI consumer that shares no code with gpunode) gives a container
exactly what a CDI spec declares: the spec is tests/data/cdi/nvidia.yaml, the fake host's device
nodes are real character devices with NVIDIA's numbers, and only the GPU behind them is missing.

The harness is gpunode_testing.podman (flags and why in its docstring). Without root these tests
skip; without podman, crun or busybox-static they fail (`make setup` installs them); where podman
cannot run even a plain container here, they skip with podman's own error."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from conftest import TEST_DATA
from gpunode_testing import podman

pytestmark = pytest.mark.allow_paths(str(podman.BUSYBOX))  # copied into each rootfs

SPEC = TEST_DATA / "cdi" / "nvidia.yaml"
PLACEHOLDER = "/gpunode-test-host"
LIBRARY = b"\x7fELF stand-in for libcuda.so.550.127.08\n"
LIB64 = "/usr/local/nvidia/lib64"
NODES = {"nvidia0": (195, 0), "nvidia1": (195, 1), "nvidiactl": (195, 255)}
LS_CHAR_DEVICE = re.compile(r"^c\S*\s+\d+\s+\S+\s+\S+\s+(\d+),\s*(\d+)\s.*\s(/dev/\S+)$")


@pytest.fixture(scope="module")
def ready(tmp_path_factory: pytest.TempPathFactory) -> None:
    if os.geteuid() != 0:
        pytest.skip("podman's namespace, mounts and mknod need root")
    if missing := podman.missing_tools():
        pytest.fail("missing " + ", ".join(missing) + ": apt-get install podman crun "
                    "busybox-static (make setup does)")
    workdir = tmp_path_factory.mktemp("podman-probe")
    if reason := podman.probe(workdir, podman.make_rootfs(workdir / "rootfs")):
        pytest.skip(reason)
    print(podman.version())


class Node:
    """A fake GPU host under tmp_path: its device nodes, its library, the spec naming them."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.host = tmp_path / "host"
        (self.host / "dev").mkdir(parents=True)
        (self.host / "lib").mkdir()
        for name, (major, minor) in NODES.items():
            os.mknod(self.host / "dev" / name, 0o666 | 0o020000, os.makedev(major, minor))
        (self.host / "lib" / "libcuda.so.550.127.08").write_bytes(LIBRARY)
        self.spec_dir = tmp_path / "cdi"
        self.spec_dir.mkdir()
        self.write_spec(SPEC.read_text())
        self.runs = 0

    def write_spec(self, text: str) -> None:
        (self.spec_dir / "nvidia.yaml").write_text(text.replace(PLACEHOLDER, str(self.host)))

    def run(self, device: str | tuple[str, ...], script: str) -> tuple[int, str, str]:
        self.runs += 1  # a fresh rootfs each time: crun leaves mount points in it
        rootfs = podman.make_rootfs(self.tmp / f"rootfs-{self.runs}")
        return podman.run_with_cdi(self.spec_dir, device, ["/bin/sh", "-c", script], rootfs,
                                   self.tmp / "podman")

    def ok(self, device: str | tuple[str, ...], script: str) -> str:
        rc, out, err = self.run(device, script)
        assert rc == 0, f"podman exit {rc}\nstdout:\n{out}\nstderr:\n{err}"
        return out


@pytest.fixture
def node(ready: None, tmp_path: Path) -> Node:
    return Node(tmp_path)


def char_devices(ls_output: str) -> dict[str, tuple[int, int]]:
    """`ls -l /dev/...` lines of character devices → {path: (major, minor)}."""
    found = {}
    for line in ls_output.splitlines():
        if match := LS_CHAR_DEVICE.match(line.strip()):
            found[match[3]] = (int(match[1]), int(match[2]))
    return found


def test_gpu_0_is_a_character_device_with_the_declared_numbers(node: Node) -> None:
    out = node.ok("nvidia.com/gpu=0", "ls -l /dev/nvidia0")
    assert char_devices(out) == {"/dev/nvidia0": (195, 0)}, out


def test_gpu_0_brings_the_common_control_node_and_no_other_gpu(node: Node) -> None:
    out = node.ok("nvidia.com/gpu=0", "ls -l /dev/nvidia*")
    assert char_devices(out) == {"/dev/nvidia0": (195, 0), "/dev/nvidiactl": (195, 255)}, out


def test_a_node_without_declared_numbers_gets_the_host_nodes_numbers(node: Node) -> None:
    out = node.ok("nvidia.com/gpu=1", "ls -l /dev/nvidia1")
    assert char_devices(out) == {"/dev/nvidia1": (195, 1)}, out


def test_the_library_is_readable_at_its_versioned_path_and_its_soname(node: Node) -> None:
    out = node.ok("nvidia.com/gpu=0", f"cat {LIB64}/libcuda.so.550.127.08; "
                  f"cat {LIB64}/libcuda.so.1")
    assert out.encode() == LIBRARY * 2


def test_the_library_mounts_are_read_only(node: Node) -> None:
    out = node.ok("nvidia.com/gpu=0", f"echo x >> {LIB64}/libcuda.so.1 && echo writable; "
                  "grep ' /usr/local/nvidia/lib64/' /proc/self/mountinfo")
    assert "writable" not in out
    mounts = dict(line.split()[4:6] for line in out.splitlines())  # mount point → options
    assert sorted(mounts) == [f"{LIB64}/libcuda.so.1", f"{LIB64}/libcuda.so.550.127.08"], out
    assert all("ro" in options.split(",") for options in mounts.values()), out


def test_the_spec_environment_is_set(node: Node) -> None:
    out = node.ok("nvidia.com/gpu=0", "env")
    assert "NVIDIA_VISIBLE_DEVICES=void" in out.splitlines()


def test_gpu_all_gives_every_gpu_and_the_control_node(node: Node) -> None:
    out = node.ok("nvidia.com/gpu=all", "ls -l /dev/nvidia0 /dev/nvidia1 /dev/nvidiactl; "
                  f"cat {LIB64}/libcuda.so.1")
    assert char_devices(out) == {f"/dev/{name}": numbers for name, numbers in NODES.items()}
    assert out.encode().endswith(LIBRARY)


def test_without_a_cdi_device_the_container_has_no_nvidia_node_and_no_library(
        node: Node) -> None:
    out = node.ok((), f"ls /dev; test -e {LIB64} || echo no-lib64")
    assert "nvidia" not in out and "no-lib64" in out, out


def test_a_device_the_spec_does_not_name_is_refused_by_podman(node: Node) -> None:
    rc, out, err = node.run("nvidia.com/gpu=7", "echo started")
    assert rc != 0 and "started" not in out
    assert "unresolvable CDI devices nvidia.com/gpu=7" in err, err


def test_a_spec_naming_a_missing_host_node_is_refused_by_podman(node: Node) -> None:
    node.write_spec(SPEC.read_text().replace("dev/nvidia1", "dev/nvidia9"))
    rc, out, err = node.run("nvidia.com/gpu=1", "echo started")
    assert rc != 0 and "started" not in out
    assert f"{node.host}/dev/nvidia9" in err and "no such file" in err.lower(), err


def test_a_spec_podman_cannot_load_is_refused_and_stderr_says_why(node: Node) -> None:
    node.write_spec(SPEC.read_text().replace('cdiVersion: "0.5.0"', 'cdiVersion: "99.0.0"'))
    rc, out, err = node.run("nvidia.com/gpu=0", "echo started")
    assert rc != 0 and "started" not in out
    assert "unresolvable CDI devices nvidia.com/gpu=0" in err
    assert re.search(r'invalid CDI Spec: invalid version \\"99\.0\.0\\"', err), err


MACHINE_STATE = ("/var/lib/containers", "/run/libpod", "/run/containers", "/run/crun",
                 "/run/cdi", "/etc/cdi", "/run/gpunode-podman",
                 *(f"/sys/fs/cgroup/{h}/libpod_parent" for h in ("", "memory", "unified")))


def test_a_run_leaves_the_machines_container_state_as_it_was(node: Node) -> None:
    before = {path: os.path.exists(path) for path in MACHINE_STATE}  # no audit event: allowed
    node.ok("nvidia.com/gpu=all", "true")
    assert {path: os.path.exists(path) for path in MACHINE_STATE} == before
