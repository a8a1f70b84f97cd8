"""The driver build with real processes and sockets: two processes building at once compile
once, the real fetcher downloads from a local HTTP server, build.sh passes `bash -n` and
shellcheck, NspawnBuilder's command template runs for real with a stand-in program, and
build.sh itself runs for real (outside a container) on a stand-in NVIDIA installer, real make
and ldconfig: its cache entry holds the driver's user-space, and `gpunode cdi generate` mounts
the entry's libcuda. The build on fixture hosts with a fake compiler:
tests/unit/test_driver_build.py and tests/unit/test_driver_build_userspace.py.
"""

from __future__ import annotations

import http.server
import json
import mimetypes
import multiprocessing
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode.driver import build as b
from gpunode.driver import builders, cache, modules
from gpunode.platform import command
from gpunode.platform.host import Host
from gpunode_testing import fixtures
from gpunode_testing.driver_files import write_build_userspace
from helpers.driver_build import (
    BUILD_SH,
    DRIVER,
    FACTS,
    INSTALLER,
    KERNEL,
    FakeBuilder,
    build_sh_command,
    fake_installer,
    inputs,
    kernel_tree,
    mirror_host,
    sha,
    split_kernel_tree,
    strip_system_userspace,
    write_build_setup,
)
from hostile.support import Cli
from real.nvidia_modules import ensure_headers


@pytest.fixture
def host(make_host: HostFactory) -> Host:
    return mirror_host(make_host)


# -- concurrent builds ---------------------------------------------------------------------------


def _build_in_process(root: str, sleep: float, queue: multiprocessing.Queue) -> None:
    host = Host(Path(root))
    builder = FakeBuilder(sleep=sleep)
    result = b.build(host, inputs(), builders.UrlFetcher(host), builder, FACTS)
    queue.put((result.cache_hit, builder.calls))


def test_two_processes_building_at_once_compile_once(host: Host) -> None:
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    processes = [context.Process(target=_build_in_process, args=(str(host.root), 1.0, queue))
                 for _ in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(30)
    outcomes = sorted(queue.get(timeout=5) for _ in processes)
    assert outcomes == [(False, 1), (True, 0)]
    assert cache.find_usable(host, KERNEL, DRIVER, "open") is not None


# -- the real fetcher over HTTP (a local server thread: sockets, no process) -----------------------


@pytest.fixture
def http_mirror(tmp_path: Path) -> Iterator[str]:
    served = tmp_path / "served"
    served.mkdir()
    (served / "NVIDIA.run").write_bytes(INSTALLER)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(served), **kwargs)  # type: ignore[arg-type]

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


# a real HTTP server on loopback: sockets
@pytest.mark.allow_paths(*mimetypes.knownfiles)  # read by http.server's handler
def test_url_fetcher_streams_an_http_download_into_place(http_mirror: str,
                                                         tmp_path: Path) -> None:
    dest = tmp_path / "nvidia-installer.run"
    builders.UrlFetcher(Host(tmp_path)).fetch(f"{http_mirror}/NVIDIA.run", dest)
    assert dest.read_bytes() == INSTALLER
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nvidia-installer.run", "served"]


# a real HTTP server on loopback: sockets
@pytest.mark.allow_paths(*mimetypes.knownfiles)  # read by http.server's handler
def test_url_fetcher_reports_an_http_error_and_leaves_no_partial_file(http_mirror: str,
                                                                      tmp_path: Path) -> None:
    dest = tmp_path / "out" / "nvidia-installer.run"
    dest.parent.mkdir()
    with pytest.raises(b.DriverBuildError, match=r"Failed to download .*: HTTP 404"):
        builders.UrlFetcher(Host(tmp_path)).fetch(f"{http_mirror}/missing.run", dest)
    assert list(dest.parent.iterdir()) == []


# -- NspawnBuilder's build.sh and command template, run for real -----------------------------------


def test_build_sh_is_valid_bash() -> None:
    command.run(["bash", "-n", str(BUILD_SH)], timeout=10)


def test_build_sh_passes_shellcheck() -> None:
    """shellcheck (Debian's package; `make setup` installs it) finds nothing, info level too."""
    command.run(["shellcheck", "--shell=bash", "--severity=info", str(BUILD_SH)], timeout=60)


