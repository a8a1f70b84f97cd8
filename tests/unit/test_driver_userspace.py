"""The driver root: the loaded driver's user-space found where each install puts it, only for
its own version, and refused (never hung on) when what is there is no library."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from conftest import HostFactory, with_runtime_binary
from gpunode.config import AgentConfig
from gpunode.driver import userspace
from gpunode.errors import DriverError
from gpunode.pipeline import boot
from gpunode.platform.host import Host
from gpunode.platform.systemd import NoSystemd
from gpunode_testing import fixtures
from gpunode_testing.driver_files import ELF64_LIBRARY, write_userspace
from hostile.support import Cli

VERSION = "550.127.08"
KERNEL = fixtures.KERNEL


def bare(tmp_path: Path) -> Path:
    """A node root with a kernel release and nothing of the driver's user-space."""
    root = tmp_path / "node"
    (root / "proc/sys/kernel").mkdir(parents=True)
    (root / "proc/sys/kernel/osrelease").write_text(KERNEL + "\n")
    return root


GPU_MACHINES = [m for m in fixtures.MACHINES.values() if "ready" in m.states]


@pytest.mark.parametrize("machine", GPU_MACHINES, ids=lambda m: m.name)
def test_every_fixture_node_in_the_ready_state_has_its_driver_root(
        make_host: HostFactory, machine: fixtures.Machine) -> None:
    found = userspace.find(make_host(machine.name, "ready"), machine.driver_version)
    assert found.root == "/"
    assert f"/usr/lib64/libcuda.so.{machine.driver_version}" in found.libraries
    assert f"/usr/lib64/libnvidia-ml.so.{machine.driver_version}" in found.libraries
    assert "/usr/bin/nvidia-smi" in found.binaries
    assert found.libraries == tuple(sorted(found.libraries))
    assert bool(found.firmware) == machine.open_modules


def test_the_flatcar_sysext_layout_is_found_with_its_firmware_through_the_lib_link(
        tmp_path: Path) -> None:
    root = bare(tmp_path)
    (root / "usr/lib").mkdir(parents=True)
    (root / "lib").symlink_to("usr/lib")  # Flatcar's merged /usr
    write_userspace(root, VERSION, open_modules=True,
                    firmware_dir="/usr/lib/firmware/nvidia/{version}")
    found = userspace.find(Host(root), VERSION)
    assert found.root == "/"
    assert found.firmware == (f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin",
                              f"/lib/firmware/nvidia/{VERSION}/gsp_tu10x.bin")
    assert found.binaries == tuple(sorted(f"/usr/bin/{b}" for b in userspace.BINARIES))


def test_flatcars_nvidia_service_layout_is_found_under_opt_nvidia(tmp_path: Path) -> None:
    root = bare(tmp_path)
    write_userspace(root, VERSION, open_modules=False,
                    lib_dir=f"/opt/nvidia/{VERSION}/{KERNEL}/usr/lib64", bin_dir="/opt/bin")
    found = userspace.find(Host(root), VERSION)
    assert found.root == f"/opt/nvidia/{VERSION}/{KERNEL}"
    assert f"{found.root}/usr/lib64/libcuda.so.{VERSION}" in found.libraries
    assert "/opt/bin/nvidia-smi" in found.binaries
    assert found.firmware == ()


def test_a_prebuilt_directory_for_the_running_kernel_is_a_driver_root(tmp_path: Path) -> None:
    root = bare(tmp_path)
    base = f"/srv/drivers/{KERNEL}"
    write_userspace(root, VERSION, open_modules=True, lib_dir=f"{base}/lib",
                    bin_dir=f"{base}/bin", firmware_dir=f"{base}/firmware/nvidia/{{version}}")
    found = userspace.find(Host(root), VERSION, prebuilt_dirs=("/srv/drivers",))
    assert found.root == base
    assert f"{base}/bin/nvidia-smi" in found.binaries
    assert f"{base}/firmware/nvidia/{VERSION}/gsp_ga10x.bin" in found.firmware


