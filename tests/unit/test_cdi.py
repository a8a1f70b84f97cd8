"""gpunode's CDI spec: valid by the CDI spec's rules, byte-stable, one device per GPU by index and
by UUID plus `all`, the hook or hook-free layout, `gpunode cdi generate`, and boot's cdi step.

The rules below are written from the CDI specification's text (cncf-tags/container-device-
interface, SPEC.md: "Kind", "CDI Devices", "OCI Edits", "Released versions"), not from its code.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import HostFactory
from gpunode.cdi import node as cdinode
from gpunode.cdi import spec as cdi
from gpunode.config import AgentConfig
from gpunode.errors import DeviceMinorCollision, DriverError
from gpunode.gpu import driverinfo
from gpunode.pipeline import boot
from gpunode.platform.host import Host
from gpunode.platform.systemd import NoSystemd
from gpunode.status import evaluate, observe
from hostile.support import Cli, check_refusal

T4, ND96 = "nc4as-t4-v3", "nd96amsr-a100-v4"
VERSION = "550.127.08"  # the fixtures' driver

# -- the CDI spec's rules (SPEC.md) ---------------------------------------------------------------
_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
KIND = re.compile(rf"{_LABEL}(?:\.{_LABEL})*/[A-Za-z0-9](?:[A-Za-z0-9_.-]{{0,61}}[A-Za-z0-9])?")
DEVICE_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.-]*[A-Za-z0-9])?")
RELEASED = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
OCI_HOOKS = {"createRuntime", "createContainer", "startContainer", "poststart", "poststop"}
EDIT_KEYS = {"env", "deviceNodes", "mounts", "hooks"}  # what this spec may use of 0.5.0


def cdi_rule_violations(doc: dict[str, Any]) -> list[str]:
    bad: list[str] = []
    if set(doc) - {"cdiVersion", "kind", "devices", "containerEdits"}:
        bad.append(f"unknown top-level keys {set(doc)}")
    if doc.get("cdiVersion") not in RELEASED:
        bad.append(f"cdiVersion {doc.get('cdiVersion')!r} is no released version")
    if len(str(doc.get("kind")).split("/")[0]) > 253 or not KIND.fullmatch(str(doc.get("kind"))):
        bad.append(f"kind {doc.get('kind')!r}")
    devices = doc.get("devices") or []
    if not devices:
        bad.append("no device: a CDI file needs at least one")
    names = [d.get("name") for d in devices]
    if len(names) != len(set(names)):
        bad.append("device names repeat")
    for name in names:
        if not isinstance(name, str) or not DEVICE_NAME.fullmatch(name):
            bad.append(f"device name {name!r}")
        elif name[0].isdigit() and RELEASED.index(doc["cdiVersion"]) < RELEASED.index("0.5.0"):
            bad.append(f"device name {name!r} starts with a digit: needs cdiVersion 0.5.0")
    for edits in [doc.get("containerEdits") or {}, *(d.get("containerEdits") or {}
                                                     for d in devices)]:
        if set(edits) - EDIT_KEYS:
            bad.append(f"unknown containerEdits keys {set(edits) - EDIT_KEYS}")
        for node in edits.get("deviceNodes") or []:
            if not str(node.get("path", "")).startswith("/"):
                bad.append(f"device node path {node!r} is not absolute")
        for mount in edits.get("mounts") or []:
            if not (str(mount.get("hostPath", "")).startswith("/")
                    and str(mount.get("containerPath", "")).startswith("/")):
                bad.append(f"mount {mount!r}: hostPath and containerPath are required, absolute")
            if "type" in mount and RELEASED.index(doc["cdiVersion"]) < RELEASED.index("0.4.0"):
                bad.append("a mount's type needs cdiVersion 0.4.0")
        for hook in edits.get("hooks") or []:
            if hook.get("hookName") not in OCI_HOOKS:
                bad.append(f"hookName {hook.get('hookName')!r}")
            if not str(hook.get("path", "")).startswith("/"):
                bad.append(f"hook path {hook.get('path')!r} is not absolute")
    return bad


def spec_of(host: Host) -> dict[str, Any]:
    return cdinode.generate(host)


def with_hook(host: Host) -> Host:
    """The host with the toolkit's nvidia-cdi-hook installed (an executable stand-in)."""
    path = host.root / cdi.HOOK.lstrip("/")
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return host