def test_a_configured_builder_command_runs_for_real_through_the_whole_build(host: Host) -> None:
    """The argv template with a stand-in program (sh and cp) instead of systemd-nspawn."""
    extracted = host.root / "srv/extracted"
    write_build_userspace(extracted, DRIVER)
    builder = builders.NspawnBuilder(command=[
        "sh", "-c", 'cp "$1" "$2/nvidia.ko" && cp -R "$3/." "$2/"', "sh", "{driver_installer}",
        "{out_dir}", str(extracted)])
    result = b.build(host, inputs(), builders.UrlFetcher(host), builder, FACTS)
    assert (host.path(result.entry.path) / "nvidia.ko").read_bytes() == INSTALLER
    assert result.entry.manifest["modules"] == {"nvidia.ko": sha(INSTALLER, "sha256")}


# -- build.sh run for real on a stand-in installer -----------------------------------------------

T4 = fixtures.MACHINES["nc4as-t4-v3"]
def built_node_root(make_host: HostFactory, tmp_path: Path, kernel: str = fixtures.KERNEL,
                    tree: Path | None = None, **installer: object) -> Path:
    """A T4 node running `kernel` with the driver loaded and no user-space of its own, set up
    for `gpunode driver build` with build.sh run for real on a stand-in installer of the
    loaded version, against `tree` (default: a one-tree kernel_tree)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: the stand-in installer's libraries need it")
    host = make_host(T4, "driver", extra={"/proc/sys/kernel/osrelease": kernel + "\n"})
    root = host.root
    strip_system_userspace(root)
    data = fake_installer(tmp_path, T4.driver_version, **installer)  # type: ignore[arg-type]
    write_build_setup(root, T4.driver_version, data, b"developer container image\n",
                      build_sh_command(tree or kernel_tree(tmp_path / "kernel", kernel)))
    return root


def test_build_sh_builds_on_a_split_tree_and_caches_stripped_modules(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    """On Debian's layout (sources and output tree apart, kernel.release saying the upstream
    version) build.sh gives NVIDIA's Makefile SYSSRC = the source tree and SYSOUT = the
    output tree; the modules carry the kernel's release from utsrelease.h in their vermagic,
    reach the cache without their debug info, and keep their .modinfo (real modinfo, readelf)."""
    kernel = "6.1.0-50-amd64"
    root = built_node_root(make_host, tmp_path, kernel=kernel,
                           tree=split_kernel_tree(tmp_path / "kernel", kernel, "6.1.176"))
    built = cli("--root", str(root), "driver", "build")
    assert built.code == 0, built.err
    module = root / f"opt/gpunode/drivers/{kernel}/{T4.driver_version}-proprietary/nvidia.ko"
    info = modules.KmodTools().modinfo([str(module)])[str(module)]
    assert info.kernel == kernel and info.license == "NVIDIA"
    fields = {f: subprocess.run(["modinfo", "-F", f, str(module)], capture_output=True,
                                text=True, check=True).stdout.strip() for f in ("syssrc", "sysout")}
    assert fields == {"syssrc": str(tmp_path / "kernel/usr/src/linux-headers-6.1.0-50-common"),
                      "sysout": str(tmp_path / f"kernel/usr/src/linux-headers-{kernel}")}
    sections = subprocess.run(["readelf", "-S", "--wide", str(module)], capture_output=True,
                              text=True, check=True).stdout
    assert ".modinfo" in sections and ".debug_info" not in sections


# The trees handed to kbuild as NVIDIA's kernel-open/Makefile hands them (`$(MAKE) -C
# $(KERNEL_SOURCES) KBUILD_OUTPUT=$(KERNEL_OUTPUT) M=$(CURDIR) modules`, SYSSRC and SYSOUT),
# and real (tiny) kernel modules with the .modinfo fields NVIDIA's have.
KBUILD_MAKEFILE = """\
modules:
\t$(MAKE) -C $(SYSSRC) KBUILD_OUTPUT=$(SYSOUT) M=$(CURDIR) modules
"""
KBUILD_MODULE = """\
#include <linux/module.h>
static int __init stand_in_init(void) {{ return 0; }}
static void __exit stand_in_exit(void) {{ }}
module_init(stand_in_init);
module_exit(stand_in_exit);
MODULE_LICENSE("{license}");
MODULE_VERSION("{version}");
"""


def real_kbuild_modules(tree: Path) -> None:
    """The installer's kernel/ and kernel-open/ as kbuild external modules of its version."""
    version = tree.name.rsplit("-", 1)[1]
    for directory, license_ in (("kernel", "NVIDIA"), ("kernel-open", "Dual MIT/GPL")):
        (tree / directory / "stand-in-modules.sh").unlink()
        (tree / directory / "Makefile").write_text(KBUILD_MAKEFILE)
        (tree / directory / "Kbuild").write_text("obj-m := nvidia.o nvidia-uvm.o "
                                                 "nvidia-modeset.o\n")
        for name in ("nvidia", "nvidia-uvm", "nvidia-modeset"):
            (tree / directory / f"{name}.c").write_text(KBUILD_MODULE.format(
                license=license_, version=version))


