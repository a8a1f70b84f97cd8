"""What gpunode's CDI spec mounts into every GPU container: each library under the names its own
ELF file gives (DT_SONAME), the driver's files by capability (`[cdi] capabilities`), the config
files and IPC endpoints that are there, and the toolkit's hooks where the hook program has them.

The fixture's libraries are the smallest ELF shared objects that carry a SONAME
(gpunode_testing.driver_files.elf_library); tests/integration/test_real_driver_cdi.py does the
same on NVIDIA's real files.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from conftest import HostFactory
from gpunode.cdi import node as cdinode
from gpunode.cdi import spec as cdi
from gpunode.config import CDI_CAPABILITIES
from gpunode.platform.host import Host
from gpunode_testing.driver_files import elf_library
from hostile.support import Cli

T4 = "nc4as-t4-v3"
VERSION = "550.127.08"  # the fixtures' driver
LIB = "/usr/local/nvidia/lib64"


def mounts(host: Host, capabilities: frozenset[str] | tuple[str, ...] = CDI_CAPABILITIES,
           ) -> dict[str, dict[str, Any]]:
    """containerPath → mount of the node's spec."""
    doc = cdinode.generate(host, capabilities=capabilities)
    return {m["containerPath"]: m for m in doc["containerEdits"]["mounts"]}


def add_library(host: Host, name: str, soname: str | None) -> str:
    path = f"/usr/lib64/{name}.so.{VERSION}"
    (host.root / path.lstrip("/")).write_bytes(elf_library(soname))
    return path


def with_hook(host: Host, commands: tuple[str, ...] = ()) -> Host:
    """The toolkit's nvidia-cdi-hook (a stand-in program naming the commands it has)."""
    path = host.root / cdi.HOOK.lstrip("/")
    path.write_text("#!/bin/sh\n# commands: " + " ".join(commands) + "\n")
    path.chmod(0o755)
    return host


def test_a_library_is_mounted_under_the_soname_its_file_names_not_a_rule(
        make_host: HostFactory) -> None:
    """libnvidia-gpucomp names its full version as SONAME, so no .so.1 name appears; a
    library whose SONAME ends in .so.7 is mounted as .so.7."""
    host = make_host(T4, "driver")
    gpucomp = f"/usr/lib64/libnvidia-gpucomp.so.{VERSION}"
    nvml = add_library(host, "libnvidia-ml", "libnvidia-ml.so.7")
    found = mounts(host)
    assert [c for c, m in found.items() if m["hostPath"] == gpucomp] == [
        f"{LIB}/libnvidia-gpucomp.so.{VERSION}"]
    assert {c for c, m in found.items() if m["hostPath"] == nvml} == {
        f"{LIB}/libnvidia-ml.so.7", f"{LIB}/libnvidia-ml.so.{VERSION}"}


def test_a_library_without_a_soname_is_mounted_under_its_file_name_alone(
        make_host: HostFactory) -> None:
    host = make_host(T4, "driver")
    cfg = add_library(host, "libnvidia-cfg", None)
    assert [c for c, m in mounts(host).items() if m["hostPath"] == cfg] == [
        f"{LIB}/libnvidia-cfg.so.{VERSION}"]


def test_the_video_libraries_are_mounted_with_the_links_the_toolkit_always_makes(
        make_host: HostFactory) -> None:
    """NVDEC, NVENC and optical flow reach a container by default; libnvidia-opticalflow.so
    is there too, as the toolkit's create-symlinks always links it."""
    host = make_host(T4, "driver")
    for name in ("libnvcuvid", "libnvidia-encode", "libnvidia-opticalflow"):
        add_library(host, name, f"{name}.so.1")
    found = mounts(host)
    assert {f"{LIB}/libnvcuvid.so.1", f"{LIB}/libnvidia-encode.so.1",
            f"{LIB}/libnvidia-opticalflow.so.1", f"{LIB}/libnvidia-opticalflow.so"} <= set(found)


