"""Hostile inputs to a build's driver user-space: a cache entry whose libraries, links or
manifest are not what it recorded is refused by every reader of the driver root (`cdi
generate` here) with one clear error and nothing changed; an installer whose extracted tree
holds links out of it or FIFOs in place of libraries gives a refused build, not a cached one.

The entry is built in-process with the fake compiler (tests/helpers/driver_build.py); the
installer cases run the real build.sh (processes: marked integration).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode.driver import build as b
from gpunode.driver import builders, cache
from gpunode.platform.host import Host
from gpunode_testing import fixtures
from gpunode_testing.driver_files import ELF64_LIBRARY
from helpers.driver_build import (
    FakeBuilder,
    build_config,
    build_sh_command,
    fake_installer,
    kernel_tree,
    strip_system_userspace,
)
from hostile.support import Cli, assert_refused, check_refusal

T4 = fixtures.MACHINES["nc4as-t4-v3"]
VERSION = T4.driver_version
ENTRY = f"opt/gpunode/drivers/{fixtures.KERNEL}/{VERSION}-proprietary"
LIBCUDA = f"{ENTRY}/lib/libcuda.so.{VERSION}"
MANIFEST = f"{ENTRY}/manifest.json"


def built_node(make_host: HostFactory) -> Path:
    """A T4 node whose loaded driver came from a build: its user-space only in the entry."""
    host = make_host(T4, "driver")
    strip_system_userspace(host.root)
    config = build_config(host, VERSION)
    b.build(host, b.inputs_for(config, fixtures.KERNEL, "proprietary"),  # type: ignore[arg-type]
            builders.UrlFetcher(host), FakeBuilder(), b.FlatcarFacts(version="4459.2.1"))
    return host.root


def _replace(rel: str, make: Callable[[Path], None]) -> Callable[[Path], None]:
    def mutate(root: Path) -> None:
        path = root / rel
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink()
        make(path)
    return mutate


def _huge(path: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(cache.MAX_FILE_BYTES + 1)  # sparse: no disk


def _manifest(change: Callable[[dict[str, object]], None]) -> Callable[[Path], None]:
    def mutate(root: Path) -> None:
        manifest = json.loads((root / MANIFEST).read_text())
        change(manifest)
        (root / MANIFEST).write_text(json.dumps(manifest))
    return mutate


def _modules_only(manifest: dict[str, object]) -> None:
    manifest["schema_version"] = 1
    del manifest["userspace"], manifest["links"]


def _climbing(manifest: dict[str, object]) -> None:
    manifest["userspace"][f"lib/../../../../etc/libcuda.so.{VERSION}"] = "0" * 64  # type: ignore[index]


REFUSED = "the build cache entry .* is refused: "
ENTRY_CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "libcuda-tampered": (lambda r: (r / LIBCUDA).write_bytes(ELF64_LIBRARY + b"x"),
                         REFUSED + f"lib/libcuda.so.{VERSION} has sha256"),
    "libcuda-missing": (lambda r: (r / LIBCUDA).unlink(),
                        REFUSED + f"lib/libcuda.so.{VERSION} is missing"),
    "libcuda-is-a-fifo": (_replace(LIBCUDA, os.mkfifo),
                          REFUSED + f"lib/libcuda.so.{VERSION} is not a regular file"),
    "libcuda-links-out-of-the-root": (
        _replace(LIBCUDA, lambda p: p.symlink_to("../../../../../../../../etc/passwd")),
        REFUSED + f"lib/libcuda.so.{VERSION} is not a regular file"),
    "libcuda-huge": (_replace(LIBCUDA, _huge),
                     REFUSED + ".*is 1073741825 bytes, more than any driver file"),
    "soname-link-repointed": (
        _replace(f"{ENTRY}/lib/libcuda.so.1", lambda p: p.symlink_to("/etc/passwd")),
        REFUSED + "lib/libcuda.so.1 points to '/etc/passwd'"),
    "manifest-garbled": (lambda r: (r / MANIFEST).write_text('{"schema_version": 2, '),
                         REFUSED + "manifest.json"),
    "manifest-is-a-fifo": (_replace(MANIFEST, os.mkfifo), REFUSED + ".*is a FIFO"),
    "manifest-is-a-directory": (_replace(MANIFEST, Path.mkdir),
                                REFUSED + ".*(directory|no manifest)"),
    "manifest-deeply-nested": (lambda r: (r / MANIFEST).write_text("[" * 100000),
                               REFUSED + "manifest.json"),
    "manifest-of-a-modules-only-build": (_manifest(_modules_only),
                                         REFUSED + ".*older gpunode with the modules only"),
    "manifest-lists-a-climbing-path": (_manifest(_climbing),
                                       REFUSED + "user-space entry .* is malformed"),
}


@pytest.mark.parametrize("case", ENTRY_CASES)
def test_a_bad_cache_entry_is_never_the_driver_root_cdi_generate_refuses_it(
        make_host: HostFactory, cli: Cli, case: str) -> None:
    mutate, pattern = ENTRY_CASES[case]
    root = built_node(make_host)
    assert cli("--root", str(root), "cdi", "generate").code == 0  # the entry as built is fine
    mutate(root)
    check_refusal(cli, root, ["--root", str(root), "cdi", "generate"], 1, pattern)


def test_a_modules_only_entry_is_not_loaded_when_building_is_off_and_the_warning_says_why(
        make_host: HostFactory, cli: Cli) -> None:
    """An entry an older gpunode built (no libcuda) on a rebooted node: refused, not loaded."""
    root = built_node(make_host)
    _manifest(_modules_only)(root)
    bare = make_host(T4, "bare").root
    (bare / "opt").mkdir(exist_ok=True)
    os.rename(root / "opt/gpunode", bare / "opt/gpunode")
    (bare / "etc/gpunode").mkdir(parents=True, exist_ok=True)
    (bare / "etc/gpunode/config.toml").write_text(
        f'[driver]\nstrategy = "build"\nversion = "{VERSION}"\n')
    result = check_refusal(cli, bare, ["--root", str(bare), "driver", "load"], 1,
                           r"no cached build for kernel .* driver.build.enabled is false")
    (warning,) = [e for e in result.events if e["event"] == "driver.cache.unusable"]
    assert "older gpunode with the modules only" in str(warning["reason"])


# -- the kernel's firmware search path, for the open modules of a build --------------------------

A100 = fixtures.MACHINES["nc24ads-a100-v4"]
PARAMETER = "sys/module/firmware_class/parameters/path"


def _parameter(make: Callable[[Path], None] | None) -> Callable[[Path], None]:
    """The fixture's (empty) parameter replaced by what `make` makes, or removed (None)."""
    def mutate(root: Path) -> None:
        (root / PARAMETER).unlink()
        if make is not None:
            make(root / PARAMETER)
    return mutate