def test_build_sh_compiles_against_debians_real_split_headers(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    """Debian's real linux-headers-6.1.0-50-amd64 and -common (tests/real/nvidia_modules.py
    ensure_headers): build.sh finds both trees through /lib/modules/<kernel>/build and /source,
    kbuild compiles real modules with them (vermagic 6.1.0-50-amd64, by the real modinfo),
    and the cache gets them without their debug info."""
    kernel = "6.1.0-50-amd64"
    root = built_node_root(make_host, tmp_path, kernel=kernel, tree=ensure_headers(),
                           mutate=real_kbuild_modules)
    built = cli("--root", str(root), "driver", "build")
    assert built.code == 0, built.err
    module = root / f"opt/gpunode/drivers/{kernel}/{T4.driver_version}-proprietary/nvidia.ko"
    info = modules.KmodTools().modinfo([str(module)])[str(module)]
    assert (info.vermagic, info.license, info.version) == (
        f"{kernel} SMP preempt mod_unload modversions", "NVIDIA", T4.driver_version)
    sections = subprocess.run(["readelf", "-S", "--wide", str(module)], capture_output=True,
                              text=True, check=True).stdout
    assert ".modinfo" in sections and ".debug_info" not in sections


def test_build_sh_names_the_release_of_a_tree_that_is_not_the_kernels(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    """A developer container whose tree is for another release: the build fails naming the
    tree and the release it is for (utsrelease.h), not just "no prepared build tree"."""
    kernel = "6.1.0-50-amd64"
    root = built_node_root(make_host, tmp_path, kernel=kernel, tree=split_kernel_tree(
        tmp_path / "kernel", kernel, "6.1.176", release="6.1.0-49-amd64"))
    built = cli("--root", str(root), "driver", "build")
    assert built.code == 1
    assert re.search(rf"no build tree for kernel {kernel} in this developer container; "
                     rf"\S*/lib/modules/{kernel}/build is for kernel 6\.1\.0-49-amd64",
                     built.err), built.err


def test_build_sh_caches_the_installers_user_space_and_cdi_generate_mounts_its_libcuda(
        make_host: HostFactory, tmp_path: Path, cli: Cli) -> None:
    root = built_node_root(make_host, tmp_path)
    version = T4.driver_version
    built = cli("--root", str(root), "driver", "build")
    assert built.code == 0, built.err

    entry = root / f"opt/gpunode/drivers/{fixtures.KERNEL}/{version}-proprietary"
    assert sorted(p.name for p in entry.glob("*.ko")) == [
        "nvidia-modeset.ko", "nvidia-uvm.ko", "nvidia.ko"]
    lib = entry / "lib"
    assert (lib / f"libcuda.so.{version}").read_bytes().startswith(b"\x7fELF\x02")  # not 32/
    assert (lib / "libcuda.so.1").readlink() == Path(f"libcuda.so.{version}")  # by ldconfig
    assert (lib / "libnvidia-nvvm.so.4").readlink() == Path(f"libnvidia-nvvm.so.{version}")
    assert not (lib / f"libnvidia-glcore.so.{version}").exists()  # not in userspace's list
    assert sorted(p.name for p in (entry / "bin").iterdir()) == sorted(
        ["nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control",
         "nvidia-cuda-mps-server"])
    assert sorted(p.name for p in (entry / f"firmware/nvidia/{version}").iterdir()) == [
        "gsp_ga10x.bin", "gsp_tu10x.bin"]
    manifest = json.loads((entry / "manifest.json").read_text())
    assert manifest["userspace"][f"lib/libcuda.so.{version}"] == sha(
        (lib / f"libcuda.so.{version}").read_bytes(), "sha256")
    assert manifest["links"]["lib/libcuda.so.1"] == f"libcuda.so.{version}"
    assert not list(entry.glob(".work*"))

    generated = cli("--root", str(root), "cdi", "generate", "--format", "json")
    assert generated.code == 0, generated.err
    spec = json.loads(generated.out)
    mounts = {m["hostPath"] for m in spec["containerEdits"]["mounts"]}
    host_entry = f"/opt/gpunode/drivers/{fixtures.KERNEL}/{version}-proprietary"
    assert f"{host_entry}/lib/libcuda.so.{version}" in mounts
    assert f"{host_entry}/bin/nvidia-smi" in mounts
