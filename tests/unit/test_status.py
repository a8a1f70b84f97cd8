"""`gpunode status`: the right verdict for every fixture machine and state, check by check."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import HostFactory
from gpunode.config import AgentConfig, ContainerdConfig
from gpunode.platform.host import Host
from gpunode.status import Report, evaluate, observe
from gpunode_testing import fixtures

CHECKS = ("gpus", "pci_scan", "nouveau", "gpu_binding", "driver", "driver_gpus", "gpu_init",
          "device_nodes", "cdi_spec", "containerd_runtime", "toolkit", "containerd_running",
          "kubelet_running", "device_plugin", "watch", "node", "last_boot")

# Checks that are not "ok" in each (machine, state); every other check must be ok.
NODE = {"node": "skip", "watch": "skip"}  # no kubeconfig (not joined), no watch run
BARE = {**NODE, "driver": "fail", "driver_gpus": "skip", "gpu_init": "skip",
        "device_nodes": "skip", "cdi_spec": "skip",
        "containerd_runtime": "fail", "toolkit": "fail", "containerd_running": "warn",
        "kubelet_running": "warn", "device_plugin": "warn", "last_boot": "skip"}
DRIVER = {**NODE, "cdi_spec": "warn", "containerd_runtime": "fail", "toolkit": "fail",
          "device_plugin": "warn", "last_boot": "skip"}
NO_GPU = {name: "skip" for name in CHECKS if name != "pci_scan"}

GPU_MACHINES = ("nc4as-t4-v3", "nc24ads-a100-v4", "nd96amsr-a100-v4", "nvads-a10-v5",
                "nc40ads-h100-v5", "nc6s-v3", "hgx-b200", "mixed-t4-a100")
EXPECTED: dict[tuple[str, str], tuple[str, dict[str, str]]] = {
    ("azure-d4s-v5", "bare"): ("no-gpu", NO_GPU),
    ("t4-nouveau", "bare"): ("not-ready", {**BARE, "nouveau": "fail", "gpu_binding": "fail"}),
    ("a100-vfio", "bare"): ("not-ready", {**BARE, "gpu_binding": "warn"}),
    ("a100-vfio", "driver"): ("not-ready", {**DRIVER, "gpu_binding": "warn"}),
    ("a100-vfio", "ready"): ("ready", {**NODE, "gpu_binding": "warn"}),
    ("mixed-v100-b200", "bare"): ("not-ready", BARE),
    **{(m, "bare"): ("not-ready", BARE) for m in GPU_MACHINES},
    **{(m, "driver"): ("not-ready", DRIVER) for m in GPU_MACHINES},
    **{(m, "ready"): ("ready", NODE) for m in GPU_MACHINES},
}


def report_for(host: Host, config: AgentConfig | None = None) -> Report:
    return evaluate(observe(host, config or AgentConfig()))


def states(report: Report) -> dict[str, str]:
    return {c.name: c.state for c in report.checks}


def check(report: Report, name: str):  # type: ignore[no-untyped-def]
    return next(c for c in report.checks if c.name == name)


def test_every_fixture_state_has_an_expectation() -> None:
    assert set(EXPECTED) == {(n, s) for n, m in fixtures.MACHINES.items() for s in m.states}


@pytest.mark.parametrize(("machine", "state"), list(EXPECTED), ids=[f"{m}-{s}" for m, s in
                                                                       EXPECTED])
def test_verdict_and_every_check_state(make_host: HostFactory, machine: str, state: str) -> None:
    verdict, not_ok = EXPECTED[(machine, state)]
    report = report_for(make_host(machine, state))
    assert report.verdict == verdict
    assert states(report) == {name: not_ok.get(name, "ok") for name in CHECKS}
    for c in report.checks:
        assert c.detail, f"{c.name} has no detail"
        assert c.state in ("ok", "skip") or c.hint, f"{c.name} is {c.state} without a hint"


def test_nd96_driver_and_device_nodes_details(make_host: HostFactory) -> None:
    report = report_for(make_host("nd96amsr-a100-v4", "ready"))
    assert check(report, "gpus").detail == "8 GPUs: 8x GA100 [A100 SXM4 80GB]; 6 NVSwitch"
    assert check(report, "driver").detail == "NVIDIA 550.127.08 (open kernel modules)"
    # nvidiactl, uvm, uvm-tools, modeset and one node per GPU
    assert check(report, "device_nodes").detail == "12 device nodes present"


def test_missing_proc_driver_tree_is_a_failed_check(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    for path in sorted((host.root / "proc/driver").rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    report = report_for(host)
    assert report.verdict == "not-ready"
    assert check(report, "driver").state == "fail"
    assert "driver is not loaded" in check(report, "driver").detail
    assert check(report, "driver_gpus").state == "skip"


def test_unparseable_driver_version_is_a_failed_check(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready", extra={"/proc/driver/nvidia/version": "hello\n"})
    c = check(report_for(host), "driver")
    assert (c.state, c.detail) == ("fail", "cannot parse /proc/driver/nvidia/version: 'hello'")


def test_gpu_the_driver_does_not_see_is_named(make_host: HostFactory) -> None:
    host = make_host("nd96amsr-a100-v4", "ready")
    info = host.root / "proc/driver/nvidia/gpus/0003:00:00.0"
    (info / "information").unlink()
    info.rmdir()
    c = check(report_for(host), "driver_gpus")
    assert (c.state, c.detail) == ("fail", "the driver does not see 0003:00:00.0")


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of character devices needs root")
def test_device_node_with_wrong_numbers_is_named(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    fixtures.make_char_device(host.root, "/dev/nvidia0", 195, 7, real=True)
    c = check(report_for(host), "device_nodes")
    assert (c.state, c.detail) == ("fail", "/dev/nvidia0 is 195:7, expected 195:0")


def test_device_nodes_that_are_plain_files_fail(make_host: HostFactory) -> None:
    report = report_for(make_host("nc4as-t4-v3", "ready", dev_nodes="plain"))
    c = check(report, "device_nodes")
    assert c.state == "fail"
    assert "/dev/nvidiactl is not a character device" in c.detail


def test_missing_device_node_is_named(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    (host.root / "dev/nvidia-uvm").unlink()
    c = check(report_for(host), "device_nodes")
    assert (c.state, c.detail) == ("fail", "/dev/nvidia-uvm missing")


def test_containerd_runtime_pointing_at_missing_binary(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    (host.root / "usr/bin/nvidia-container-runtime").unlink()
    c = check(report_for(host), "containerd_runtime")
    assert c.state == "fail"
    assert "/usr/bin/nvidia-container-runtime, which is not an executable file" in c.detail


def test_containerd_runtime_without_binary_name(make_host: HostFactory) -> None:
    config = fixtures.FLATCAR_CONTAINERD_CONFIG + (
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n'
        'runtime_type = "io.containerd.runc.v2"\n')
    host = make_host("nc4as-t4-v3", "ready", extra={"/etc/containerd/config.toml": config})
    c = check(report_for(host), "containerd_runtime")
    assert c.state == "fail"
    assert "has no options.BinaryName" in c.detail


def test_broken_containerd_config_names_file_and_line(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready",
                     extra={"/etc/containerd/config.toml": "version = 2\n[plugins\n"})
    c = check(report_for(host), "containerd_runtime")
    assert c.state == "fail"
    assert c.detail.startswith(f"{host.root}/etc/containerd/config.toml:2: not valid TOML")


def test_unknown_containerd_config_version_is_refused(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready", extra={"/etc/containerd/config.toml": "version = 4\n"})
    c = check(report_for(host), "containerd_runtime")
    assert c.state == "fail"
    assert "'version' is 4; gpunode understands 1 (or no version), 2 and 3" in c.detail


def test_runtime_found_in_an_imported_file(make_host: HostFactory) -> None:
    main = 'version = 2\nimports = ["/etc/containerd/conf.d/*.toml"]\n'
    # With runc too: containerd 1.x lets the imported CRI table replace the main file's, so an
    # import without runc would leave 1.x without its default runtime.
    dropin = ('[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n'
              'runtime_type = "io.containerd.runc.v2"\n' + fixtures.NVIDIA_RUNTIME)
    host = make_host("nc4as-t4-v3", "ready", extra={"/etc/containerd/config.toml": main,
                                                   "/etc/containerd/conf.d/nvidia.toml":
                                                   "version = 2\n" + dropin})
    c = check(report_for(host), "containerd_runtime")
    assert c.state == "ok", c.detail


def test_configured_runtime_name_and_config_path_are_used(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    config = AgentConfig(containerd=ContainerdConfig(runtime_name="runc",
                                                     config_path="/usr/share/containerd/config.toml"))
    c = check(report_for(host, config), "containerd_runtime")
    assert c.state == "fail"
    assert c.detail.startswith("runtime 'runc' in /usr/share/containerd/config.toml has no "
                               "options.BinaryName")


def test_failed_last_boot_is_shown_with_its_hint(make_host: HostFactory) -> None:
    record = {"schema_version": 1, "outcome": "failed", "finished_at": "2026-11-29T08:00:02Z",
              "steps": [{"name": "driver", "outcome": "failed", "error": "modprobe nvidia: exit 1",
                         "hint": "see dmesg"}]}
    host = make_host("nc4as-t4-v3", "ready",
                     extra={"/run/gpunode/state.json": json.dumps(record)})
    c = check(report_for(host), "last_boot")
    assert (c.state, c.detail, c.hint) == (
        "warn", "last boot failed at 2026-11-29T08:00:02Z: driver: modprobe nvidia: exit 1",
        "see dmesg")


def test_garbage_boot_record_is_a_warning(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready", extra={"/run/gpunode/state.json": "{not json"})
    c = check(report_for(host), "last_boot")
    assert c.state == "warn"
    assert c.detail.startswith(f"boot record unreadable: {host.root}/run/gpunode/state.json: "
                               "not JSON")


def test_missing_sysfs_is_not_mistaken_for_a_cpu_node(tmp_path: Path) -> None:
    report = report_for(Host(tmp_path))
    assert report.verdict == "not-ready"
    c = check(report, "pci_scan")
    assert (c.state, c.detail) == ("fail", f"{tmp_path}/sys/bus/pci/devices: does not exist; is "
                                   "sysfs mounted (and --root the node's root)?")


def test_unreadable_vendor_of_a_non_nvidia_function_is_a_warning(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready")
    (host.root / "sys/devices/pcic3c1:00/c3c1:00:02.0/vendor").unlink()
    c = check(report_for(host), "pci_scan")
    assert (c.state, c.detail) == ("warn", "c3c1:00:02.0: no 'vendor' attribute; cannot tell "
                                   "whether it is NVIDIA")


def test_garbage_class_of_an_nvidia_function_fails(make_host: HostFactory) -> None:
    host = make_host("nc4as-t4-v3", "ready",
                     extra={"/sys/devices/pci0001:00/0001:00:00.0/class": "0xZZ\n"})
    report = report_for(host)
    assert report.verdict == "not-ready"
    assert check(report, "pci_scan").state == "fail"


def test_flatcar_read_only_config_gets_the_writable_copy_hint(make_host: HostFactory) -> None:
    c = check(report_for(make_host("nc4as-t4-v3", "driver")), "containerd_runtime")
    assert c.detail.startswith("no 'nvidia' runtime in /usr/share/containerd/config.toml")
    assert c.hint is not None
    assert c.hint.startswith("/usr/share/containerd/config.toml is on read-only /usr")


def test_under_a_root_a_changed_config_is_not_called_a_pending_restart(
    make_host: HostFactory,
) -> None:
    """Only systemd can say when containerd started (tests/unit/test_status_restart.py)."""
    host = make_host("nc4as-t4-v3", "ready")
    (host.root / "etc/containerd/config.toml").touch()  # now: long after the fixture's boot
    c = check(report_for(host), "containerd_running")
    assert c.state == "ok"
    assert "cannot tell whether a restart is pending" in c.detail


def test_a_gpu_whose_vendor_is_garbage_makes_the_gpus_row_undecided(
    make_host: HostFactory,
) -> None:
    host = make_host("nc4as-t4-v3", "ready",
                     extra={"/sys/devices/pci0001:00/0001:00:00.0/vendor": "zz\n"})
    report = report_for(host)
    assert report.verdict == "not-ready"
    c = check(report, "gpus")
    assert (c.state, c.detail) == ("fail", "GPU detection undecided: cannot tell whether "
                                   "0001:00:00.0 is an NVIDIA GPU: 0001:00:00.0: 'vendor' is "
                                   "'zz', expected 0x and 4 hex digits; cannot tell whether it "
                                   "is NVIDIA")
    assert check(report, "driver").detail == "GPU detection undecided (see gpus)"


def test_a_root_without_a_pci_tree_makes_the_gpus_row_undecided(tmp_path: Path) -> None:
    c = check(report_for(Host(tmp_path)), "gpus")
    assert (c.state, c.detail) == ("fail", "GPU detection undecided: cannot look for NVIDIA "
                                   f"GPUs: {tmp_path}/sys/bus/pci/devices: does not exist; is "
                                   "sysfs mounted (and --root the node's root)?")