FIRMWARE_CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "set-by-someone-else": (_parameter(lambda p: p.write_text("/vendor/firmware\n")),
                            r"only .*/firmware has, but .* is already set to /vendor/firmware; "
                            r"gpunode does not overwrite it .*clear it"),
    "is-a-fifo": (_parameter(os.mkfifo),
                  r"cannot read the kernel's firmware search path: .*is a FIFO"),
    "is-a-directory": (_parameter(Path.mkdir),
                       r"cannot read the kernel's firmware search path: .*directory"),
    "missing": (_parameter(None), r"this kernel has no firmware search path parameter .*"
                                  r"/lib/firmware/nvidia/"),
}


@pytest.mark.parametrize("case", FIRMWARE_CASES)
def test_a_firmware_search_path_gpunode_cannot_use_refuses_the_open_build_before_anything(
        make_host: HostFactory, cli: Cli, case: str) -> None:
    mutate, pattern = FIRMWARE_CASES[case]
    host = make_host(A100, "bare")
    config = build_config(host, A100.driver_version)
    (host.root / "etc/gpunode").mkdir(parents=True, exist_ok=True)
    (host.root / "etc/gpunode/config.toml").write_text(
        f'[driver]\nstrategy = "build"\nversion = "{A100.driver_version}"\n\n'
        "[driver.build]\nenabled = true\n" + "".join(
            f'{key} = "{getattr(config.build, key)}"\n'  # type: ignore[attr-defined]
            for key in ("dev_container_url", "dev_container_sha512", "driver_url",
                        "driver_sha256")))
    mutate(host.root)
    check_refusal(cli, host.root, ["--root", str(host.root), "driver", "load"], 1, pattern)


