"""A build's driver user-space: what the builder extracts from the installer is checked and
checksummed into the cache entry, a built driver's user-space is the entry's, and the open
modules of a build get the kernel's firmware search path pointed at the entry's GSP firmware.

On fixture hosts with the fake compiler (tests/helpers/driver_build.py); build.sh itself run
on a fake installer: tests/integration/test_driver_build_real.py.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import HostFactory
from gpunode import log
from gpunode.config import DriverConfig
from gpunode.driver import build as b
from gpunode.driver import builders, cache, firmware, step, userspace
from gpunode.driver.modinfo import ModuleInfo
from gpunode.errors import DriverError, ExtractedFileError, FirmwarePathError
from gpunode.gpu.detect import detect
from gpunode.platform.host import Host
from gpunode_testing import fixtures
from gpunode_testing.driver_files import ELF64_LIBRARY, OPEN_FIRMWARE
from helpers.driver_build import (
    DRIVER,
    FACTS,
    KERNEL,
    BuiltKernel,
    FakeBuilder,
    build_config,
    inputs,
    mirror_host,
)
from helpers.fake_kernel import stand_in_modinfo
from hostile.support import Cli

PARAMETER = "/sys/module/firmware_class/parameters/path"


@pytest.fixture
def host(make_host: HostFactory) -> Host:
    return mirror_host(make_host)


def run_build(host: Host, builder: FakeBuilder, **changes: object) -> b.BuildResult:
    return b.build(host, inputs(**changes), builders.UrlFetcher(host), builder, FACTS)


def entry_dir(host: Host, flavour: str = "open") -> Path:
    return host.path(cache.entry_path(KERNEL, DRIVER, flavour))


def manifest(host: Host) -> dict[str, Any]:
    return json.loads((entry_dir(host) / "manifest.json").read_text())


# -- what a build caches -------------------------------------------------------------------------


def test_build_sh_is_told_the_version_and_the_libraries_and_binaries_userspace_names(
        host: Host) -> None:
    seen: list[str] = []
    run_build(host, FakeBuilder(extra=lambda out: seen.append(
        (out / b.WORK_DIR / b.WANTED_LIST).read_text())))
    assert seen == ["".join([f"version {DRIVER}\n",
                             *(f"lib {name}\n" for name in userspace.LIBRARIES),
                             *(f"bin {name}\n" for name in userspace.BINARIES)])]


def test_a_build_caches_lib_bin_and_firmware_each_file_with_its_sha256(host: Host) -> None:
    result = run_build(host, FakeBuilder())
    entry = entry_dir(host)
    recorded = manifest(host)["userspace"]
    assert f"lib/libcuda.so.{DRIVER}" in recorded and "bin/nvidia-smi" in recorded
    assert {f"firmware/nvidia/{DRIVER}/{name}" for name in OPEN_FIRMWARE} <= set(recorded)
    assert sorted(recorded) == sorted(str(p.relative_to(entry)) for p in entry.rglob("*")
                                      if p.is_file() and not p.is_symlink()
                                      and p.parent != entry)
    assert all(digest == cache.digest(host, f"{result.entry.path}/{rel}")
               for rel, digest in recorded.items())


def test_the_soname_links_are_recorded_with_their_targets(host: Host) -> None:
    run_build(host, FakeBuilder())
    links = manifest(host)["links"]
    assert links["lib/libcuda.so.1"] == f"libcuda.so.{DRIVER}"
    assert links["lib/libnvidia-nvvm.so.4"] == f"libnvidia-nvvm.so.{DRIVER}"


def _write(rel: str, data: bytes = ELF64_LIBRARY) -> Callable[[Path], None]:
    def write(out: Path) -> None:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    return write


def _link(rel: str, target: str) -> Callable[[Path], None]:
    def link(out: Path) -> None:
        (out / rel).unlink(missing_ok=True)
        (out / rel).symlink_to(target)
    return link


def _remove(rel: str) -> Callable[[Path], None]:
    return lambda out: (out / rel).unlink()


def _fifo(rel: str) -> Callable[[Path], None]:
    def fifo(out: Path) -> None:
        (out / rel).unlink()
        os.mkfifo(out / rel)
    return fifo


def _huge(rel: str) -> Callable[[Path], None]:
    def huge(out: Path) -> None:
        with open(out / rel, "r+b") as f:
            f.truncate(cache.MAX_FILE_BYTES + 1)  # sparse: no disk, and never hashed
    return huge


@pytest.mark.parametrize(("extra", "message"), [
    (lambda out: [p.unlink() for p in (out / "lib").glob("libcuda.so.*")],
     rf"'lib': has no libcuda.so.{DRIVER}$"),
    (_write("lib/libcuda.so.550.127.08"), r"'lib/libcuda.so.550.127.08': is not a file gpunode"),
    (_write(f"lib/libnvidia-ml.so.{DRIVER}", b"\x7fELF\x01\x01\x01"), r"is a 32-bit library"),
    (_write(f"lib/libnvidia-ml.so.{DRIVER}", b"#!/bin/sh\n"), r"is not an ELF shared library"),
    (_link("lib/libcuda.so.1", "/etc/shadow"), r"'lib/libcuda.so.1': links to '/etc/shadow'"),
    (_link("lib/libcuda.so.1", "../../../../etc"), r"links to '../../../../etc'"),
    (_link("lib/libfoo.so.1", "libfoo.so.2"), r"links to 'libfoo.so.2', which is no library"),
    (_link("bin/nvidia-smi", "/usr/bin/sh"), r"'bin/nvidia-smi': is a symlink"),
    (_fifo(f"lib/libcuda.so.{DRIVER}"), rf"'lib/libcuda.so.{DRIVER}': is not a regular file"),
    (_huge(f"lib/libcuda.so.{DRIVER}"), r"is 1073741825 bytes, more than any driver file"),
    (_write("firmware/gsp_ga10x.bin"), r"'firmware/gsp_ga10x.bin': is not firmware/nvidia/"),
    (_write("firmware/nvidia/550.127.08/gsp_ga10x.bin"), r"is not firmware/nvidia/570"),
    (_write(f"firmware/nvidia/{DRIVER}/notes.txt"), r"is not GSP firmware"),
    (lambda out: [(p.unlink()) for p in (out / f"firmware/nvidia/{DRIVER}").iterdir()],
     r"has no GSP firmware .* the open modules cannot start a GPU"),
], ids=["no-libcuda", "other-version", "32-bit", "not-elf", "link-absolute", "link-climbing",
        "link-dangling", "binary-link", "fifo", "huge", "firmware-flat", "firmware-other-version",
        "firmware-not-gsp", "open-without-firmware"])
def test_what_the_builder_left_that_is_not_driver_user_space_is_refused_and_nothing_is_cached(
        host: Host, extra: Callable[[Path], None], message: str) -> None:
    with pytest.raises(ExtractedFileError, match=message) as refused:
        run_build(host, FakeBuilder(extra=extra))
    assert refused.value.code == "driver-build-userspace-refused"
    assert cache.find_usable(host, KERNEL, DRIVER, "open") is None


def test_an_installer_without_the_versions_libcuda_asks_whether_it_is_that_version(
        host: Host) -> None:
    with pytest.raises(ExtractedFileError) as refused:
        run_build(host, FakeBuilder(userspace=False))
    assert str(refused.value).endswith(f"has no libcuda.so.{DRIVER} or libnvidia-ml.so.{DRIVER}")
    assert refused.value.hint.startswith(f"is driver.build.driver_url the installer of NVIDIA "
                                         f"{DRIVER}? (see ")


def test_proprietary_modules_are_cached_without_firmware(host: Host) -> None:
    def drop_firmware(out: Path) -> None:
        for p in (out / f"firmware/nvidia/{DRIVER}").iterdir():
            p.unlink()
    result = run_build(host, FakeBuilder(extra=drop_firmware), flavour="proprietary")
    assert result.entry.userspace(f"firmware/nvidia/{DRIVER}") == ()
    assert cache.find_usable(host, KERNEL, DRIVER, "proprietary") == result.entry


@pytest.fixture
def log_events(monkeypatch: pytest.MonkeyPatch) -> Callable[[], list[dict[str, Any]]]:
    monkeypatch.setattr(log, "_logger", log.get())
    stream = io.StringIO()
    log.configure("json", stream=stream)
    return lambda: [json.loads(line) for line in stream.getvalue().splitlines()]


def test_an_entry_built_without_user_space_is_unusable_and_says_why(
        host: Host, log_events: Callable[[], list[dict[str, Any]]]) -> None:
    run_build(host, FakeBuilder())
    old = {k: v for k, v in manifest(host).items() if k not in ("userspace", "links")}
    (entry_dir(host) / "manifest.json").write_text(json.dumps({**old, "schema_version": 1}))
    assert cache.find_usable(host, KERNEL, DRIVER, "open") is None
    (event,) = [e for e in log_events() if e["event"] == "driver.cache.unusable"]
    assert "older gpunode with the modules only" in event["reason"]
    assert "libcuda" in event["reason"]


def test_a_file_hashed_once_is_hashed_again_when_it_changes(tmp_path: Path) -> None:
    host = Host(tmp_path)
    (tmp_path / "f").write_bytes(b"one")
    os.utime(tmp_path / "f", (1, 1))  # an old file: its digest is remembered
    first = cache.digest(host, "/f")
    (tmp_path / "f").write_bytes(b"two")
    os.utime(tmp_path / "f", (1, 1))  # same mtime, but the ctime moved
    assert cache.digest(host, "/f") != first


# -- a built driver's user-space -----------------------------------------------------------------


def built_node(make_host: HostFactory, machine: str = "nc4as-t4-v3",
               firmware_path: str | None = "\n") -> tuple[Host, DriverConfig, BuiltKernel]:
    """A bare fixture node taken through the driver step with the build strategy: its driver
    loaded from the cache entry, no user-space anywhere else."""
    spec = fixtures.MACHINES[machine]
    host = make_host(machine, "bare")
    if firmware_path is None:
        (host.root / PARAMETER.lstrip("/")).unlink()
    else:
        (host.root / PARAMETER.lstrip("/")).write_text(firmware_path)
    config = build_config(host, spec.driver_version)
    return host, config, BuiltKernel(host.root, spec)  # type: ignore[return-value]


def drive(host: Host, config: DriverConfig, kmod: BuiltKernel) -> step.Outcome:
    the_plan = step.plan(host, config, detect(host), kmod)
    return step.apply(host, the_plan, config, kmod, (builders.UrlFetcher(host), FakeBuilder()))


def test_a_built_drivers_user_space_is_its_cache_entrys(make_host: HostFactory) -> None:
    host, config, kmod = built_node(make_host)
    outcome = drive(host, config, kmod)
    entry = cache.entry_path(fixtures.KERNEL, config.version, "proprietary")
    assert outcome.source == entry
    found = outcome.driver_root
    assert found is not None and found.root == entry
    assert f"{entry}/lib/libcuda.so.{config.version}" in found.libraries
    assert f"{entry}/bin/nvidia-smi" in found.binaries
    assert userspace.find(host, config.version) == found


def test_a_tampered_library_in_the_entry_is_never_the_driver_root(
        make_host: HostFactory) -> None:
    host, config, kmod = built_node(make_host)
    drive(host, config, kmod)
    entry = host.path(cache.entry_path(fixtures.KERNEL, config.version, "proprietary"))
    (entry / f"lib/libcuda.so.{config.version}").write_bytes(ELF64_LIBRARY + b"tampered")
    with pytest.raises(DriverError, match=r"the build cache entry .* is refused: "
                       rf"lib/libcuda.so.{config.version} has sha256"):
        userspace.find(host, config.version)


def test_a_file_the_entrys_manifest_does_not_list_is_not_taken(make_host: HostFactory) -> None:
    host, config, kmod = built_node(make_host)
    drive(host, config, kmod)
    entry = host.path(cache.entry_path(fixtures.KERNEL, config.version, "proprietary"))
    (entry / f"lib/libnvidia-cfg.so.{config.version}").unlink()  # listed: now unusable
    with pytest.raises(DriverError, match=r"is refused: .*libnvidia-cfg.* is missing"):
        userspace.find(host, config.version)


# -- the open modules' firmware ------------------------------------------------------------------


def test_open_modules_of_a_build_load_after_the_firmware_path_names_the_entry(
        make_host: HostFactory) -> None:
    host, config, kmod = built_node(make_host, "nc24ads-a100-v4")
    the_plan = step.plan(host, config, detect(host), kmod)
    entry = cache.entry_path(fixtures.KERNEL, config.version, "open")
    assert (f"set the kernel's firmware search path ({PARAMETER}) to {entry}/firmware (for "
            f"nvidia/{config.version}/gsp_*.bin)" in the_plan.describe())
    outcome = step.apply(host, the_plan, config, kmod,
                         (builders.UrlFetcher(host), FakeBuilder()))
    assert (host.root / PARAMETER.lstrip("/")).read_text() == f"{entry}/firmware"
    assert outcome.driver_root is not None
    assert f"{entry}/firmware/nvidia/{config.version}/gsp_ga10x.bin" in outcome.driver_root.firmware


def test_the_next_boot_of_a_built_open_driver_sets_the_path_before_loading(
        make_host: HostFactory) -> None:
    host, config, kmod = built_node(make_host, "nc24ads-a100-v4")
    drive(host, config, kmod)
    (host.root / PARAMETER.lstrip("/")).write_text("\n")  # a reboot empties it
    for path in ("proc/driver/nvidia/version", "proc/modules"):
        (host.root / path).unlink()
    (host.root / "proc/modules").write_text("")
    the_plan = step.plan(host, config, detect(host), kmod)
    assert the_plan.choice.action == "load" and the_plan.firmware is not None


def test_no_firmware_path_is_set_when_the_kernel_finds_the_firmware_already(
        make_host: HostFactory) -> None:
    host, config, kmod = built_node(make_host, "nc24ads-a100-v4")
    system = host.root / f"lib/firmware/nvidia/{config.version}"
    system.mkdir(parents=True)
    (system / "gsp_ga10x.bin").write_bytes(b"GSP")
    the_plan = step.plan(host, config, detect(host), kmod)
    assert the_plan.firmware is None
    assert not any("firmware search path" in line for line in the_plan.describe())


def test_a_firmware_path_someone_else_set_is_never_overwritten(make_host: HostFactory) -> None:
    host, config, kmod = built_node(make_host, "nc24ads-a100-v4", firmware_path="/vendor/fw\n")
    with pytest.raises(FirmwarePathError, match=r"name their GSP firmware nvidia/550.127.08/"
                       r"gsp_\*.bin, which only .*/firmware has, but .* is already set to "
                       r"/vendor/fw; gpunode does not overwrite it") as taken:
        step.plan(host, config, detect(host), kmod)
    assert "clear it" in taken.value.hint
    assert (host.root / PARAMETER.lstrip("/")).read_text() == "/vendor/fw\n"


def test_a_firmware_path_someone_else_set_that_has_the_firmware_is_used_as_it_is(
        make_host: HostFactory) -> None:
    host, config, kmod = built_node(make_host, "nc24ads-a100-v4", firmware_path="/vendor/fw\n")
    (host.root / f"vendor/fw/nvidia/{config.version}").mkdir(parents=True)
    (host.root / f"vendor/fw/nvidia/{config.version}/gsp_ga10x.bin").write_bytes(b"GSP")
    assert step.plan(host, config, detect(host), kmod).firmware is None


def test_a_kernel_without_the_firmware_path_parameter_is_a_refusal_with_a_hint(
        make_host: HostFactory) -> None:
    host, config, kmod = built_node(make_host, "nc24ads-a100-v4", firmware_path=None)
    with pytest.raises(FirmwarePathError, match=r"has no firmware search path parameter") as no:
        step.plan(host, config, detect(host), kmod)
    assert "/lib/firmware/nvidia/550.127.08" in no.value.hint


def gsp_module(name: str = "gsp_tu10x.bin") -> ModuleInfo:
    """nvidia.ko's .modinfo as far as the firmware goes: it names nvidia/<version>/<name>."""
    return ModuleInfo("/opt/e/nvidia.ko", KERNEL, "NVIDIA", DRIVER, (f"nvidia/{DRIVER}/{name}",))