@pytest.mark.parametrize("hooks", [False, True], ids=["hook-free", "nvidia-cdi-hook"])
@pytest.mark.parametrize("machine", [T4, ND96, "nc24ads-a100-v4", "a100-vfio"])
def test_the_spec_keeps_every_rule_of_the_cdi_specification(
    make_host: HostFactory, machine: str, hooks: bool
) -> None:
    host = make_host(machine, "driver")
    doc = spec_of(with_hook(host) if hooks else host)
    assert ("hooks" in doc["containerEdits"]) is hooks
    assert cdi_rule_violations(doc) == []
    assert doc["cdiVersion"] == "0.5.0"  # index names start with a digit; nothing newer used


def test_the_rules_catch_what_the_cdi_specification_forbids() -> None:
    broken = {"cdiVersion": "0.4.0", "kind": "nvidia.com", "devices": [
        {"name": "0", "containerEdits": {"deviceNodes": [{"path": "dev/nvidia0"}]}},
        {"name": "-x"}], "containerEdits": {"hooks": [{"hookName": "prestart", "path": "x"}]}}
    assert len(cdi_rule_violations(broken)) == 6


def test_the_lowest_version_follows_the_features_used() -> None:
    named = {"kind": cdi.KIND, "devices": [{"name": "gpu0"}], "containerEdits": {}}
    assert cdi.minimum_version(named) == "0.3.0"
    typed = {**named, "containerEdits": {"mounts": [{"hostPath": "/a", "containerPath": "/a",
                                                     "type": "none"}]}}
    assert cdi.minimum_version(typed) == "0.4.0"
    assert cdi.minimum_version({**named, "devices": [{"name": "0"}]}) == "0.5.0"


@pytest.mark.parametrize("fmt", cdi.FORMATS)
def test_the_bytes_are_the_same_on_every_run_and_every_identical_node(
    make_host: HostFactory, fmt: str
) -> None:
    first, second = make_host(ND96, "driver"), make_host(ND96, "driver")
    outputs = {cdi.render(spec_of(h), fmt) for h in (first, second, first)}
    assert len(outputs) == 1


def test_nd96_has_a_device_per_gpu_by_index_and_by_uuid_and_all(make_host: HostFactory) -> None:
    host = make_host(ND96, "driver")
    doc = spec_of(host)
    by_name = {d["name"]: d["containerEdits"]["deviceNodes"] for d in doc["devices"]}
    infos = driverinfo.read_gpu_infos(host)
    uuids = [infos[address].uuid for address in sorted(infos)]  # index = PCI address order
    assert len(by_name) == 8 + 8 + 1 and len(set(uuids)) == 8
    for i in range(8):
        assert by_name[str(i)] == [{"path": f"/dev/nvidia{i}"}]
        assert by_name[uuids[i]] == [{"path": f"/dev/nvidia{i}"}]
    assert by_name["all"] == [{"path": f"/dev/nvidia{i}"} for i in range(8)]
    control = [n["path"] for n in doc["containerEdits"]["deviceNodes"]]
    assert control == ["/dev/nvidia-modeset", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                       "/dev/nvidiactl"]


def test_a_gpu_is_named_by_the_uuid_its_driver_reports(make_host: HostFactory) -> None:
    info = "/proc/driver/nvidia/gpus/0001:00:00.0/information"
    uuid = "GPU-5a4f2c1e-9b7d-4e3a-8c6f-0123456789ab"
    host = make_host(T4, "driver", extra={info: f"Model: \t Tesla T4\nGPU UUID: \t {uuid}\n"
                                              "Device Minor: \t 0\n"})
    assert [d["name"] for d in spec_of(host)["devices"]] == ["0", uuid, "all"]


def test_a_gpu_without_a_uuid_line_keeps_its_index_device(make_host: HostFactory) -> None:
    """A UUID the driver does not give is a UUID device less, never a spec less."""
    info = "/proc/driver/nvidia/gpus/0001:00:00.0/information"
    host = make_host(T4, "driver", extra={info: "Model: \t Tesla T4\nDevice Minor: \t 0\n"})
    assert [d["name"] for d in spec_of(host)["devices"]] == ["0", "all"]


def _infos(*lines: tuple[str, str, int]) -> dict[str, driverinfo.GpuInfo]:
    return {address: driverinfo.parse_information(
        address, f"GPU UUID: \t {uuid}\nDevice Minor: \t {minor}\n")
        for address, uuid, minor in lines}


UUID_A = "GPU-5a4f2c1e-9b7d-4e3a-8c6f-0123456789ab"
UUID_B = "GPU-0b11d014-1111-4e3a-8c6f-0123456789ab"