@pytest.mark.parametrize("capabilities, present, absent", [
    (("compute",), ["libcuda.so.1", "nvidia-cuda-mps-control"],
     ["libnvidia-ml.so.1", "nvidia-smi", "libnvcuvid.so.1"]),
    (("utility",), ["libnvidia-ml.so.1", "nvidia-smi"],
     ["libcuda.so.1", "nvidia-cuda-mps-server"]),
    (("compute", "utility"), ["libcuda.so.1", "libnvidia-ml.so.1"], ["libnvcuvid.so.1"]),
    (("video",), ["libnvcuvid.so.1"], ["libcuda.so.1", "libnvidia-ml.so.1"]),
], ids=["compute", "utility", "compute-utility", "video"])
def test_only_the_configured_capabilities_files_are_mounted(
        make_host: HostFactory, capabilities: tuple[str, ...], present: list[str],
        absent: list[str]) -> None:
    """Each capability brings its libraries and binaries; the GSP firmware comes with all."""
    host = make_host("nc24ads-a100-v4", "driver")  # open modules: with GSP firmware
    add_library(host, "libnvcuvid", "libnvcuvid.so.1")
    names = {c.rpartition("/")[2] for c in mounts(host, capabilities)}
    assert set(present) <= names and not set(absent) & names
    assert {"gsp_ga10x.bin", "gsp_tu10x.bin"} <= names


def test_the_agent_configs_capabilities_reach_cdi_generate(make_host: HostFactory,
                                                          cli: Cli) -> None:
    """`[cdi] capabilities = ["utility"]` in the node's agent config: NVML, no libcuda."""
    host = make_host(T4, "driver")
    config = host.root / "etc/gpunode/config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text('[cdi]\ncapabilities = ["utility"]\n')
    result = cli("--root", str(host.root), "cdi", "generate", "--format", "json")
    assert result.code == 0, result.err
    assert f"{LIB}/libnvidia-ml.so.1" in result.out and "libcuda" not in result.out


CONFIGS = {  # host file → where the container gets it (the toolkit's places)
    "/usr/share/glvnd/egl_vendor.d/10_nvidia.json": "/usr/share/glvnd/egl_vendor.d/10_nvidia.json",
    "/usr/share/vulkan/icd.d/nvidia_icd.json": "/etc/vulkan/icd.d/nvidia_icd.json",
    "/etc/OpenCL/vendors/nvidia.icd": "/etc/OpenCL/vendors/nvidia.icd",
    "/usr/share/X11/xorg.conf.d/10-nvidia.conf": "/usr/share/X11/xorg.conf.d/10-nvidia.conf",
}