def test_the_persistenced_socket_is_part_of_the_driver_root_when_it_is_there(
        make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    socket = host.root / "run/nvidia-persistenced/socket"
    socket.parent.mkdir(parents=True)
    os.mknod(socket, 0o140600)
    assert userspace.find(host, VERSION).persistenced_socket == "/run/nvidia-persistenced/socket"


def test_no_libcuda_is_a_driver_error_naming_where_it_looked_with_a_hint(
        make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    (host.root / f"usr/lib64/libcuda.so.{VERSION}").unlink()
    with pytest.raises(DriverError) as raised:
        userspace.find(host, VERSION)
    message = str(raised.value)
    assert f"libcuda.so.{VERSION}" in message and f"{host.root}/usr/lib64" in message
    assert "but not libcuda" in message
    assert "Flatcar driver sysext" in raised.value.hint
    assert raised.value.code == "driver-unavailable"


def test_a_library_of_another_driver_version_is_not_taken_and_is_named(tmp_path: Path) -> None:
    root = bare(tmp_path)
    write_userspace(root, "535.104.05", open_modules=False)
    with pytest.raises(DriverError, match=r"has libcuda.so.535.104.05 \(535.104.05, not "
                       r"550.127.08\)"):
        userspace.find(Host(root), VERSION)


def test_a_refused_library_is_named_and_its_version_s_others_are_not_another_version(
        tmp_path: Path) -> None:
    """The notes after a miss: the refused file, and only libraries of other versions (the
    directories are listed for them only then); the version's own are no 'other' version."""
    root = bare(tmp_path)
    write_userspace(root, VERSION, open_modules=False)
    write_userspace(root, "535.104.05", open_modules=False, lib_dir="/usr/lib")
    ml = root / f"usr/lib64/libnvidia-ml.so.{VERSION}"
    ml.unlink()
    os.mkfifo(ml)
    with pytest.raises(DriverError) as info:
        userspace.find(Host(root), VERSION)
    notes = str(info.value).split(" (", 1)[1]
    assert f"{root}/usr/lib64/libnvidia-ml.so.{VERSION} is refused" in notes
    assert f"has libcuda.so.535.104.05 (535.104.05, not {VERSION})" in notes
    assert f"({VERSION}, not {VERSION})" not in notes


def test_a_32_bit_copy_in_usr_lib_is_not_the_driver_library(tmp_path: Path) -> None:
    root = bare(tmp_path)
    write_userspace(root, VERSION, open_modules=False, lib_dir="/usr/lib")
    for lib in (root / "usr/lib").glob(f"*.so.{VERSION}"):
        lib.write_bytes(b"\x7fELF\x01\x01\x01")
    with pytest.raises(DriverError, match="is a 32-bit library"):
        userspace.find(Host(root), VERSION)


def test_a_library_linking_out_of_the_root_is_refused_not_followed(tmp_path: Path) -> None:
    root = bare(tmp_path)
    write_userspace(root, VERSION, open_modules=False)
    outside = tmp_path / "outside.so"
    outside.write_bytes(ELF64_LIBRARY)
    lib = root / f"usr/lib64/libcuda.so.{VERSION}"
    lib.unlink()
    lib.symlink_to("../../../outside.so")
    with pytest.raises(DriverError, match="climbs above the root"):
        userspace.find(Host(root), VERSION)


def test_a_fifo_named_as_a_library_is_refused_without_hanging(tmp_path: Path) -> None:
    root = bare(tmp_path)
    write_userspace(root, VERSION, open_modules=False)
    lib = root / f"usr/lib64/libcuda.so.{VERSION}"
    lib.unlink()
    os.mkfifo(lib)
    os.mkfifo(root / "usr/lib64/notes.fifo")
    signal.alarm(5)
    try:
        with pytest.raises(DriverError, match="is a FIFO"):
            userspace.find(Host(root), VERSION)
    finally:
        signal.alarm(0)


def test_the_record_holds_the_root_and_counts_not_every_path(make_host: HostFactory) -> None:
    found = userspace.find(make_host("nc24ads-a100-v4", "ready"), VERSION)
    assert userspace.record_fields(found) == {
        "root": "/", "libraries": len(found.libraries), "binaries": 5, "firmware": 2,
        "configs": 0, "persistenced_socket": False, "fabricmanager_socket": False,
        "mps_pipe_dir": False}


def test_every_gpu_has_a_distinct_uuid_in_the_drivers_format(make_host: HostFactory) -> None:
    host = make_host("nd96amsr-a100-v4", "driver")
    uuids = [line.split(":", 1)[1].strip()
             for path in host.glob("/proc/driver/nvidia/gpus/*/information")
             for line in host.read_text(path).splitlines() if line.startswith("GPU UUID:")]
    assert len(set(uuids)) == 8
    assert all(len(u) == 40 and u.startswith("GPU-") and u.count("-") == 5 for u in uuids)


# -- the driver step, the boot record, driver status ----------------------------------------


class NoKernel:
    """A loaded driver needs no modprobe."""

    def modinfo(self, paths: list[str]) -> dict[str, Any]:
        raise AssertionError(f"boot read modules on a loaded node: {paths}")

    def run(self, argv: tuple[str, ...]) -> None:
        raise AssertionError(f"boot loaded a module on a loaded node: {argv}")


def _boot(host: Host) -> boot.BootRun:
    return boot.boot(host, AgentConfig(), boot.Adapters(systemd=NoSystemd(), kmod=NoKernel()))


def test_boot_records_the_driver_root_and_a_removed_libcuda_fails_the_next_boot(
        make_host: HostFactory) -> None:
    host = with_runtime_binary(make_host("nc24ads-a100-v4", "ready"))
    run = _boot(host)
    assert run.outcome == "ok", run.steps
    driver = next(s for s in run.steps if s["name"] == "driver")
    assert driver["driver_root"] == {"root": "/", "libraries": 10, "binaries": 5, "firmware": 2,
                                     "configs": 0, "persistenced_socket": False,
                                     "fabricmanager_socket": False, "mps_pipe_dir": False}
    (host.root / f"usr/lib64/libcuda.so.{VERSION}").unlink()
    again = _boot(host)
    driver = next(s for s in again.steps if s["name"] == "driver")
    assert (again.outcome, driver["code"]) == ("failed", "driver-unavailable")
    assert f"libcuda.so.{VERSION}" in driver["error"] and "Flatcar driver sysext" in driver["hint"]


@pytest.mark.parametrize("change", ["replaced", "installed"])
def test_a_driver_library_replaced_or_newly_installed_is_seen_by_the_next_boot(
        make_host: HostFactory, change: str) -> None:
    host = with_runtime_binary(make_host("nc24ads-a100-v4", "ready"))
    assert _boot(host).outcome == "ok"
    name = "libcuda" if change == "replaced" else "libnvidia-nscq"
    library = host.root / f"usr/lib64/{name}.so.{VERSION}"
    assert library.exists() == (change == "replaced")
    library.unlink(missing_ok=True)
    library.write_bytes(ELF64_LIBRARY + b"another build")
    again = _boot(host)
    driver = next(s for s in again.steps if s["name"] == "driver")
    assert (again.outcome, str(library).removeprefix(str(host.root))) == (
        "ok", f"/usr/lib64/{name}.so.{VERSION}")
    assert driver["driver_root"]["libraries"] == 10 + (change == "installed")


def test_driver_status_says_where_the_user_space_is(make_host: HostFactory, cli: Cli) -> None:
    host = make_host("nc24ads-a100-v4", "ready")
    result = cli("--root", str(host.root), "driver", "status")
    assert "user-space: / (10 libraries, 5 binaries, 2 firmware files)" in result.out
    result = cli("--root", str(host.root), "driver", "status", "--json")
    document = json.loads(result.out)
    assert document["driver_root"]["root"] == "/" and document["driver_root_error"] is None
    assert f"/usr/lib64/libcuda.so.{VERSION}" in document["driver_root"]["libraries"]


def test_driver_status_says_why_there_is_no_user_space(make_host: HostFactory, cli: Cli) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    (host.root / f"usr/lib64/libnvidia-ml.so.{VERSION}").unlink()
    result = cli("--root", str(host.root), "driver", "status")
    assert f"user-space: not found: NVIDIA {VERSION} is loaded, but its user-space is missing" \
        in result.out
    bare_host = make_host("nc4as-t4-v3", "bare")
    document = json.loads(cli("--root", str(bare_host.root), "driver", "status", "--json").out)
    assert (document["driver_root"], document["driver_root_error"]) == (
        None, "no NVIDIA driver is loaded")


def test_plan_names_missing_user_space_as_the_driver_problem_boot_then_fails_with(
        make_host: HostFactory) -> None:
    host = with_runtime_binary(make_host("nc4as-t4-v3", "ready"))
    (host.root / f"usr/lib64/libcuda.so.{VERSION}").unlink()
    adapters = boot.Adapters(systemd=NoSystemd(), kmod=NoKernel())
    problems = boot.plan(host, AgentConfig(), adapters).problems
    (problem,) = [p for p in problems if p.step == "driver"]
    driver = next(s for s in _boot(host).steps if s["name"] == "driver")
    assert (problem.step, problem.code, problem.error) == ("driver", driver["code"],
                                                            driver["error"])