def test_the_spec_leaves_out_the_uuid_device_of_a_gpu_not_yet_initialized() -> None:
    """The placeholder UUID names no device; the GPU's index device and `all` stay."""
    gpus, notes = cdinode.spec_gpus(_infos(("0000:3b:00.0", UUID_A, 0),
                                           ("0000:af:00.0", driverinfo.UNINITIALIZED_UUID, 1)),
                                    {})
    assert gpus == [(0, UUID_A, 0), (1, None, 1)]
    assert "GPU 1 (0000:af:00.0) has its index device only" in notes[0]


def test_a_gpu_whose_initialization_failed_gets_no_device_and_keeps_its_index() -> None:
    """No pod lands on a GPU the kernel log says failed RmInitAdapter: neither by index nor by
    `all`; the next GPU keeps its index (nvidia-smi's numbering)."""
    failed = {"0000:3b:00.0": "NVRM: GPU 0000:3b:00.0: RmInitAdapter failed! (0x22:0x56:667)"}
    gpus, notes = cdinode.spec_gpus(_infos(("0000:3b:00.0", driverinfo.UNINITIALIZED_UUID, 0),
                                           ("0000:af:00.0", UUID_B, 1)), failed)
    assert gpus == [(1, UUID_B, 1)]
    assert "RmInitAdapter failed" in notes[0]


def test_a_uuid_two_gpus_report_names_neither() -> None:
    gpus, notes = cdinode.spec_gpus(_infos(("0000:3b:00.0", UUID_A, 0),
                                           ("0000:af:00.0", UUID_A, 1)), {})
    assert gpus == [(0, None, 0), (1, None, 1)] and len(notes) == 2


def test_one_device_minor_for_two_gpus_is_no_spec_naming_both() -> None:
    """Which /dev/nvidia0 is which GPU cannot be told: no spec rather than a wrong GPU."""
    with pytest.raises(DeviceMinorCollision, match=r"0000:3b:00.0 and 0000:af:00.0 all say "
                       r"Device Minor 0 \(/dev/nvidia0\)"):
        cdinode.spec_gpus(_infos(("0000:3b:00.0", UUID_A, 0), ("0000:af:00.0", UUID_B, 0),
                                 ("0000:d8:00.0", UUID_B.replace("1111", "2222"), 1)), {})


def test_mig_capability_nodes_are_not_given_to_every_gpu_container(
    make_host: HostFactory,
) -> None:
    caps = "/proc/driver/nvidia/capabilities/mig"
    host = make_host(T4, "driver", extra={f"{caps}/config": "DeviceFileMinor: 1\n"
                                          "DeviceFileMode: 256\n",
                                          f"{caps}/monitor": "DeviceFileMinor: 2\n"
                                          "DeviceFileMode: 292\n"})
    doc = spec_of(host)
    every = [n["path"] for n in doc["containerEdits"]["deviceNodes"]]
    every += [n["path"] for d in doc["devices"] for n in d["containerEdits"]["deviceNodes"]]
    assert not [p for p in every if "nvidia-caps" in p]
    control = {n["path"] for n in doc["containerEdits"]["deviceNodes"]}
    assert {"/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidiactl"} <= control <= {
        "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidiactl", "/dev/nvidia-modeset"}


def test_without_the_hook_libraries_and_their_sonames_are_mounted_where_cuda_images_look(
    make_host: HostFactory,
) -> None:
    doc = spec_of(make_host(T4, "driver"))
    mounts = {m["containerPath"]: m["hostPath"] for m in doc["containerEdits"]["mounts"]}
    lib = "/usr/local/nvidia/lib64"
    assert mounts[f"{lib}/libcuda.so.1"] == mounts[f"{lib}/libcuda.so.{VERSION}"] \
        == mounts[f"{lib}/libcuda.so"] == f"/usr/lib64/libcuda.so.{VERSION}"
    assert mounts[f"{lib}/libnvidia-ml.so.1"] == f"/usr/lib64/libnvidia-ml.so.{VERSION}"
    assert mounts[f"{lib}/libnvidia-nvvm.so.4"] == f"/usr/lib64/libnvidia-nvvm.so.{VERSION}"
    assert mounts["/usr/local/nvidia/bin/nvidia-smi"] == "/usr/bin/nvidia-smi"
    firmware = {c: h for c, h in mounts.items() if "/firmware/" in c}
    assert all(c == h for c, h in firmware.items())  # where the kernel looks, in and out
    assert all(m["options"] == ["ro", "nosuid", "nodev", "bind"]
               for m in doc["containerEdits"]["mounts"])
    assert "hooks" not in doc["containerEdits"] and "env" not in doc["containerEdits"]