def test_the_firmware_path_is_ours_already_nothing_is_written(tmp_path: Path) -> None:
    (tmp_path / PARAMETER.lstrip("/")).parent.mkdir(parents=True)
    (tmp_path / PARAMETER.lstrip("/")).write_text("/opt/e/firmware\n")
    os.makedirs(tmp_path / f"opt/e/firmware/nvidia/{DRIVER}")
    (tmp_path / f"opt/e/firmware/nvidia/{DRIVER}/gsp_tu10x.bin").write_bytes(b"GSP")
    assert firmware.plan(Host(tmp_path), [gsp_module()], "/opt/e/firmware", KERNEL) is None


def test_the_firmware_path_is_written_without_a_newline_through_the_host(
        tmp_path: Path) -> None:
    (tmp_path / PARAMETER.lstrip("/")).parent.mkdir(parents=True)
    (tmp_path / PARAMETER.lstrip("/")).write_text("\n")
    os.makedirs(tmp_path / f"opt/e/firmware/nvidia/{DRIVER}")
    (tmp_path / f"opt/e/firmware/nvidia/{DRIVER}/gsp_tu10x.bin").write_bytes(b"GSP")
    wanted = firmware.plan(Host(tmp_path), [gsp_module()], "/opt/e/firmware", KERNEL)
    assert wanted == firmware.FirmwarePath("/opt/e/firmware", (f"nvidia/{DRIVER}/gsp_tu10x.bin",))
    firmware.apply(Host(tmp_path), wanted)
    assert (tmp_path / PARAMETER.lstrip("/")).read_bytes() == b"/opt/e/firmware"