# -- hostile installers, through the real build.sh ----------------------------------------------

BUILD_CONFIG = """\
[driver]
version = "{version}"

[driver.build]
enabled = true
allow_unverified = true
dev_container_url = "/srv/mirror/dev.bin"
driver_url = "/srv/mirror/driver.run"
command = {command}
"""


def _tree_replace(name: str, make: Callable[[Path], None]) -> Callable[[Path], None]:
    def mutate(tree: Path) -> None:
        (tree / name).unlink()
        make(tree / name)
    return mutate


INSTALLER_CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "libcuda-links-out-of-the-tree": (
        _tree_replace(f"libcuda.so.{VERSION}", lambda p: p.symlink_to("/etc/passwd")),
        f"Failed to cache extracted 'lib': has no libcuda.so.{VERSION} "
        f".*the installer of NVIDIA {VERSION}"),
    "libnvidia-ml-is-a-fifo": (
        _tree_replace(f"libnvidia-ml.so.{VERSION}", os.mkfifo),
        f"'lib': has no libnvidia-ml.so.{VERSION}"),
    "nvidia-smi-links-out-of-the-tree-only-it-is-left-out": (
        _tree_replace("nvidia-smi", lambda p: p.symlink_to("/bin/sh")), ""),
}


@pytest.mark.integration
@pytest.mark.parametrize("case", INSTALLER_CASES)
def test_links_and_fifos_in_the_installer_are_never_followed_into_the_cache(
        make_host: HostFactory, tmp_path: Path, cli: Cli, case: str) -> None:
    import shutil

    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: the stand-in installer's libraries need it")
    mutate, pattern = INSTALLER_CASES[case]
    host = make_host(T4, "bare")
    root = host.root
    (root / "srv/mirror").mkdir(parents=True)
    (root / "srv/mirror/driver.run").write_bytes(fake_installer(tmp_path, VERSION, mutate))
    (root / "srv/mirror/dev.bin").write_bytes(b"image")
    (root / "etc/gpunode").mkdir(parents=True, exist_ok=True)
    (root / "etc/gpunode/config.toml").write_text(BUILD_CONFIG.format(
        version=VERSION, command=json.dumps(build_sh_command(
            kernel_tree(tmp_path / "kernel", fixtures.KERNEL)))))
    result = cli("--root", str(root), "driver", "build")
    usable = cache.find_usable(Host(root), fixtures.KERNEL, VERSION, "proprietary")
    if not pattern:  # the link is skipped: the build goes on without that binary
        assert result.code == 0, result.err
        assert usable is not None and not (root / ENTRY / "bin/nvidia-smi").exists()
        return
    assert_refused(result, 1, pattern)
    assert usable is None
    kernel_dir = root / f"opt/gpunode/drivers/{fixtures.KERNEL}"
    left = sorted(str(p.relative_to(kernel_dir)).split("/", 1)[1] for p in kernel_dir.rglob("*")
                  if p.is_file())
    assert left == [f"{b.WORK_DIR}/{b.BUILD_LOG}"]  # its log, until the next build or prune