def test_with_the_hook_the_toolkits_symlink_and_ldcache_hooks_are_called(
    make_host: HostFactory,
) -> None:
    edits = spec_of(with_hook(make_host(T4, "driver")))["containerEdits"]
    assert [(h["hookName"], h["path"], h["args"]) for h in edits["hooks"]] == [
        ("createContainer", cdi.HOOK, ["nvidia-cdi-hook", "create-symlinks", "--link",
                                       "libcuda.so.1::/usr/lib64/libcuda.so"]),
        ("createContainer", cdi.HOOK, ["nvidia-cdi-hook", "update-ldcache", "--folder",
                                       "/usr/lib64"])]
    libs = [m for m in edits["mounts"] if ".so." in m["hostPath"]]
    assert libs and all(m["containerPath"] == m["hostPath"] for m in libs)


def test_a_node_without_the_drivers_libraries_gets_no_spec_and_is_told_why(
    make_host: HostFactory,
) -> None:
    host = make_host(T4, "driver")
    (host.root / f"usr/lib64/libcuda.so.{VERSION}").unlink()
    with pytest.raises(DriverError, match=rf"user-space is missing: libcuda.so.{VERSION}"):
        spec_of(host)


# -- gpunode cdi generate -------------------------------------------------------------------------


def test_generate_prints_yaml_and_json_of_the_same_spec(make_host: HostFactory, cli: Cli) -> None:
    root = str(make_host(ND96, "driver").root)
    as_yaml = cli("--root", root, "cdi", "generate")
    as_json = cli("--root", root, "cdi", "generate", "--format", "json")
    assert as_yaml.code == as_json.code == 0
    assert as_yaml.out.startswith(cdi.HEADER)
    assert yaml.safe_load(as_yaml.out) == json.loads(as_json.out)
    assert len(json.loads(as_json.out)["devices"]) == 17


def test_output_is_written_once_and_left_alone_while_the_bytes_stay_the_same(
    make_host: HostFactory, cli: Cli
) -> None:
    host = make_host(T4, "driver")
    argv = ["--root", str(host.root), "cdi", "generate", "--output", "/etc/cdi/nvidia.yaml"]
    assert cli(*argv).code == 0
    written = host.root / "etc/cdi/nvidia.yaml"
    before = written.stat()
    assert cli(*argv).code == 0
    after = written.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert cdi.parse(written.read_bytes()) == spec_of(host)


@pytest.mark.parametrize("output", ["relative/nvidia.yaml", "", "/etc/cdi/", "/etc"],
                         ids=["relative", "empty", "a-directory-name", "an-existing-directory"])
def test_a_bad_output_path_is_refused_with_exit_2(
    make_host: HostFactory, cli: Cli, output: str
) -> None:
    root = make_host(T4, "driver").root
    check_refusal(cli, root, ["--root", str(root), "cdi", "generate", "--output", output], 2,
                  r"--output")


def test_a_node_without_gpu_gets_no_spec_and_exit_0(make_host: HostFactory, cli: Cli) -> None:
    root = make_host("azure-d4s-v5", "bare").root
    result = cli("--root", str(root), "cdi", "generate", "--output", cdi.SPEC_PATH)
    assert (result.code, result.out) == (0, "")
    assert any(e["event"] == "cdi.no_gpu" for e in result.events)
    assert not (root / cdi.SPEC_PATH.lstrip("/")).exists()


def test_an_undecided_detection_is_refused_with_exit_1(make_host: HostFactory, cli: Cli) -> None:
    host = make_host(T4, "driver")
    (host.root / "sys/devices/pci0001:00/0001:00:00.0/vendor").write_text("0xzzzz\n")
    result = cli("--root", str(host.root), "cdi", "generate")
    assert (result.code, result.out) == (1, "")


# -- boot's cdi step, and status ------------------------------------------------------------------


def boot_run(host: Host) -> boot.BootRun:
    adapters = boot.Adapters(systemd=NoSystemd(), kmod=None)  # type: ignore[arg-type]
    return boot.boot(host, AgentConfig(), adapters)


def spec_file(host: Host) -> Path:
    return host.root / cdi.SPEC_PATH.lstrip("/")


def test_boot_writes_the_spec_after_the_driver_step(make_host: HostFactory) -> None:
    host = make_host(ND96, "driver")
    run = boot_run(host)
    step = next(s for s in run.steps if s["name"] == "cdi")
    assert [s["name"] for s in run.steps][:4] == ["detect", "driver", "gpu_init", "cdi"]
    assert (step["outcome"], step["changed"], step["devices"]) == ("ok", True, 17)
    assert spec_file(host).read_bytes() == cdi.render(spec_of(host))
    again = next(s for s in boot_run(host).steps if s["name"] == "cdi")
    assert again["changed"] is False


