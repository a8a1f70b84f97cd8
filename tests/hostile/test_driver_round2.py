"""Hostile inputs from the second adversarial run: PCI attributes and driver files that status
and boot used to judge differently, boot records with numbers JSON has not, a broken kubeconfig,
and `label`'s output forms.

Each case is one bad input; status, boot and the driver commands give one answer for it:
- a GPU's PCI `device` id unreadable: the driver flavour cannot be chosen (open or proprietary
  follows the generation), so with driver.flavour "auto" status fails pci_scan and boot and
  `driver load` fail naming the GPU; with the flavour pinned, status warns and boot goes on;
- a GPU's `numa_node` unreadable: cosmetic, status warns and boot goes on;
- a GPU whose driver information file gives no Device Minor: /dev/nvidiaN can be neither made
  nor checked, so status's device_nodes and the driver step fail naming the GPU.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from conftest import HostFactory
from gpunode.platform import records
from hostile.support import Cli, Result, check_refusal

GPU = "0001:00:00.0"
PCI = f"sys/devices/pci0001:00/{GPU}"
INFORMATION = f"proc/driver/nvidia/gpus/{GPU}/information"
STATE = "run/gpunode/state.json"
KUBECONFIG = "etc/kubernetes/kubelet.conf"


def _write(path: str, text: str) -> Callable[[Path], None]:
    def write(root: Path) -> None:
        (root / path).write_text(text)

    return write


def _remove(path: str) -> Callable[[Path], None]:
    def remove(root: Path) -> None:
        (root / path).unlink()

    return remove


def _node(make_host: HostFactory, mutate: Callable[[Path], None], flavour: str | None = None,
          state: str = "ready") -> Path:
    """A T4 fixture node (toolkit installed) with one bad input."""
    root = make_host("nc4as-t4-v3", state).root
    binary = root / "usr/bin/nvidia-container-runtime"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    if flavour is not None:
        (root / "etc/gpunode").mkdir(parents=True, exist_ok=True)
        (root / "etc/gpunode/config.toml").write_text(f'[driver]\nflavour = "{flavour}"\n')
    mutate(root)
    return root


def _status(cli: Cli, root: Path) -> tuple[Result, dict[str, dict[str, str]]]:
    result = cli("--root", str(root), "status", "--json")
    return result, {c["name"]: c for c in json.loads(result.out)["checks"]}


def _boot_failures(result: Result) -> dict[str, str]:
    return {str(e["step"]): str(e["error"]) for e in result.events
            if e.get("event") == "step.failed"}


BAD_DEVICE_IDS = {
    "garbage": "0xzz\n",
    "empty": "",
    "huge": "0x" + "1" * 100_000 + "\n",
}


@pytest.mark.parametrize("value", BAD_DEVICE_IDS.values(), ids=BAD_DEVICE_IDS.keys())
def test_an_unreadable_gpu_device_id_fails_status_boot_and_driver_load_alike(
        value: str, make_host: HostFactory, cli: Cli) -> None:
    root = _node(make_host, _write(f"{PCI}/device", value))
    status, checks = _status(cli, root)
    assert status.code == 1 and checks["pci_scan"]["state"] == "fail", checks["pci_scan"]
    assert "driver.flavour" in checks["pci_scan"]["hint"]
    assert "None" not in checks["gpus"]["detail"], checks["gpus"]  # not "10de:None"
    check_refusal(cli, root, ["--root", str(root), "driver", "load"], 1,
                  rf"cannot choose the driver flavour: the PCI device id of the GPU at {GPU}.*"
                  "driver.flavour")
    boot = cli("--root", str(root), "boot")
    assert boot.code == 1, boot.err
    assert GPU in _boot_failures(boot)["driver"], boot.err
    driver = cli("--root", str(root), "driver", "status", "--json")
    assert driver.code == 1 and "driver flavour" in json.loads(driver.out)["plan_error"]


def test_an_unreadable_gpu_device_id_only_warns_when_the_flavour_is_pinned(
        make_host: HostFactory, cli: Cli) -> None:
    root = _node(make_host, _write(f"{PCI}/device", "0xzz\n"), flavour="proprietary")
    status, checks = _status(cli, root)
    assert (status.code, checks["pci_scan"]["state"]) == (0, "warn"), checks["pci_scan"]
    boot = cli("--root", str(root), "boot")
    assert (boot.code, _boot_failures(boot)) == (0, {}), boot.err


BAD_NUMA = {"garbage": "zz\n", "empty": "", "huge": "9" * 40 + "\n"}


@pytest.mark.parametrize("value", BAD_NUMA.values(), ids=BAD_NUMA.keys())
def test_an_unreadable_numa_node_is_a_warning_and_boot_goes_on(
        value: str, make_host: HostFactory, cli: Cli) -> None:
    root = _node(make_host, _write(f"{PCI}/numa_node", value))
    status, checks = _status(cli, root)
    assert checks["pci_scan"]["state"] == "warn", checks["pci_scan"]
    assert "numa_node" in checks["pci_scan"]["detail"]
    assert status.code == 0, [c for c in checks.values() if c["state"] == "fail"]
    boot = cli("--root", str(root), "boot")
    assert (boot.code, _boot_failures(boot)) == (0, {}), boot.err


NO_MINOR = {
    "empty": (_write(INFORMATION, ""), "is empty"),
    "garbage": (_write(INFORMATION, "zzz garbage\n\x01\x02\n"), "has no 'Device Minor' line"),
    "missing": (_remove(INFORMATION), "is missing"),
    "minor-not-a-number": (_write(INFORMATION, "Model: Tesla T4\nDevice Minor: x\n"),
                           "'Device Minor' is 'x'"),
}


@pytest.mark.parametrize("name", NO_MINOR)
def test_a_gpu_without_a_known_device_minor_fails_device_nodes_and_the_driver_step(
        name: str, make_host: HostFactory, cli: Cli) -> None:
    mutate, said = NO_MINOR[name]
    root = _node(make_host, mutate)
    status, checks = _status(cli, root)
    assert status.code == 1 and checks["device_nodes"]["state"] == "fail", checks
    assert GPU in checks["device_nodes"]["detail"] and said in checks["device_nodes"]["detail"]
    check_refusal(cli, root, ["--root", str(root), "driver", "load"], 1,
                  rf"gpus/{GPU}/information {said}|information: {said}")
    boot = cli("--root", str(root), "boot")
    assert boot.code == 1 and GPU in _boot_failures(boot)["driver"], boot.err


NOT_FINITE = {"nan": "NaN", "infinity": "Infinity", "minus-infinity": "-Infinity",
              "overflow": "1e999"}


@pytest.mark.parametrize("number", NOT_FINITE.values(), ids=NOT_FINITE.keys())
def test_a_boot_record_with_a_number_json_has_not_is_unreadable(
        number: str, make_host: HostFactory, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "ready").root
    record = json.loads((root / STATE).read_text())
    record["steps"][0]["duration_ms"] = 0.5
    (root / STATE).write_text(json.dumps(record).replace("0.5", number, 1))
    _, checks = _status(cli, root)
    assert checks["last_boot"]["state"] == "warn", checks["last_boot"]
    assert f"not JSON ({number}" in checks["last_boot"]["detail"]


@pytest.mark.parametrize("text", ['{"a": NaN}', '[Infinity]', '{"a": -1e400}',
                                  "[" + "1" * 5000 + "]"],
                         ids=["nan", "infinity", "overflow", "integer-too-long"])
def test_every_record_reader_refuses_numbers_json_has_not(text: str) -> None:
    with pytest.raises(ValueError, match=r"^ledger: not JSON \("):
        records.loads_json(text, "ledger")


def test_a_broken_kubeconfig_says_to_fix_or_regenerate_it_not_to_wait(
        make_host: HostFactory, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "ready").root
    (root / KUBECONFIG).parent.mkdir(parents=True, exist_ok=True)
    (root / KUBECONFIG).write_text("::: not yaml [\n")
    _, checks = _status(cli, root)
    assert "has no 'contexts' list" in checks["node"]["detail"], checks["node"]
    assert "regenerate" in checks["node"]["hint"] and "retries" not in checks["node"]["hint"]
    check_refusal(cli, root, ["--root", str(root), "label"], 1,
                  r"kubelet.conf: has no 'contexts' list.*fix .*kubelet.conf or regenerate it "
                  r"\(kubeadm writes")


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "apply"])
def test_label_json_on_a_node_without_a_gpu_is_a_json_document(
        dry_run: bool, make_host: HostFactory, cli: Cli) -> None:
    root = make_host("azure-d4s-v5", "bare").root
    result = cli("--root", str(root), "label", "--json", *(["--dry-run"] if dry_run else []))
    assert result.code == 0, result.err
    document = json.loads(result.out)
    assert (document["schema_version"], document["gpu"], document["labels"]) == (1, False, {})
    assert document["message"] == "no NVIDIA GPU: nothing to label"
    assert ("calls" in document) is not dry_run


def test_label_json_on_a_gpu_node_says_it_has_a_gpu(make_host: HostFactory, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "ready").root
    document = json.loads(cli("--root", str(root), "label", "--dry-run", "--json").out)
    assert document["gpu"] is True and document["labels"]["nvidia.com/gpu.present"] == "true"


@pytest.mark.parametrize("form", ["cluster-azure", "kubeadm", "kubelet-flags"])
def test_registration_json_is_the_yaml_document_as_json(
        form: str, make_host: HostFactory, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "ready").root
    plain = cli("--root", str(root), "label", "--registration", form)
    as_json = cli("--root", str(root), "label", "--registration", form, "--json")
    assert plain.code == as_json.code == 0, (plain.err, as_json.err)
    expected = plain.out.split() if form == "kubelet-flags" else yaml.safe_load(plain.out)
    assert json.loads(as_json.out) == expected


BAD_POOL_FLAGS = {
    "empty-pool": (["--pool", ""], r"--pool '': a cluster-azure node pool name is 5-20 lower"),
    "pool-with-space": (["--pool", "bad pool!"], r"--pool 'bad pool!': a cluster-azure node"),
    "pool-uppercase": (["--pool", "GPU00"], r"--pool 'GPU00': a cluster-azure node pool name"),
    "pool-4-chars": (["--pool", "gpu0"], r"--pool 'gpu0': .*chart's schema"),
    "pool-21-chars": (["--pool", "g" * 21], r"--pool 'g{21}': a cluster-azure node pool name"),
    "pool-5000-chars": (["--pool", "a" * 5000], r"\(5000 characters\): a cluster-azure node"),
    "empty-instance-type": (["--instance-type", ""], r"--instance-type '': an instance type"),
    "instance-type-newline": (["--instance-type", "Standard\nX"], r"an instance type is"),
}


@pytest.mark.parametrize("flags", [v[0] for v in BAD_POOL_FLAGS.values()], ids=BAD_POOL_FLAGS)
def test_a_bad_pool_or_instance_type_is_a_usage_error(
        flags: list[str], make_host: HostFactory, cli: Cli) -> None:
    pattern = next(p for f, p in BAD_POOL_FLAGS.values() if f == flags)
    root = make_host("nc4as-t4-v3", "ready").root
    result = check_refusal(cli, root, ["--root", str(root), "label", "--registration",
                                       "cluster-azure", *flags], 2, pattern)
    assert result.out == ""


@pytest.mark.parametrize("argv", [["--registration", "kubeadm", "--pool", "gpu"],
                                  ["--dry-run", "--instance-type", "Standard_NC4as_T4_v3"]],
                         ids=["pool-with-kubeadm", "instance-type-without-registration"])
def test_pool_flags_are_refused_where_nothing_takes_them(
        argv: list[str], make_host: HostFactory, cli: Cli) -> None:
    root = make_host("nc4as-t4-v3", "ready").root
    check_refusal(cli, root, ["--root", str(root), "label", *argv], 2,
                  r"only --registration cluster-azure takes it")