def _write_configs(root: Path) -> None:
    for host_path in CONFIGS:
        (root / host_path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (root / host_path.lstrip("/")).write_text("{}\n")


def test_config_files_that_exist_are_mounted_where_the_toolkit_mounts_them(
        make_host: HostFactory) -> None:
    host = make_host(T4, "driver")
    _write_configs(host.root)
    found = mounts(host)
    assert {c: found[c]["hostPath"] for c in CONFIGS.values()} == {
        inside: host_path for host_path, inside in CONFIGS.items()}
    assert not [c for c in found if "wayland" in c or "nvoptix" in c]  # absent: not mounted


def test_config_files_follow_their_capability(make_host: HostFactory) -> None:
    """The Vulkan and EGL files come with graphics, the OpenCL ICD with compute, the X.Org
    snippets with display."""
    host = make_host(T4, "driver")
    _write_configs(host.root)
    compute = mounts(host, ("compute",))
    assert "/etc/OpenCL/vendors/nvidia.icd" in compute
    assert not {"/etc/vulkan/icd.d/nvidia_icd.json", "/usr/share/X11/xorg.conf.d/10-nvidia.conf",
                "/usr/share/glvnd/egl_vendor.d/10_nvidia.json"} & set(compute)
    assert "/usr/share/X11/xorg.conf.d/10-nvidia.conf" in mounts(host, ("display",))


def test_fabric_manager_socket_and_mps_pipes_are_mounted_with_the_toolkits_options(
        make_host: HostFactory) -> None:
    host = make_host(T4, "driver")
    socket = host.root / "var/run/nvidia-fabricmanager/socket"  # the toolkit looks here second
    socket.parent.mkdir(parents=True)
    os.mknod(socket, stat.S_IFSOCK | 0o600)
    if os.geteuid() == 0:  # a socket in /run may be a service user's (persistenced --user)
        os.chown(socket, 1000, 1000)
    (host.root / "tmp/nvidia-mps").mkdir(parents=True)
    found = mounts(host)
    ipc = ["nosuid", "nodev", "rbind", "rprivate", "noexec"]
    assert found["/var/run/nvidia-fabricmanager/socket"] == {
        "hostPath": "/var/run/nvidia-fabricmanager/socket",
        "containerPath": "/var/run/nvidia-fabricmanager/socket", "options": ipc}
    assert found["/tmp/nvidia-mps"]["options"] == ipc


def test_no_ipc_endpoint_is_mounted_where_there_is_none(make_host: HostFactory) -> None:
    """No socket, and a file where the MPS pipe directory would be: no IPC mount at all."""
    host = make_host(T4, "driver")
    (host.root / "tmp/nvidia-mps").parent.mkdir(parents=True, exist_ok=True)
    (host.root / "tmp/nvidia-mps").write_text("a file, not the MPS pipe directory\n")
    assert not [c for c in mounts(host) if c.startswith(("/run/", "/var/run/", "/tmp/"))]


@pytest.mark.parametrize("mps", ["a-link-to-root-s-home", "another-user-s"])
def test_an_mps_pipe_directory_anyone_could_have_made_is_not_mounted(
        make_host: HostFactory, mps: str) -> None:
    """/tmp is anyone's: a link named /tmp/nvidia-mps, or such a directory another user
    owns, would be mounted writable into every GPU container; neither is."""
    host = make_host(T4, "driver")
    pipes = host.root / "tmp/nvidia-mps"
    pipes.parent.mkdir(parents=True, exist_ok=True)
    if mps == "a-link-to-root-s-home":
        (host.root / "root").mkdir(exist_ok=True)
        pipes.symlink_to("/root")
    else:
        pipes.mkdir()
        if os.geteuid() == 0:  # else it is this (unprivileged) user's already
            os.chown(pipes, 1000, 1000)
    assert "/tmp/nvidia-mps" not in mounts(host)


def _hooks(host: Host) -> list[list[str]]:
    return [h["args"] for h in cdinode.generate(host)["containerEdits"]["hooks"]]


def test_the_compat_hook_runs_between_the_links_and_the_loader_cache_where_the_hook_has_it(
        make_host: HostFactory) -> None:
    host = with_hook(make_host(T4, "driver"),
                     ("create-symlinks", "enable-cuda-compat", "update-ldcache"))
    assert [args[1] for args in _hooks(host)] == ["create-symlinks", "enable-cuda-compat",
                                                  "update-ldcache"]
    assert _hooks(host)[1] == ["nvidia-cdi-hook", "enable-cuda-compat",
                               f"--host-driver-version={VERSION}"]


def test_an_older_hook_without_the_compat_command_is_not_asked_for_it(
        make_host: HostFactory) -> None:
    host = with_hook(make_host(T4, "driver"), ("create-symlinks", "update-ldcache"))
    assert [args[1] for args in _hooks(host)] == ["create-symlinks", "update-ldcache"]


def test_the_hook_layout_links_the_unversioned_names_to_each_librarys_soname(
        make_host: HostFactory) -> None:
    host = with_hook(make_host(T4, "driver"))
    add_library(host, "libnvidia-opticalflow", "libnvidia-opticalflow.so.1")
    assert _hooks(host)[0] == [
        "nvidia-cdi-hook", "create-symlinks",
        "--link", "libcuda.so.1::/usr/lib64/libcuda.so",
        "--link", "libnvidia-opticalflow.so.1::/usr/lib64/libnvidia-opticalflow.so"]