def test_gpunode_plan_says_it_sets_the_firmware_path_for_the_open_modules_of_a_build(
        make_host: HostFactory, cli: Cli) -> None:
    host, config, _ = built_node(make_host, "nc24ads-a100-v4")
    (host.root / "etc/gpunode").mkdir(parents=True, exist_ok=True)
    (host.root / "etc/gpunode/config.toml").write_text(
        f'[driver]\nstrategy = "build"\nversion = "{config.version}"\n\n[driver.build]\n'
        f'enabled = true\ndev_container_url = "{config.build.dev_container_url}"\n'
        f'dev_container_sha512 = "{config.build.dev_container_sha512}"\n'
        f'driver_url = "{config.build.driver_url}"\n'
        f'driver_sha256 = "{config.build.driver_sha256}"\n')
    planned = cli("--root", str(host.root), "plan")
    entry = cache.entry_path(fixtures.KERNEL, config.version, "open")
    assert f"set the kernel's firmware search path ({PARAMETER}) to {entry}/firmware" \
        in planned.out, planned.out + planned.err
    assert (host.root / PARAMETER.lstrip("/")).read_text() == "\n"  # a plan writes nothing


def test_writing_the_firmware_path_into_a_fifo_is_refused_without_blocking(
        tmp_path: Path) -> None:
    from gpunode.errors import HostError

    (tmp_path / PARAMETER.lstrip("/")).parent.mkdir(parents=True)
    os.mkfifo(tmp_path / PARAMETER.lstrip("/"))
    with pytest.raises(HostError, match=r"Failed to write '.*/path': is a FIFO"):
        firmware.apply(Host(tmp_path), firmware.FirmwarePath("/opt/e/firmware", ("f.bin",)))


def test_the_firmware_path_is_not_written_where_the_modules_cannot_be_loaded(
        make_host: HostFactory) -> None:
    """Under --root the real kmod tools refuse to load: the parameter stays as it was."""
    from gpunode.driver.modules import KmodTools
    from gpunode.errors import LoadError

    host, config, _ = built_node(make_host, "nc24ads-a100-v4")

    class RootTools(KmodTools):
        def modinfo(self, paths: list[str]) -> dict[str, ModuleInfo]:
            # the stand-in modules have no .modinfo for the real tool to read
            return {p: stand_in_modinfo(host.root, fixtures.MACHINES["nc24ads-a100-v4"], p)
                    for p in paths}
    tools = RootTools(may_load=False)
    the_plan = step.plan(host, config, detect(host), tools)
    with pytest.raises(LoadError):
        step.apply(host, the_plan, config, tools, (builders.UrlFetcher(host), FakeBuilder()))
    assert (host.root / PARAMETER.lstrip("/")).read_text() == "\n"
