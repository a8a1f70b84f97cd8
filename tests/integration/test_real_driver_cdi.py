"""gpunode, as a user runs it, on fixture nodes that carry NVIDIA's real 550 (and 535) files.

Each node is a fixture T4 with its driver loaded (gpunode_testing.fixtures) whose driver
user-space is Debian's real files instead of the stand-ins, in one of the layouts gpunode knows
(gpunode_testing.real_driver): the Flatcar driver sysext, Flatcar's nvidia.service, a prebuilt
directory, a build-cache entry. gpunode runs as a process (`python -m gpunode --root NODE …`),
and the tests read what it prints: which driver root `driver status` finds, and whether what the
CDI spec mounts exists and is named as the loader asks for it.

Tests marked xfail(strict=True) say what gpunode does not do yet on real files (issue 35); each
flips to a failure, to be unmarked, once gpunode does it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpunode.pipeline import boot
from gpunode_testing import fixtures, real_driver
from helpers.fake_kernel import FakeGpus
from hostile.support import Cli
from real.nvidia_driver import ensure_driver
from real.nvidia_modules import BuiltModules, ensure_modules

T4 = "nc4as-t4-v3"
LAYOUTS = {  # layout → (module flavour, driver root gpunode should report, firmware files)
    "sysext": ("open", "/", 2),
    "nvidia.service": ("proprietary", "/opt/nvidia/{version}/{kernel}", 0),
    "prebuilt": ("open", "/opt/nvidia/modules/{kernel}", 2),
    "build": ("open", "/opt/gpunode/drivers/{kernel}/{version}-open", 2),
}
ISSUE = "issue 35"


@pytest.fixture(scope="module")
def source() -> real_driver.DriverSource:
    driver = ensure_driver("550")
    return real_driver.read_source(driver.root, driver.version)


@pytest.fixture(scope="module")
def open_modules() -> BuiltModules:
    return ensure_modules("open")


@pytest.fixture(scope="module")
def proprietary_modules() -> BuiltModules:
    return ensure_modules("proprietary")


def node(tmp_path: Path, source: real_driver.DriverSource, layout: str,
         modules: dict[str, BuiltModules]) -> Path:
    flavour = LAYOUTS[layout][0]
    return real_driver.build_node(T4, tmp_path / layout, source, layout, flavour=flavour,
                                  modules=modules[flavour].directory)


@pytest.fixture
def modules(open_modules: BuiltModules,
            proprietary_modules: BuiltModules) -> dict[str, BuiltModules]:
    return {"open": open_modules, "proprietary": proprietary_modules}


def gpunode(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """gpunode as a user runs it, against the node at `root`."""
    return subprocess.run([sys.executable, "-m", "gpunode", "--root", str(root),
                           "--log-format", "json", *args], capture_output=True, text=True,
                          timeout=120, check=False)


def spec_of(root: Path) -> dict[str, Any]:
    done = gpunode(root, "cdi", "generate")
    assert done.returncode == 0, done.stderr
    return dict(yaml.safe_load(done.stdout))


def mounts(spec: dict[str, Any]) -> list[dict[str, Any]]:
    edits = [spec.get("containerEdits", {})]
    edits += [device.get("containerEdits", {}) for device in spec.get("devices", [])]
    return [mount for edit in edits for mount in edit.get("mounts", [])]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_driver_status_finds_the_real_user_space_in_each_layout(
        tmp_path: Path, source: real_driver.DriverSource,
        modules: dict[str, BuiltModules], layout: str) -> None:
    """`gpunode driver status --json` finds the real 550 user-space where the layout puts it:
    the driver root, the compute and utility libraries, the binaries, and the GSP firmware
    where the layout has it (nvidia.service copies none)."""
    root = node(tmp_path, source, layout, modules)
    done = gpunode(root, "driver", "status", "--json")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)["driver_root"]
    _, where, firmware = LAYOUTS[layout]
    kernel = (root / "proc/sys/kernel/osrelease").read_text().strip()
    assert found["version"] == source.version
    assert found["root"] == where.format(version=source.version, kernel=kernel)
    expected = {lib.name for lib in source.select(real_driver.DEFAULT_CAPABILITIES)}
    assert {Path(path).name for path in found["libraries"]} == expected
    assert len(found["binaries"]) == 5 and len(found["firmware"]) == firmware


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_host_path_the_spec_names_exists_on_the_node(
        tmp_path: Path, source: real_driver.DriverSource,
        modules: dict[str, BuiltModules], layout: str) -> None:
    """Every mount and device node of gpunode's CDI spec for a real-file node is there on the
    node, and libcuda is among the mounts."""
    root = node(tmp_path, source, layout, modules)
    spec = spec_of(root)
    for mount in mounts(spec):
        assert os.path.lexists(f"{root}{mount['hostPath']}"), mount
    nodes = [n for edit in [spec["containerEdits"], *(d["containerEdits"] for d in
                                                      spec["devices"])]
             for n in edit.get("deviceNodes", [])]
    for device in nodes:
        assert os.path.lexists(f"{root}{device.get('hostPath', device['path'])}"), device
    assert any(Path(m["hostPath"]).name == f"libcuda.so.{source.version}" for m in mounts(spec))


@pytest.mark.parametrize("release", ["535", "535-tesla"])
def test_the_535_branch_is_found_and_mounted_too(tmp_path: Path, release: str) -> None:
    """A node on Debian's 535 files (bookworm's, trixie's Tesla 535) in the sysext layout:
    driver status reports that version and the spec mounts its libcuda and nvidia-smi."""
    driver = ensure_driver(release)
    source = real_driver.read_source(driver.root, driver.version)
    root = real_driver.build_node(T4, tmp_path / "535", source, "sysext", flavour="proprietary")
    done = gpunode(root, "driver", "status", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["driver_root"]["version"] == driver.version
    names = {Path(m["hostPath"]).name for m in mounts(spec_of(root))}
    assert {f"libcuda.so.{driver.version}", "nvidia-smi"} <= names


@pytest.mark.xfail(strict=True, reason=f"{ISSUE} item 4: the spec names libraries .so.1 by rule; "
                   "libnvidia-gpucomp and libnvidia-pkcs11-openssl3 have the full version as "
                   "SONAME")
def test_every_library_is_mounted_under_its_file_name_soname_or_unversioned_name(
        tmp_path: Path, source: real_driver.DriverSource,
        modules: dict[str, BuiltModules]) -> None:
    """Each library the spec mounts appears in the container only under names something asks
    for: its file name, its DT_SONAME (the dynamic loader), or lib<name>.so (a linker)."""
    root = node(tmp_path, source, "sysext", modules)
    sonames = {lib.name: lib.soname for lib in source.libraries}
    wrong = []
    for mount in mounts(spec_of(root)):
        file = Path(mount["hostPath"]).name
        if file in sonames:
            allowed = {file, sonames[file], file.split(".so")[0] + ".so"}
            if Path(mount["containerPath"]).name not in allowed:
                wrong.append(f"{file} as {mount['containerPath']}")
    assert wrong == []


@pytest.mark.xfail(strict=True, reason=f"{ISSUE} item 5: gpunode mounts the compute and utility "
                   "libraries only; nvidia-ctk's spec mounts every *.so.<version>")
def test_by_default_the_spec_mounts_the_video_libraries_as_nvidia_ctk_does(
        tmp_path: Path, source: real_driver.DriverSource,
        modules: dict[str, BuiltModules]) -> None:
    """NVDEC/NVENC (libnvcuvid, libnvidia-encode) and optical flow reach a container given a
    GPU by the default spec, as with `nvidia-ctk cdi generate` (which filters no capability)."""
    root = node(tmp_path, source, "sysext", modules)
    names = {Path(m["hostPath"]).name for m in mounts(spec_of(root))}
    video = {lib.name for lib in source.select(["video"]) if lib.stem != "libvdpau_nvidia"}
    assert video <= names


def test_a_gpu_not_yet_initialized_still_gets_its_index_device(
        tmp_path: Path, source: real_driver.DriverSource,
        modules: dict[str, BuiltModules]) -> None:
    """Right after the modules load, /proc shows GPU-????????-… until the GPU is opened once:
    the spec still has the index device and `all`, and no device named by the placeholder."""
    root = node(tmp_path, source, "sysext", modules)
    real_driver.write_uninitialized_gpus(root)
    done = gpunode(root, "cdi", "generate")
    assert done.returncode == 0, done.stderr
    names = {device["name"] for device in yaml.safe_load(done.stdout)["devices"]}
    assert {"0", "all"} <= names and not any("?" in name for name in names)


@pytest.mark.parametrize("machine", [T4, "nd96amsr-a100-v4"])
def test_a_node_on_real_files_goes_from_gpus_not_initialized_to_ready_through_boot(
        tmp_path: Path, source: real_driver.DriverSource, cli: Cli,
        monkeypatch: pytest.MonkeyPatch, machine: str) -> None:
    """The driver loaded and every GPU still GPU-????…, as right after `modprobe nvidia`:
    status says not ready; `gpunode boot` starts the real driver's nvidia-persistenced and
    waits, the spec names every GPU by index and UUID, and status says ready. The fixture's
    GPUs cannot be initialized by a real persistenced: FakeGpus stands in for what it does to
    them (tests/helpers/fake_kernel.py), through the initializer boot is given."""
    root = real_driver.build_node(machine, tmp_path / machine, source, "sysext", state="ready",
                                  flavour="open")
    real_driver.write_uninitialized_gpus(root)
    before = cli("--root", str(root), "status", "--json")
    failed = {c["name"] for c in json.loads(before.out)["checks"] if c["state"] == "fail"}
    assert before.code == 1 and "gpu_init" in failed
    fake = FakeGpus(root, fixtures.MACHINES[machine])
    real = boot.adapters_for
    monkeypatch.setattr(boot, "adapters_for", lambda host, config: dataclasses.replace(
        real(host, config), gpus=fake))
    done = cli("--root", str(root), "boot")
    assert done.code == 0, done.err
    assert fake.calls == [("start", "/usr/bin/nvidia-persistenced")]  # the driver's own
    after = cli("--root", str(root), "status", "--json")
    report = json.loads(after.out)
    assert (after.code, report["verdict"]) == (0, "ready"), [
        c for c in report["checks"] if c["state"] not in ("ok", "skip")]
    spec = yaml.safe_load((root / "var/run/cdi/nvidia.yaml").read_text())
    names = [d["name"] for d in spec["devices"]]
    gpus = len(list((root / "proc/driver/nvidia/gpus").iterdir()))
    assert len([n for n in names if n.startswith("GPU-")]) == gpus
    assert len([n for n in names if n.isdigit()]) == gpus and names[-1] == "all"
    assert not any("?" in n for n in names)
