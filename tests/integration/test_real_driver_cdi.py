"""gpunode, as a user runs it, on fixture nodes that carry NVIDIA's real 550 (and 535) files.

Each node is a fixture T4 with its driver loaded (gpunode_testing.fixtures) whose driver
user-space is Debian's real files instead of the stand-ins, in one of the layouts gpunode knows
(gpunode_testing.real_driver): the Flatcar driver sysext, Flatcar's nvidia.service, a prebuilt
directory, a build-cache entry. gpunode runs as a process (`python -m gpunode --root NODE …`),
and the tests read what it prints: which driver root `driver status` finds, whether what the
CDI spec mounts exists and is named as the loader asks for it, and what plan, boot and status
say on such a node.

Tests marked xfail(strict=True) say what gpunode does not do yet on real files (issue 35); each
flips to a failure, to be unmarked, once gpunode does it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpunode.driver import elf
from gpunode.pipeline import boot
from gpunode_testing import fixtures, real_driver
from gpunode_testing.driver_files import elf_library
from helpers.fake_kernel import FakeGpus
from hostile.support import Cli
from real.nvidia_driver import ensure_driver
from real.nvidia_modules import BuiltModules

T4 = "nc4as-t4-v3"
LAYOUTS = {  # layout → (module flavour, driver root gpunode should report, firmware files)
    "sysext": ("open", "/", 2),
    "nvidia.service": ("proprietary", "/opt/nvidia/{version}/{kernel}", 0),
    "prebuilt": ("open", "/opt/nvidia/modules/{kernel}", 2),
    "build": ("open", "/opt/gpunode/drivers/{kernel}/{version}-open", 2),
}
# (Debian release, layout): 550 in every layout; the 535 branches (compute, utility and
# firmware only) in the two layouts that need no modules, since the compiled modules are 550's
CASES = [("550", layout) for layout in LAYOUTS] + [("535", "sysext"),
                                                   ("535-tesla", "nvidia.service")]
CASE_IDS = [f"{release}-{layout}" for release, layout in CASES]
ISSUE = "issue 35"
# What gpunode takes of a layout's libraries: every one of libnvidia-container's capability
# lists (driver/userspace.py), so neither the X server's module (display) nor libnvidia-api
# (no version in its name; the toolkit takes it only behind a feature flag)
NOT_TAKEN = {"libglxserver_nvidia", "libnvidia-api"}
VIDEO = ("libnvcuvid", "libnvidia-encode", "libnvidia-opticalflow")


@pytest.fixture
def modules(open_modules: BuiltModules,
            proprietary_modules: BuiltModules) -> dict[str, BuiltModules]:
    return {"open": open_modules, "proprietary": proprietary_modules}


@pytest.fixture(scope="module")
def sources() -> dict[str, real_driver.DriverSource]:
    found = {}
    for release in {release for release, _ in CASES}:
        driver = ensure_driver(release)
        found[release] = real_driver.read_source(driver.root, driver.version)
    return found


def node(tmp_path: Path, source: real_driver.DriverSource, layout: str,
         modules: dict[str, BuiltModules], config: str = 'gpu_access = "cdi"') -> Path:
    """A T4 node on `source`'s files in `layout`, its agent config's [containerd] `config`
    (CDI mode: the fixture has no NVIDIA container toolkit)."""
    flavour = LAYOUTS[layout][0]
    needs_modules = layout in ("prebuilt", "build")
    root = real_driver.build_node(T4, tmp_path / layout, source, layout, flavour=flavour,
                                  modules=modules[flavour].directory if needs_modules else None)
    agent = root / "etc/gpunode/config.toml"
    agent.parent.mkdir(parents=True, exist_ok=True)
    agent.write_text(f"[containerd]\n{config}\n")
    return root


def installed(source: real_driver.DriverSource, layout: str) -> set[str]:
    """The library files a layout puts on the node that gpunode takes (NOT_TAKEN aside)."""
    if layout == "sysext":  # Flatcar's USE flags: no X (real_driver.install_sysext)
        without_x = {"libGLX_nvidia", "libglxserver_nvidia", "libnvidia-fbc", "libvdpau_nvidia"}
        libraries = [lib for lib in source.select() if lib.stem not in without_x]
    elif layout == "build":
        libraries = list(source.select(real_driver.DEFAULT_CAPABILITIES))
    else:
        libraries = list(source.select())
    return {lib.name for lib in libraries if lib.stem not in NOT_TAKEN}


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


@pytest.mark.parametrize("release, layout", CASES, ids=CASE_IDS)
def test_driver_status_finds_the_real_user_space_in_each_layout(
        tmp_path: Path, sources: dict[str, real_driver.DriverSource],
        modules: dict[str, BuiltModules], release: str, layout: str) -> None:
    """`gpunode driver status --json` finds the real user-space where the layout puts it: the
    driver root, every library the layout installed, each with the SONAME binutils' readelf
    reads from it, the binaries, and the GSP firmware where the layout has it (nvidia.service
    copies none; Debian's 535 packages carry 535's own)."""
    source = sources[release]
    root = node(tmp_path, source, layout, modules)
    done = gpunode(root, "driver", "status", "--json")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)["driver_root"]
    _, where, firmware = LAYOUTS[layout]
    kernel = (root / "proc/sys/kernel/osrelease").read_text().strip()
    assert found["version"] == source.version
    assert found["root"] == where.format(version=source.version, kernel=kernel)
    assert {Path(path).name for path in found["libraries"]} == installed(source, layout)
    readelf = {lib.name: lib.soname for lib in source.libraries}
    assert {Path(path).name: soname for path, soname in found["sonames"].items()} == {
        name: readelf[name] for name in installed(source, layout)}
    assert {Path(path).name for path in found["binaries"]} == set(source.binaries) - {
        "nv-fabricmanager"}  # not among the toolkit's binaries
    assert len(found["firmware"]) == (firmware if source.firmware else 0)


@pytest.mark.parametrize("release, layout", CASES, ids=CASE_IDS)
def test_every_host_path_the_spec_names_exists_on_the_node(
        tmp_path: Path, sources: dict[str, real_driver.DriverSource],
        modules: dict[str, BuiltModules], release: str, layout: str) -> None:
    """Every mount and device node of gpunode's CDI spec for a real-file node is there on the
    node, and libcuda is among the mounts."""
    source = sources[release]
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


@pytest.mark.parametrize("release, layout", CASES, ids=CASE_IDS)
def test_every_library_is_mounted_under_its_file_name_soname_or_unversioned_name(
        tmp_path: Path, sources: dict[str, real_driver.DriverSource],
        modules: dict[str, BuiltModules], release: str, layout: str) -> None:
    """Each library the spec mounts appears in the container only under names something asks
    for: its file name, its DT_SONAME as binutils' readelf reads it (the dynamic loader), or
    lib<name>.so (a linker, dlopen); and under its SONAME wherever it has one."""
    source = sources[release]
    root = node(tmp_path, source, layout, modules)
    sonames = {lib.name: lib.soname for lib in source.libraries}
    wrong, names = [], {}
    for mount in mounts(spec_of(root)):
        file = Path(mount["hostPath"]).name
        if file in sonames:
            inside = Path(mount["containerPath"]).name
            names.setdefault(file, set()).add(inside)
            if inside not in {file, sonames[file], file.split(".so")[0] + ".so"}:
                wrong.append(f"{file} as {mount['containerPath']}")
    assert wrong == []
    assert names.keys() == installed(source, layout)
    assert all(sonames[file] in inside for file, inside in names.items() if sonames[file])


@pytest.mark.parametrize("release, layout", CASES, ids=CASE_IDS)
def test_plan_boot_and_status_on_the_real_files(
        tmp_path: Path, sources: dict[str, real_driver.DriverSource],
        modules: dict[str, BuiltModules], release: str, layout: str) -> None:
    """On a node whose driver is loaded: `plan` says it will write the spec, `boot` writes
    exactly what `cdi generate` prints and the node is ready by `status`, and a second boot
    changes nothing."""
    root = node(tmp_path, sources[release], layout, modules)
    planned = gpunode(root, "plan", "--json")
    assert planned.returncode == 0, planned.stderr
    actions = json.loads(planned.stdout)["actions"]
    assert [a for a in actions if a["step"] == "cdi"] == [
        {"step": "cdi", "description": "write /var/run/cdi/nvidia.yaml: 1 GPU by index and "
                                       "UUID, and all (hook-free layout)"}]
    booted = gpunode(root, "boot")
    assert booted.returncode == 0, booted.stderr
    written = root / "var/run/cdi/nvidia.yaml"
    assert yaml.safe_load(written.read_text()) == spec_of(root)
    status = gpunode(root, "status", "--json")
    assert status.returncode == 0, status.stdout
    assert json.loads(status.stdout)["verdict"] == "ready"
    before = written.stat()
    again = gpunode(root, "boot")
    assert again.returncode == 0, again.stderr
    cdi_step = next(json.loads(line) for line in again.stderr.splitlines()
                    if line.startswith("{") and json.loads(line).get("step") == "cdi")
    assert cdi_step["changed"] is False
    assert written.stat().st_mtime_ns == before.st_mtime_ns


def test_by_default_the_spec_mounts_the_video_libraries_as_nvidia_ctk_does(
        tmp_path: Path, source: real_driver.DriverSource,
        modules: dict[str, BuiltModules]) -> None:
    """NVDEC/NVENC (libnvcuvid, libnvidia-encode) and optical flow reach a container given a
    GPU by the default spec, as with `nvidia-ctk cdi generate` (which filters no capability)."""
    root = node(tmp_path, source, "sysext", modules)
    names = {Path(m["hostPath"]).name for m in mounts(spec_of(root))}
    assert {f"{stem}.so.{source.version}" for stem in VIDEO} <= names


def test_a_video_only_spec_mounts_the_video_libraries_under_their_loader_names(
        tmp_path: Path, source: real_driver.DriverSource,
        modules: dict[str, BuiltModules]) -> None:
    """`[cdi] capabilities = ["video"]` on a full install (nvidia.service: every library):
    libnvcuvid, libnvidia-encode, libnvidia-opticalflow and libvdpau_nvidia under their
    SONAMEs (and libnvidia-opticalflow.so, which the toolkit always links), and no
    compute or utility library."""
    root = node(tmp_path, source, "nvidia.service", modules)
    (root / "etc/gpunode/config.toml").write_text('[cdi]\ncapabilities = ["video"]\n')
    inside = {Path(m["containerPath"]).name for m in mounts(spec_of(root))
              if ".so" in m["hostPath"]}
    assert inside == {*(f"{stem}.so.{v}" for stem in (*VIDEO, "libvdpau_nvidia")
                        for v in (source.version, "1")), "libnvidia-opticalflow.so"}


def test_the_graphics_config_files_of_a_full_install_are_mounted_where_the_toolkit_does(
        tmp_path: Path, source: real_driver.DriverSource,
        modules: dict[str, BuiltModules]) -> None:
    """Debian's EGL vendor and Vulkan ICD/layer files in /usr/share: the EGL one mounted in
    /usr/share, the Vulkan ones in /etc (internal/discover/graphics.go), and with the
    graphics capability off none of them."""
    root = node(tmp_path, source, "sysext", modules)
    shipped = sorted(p.relative_to(source.root) for p in source.root.glob("usr/share/*/*/*.json"))
    assert len(shipped) >= 3, shipped  # egl_vendor.d, icd.d, implicit_layer.d
    for rel in shipped:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source.root / rel, root / rel)
    found = {m["containerPath"]: m["hostPath"] for m in mounts(spec_of(root))}
    assert {"/usr/share/glvnd/egl_vendor.d/10_nvidia.json": "/usr/share/glvnd/egl_vendor.d/"
            "10_nvidia.json", "/etc/vulkan/icd.d/nvidia_icd.json": "/usr/share/vulkan/icd.d/"
            "nvidia_icd.json", "/etc/vulkan/implicit_layer.d/nvidia_layers.json":
            "/usr/share/vulkan/implicit_layer.d/nvidia_layers.json"}.items() <= found.items()
    (root / "etc/gpunode/config.toml").write_text('[cdi]\ncapabilities = ["compute", '
                                                  '"utility"]\n')
    assert not [m for m in mounts(spec_of(root)) if m["hostPath"].endswith(".json")]


@pytest.mark.parametrize("soname", ["libcuda.so.1", "libnvidia-gpucomp.so.550.163.01", None])
def test_the_unit_tests_stand_in_libraries_carry_the_soname_readelf_reads(
        tmp_path: Path, soname: str | None) -> None:
    """The fixtures' stand-in libraries (driver_files.elf_library) are ELF files binutils reads
    the same SONAME from as gpunode does, so the unit tests' libraries are real enough."""
    path = tmp_path / "lib.so"
    path.write_bytes(elf_library(soname))
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    found = re.search(r"Library soname: \[(.*)\]", out)
    assert (found.group(1) if found else None) == soname
    with open(path, "rb") as stream:
        assert elf.read(stream) == elf.Library(64, soname)


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