def test_boot_removes_its_spec_from_a_node_that_has_no_gpu(make_host: HostFactory) -> None:
    host = make_host("azure-d4s-v5", "bare", extra={cdi.SPEC_PATH: cdi.HEADER + "kind: x\n"})
    run = boot_run(host)
    assert next(s for s in run.steps if s["name"] == "cdi")["changed"] is True
    assert not spec_file(host).exists() and run.outcome == "no-gpu"


def test_boot_leaves_a_spec_it_did_not_write_on_a_node_without_gpu(
    make_host: HostFactory,
) -> None:
    host = make_host("azure-d4s-v5", "bare", extra={cdi.SPEC_PATH: "kind: other.com/x\n"})
    run = boot_run(host)
    assert "cdi" not in [s["name"] for s in run.steps] and spec_file(host).exists()


def test_without_a_driver_the_cdi_step_fails_saying_why(make_host: HostFactory) -> None:
    run = boot_run(make_host(T4, "bare"))  # no driver source: the driver step fails
    step = next(s for s in run.steps if s["name"] == "cdi")
    assert step["outcome"] == "failed" and step["error"].startswith(
        "no CDI spec: the driver step failed")


def test_status_passes_the_spec_boot_wrote(make_host: HostFactory) -> None:
    host = make_host(ND96, "ready")
    check = next(c for c in evaluate(observe(host, AgentConfig())).checks
                 if c.name == "cdi_spec")
    assert check.state == "ok", check


def _swap_first_device_nodes(root: Path) -> None:
    """Device 0 gives GPU 1's node: a pod asking for GPU 0 would get GPU 1."""
    document = json.loads(spec_file_at(root).read_text().removeprefix(cdi.HEADER))
    by_name = {d["name"]: d for d in document["devices"]}
    by_name["0"]["containerEdits"]["deviceNodes"] = [{"path": "/dev/nvidia1"}]
    spec_file_at(root).write_text(cdi.HEADER + json.dumps(document))


def _uninitialize(root: Path, address: str) -> None:
    """A GPU down: placeholder UUID, and RmInitAdapter failed in the kernel log."""
    info = root / "proc/driver/nvidia/gpus" / address / "information"
    info.write_text(re.sub(r"GPU UUID: \t .*", f"GPU UUID: \t {driverinfo.UNINITIALIZED_UUID}",
                           info.read_text()))
    (root / "dev/kmsg").write_text(f"3,100,5,-;NVRM: GPU {address}: RmInitAdapter failed! "
                                   "(0x22:0x56:667)\n")


@pytest.mark.parametrize(("change", "detail"), [
    (lambda root: (root / "usr/bin/nvidia-smi").unlink(), "names what is not on the node: "
     "/usr/bin/nvidia-smi"),
    (lambda root: spec_file_at(root).write_text("devices: [\n"), "not YAML"),
    (lambda root: spec_file_at(root).write_text(
        spec_file_at(root).read_text().replace('"name": "1",', '"name": "one",')),
     "disagrees with the driver: it lacks 1 (/dev/nvidia1); it names one, which the driver "
     "does not report"),
    (lambda root: _swap_first_device_nodes(root), "0 gives /dev/nvidia1, the driver says "
     "/dev/nvidia0"),
    (lambda root: spec_file_at(root).write_text(spec_file_at(root).read_text().replace(
        "GPU-", "GPU-0", 1)), "which the driver does not report"),
    (lambda root: _uninitialize(root, "0001:00:00.0"), "it names 0, which the driver does not "
     "report"),
], ids=["a-path-gone", "not-yaml", "a-gpu-missing", "an-index-to-another-gpu",
        "a-uuid-the-driver-does-not-report", "a-gpu-whose-init-failed-still-in-the-spec"])
def test_status_fails_a_spec_that_does_not_fit_the_node(
    make_host: HostFactory, change: Any, detail: str
) -> None:
    host = make_host(ND96, "ready")
    change(host.root)
    check = next(c for c in evaluate(observe(host, AgentConfig())).checks
                 if c.name == "cdi_spec")
    assert (check.state, detail in check.detail) == ("fail", True), check
    assert check.hint and "gpunode cdi generate --output /var/run/cdi/nvidia.yaml" in check.hint


def spec_file_at(root: Path) -> Path:
    return root / cdi.SPEC_PATH.lstrip("/")
